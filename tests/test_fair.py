"""The fair queue (``fair=True``): arrival order across processes, skipping
crashed waiters and holders, leaving no row behind, lost leases."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from dblock import LockArgumentError, LockBusy, LockLost, LockManager, LockTimeout
from tests.support import fair_procs
from tests.support.interrupts import raise_in

ctx = multiprocessing.get_context("spawn")

# Bounds for waiting on other processes (never assertions on speed).
BOUND = 90.0


def _rows(m: LockManager, key: str) -> list[tuple[str, str]]:
    """The key's rows, but for the holder's own queue row: MariaDB keeps a
    granted waiter's queue row to its release (see MySQLFair)."""
    rows = m.store.rows(key=key)
    head = next((r.token for r in rows if r.slot == ""), None)
    return [(r.slot, r.mode) for r in rows if r.slot == "" or r.token != head]


def _queued(m: LockManager, key: str) -> int:
    return sum(1 for slot, _ in _rows(m, key) if slot.startswith("q"))


def _until(what: Callable[[], bool], message: str) -> None:
    deadline = time.monotonic() + BOUND
    while not what():
        assert time.monotonic() < deadline, message
        time.sleep(0.02)


@pytest.fixture
def procs() -> Iterator[list[multiprocessing.process.BaseProcess]]:
    started: list[multiprocessing.process.BaseProcess] = []
    yield started
    for p in started:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
        p.join(10)


def _spawn(
    procs: list[multiprocessing.process.BaseProcess], target: object, *args: object
) -> multiprocessing.process.BaseProcess:
    p = ctx.Process(target=target, args=args)
    p.start()
    procs.append(p)
    return p


def test_fair_grants_in_arrival_order_across_processes(
    db_url: str, key: str, procs: list[multiprocessing.process.BaseProcess]
) -> None:
    """Four processes queue one after the other (each after the previous one's
    queue row is visible) while the key is held; released, they are granted in
    exactly that order, with growing fences."""
    report = ctx.Queue()
    with LockManager(db_url) as m:
        with m.lock(key, fair=True) as held:
            for i in range(4):
                _spawn(procs, fair_procs.fair_waiter, db_url, key, f"w{i}", 30.0, report)
                _until(lambda i=i: _queued(m, key) == i + 1, f"waiter {i} never queued")
            first = held.fence
        # In the order of the grants (each waiter notes the time of its own,
        # on the system-wide monotonic clock), not of the reports: a Queue's
        # put() returns before its feeder thread has sent the report, so a
        # waiter granted later may be heard from first.
        got = sorted((report.get(timeout=BOUND) for _ in range(4)), key=lambda g: g[2])
        assert [name for name, _, _ in got] == ["w0", "w1", "w2", "w3"]
        fences = [first] + [fence for _, fence, _ in got]
        assert fences == sorted(fences)
        assert len(set(fences)) == 5
        for p in procs:
            p.join(BOUND)
            assert p.exitcode == 0
        assert _rows(m, key) == []


def test_killed_waiter_is_skipped_after_its_lease(
    db_url: str, key: str, procs: list[multiprocessing.process.BaseProcess]
) -> None:
    report = ctx.Queue()
    with LockManager(db_url) as m:
        with m.lock(key, fair=True):
            dead = _spawn(procs, fair_procs.fair_waiter, db_url, key, "dead", 1.0, report)
            _until(lambda: _queued(m, key) == 1, "the first waiter never queued")
            _spawn(procs, fair_procs.fair_waiter, db_url, key, "alive", 30.0, report)
            _until(lambda: _queued(m, key) == 2, "the second waiter never queued")
            os.kill(dead.pid, signal.SIGKILL)  # type: ignore[arg-type]
            dead.join(BOUND)
        # The release wakes the dead waiter (its row is still live); the next
        # one is granted once that row's lease has run out.
        name, _, _ = report.get(timeout=BOUND)
        assert name == "alive"
        procs[1].join(BOUND)
        assert procs[1].exitcode == 0
        # The dead row is expired (ignored); the sweeper or its lease removes it.
        assert [r.expired for r in m.store.rows(key=key)] in ([], [True])


def test_killed_holder_is_taken_over_by_the_queue(
    db_url: str, key: str, procs: list[multiprocessing.process.BaseProcess]
) -> None:
    report = ctx.Queue()
    holder = _spawn(procs, fair_procs.fair_holder, db_url, key, 1.0, report)
    dead_fence = report.get(timeout=BOUND)
    os.kill(holder.pid, signal.SIGKILL)  # type: ignore[arg-type]
    holder.join(BOUND)
    with LockManager(db_url) as m, m.lock(key, fair=True, timeout=BOUND) as held:
        assert held.fence > dead_fence
        assert _rows(m, key) == [("", "exclusive")]


