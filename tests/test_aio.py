"""The asyncio face (issue 11) on the three databases: AsyncLockManager's
API, level 1 for tasks (shared with threads), waiting without blocking the
loop, cancellation at each stage, and async holders' leases. The managers of
the ``alocks`` and ``other`` fixtures run on each asyncio driver of their
database in turn (``driver0``, ``driver1``: see tests/support/db.py)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from dblock import (
    AsyncLockManager,
    LockArgumentError,
    LockBusy,
    LockLost,
    LockNotHeld,
    LockTimeout,
    returns,
)
from tests.conftest import row_of
from tests.support.counting import StatementCounter
from tests.support.db import driver_form

# -- helpers -------------------------------------------------------------------


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def until(condition: Callable[[], object], seconds: float = 10.0) -> None:
    """Wait (without blocking the loop) for a state, not for a time."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


def queued(alocks: AsyncLockManager, key: str, n: int = 1) -> bool:
    entry = alocks.sync._locker.registry.get(key)
    return entry is not None and len(entry.queue) >= n


def free(alocks: AsyncLockManager, key: str) -> bool:
    """Nothing of ``key`` left: no registry entry, no row."""
    return alocks.sync._locker.registry.get(key) is None and row_of(alocks.sync, key) is None


def statements(alocks: AsyncLockManager) -> StatementCounter:
    """Counts what the async engine sends."""
    return StatementCounter(alocks._astore.engine.sync_engine)


@pytest.fixture(params=[0, 1], ids=["driver0", "driver1"])
def form(request: pytest.FixtureRequest, db: str, db_url: str) -> str:
    """The database's URL in one of its asyncio drivers' forms."""
    url, _ = driver_form(db, db_url, request.param)
    return url


@pytest.fixture
def alocks(form: str) -> Iterator[AsyncLockManager]:
    a = AsyncLockManager(form)
    yield a
    run(a.close())


@pytest.fixture
def other(form: str) -> Iterator[AsyncLockManager]:
    """A second manager (its own registry): another process, as far as level 1 goes."""
    a = AsyncLockManager(form)
    yield a
    run(a.close())


# -- 1. the API ------------------------------------------------------------------


def test_async_with_holds_the_row_and_releases_it(alocks: AsyncLockManager, key: str) -> None:
    async def main() -> None:
        async with alocks.lock(key, ttl=10) as held:
            row = row_of(alocks.sync, key)
            assert row is not None
            assert row.token == held.token
            assert held.fence > 0
            assert not held.lost
        assert held.released
        assert free(alocks, key)

    run(main())


def test_acquire_and_await_release(alocks: AsyncLockManager, key: str) -> None:
    async def main() -> None:
        held = await alocks.acquire(key)
        assert row_of(alocks.sync, key) is not None
        assert await held.release() is True
        assert free(alocks, key)
        with pytest.raises(LockNotHeld):
            await held.release()

    run(main())


def test_the_options_are_checked_before_any_sql(alocks: AsyncLockManager) -> None:
    with pytest.raises(LockArgumentError):
        alocks.lock("")
    with pytest.raises(LockArgumentError):
        alocks.lock("k", ttl=-1)
    with pytest.raises(LockArgumentError):
        run(alocks.acquire("k", timeout=-1))


def test_lock_many_takes_every_key_and_gives_them_back(alocks: AsyncLockManager, keys: Any) -> None:
    ks = keys(3)

    async def main() -> None:
        async with alocks.lock_many(reversed(ks)) as held:
            assert sorted(held) == sorted(ks)
            assert all(row_of(alocks.sync, k) is not None for k in ks)
        assert all(free(alocks, k) for k in ks)

    run(main())


def test_lock_many_gives_back_what_it_took_when_one_key_is_busy(
    alocks: AsyncLockManager, other: AsyncLockManager, keys: Any
) -> None:
    ks = keys(3)

    async def main() -> None:
        async with other.lock(ks[2]):
            with pytest.raises(LockBusy):
                await alocks.acquire_many(ks, blocking=False)
            assert all(free(alocks, k) for k in ks[:2])

    run(main())


def test_locked_decorates_coroutine_functions_and_methods(
    alocks: AsyncLockManager, key: str
) -> None:
    seen: list[object] = []

    @alocks.locked(key + ":{user_id}")
    async def withdraw(user_id: int, amount: int) -> int:
        seen.append(row_of(alocks.sync, f"{key}:{user_id}"))
        return amount

    class Account:
        def __init__(self, ident: int) -> None:
            self.ident = ident

        @alocks.locked(key + ":acct:{self.ident}", blocking=False, on_busy=returns("busy"))
        async def close(self) -> str:
            await asyncio.sleep(0)
            return "closed"

    async def main() -> None:
        assert await withdraw(7, 5) == 5
        assert seen[0] is not None
        assert free(alocks, f"{key}:7")
        assert await Account(1).close() == "closed"
        async with alocks.lock(f"{key}:acct:1"):
            busy = asyncio.create_task(Account(1).close())
            assert await busy == "busy"

    run(main())


