"""Cancelling asyncio acquisitions whose statement is in flight, on the three
databases and each of their asyncio drivers (``driver0``, ``driver1``: psycopg
and asyncpg, aiomysql and asyncmy; SQLite's asyncio and blocking URL forms,
both aiosqlite): what is logged (a cancellation on a healthy database is ordinary,
DEBUG; the "may have committed while the database was unreachable" WARNING
only when it was), and how soon the cancellation takes effect.

A statement is held in flight the way the database itself holds it: the
key's row locked by another transaction (``SELECT … FOR UPDATE`` on
PostgreSQL and MariaDB), or SQLite's write lock taken by another connection
(``BEGIN IMMEDIATE``), so the acquirer's INSERT waits inside the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from dblock import AsyncLockManager, LockManager
from tests.conftest import row_of
from tests.support.db import driver_form
from tests.support.innodb import innodb_count
from tests.support.proxy import Proxy

MAY_HAVE_COMMITTED = "may have committed while the database was unreachable"


def _nothing(*args: Any) -> None:
    pass


@pytest.fixture(params=[0, 1], ids=["driver0", "driver1"])
def which(request: pytest.FixtureRequest) -> int:
    """Which of its server's asyncio forms a test runs on (see driver_form)."""
    return int(request.param)


def on_driver(db: str, url: str, which: int, **options: Any) -> AsyncLockManager:
    """An AsyncLockManager on ``url`` (a blocking form) through the
    ``which``-th asyncio driver of its database."""
    form, spoken = driver_form(db, url, which)
    alocks = AsyncLockManager(form, **options)
    assert alocks.astore.engine.sync_engine.dialect.driver == spoken
    return alocks


