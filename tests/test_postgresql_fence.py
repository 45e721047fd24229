"""PostgreSQL: fences follow the order in which a key is granted (issue 15).

``nextval`` in the acquire statement runs when the row to insert is built,
before the conflict check. An acquire held up between the two (waiting for
another's insert of the key to end, or descheduled on a loaded machine) could
write a fence drawn *before* the one another process was granted, and
released, on the same key meanwhile. Under load (a niced private server, four
processes of four threads on one key) that happened to about one grant in ten.

Here the hold-up is made on cue: a BEFORE INSERT trigger on a private table
(it fires after ``nextval`` and before the conflict check) waits on an
advisory lock the test holds, for the "slow" manager's rows only.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from dblock import LockManager
from tests.support.grants import Grants

pytestmark = pytest.mark.databases("postgresql")


def _until(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class _Gate:
    """The hold-up: a BEFORE INSERT trigger on the table (it fires after
    ``nextval`` and before the conflict check) that waits, for rows of a
    ``slow:`` owner only, on a session advisory lock the test holds."""

    def __init__(self, db_url: str, table: str) -> None:
        self.number = random.randrange(1, 2**31)  # an advisory lock of this test's own
        self.table = table
        self.hold = f"{table}_hold"
        self.admin = sa.create_engine(
            db_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
        )
        with self.admin.connect() as conn:
            conn.exec_driver_sql(
                f"CREATE FUNCTION {self.hold}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                f"IF starts_with(NEW.owner, 'slow:') THEN "
                f"PERFORM pg_advisory_lock_shared({self.number}); "
                f"PERFORM pg_advisory_unlock_shared({self.number}); END IF; RETURN NEW; END $$"
            )
            conn.exec_driver_sql(
                f"CREATE TRIGGER {self.hold} BEFORE INSERT ON {table} "
                f"FOR EACH ROW EXECUTE FUNCTION {self.hold}()"
            )
        self.keeper = self.admin.connect()

    def close(self) -> None:
        self.keeper.exec_driver_sql("SELECT pg_advisory_unlock_all()")
        self.keeper.close()
        with self.admin.connect() as conn:
            conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {self.hold} ON {self.table}")
            conn.exec_driver_sql(f"DROP FUNCTION IF EXISTS {self.hold}()")
        self.admin.dispose()

    def shut(self) -> None:
        self.keeper.exec_driver_sql(f"SELECT pg_advisory_lock({self.number})")

    def open(self) -> None:
        self.keeper.exec_driver_sql(f"SELECT pg_advisory_unlock({self.number})")

    def slow_is_held(self) -> bool:
        """Slow drew its fence, and its row is not written."""
        return self.waits(1, self.number)

    def waits(self, objsubid: int, objid: int | None = None) -> bool:
        """Is some backend waiting for an advisory lock of this shape? (2:
        a key's transaction lock, ``pg_advisory_xact_lock(class, hash)``)"""
        sql = (
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            f"AND objsubid = {objsubid}"
        )
        if objid is not None:
            sql += f" AND objid = {objid}"
        with self.admin.connect() as conn:
            return bool(conn.exec_driver_sql(sql).scalar_one())


@contextlib.contextmanager
def _race(db_url: str, table: str, key: str) -> Iterator[tuple[_Gate, LockManager, LockManager]]:
    """The gate, and a slow and a fast manager on ``table``, warmed up."""
    gate = _Gate(db_url, table)
    slow = LockManager(db_url, table=table, client_id="slow", renew=False)
    fast = LockManager(db_url, table=table, client_id="fast", renew=False)
    try:
        for m in (slow, fast):
            m.acquire(key + ":warm-up").release()
        yield gate, slow, fast
    finally:
        slow.close()
        fast.close()
        gate.close()


def test_fence_drawn_before_a_wait_is_never_granted_after_a_larger_one(
    db_url: str, private: LockManager, key: str
) -> None:
    grants = Grants(key, hold="slow")  # slow releases its own lock: only a holder may
    with _race(db_url, private.store.names.table, key) as (gate, slow, fast):
        try:
            gate.shut()
            grants.start(slow, "slow")
            _until(gate.slow_is_held, 60)
            grants.start(fast, "fast")
            # Before the fix fast is granted (a larger fence) and done; with it,
            # fast waits for slow's statement on the key's advisory lock.
            _until(lambda: not grants.threads[-1].is_alive() or gate.waits(2), 60)
            gate.open()
            _until(lambda: "slow" in grants.names() or not grants.threads[0].is_alive(), 60)
        finally:
            grants.join()
        assert grants.names() in (["slow", "fast"], ["fast", "slow"])
        fences = grants.fences()
        assert fences[0] < fences[1], (
            f"granted in this order, fences going backwards: {grants.grants}"
        )


def test_a_hand_off_never_draws_a_fence_past_an_acquire_about_to_insert(
    db_url: str, private: LockManager, key: str
) -> None:
    """The hand-off's ``UPDATE`` (the next local thread's grant, and the
    run's reserve) draws fences too. Seen once in a Patroni torture run under
    load: an acquire of another process drew its fence and was descheduled
    before its conflict check; meanwhile the holder handed the key on (a
    larger fence), that thread released it, and the acquire then found the
    key free and wrote its smaller fence. The hand-off takes the key's
    advisory lock before it draws, as the acquire does, so it waits for such
    an acquire to end."""
    grants = Grants(key, hold="first")
    with _race(db_url, private.store.names.table, key) as (gate, slow, fast):
        try:
            grants.start(fast, "first")
            _until(lambda: grants.names() == ["first"], 60)
            gate.shut()
            grants.start(slow, "slow")
            _until(gate.slow_is_held, 60)
            grants.start(fast, "second")  # queued behind "first" in fast's process
            _until(lambda: bool(fast._locker.registry.get(key).queue), 60)  # type: ignore[union-attr]
            grants.let_go()  # its release hands the key to "second" with a new fence
            # Before the fix "second" is granted (a larger fence) and releases at
            # once; with it, the hand-off waits for slow's statement on the key's
            # advisory lock.
            _until(lambda: "second" in grants.names() or gate.waits(2), 60)
            gate.open()
        finally:
            grants.join()
        assert sorted(grants.names()) == ["first", "second", "slow"]
        fences = grants.fences()
        assert fences == sorted(fences), (
            f"granted in this order, fences going backwards: {grants.grants}"
        )
