"""The asyncio face's remaining guarantees (issue 11) on the three databases:
``until=`` an ``AsyncSession`` (the lock covers the commit), a deferred lock
outliving the task that took it, ``await held.extend()`` on the async engine,
and a forked child that never touches its parent's async connections."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_scoped_session,
    async_sessionmaker,
    create_async_engine,
)

from dblock import AsyncLockManager, LockArgumentError, LockBusy, LockLost, LockManager, LockNotHeld
from dblock._store.aio import async_url
from dblock.adeferral import aexit_deferring
from tests.conftest import row_of
from tests.support.counting import StatementCounter
from tests.support.db import ASYNC_FORMS, async_form, driver_form, private_database


async def until(condition: Callable[[], object], seconds: float = 30.0) -> None:
    """Wait (without blocking the loop) for a state, not for a time."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


def held_elsewhere(manager: LockManager, key: str) -> bool:
    """Does another process (a manager of its own) find ``key`` busy?"""
    try:
        with manager.lock(key, blocking=False):
            return False
    except LockBusy:
        return True


@pytest.fixture(params=[0, 1], ids=["driver0", "driver1"])
def which(request: pytest.FixtureRequest) -> int:
    """Which asyncio driver of its database both the manager and the
    application's engine speak (tests/support/db.py: psycopg and asyncpg,
    aiomysql and asyncmy; aiosqlite in both URL forms)."""
    return int(request.param)


@pytest.fixture
def alocks(db: str, db_url: str, which: int) -> Iterator[AsyncLockManager]:
    url, _ = driver_form(db, db_url, which)
    a = AsyncLockManager(url)
    yield a
    asyncio.run(a.close())


@pytest.fixture
def other(make_manager: Any) -> LockManager:
    return make_manager()  # type: ignore[no-any-return]


@pytest.fixture
def bank_url(db: str, tmp_path: Path, which: int) -> Iterator[str]:
    """An application database with one account holding 100 (async URL, on
    the test's asyncio driver)."""
    with private_database(db, tmp_path) as url:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE account (id INTEGER PRIMARY KEY, balance INTEGER)"))
            conn.execute(sa.text("INSERT INTO account VALUES (1, 100)"))
        engine.dispose()
        driver = ASYNC_FORMS[db][which][0]
        if driver is None:
            yield async_url(sa.make_url(url)).render_as_string(hide_password=False)
        else:
            yield async_form(url, driver)


def make_bank(url: str) -> AsyncEngine:
    connect_args = {"timeout": 30} if url.startswith("sqlite") else {}
    return create_async_engine(url, connect_args=connect_args)


# -- until=session -----------------------------------------------------------------


async def withdraw_all(url: str, alocks: AsyncLockManager, key: str, *, cover: bool) -> int:
    """20 tasks each withdraw 1 under the lock and commit after the locked
    block, as a request commits its session at its end; the final balance."""
    engine = make_bank(url)

    async def withdraw() -> None:
        async with AsyncSession(engine) as session:
            async with alocks.lock(key, timeout=60, until=session if cover else None):
                result = await session.execute(sa.text("SELECT balance FROM account"))
                balance = result.scalar_one()
                await session.execute(
                    sa.text("UPDATE account SET balance = :b"), {"b": balance - 1}
                )
            await asyncio.sleep(0.02)  # the rest of the request, before its commit
            await session.commit()

    await asyncio.gather(*(withdraw() for _ in range(20)))
    async with engine.connect() as conn:
        balance = (await conn.execute(sa.text("SELECT balance FROM account"))).scalar_one()
    await engine.dispose()
    return int(balance)


@pytest.mark.databases("postgresql", "mariadb")
def test_an_async_lock_released_before_the_commit_loses_updates(
    bank_url: str, alocks: AsyncLockManager, key: str
) -> None:
    assert asyncio.run(withdraw_all(bank_url, alocks, key, cover=False)) > 80


@pytest.mark.databases("postgresql", "mariadb")
def test_until_async_session_loses_no_update(
    bank_url: str, alocks: AsyncLockManager, key: str
) -> None:
    assert asyncio.run(withdraw_all(bank_url, alocks, key, cover=True)) == 80