@contextlib.contextmanager
def statements_held(db_url: str, keys: list[str], table: str = "dblock_locks") -> Iterator[int]:
    """While inside, a statement acquiring one of ``keys`` (rows some other
    manager holds) waits in the database. Yields the server's id of the
    session holding the rows (PostgreSQL's backend pid, MySQL's connection
    id; 0 on SQLite), for :func:`blocked_by`."""
    url = sa.make_url(db_url)
    if url.get_backend_name() == "sqlite":
        conn = sqlite3.connect(url.database or "", isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")  # the file's write lock
        try:
            yield 0
        finally:
            conn.execute("ROLLBACK")
            conn.close()
        return
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as sa_conn, sa_conn.begin() as tx:
            quoted = sa_conn.dialect.identifier_preparer.quote(table)
            rows = sa_conn.execute(
                sa.text(
                    f"SELECT lock_key FROM {quoted} WHERE lock_key IN :keys FOR UPDATE"
                ).bindparams(sa.bindparam("keys", expanding=True)),
                {"keys": keys},
            ).all()
            assert len(rows) == len(keys)  # each row is there, and locked
            session = (
                "SELECT pg_backend_pid()" if "postgresql" in db_url else "SELECT CONNECTION_ID()"
            )
            yield int(sa_conn.exec_driver_sql(session).scalar_one())
            tx.rollback()
    finally:
        engine.dispose()


def blocked_by(db_url: str, session: int) -> int:
    """How many sessions wait in the server for row locks ``session`` holds
    (asked on a connection of its own: PostgreSQL keeps one transaction's
    view of its activity for the whole transaction)."""
    if "postgresql" in db_url:
        sql = "SELECT count(*) FROM pg_stat_activity WHERE :s = ANY(pg_blocking_pids(pid))"
    else:
        sql = (
            "SELECT count(*) FROM information_schema.INNODB_LOCK_WAITS w "
            "JOIN information_schema.INNODB_TRX b ON b.trx_id = w.blocking_trx_id "
            "WHERE b.trx_mysql_thread_id = :s"
        )
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            if "postgresql" in db_url:
                return int(conn.execute(sa.text(sql), {"s": session}).scalar_one())
            # (InnoDB's lock tables stay stale while read more often than
            # every 0.1 s: polled at 10 ms, the wait never showed.)
            return innodb_count(conn, sql, {"s": session})
    finally:
        engine.dispose()


def mentions(caplog: pytest.LogCaptureFixture, text: str, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage() and r.levelno == level]


async def until(condition: Any, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def test_a_cancellation_storm_on_a_healthy_database_logs_no_warning(
    manager: LockManager,
    make_manager: Any,
    db: str,
    db_url: str,
    which: int,
    keys: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Tasks cancelled with their INSERT waiting in the database: every
    outcome is settled by token (no row of theirs stays), at DEBUG; none of
    them is reported as a database fault."""
    caplog.set_level(logging.DEBUG, logger="dblock")
    names = keys(8)
    holder = make_manager()
    held = [holder.acquire(k, ttl=60) for k in names]
    alocks = on_driver(db, db_url, which)

    async def main() -> None:
        with statements_held(db_url, names):
            tasks = [asyncio.create_task(alocks.acquire(k, timeout=60)) for k in names]
            await asyncio.sleep(0.5)  # every INSERT sent, and waiting in the database
            for task in tasks:
                task.cancel()
            await asyncio.sleep(0.1)
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results), results
        await until(lambda: not alocks.sync.store.has_orphans)
        await alocks.close()

    asyncio.run(main())
    assert mentions(caplog, MAY_HAVE_COMMITTED, logging.WARNING) == []
    quiet = mentions(caplog, "was interrupted with its statement sent", logging.DEBUG)
    # One DEBUG line per cancelled request whose statement was sent; with
    # group commit, one still queued behind the batches in flight was never
    # sent, and has nothing to settle. SQLite: most often none. Each INSERT
    # waits for the write lock held here, which it never gets: cancelled in
    # that wait (or between two attempts) it is known to have written nothing.
    assert (0 if db_url.startswith("sqlite") else 1) <= len(quiet) <= len(names)
    # dblock's own lines: SQLAlchemy's pool may log the garbage collection of
    # another test's unreturned connection while this one runs (seen in CI).
    assert not [
        r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("dblock")
    ]
    for h in held:  # the holder's rows were never touched
        row = row_of(manager, h.key)
        assert row is not None
        assert row.token == h.token
        h.release()


def test_a_cancelled_semaphore_acquisition_is_settled_quietly(
    db: str, db_url: str, which: int, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The same for a semaphore's permit (whose clean-up of an unsettled
    permit failed on a missing attribute, every renewal pass)."""
    caplog.set_level(logging.DEBUG, logger="dblock")
    alocks = on_driver(db, db_url, which)
    manager = alocks.sync

    async def main() -> None:
        task: asyncio.Task[Any] | None = None
        engine = alocks._astore.engine.sync_engine

        def cancel(*_args: Any) -> None:
            if task is not None:
                task.cancel()

        sa.event.listen(engine, "after_cursor_execute", cancel)
        try:
            task = asyncio.create_task(alocks.semaphore(key, permits=2).__aenter__())
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            sa.event.remove(engine, "after_cursor_execute", cancel)
        await until(lambda: not manager._locker.store.has_orphans)
        await until(lambda: not any(s.has_orphans for s in _permit_stores(manager)))
        async with alocks.semaphore(key, permits=2) as one, alocks.semaphore(key, permits=2):
            assert one.permits == 2  # both permits free: nothing was left behind
        await alocks.close()

    asyncio.run(main())
    # dblock's own lines: SQLAlchemy's pool may log the garbage collection of
    # another test's unreturned connection while this one runs (seen in CI).
    assert not [
        r for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("dblock")
    ]
    assert mentions(caplog, "was interrupted with its statement sent", logging.DEBUG)


def _permit_stores(manager: LockManager) -> list[Any]:
    semaphores = manager._semaphores
    return [] if semaphores is None else [semaphores.store]


@pytest.mark.databases("postgresql", "mariadb")
def test_a_cancellation_while_the_database_is_unreachable_warns(
    make_manager: Any,
    db: str,
    db_url: str,
    which: int,
    key: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The warning is for the case it describes: a task cancelled with its
    INSERT in flight as the database goes away. Its row is deleted once the
    database answers again."""
    caplog.set_level(logging.DEBUG, logger="dblock")
    url = sa.make_url(db_url)
    proxy = Proxy(url.host or "127.0.0.1", url.port or (5432 if "postgresql" in db_url else 3306))
    holder = make_manager()
    held = holder.acquire(key, ttl=60)
    alocks = on_driver(db, proxy.url_for(db_url), which, ttl=1.0)  # renewal every 1/3 s

    async def main() -> None:
        with statements_held(db_url, [key]) as session:
            task = asyncio.create_task(alocks.acquire(key, timeout=60))
            # Cancelled once its INSERT waits in the server (a fixed 0.5 s was
            # too short for a loaded machine: still queued, nothing was sent).
            await until(lambda: blocked_by(db_url, session) > 0)
            task.cancel()
            proxy.refuse(True)
            proxy.cut_all()
            with pytest.raises(asyncio.CancelledError):
                await task
        await until(lambda: mentions(caplog, MAY_HAVE_COMMITTED, logging.WARNING))
        proxy.refuse(False)
        await until(lambda: not alocks.sync.store.has_orphans)
        await alocks.close()

    try:
        asyncio.run(main())
    finally:
        proxy.close()
    assert mentions(caplog, MAY_HAVE_COMMITTED, logging.WARNING) == [
        f"dblock: acquisition of {key!r} may have committed while the database was "
        "unreachable; its row will be deleted once the database answers"
    ]
    assert mentions(caplog, f"removed the row of {key!r}", logging.INFO)
    row = row_of(holder, key)
    assert row is not None
    assert row.token == held.token
    held.release()


def test_a_cancelled_task_stops_waiting_at_once(
    manager: LockManager, make_manager: Any, db: str, db_url: str, which: int, key: str
) -> None:
    """A task whose INSERT waits inside the database (SQLite: for the file's
    write lock, under its 30 s busy timeout) is cancelled: the cancellation
    takes effect at once, not when the database lets the statement go, and
    nothing of the request is left."""
    holder = make_manager()
    held = holder.acquire(key, ttl=60)
    alocks = on_driver(db, db_url, which)

    async def main() -> float:
        with statements_held(db_url, [key]):
            task = asyncio.create_task(alocks.acquire(key, timeout=60))
            await asyncio.sleep(0.5)  # the INSERT waits in the database
            assert not task.done()
            cancelled_at = time.monotonic()
            task.cancel()
            # The database keeps the statement waiting for 8 s more, unless
            # the cancellation ends it first.
            done, _ = await asyncio.wait((task,), timeout=8.0)
            delay = time.monotonic() - cancelled_at
            assert done, "the cancellation waited for the database"
            with pytest.raises(asyncio.CancelledError):
                await task
        await until(lambda: not alocks.sync.store.has_orphans)
        await alocks.close()
        return delay

    delay = asyncio.run(main())
    print(f"cancellation took {delay * 1000:.0f} ms")
    assert delay < 0.5
    assert row_of(manager, key).token == held.token  # type: ignore[union-attr]
    held.release()
    with manager.lock(key, blocking=False):  # the key works as if nothing happened
        pass


@pytest.mark.databases("sqlite")
def test_an_async_statement_still_waits_out_the_write_lock(
    manager: LockManager, db_url: str, key: str
) -> None:
    """The wait for SQLite's write lock is taken in slices, but as a whole it
    is the request's: a write lock held for a second (many slices) delays
    the grant of a request with a timeout, it does not fail it. (A fail-fast
    one is refused within 0.1 s: tests/test_sqlite_busy.py.)"""
    alocks = AsyncLockManager(manager)

    async def take() -> float:
        async with alocks.lock(key, timeout=10):
            return time.monotonic()

    async def main() -> float:
        started = time.monotonic()
        with statements_held(db_url, [key]):
            task = asyncio.create_task(take())
            await asyncio.sleep(1.0)
            assert not task.done()
        waited = await task - started
        await alocks.close()
        return waited

    assert asyncio.run(main()) >= 1.0


@pytest.mark.databases("postgresql", "mariadb")
@pytest.mark.parametrize("observed", [False, True], ids=["direct", "observed"])
def test_a_statement_reaching_the_server_after_its_task_was_cancelled_leaves_no_row(
    db: str, db_url: str, which: int, key: str, observed: bool
) -> None:
    """The acquire's INSERT is on its way (here held by a proxy, as a slow
    network would) when its task is cancelled. The statement still reaches
    the server, which runs it: closing the client's connection does not stop
    a statement the server has been sent. The row it writes must still be
    deleted, not left to block the key until its lease ends. (PyMySQL's
    asyncio sibling just dropped the connection, and the DELETE of the
    orphan ran before the late INSERT: the key stayed taken for the lease.)"""
    url = sa.make_url(db_url)
    proxy = Proxy(url.host or "127.0.0.1", url.port or (5432 if "postgresql" in db_url else 3306))
    alocks = on_driver(db, proxy.url_for(db_url), which, ttl=60)
    store = alocks.sync.store
    if observed:  # a listener on the engine: statements go through SQLAlchemy's Connection
        sa.event.listen(alocks._astore.engine.sync_engine, "before_cursor_execute", _nothing)

    async def main() -> None:
        await (await alocks.acquire(f"{key}-warm")).release()  # connections made
        held, let_go = proxy.hold(key.encode())
        task = asyncio.create_task(alocks.acquire(key))
        assert await asyncio.to_thread(held.wait, 10), "the INSERT never went out"
        task.cancel()
        await asyncio.wait((task,), timeout=2)
        # Give the cleaner its chance to delete the orphan too early.
        deadline = time.monotonic() + 2
        while store.has_orphans and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        let_go.set()  # the INSERT reaches the server now, and runs
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: not store.has_orphans, 10)
        await alocks.close()

    try:
        asyncio.run(main())
    finally:
        proxy.close()
    with LockManager(db_url) as m:
        deadline = time.monotonic() + 5
        while row_of(m, key) is not None:
            assert time.monotonic() < deadline, "the late INSERT's row stayed (lease 60 s)"
            time.sleep(0.05)


def test_a_task_cancelled_while_releasing_several_locks_releases_them_all(
    manager: LockManager,
    db: str,
    db_url: str,
    which: int,
    keys: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``lock_many``'s exit releases its locks one by one, newest first. A
    cancellation during the first release (its DELETE waiting in the
    database) must not leave the older ones held: they go at once on the
    renewal thread, although the task catches the cancellation and lives
    on, and nobody is told they were "never released"."""
    caplog.set_level(logging.WARNING, logger="dblock")
    names = sorted(keys(3))
    alocks = on_driver(db, db_url, which)

    async def main() -> None:
        entered, leave, stay = asyncio.Event(), asyncio.Event(), asyncio.Event()
        got: list[Any] = []

        async def holder() -> None:
            try:
                async with alocks.lock_many(names) as held:
                    got.append(held)
                    entered.set()
                    await leave.wait()
            except asyncio.CancelledError:
                await stay.wait()  # alive: what it held is not reaped as abandoned

        task = asyncio.create_task(holder())
        await entered.wait()
        newest = got[0][names[-1]].held
        with statements_held(db_url, [names[-1]]):
            leave.set()
            # Its release of the newest key under way: its DELETE waits in the database.
            await until(lambda: newest.state.released)
            await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.sleep(0.1)
        await until(lambda: all(row_of(manager, k) is None for k in names), 10)
        assert not task.done()
        stay.set()
        await task
        await alocks.close()

    asyncio.run(main())
    assert "never released" not in caplog.text
    assert "ended without releasing" not in caplog.text
