"""Level 1: what never reaches the database, and memory that follows keys in use."""

from __future__ import annotations

import gc
import threading
import time
import tracemalloc

import pytest
import sqlalchemy as sa

from dblock import LockBusy, LockLost, LockManager
from dblock.registry import Entry, Registry
from tests.conftest import row_of, wait_queued
from tests.support.counting import StatementCounter


def test_uncontended_acquire_and_release_are_one_statement_each(
    manager: LockManager, key: str
) -> None:
    with manager.lock(key):  # warm up: first connection, dialect detection
        pass
    with StatementCounter(manager.engine) as c:
        held = manager.acquire(key)
        assert c.count == 1
        held.release()
        assert c.count == 2


def test_reentrant_acquire_sends_no_sql(manager: LockManager, key: str) -> None:
    with manager.lock(key), StatementCounter(manager.engine) as c:
        for _ in range(100):
            with manager.lock(key), manager.lock(key, blocking=False):
                pass
        assert c.count == 0


def test_fail_fast_refusal_at_level_1_sends_no_sql(manager: LockManager, key: str) -> None:
    refusals: list[int] = []
    with manager.lock(key), StatementCounter(manager.engine) as c:

        def other() -> None:
            for _ in range(100):
                try:
                    manager.acquire(key, blocking=False)
                except LockBusy as exc:
                    refusals.append(exc.level)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert c.count == 0
    assert refusals == [1] * 100


def test_only_one_thread_per_key_talks_to_the_database(make_manager: object, key: str) -> None:
    """Eight threads queue on one key held by another process: the database
    sees one waiter polling, never two statements for the key at once."""
    other = make_manager()  # type: ignore[operator]
    manager = make_manager(poll_initial=0.002, poll_max=0.01, notify=False)  # type: ignore[operator]
    holder = other.acquire(key)
    results: list[int] = []
    with StatementCounter(manager.engine) as c:

        def work() -> None:
            with manager.lock(key, timeout=60) as held:
                results.append(held.fence)

        threads = [threading.Thread(target=work) for _ in range(8)]
        for t in threads:
            t.start()
        wait_queued(manager, key, 7)  # seven queue in the process ...
        deadline = time.monotonic() + 10
        while c.count < 3 and time.monotonic() < deadline:  # ... while the eighth polls
            time.sleep(0.005)
        polled = c.count
        holder.release()
        for t in threads:
            t.join(60)
    assert len(results) == 8
    assert c.max_in_flight == 1
    # One thread polled while the others queued in the process.
    assert polled >= 3
    entry = manager._locker.registry.get(key)
    assert entry is None


def test_handoff_costs_one_statement_per_grant(manager: LockManager, key: str) -> None:
    """Local waiters receive the row by hand-off where the dialect can (one
    UPDATE per grant, or one UPDATE for a run where the dialect draws a fence
    reserve with it); elsewhere each grant is an INSERT and a DELETE."""
    with manager.lock(key):
        pass
    grants = 8  # one run: handoff_limit local grants
    with StatementCounter(manager.engine) as c:
        holder = manager.acquire(key)
        threads = [
            threading.Thread(target=lambda: manager.acquire(key, timeout=60).release())
            for _ in range(grants - 1)
        ]
        for t in threads:
            t.start()
        wait_queued(manager, key, grants - 1)
        holder.release()
        for t in threads:
            t.join(60)
    if manager.store.reserves_fences:
        # the INSERT, one hand-off drawing fences for the next ones, the DELETE
        assert c.count == 3
    elif manager.store.can_transfer:
        # one INSERT, seven hand-offs (a run of handoff_limit 8 grants), one
        # DELETE = grants + 1 statements.
        assert c.count == grants + 1
    else:
        assert c.count == 2 * grants


def test_registry_entries_disappear_with_their_keys(manager: LockManager, keys: object) -> None:
    held = [manager.acquire(k) for k in keys(50)]  # type: ignore[operator]
    assert len(manager._locker.registry) == 50
    for h in held:
        h.release()
    assert len(manager._locker.registry) == 0


def test_registry_memory_follows_keys_in_use() -> None:
    """100,000 distinct keys held at once, then released: the registry's
    memory goes back to where it started."""
    registry = Registry()
    gc.collect()
    tracemalloc.start()
    try:
        baseline = tracemalloc.take_snapshot()
        entries = []
        for i in range(100_000):
            entry = registry.claim(f"user:{i}", i)
            assert isinstance(entry, Entry)
            entries.append(entry)
        peak = tracemalloc.get_traced_memory()[0]
        assert len(registry) == 100_000
        for entry in entries:
            assert registry.leave(entry) is None
        del entries, entry
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    assert len(registry) == 0
    grown = sum(
        s.size_diff
        for s in after.compare_to(baseline, "filename")
        if "registry.py" in str(s.traceback)
    )
    assert peak > 10_000_000  # 100k entries really were held
    assert grown < 10_000, f"registry kept {grown} bytes after all keys left"


def test_manager_memory_after_many_distinct_keys(manager: LockManager, keys: object) -> None:
    """Distinct keys coming and going through a real manager leave nothing behind."""
    names = keys(2000)  # type: ignore[operator]
    for k in names:
        with manager.lock(k):
            pass
    assert len(manager._locker.registry) == 0
    assert manager._locker.registry._entries == {}


def test_a_hand_off_of_a_row_that_was_gone_tells_the_holder_and_leaves_no_row(
    manager: LockManager, key: str
) -> None:
    """The holder's row was deleted under it (``dblock release --force``) while a
    local thread queued: the release says the lock was lost, and the next
    thread acquires the key by itself (on MariaDB the hand-off's INSERT had
    written a row for it, which goes again), with a greater fence; once it
    releases, no row is left."""
    held = manager.acquire(key, ttl=30)
    got: list[int] = []
    rows: list[object] = []  # (asserted here: an assert in the thread would fail unseen)

    def second() -> None:
        with manager.lock(key, timeout=30, ttl=30) as next_held:
            got.append(next_held.fence)
            rows.append(row_of(manager, key))

    thread = threading.Thread(target=second)
    thread.start()
    wait_queued(manager, key, 1)
    table = manager.store.table
    with manager.engine.begin() as conn:
        conn.execute(sa.delete(table).where(table.c.lock_key == key))
    with pytest.raises(LockLost):
        held.release()
    thread.join(30)
    assert got
    assert got[0] > held.fence
    assert rows[0] is not None  # it held a row of its own
    assert row_of(manager, key) is None
    assert len(manager._locker.registry) == 0