def test_timeout_while_queued_leaves_no_row(db_url: str, key: str) -> None:
    with LockManager(db_url) as m, LockManager(db_url) as other:
        with m.lock(key, fair=True):
            with pytest.raises(LockTimeout):
                other.acquire(key, fair=True, timeout=0.3)
            assert _rows(m, key) == [("", "exclusive")]
            with pytest.raises(LockBusy):
                other.acquire(key, fair=True, blocking=False)
            assert _rows(m, key) == [("", "exclusive")]
        assert _rows(m, key) == []


def test_interrupt_while_queued_leaves_no_row(db_url: str, key: str) -> None:
    """An exception raised in the waiting thread (as a signal handler's
    would be) while it waits in the queue: its queue row goes."""
    with LockManager(db_url) as m, LockManager(db_url) as other:
        outcome: queue.Queue[BaseException | None] = queue.Queue()

        def wait() -> None:
            try:
                other.acquire(key, fair=True, timeout=BOUND).release()
                outcome.put(None)
            except BaseException as exc:
                outcome.put(exc)

        with m.lock(key, fair=True):
            t = threading.Thread(target=wait)
            t.start()
            _until(lambda: _queued(m, key) == 1, "the waiter never queued")
            _interrupt(t)
            t.join(BOUND)
            assert isinstance(outcome.get(timeout=BOUND), _Interrupt)
            # Deleted at once, or (cut off mid-statement) by the orphan clean-up.
            _until(lambda: _queued(m, key) == 0, "the interrupted waiter's row stayed")
        assert _rows(m, key) == []


def test_first_waiter_giving_up_passes_its_place_on(db_url: str, key: str) -> None:
    """The first waiter is interrupted and leaves; the one behind it is next."""
    with LockManager(db_url) as m, LockManager(db_url) as a, LockManager(db_url) as b:
        got: queue.Queue[object] = queue.Queue()

        def wait(manager: LockManager) -> None:
            try:
                with manager.lock(key, fair=True, timeout=BOUND) as held:
                    got.put(held.fence)
            except BaseException as exc:
                got.put(exc)

        with m.lock(key, fair=True):
            first = threading.Thread(target=wait, args=(a,))
            first.start()
            _until(lambda: _queued(m, key) == 1, "the first waiter never queued")
            second = threading.Thread(target=wait, args=(b,))
            second.start()
            _until(lambda: _queued(m, key) == 2, "the second waiter never queued")
            _interrupt(first)
            first.join(BOUND)
            assert isinstance(got.get(timeout=BOUND), _Interrupt)
            _until(lambda: _queued(m, key) == 1, "the first waiter's row stayed")
        assert isinstance(got.get(timeout=BOUND), int)
        second.join(BOUND)
        assert _rows(m, key) == []


class _Interrupt(Exception):
    """Raised in a waiting thread, as a signal handler's exception would be."""


def _interrupt(thread: threading.Thread) -> None:
    raise_in(thread, _Interrupt)


def test_lost_fair_lock_raises_lock_lost(db_url: str, key: str) -> None:
    with LockManager(db_url, renew=False) as m, LockManager(db_url) as other:
        held = m.acquire(key, fair=True, ttl=0.5)
        with other.lock(key, fair=True, timeout=BOUND) as taken:
            assert taken.fence > held.fence
            with pytest.raises(LockLost):
                held.release()


