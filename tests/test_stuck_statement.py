"""One key's statement held up does not hold up the process (group commit).

A statement can wait for as long as the database makes it: a row lock or an
advisory lock another session holds on its key (an administrator's session,
a long transaction), or a connection that silently stopped forwarding (a
half-open TCP connection: minutes, until the kernel gives up). With group
commit one statement per lane is in flight, so before the mend every other
request of the process queued behind the held-up one: a free key asked with
``timeout=0.5`` or fail-fast took as long as the stuck one (6 s here, 15
minutes in production), and a lock granted after queueing counted its lease
from before it queued (``remaining`` negative, ``check()`` raising while
its row had its whole lease). Now a statement in flight past
``batch.STALL`` is stuck, and the next request goes out beside it; a
request whose own batch is stuck leaves at its deadline (its row, if the
batch writes one, deleted by its token); a grant's lease counts from when
its statement was sent.

Also here: a grant whose statement came back after the lease it set had run
out (by this process's clock) is not handed back (issue 32, defect 4).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from dblock import AsyncLockManager, LockBusy, LockManager, LockTimeout
from dblock._store import batch as batch_module
from dblock._store.sqlparts import lock_class
from tests.conftest import row_of
from tests.support.proxy import Proxy
from tests.test_batch import Gate, Runner, gate_row, one_at_a_time, wait_until

SERVERS = pytest.mark.databases("postgresql", "mariadb")
# A statement held up by a lock on the database holds up only itself on
# PostgreSQL. On MariaDB a row lock held on one key's existing row stalls
# every INSERT into the table, with or without group commit: dblock's INSERT
# IGNORE … SELECT is a bulk insert, which holds the table's AUTO-INC lock
# (innodb_autoinc_lock_mode=1, the default) until it ends, row-lock wait
# included. There the tests hold a statement up with a half-open connection.
LOCKS_HOLD_ONE = pytest.mark.databases("postgresql")

# How long the stuck statement is held at most (the administrator:
# 6 s). An unmended batcher makes every request below wait this long.
HOLD = 10.0


def fence_row(manager: LockManager, key: str) -> None:
    """An expired row right after ``key`` in the index. On MariaDB a
    statement waiting for ``key``'s row lock also holds up inserts into the
    index gap after that row (InnoDB's next-key locking of its look-up),
    with or without group commit: this row closes that gap, so the test's
    other keys (which sort after it) are free as far as the database goes."""
    table = manager.store.table
    long_ago = datetime.now(timezone.utc) - timedelta(hours=1)
    with manager.engine.begin() as conn:
        conn.execute(
            table.insert().values(
                lock_key=f"{key}0",
                owner="fence",
                token="fence",
                fence=None if manager.engine.dialect.name in ("mysql", "mariadb") else -1,
                acquired_at=long_ago,
                expires_at=long_ago,
            )
        )


# What a request may take beside a stuck statement: the stall bound, a
# round trip, and room for a loaded test machine.
QUICK = batch_module.STALL + 0.75


@contextmanager
def advisory(db_url: str, manager: LockManager, key: str) -> Iterator[Callable[[], None]]:
    """PostgreSQL: another session holds ``key``'s advisory lock (dblock's
    class), as an administrator's ``pg_advisory_lock`` would: the key's
    INSERT waits for it. Yields the release."""
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    conn = engine.connect()
    number = lock_class(manager.store.names.table)
    conn.execute(sa.text("SELECT pg_advisory_lock(:c, hashtext(:k))"), {"c": number, "k": key})
    conn.commit()
    done = threading.Event()

    def release() -> None:
        if not done.is_set():
            done.set()
            conn.execute(
                sa.text("SELECT pg_advisory_unlock(:c, hashtext(:k))"), {"c": number, "k": key}
            )
            conn.commit()

    try:
        yield release
    finally:
        release()
        conn.close()
        engine.dispose()


def _waiting_on(db_url: str, manager: LockManager, key: str) -> bool:
    """Whether a statement of ``manager``'s waits (PostgreSQL: on a lock)."""
    with sa.create_engine(db_url, poolclass=sa.pool.NullPool).connect() as conn:
        return bool(
            conn.execute(
                sa.text(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                    "AND query LIKE '%pg_advisory_xact_lock%'"
                )
            ).scalar_one()
        )