def test_locked_refuses_a_plain_function(alocks: AsyncLockManager) -> None:
    with pytest.raises(LockArgumentError, match="not a coroutine function"):

        @alocks.locked("k")
        def plain() -> None: ...


def test_an_async_busy_handler_is_awaited(alocks: AsyncLockManager, key: str) -> None:
    async def handler(error: Exception, n: int) -> str:
        return f"busy {n} {type(error).__name__}"

    @alocks.locked(key + ":{n}", blocking=False, on_busy=handler)
    async def job(n: int) -> str:
        return "ran"

    async def main() -> None:
        async with alocks.lock(key + ":3"):
            assert await asyncio.create_task(job(3)) == "busy 3 LockBusy"

    run(main())


# -- 2. level 1 for tasks --------------------------------------------------------


def test_a_second_task_is_refused_at_level_1_without_sql(
    alocks: AsyncLockManager, key: str
) -> None:
    async def main() -> None:
        async with alocks.lock(key):
            with statements(alocks) as counted:

                async def second() -> None:
                    await alocks.acquire(key, blocking=False)

                with pytest.raises(LockBusy) as caught:
                    await asyncio.create_task(second())
            assert caught.value.level == 1
            assert counted.count == 0

    run(main())


def test_a_task_reenters_its_own_key_for_free(alocks: AsyncLockManager, key: str) -> None:
    async def main() -> None:
        async with alocks.lock(key) as outer:
            with statements(alocks) as counted:
                async with alocks.lock(key, blocking=False) as inner:
                    assert inner.held is outer.held
            assert counted.count == 0
            assert not outer.released
        assert free(alocks, key)

    run(main())


def test_a_second_task_queues_locally_without_sql_and_gets_the_key(
    alocks: AsyncLockManager, key: str
) -> None:
    async def main() -> None:
        order: list[str] = []
        first = await alocks.acquire(key)
        with statements(alocks) as counted:

            async def second() -> None:
                async with alocks.lock(key, timeout=30):
                    order.append("second")

            task = asyncio.create_task(second())
            await until(lambda: queued(alocks, key))
            assert counted.count == 0  # queued at level 1, nothing sent
        order.append("first")
        await first.release()
        await task
        assert order == ["first", "second"]
        assert free(alocks, key)

    run(main())


def test_a_queued_task_times_out_at_level_1(alocks: AsyncLockManager, key: str) -> None:
    async def main() -> None:
        async with alocks.lock(key):

            async def second() -> None:
                await alocks.acquire(key, timeout=0.05)

            with pytest.raises(LockTimeout) as caught:
                await asyncio.create_task(second())
            assert caught.value.level == 1
            entry = alocks.sync._locker.registry.get(key)
            assert entry is not None
            assert not entry.queue
        assert free(alocks, key)

    run(main())


def test_a_thread_and_a_task_share_one_level_1(alocks: AsyncLockManager, key: str) -> None:
    locks = alocks.sync
    held_by_thread = threading.Event()
    let_go = threading.Event()

    def thread_holder() -> None:
        with locks.lock(key):
            held_by_thread.set()
            let_go.wait(30)

    async def main() -> None:
        t = threading.Thread(target=thread_holder)
        t.start()
        await until(held_by_thread.is_set)
        with statements(alocks) as counted:
            with pytest.raises(LockBusy) as caught:
                await alocks.acquire(key, blocking=False)
            assert caught.value.level == 1
            assert counted.count == 0
            refused: list[LockBusy] = []

            async def task_waiter() -> None:
                held = await alocks.acquire(key, timeout=30)
                # ... and a thread is refused while the task holds it.
                try:
                    await asyncio.to_thread(lambda: locks.acquire(key, blocking=False))
                except LockBusy as exc:
                    refused.append(exc)
                await held.release()

            waiting = asyncio.create_task(task_waiter())
            await until(lambda: queued(alocks, key))
            assert counted.count == 0  # the task queued behind the thread locally
        let_go.set()
        await waiting
        await asyncio.to_thread(t.join)
        assert refused
        assert refused[0].level == 1
        assert free(alocks, key)

    run(main())


