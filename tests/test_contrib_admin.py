"""The integrations' admin operations (dblock/contrib/_admin.py) on every
database, each test on a lock table of its own."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from dblock import LockArgumentError, LockLost, LockManager, SchemaMissing
from dblock.contrib import _admin
from tests.support.counting import StatementCounter


@pytest.fixture
def private(db_url: str) -> Iterator[LockManager]:
    m = LockManager(db_url, table=f"dblock_t_{uuid.uuid4().hex[:8]}")
    m.create_schema()
    yield m
    m.drop_schema()
    m.close()


def test_list_shows_rows_with_database_lease(private: LockManager) -> None:
    held = private.acquire("a%b", ttl=30)
    _kept = [private.acquire("a_c", ttl=0.1, renew=False), private.acquire("zz", ttl=30)]
    time.sleep(0.3)
    infos = _admin.list_locks(private)
    assert [i.key for i in infos] == ["a%b", "a_c", "zz"]
    first = infos[0]
    assert (first.owner, first.fence) == (held.owner, held.fence)
    assert 25 < first.lease_left <= 30
    assert not first.expired
    assert infos[1].expired
    # LIKE wildcards in the prefix are taken literally.
    assert [i.key for i in _admin.list_locks(private, prefix="a%")] == ["a%b"]
    assert [i.key for i in _admin.list_locks(private, prefix="a_")] == ["a_c"]


def test_sweep_expired_and_too_old(private: LockManager) -> None:
    _expired = private.acquire("expired", ttl=0.1, renew=False)  # kept, not released
    old = private.acquire("old", ttl=60)
    time.sleep(1.2)
    young = private.acquire("young", ttl=60)
    assert _admin.sweep(private) == 1
    assert _admin.sweep(private, max_age=1.0) == 1  # "old" held over 1 s
    assert [i.key for i in _admin.list_locks(private)] == ["young"]
    with pytest.raises(LockLost):
        old.release()
    assert young.release()


def test_force_release(private: LockManager) -> None:
    held = private.acquire("k")
    assert _admin.force_release(private, "k") is True
    assert _admin.force_release(private, "k") is False
    with pytest.raises(LockLost):
        held.release()
    with StatementCounter(private.engine) as counter, pytest.raises(LockArgumentError):
        _admin.force_release(private, "")
    assert counter.count == 0
    with pytest.raises(LockArgumentError, match="max_age"):
        _admin.sweep(private, max_age=0)


def test_missing_table_is_reported(db_url: str) -> None:
    with LockManager(db_url, table=f"dblock_t_{uuid.uuid4().hex[:8]}") as m:
        for call in (_admin.list_locks, _admin.sweep):
            with pytest.raises(SchemaMissing):
                call(m)


def test_sweepers_take_turns(private: LockManager, make_manager: Any) -> None:
    """Two sweepers (two processes' managers): while one sweeps, the other
    skips its round instead of sweeping the same rows."""
    other = make_manager(table=private.names.table)
    one = _admin.Sweeper(private, interval=60)
    two = _admin.Sweeper(other, interval=60)
    _gone = private.acquire("gone", ttl=0.1, renew=False)  # kept: a dropped lock is released
    time.sleep(0.3)
    with other.lock(two.key):  # the other sweeper is mid-round
        assert one.run_once() is None
    assert one.run_once() == 1
    assert two.run_once() == 0
    assert (one.rounds, one.swept) == (1, 1)


def test_background_sweeper(private: LockManager) -> None:
    sweeper = _admin.Sweeper(private, interval=0.2).start()
    try:
        assert sweeper.running
        _bg = private.acquire("bg", ttl=0.1, renew=False)  # kept, not released
        deadline = time.monotonic() + 30
        while sweeper.swept == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sweeper.swept == 1
    finally:
        sweeper.stop()
    assert not sweeper.running
