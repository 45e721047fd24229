"""The asyncio face on every asyncio driver it speaks: psycopg 3 and asyncpg
on PostgreSQL, aiomysql and asyncmy on MariaDB, aiosqlite on SQLite (given
its asyncio URL form, and the blocking one, which picks it). A driver that
is not installed fails these tests (the dev extra installs every one).

Each test runs on both drivers of its server (``driver0``, ``driver1``):
acquire and release, contention between two managers, a waiter woken by a
release (promptly: the wake-up path, not the re-check), a timeout, a
cancellation at each turn of the event loop during an acquire, an
application's ``AsyncEngine``, and the drivers' errors translated as the
blocking side's."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from dblock import (
    AsyncLockManager,
    BackendError,
    ConnectionLost,
    LockBusy,
    LockManager,
    LockTimeout,
    PoolerMismatch,
)
from tests.conftest import row_of
from tests.support.db import ASYNC_DRIVERS, ASYNC_FORMS, async_form, driver_form

pytestmark = pytest.mark.databases("sqlite", "postgresql", "mariadb")

assert {db: tuple(d for d, _ in forms if d) for db, forms in ASYNC_FORMS.items()} == ASYNC_DRIVERS

#: How long a waiter may take to get a released key: a wake-up's round
#: trips on a loaded machine. On PostgreSQL every re-check and poll is set
#: 30 s away (``SLOW``), so only the release's NOTIFY can be that prompt;
#: elsewhere the waiters keep the default polling (a wake-up of MariaDB's
#: named locks or SQLite's sockets may be missed, costing the poll it
#: replaces, at most ``poll_max``, 0.5 s).
PROMPT = 1.0
SLOW = {"notify_recheck": 30.0, "poll_initial": 30.0, "poll_max": 30.0}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(params=[0, 1], ids=["driver0", "driver1"])
def form(request: pytest.FixtureRequest, db: str, db_url: str) -> tuple[str, str]:
    """(the URL in this test's asyncio form, the driver it must speak)."""
    return driver_form(db, db_url, request.param)


def make(url: str, spoken: str, **options: Any) -> AsyncLockManager:
    alocks = AsyncLockManager(url, **options)
    assert alocks.astore.engine.sync_engine.dialect.driver == spoken
    return alocks


@pytest.fixture
def pair(form: tuple[str, str], db: str) -> Iterator[tuple[AsyncLockManager, AsyncLockManager]]:
    """Two managers (two processes, as far as level 1 goes) on this form."""
    url, spoken = form
    options = SLOW if db == "postgresql" else {}
    first, second = make(url, spoken, **options), make(url, spoken, **options)
    yield first, second
    for alocks in (first, second):
        alocks.sync.close()


@pytest.mark.parametrize("observed", [False, True], ids=["direct", "observed"])
def test_acquire_and_release(form: tuple[str, str], key: str, observed: bool) -> None:
    """``observed``: something listens for the engine's execution events,
    so every statement goes through SQLAlchemy's Connection (and the
    listener sees each one) instead of the driver's own connection."""
    url, spoken = form
    seen: list[str] = []

    async def main() -> None:
        alocks = make(url, spoken)
        if observed:
            sa.event.listen(
                alocks.astore.engine.sync_engine,
                "before_cursor_execute",
                lambda conn, cursor, statement, *args: seen.append(statement),
            )
        try:
            async with alocks.lock(key, ttl=10) as held:
                row = row_of(alocks.sync, key)
                assert row is not None
                assert row.token == held.token
                assert held.fence is not None
            assert row_of(alocks.sync, key) is None
            held = await alocks.acquire(key)
            await held.release()
            assert row_of(alocks.sync, key) is None
        finally:
            await alocks.close()

    run(main())
    assert bool(seen) == observed


def test_contention_between_two_managers(
    pair: tuple[AsyncLockManager, AsyncLockManager], key: str
) -> None:
    first, second = pair

    async def main() -> None:
        async with first.lock(key):
            with pytest.raises(LockBusy):
                async with second.lock(key, blocking=False):
                    pass
        async with second.lock(key, blocking=False):
            with pytest.raises(LockBusy):
                await first.acquire(key, blocking=False)
        # Tasks of both managers take turns on one key: never two at once.
        inside = 0
        most = 0

        async def take(alocks: AsyncLockManager) -> None:
            nonlocal inside, most
            for _ in range(5):
                async with alocks.lock(key, timeout=30):
                    inside += 1
                    most = max(most, inside)
                    await asyncio.sleep(0.002)
                    inside -= 1

        await asyncio.gather(*(take(m) for m in (first, second, first, second)))
        assert most == 1
        await first.close()
        await second.close()

    run(main())


def test_a_waiter_is_woken_promptly_by_a_release(
    pair: tuple[AsyncLockManager, AsyncLockManager], key: str
) -> None:
    """The waiter of another manager gets the key within a wake-up's round
    trips of the release. On PostgreSQL, with every re-check and poll 30 s
    away: the release's NOTIFY (its statement's, whatever the asyncio driver
    that sent it) reaches the process's listener, which wakes the task."""
    first, second = pair

    async def main() -> list[float]:
        handoffs = []
        for _ in range(3):
            held = await first.acquire(key)
            got = asyncio.get_running_loop().create_future()

            async def wait(got: asyncio.Future[float] = got) -> None:
                async with second.lock(key, timeout=60):
                    got.set_result(time.monotonic())

            waiter = asyncio.create_task(wait())
            await asyncio.sleep(0.3)  # queued, asleep
            assert not got.done()
            released = time.monotonic()
            await held.release()
            handoffs.append(await got - released)
            await waiter
        await first.close()
        await second.close()
        return handoffs

    handoffs = run(main())
    assert max(handoffs) < PROMPT, handoffs


def test_a_timeout(pair: tuple[AsyncLockManager, AsyncLockManager], key: str) -> None:
    first, second = pair

    async def main() -> float:
        async with first.lock(key):
            started = time.monotonic()
            with pytest.raises(LockTimeout):
                await second.acquire(key, timeout=0.5)
            waited = time.monotonic() - started
        async with second.lock(key, timeout=5):
            pass
        await first.close()
        await second.close()
        return waited

    assert 0.4 < run(main()) < 5


@pytest.mark.parametrize("contended", [False, True], ids=["free", "held"])
def test_an_acquire_cancelled_at_each_turn_leaves_nothing_held(
    pair: tuple[AsyncLockManager, AsyncLockManager], key: str, contended: bool
) -> None:
    """An acquire cancelled after 0, 1, 2, ... turns of the event loop (so
    at each of its awaits in turn, its statements mid-flight included)
    until one completes uncancelled: the key is free afterwards each time
    (an INSERT that committed unseen is deleted by its token) and another
    manager takes it. ``held``: the key is held by the other manager until
    just after the cancellation (the acquire was waiting, or had just
    been granted it)."""
    first, second = pair

    async def free() -> None:
        deadline = time.monotonic() + 15
        while True:
            try:
                await (await second.acquire(key, blocking=False)).release()
            except LockBusy:
                assert time.monotonic() < deadline, "the key stayed taken"
                await asyncio.sleep(0.01)
            else:
                return

    async def main() -> int:
        turns = 0
        while True:
            holder = await second.acquire(key) if contended else None
            task = asyncio.create_task(first.acquire(key, timeout=30))
            for _ in range(turns):
                await asyncio.sleep(0)
            if holder is not None:
                await holder.release()
                for _ in range(turns % 7):
                    await asyncio.sleep(0)
            if task.done():
                await (await task).release()
                await free()
                return turns
            task.cancel()
            try:
                held = await task
            except asyncio.CancelledError:
                pass
            else:  # it had its lock just as it was cancelled: it keeps it
                await held.release()
            assert first.sync._locker.registry.get(key) is None
            await free()
            turns += 1
            if contended and turns > 60:
                return turns

    try:
        turns = run(main())
    finally:
        run(first.close())
        run(second.close())
    assert turns > 2


def test_an_applications_async_engine(form: tuple[str, str], key: str) -> None:
    from sqlalchemy.ext.asyncio import create_async_engine

    url, spoken = form
    if "+" not in sa.make_url(url).drivername:  # the blocking form: not an AsyncEngine's
        url = async_form(url, spoken)

    async def main() -> None:
        engine = create_async_engine(url, pool_size=3)
        alocks = AsyncLockManager(engine)
        assert alocks.astore.engine.sync_engine.dialect.driver == spoken
        assert alocks.astore.engine is not engine  # connections of its own
        try:
            async with alocks.lock(key) as held:
                assert row_of(alocks.sync, key) is not None
                assert held.fence is not None
        finally:
            await alocks.close()
            await engine.dispose()

    run(main())


# -- the drivers' errors, translated as the blocking side's -------------------------


@pytest.mark.databases("postgresql", "mariadb")
def test_a_connection_killed_under_the_driver_is_connection_lost(
    form: tuple[str, str], db: str, db_url: str, key: str
) -> None:
    """The server ends the session of an idle pooled connection (as a
    restart or a failover would): the next statement on it fails as dblock's
    ConnectionLost (never the driver's own exception) or succeeds on a new
    connection, and the one after works."""
    url, spoken = form

    async def main() -> None:
        alocks = make(url, spoken, async_engine_options={"pool_size": 4})
        try:
            await (await alocks.acquire(f"{key}-warm")).release()
            pool = alocks.astore._pool()
            assert pool.idle  # the direct path's idle connections
            store = alocks.sync.store
            sessions = [store.server_thread(conn.driver_connection) for conn, _ in pool.idle]
            killer = sa.create_engine(db_url, isolation_level="AUTOCOMMIT")
            with killer.connect() as conn:
                for session in sessions:
                    conn.exec_driver_sql(
                        f"SELECT pg_terminate_backend({session})"
                        if db == "postgresql"
                        else f"KILL CONNECTION {session}"
                    )
            killer.dispose()
            await asyncio.sleep(0.2)
            with contextlib.suppress(ConnectionLost):
                await (await alocks.acquire(key)).release()
            async with alocks.lock(key, timeout=10):
                pass
        finally:
            await alocks.close()

    run(main())


@pytest.mark.databases("postgresql", "mariadb")
def test_a_missing_table_is_told_as_on_the_blocking_side(form: tuple[str, str], key: str) -> None:
    """A statement the server refuses for want of the lock table (the
    driver's SQLSTATE 42P01, errno 1146) is SchemaMissing, as on the
    blocking side."""
    from dblock import SchemaMissing

    url, spoken = form

    async def main() -> None:
        alocks = make(url, spoken, table="dblock_no_such_table")
        try:
            with pytest.raises(SchemaMissing, match="dblock_no_such_table"):
                await alocks.acquire(key)
        finally:
            await alocks.close()

    run(main())


@pytest.mark.databases("postgresql", "mariadb")
def test_losers_of_contention_are_recognised(db: str, db_url: str) -> None:
    """The dialect's retry rule reads the asyncio driver's error as the
    blocking driver's: a deadlock victim (PostgreSQL 40P01, serialization
    40001; MySQL/MariaDB 1213, 1205) is run again, another error is not."""
    with LockManager(db_url) as manager:
        store = manager.store

        def lost(cause: BaseException) -> bool:
            try:
                raise BackendError("statement failed") from cause
            except BackendError as exc:
                return bool(store.lost_contention(exc)) and store.retry("x", exc, 0) is not None

        if db == "postgresql":
            import asyncpg

            assert lost(asyncpg.exceptions.DeadlockDetectedError("deadlock detected"))
            assert lost(asyncpg.exceptions.SerializationError("could not serialize"))
            assert not lost(asyncpg.exceptions.UniqueViolationError("duplicate key"))
        else:
            from asyncmy import errors

            assert lost(errors.OperationalError(1213, "Deadlock found"))
            assert lost(errors.OperationalError(1205, "Lock wait timeout exceeded"))
            assert not lost(errors.IntegrityError(1062, "Duplicate entry"))


def test_asyncpg_statements_are_translated_once_each() -> None:
    """psycopg's named parameters in asyncpg's numbered ones: a name used
    twice gets one number, ``%%`` is a percent sign; cached per text."""
    from dblock._store.aio import numbered

    sql = "SELECT %(key)s, %(ttl)s, %(key)s LIKE 'a%%'"
    assert numbered(sql) == ("SELECT $1, $2, $1 LIKE 'a%'", ("key", "ttl"))
    assert numbered(sql) is numbered(sql)


@pytest.mark.databases("postgresql")
def test_asyncpgs_prepared_statements_behind_a_pooler_are_told_as_psycopgs(db_url: str) -> None:
    """Without ``pooler=True`` behind a transaction-mode pooler, asyncpg's
    cached statements (``__asyncpg_stmt_N__``) may be missing on the next
    server connection: the error says what it means, as psycopg's does
    (tests/test_pgbouncer.py shows psycopg's through a real pgbouncer)."""
    import asyncpg

    with LockManager(db_url) as manager:
        translate = manager.store.executor.translate
        missing = asyncpg.exceptions.InvalidSQLStatementNameError(
            'prepared statement "__asyncpg_stmt_1f__" does not exist'
        )
        told = translate(missing, sent=True)
        assert isinstance(told, PoolerMismatch)
        assert "pass pooler=True" in str(told)
        assert "statement_cache_size=0" in str(told)
        other = translate(asyncpg.exceptions.UniqueViolationError("duplicate key"), sent=True)
        assert "pooler" not in str(other)


def test_one_manager_across_event_loops(form: tuple[str, str], key: str) -> None:
    """A manager used from one ``asyncio.run`` after another (Django's loop
    per request under WSGI): the connections of a closed loop are dropped
    (asyncpg's and asyncmy's sockets closed without their dead loop, and
    quietly: no ResourceWarning of an unclosed connection of the driver),
    and each new loop gets connections of its own."""
    import gc
    import warnings

    url, spoken = form
    alocks = make(url, spoken)

    async def once() -> None:
        async with alocks.lock(key, timeout=10):
            pass

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        try:
            for _ in range(3):
                asyncio.run(once())
            gc.collect()
        finally:
            run(alocks.close())
        gc.collect()
    assert row_of(alocks.sync, key) is None
    if spoken != "aiomysql":  # (aiomysql's stream warns of its closed loop)
        unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        # (An unclosed transport names no driver: another test's, collected here.)
        assert not [m for m in unclosed if spoken in m], unclosed


def test_an_acquire_cancelled_while_connecting_is_cancelled(
    form: tuple[str, str], key: str
) -> None:
    """A manager's first acquire (its connection being opened: asyncmy's
    handshake swallows a cancellation at some of its awaits) cancelled after
    0, 1, 2, ... turns of the loop: the task is cancelled, never handed a
    lock it no longer waits for, and the key stays free."""
    url, spoken = form

    async def main() -> int:
        turns = 0
        while True:
            alocks = make(url, spoken)
            try:
                task = asyncio.create_task(alocks.acquire(key, timeout=30))
                for _ in range(turns):
                    await asyncio.sleep(0)
                if task.done():
                    await (await task).release()
                    return turns
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                # (A row its INSERT committed unseen is deleted by its token, soon.)
                async with alocks.lock(key, timeout=15):
                    pass
            finally:
                await alocks.close()
            turns += 1

    assert run(main()) > 2