@contextmanager
def stuck_key(db: str, db_url: str, manager: LockManager, key: str, how: str) -> Iterator[Any]:
    """``key``'s statement held up (by ``how``) for :data:`HOLD` seconds at
    most: a thread of ``manager`` asks for it and waits in its statement."""
    runner = Runner()
    fence_row(manager, key)
    if how == "row":
        gate = Gate(db_url, manager, key)
        timer = threading.Timer(HOLD, gate.open)
        timer.start()
        try:
            runner.start("stuck", lambda: manager.acquire(key, blocking=False))
            wait_until(gate.blocking, "the stuck statement waiting", step=0.15)
            yield runner
        finally:
            timer.cancel()
            gate.open()
    else:
        assert how == "advisory"
        assert db == "postgresql"
        with advisory(db_url, manager, key) as release:
            timer = threading.Timer(HOLD, release)
            timer.start()
            try:
                runner.start("stuck", lambda: manager.acquire(key, blocking=False))
                wait_until(lambda: _waiting_on(db_url, manager, key), "the stuck statement")
                yield runner
            finally:
                timer.cancel()
    runner.join()
    runner.finish()


def _timed(call: Callable[[], Any]) -> tuple[Any, float]:
    start = time.monotonic()
    try:
        got = call()
    except Exception as exc:
        got = exc
    return got, time.monotonic() - start


def _others_go_on(manager: LockManager, other: LockManager, key: str) -> None:
    """The issue's requests, made while a statement of ``manager`` is stuck:
    each meets its own timeout or fail-fast, and a granted lock has its
    whole lease."""
    held = other.acquire(f"{key}:held")
    try:
        a, took_a = _timed(lambda: manager.acquire(f"{key}:a", timeout=0.5))
        b, took_b = _timed(lambda: manager.acquire(f"{key}:b", blocking=False))
        c, took_c = _timed(lambda: manager.acquire(f"{key}:c", ttl=2))
        d, took_d = _timed(lambda: manager.acquire(f"{key}:held", timeout=0.3))
        e, took_e = _timed(lambda: manager.acquire(f"{key}:held", blocking=False))
    finally:
        held.release()
    for got, took in ((a, took_a), (b, took_b), (c, took_c)):
        assert not isinstance(got, BaseException), got
        assert took < QUICK, (got.key, took)
        assert got.owned()
        got.check()
    assert c.remaining > 2 - QUICK, c.remaining  # its whole lease, less the round trip
    assert isinstance(d, LockTimeout), d
    assert took_d < 0.3 + QUICK, took_d
    assert isinstance(e, LockBusy), e
    assert took_e < QUICK, took_e
    for got in (a, b, c):
        assert row_of(manager, got.key).token == got.token  # type: ignore[union-attr]
        got.release()


@LOCKS_HOLD_ONE
@pytest.mark.parametrize("how", ["row", "advisory"])
def test_a_stuck_statement_holds_up_no_other_request(
    db: str, db_url: str, make_manager: Callable[..., LockManager], key: str, how: str
) -> None:
    """A row lock (PostgreSQL and MariaDB) or an advisory lock (PostgreSQL)
    held by another session on one key: the other requests of the process
    go on as with ``batch=False``."""
    manager, other = make_manager(), make_manager()
    with stuck_key(db, db_url, manager, f"{key}:0stuck", how) as runner:
        _others_go_on(manager, other, key)
        assert "stuck" not in runner.results  # still held up


@SERVERS
def test_a_half_open_connection_holds_up_no_other_request(
    db_url: str, make_manager: Callable[..., LockManager], key: str
) -> None:
    """The connection of one key's statement stops forwarding (the proxy
    holds its packet: to the client, a half-open connection): the other
    requests of the process go on, on other connections."""
    url = sa.make_url(db_url)
    proxy = Proxy(url.host or "127.0.0.1", url.port or (5432 if "postgresql" in db_url else 3306))
    manager = LockManager(proxy.url_for(db_url))
    other = make_manager()
    runner = Runner()
    try:
        with manager.lock(f"{key}:warm"):
            pass  # MariaDB reads the server's capabilities on first use
        stuck = f"{key}:0stuck"
        fence_row(other, stuck)
        held, let_go = proxy.hold(stuck.encode())
        timer = threading.Timer(HOLD, proxy.cut_all)
        timer.start()
        try:
            runner.start("stuck", lambda: manager.acquire(stuck, blocking=False))
            assert held.wait(10)
            _others_go_on(manager, other, key)
            assert "stuck" not in runner.results
        finally:
            timer.cancel()
            proxy.cut_all()
            let_go.set()
        runner.join()
        runner.finish()
    finally:
        manager.close()
        proxy.close()


