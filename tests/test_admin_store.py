"""The store's admin operations on each database: rows, stats, bounded sweeps.

Every test works on a lock table of its own (the ``private`` fixture), since
it counts or deletes rows table-wide.
"""

from __future__ import annotations

import threading
import time

import pytest

from dblock import LockLost, LockManager
from dblock._store.admin import SweepReason
from tests.support.rows import backdate, insert_expired

EXPIRED = SweepReason.EXPIRED
MAX_HOLD = SweepReason.MAX_HOLD


def test_rows_and_stats(private: LockManager, keys: object) -> None:
    live_key, dead_key = keys(2)  # type: ignore[operator]
    live = private.acquire(live_key, ttl=60)
    dead = private.acquire(dead_key, ttl=0.2)
    time.sleep(0.4)
    rows = {row.key: row for row in private.store.rows()}
    assert set(rows) == {live_key, dead_key}
    row = rows[live_key]
    assert (row.owner, row.token, row.fence) == (live.owner, live.token, live.fence)
    assert 0.3 <= row.age < 30
    assert 30 < row.lease_left <= 60
    assert not row.expired
    assert rows[dead_key].expired
    assert rows[dead_key].lease_left < 0
    assert rows[dead_key].fence == dead.fence
    assert [r.key for r in private.store.rows(key=dead_key)] == [dead_key]
    assert private.store.rows(key=dead_key + ":nobody") == []
    assert [r.key for r in private.store.rows(limit=1)] == [live_key]  # oldest first
    stats = private.store.stats()
    assert (stats.rows, stats.live, stats.expired) == (2, 1, 1)
    assert stats.oldest is not None
    assert stats.oldest.key == live_key
    live.release()


def test_rows_by_prefix_take_it_literally(private: LockManager, key: str) -> None:
    names = [f"{key}:a%b", f"{key}:a_c", f"{key}:A%b", f"{key}:ab"]
    held = [private.acquire(name, ttl=60) for name in names]

    def keys_with(prefix: str) -> list[str]:
        return sorted(row.key for row in private.store.rows(prefix=prefix))

    assert keys_with(f"{key}:a%") == [f"{key}:a%b"]  # % is no wildcard
    assert keys_with(f"{key}:a_") == [f"{key}:a_c"]  # nor is _
    assert keys_with(f"{key}:A") == [f"{key}:A%b"]  # case-sensitive, on SQLite too
    assert keys_with(key) == sorted(names)
    for h in held:
        h.release()


def test_stats_of_an_empty_table(private: LockManager) -> None:
    stats = private.store.stats()
    assert (stats.rows, stats.expired, stats.oldest) == (0, 0, None)
    assert private.store.rows() == []


def test_sweep_deletes_only_rows_expired_longer_than_the_grace(
    private: LockManager, keys: object
) -> None:
    live_key, old_key, recent_key = keys(3)  # type: ignore[operator]
    live = private.acquire(live_key, ttl=60)
    insert_expired(private, [old_key], ago=3600)
    _recent = private.acquire(recent_key, ttl=0.1)  # kept: a dropped lock is released
    time.sleep(0.2)
    gone = private.store.sweep(EXPIRED, older_than=30, limit=100)
    assert [row.key for row in gone] == [old_key]
    assert gone[0].expired
    assert {row.key for row in private.store.rows()} == {live_key, recent_key}
    live.release()  # untouched: still ours


def test_sweep_works_in_bounded_batches_oldest_first(private: LockManager, keys: object) -> None:
    backlog = keys(25)  # type: ignore[operator]
    _held = [private.acquire(key, ttl=0.1) for key in backlog]  # kept, not released
    time.sleep(0.3)
    batches = []
    while batch := private.store.sweep(EXPIRED, older_than=0.0, limit=10):
        batches.append(batch)
    assert [len(b) for b in batches] == [10, 10, 5]
    swept = [row for batch in batches for row in batch]
    assert sorted(row.key for row in swept) == sorted(backlog)
    ends = [row.expires_at for row in swept]
    assert ends == sorted(ends)
    assert private.store.stats().rows == 0


