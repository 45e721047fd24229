"""Memory: level 1 after many distinct keys have come and gone.

Two runs, each in a fresh spawned process:

* the registry alone (the exact level-1 code the lock uses), under
  ``tracemalloc``: keys are claimed in bursts of ``burst`` held at once (so
  the map grows well past its shrink threshold) and then all left; we compare
  what is still allocated afterwards with the baseline taken after one
  warm-up burst, both in total and for the lines of ``registry.py``;
* the whole lock on a SQLite file, every key acquired and released through
  ``LockManager``: resident memory (RSS) and the registry's size before and
  after. tracemalloc is off here: it would double the run time, and RSS is
  what an operator sees.
"""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import os
import resource
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from dblock import LockManager
from dblock._hooks import Registry, new_registry, registry_dict_bytes, registry_of

__all__ = ["MemoryResult", "run_memory"]


@dataclasses.dataclass
class MemoryResult:
    what: str
    keys: int
    burst: int
    seconds: float
    traced_before: int  # bytes, tracemalloc (registry run only)
    traced_after: int
    registry_before: int  # bytes allocated by registry.py lines still alive
    registry_after: int
    peak_traced: int
    rss_before: int  # bytes
    rss_after: int
    rss_peak: int
    entries_after: int
    dict_bytes_before: int
    dict_bytes_after: int


def run_memory(
    kind: str, keys: int, burst: int, url: str | None = None, table: str | None = None
) -> MemoryResult:
    ctx = multiprocessing.get_context("spawn")
    out: Any = ctx.Queue()
    proc = ctx.Process(
        target=_child, args=(kind, keys, burst), kwargs={"url": url, "table": table, "out": out}
    )
    proc.start()
    try:
        result: MemoryResult = out.get(timeout=3600)
    finally:
        proc.join(30)
    return result


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _child(
    kind: str, keys: int, burst: int, *, url: str | None, table: str | None, out: Any
) -> None:
    if kind == "registry":
        out.put(_registry_run(keys, burst))
    else:
        out.put(_lock_run(keys, burst, url, table))


def _bursts(keys: int, burst: int, step: Callable[[list[str]], None]) -> None:
    for b in range(keys // burst):
        step([f"memory:{b}:{j}" for j in range(burst)])


def _registry_run(keys: int, burst: int) -> MemoryResult:
    registry = new_registry()
    me = object()

    def step(names: list[str]) -> None:
        entries = [registry.claim(k, me) for k in names]
        for e in entries:
            assert e is not None
            registry.leave(e)

    tracemalloc.start()
    step([f"warm-up:{j}" for j in range(burst)])
    gc.collect()
    before = tracemalloc.take_snapshot()
    traced_before = tracemalloc.get_traced_memory()[0]
    dict_before = registry_dict_bytes(registry)
    rss_before = _rss()
    tracemalloc.reset_peak()
    t0 = time.monotonic()
    _bursts(keys, burst, step)
    seconds = time.monotonic() - t0
    gc.collect()
    after = tracemalloc.take_snapshot()
    traced_after, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return MemoryResult(
        what="registry alone (tracemalloc)",
        keys=keys,
        burst=burst,
        seconds=seconds,
        traced_before=traced_before,
        traced_after=traced_after,
        registry_before=_registry_bytes(before),
        registry_after=_registry_bytes(after),
        peak_traced=peak,
        rss_before=rss_before,
        dict_bytes_before=dict_before,
        **_after(registry),
    )


def _after(registry: Registry) -> dict[str, int]:
    """The end-of-run measures both runs take, once every key is gone."""
    return {
        "rss_after": _rss(),
        "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "entries_after": len(registry),
        "dict_bytes_after": registry_dict_bytes(registry),
    }


def _registry_bytes(snapshot: tracemalloc.Snapshot) -> int:
    only = snapshot.filter_traces([tracemalloc.Filter(True, "*dblock/registry.py")])
    return sum(stat.size for stat in only.statistics("filename"))


def _lock_run(keys: int, burst: int, url: str | None, table: str | None) -> MemoryResult:
    manager = LockManager(url, table=table or "dblock_locks")
    registry = registry_of(manager)
    acquire = manager.acquire

    def step(names: list[str]) -> None:
        held = [acquire(k, blocking=False) for k in names]
        for h in held:
            h.release()

    step([f"warm-up:{j}" for j in range(burst)])
    gc.collect()
    rss_before = _rss()
    dict_before = registry_dict_bytes(registry)
    t0 = time.monotonic()
    _bursts(keys, burst, step)
    seconds = time.monotonic() - t0
    gc.collect()
    result = MemoryResult(
        what="LockManager on SQLite (RSS)",
        keys=keys,
        burst=burst,
        seconds=seconds,
        traced_before=0,
        traced_after=0,
        registry_before=0,
        registry_after=0,
        peak_traced=0,
        rss_before=rss_before,
        dict_bytes_before=dict_before,
        **_after(registry),
    )
    manager.close()
    return result