@SERVERS
def test_a_request_in_a_stuck_batch_leaves_at_its_deadline(
    db_url: str, make_manager: Callable[..., LockManager], key: str
) -> None:
    """A free key that went out in one statement with a stuck key: it leaves
    at its own timeout, and the row the batch writes for it once unstuck is
    deleted by its token (nobody holds it)."""
    manager = make_manager()
    sa.event.listen(manager.engine, "before_cursor_execute", lambda *a: None)
    one_at_a_time(manager)  # so that both queue behind the gate, then go together
    batcher = manager._locker.batcher
    assert batcher is not None
    lane = batcher._acquires
    runner = Runner()
    stuck, free = f"{key}:0stuck", f"{key}:free"
    fence_row(manager, stuck)
    block = Gate(db_url, manager, stuck)
    gate = Gate(db_url, manager, f"{key}:gate")
    try:
        runner.start("gate", lambda: manager.acquire(f"{key}:gate", blocking=False))
        wait_until(gate.blocking, "the gate's statement waiting", step=0.15)
        runner.start("stuck", lambda: manager.acquire(stuck, blocking=False))
        wait_until(lambda: len(lane.queue) == 1, "the stuck key queued")
        got: dict[str, Any] = {}

        def free_one() -> None:
            got["free"] = _timed(lambda: manager.acquire(free, timeout=1.0))

        asker = threading.Thread(target=free_one)
        asker.start()
        wait_until(lambda: len(lane.queue) == 2, "the free key queued")
        gate.open()  # the batch (stuck, free) goes out and waits on the block
        wait_until(block.blocking, "the batch waiting", step=0.15)
        asker.join(10)
        result, took = got["free"]
        assert isinstance(result, LockTimeout), result
        assert 1.0 <= took < 1.0 + QUICK, took
    finally:
        gate.open()
        block.open()
    runner.join()
    assert runner.results["stuck"].key == stuck
    # The batch committed a row for the free key's token: deleted as an orphan.
    wait_until(lambda: row_of(manager, free) is None, "the abandoned row deleted")
    assert manager._locker.registry.get(free) is None
    runner.finish()
    # The key is free for the next request.
    manager.acquire(free, blocking=False).release()


@SERVERS
def test_a_queued_grant_counts_its_lease_from_its_statement(
    db_url: str, make_manager: Callable[..., LockManager], key: str
) -> None:
    """A request that queued (here 1.5 s behind a statement held up and not
    taken as stuck) is granted with its whole lease: counted from when its
    own statement was sent, not from when it asked."""
    manager = make_manager()
    one_at_a_time(manager)
    runner = Runner()
    with gate_row(db_url, manager, f"{key}:gate") as gate:
        runner.start("gate", lambda: manager.acquire(f"{key}:gate", blocking=False))
        wait_until(gate.blocking, "the gate's statement waiting", step=0.15)
        threading.Timer(1.5, gate.open).start()
        held = manager.acquire(f"{key}:late", ttl=1.0, blocking=False)
    assert held.remaining > 0.7, held.remaining
    assert held.owned()
    held.check()
    held.release()
    runner.join()
    runner.finish()


# -- asyncio -------------------------------------------------------------