def test_a_thread_queued_behind_a_task_gets_the_key(alocks: AsyncLockManager, key: str) -> None:
    locks = alocks.sync

    async def main() -> None:
        held = await alocks.acquire(key)
        got: list[int] = []

        def thread_waiter() -> None:
            with locks.lock(key, timeout=30) as h:
                got.append(h.fence)

        t = threading.Thread(target=thread_waiter)
        t.start()
        await until(lambda: queued(alocks, key))
        await held.release()
        await asyncio.to_thread(t.join)
        assert got
        assert got[0] > 0
        assert free(alocks, key)

    run(main())


def test_only_its_holder_task_may_release(alocks: AsyncLockManager, key: str) -> None:
    async def main() -> None:
        held = await alocks.acquire(key)

        async def intruder() -> None:
            await held.release()

        with pytest.raises(LockNotHeld):
            await asyncio.create_task(intruder())
        await held.release()

    run(main())


# -- 3. waiting at level 2 never blocks the loop ----------------------------------


def test_waiting_at_level_2_keeps_the_loop_running(
    alocks: AsyncLockManager, other: AsyncLockManager, key: str
) -> None:
    async def main() -> None:
        ticks = 0
        stop = False

        async def ticker() -> None:
            nonlocal ticks
            while not stop:
                ticks += 1
                await asyncio.sleep(0.001)

        tick_task = asyncio.create_task(ticker())
        holder = await other.acquire(key, ttl=30)
        granted = 0

        async def take() -> None:
            nonlocal granted
            async with alocks.lock(key, timeout=60):
                granted += 1

        waiters = [asyncio.create_task(take()) for _ in range(5)]
        # One task waits on the database, four behind it locally; the loop
        # keeps ticking all along.
        await until(lambda: queued(alocks, key, 4))
        seen = ticks
        await until(lambda: ticks >= seen + 20)
        assert not any(w.done() for w in waiters)
        await holder.release()
        await asyncio.gather(*waiters)
        assert granted == 5
        stop = True
        await tick_task
        assert free(alocks, key)

    run(main())


def test_a_level_2_wait_times_out(
    alocks: AsyncLockManager, other: AsyncLockManager, key: str
) -> None:
    async def main() -> None:
        async with other.lock(key):
            with pytest.raises(LockTimeout) as caught:
                await alocks.acquire(key, timeout=0.2)
            assert caught.value.level == 2
            assert alocks.sync._locker.registry.get(key) is None

    run(main())


def test_a_fail_fast_request_for_a_key_held_elsewhere_is_busy_at_level_2(
    alocks: AsyncLockManager, other: AsyncLockManager, key: str
) -> None:
    async def main() -> None:
        async with other.lock(key):
            with pytest.raises(LockBusy) as caught:
                await alocks.acquire(key, blocking=False)
            assert caught.value.level == 2

    run(main())


# -- 4. cancellation -------------------------------------------------------------


def test_a_task_cancelled_while_queued_leaves_no_trace(alocks: AsyncLockManager, key: str) -> None:
    async def main() -> None:
        held = await alocks.acquire(key)
        task = asyncio.create_task(alocks.acquire(key, timeout=60))
        await until(lambda: queued(alocks, key))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        entry = alocks.sync._locker.registry.get(key)
        assert entry is not None
        assert not entry.queue
        await held.release()
        assert free(alocks, key)

    run(main())


def test_asyncio_timeout_while_waiting_at_level_2_leaves_no_trace(
    alocks: AsyncLockManager, other: AsyncLockManager, key: str
) -> None:
    async def main() -> None:
        async with other.lock(key) as held:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await alocks.acquire(key, timeout=60)
            assert alocks.sync._locker.registry.get(key) is None
            row = row_of(alocks.sync, key)
            assert row is not None
            assert row.token == held.token
        assert free(alocks, key)

    run(main())


@pytest.mark.parametrize("when", ["before_cursor_execute", "after_cursor_execute"])
def test_a_task_cancelled_mid_statement_leaves_no_row(
    alocks: AsyncLockManager, key: str, when: str
) -> None:
    """Cancelled as the INSERT is sent or just after it committed: either
    way no row stays (an uncertain one is deleted by its token)."""
    from sqlalchemy import event

    async def main() -> None:
        task: asyncio.Task[Any] | None = None
        engine = alocks._astore.engine.sync_engine

        def cancel(*_args: Any) -> None:
            if task is not None:
                task.cancel()

        event.listen(engine, when, cancel)
        try:
            task = asyncio.create_task(alocks.acquire(key))
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            event.remove(engine, when, cancel)
        await until(lambda: free(alocks, key))
        # The key works as if nothing happened.
        async with alocks.lock(key, blocking=False):
            pass

    run(main())


# -- 4. holders: leases, loss, extend, a task that ended --------------------------