def test_until_async_session_releases_at_commit_rollback_and_close(
    bank_url: str, alocks: AsyncLockManager, other: LockManager, keys: Any
) -> None:
    k_commit, k_rollback, k_close, k_idle, k_many = keys(5)

    async def main() -> None:
        engine = make_bank(bank_url)
        gone = lambda k: lambda: not held_elsewhere(other, k)  # noqa: E731
        for key, end in ((k_commit, "commit"), (k_rollback, "rollback"), (k_close, "close")):
            session = AsyncSession(engine)
            await session.execute(sa.text("UPDATE account SET balance = balance - 1"))
            async with alocks.lock(key, until=session) as held:
                pass
            # The block is over, the transaction is not: the lock stays.
            assert not held.released
            assert await asyncio.to_thread(held_elsewhere, other, key)
            await getattr(session, end)()
            await until(lambda h=held: h.released)  # type: ignore[misc]
            await until(gone(key))
            assert row_of(other, key) is None
            await session.close()
        # No transaction open: released at the end of the block, as without until.
        async with AsyncSession(engine) as session:
            async with alocks.lock(k_idle, until=session) as held:
                pass
            assert held.released
        # lock_many, and a second end of the same transaction.
        async with AsyncSession(engine) as session:
            await session.execute(sa.text("SELECT 1"))
            async with alocks.lock_many([k_many, f"{k_many}:2"], until=session) as both:
                pass
            assert not any(h.released for h in both.values())
            await session.commit()
            await until(lambda: all(h.released for h in both.values()))
        await engine.dispose()

    asyncio.run(main())


def test_until_async_scoped_session_and_the_decorator(
    bank_url: str, alocks: AsyncLockManager, other: LockManager, key: str
) -> None:
    async def main() -> None:
        engine = make_bank(bank_url)
        scoped = async_scoped_session(async_sessionmaker(engine), scopefunc=asyncio.current_task)

        @alocks.locked(lambda: key, until=scoped)
        async def debit() -> None:
            await scoped().execute(sa.text("UPDATE account SET balance = balance - 1"))

        await debit()
        assert await asyncio.to_thread(held_elsewhere, other, key)
        await scoped().commit()
        await until(lambda: not held_elsewhere(other, key))
        await scoped.remove()
        # A scope with no session yet: nothing to cover, released at once.
        await asyncio.create_task(debit_without_session(alocks, key, scoped))
        await engine.dispose()

    asyncio.run(main())


async def debit_without_session(alocks: AsyncLockManager, key: str, scoped: Any) -> None:
    async with alocks.lock(key, until=scoped) as held:
        pass
    assert held.released


def test_until_must_be_a_session_before_any_sql(alocks: AsyncLockManager, key: str) -> None:
    with pytest.raises(LockArgumentError, match="AsyncSession"):
        alocks.lock(key, until=object())
    with pytest.raises(LockArgumentError, match="AsyncSession"):
        alocks.lock_many([key], until="session")
    with pytest.raises(LockArgumentError, match="AsyncSession"):
        alocks.locked(lambda: key, until=42)


# -- a deferred lock outlives the task that took it ---------------------------------


