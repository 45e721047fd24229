"""Many listening processes (PostgreSQL): what each one hears, and what it costs.

``processes`` spawned processes in pairs; the two of a pair take turns on one
key of their own, as the hand-off benchmark's two do (hold it ``hold``
seconds, note the time, release, ask again ``gap`` seconds later), so at every
release of a key the other process of its pair waits for it on the database.
Every process counts, over the same window:

* the notifications its listener dispatched (``Listener.received``): what it
  hears, of its own key and of everybody else's;
* the events of the key it waits for: the releases of its key, its own and
  its partner's (each one notifies: the other side waits);
* the CPU its listener thread spent (``pthread_getcpuclockid``) and the CPU
  of the whole process (``time.process_time``), per second;
* the latency from its partner's release to its own grant
  (``time.monotonic`` is one system-wide clock on Linux).

With one channel per table every process hears every release of the
cluster; with channels per key bucket it should hear its own key's and those
of the few keys that share its bucket. Run by ``scripts/bench-listeners``
(on a private PostgreSQL instance with ``max_connections`` raised); the
suite runs it at smoke size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from dblock import LockLost, LockManager, LockNotAcquired
from dblock._hooks import ListenerView, listener_of

from .procs import Start, run_together
from .stats import percentile

__all__ = ["ListenersResult", "ListenersSpec", "render", "run_listeners"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ListenersSpec:
    url: str
    table: str = "dblock_locks"
    processes: int = 100
    seconds: float = 10.0
    hold: float = 0.100  # each side holds its key this long
    gap: float = 0.025  # and asks again this long after its release (< hold)


@dataclasses.dataclass
class ProcessReport:
    """One process's counts over the measured window."""

    seconds: float
    received: int  # notifications its listener dispatched
    events: int  # releases of its key, both sides
    listener_cpu: float  # seconds of CPU of the listener thread
    process_cpu: float  # seconds of CPU of the whole process
    latencies: list[float]  # partner's release -> our grant, seconds
    buckets: int  # bucket channels its listener listens to at the end (0: one channel)


@dataclasses.dataclass
class ListenersResult:
    processes: int
    seconds: float
    received_per_s: tuple[float, float, float]  # per process: median, p99, max
    events_per_s: float  # median per process: releases of the key it waits for
    ratio: tuple[float, float]  # received / events per process: median, max
    listener_cpu_ms_per_s: tuple[float, float]  # per process: median, max
    process_cpu_ms_per_s: float  # median per process
    us_per_notification: float  # listener CPU per notification received, all processes
    grants: int
    p50_ms: float
    p99_ms: float
    releases_per_s: float  # of the whole cluster
    server_cpu_ms_per_s: float | None  # the server's processes, all together (if known)
    channels: float  # bucket channels a process listens to at the end (median)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


def run_listeners(
    spec: ListenersSpec, server_cpu: Callable[[], float] | None = None
) -> ListenersResult:
    """Run the processes and sum up. ``server_cpu``: the database server's
    CPU seconds so far (all its processes), read over the same window."""
    if spec.processes < 2 or spec.processes % 2:
        raise ValueError("processes must be an even number, at least 2")
    if not 0 < spec.gap < spec.hold:
        raise ValueError("gap must be between 0 and hold")
    run = uuid.uuid4().hex[:8]
    server: list[float] = []

    def sample() -> None:
        assert server_cpu is not None
        time.sleep(1.0)  # the workers' warm-up
        began, cpu = time.monotonic(), server_cpu()
        time.sleep(spec.seconds)
        server.append((server_cpu() - cpu) / (time.monotonic() - began))

    sampler = threading.Thread(target=sample, daemon=True)
    reports: list[tuple[int, ProcessReport]] = run_together(
        _worker,
        (spec, run),
        processes=spec.processes,
        timeout=spec.seconds + 180,
        doubles=spec.processes,
        after_go=sampler.start if server_cpu is not None else None,
    )
    if server_cpu is not None:
        sampler.join(5.0)
    # Both sides of a pair release its key: a key's events are the two's sum.
    releases: dict[int, int] = {}
    for pair, r in reports:
        releases[pair] = releases.get(pair, 0) + r.events
    per_s = sorted(r.received / r.seconds for _, r in reports)
    events = [releases[pair] / r.seconds for pair, r in reports]
    ratios = sorted(r.received / releases[pair] for pair, r in reports if releases[pair] > 0)
    listener_cpu = sorted(r.listener_cpu / r.seconds * 1e3 for _, r in reports)
    latencies = [x for _, r in reports for x in r.latencies]
    received = sum(r.received for _, r in reports)
    window = max(r.seconds for _, r in reports)
    return ListenersResult(
        processes=spec.processes,
        seconds=window,
        received_per_s=(percentile(per_s, 50), percentile(per_s, 99), per_s[-1]),
        events_per_s=percentile(events, 50),
        ratio=(percentile(ratios, 50), max(ratios, default=float("nan"))),
        listener_cpu_ms_per_s=(percentile(listener_cpu, 50), listener_cpu[-1]),
        process_cpu_ms_per_s=percentile([r.process_cpu / r.seconds * 1e3 for _, r in reports], 50),
        us_per_notification=(
            sum(r.listener_cpu for _, r in reports) / received * 1e6 if received else float("nan")
        ),
        grants=len(latencies),
        p50_ms=percentile(latencies, 50) * 1e3,
        p99_ms=percentile(latencies, 99) * 1e3,
        releases_per_s=sum(releases.values()) / window,
        server_cpu_ms_per_s=server[0] * 1e3 if server else None,
        channels=percentile([float(r.buckets) for _, r in reports], 50),
    )


