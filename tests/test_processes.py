"""Behaviour across real processes (spawned: nothing inherited but arguments)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from dblock import LockManager
from tests.conftest import row_of
from tests.support import procs

ctx = multiprocessing.get_context("spawn")

PROCESSES = 3
THREADS = 4
ROUNDS = 8


def _run_incrementers(db_url: str, key: str, name: str, use_lock: bool) -> int:
    procs.reset_counter(db_url, name)
    go = ctx.Event()
    workers = [
        ctx.Process(
            target=procs.increment_worker,
            args=(db_url, key, name, THREADS, ROUNDS, use_lock, go),
        )
        for _ in range(PROCESSES)
    ]
    for w in workers:
        w.start()
    go.set()
    for w in workers:
        w.join(300)
        assert w.exitcode == 0
    return procs.read_counter(db_url, name)


def test_cross_process_read_modify_write_is_exact(db_url: str, key: str) -> None:
    """Processes x threads each read a counter row, wait, write it back + 1,
    inside the lock: no update is lost."""
    expected = PROCESSES * THREADS * ROUNDS
    assert _run_incrementers(db_url, key, key, use_lock=True) == expected


@pytest.mark.databases("postgresql")
def test_control_without_lock_loses_updates(db_url: str, key: str) -> None:
    """The same workload without the lock loses updates, so the test above
    would notice a lock that does not exclude."""
    expected = PROCESSES * THREADS * ROUNDS
    assert _run_incrementers(db_url, key, key, use_lock=False) < expected


def test_killed_holder_is_taken_over_after_its_lease(db_url: str, key: str) -> None:
    report = ctx.Queue()
    holder = ctx.Process(target=procs.hold_forever, args=(db_url, key, 1.5, report))
    holder.start()
    try:
        dead_fence = report.get(timeout=60)
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # type: ignore[arg-type]
        holder.join(10)
    assert holder.exitcode == -signal.SIGKILL
    with LockManager(db_url) as m:
        row = row_of(m, key)
        assert row is not None  # the dead holder's row is still there
        start = time.monotonic()
        with m.lock(key, timeout=30) as held:
            waited = time.monotonic() - start
            assert held.fence > dead_fence
            assert row_of(m, key).token == held.token  # type: ignore[union-attr]
    # Blocked for at most the lease (1.5 s from the holder's acquisition).
    assert waited < 1.5 + 2.0


def test_stale_holder_process_loses_to_new_owner(db_url: str, key: str) -> None:
    """A process holding past its lease learns it lost the lock on release,
    and its release does not delete the new owner's row."""
    report = ctx.Queue()
    slow = ctx.Process(target=procs.hold_for, args=(db_url, key, 0.5, 1.5, report))
    slow.start()
    try:
        assert report.get(timeout=60)[0] == "acquired"
        with LockManager(db_url) as m, m.lock(key, timeout=30) as held:
            assert report.get(timeout=30)[0] == "releasing"
            slow.join(30)
            # The stale holder raised LockLost from its with-block.
            assert slow.exitcode == 1
            row = row_of(m, key)
            assert row is not None
            assert row.token == held.token
    finally:
        if slow.is_alive():
            slow.kill()


@pytest.fixture(autouse=True)
def _quiet_children(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