def test_extend_and_check_for_an_async_holder(alocks: AsyncLockManager, key: str) -> None:
    async def main() -> None:
        async with alocks.lock(key, ttl=2, renew=False) as held:
            before = held.expires_at
            await held.extend(30)
            assert held.expires_at > before
            held.check()

    run(main())


def test_an_async_holder_learns_its_lock_was_lost(alocks: AsyncLockManager, key: str) -> None:
    lost: list[object] = []

    async def main() -> None:
        held = await alocks.acquire(key, ttl=0.6, on_lost=lost.append)
        alocks.sync.store.release(key, held.token)  # taken away behind its back
        await until(lambda: held.lost and lost)
        with pytest.raises(LockLost):
            held.check()
        with pytest.raises(LockLost):
            await held.release()

    run(main())


def test_a_holder_task_that_ended_without_releasing_is_released_with_a_warning(
    alocks: AsyncLockManager, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dblock")
    kept: list[Any] = []

    async def hold() -> None:
        kept.append(await alocks.acquire(key, ttl=1.5))

    async def main() -> None:
        await asyncio.create_task(hold(), name="gone-task")
        await until(lambda: free(alocks, key))

    run(main())
    assert kept[0].released
    assert any(key in r.getMessage() and "gone-task" in r.getMessage() for r in caplog.records)


def test_the_row_names_the_task(alocks: AsyncLockManager, key: str) -> None:
    async def main() -> None:
        async def hold() -> None:
            async with alocks.lock(key):
                row = row_of(alocks.sync, key)
                assert row is not None
                assert row.owner.endswith(":named-task")

        await asyncio.create_task(hold(), name="named-task")

    run(main())


@pytest.mark.databases("postgresql")  # LISTEN/NOTIFY is PostgreSQL's
def test_on_postgresql_a_waiting_task_is_woken_by_notify_not_by_polling(
    db: str, alocks: AsyncLockManager, other: AsyncLockManager, key: str
) -> None:

    async def main() -> None:
        holder = await other.acquire(key, ttl=30)
        with statements(alocks) as counted:

            async def take() -> int:
                async with alocks.lock(key, timeout=60) as held:
                    return int(held.fence)

            task = asyncio.create_task(take())
            listener = alocks.sync.store.listener()  # type: ignore[attr-defined]
            # (Its first attempt counted too: under load the subscription can
            # be seen before that attempt's statement is. And the LISTEN for
            # the key in: until then the waiter looks again every poll_max.)
            await until(lambda: listener.listening and listener.covers(key) and counted.count)
            attempts = counted.count
            # Polling from 5 ms up would send several attempts in this while;
            # a notified waiter tries once more at most (the listener started
            # after its first attempt, so a release may have slipped by).
            for _ in range(100):
                await asyncio.sleep(0.002)
            assert counted.count <= attempts + 1
            assert not task.done()
            await holder.release()
            assert await task > holder.fence
        assert free(alocks, key)

    run(main())


# -- 5. many tasks in many processes ---------------------------------------------


def test_200_tasks_on_5_keys_in_4_processes_count_exactly(db_url: str, keys: Any) -> None:
    import multiprocessing

    from tests.support import procs

    ctx = multiprocessing.get_context("spawn")
    ks = keys(5)
    names = [f"aio:{k}"[-200:] for k in ks]
    for name in names:
        procs.reset_counter(db_url, name)
    go = ctx.Event()
    processes, tasks, rounds = 4, 50, 2
    workers = [
        ctx.Process(
            target=procs.async_increment_worker, args=(db_url, ks, names, tasks, rounds, go)
        )
        for _ in range(processes)
    ]
    for w in workers:
        w.start()
    go.set()
    for w in workers:
        w.join(300)
        assert w.exitcode == 0
    per_key = processes * (tasks // len(ks)) * rounds
    assert [procs.read_counter(db_url, name) for name in names] == [per_key] * len(ks)


def test_more_tasks_than_pooled_connections_all_get_their_turn(db_url: str, keys: Any) -> None:
    """30 tasks on 3 pooled connections and no overflow: a connection coming
    back while tasks wait for the pool goes to them, not to the store's idle
    stack (where it would stay while they time out after ``pool_timeout``)."""

    async def main() -> int:
        alocks = AsyncLockManager(
            db_url, async_engine_options={"pool_size": 3, "max_overflow": 0, "pool_timeout": 5}
        )
        done = 0

        async def one(prefix: str) -> None:
            nonlocal done
            for i in range(3):
                async with alocks.lock(f"{prefix}:{i}"):
                    pass
                done += 1

        try:
            await asyncio.gather(*(one(k) for k in keys(30)))
        finally:
            await alocks.close()
        return done

    t0 = time.monotonic()
    assert run(main()) == 90
    assert time.monotonic() - t0 < 5  # nobody waited out the pool's timeout