def render(result: ListenersResult) -> str:
    """The result as a Markdown table."""
    r = result
    rows = [
        ("processes (pairs on a key each)", f"{r.processes}"),
        ("releases per second, whole cluster", f"{r.releases_per_s:,.0f}"),
        (
            "notifications heard per process per second (median, p99, max)",
            "{:,.1f} / {:,.1f} / {:,.1f}".format(*r.received_per_s),
        ),
        ("events of the key it waits for, per second (median)", f"{r.events_per_s:,.1f}"),
        ("heard / events of its key (median, max)", "{:.2f} / {:.2f}".format(*r.ratio)),
        (
            "listener thread CPU, ms per second (median, max)",
            "{:.1f} / {:.1f}".format(*r.listener_cpu_ms_per_s),
        ),
        ("process CPU, ms per second (median)", f"{r.process_cpu_ms_per_s:.1f}"),
        ("bucket channels listened to per process (median)", f"{r.channels:g}"),
        (
            "database server CPU, ms per second (all its processes)",
            "?" if r.server_cpu_ms_per_s is None else f"{r.server_cpu_ms_per_s:,.0f}",
        ),
        ("listener CPU per notification heard, µs", f"{r.us_per_notification:.1f}"),
        (
            f"grant latency after the partner's release, p50 / p99 ms ({r.grants} grants)",
            f"{r.p50_ms:.2f} / {r.p99_ms:.2f}",
        ),
    ]
    lines = ["| measure | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def _thread_cpu(thread: threading.Thread | None) -> float:
    if thread is None or thread.ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (OSError, AttributeError):  # ended, or not Linux
        return 0.0


def _worker(spec: ListenersSpec, run: str, start: Start) -> None:
    with start.counter.get_lock():
        index = start.counter.value
        start.counter.value += 1
    pair, side = divmod(index, 2)
    key = f"bench:listeners:{run}:{pair}"
    manager = LockManager(spec.url, table=spec.table, renew=False)
    with manager.lock(f"bench:listeners:{run}:warm-up:{os.getpid()}"):
        pass
    listener = listener_of(manager)
    assert listener is not None, "PostgreSQL only"
    window = _Window(listener)
    start.ready.put(True)
    start.go.wait()
    # Side 0 takes the key first (not before the others are ready: a
    # hundred processes can take longer to start than a lease lasts).
    held = manager.acquire(key) if side == 0 else None
    if side == 1:
        time.sleep(spec.gap)
    released_at = _Mailbox(start.shared, pair)
    # Warm up for a second (every process waiting, every listener listening),
    # then measure; the last turn's holder releases and nobody asks again.
    measure_from = time.monotonic() + 1.0
    measure_to = measure_from + spec.seconds
    last_grant = 0.0
    while (now := time.monotonic()) < measure_to:
        if not window.open and now >= measure_from:
            window.start()
        if held is None:
            try:
                held = manager.acquire(key, timeout=max(0.1, measure_to - now))
            except LockNotAcquired:
                break
            granted = time.monotonic()
            theirs = released_at.get(1 - side)
            if theirs > last_grant:  # a turn handed over by the partner, not our own retake
                window.latencies.append(granted - theirs)
            last_grant = granted
        time.sleep(spec.hold)
        released_at.put(side, time.monotonic())
        with contextlib.suppress(LockLost):  # a machine too loaded to keep the lease
            held.release()
        held = None
        window.events += 1
        time.sleep(spec.gap)
    start.results.put((pair, window.report()))
    # Stay a moment: the partner's last wait ends on its timeout, not on
    # a connection that went away under it.
    time.sleep(1.0)
    manager.close()


class _Window:
    """One process's counters, from :meth:`start` to :meth:`report`."""

    def __init__(self, listener: ListenerView) -> None:
        self.listener = listener
        self.open = False
        self.events = 0
        self.latencies: list[float] = []
        self._since = self._received = 0.0
        self._cpu = self._process = 0.0

    def start(self) -> None:
        self.open = True
        self.events = 0
        self.latencies.clear()
        self._since = time.monotonic()
        self._received = self.listener.received
        self._cpu = _thread_cpu(self.listener.thread)
        self._process = time.process_time()

    def report(self) -> ProcessReport:
        return ProcessReport(
            seconds=time.monotonic() - self._since,
            received=int(self.listener.received - self._received),
            events=self.events,
            listener_cpu=_thread_cpu(self.listener.thread) - self._cpu,
            process_cpu=time.process_time() - self._process,
            latencies=list(self.latencies),
            buckets=self.listener.buckets,
        )


class _Mailbox:
    """The last release time of each side of one pair, in shared memory."""

    def __init__(self, array: Any, pair: int) -> None:
        self._array = array
        self._base = 2 * pair

    def put(self, side: int, value: float) -> None:
        self._array[self._base + side] = value

    def get(self, side: int) -> float:
        return float(self._array[self._base + side])
