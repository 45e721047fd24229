"""Owners that can never run again, managers shared by event loops, and a
close() that always finishes (the "Hardening III" defects), on every database.

* A task that holds a key, or waits for one, on an event loop that is then
  closed can never run again: its key must be released (with a WARNING naming
  it) as a dead thread's is, and never handed to it.
* One ``AsyncLockManager`` used by several threads, each running its own
  event loop (``asyncio.run`` per thread), must never hang.
* ``close()`` finishes whatever the database says (the table dropped), and a
  second ``close()`` is harmless.
* A lock dropped without release is taken back by its own thread's next acquire.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
import uuid
import warnings
from collections.abc import Iterator

import pytest

from dblock import AsyncLockManager, LockBusy, LockManager
from tests.conftest import row_of, wait_queued

TTL = 1.5  # renewal (and the liveness check) every 0.5 s


def key(name: str) -> str:
    return f"gone:{name}:{uuid.uuid4().hex[:10]}"


@pytest.fixture
def short(db_url: str) -> Iterator[LockManager]:
    m = LockManager(db_url, ttl=TTL)
    yield m
    m.close()


def _run_until(loop: asyncio.AbstractEventLoop, flag: asyncio.Event, limit: float = 10.0) -> None:
    loop.run_until_complete(asyncio.wait_for(flag.wait(), limit))


async def _queued(manager: LockManager, key: str, n: int) -> None:
    """On the loop: until ``n`` requests are queued at level 1 for ``key``."""
    for _ in range(10_000):
        entry = manager._locker.registry.get(key)
        if entry is not None and len(entry.queue) >= n:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{n} waiters never queued")


def _close_with_pending(loop: asyncio.AbstractEventLoop) -> None:
    """What a torn-down worker thread or a test framework does: close the
    loop while tasks are still pending (never cancelled, never run again)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loop.close()


# -- 1 (a): a task holds a key; its loop is closed -----------------------------


def test_holder_on_closed_loop_is_released(
    short: LockManager, make_manager: object, caplog: pytest.LogCaptureFixture
) -> None:
    k = key("held")
    alocks = AsyncLockManager(short)
    loop = asyncio.new_event_loop()
    got = asyncio.Event()

    async def holder() -> None:
        held = await alocks.acquire(k)
        got.set()
        await asyncio.Event().wait()  # for ever: the loop is closed under it
        await held.release()  # never reached

    task = loop.create_task(holder())
    _run_until(loop, got)
    _close_with_pending(loop)
    assert not task.done()  # pending for ever, yet its lock must not be
    other: LockManager = make_manager()  # type: ignore[operator]
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dblock"), other.lock(k, timeout=10):
        waited = time.monotonic() - started
    # Released by the renewal pass (every third of the lease), long before
    # the lease would have run out on its own (it is renewed meanwhile).
    assert waited < TTL * 2
    assert any(
        k in r.getMessage() and "event loop is closed" in r.getMessage() for r in caplog.records
    )
    assert short._locker.registry.get(k) is None
    asyncio.run(alocks.close())  # the closed loop's connections: dropped quietly


# -- 1 (b): a task queued at level 1; its loop is closed -----------------------


def test_handoff_skips_waiter_of_closed_loop(short: LockManager) -> None:
    k = key("queued")
    alocks = AsyncLockManager(short)
    held = short.acquire(k)
    loop = asyncio.new_event_loop()
    queued = asyncio.Event()

    async def waiter() -> None:
        queued.set()
        await alocks.acquire(k, timeout=None)

    task = loop.create_task(waiter())  # it will never run again
    _run_until(loop, queued)
    loop.run_until_complete(_queued(short, k, 1))  # it is in the queue now
    entry = short._locker.registry.get(k)
    assert entry is not None
    assert len(entry.queue) == 1
    _close_with_pending(loop)
    assert not task.done()

    # A thread queued behind the dead task.
    granted = threading.Event()

    def behind() -> None:
        with short.lock(k, timeout=10):
            granted.set()

    t = threading.Thread(target=behind)
    t.start()
    wait_queued(short, k, 2)  # behind the dead task
    held.release()  # must go to the thread, not to the task nobody will run
    t.join(10)
    assert granted.is_set()
    with short.lock(k, blocking=False):
        pass
    asyncio.run(alocks.close())


# -- 1 (c): a task waiting at level 2 owns level 1; its loop is closed ----------


