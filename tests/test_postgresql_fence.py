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

import random
import threading
import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from dblock import LockManager

pytestmark = pytest.mark.databases("postgresql")


def _until(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_fence_drawn_before_a_wait_is_never_granted_after_a_larger_one(
    db_url: str, private: LockManager, key: str
) -> None:
    table = private.store.names.table
    gate = random.randrange(1, 2**31)  # a session advisory lock of this test's own
    admin = sa.create_engine(db_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    hold = f"{table}_hold"
    slow = LockManager(db_url, table=table, client_id="slow", renew=False)
    fast = LockManager(db_url, table=table, client_id="fast", renew=False)
    grants: list[tuple[str, int]] = []  # in the order acquire() returned
    let_slow_go = threading.Event()  # slow releases its own lock: only a holder may
    record = threading.Lock()

    def waiting(objsubid: int, objid: int | None = None) -> bool:
        """Is some backend waiting for an advisory lock of this shape?"""
        sql = (
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            f"AND objsubid = {objsubid}"
        )
        if objid is not None:
            sql += f" AND objid = {objid}"
        with admin.connect() as conn:
            return bool(conn.exec_driver_sql(sql).scalar_one())

    def take(manager: LockManager, name: str) -> None:
        held = manager.acquire(key, timeout=60)
        with record:
            grants.append((name, held.fence))
        if name == "slow":
            let_slow_go.wait(60)
        held.release()

    with admin.connect() as conn:
        conn.exec_driver_sql(
            f"CREATE FUNCTION {hold}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF starts_with(NEW.owner, 'slow:') THEN PERFORM pg_advisory_lock_shared({gate}); "
            f"PERFORM pg_advisory_unlock_shared({gate}); END IF; RETURN NEW; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER {hold} BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION {hold}()"
        )
    gatekeeper = admin.connect()
    try:
        for m in (slow, fast):
            m.acquire(key + ":warm-up").release()
        gatekeeper.exec_driver_sql(f"SELECT pg_advisory_lock({gate})")
        first = threading.Thread(target=take, args=(slow, "slow"))
        first.start()
        _until(lambda: waiting(1, gate), 60)  # slow drew its fence, its row is not written
        second = threading.Thread(target=take, args=(fast, "fast"))
        second.start()
        # Before the fix fast is granted (a larger fence) and done; with it,
        # fast waits for slow's statement on the key's advisory lock.
        _until(lambda: not second.is_alive() or waiting(2), 60)
        gatekeeper.exec_driver_sql(f"SELECT pg_advisory_unlock({gate})")
        _until(lambda: "slow" in dict(grants) or not first.is_alive(), 60)
        let_slow_go.set()
        first.join(60)
        second.join(60)
        assert [name for name, _ in grants] in (["slow", "fast"], ["fast", "slow"])
        fences = [fence for _, fence in grants]
        assert fences[0] < fences[1], f"granted in this order, fences going backwards: {grants}"
    finally:
        let_slow_go.set()
        gatekeeper.close()
        slow.close()
        fast.close()
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {hold} ON {table}")
            conn.exec_driver_sql(f"DROP FUNCTION IF EXISTS {hold}()")
        admin.dispose()


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
    table = private.store.names.table
    gate = random.randrange(1, 2**31)
    admin = sa.create_engine(db_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    hold = f"{table}_hold"
    slow = LockManager(db_url, table=table, client_id="slow", renew=False)
    fast = LockManager(db_url, table=table, client_id="fast", renew=False)
    grants: list[tuple[str, int]] = []  # in the order acquire() returned
    record = threading.Lock()
    let_first_go = threading.Event()

    def take(manager: LockManager, name: str) -> None:
        held = manager.acquire(key, timeout=60)
        with record:
            grants.append((name, held.fence))
        if name == "first":
            let_first_go.wait(60)
        held.release()

    def names() -> list[str]:
        with record:
            return [name for name, _ in grants]

    def lock_waits(objsubid: int, objid: int | None = None) -> bool:
        sql = (
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            f"AND objsubid = {objsubid}"
        )
        if objid is not None:
            sql += f" AND objid = {objid}"
        with admin.connect() as conn:
            return bool(conn.exec_driver_sql(sql).scalar_one())

    with admin.connect() as conn:
        conn.exec_driver_sql(
            f"CREATE FUNCTION {hold}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            f"IF starts_with(NEW.owner, 'slow:') THEN PERFORM pg_advisory_lock_shared({gate}); "
            f"PERFORM pg_advisory_unlock_shared({gate}); END IF; RETURN NEW; END $$"
        )
        conn.exec_driver_sql(
            f"CREATE TRIGGER {hold} BEFORE INSERT ON {table} FOR EACH ROW EXECUTE FUNCTION {hold}()"
        )
    gatekeeper = admin.connect()
    threads: list[threading.Thread] = []
    try:
        for m in (slow, fast):
            m.acquire(key + ":warm-up").release()

        def start(manager: LockManager, name: str) -> None:
            thread = threading.Thread(target=take, args=(manager, name))
            threads.append(thread)
            thread.start()

        start(fast, "first")
        _until(lambda: names() == ["first"], 60)
        gatekeeper.exec_driver_sql(f"SELECT pg_advisory_lock({gate})")
        start(slow, "slow")
        _until(lambda: lock_waits(1, gate), 60)  # slow drew its fence, its row is not written
        start(fast, "second")  # queued behind "first" in fast's process
        _until(lambda: bool(fast._locker.registry.get(key).queue), 60)  # type: ignore[union-attr]
        let_first_go.set()  # its release hands the key to "second" with a new fence
        # Before the fix "second" is granted (a larger fence) and releases at
        # once; with it, the hand-off waits for slow's statement on the key's
        # advisory lock.
        _until(lambda: "second" in names() or lock_waits(2), 60)
        gatekeeper.exec_driver_sql(f"SELECT pg_advisory_unlock({gate})")
        for thread in threads:
            thread.join(60)
        assert sorted(names()) == ["first", "second", "slow"]
        fences = [fence for _, fence in grants]
        assert fences == sorted(fences), f"granted in this order, fences going backwards: {grants}"
    finally:
        let_first_go.set()
        gatekeeper.close()
        for thread in threads:
            thread.join(60)
        slow.close()
        fast.close()
        with admin.connect() as conn:
            conn.exec_driver_sql(f"DROP TRIGGER IF EXISTS {hold} ON {table}")
            conn.exec_driver_sql(f"DROP FUNCTION IF EXISTS {hold}()")
        admin.dispose()
