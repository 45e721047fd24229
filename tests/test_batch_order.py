"""Every batch statement takes its row locks in key order (issue 32, defect 2).

A release batch and an acquire batch deadlocked on PostgreSQL: the acquire
wrote its rows in key order, while the release's DELETE (and the renewal's
UPDATE), joined to the table by a hash join over a scan of a small or
never-analysed table, locked them in the table's physical order. Here the
rows are written in the reverse of key order (so a scan meets the last key
first), a transaction of the test's own locks the first key's row, and a
batch statement of both keys goes out: locking in key order, it waits at
the first key holding nothing, so the test can still lock the second key
without waiting. Locking in physical order, it would have taken the second
key first (the test's NOWAIT then fails), and the two would deadlock as
soon as the test asked for it.

The server logs of whole runs are read in tests/test_batch_deadlocks.py.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from dblock import LockManager
from dblock._store.base import Grant
from tests.support.innodb import innodb_count

pytestmark = pytest.mark.databases("postgresql", "mariadb")


def _waiting(conn: sa.Connection, db: str, table: str) -> int:
    """Statements on ``table`` waiting for a row lock right now."""
    if db == "postgresql":
        sql = (
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE :like"
        )
        return int(conn.execute(sa.text(sql), {"like": f"%{table}%"}).scalar_one())
    return innodb_count(
        conn,
        "SELECT count(*) FROM information_schema.INNODB_TRX "
        "WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE :like",
        {"like": f"%{table}%"},
    )


@pytest.fixture
def two_rows(db_url: str, private: LockManager) -> tuple[LockManager, list[str]]:
    """Rows of ``b`` and ``a`` (written in that order, so the table's
    physical order is the reverse of key order), each with its token."""
    keys = ["b", "a"]
    store = private.store
    tokens = []
    for key in keys:
        token = uuid.uuid4().hex
        assert isinstance(store.try_acquire(key, token, "test:1:T", 300.0), Grant)
        tokens.append(token)
    return private, tokens


def _held_first_key(
    db: str, db_url: str, manager: LockManager, batch: Callable[[], object]
) -> tuple[object, bool]:
    """Lock ``a``'s row, send ``batch`` (of ``a`` and ``b``) on a thread,
    and once it waits: can ``b``'s row still be locked without waiting?
    Returns the batch's answer and that."""
    table = manager.names.table
    quoted = manager.store.quoted(table)
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    answer: list[object] = []
    failed: list[BaseException] = []

    def run() -> None:
        try:
            answer.append(batch())
        except BaseException as exc:  # reported by the test
            failed.append(exc)

    thread = threading.Thread(target=run)
    try:
        with engine.connect() as holder, engine.connect() as watcher:
            holder.exec_driver_sql(
                f"SELECT token FROM {quoted} WHERE lock_key = 'a' AND slot = '' FOR UPDATE"
            )
            thread.start()
            deadline = time.monotonic() + 10
            while not _waiting(watcher, db, table):
                assert time.monotonic() < deadline, "the batch never waited for 'a'"
                assert thread.is_alive(), (answer, failed)
                time.sleep(0.02)  # innodb_count spaces its reads
            try:
                holder.exec_driver_sql(
                    f"SELECT token FROM {quoted} WHERE lock_key = 'b' AND slot = '' "
                    "FOR UPDATE NOWAIT"
                )
                free = True
            except sa.exc.DBAPIError:
                free = False
            holder.rollback()
            thread.join(10)
    finally:
        engine.dispose()
    assert not thread.is_alive()
    assert not failed, failed
    return answer[0], free


def test_release_batch_locks_rows_in_key_order(
    db: str, db_url: str, two_rows: tuple[LockManager, list[str]]
) -> None:
    manager, (token_b, token_a) = two_rows
    store = manager.store
    gone, free = _held_first_key(
        db,
        db_url,
        manager,
        lambda: store.drive(store.release_many_steps([("b", token_b), ("a", token_a)])),
    )
    assert free, "the release batch locked 'b' before 'a'"
    assert gone == [True, True]


def test_renewal_locks_rows_in_key_order(
    db: str, db_url: str, two_rows: tuple[LockManager, list[str]]
) -> None:
    manager, (token_b, token_a) = two_rows
    store = manager.store
    leases, free = _held_first_key(
        db, db_url, manager, lambda: store.renew([("b", token_b, 60.0), ("a", token_a, 60.0)])
    )
    assert free, "the renewal locked 'b' before 'a'"
    assert isinstance(leases, dict)
    assert set(leases) == {token_a, token_b}


def test_acquire_batch_locks_rows_in_key_order(
    db: str, db_url: str, two_rows: tuple[LockManager, list[str]]
) -> None:
    manager, _ = two_rows
    store = manager.store
    table = store.table
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    long_ago = datetime.now(timezone.utc) - timedelta(hours=1)
    with engine.begin() as conn:  # both expired: the batch takes them over
        conn.execute(table.update().values(acquired_at=long_ago, expires_at=long_ago))
    engine.dispose()
    mine = {"b": uuid.uuid4().hex, "a": uuid.uuid4().hex}
    requests = [(k, t, "test:2:T", 30.0) for k, t in mine.items()]
    answers, free = _held_first_key(
        db, db_url, manager, lambda: store.drive(store.acquire_many_steps(requests))
    )
    assert free, "the acquire batch locked 'b' before 'a'"
    assert isinstance(answers, list)
    assert [isinstance(a, Grant) for a in answers] == [True, True]
