"""Hot key: P processes x T threads all asking for one key.

Each configuration runs in fresh spawned processes, every thread looping
until the time is up: request the key (fail-fast, or waiting), hold it for
``hold`` seconds, release; a fail-fast thread that is refused tries again
after ``retry_after``. Compared: dblock as it is, and the same lock with
level 1 turned off (``local_filter=False``: every thread goes to the
database). Reported: grants per second, SQL statements per grant (counted in
every process with a ``before_cursor_execute`` listener on the manager's
engine, from the start signal to the end) and the wait of granted requests.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
import uuid
from typing import Any

from dblock import BackendError, LockBusy, LockManager, LockTimeout

from .counting import count_statements
from .procs import Start, run_together
from .stats import percentile

__all__ = ["HotKeyResult", "HotKeySpec", "run_hot_key"]

_monotonic = time.monotonic


@dataclasses.dataclass(frozen=True, kw_only=True)
class HotKeySpec:
    database: str
    url: str
    table: str
    label: str  # "dblock", "level 2 only", or a variant's name
    options: tuple[tuple[str, Any], ...]
    blocking: bool
    processes: int
    threads: int
    seconds: float
    hold: float
    retry_after: float
    # A cluster's nodes: worker process n connects to urls[n % len(urls)].
    urls: tuple[str, ...] = ()
    # Requests ask with fair=True (the fair queue).
    fair: bool = False

    @property
    def mode(self) -> str:
        return "waiting" if self.blocking else "fail-fast"


@dataclasses.dataclass
class HotKeyResult:
    database: str
    mode: str
    label: str
    level1: bool
    processes: int
    threads: int
    seconds: float
    grants: int
    grants_per_s: float
    statements: int
    statements_per_grant: float
    refused_level1: int
    refused_level2: int
    timeouts: int
    errors: int
    wait_p50_ms: float
    wait_p99_ms: float
    max_concurrent: int  # most holders ever inside at once in one process (must be 1)
    hold: float = 0.0  # the critical section, seconds


@dataclasses.dataclass
class _Tally:
    grants: int = 0
    refused_level1: int = 0
    refused_level2: int = 0
    timeouts: int = 0
    errors: int = 0
    waits: list[float] = dataclasses.field(default_factory=list)


def run_hot_key(spec: HotKeySpec) -> HotKeyResult:
    key = f"bench:hot:{uuid.uuid4().hex[:10]}"
    parts = run_together(_worker, (spec, key), processes=spec.processes, timeout=spec.seconds + 180)
    return _combine(spec, parts)


def _combine(spec: HotKeySpec, parts: list[dict[str, Any]]) -> HotKeyResult:
    waits = [w for p in parts for w in p["waits"]]
    grants = sum(p["grants"] for p in parts)
    statements = sum(p["statements"] for p in parts)
    elapsed = max(p["elapsed"] for p in parts)
    return HotKeyResult(
        database=spec.database,
        mode=spec.mode,
        label=spec.label,
        level1=dict(spec.options).get("local_filter", True),
        processes=spec.processes,
        threads=spec.threads,
        seconds=elapsed,
        grants=grants,
        grants_per_s=grants / elapsed if elapsed else 0.0,
        statements=statements,
        statements_per_grant=statements / grants if grants else float("inf"),
        refused_level1=sum(p["refused_level1"] for p in parts),
        refused_level2=sum(p["refused_level2"] for p in parts),
        timeouts=sum(p["timeouts"] for p in parts),
        errors=sum(p["errors"] for p in parts),
        wait_p50_ms=percentile(waits, 50) * 1e3,
        wait_p99_ms=percentile(waits, 99) * 1e3,
        max_concurrent=max(p["max_concurrent"] for p in parts),
        hold=spec.hold,
    )


def _node_url(spec: HotKeySpec, start: Start) -> str:
    """This worker's URL: on a cluster, the workers take the nodes in turn."""
    if not spec.urls:
        return spec.url
    with start.counter.get_lock():
        n = int(start.counter.value)
        start.counter.value += 1
    return spec.urls[n % len(spec.urls)]


def _worker(spec: HotKeySpec, key: str, start: Start) -> None:
    manager = LockManager(_node_url(spec, start), table=spec.table, **dict(spec.options))
    tallies = [_Tally() for _ in range(spec.threads)]
    inside = 0
    most_inside = 0
    inside_lock = threading.Lock()
    blocking, hold, retry = spec.blocking, spec.hold, spec.retry_after
    # A fail-fast request takes no timeout.
    lock = functools.partial(manager.lock, timeout=60.0) if blocking else manager.lock

    def run(tally: _Tally, deadline: float) -> None:
        nonlocal inside, most_inside
        waits = tally.waits
        while _monotonic() < deadline:
            t0 = _monotonic()
            try:
                with lock(key, blocking=blocking, fair=spec.fair):
                    waits.append(_monotonic() - t0)
                    with inside_lock:
                        inside += 1
                        most_inside = max(most_inside, inside)
                    if hold:
                        time.sleep(hold)
                    with inside_lock:
                        inside -= 1
            except LockBusy as exc:
                if exc.level == 1:
                    tally.refused_level1 += 1
                else:
                    tally.refused_level2 += 1
                time.sleep(retry)
            except LockTimeout:
                tally.timeouts += 1
            except BackendError:
                tally.errors += 1
                time.sleep(0.01)
        tally.grants = len(waits)

    with count_statements(manager.engine) as counter:
        # One lock cycle per process before the start, so the connection
        # pool and (on PostgreSQL) prepared statements are warm.
        with manager.lock(f"{key}:warm-up:{uuid.uuid4().hex[:6]}"):
            pass
        start.ready.put(True)
        start.go.wait()
        counter.reset()
        began = _monotonic()
        deadline = began + spec.seconds
        pool = [
            threading.Thread(target=run, args=(t, deadline), name=f"hot-{i}")
            for i, t in enumerate(tallies)
        ]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        elapsed = _monotonic() - began
        statements = counter.count
    manager.close()
    start.results.put(
        {
            "grants": sum(t.grants for t in tallies),
            "refused_level1": sum(t.refused_level1 for t in tallies),
            "refused_level2": sum(t.refused_level2 for t in tallies),
            "timeouts": sum(t.timeouts for t in tallies),
            "errors": sum(t.errors for t in tallies),
            "waits": [w for t in tallies for w in t.waits],
            "statements": statements,
            "elapsed": elapsed,
            "max_concurrent": most_inside,
        }
    )