def test_a_deferred_async_lock_outlives_the_task_that_took_it(
    alocks: AsyncLockManager, other: LockManager, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The task that took the lock ends before the end its release waits for
    (a commit elsewhere, a response closed by the server): renewal keeps the
    lock, never releases it as abandoned; the trigger, fired on another
    thread, releases it on the loop through the async engine."""
    caplog.set_level(logging.WARNING, logger="dblock")
    kept: list[Any] = []

    async def request() -> Any:
        # A lease that a loaded CI worker still renews in time (a 0.3 s one
        # was lost on MariaDB when one renewal's answer took 0.2 s), short
        # enough that three renewal passes take a couple of seconds.
        held = await alocks.acquire(key, ttl=1.5)
        await aexit_deferring(held, lambda d, r: kept.append(d.trigger()), None, None)
        return held

    async def main() -> None:
        task = asyncio.create_task(request())
        held = await task
        assert task.done()
        # Three renewal passes after its task ended (each also looks at owners).
        for _ in range(3):
            before = held.expires_at
            await until(lambda b=before: held.expires_at != b or held.released or held.lost)  # type: ignore[misc]
            assert not held.released, "released before its trigger fired"
            assert not held.lost, "lost while renewal should have kept it"
        assert not held.lost
        assert await asyncio.to_thread(held_elsewhere, other, key)
        sync = StatementCounter(alocks.sync.engine)
        with sync:
            fire = threading.Thread(target=kept.pop())
            fire.start()
            await asyncio.to_thread(fire.join, 30)
            await until(lambda: held.released and row_of(other, key) is None)
        # The release went on the async engine, not the blocking one (where
        # the lock's renewals go: one may fall in this window).
        released_on_sync = [s for s in sync.statements if "DELETE" in s.upper()]
        assert released_on_sync == [], sync.statements

    asyncio.run(main())
    assert "ended without releasing" not in caplog.text


def test_a_dropped_trigger_releases_on_the_loop(
    alocks: AsyncLockManager, other: LockManager, key: str
) -> None:
    """A trigger collected uncalled (a rollback dropping an on_commit
    callback) fires from dblock's worker thread; the release is still sent
    on the holder's loop."""

    async def main() -> None:
        held = await alocks.acquire(key)
        await aexit_deferring(held, lambda d, r: (d.trigger(), r)[1], None, None)
        await until(lambda: held.released and row_of(other, key) is None)

    asyncio.run(main())


def test_a_trigger_fired_after_its_loop_closed_releases_on_a_thread(
    alocks: AsyncLockManager, other: LockManager, key: str
) -> None:
    kept: list[Any] = []

    async def main() -> Any:
        held = await alocks.acquire(key)
        await aexit_deferring(held, lambda d, r: kept.append(d.trigger()), None, None)
        return held

    held = asyncio.run(main())  # the loop is closed now
    assert held_elsewhere(other, key)
    kept.pop()()
    deadline = time.monotonic() + 30
    while not (held.released and row_of(other, key) is None):
        assert time.monotonic() < deadline, "never released"
        time.sleep(0.01)


def test_no_trigger_releases_at_exit(alocks: AsyncLockManager, key: str) -> None:
    async def main() -> None:
        held = await alocks.acquire(key)
        await aexit_deferring(held, lambda d, r: r, None, None)
        assert held.released

    asyncio.run(main())


# -- extend -------------------------------------------------------------------------


def test_extend_is_sent_on_the_async_engine(
    alocks: AsyncLockManager, other: LockManager, key: str, db: str
) -> None:
    async def main() -> None:
        held = await alocks.acquire(key, ttl=5, renew=False)
        before = held.expires_at
        blocking = StatementCounter(alocks.sync.engine)
        awaited = StatementCounter(alocks._astore.engine.sync_engine)
        with blocking, awaited:
            await held.extend(60)
        assert blocking.count == 0
        assert awaited.count == (2 if db == "mariadb" else 1)
        assert held.expires_at > before
        assert 50 < held.remaining <= 60
        # Lost: the row was taken away behind its back (an admin's force-release).
        assert other.store.release(key, held.token)
        with pytest.raises(LockLost):
            await held.extend()
        assert held.lost
        with pytest.raises(LockLost):
            await held.release()
        held = await alocks.acquire(key)
        await held.release()
        with pytest.raises(LockNotHeld):
            await held.extend()

    asyncio.run(main())


# -- fork -----------------------------------------------------------------------------


def _wait_child(pid: int, seconds: float = 120.0) -> int:
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung (it reused its parent's connection?)")
        time.sleep(0.01)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_never_uses_its_parents_async_connections(
    alocks: AsyncLockManager, keys: Any
) -> None:
    """The parent holds a pooled async connection (and keeps its loop); the
    child, forked, locks and unlocks on connections of its own; then the
    parent goes on with its pooled connection, undisturbed."""
    k_parent, k_child = keys(2)
    loop = asyncio.new_event_loop()
    engine = alocks._astore.engine

    async def cycle(key: str) -> str | None:
        """Lock and unlock ``key``, then say whose the pooled connection is."""
        async with alocks.lock(key, timeout=30):
            pass
        async with engine.connect() as conn:
            raw = await conn.get_raw_connection()
            raw.info.setdefault("test.made_in", os.getpid())
            return f"{raw.info['test.made_in']}"

    try:
        parents = loop.run_until_complete(cycle(k_parent))
        assert parents == str(os.getpid())
        pid = os.fork()
        if pid == 0:  # the child: nothing of pytest's may run here
            code = 1
            try:

                async def child() -> str | None:
                    async with asyncio.timeout(60):
                        return await cycle(k_child)

                code = 0 if asyncio.run(child()) == str(os.getpid()) else 2
                gc.collect()  # nothing of the parent's may be closed by collection
            finally:
                os._exit(code)
        assert _wait_child(pid) == 0
        # The parent's own connection still works (a child that had used or
        # closed it would have broken its session), and it is the same one.
        assert loop.run_until_complete(cycle(k_parent)) == parents
    finally:
        loop.run_until_complete(alocks._astore.close())
        loop.close()


# -- a connection of a closed loop ----------------------------------------------------


def test_a_manager_serves_one_asyncio_run_after_another(
    alocks: AsyncLockManager, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Scripts (and Django's async views under WSGI) run each coroutine in an
    event loop of its own: a pooled connection of a loop that has closed is
    replaced, not used (aiomysql's would wait on the dead loop)."""
    caplog.set_level(logging.ERROR)

    async def cycle() -> int:
        async with alocks.lock(key, timeout=30) as held:
            await held.extend()
            return int(held.fence)

    fences = [asyncio.run(asyncio.wait_for(cycle(), 60)) for _ in range(3)]
    assert fences == sorted(set(fences))
    assert [r.getMessage() for r in caplog.records] == []
