"""The read-write lock across real processes (spawned), on every database.

Exclusion is checked by a ledger file every holder updates under ``flock``
inside its critical section (see tests/support/rw_procs.py): a writer
entering while anyone is inside, or anyone entering while a writer is, is a
violation, and so is a writer's fence not above every earlier fence.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from dblock import LockManager
from tests.support import rw_procs
from tests.support.rw_procs import Ledger

ctx = multiprocessing.get_context("spawn")


@pytest.fixture(autouse=True)
def _quiet_children(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")


def _join(workers: list[Any], bound: float = 300) -> None:
    for w in workers:
        w.join(bound)
    for w in workers:
        if w.is_alive():
            w.kill()
    assert [w.exitcode for w in workers] == [0] * len(workers)


def test_hammering_processes_never_overlap_a_writer(db_url: str, key: str, tmp_path: Path) -> None:
    """4 processes x 3 threads take the read or write lock of one key at
    random (a third writes): no writer ever overlaps anyone, readers do
    overlap each other, and fences grow."""
    ledger = Ledger(str(tmp_path / "ledger.json"))
    ledger.reset()
    go = ctx.Event()
    workers = [
        ctx.Process(target=rw_procs.hammer, args=(db_url, key, ledger.path, 3, 25, 0.3, go))
        for _ in range(4)
    ]
    for w in workers:
        w.start()
    go.set()
    _join(workers)
    state = ledger.read()
    assert state["violations"] == []
    assert state["reads"] + state["writes"] == 4 * 3 * 25
    assert state["writes"] > 0
    assert state["max_readers"] >= 2  # readers did share
    assert (state["readers"], state["writers"]) == (0, 0)


def test_writer_is_not_starved_by_looping_readers(db_url: str, key: str, tmp_path: Path) -> None:
    """8 reader processes take the read lock in a loop, each hold overlapping
    the others'; a writer asking meanwhile gets in, while they still loop."""
    ledger = Ledger(str(tmp_path / "ledger.json"))
    ledger.reset()
    stop, started = ctx.Event(), ctx.Semaphore(0)
    readers = [
        ctx.Process(target=rw_procs.reader_loop, args=(db_url, key, ledger.path, stop, started))
        for _ in range(8)
    ]
    for r in readers:
        r.start()
    try:
        for _ in readers:
            assert started.acquire(timeout=120)  # every reader is looping
        with LockManager(db_url) as m, m.write_lock(key, timeout=120) as w:
            ledger.enter("write", "the writer", w.fence)
            ledger.leave("write")
        reads_at_write = ledger.read()["reads"]
        # The readers were still looping when the writer got in, and go on.
        before = reads_at_write
        deadline_reads = before + 8
        for _ in range(600):
            if ledger.read()["reads"] >= deadline_reads:
                break
            stop.wait(0.05)
        assert ledger.read()["reads"] >= deadline_reads
    finally:
        stop.set()
        _join(readers)
    state = ledger.read()
    assert state["violations"] == []
    assert state["max_readers"] >= 2


@pytest.mark.parametrize("mode", ["read", "write"])
def test_killed_holder_is_taken_over_after_its_lease(db_url: str, key: str, mode: str) -> None:
    """kill -9 of a process holding the read (or write) lock: a writer (or
    reader) of another process gets the key once the dead holder's lease ends."""
    report = ctx.Queue()
    holder = ctx.Process(target=rw_procs.hold_rw, args=(db_url, key, mode, 1.5, report))
    holder.start()
    try:
        dead_fence = report.get(timeout=120)
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # type: ignore[arg-type]
        holder.join(10)
    assert holder.exitcode == -signal.SIGKILL
    other = "write" if mode == "read" else "read"
    with LockManager(db_url) as m:
        request = m.write_lock if other == "write" else m.read_lock
        with request(key, timeout=60) as held:
            assert held.fence > dead_fence


def test_readers_of_processes_overlap_and_writer_waits(
    db_url: str, key: str, tmp_path: Path
) -> None:
    """Readers of two processes are inside at once; a writer in a third
    process asking meanwhile gets in only after both left."""
    ledger = Ledger(str(tmp_path / "ledger.json"))
    ledger.reset()
    report = ctx.Queue()
    readers = [
        ctx.Process(target=rw_procs.read_then_report, args=(db_url, key, 1.0, report, ledger.path))
        for _ in range(2)
    ]
    for r in readers:
        r.start()
    try:
        fences = [report.get(timeout=120)[2] for _ in readers]
        with LockManager(db_url) as m, m.write_lock(key, timeout=120) as w:
            ledger.enter("write", "the writer", w.fence)
            ledger.leave("write")
            assert w.fence > max(fences)
    finally:
        _join(readers)
    state = ledger.read()
    assert state["violations"] == []
    assert state["max_readers"] == 2
