"""MariaDB under heavy contention on one key: InnoDB deadlocks are contention.

Two ``INSERT IGNORE`` racing for a key whose row is being deleted can
deadlock (both take a shared lock on the delete-marked record, then both
want to insert): InnoDB rolls one back whole with error 1213. Found by
``scripts/bench`` (hot key, fail-fast, level 2 only). Nothing was written, so
for the lock it is an ignored INSERT: the key is busy, not the database
broken. No BackendError may reach the caller.
"""

from __future__ import annotations

import threading
import time

import pytest

from dblock import BackendError, LockBusy, LockManager

pytestmark = pytest.mark.databases("mariadb")


@pytest.mark.slow
def test_racing_inserts_never_surface_as_backend_errors(make_manager: object, key: str) -> None:
    managers = [make_manager(local_filter=False) for _ in range(4)]  # type: ignore[operator]
    errors: list[BaseException] = []
    grants = busy = 0
    count = threading.Lock()
    deadline = time.monotonic() + 4.0

    def hammer(m: LockManager) -> None:
        nonlocal grants, busy
        while time.monotonic() < deadline:
            try:
                with m.lock(key, blocking=False):
                    with count:
                        grants += 1
                    time.sleep(0.001)
            except LockBusy:
                with count:
                    busy += 1
                time.sleep(0.001)
            except BackendError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(m,)) for m in managers for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert grants > 0
    assert busy > 0
    assert errors == []


def test_an_auto_inc_lock_victim_is_contention(manager: LockManager) -> None:
    """InnoDB reports a deadlock or lock-wait timeout met while taking the
    table's AUTO-INC lock (which an INSERT … SELECT holds to its end) as
    "Failed to read auto-increment value from storage engine" (1467); seen
    failing a read lock's grant with two processes racing for one key. Like
    1213, the statement was rolled back whole: it runs again (an INSERT
    IGNORE counts as ignored, the holder is read next), never raised."""
    import pymysql

    from dblock._store.mysql import deadlocked

    store = manager.store
    failure = BackendError("statement failed: 1467")
    failure.__cause__ = pymysql.err.OperationalError(
        1467, "Failed to read auto-increment value from storage engine"
    )
    assert deadlocked(failure)
    insert = store._insert_returning_sql if store.returning else store._insert_sql
    assert store.retry(insert, failure, 0).rowcount == 0  # ignored: read the holder
    assert store.retry(store._release_sql, failure, 0) > 0  # any other: again, after a pause
    assert store.retry(store._release_sql, failure, 3) is None  # bounded