def test_fair_and_plain_requests_on_one_key(
    db: str, db_url: str, key: str, procs: list[multiprocessing.process.BaseProcess]
) -> None:
    """A (paused) fair waiter is queued when the holder releases. A fair
    request never jumps the queue. A plain one barges into a free head
    (SQLite, MariaDB: the waiter polls); on PostgreSQL the release handed the
    head to the waiter in the same statement, so there is no gap to barge into."""
    report = ctx.Queue()
    with LockManager(db_url) as m, LockManager(db_url) as other:
        with m.lock(key, fair=True):
            waiter = _spawn(procs, fair_procs.fair_waiter, db_url, key, "w", 30.0, report)
            _until(lambda: _queued(m, key) == 1, "the waiter never queued")
            os.kill(waiter.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        try:
            with pytest.raises(LockBusy):
                other.acquire(key, fair=True, blocking=False)
            if db == "postgresql":
                assert [slot for slot, _ in _rows(m, key)] == [""]
                with pytest.raises(LockBusy):
                    other.acquire(key, blocking=False)
            else:
                with other.lock(key, blocking=False):  # plain: barges
                    assert _queued(m, key) == 1
        finally:
            os.kill(waiter.pid, signal.SIGCONT)  # type: ignore[arg-type]
        assert report.get(timeout=BOUND)[0] == "w"
        waiter.join(BOUND)
        assert waiter.exitcode == 0


def test_local_threads_queue_fifo_with_one_row_per_process(db_url: str, key: str) -> None:
    """Level 1: eight threads of one process wait in order; the database
    sees one queue row (the first thread's), not eight."""
    with LockManager(db_url) as m, LockManager(db_url) as other:
        order: list[int] = []
        registry = other._locker.registry

        def local_queue() -> int:
            entry = registry.get(key)
            return -1 if entry is None else len(entry.queue)

        with m.lock(key, fair=True):
            threads = []
            for i in range(8):
                t = threading.Thread(target=_hold, args=(other, key, order, i))
                t.start()
                threads.append(t)
                if i == 0:
                    _until(lambda: _queued(m, key) == 1, "the first thread never queued")
                else:
                    _until(lambda i=i: local_queue() == i, f"thread {i} never queued locally")
            assert _queued(m, key) == 1
        for t in threads:
            t.join(BOUND)
        assert order == list(range(8))


def _hold(m: LockManager, key: str, order: list[int], i: int) -> None:
    with m.lock(key, fair=True, timeout=BOUND):
        order.append(i)


def test_uncontended_fair_cycle_is_one_statement_each_way(
    db_url: str, key: str, count_statements: type
) -> None:
    with LockManager(db_url) as m:
        with m.lock(key, fair=True):  # warm: capabilities, connections
            pass
        with count_statements(m.engine) as c:
            held = m.acquire(key, fair=True)
            acquired = c.count
            held.release()
        assert acquired == 1
        assert c.count == 2


def test_fair_option_is_checked(manager: LockManager, key: str) -> None:
    with pytest.raises(LockArgumentError, match="fair"):
        manager.lock(key, fair="yes")  # type: ignore[arg-type]
    with pytest.raises(LockArgumentError, match="fair"):
        manager.locked(["a", "b"], fair=True)


def test_locked_decorator_fair(manager: LockManager, key: str) -> None:
    @manager.locked("{name}", fair=True)
    def work(name: str) -> list[tuple[str, str]]:
        return _rows(manager, name)

    assert work(key) == [("", "exclusive")]


def test_async_fair_waits_in_the_queue(db_url: str, key: str) -> None:
    """AsyncLockManager(fair=True): a task queues behind a thread's hold and
    is granted on release; a timed-out task leaves no row."""
    import asyncio

    from dblock import AsyncLockManager

    async def main() -> None:
        with LockManager(db_url) as m:
            alocks = AsyncLockManager(db_url)
            try:
                held = m.acquire(key, fair=True)
                with pytest.raises(LockTimeout):
                    await alocks.acquire(key, fair=True, timeout=0.3)
                assert _rows(m, key) == [("", "exclusive")]

                async def wait() -> int:
                    async with alocks.lock(key, fair=True, timeout=BOUND) as got:
                        return int(got.fence)

                task = asyncio.ensure_future(wait())
                deadline = time.monotonic() + BOUND
                while _queued(m, key) != 1:
                    assert time.monotonic() < deadline, "the task never queued"
                    await asyncio.sleep(0.02)
                held.release()  # one statement, on the loop: this test only
                assert await task > held.fence
                assert _rows(m, key) == []
            finally:
                await alocks.close()

    asyncio.run(main())


def test_next_local_thread_queued_by_the_release_then_interrupted(db_url: str, key: str) -> None:
    """A releases while C (another manager) is queued and B (A's manager) waits
    locally: C gets the key, B joins the queue (on PostgreSQL the release
    queues B in the same statement). B interrupted there leaves no row."""
    with LockManager(db_url) as m, LockManager(db_url) as other:
        got: queue.Queue[object] = queue.Queue()
        release_c = threading.Event()

        def c() -> None:
            with other.lock(key, fair=True, timeout=BOUND):
                got.put("c")
                release_c.wait(BOUND)

        def b() -> None:
            try:
                with m.lock(key, fair=True, timeout=BOUND):
                    got.put("b")
            except BaseException as exc:
                got.put(exc)

        a = m.acquire(key, fair=True)
        tc = threading.Thread(target=c)
        tc.start()
        _until(lambda: _queued(m, key) == 1, "C never queued")
        tb = threading.Thread(target=b)
        tb.start()
        entry = m._locker.registry.get(key)
        _until(lambda: entry is not None and len(entry.queue) == 1, "B never queued locally")
        a.release()
        assert got.get(timeout=BOUND) == "c"
        _until(lambda: _queued(m, key) == 1, "B never joined the queue")
        _interrupt(tb)
        tb.join(BOUND)
        assert isinstance(got.get(timeout=BOUND), _Interrupt)
        _until(lambda: _queued(m, key) == 0, "B's queue row stayed")
        release_c.set()
        tc.join(BOUND)
        assert _rows(m, key) == []


def test_async_locked_decorator_fair(db_url: str, key: str) -> None:
    import asyncio

    from dblock import AsyncLockManager

    async def main() -> list[tuple[str, str]]:
        alocks = AsyncLockManager(db_url)
        try:

            @alocks.locked("{name}", fair=True)
            async def work(name: str) -> list[tuple[str, str]]:
                return _rows(alocks.sync, name)

            with pytest.raises(LockArgumentError, match="fair"):
                alocks.locked(["a", "b"], fair=True)
            return await work(key)
        finally:
            await alocks.close()

    assert asyncio.run(main()) == [("", "exclusive")]