def test_max_hold_deletes_live_rows_held_too_long(private: LockManager, keys: object) -> None:
    old_key, young_key = keys(2)  # type: ignore[operator]
    old = private.acquire(old_key, ttl=600)
    backdate(private, old_key, 7200)  # acquired two hours ago, lease renewed since
    young = private.acquire(young_key, ttl=600)
    gone = private.store.sweep(MAX_HOLD, older_than=3600, limit=10)
    assert [row.key for row in gone] == [old_key]
    assert not gone[0].expired  # a live row: only the safety net deletes those
    assert gone[0].age >= 7200
    assert gone[0].owner == old.owner
    with pytest.raises(LockLost):
        old.release()  # its holder learns it
    young.release()


def test_swept_expired_holder_gets_lock_lost(private: LockManager, key: str) -> None:
    held = private.acquire(key, ttl=0.1)
    time.sleep(0.3)
    assert [row.key for row in private.store.sweep(EXPIRED, older_than=0.0, limit=5)] == [key]
    with pytest.raises(LockLost):
        held.release()
    with private.lock(key, blocking=False) as again:  # the key is free
        assert again.fence > held.fence


def test_concurrent_sweeps_delete_each_row_once(private: LockManager, keys: object) -> None:
    backlog = keys(300)  # type: ignore[operator]
    insert_expired(private, backlog)
    swept: list[list[str]] = [[], [], []]
    errors: list[BaseException] = []

    def sweep(out: list[str]) -> None:
        try:
            while batch := private.store.sweep(EXPIRED, older_than=0.0, limit=20):
                out.extend(row.key for row in batch)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=sweep, args=(out,)) for out in swept]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    everything = [key for out in swept for key in out]
    assert sorted(everything) == sorted(backlog)  # all of them, none twice


@pytest.mark.databases("postgresql")
def test_sweep_wakes_waiters_on_postgresql(
    private: LockManager, make_manager: object, key: str
) -> None:
    """A swept key is announced like a release: its waiter wakes at once,
    not at the holder's lease end or its own periodic re-check."""
    waiter = make_manager(table=private.config.table, notify_recheck=60.0)  # type: ignore[operator]
    held = private.acquire(key, ttl=120)
    got: list[float] = []

    def wait() -> None:
        with waiter.lock(key, timeout=90):
            got.append(time.monotonic())

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(1.0)  # the waiter found it held and listens
    assert not got
    swept_at = time.monotonic()
    assert private.store.sweep(MAX_HOLD, older_than=0.5, limit=5)
    t.join(90)
    assert got
    assert got[0] - swept_at < 20  # far below the 60 s re-check and 120 s lease
    with pytest.raises(LockLost):
        held.release()


@pytest.mark.databases("mariadb")
def test_sweep_without_returning_on_mysql(private: LockManager, keys: object) -> None:
    """MySQL proper has no DELETE ... RETURNING: a batch is read, then each
    row deleted by its token. Driven on MariaDB with RETURNING turned off."""
    store = private.store
    store._capabilities()  # type: ignore[attr-defined]
    store.returning = False  # type: ignore[attr-defined]
    *backlog, live_key = keys(8)  # type: ignore[operator]
    insert_expired(private, backlog)
    live = private.acquire(live_key, ttl=60)
    first = store.sweep(EXPIRED, older_than=0.0, limit=5)
    second = store.sweep(EXPIRED, older_than=0.0, limit=5)
    assert (len(first), len(second)) == (5, 2)
    assert sorted(row.key for row in first + second) == sorted(backlog)
    assert store.sweep(MAX_HOLD, older_than=600, limit=5) == []
    assert [row.key for row in store.rows()] == [live_key]
    live.release()