def test_level1_owner_of_closed_loop_is_evicted(
    make_manager: object, caplog: pytest.LogCaptureFixture
) -> None:
    k = key("level2")
    other: LockManager = make_manager(ttl=TTL)  # type: ignore[operator]
    elsewhere = other.acquire(k)  # another process holds the row
    # Polling databases: one look, then a long sleep, so the loop is closed
    # while the task sleeps, not in the middle of a statement.
    short: LockManager = make_manager(ttl=TTL, poll_initial=5.0, poll_max=5.0)  # type: ignore[operator]
    alocks = AsyncLockManager(short)
    loop = asyncio.new_event_loop()
    started = asyncio.Event()

    async def waiter() -> None:
        started.set()
        await alocks.acquire(k, timeout=None)  # waits at level 2, owns level 1

    task = loop.create_task(waiter())  # it will never run again
    _run_until(loop, started)
    loop.run_until_complete(asyncio.sleep(0.1))
    entry = short._locker.registry.get(k)
    assert entry is not None
    assert entry.held is None
    _close_with_pending(loop)
    assert not task.done()
    elsewhere.release()
    with caplog.at_level(logging.WARNING, logger="dblock"):
        # A thread of the same process: neither queued behind the dead task
        # for ever nor refused for ever (fail-fast, retried).
        deadline = time.monotonic() + 10
        while True:
            try:
                with short.lock(k, blocking=False):
                    break
            except LockBusy:
                assert time.monotonic() < deadline, "the dead task keeps the key"
                time.sleep(0.05)
        with short.lock(k, timeout=10):
            pass
    assert any(k in r.getMessage() and "passed on" in r.getMessage() for r in caplog.records)
    asyncio.run(alocks.close())


# -- 2: one AsyncLockManager, many event loops --------------------------------


@pytest.mark.parametrize("loops", [2, 8])
def test_one_manager_many_loops(db_url: str, loops: int) -> None:
    alocks = AsyncLockManager(db_url)
    cycles = 60
    rounds = 3
    hot = key("hot")
    try:
        for _ in range(rounds):
            done = [0] * loops
            errors: list[BaseException] = []

            def worker(
                i: int, done: list[int] = done, errors: list[BaseException] = errors
            ) -> None:
                async def main() -> None:
                    for n in range(cycles):
                        # Distinct keys mostly; every fourth cycle the one key
                        # all loops share (hand-offs across loops).
                        k = hot if n % 4 == 0 else key(f"loop{i}")
                        async with alocks.lock(k, timeout=20):
                            pass
                        done[i] += 1

                try:
                    asyncio.run(main())
                except BaseException as exc:
                    errors.append(exc)

            threads = [
                threading.Thread(target=worker, args=(i,), daemon=True) for i in range(loops)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not [t for t in threads if t.is_alive()], f"a loop hung: {done}"
            assert not errors, errors
            assert done == [cycles] * loops
    finally:
        asyncio.run(alocks.close())
        alocks.sync.close()


def test_close_from_one_loop_while_another_runs(db_url: str) -> None:
    """close() on one loop closes another running loop's connections on that
    loop (or drops them), and finishes."""
    alocks = AsyncLockManager(db_url)
    stop = threading.Event()
    ready = threading.Event()

    def other() -> None:
        async def main() -> None:
            async with alocks.lock(key("other")):
                pass
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.01)

        asyncio.run(main())

    t = threading.Thread(target=other, daemon=True)
    t.start()
    assert ready.wait(10)

    async def here() -> None:
        async with alocks.lock(key("here")):
            pass
        await asyncio.wait_for(alocks.close(), 10)

    asyncio.run(here())
    stop.set()
    t.join(10)
    assert not t.is_alive()
    alocks.sync.close()


# -- 3: close() after the table was dropped ------------------------------------


