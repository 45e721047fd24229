"""MySQL/MariaDB specifics."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from dblock import LockBusy, LockLost, LockManager
from tests.conftest import row_of
from tests.support.counting import StatementCounter

pytestmark = pytest.mark.databases("mariadb")


def test_returning_capability_detected(manager: LockManager, key: str) -> None:
    with manager.lock(key):
        pass
    assert manager.store.returning is True  # type: ignore[attr-defined]


def test_mysql_path_without_returning(make_manager: object, key: str) -> None:
    """MySQL proper has no INSERT ... RETURNING: the fence comes from
    lastrowid and the lease end from the measured clock offset."""
    a, b = make_manager(), make_manager()  # type: ignore[operator]
    for m in (a, b):
        m.store._capabilities()
        m.store.returning = False
    held = a.acquire(key, ttl=60)
    row = row_of(a, key)
    assert row is not None
    assert held.fence == row.fence
    assert abs((held.expires_at - row.expires_at).total_seconds()) < 0.5
    # Estimated from the send time, so early rather than late (up to the
    # offset measurement's error, half a round trip).
    assert held.expires_at <= row.expires_at + timedelta(milliseconds=50)
    b.acquire(key + ":warm-up").release()  # b measures its clock offset once
    with StatementCounter(b.engine) as c:
        with pytest.raises(LockBusy):
            b.acquire(key, blocking=False)
        assert c.count == 2  # the ignored INSERT and the read of the holder
    held.release()
    with StatementCounter(b.engine) as c:
        b.acquire(key).release()
        assert c.count == 2  # one INSERT, one DELETE


def test_expired_row_taken_over_by_delete_and_insert(make_manager: object, key: str) -> None:
    a, b = make_manager(), make_manager()  # type: ignore[operator]
    stale = a.acquire(key, ttl=0.2, renew=False)
    time.sleep(0.3)
    fresh = b.acquire(key, blocking=False)
    assert fresh.fence > stale.fence
    with pytest.raises(LockLost):
        stale.release()
    fresh.release()


def test_keys_are_case_sensitive(make_manager: object, key: str) -> None:
    a, b = make_manager(), make_manager()  # type: ignore[operator]
    with a.lock(key + ":User"), b.lock(key + ":user", blocking=False):
        pass
