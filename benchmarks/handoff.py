"""Hand-off across processes: from release in one process to acquisition in another.

Two spawned processes take turns on one key. Each acquires it (waiting),
holds it for ``hold`` seconds, notes the time just before ``release()`` and
releases, then asks again only once the other process has acquired it (a
shared counter says so). So at every release the other process has been
waiting on the database for about ``hold`` seconds, as a real waiter would.
``time.monotonic`` is one system-wide clock on Linux, so times taken in the
two processes compare directly. A hand-off is an acquisition following a
release by the other process; its latency is the time between the two.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
import uuid

from dblock import LockManager

from .procs import Start, run_together
from .stats import percentile

__all__ = ["HandoffResult", "HandoffSpec", "run_handoff"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class HandoffSpec:
    database: str
    url: str
    table: str
    label: str  # how the waiter learns of the release
    notify: bool
    handoffs: int
    hold: float


@dataclasses.dataclass
class HandoffResult:
    database: str
    label: str
    notify: bool  # the waiters were woken (True) or polled (False)
    handoffs: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    overlaps: int  # an acquisition before the previous holder's release (must be 0)


def run_handoff(spec: HandoffSpec) -> HandoffResult:
    key = f"bench:handoff:{uuid.uuid4().hex[:10]}"
    turns = spec.handoffs // 2 + 1
    parts = run_together(
        _worker, (spec, key, turns), processes=2, timeout=turns * (spec.hold + 5) + 120
    )
    records: list[tuple[int, float, float]] = [r for part in parts for r in part]
    records.sort(key=lambda r: r[1])
    latencies: list[float] = []
    overlaps = 0
    for (pid0, _, released), (pid1, acquired, _) in itertools.pairwise(records):
        if acquired < released:
            overlaps += 1
        elif pid0 != pid1:
            latencies.append(acquired - released)
    return HandoffResult(
        database=spec.database,
        label=spec.label,
        notify=spec.notify,
        handoffs=len(latencies),
        p50_ms=percentile(latencies, 50) * 1e3,
        p90_ms=percentile(latencies, 90) * 1e3,
        p99_ms=percentile(latencies, 99) * 1e3,
        max_ms=max(latencies, default=float("nan")) * 1e3,
        overlaps=overlaps,
    )


def _worker(spec: HandoffSpec, key: str, turns: int, start: Start) -> None:
    manager = LockManager(spec.url, table=spec.table, notify=spec.notify)
    with manager.lock(f"{key}:warm-up:{os.getpid()}"):
        pass
    start.ready.put(True)
    start.go.wait()
    grants = start.counter
    records = []
    pid = os.getpid()
    for turn in range(turns):
        held = manager.acquire(key, timeout=60.0)
        acquired = time.monotonic()
        with grants.get_lock():
            grants.value += 1
            mine = grants.value
        time.sleep(spec.hold)
        released = time.monotonic()
        held.release()
        records.append((pid, acquired, released))
        if turn == turns - 1:
            break  # asking no more: nothing to wait for (the other may be done already)
        # Wait for the other process's grant (it is waiting now), unless it is done.
        give_up = time.monotonic() + 10.0
        while grants.value == mine and time.monotonic() < give_up:
            time.sleep(0.0005)
    manager.close()
    start.results.put(records)