def test_close_after_schema_dropped(db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    table = f"dblock_t_{uuid.uuid4().hex[:8]}"
    m = LockManager(db_url, table=table)
    m.create_schema()
    held = m.acquire(key("dropped-table"))
    m.drop_schema()
    with caplog.at_level(logging.WARNING, logger="dblock"):
        m.close()  # never raises past the clean-up
    assert m._locker.renewer._thread is None
    assert m._locker.registry.get(held.key) is None
    assert held.lost
    assert held.released
    messages = [r.getMessage() for r in caplog.records]
    assert not any("may have committed" in msg for msg in messages)
    assert sum(held.key in msg and "does not exist" in msg for msg in messages) == 1
    m.close()  # idempotent


# -- 9: a lock dropped without release -----------------------------------------


def test_dropped_lock_is_taken_back_by_its_thread(manager: LockManager) -> None:
    for _ in range(20):
        k = key("dropped")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lock = manager.acquire(k)
            lock = manager.acquire(k + ":2")  # rebinding drops the first, unreleased
            gc.collect()
        again = manager.acquire(k, blocking=False)  # ours: granted, never "another thread"
        assert row_of(manager, k) is not None
        assert again.fence is not None
        again.release()
        assert row_of(manager, k) is None
        lock.release()


def test_dropped_lock_after_its_lease(db_url: str) -> None:
    m = LockManager(db_url, ttl=1.0, renew=False)
    try:
        k = key("dropped-expired")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            lock = m.acquire(k)
            time.sleep(1.1)
            del lock
            gc.collect()
        with m.lock(k, blocking=False) as held:
            assert not held.lost
    finally:
        m.close()


# -- a lock taken in a task of its own is handed to whoever awaits it ----------


@pytest.mark.parametrize("how", ["wait_for", "create_task", "gather", "acquire_many"])
def test_lock_acquired_in_a_task_of_its_own(
    db_url: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``await asyncio.wait_for(alocks.acquire(k), 5)`` runs the acquire in a
    task of its own before Python 3.12 (as ``create_task`` and ``gather``
    always do): that task ends the moment it returns the lock, which is not
    an owner ending without releasing. The lock stays, renewed, and the task
    that awaited it releases it (no force) as its own."""
    k = key(how)
    short = LockManager(db_url, ttl=0.3)  # a renewal pass every 0.1 s
    alocks = AsyncLockManager(short)

    async def main() -> None:
        if how == "wait_for":
            got = await asyncio.wait_for(asyncio.ensure_future(alocks.acquire(k)), 5)
        elif how == "create_task":
            got = await asyncio.create_task(alocks.acquire(k))
        elif how == "gather":
            (got,) = await asyncio.gather(alocks.acquire(k))
        else:
            got = (await asyncio.create_task(alocks.acquire_many([k])))[k]
        await asyncio.sleep(1.0)  # ten renewal passes, three leases
        assert not got.lost
        assert got.owned()  # adopted: the awaiting task is its owner now
        other = LockManager(db_url)
        try:
            with pytest.raises(LockBusy):
                await asyncio.to_thread(other.acquire, k, blocking=False)
        finally:
            await asyncio.to_thread(other.close)
        assert await got.release() is True  # not force: it is this task's

    with caplog.at_level(logging.WARNING, logger="dblock"):
        asyncio.run(main())
    assert not [r for r in caplog.records if k in r.getMessage()]
    asyncio.run(alocks.close())
    short.close()


def test_lock_handed_on_and_dropped_is_released(db_url: str) -> None:
    """A lock a task of its own acquired, and nobody ever used, is released
    once dropped (collected), as any dropped lock is."""
    k = key("dropped")
    short = LockManager(db_url, ttl=0.3)
    alocks = AsyncLockManager(short)

    async def main() -> None:
        task = asyncio.create_task(alocks.acquire(k))
        await asyncio.wait([task])
        assert short.is_locked(k)
        del task
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gc.collect()
        deadline = time.monotonic() + 5
        while short.is_locked(k):
            assert time.monotonic() < deadline, "the dropped lock was never released"
            await asyncio.sleep(0.05)

    asyncio.run(main())
    asyncio.run(alocks.close())
    short.close()


def test_lock_handed_on_to_a_closed_loop_is_released(
    short: LockManager, make_manager: object, caplog: pytest.LogCaptureFixture
) -> None:
    """A lock a task of its own acquired, awaited by a task whose loop is
    then closed before it used the lock: nobody can ever release it, so the
    renewal pass does, as for any owner of a closed loop."""
    k = key("handed-closed")
    alocks = AsyncLockManager(short)
    loop = asyncio.new_event_loop()
    got = asyncio.Event()

    async def holder() -> None:
        held = await asyncio.create_task(alocks.acquire(k))
        got.set()
        await asyncio.Event().wait()  # for ever: the loop is closed under it
        await held.release()  # never reached

    task = loop.create_task(holder())
    _run_until(loop, got)
    _close_with_pending(loop)
    assert not task.done()
    other: LockManager = make_manager()  # type: ignore[operator]
    with caplog.at_level(logging.WARNING, logger="dblock"), other.lock(k, timeout=10):
        pass
    assert any(
        k in r.getMessage() and "event loop is closed" in r.getMessage() for r in caplog.records
    )
    asyncio.run(alocks.close())