@LOCKS_HOLD_ONE
def test_async_a_stuck_statement_holds_up_no_other_request(
    db_url: str, make_manager: Callable[..., LockManager], key: str
) -> None:
    """The asyncio face: one task's statement held up by a row lock; the
    other tasks meet their timeouts and fail-fast and get whole leases, and
    a task whose batch is stuck leaves at its deadline."""
    m = make_manager()
    other = make_manager()
    held_elsewhere = other.acquire(f"{key}:held")
    fence_row(m, f"{key}:0stuck")
    gate = Gate(db_url, m, f"{key}:0stuck")
    timer = threading.Timer(HOLD, gate.open)
    timer.start()

    async def timed(coro: Any) -> tuple[Any, float]:
        start = time.monotonic()
        try:
            got = await coro
        except Exception as exc:
            got = exc
        return got, time.monotonic() - start

    async def main() -> None:
        am = AsyncLockManager(m)
        try:
            stuck = asyncio.create_task(timed(am.acquire(f"{key}:0stuck", blocking=False)))
            deadline = time.monotonic() + 10
            while not gate.blocking():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.15)
            a, took_a = await timed(am.acquire(f"{key}:a", timeout=0.5))
            b, took_b = await timed(am.acquire(f"{key}:b", blocking=False))
            c, took_c = await timed(am.acquire(f"{key}:c", ttl=2))
            d, took_d = await timed(am.acquire(f"{key}:held", timeout=0.3))
            for got, took in ((a, took_a), (b, took_b), (c, took_c)):
                assert not isinstance(got, BaseException), got
                assert took < QUICK, (got.key, took)
                assert got.owned()
            assert c.remaining > 2 - QUICK, c.remaining
            assert isinstance(d, LockTimeout), d
            assert took_d < 0.3 + QUICK, took_d
            for got in (a, b, c):
                await got.release()
            assert not stuck.done()
            gate.open()
            got, _ = await stuck
            await got.release(force=True)  # (its task ended: the lock is handed over)
        finally:
            await am.close()

    try:
        asyncio.run(main())
    finally:
        timer.cancel()
        gate.open()
        held_elsewhere.release()


@SERVERS
def test_async_a_task_in_a_stuck_batch_leaves_at_its_deadline(
    db_url: str, make_manager: Callable[..., LockManager], key: str
) -> None:
    m = make_manager()
    stuck, free = f"{key}:0stuck", f"{key}:free"
    fence_row(m, stuck)

    async def main() -> None:
        am = AsyncLockManager(m)
        assert am._abatcher is not None
        lane = am._abatcher._lanes_here()[0]
        lane.stall = float("inf")  # so that both queue behind the gate, then go together
        gate = Gate(db_url, m, f"{key}:gate")
        block = Gate(db_url, m, stuck)
        try:
            first = asyncio.create_task(am.acquire(f"{key}:gate", blocking=False))
            deadline = time.monotonic() + 10
            while not gate.blocking():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.15)
            second = asyncio.create_task(am.acquire(stuck, blocking=False))
            await asyncio.sleep(0.05)
            start = time.monotonic()
            third = asyncio.create_task(am.acquire(free, timeout=1.0))
            await asyncio.sleep(0.05)
            assert len(lane.queue) == 2
            gate.open()
            with pytest.raises(LockTimeout):
                await third
            took = time.monotonic() - start
            assert 1.0 <= took < 1.0 + QUICK, took
            block.open()
            for task in (first, second):
                await (await task).release()
        finally:
            gate.open()
            block.open()
            await am.close()

    asyncio.run(main())
    wait_until(lambda: row_of(m, free) is None, "the abandoned row deleted")
    m.acquire(free, blocking=False).release()


# -- a grant that came back expired (defect 4) -----------------------------


@pytest.mark.parametrize("batch", [True, False])
def test_a_grant_that_came_back_expired_is_not_handed_back(
    db_url: str, make_manager: Callable[..., LockManager], key: str, batch: bool
) -> None:
    """The acquire's statement is held up (a row lock; on SQLite the file's
    write lock) for longer than the lease it asks for: its grant comes back
    with the lease run out by this process's clock. A waiting request
    deletes that row and goes on (granted again, with a whole lease); a
    fail-fast one raises and leaves no row."""
    manager = make_manager(batch=batch)
    if manager.dialect == "sqlite":
        # The statement waits for the write lock the gate holds, not the
        # 40 ms after which it would answer "held" (tests/test_sqlite_busy.py).
        manager.store.acquire_busy = 30.0  # type: ignore[attr-defined]
    for blocking in (True, False):
        k = f"{key}:{blocking}"
        with gate_row(db_url, manager, k) as gate:
            threading.Timer(0.6, gate.open).start()
            if blocking:
                held = manager.acquire(k, ttl=0.3, timeout=10)
            else:
                with pytest.raises(LockBusy):
                    manager.acquire(k, ttl=0.3, blocking=False)
        if blocking:
            assert held.remaining > 0.15, held.remaining
            assert held.owned()
            held.check()
            assert row_of(manager, k).token == held.token  # type: ignore[union-attr]
            held.release()
        else:
            assert row_of(manager, k) is None
            assert manager._locker.registry.get(k) is None
