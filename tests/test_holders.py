"""Holders: a lock never outlives, escapes or betrays its owner (issue 9).

Every way an owner can vanish ends in a released key: a thread or task that
ends without releasing, a handle dropped without release, a manager closed
under waiters and holders, an exception from a signal handler at any point of
acquire. And the lock is its owner's alone: another thread cannot release
it by accident, a thread given a dead holder's id is not its heir.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import re
import signal
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import sqlalchemy as sa

from dblock import (
    DBLockError,
    HeldLock,
    LockArgumentError,
    LockBusy,
    LockLost,
    LockManager,
    LockNotHeld,
    LockTimeout,
    ManagerClosed,
)
from tests.conftest import row_of
from tests.support.interrupts import LOCK_FILES, interrupt_at, next_point
from tests.support.interrupts import Interrupt as Interrupted
from tests.support.proxy import Proxy

# -- helpers -------------------------------------------------------------------


def _wait_for(condition: Callable[[], object], seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.005)
    raise AssertionError("condition not met in time")


def _queued(manager: LockManager, key: str, n: int = 1) -> bool:
    entry = manager._locker.registry.get(key)
    return entry is not None and len(entry.queue) >= n


def _free(manager: LockManager, key: str) -> bool:
    """Nothing of ``key`` left: no registry entry, no row."""
    return manager._locker.registry.get(key) is None and row_of(manager, key) is None


def _in_thread(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` on a thread; returns {'result'} or {'error'} once it ended."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not t.is_alive()
    return out


def _start(
    fn: Callable[[], Any], name: str | None = None
) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=run, name=name, daemon=True)  # never hang the run
    t.start()
    return t, out


class Interrupt(Exception):
    """What our signal handler raises (as a SIGALRM timeout handler would)."""


#: Where an exception goes nowhere (see interrupt_when).
_SWALLOWING = ("weakref.py", "_weakrefset.py")


@contextmanager
def interrupt_when(where: Callable[[types.FrameType], bool]) -> Iterator[threading.Event]:
    """Raise :class:`Interrupt` from a SIGALRM handler in the main thread the
    first time the main thread is found inside a frame ``where`` accepts: the
    interruption hits exactly the point under test, however long the way there."""
    fired = threading.Event()
    done: list[bool] = []  # a plain flag: the handler may be re-entered by the next tick

    def handler(signum: int, frame: types.FrameType | None) -> None:
        if done:
            return
        f = frame
        while f is not None:
            if f.f_code.co_filename.endswith(_SWALLOWING) or f.f_code.co_name == "__del__":
                # A weakref callback or finalizer the collector runs: Python
                # prints and drops what it raises (seen once in a full run:
                # the test's acquire then waited on). The next tick, then.
                return
            if where(f):
                done.append(True)
                signal.setitimer(signal.ITIMER_REAL, 0, 0)
                fired.set()
                raise Interrupt
            f = f.f_back

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)
    try:
        yield fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)


def _named(name: str, module: str) -> Callable[[types.FrameType], bool]:
    return lambda f: f.f_code.co_name == name and module in f.f_code.co_filename


# -- 1. owner identity and liveness --------------------------------------------


def test_a_thread_given_a_dead_holders_id_is_not_handed_its_lock(
    manager: LockManager, keys: Any
) -> None:
    dead: dict[int, HeldLock] = {}  # thread id of a holder that ended -> its lock
    probe: dict[str, Any] = {}

    def hold(key: str) -> None:
        dead[threading.get_ident()] = manager.acquire(key)

    def run() -> None:
        ident = threading.get_ident()
        if ident in dead:
            probe["old"] = dead[ident]
            try:
                probe["held"] = manager.acquire(dead[ident].key, blocking=False)
            except (LockBusy, LockLost) as exc:
                probe["refused"] = exc

    for key in keys(200):
        # Linux mostly hands a new thread the id (stack) of one that ended.
        for target in (functools.partial(hold, key), run):
            t = threading.Thread(target=target)
            t.start()
            t.join()
        if "old" in probe:
            break
    else:
        pytest.skip("no thread id was reused")
    assert probe.get("held") is not probe["old"], "a new thread inherited a dead thread's lock"
    if "held" in probe:
        probe["held"].release(force=True)


def test_a_lock_whose_thread_ended_is_released_with_a_warning(
    manager: LockManager, make_manager: Any, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dblock")
    kept: list[HeldLock] = []
    t = threading.Thread(target=lambda: kept.append(manager.acquire(key, ttl=1.5)), name="gone-1")
    t.start()
    t.join()
    _wait_for(lambda: _free(manager, key))
    (held,) = kept
    assert held.lost
    assert held.released
    assert any(
        r.levelname == "WARNING" and key in r.getMessage() and "gone-1" in r.getMessage()
        for r in caplog.records
    )
    other = make_manager()
    other.acquire(key, blocking=False).release()


def test_an_unrenewed_lock_whose_thread_ended_is_released_before_its_lease_ends(
    manager: LockManager, key: str
) -> None:
    kept: list[HeldLock] = []
    t = threading.Thread(target=lambda: kept.append(manager.acquire(key, ttl=6, renew=False)))
    t.start()
    t.join()
    (held,) = kept
    _wait_for(lambda: _free(manager, key))
    # Released by dblock (within one renewal interval, a third of the lease), not expired.
    assert held.released
    assert held.remaining > 0


def test_a_lock_whose_asyncio_task_ended_is_released(
    manager: LockManager, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="dblock")
    kept: list[HeldLock] = []

    async def hold() -> None:
        kept.append(manager.acquire(key, ttl=1.5))  # uncontended: no wait, allowed

    async def main() -> None:
        await asyncio.create_task(hold(), name="gone-task")
        _wait_for(lambda: _free(manager, key))  # the loop still runs; the task has ended

    asyncio.run(main())
    assert kept[0].released
    assert any(key in r.getMessage() and "gone-task" in r.getMessage() for r in caplog.records)


def test_tasks_of_one_thread_are_different_owners(manager: LockManager, key: str) -> None:
    async def main() -> None:
        held = manager.acquire(key)  # owned by this task
        with pytest.raises(LockBusy) as busy:  # another task: not re-entrant
            await asyncio.create_task(_acquire_async(manager, key, blocking=False))
        assert busy.value.level == 1
        with pytest.raises(LockNotHeld):  # nor may it release this task's lock
            await asyncio.create_task(_release_async(held))
        held.release()

    asyncio.run(main())
    assert _free(manager, key)


async def _acquire_async(manager: LockManager, key: str, blocking: bool = True) -> HeldLock:
    return manager.acquire(key, blocking=blocking)


async def _release_async(held: HeldLock) -> bool:
    return held.release()


# -- 2. callbacks ---------------------------------------------------------------


def _lose(manager: LockManager, held: HeldLock) -> None:
    """Take the row away from ``held`` (as an operator's force-release would)."""
    assert manager.store.release(held.key, held.token)


def _renewed_twice(held: HeldLock, seconds: float) -> bool:
    first = held.expires_at
    try:
        _wait_for(lambda: held.expires_at != first, seconds)
        second = held.expires_at
        _wait_for(lambda: held.expires_at != second, seconds)
    except AssertionError:
        return False
    return True


def test_a_slow_on_lost_callback_delays_no_renewal(manager: LockManager, keys: Any) -> None:
    a, b = keys(2)
    started, finish = threading.Event(), threading.Event()
    threads: list[str] = []

    def slow(held: HeldLock) -> None:
        threads.append(threading.current_thread().name)
        started.set()
        finish.wait(30)  # a 5 s (or longer) callback

    held_a = manager.acquire(a, ttl=0.6, on_lost=slow)
    held_b = manager.acquire(b, ttl=0.6)
    try:
        _lose(manager, held_a)
        assert started.wait(10)
        assert _renewed_twice(held_b, 2.0), "renewal stopped while a callback ran"
        assert not held_b.lost
        assert threads != ["dblock-renewal"]
    finally:
        finish.set()
        held_b.release()
        with pytest.raises(LockLost):
            held_a.release()


@pytest.mark.parametrize("raised", [RuntimeError("boom"), SystemExit(3)], ids=repr)
def test_a_failing_on_lost_callback_is_logged_and_changes_nothing_else(
    manager: LockManager, keys: Any, raised: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = keys(2)
    called = threading.Event()

    def failing(held: HeldLock) -> None:
        called.set()
        raise raised

    held_a = manager.acquire(a, ttl=0.6, on_lost=failing)
    held_b = manager.acquire(b, ttl=0.6)
    _lose(manager, held_a)
    assert called.wait(10)
    assert _renewed_twice(held_b, 2.0), "renewal died with the callback"
    assert not held_b.lost
    held_b.release()
    with pytest.raises(LockLost):
        held_a.release()
    _wait_for(lambda: any("on_lost" in r.getMessage() for r in caplog.records))


# -- 3. close() -------------------------------------------------------------------


def test_close_sends_a_thread_queued_at_level_1_away(make_manager: Any, key: str) -> None:
    m = make_manager()
    held = m.acquire(key)
    t, out = _start(lambda: m.acquire(key, timeout=None))
    _wait_for(lambda: _queued(m, key))
    m.close()
    t.join(10)
    assert isinstance(out.get("error"), ManagerClosed)
    # The holder's lock was released at close and marked lost.
    assert held.lost
    with pytest.raises(LockLost):
        held.release()
    with pytest.raises(ManagerClosed):
        m.acquire(key)
    assert issubclass(ManagerClosed, DBLockError)


def test_close_sends_a_thread_waiting_at_level_2_away(make_manager: Any, key: str) -> None:
    other = make_manager()
    m = make_manager(poll_initial=0.01, poll_max=0.05)
    theirs = other.acquire(key)
    t, out = _start(lambda: m.acquire(key, timeout=None))
    _wait_for(lambda: m._locker.registry.get(key) is not None)
    m.close()
    theirs.release()  # the key is free now: the closed manager must not take it
    t.join(10)
    assert not t.is_alive()
    assert isinstance(out.get("error"), ManagerClosed), out
    other.acquire(key, blocking=False).release()


def test_close_keeps_renewing_holders_for_its_timeout(make_manager: Any, key: str) -> None:
    m = make_manager()
    box: list[HeldLock] = []
    started, done = threading.Event(), threading.Event()

    def work() -> bool:
        with m.lock(key, ttl=0.6) as held:
            box.append(held)
            started.set()
            done.wait(20)
            held.check()  # still ours, well past its first lease
        return True

    t, out = _start(work)
    assert started.wait(10)
    closer, closed = _start(lambda: m.close(timeout=20))
    _wait_for(lambda: m._closed)
    try:
        assert _renewed_twice(box[0], 2.0), "close() stopped renewing a holder still at work"
    finally:
        done.set()
    t.join(10)
    closer.join(10)
    assert out == {"result": True}
    assert "error" not in closed
    assert row_of(make_manager(), key) is None


def test_close_releases_what_is_still_held_after_its_timeout(make_manager: Any, key: str) -> None:
    m = make_manager()
    lost = threading.Event()
    held = m.acquire(key, on_lost=lambda _h: lost.set())
    m.close(timeout=0.1)
    assert held.lost
    assert lost.wait(5)
    with pytest.raises(LockLost):
        held.check()
    checker = make_manager()
    assert row_of(checker, key) is None


# -- 4. the synchronous decorator and awaitables ------------------------------


def test_the_sync_decorator_refuses_an_awaitable_result(manager: LockManager, key: str) -> None:
    ran: list[int] = []

    async def work(n: int) -> None:
        ran.append(n)

    @functools.wraps(work)
    def wrapper(n: int) -> Any:  # a plain function returning a coroutine
        return work(n)

    locked = manager.locked(key + ":{n}")(wrapper)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(LockArgumentError, match="async form"):
            locked(1)
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)]
    assert ran == []
    assert _free(manager, key + ":1")


def test_the_sync_decorator_refuses_a_coroutine_function_pointing_at_async(
    manager: LockManager, key: str
) -> None:
    async def work(n: int) -> None: ...

    with pytest.raises(LockArgumentError, match="async form"):
        manager.locked(key + ":{n}")(work)


# -- 5. blocking on an event loop's thread ------------------------------------


def test_a_blocking_wait_at_level_1_on_an_event_loop_is_refused(
    manager: LockManager, key: str
) -> None:
    gate, done = threading.Event(), threading.Event()

    def hold() -> None:
        with manager.lock(key):
            gate.set()
            done.wait(30)

    t, _ = _start(hold)
    assert gate.wait(10)

    async def main() -> None:
        with pytest.raises(LockArgumentError, match="asyncio"):
            manager.acquire(key, timeout=3)
        with pytest.raises(LockBusy):  # fail fast is fine: it does not block
            manager.acquire(key, blocking=False)

    try:
        asyncio.run(main())
        assert not _queued(manager, key)
    finally:
        done.set()
        t.join()
    assert _free(manager, key)


def test_a_blocking_wait_at_level_2_on_an_event_loop_is_refused(
    manager: LockManager, make_manager: Any, key: str
) -> None:
    theirs = make_manager().acquire(key)

    async def main() -> None:
        with pytest.raises(LockArgumentError, match="asyncio"):
            manager.acquire(key, timeout=3)

    asyncio.run(main())
    theirs.release()
    assert _free(manager, key)

    async def uncontended() -> None:
        with manager.lock(key):  # nothing to wait for: allowed
            pass

    asyncio.run(uncontended())


# -- 6. one request entered twice ------------------------------------------------


def test_one_lock_request_entered_twice_nested_leaks_nothing(
    manager: LockManager, key: str
) -> None:
    req = manager.lock(key)
    with req as outer:
        with req as inner:
            assert inner is outer
        assert not outer.released
    assert outer.released
    assert _free(manager, key)


def test_one_lock_many_request_entered_twice_nested_leaks_nothing(
    manager: LockManager, keys: Any
) -> None:
    ks = keys(2)
    req = manager.lock_many(ks)
    with req, req:
        pass
    assert all(_free(manager, k) for k in ks)


# -- 7. interruption at every point of acquire -----------------------------------


def test_interrupted_while_queued_at_level_1(manager: LockManager, key: str) -> None:
    gate, done = threading.Event(), threading.Event()

    def hold() -> None:
        with manager.lock(key):
            gate.set()
            done.wait(30)

    t, out = _start(hold)
    assert gate.wait(10)
    with interrupt_when(_named("wait", "registry.py")) as fired, pytest.raises(Interrupt):
        manager.acquire(key, timeout=None)
    assert fired.is_set()
    assert not _queued(manager, key)
    done.set()
    t.join()
    assert "error" not in out
    assert _free(manager, key)  # no ghost waiter was handed the key
    manager.acquire(key, blocking=False).release()


def test_interrupted_while_waiting_at_level_2(
    manager: LockManager, make_manager: Any, key: str
) -> None:
    other = make_manager()
    theirs = other.acquire(key)
    with interrupt_when(_named("sleep", "_store")) as fired, pytest.raises(Interrupt):
        manager.acquire(key, timeout=None)
    assert fired.is_set()
    assert manager._locker.registry.get(key) is None
    theirs.release()
    assert row_of(manager, key) is None
    manager.acquire(key, blocking=False).release()


def _spin_after_insert(fired: threading.Event) -> None:
    deadline = time.monotonic() + 5
    while not fired.is_set() and time.monotonic() < deadline:
        pass  # Python bytecode: the signal handler runs here


def test_interrupted_mid_statement(manager: LockManager, make_manager: Any, key: str) -> None:
    """Interrupted just after the INSERT committed, before its result was read."""
    main = threading.get_ident()
    fired_box: list[threading.Event] = []

    def after(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if threading.get_ident() == main and "INSERT" in statement.upper():
            _spin_after_insert(fired_box[0])

    sa.event.listen(manager.engine, "after_cursor_execute", after)
    try:
        with interrupt_when(lambda f: f.f_code.co_name == "_spin_after_insert") as fired:
            fired_box.append(fired)
            with pytest.raises(Interrupt):
                manager.acquire(key)
    finally:
        sa.event.remove(manager.engine, "after_cursor_execute", after)
    assert fired.is_set()
    assert manager._locker.registry.get(key) is None
    # The row the INSERT committed is deleted at once, not left to its lease.
    _wait_for(lambda: row_of(manager, key) is None)
    make_manager().acquire(key, blocking=False).release()


def test_interrupted_between_the_grant_and_the_held_lock(
    manager: LockManager, make_manager: Any, key: str
) -> None:
    """Interrupted after the statement granted the row, while the held lock
    that would carry it is being made: the row is deleted at once (its
    token known only to this frame), not left to block the key for a lease."""

    def making_the_held_lock(f: types.FrameType) -> bool:
        return f.f_code.co_name == "__init__" and type(f.f_locals.get("self")) is HeldLock

    with interrupt_when(making_the_held_lock) as fired, pytest.raises(Interrupt):
        while True:  # (the timer may miss a short window: take the key again until it hits)
            manager.acquire(key, ttl=60).release()
    assert fired.is_set()
    assert manager._locker.registry.get(key) is None
    _wait_for(lambda: row_of(manager, key) is None, seconds=5)
    # The same window after a wait (the request went on through the steps):
    # another holder first, released while this one waits.
    other = make_manager()
    with interrupt_when(making_the_held_lock) as fired, pytest.raises(Interrupt):
        while True:
            held = other.acquire(key)
            threading.Timer(0.05, functools.partial(held.release, force=True)).start()
            manager.acquire(key, ttl=60, timeout=5).release()
    assert fired.is_set()
    assert manager._locker.registry.get(key) is None
    _wait_for(lambda: row_of(manager, key) is None, seconds=5)
    make_manager().acquire(key, blocking=False).release()


def test_interrupted_as_the_first_try_hands_on_to_the_steps(
    manager: LockManager, make_manager: Any, key: str
) -> None:
    """A first try refused (the row held elsewhere) goes on in the step
    machinery, which owns the claimed key once its ``try`` begins: a signal
    in the instant before that must not leave the key claimed at level 1
    for ever (every later request of the process refused)."""
    import inspect

    from dblock.lock import Locker

    source, first_line = inspect.getsourcelines(Locker.acquire_steps)
    guarded = first_line + next(i for i, line in enumerate(source) if line.strip() == "try:")

    def before_the_steps_own_it(f: types.FrameType) -> bool:
        return (
            f.f_code.co_name == "acquire_steps"
            and f.f_locals.get("claimed") is not None
            and f.f_lineno < guarded
        )

    other = make_manager()
    with other.lock(key):
        deadline = time.monotonic() + 60
        with interrupt_when(before_the_steps_own_it) as fired:
            while not fired.is_set() and time.monotonic() < deadline:
                with contextlib.suppress(LockBusy, Interrupt):
                    manager.acquire(key, blocking=False)
        assert fired.is_set(), "the interruption never hit the instant under test"
        assert manager._locker.registry.get(key) is None
    manager.acquire(key, blocking=False).release()


@pytest.mark.databases("sqlite", "postgresql")  # MySQL/MariaDB has no hand-off statement
def test_interrupted_while_the_key_is_handed_over(manager: LockManager, key: str) -> None:
    gate = threading.Event()
    holder_thread: list[int] = []
    fired_box: list[threading.Event] = []

    def hold() -> None:
        holder_thread.append(threading.get_ident())
        with manager.lock(key):
            gate.set()
            _wait_for(lambda: _queued(manager, key))
        # leaving: the key (and on these databases the row) is handed to the waiter

    def stall_hand_off(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        # Hold the hand-off statement until the waiter has been interrupted.
        if threading.get_ident() in holder_thread and statement.lstrip().upper().startswith(
            "UPDATE"
        ):
            fired_box[0].wait(10)

    def granted(f: types.FrameType) -> bool:
        if f.f_code.co_name not in ("wait_turn", "_wait_local"):
            return False
        waiter = f.f_locals.get("waiter")
        return waiter is not None and bool(waiter.granted)

    sa.event.listen(manager.engine, "before_cursor_execute", stall_hand_off)
    try:
        t, out = _start(hold)
        assert gate.wait(10)
        with interrupt_when(granted) as fired, pytest.raises(Interrupt):
            fired_box.append(fired)
            manager.acquire(key, timeout=None)
        assert fired.is_set()
        t.join(10)
        assert "error" not in out
    finally:
        sa.event.remove(manager.engine, "before_cursor_execute", stall_hand_off)
    # What was handed to us at that instant was released, not leaked.
    _wait_for(lambda: _free(manager, key))
    manager.acquire(key, blocking=False).release()


# -- 8. a lock dropped without release --------------------------------------------


def _drop(box: list[HeldLock]) -> None:
    """Drop the only reference to a held lock, without releasing it."""
    box.clear()
    gc.collect()


def test_a_dropped_lock_is_released_when_collected(
    manager: LockManager, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    box = [manager.acquire(key)]
    ref = weakref.ref(box[0])
    with pytest.warns(ResourceWarning, match=re.escape(key)):
        _drop(box)
    assert ref() is None, "something keeps an unreachable lock alive"
    _wait_for(lambda: _free(manager, key))


def test_a_thread_waiting_for_a_dropped_lock_gets_it(manager: LockManager, key: str) -> None:
    box = [manager.acquire(key)]
    t, out = _start(lambda: manager.acquire(key, timeout=30).release())
    _wait_for(lambda: _queued(manager, key))
    with pytest.warns(ResourceWarning):
        _drop(box)
    t.join(30)
    assert out == {"result": True}
    assert _free(manager, key)


@contextmanager
def _row_write_locked(manager: LockManager, key: str) -> Iterator[None]:
    """A transaction of the test's own that keeps ``key``'s row from being
    deleted until the block ends (SQLite: the whole file's write lock)."""
    engine = sa.create_engine(manager.engine.url, poolclass=sa.pool.NullPool)
    table = manager.store.table
    try:
        with engine.connect() as conn:
            if engine.dialect.name == "sqlite":
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            else:
                conn.begin()
                conn.execute(sa.select(table).where(table.c.lock_key == key).with_for_update())
            try:
                yield
            finally:
                conn.rollback()
    finally:
        engine.dispose()


def test_asking_again_while_the_dropped_lock_is_being_released_keeps_the_timeout(
    manager: LockManager, key: str
) -> None:
    """The owner asks again for a key whose dropped lock the renewal thread
    is deleting (its DELETE held up by a row lock): a waiting request gives
    up at its timeout instead of waiting for that DELETE however long it
    takes. (A fail-fast one waits for it, as for a statement of its own:
    test_owners_gone.py.)"""
    box = [manager.acquire(key)]
    with _row_write_locked(manager, key):
        with pytest.warns(ResourceWarning):
            _drop(box)
        entry = manager._locker.registry.get(key)
        assert entry is not None
        # The renewal thread has taken the job (its DELETE now waits for us).
        _wait_for(lambda: entry.held is not None and not entry.held.live)
        t0 = time.monotonic()
        with pytest.raises(LockTimeout):
            manager.acquire(key, timeout=0.3)
        assert 0.3 <= time.monotonic() - t0 < 1.5
    manager.acquire(key, timeout=10).release()
    assert _free(manager, key)


def test_a_release_in_flight_is_not_taken_for_an_abandoned_key(
    manager: LockManager, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A deferred release fired on another thread after the taking thread
    ended: while its DELETE is held up, the renewal pass's look for keys
    whose owner can never pass them on must leave this one be (its release
    passes it on): no key passed on at level 1 before the row is gone, no
    false "ended without releasing it"."""
    from dblock.deferral import Deferred

    caplog.set_level(logging.WARNING, logger="dblock")

    def take() -> Any:
        deferred = Deferred(manager.acquire(key))
        trigger = deferred.trigger()
        deferred.finish(None)
        return trigger

    trigger = _in_thread(take)["result"]  # its thread has ended now
    entry = manager._locker.registry.get(key)
    assert entry is not None
    with _row_write_locked(manager, key):
        fire, out = _start(trigger)
        _wait_for(lambda: entry.held is None)  # released, its DELETE waiting for us
        manager._locker._reap()  # the renewal pass's look, at the worst moment
        assert manager._locker.registry.get(key) is entry, "passed on before its row was gone"
    fire.join(30)
    assert out == {"result": None}
    _wait_for(lambda: _free(manager, key))
    assert "ended without releasing" not in caplog.text
    assert "passed on at level 1" not in caplog.text


def test_interrupted_as_the_machinery_returns_a_grant_keeps_the_key_with_its_row(
    manager: LockManager, make_manager: Any, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first try refused (the row held elsewhere) hands the request to the
    step machinery, which waits and is granted; a signal in the instant
    after it returned the held lock, before acquire() returns it: the key
    stays this process's at level 1 until that unreachable lock's row is
    deleted (its owner ended, or it was collected), never passed on while
    the row is held."""
    elsewhere = make_manager().acquire(key)
    locker = manager._locker
    real_run = locker.run

    machinery = threading.Event()

    def run_then_signal(steps: Any) -> Any:
        machinery.set()  # handed on: its first try was refused
        result = real_run(steps)
        if isinstance(result, HeldLock):
            raise KeyboardInterrupt  # as a signal handler would, right there
        return result

    monkeypatch.setattr(locker, "run", run_then_signal)
    interrupted, done = threading.Event(), threading.Event()

    def request() -> None:
        try:
            manager.acquire(key, timeout=30)
        except KeyboardInterrupt:
            interrupted.set()
            done.wait(30)  # alive: the renewal pass leaves its lock be meanwhile

    t, _ = _start(request)
    assert machinery.wait(30)
    elsewhere.release()
    assert interrupted.wait(30)
    monkeypatch.undo()
    assert locker.registry.get(key) is not None, "passed on with its row held"
    assert row_of(manager, key) is not None
    # Its thread ends: the renewal pass releases the lock (or, dropped, it
    # is released when collected), and the key goes with its row.
    done.set()
    t.join(30)
    _wait_for(lambda: _free(manager, key))


# -- 15. release by another thread -------------------------------------------------


def test_release_from_another_thread_is_refused(manager: LockManager, key: str) -> None:
    held = manager.acquire(key)
    out = _in_thread(held.release)
    assert isinstance(out.get("error"), LockNotHeld)
    assert "only its holder" in str(out["error"])
    assert not held.released
    assert row_of(manager, key) is not None
    out = _in_thread(lambda: held.release(force=True))  # explicit hand-over
    assert out == {"result": True}
    assert _free(manager, key)


def test_release_of_lock_many_from_another_thread_is_refused(
    manager: LockManager, keys: Any
) -> None:
    ks = keys(2)
    held = manager.acquire_many(ks)
    out = _in_thread(held.release)
    assert isinstance(out.get("error"), LockNotHeld)
    assert all(row_of(manager, k) is not None for k in ks)
    assert _in_thread(lambda: held.release(force=True)) == {"result": True}
    assert all(_free(manager, k) for k in ks)


# -- 16. extend() ----------------------------------------------------------------------


def test_extend_renews_the_lease_by_hand(manager: LockManager, key: str) -> None:
    held = manager.acquire(key, ttl=2, renew=False)
    before = held.expires_at
    held.extend(60)
    assert held.expires_at > before
    assert held.remaining > 30
    row = row_of(manager, key)
    assert row is not None
    assert row.token == held.token
    held.extend()  # the lock's own ttl again
    assert held.remaining < 30
    held.release()


def test_extend_of_a_row_no_longer_ours_raises_lock_lost(manager: LockManager, key: str) -> None:
    held = manager.acquire(key, ttl=30, renew=False)
    _lose(manager, held)
    with pytest.raises(LockLost):
        held.extend()
    assert held.lost
    with pytest.raises(LockLost):
        held.release()
    with pytest.raises(LockArgumentError):
        manager.acquire(key).extend(-1)


# -- 17. settled semantics -------------------------------------------------------------


def test_acquire_of_a_key_whose_own_acquisition_expired_raises_lock_lost(
    manager: LockManager, key: str
) -> None:
    held = manager.acquire(key, ttl=0.3, renew=False)
    _wait_for(lambda: held.lost)
    with pytest.raises(LockLost):
        manager.acquire(key)
    with pytest.raises(LockLost):
        held.release()
    assert _free(manager, key)


def test_held_locks_follow_the_mapping_contract(manager: LockManager, keys: Any) -> None:
    ks = keys(2)
    with manager.lock_many(ks) as held:
        assert held.get(123) is None  # type: ignore[call-overload]
        assert 123 not in held
        assert "" not in held
        assert held.get("nope") is None
        assert ks[0] in held
        with pytest.raises(KeyError):
            held[123]  # type: ignore[index]


def test_an_interruption_between_tries_of_an_acquire_in_doubt_leaves_no_row(
    manager: LockManager, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The acquire statement committed but its answer was lost (the driver
    could not decode it), and while dblock waits to ask again the thread is
    interrupted (a signal handler's exception during that sleep): the row
    must not be left to its lease. The renewal thread deletes it at once."""
    with manager.lock(key):  # warm: the statements and the connection
        pass
    garbled: list[str] = []

    def garble(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not garbled and "INSERT" in statement.upper():
            garbled.append(statement)
            raise ValueError("invalid literal for int() with base 10: ''")

    real_sleep = time.sleep
    main = threading.current_thread()

    def interrupted_sleep(seconds: float) -> None:
        if garbled and threading.current_thread() is main:
            raise Interrupt  # as a SIGALRM handler would, during the backoff
        real_sleep(seconds)

    sa.event.listen(manager.engine, "after_cursor_execute", garble)
    monkeypatch.setattr("dblock.lock.time.sleep", interrupted_sleep)
    try:
        with pytest.raises(Interrupt), manager.lock(key, ttl=60):
            pytest.fail("acquired although interrupted")
    finally:
        monkeypatch.undo()
        sa.event.remove(manager.engine, "after_cursor_execute", garble)
    assert garbled
    deadline = time.monotonic() + 10
    while row_of(manager, key) is not None and time.monotonic() < deadline:
        time.sleep(0.01)  # polling the table for the renewal thread's DELETE
    assert row_of(manager, key) is None
    assert manager._locker.registry.get(key) is None
    with manager.lock(key, blocking=False):
        pass


@pytest.mark.databases("postgresql", "mariadb")
@pytest.mark.parametrize("observed", [False, True], ids=["direct", "observed"])
def test_a_statement_reaching_the_server_after_its_caller_was_interrupted_leaves_no_row(
    db_url: str, key: str, observed: bool
) -> None:
    """A signal interrupts the acquire while its INSERT is on its way (held
    by a proxy, as a slow network would). The connection is closed, but a
    closed connection does not stop a statement the server was sent: it
    runs when it arrives, possibly after the DELETE that settles the
    interrupted acquisition by its token. Its row must still go, not hold
    the key for its lease."""
    url = sa.make_url(db_url)
    proxy = Proxy(url.host or "127.0.0.1", url.port or (5432 if "postgresql" in db_url else 3306))
    m = LockManager(proxy.url_for(db_url), ttl=60)
    if observed:  # a listener on the engine: statements go through SQLAlchemy's Connection
        sa.event.listen(m.engine, "before_cursor_execute", lambda *args: None)
    try:
        m.acquire(f"{key}-warm").release()  # a connection made
        held, let_go = proxy.hold(key.encode())

        def later() -> None:
            held.wait(10)
            # The cleaner's chance to delete the orphan too early, then
            # the INSERT reaches the server, and runs.
            deadline = time.monotonic() + 2.5
            while time.monotonic() < deadline and (m.store.has_orphans or not interrupted.is_set()):
                time.sleep(0.01)
            let_go.set()

        interrupted = threading.Event()
        helper = threading.Thread(target=later, daemon=True)
        helper.start()
        in_flight = _named("run", "_store/executor.py")
        with interrupt_when(lambda f: held.is_set() and in_flight(f)), pytest.raises(Interrupt):
            m.acquire(key)
        interrupted.set()
        helper.join(10)
        assert let_go.is_set()
        deadline = time.monotonic() + 10
        while m.store.has_orphans or row_of(m, key) is not None:
            assert time.monotonic() < deadline, "the late INSERT's row stayed (lease 60 s)"
            time.sleep(0.05)
    finally:
        m.close()
        proxy.close()


@pytest.mark.databases("mariadb")  # (psycopg's and SQLite's waits run no signal handler)
def test_interrupted_while_releasing_several_locks_releases_them_all(
    manager: LockManager, db_url: str, keys: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The blocking face of the cancelled ``lock_many`` exit: a signal
    handler's exception while the newest lock's DELETE waits in the
    database. The older locks go at once on the renewal thread, although
    the thread lives on; nobody is told they were "never released"."""
    from tests.test_cancellation import statements_held

    caplog.set_level(logging.WARNING, logger="dblock")
    names = sorted(keys(3))
    row_locked, done = threading.Event(), threading.Event()

    def lock_the_newest_row() -> None:
        with statements_held(db_url, [names[-1]]):
            row_locked.set()
            done.wait(10)

    releasing = threading.Event()
    in_statement = _named("run", "_store/executor.py")
    with (
        interrupt_when(lambda f: releasing.is_set() and in_statement(f)) as fired,
        pytest.raises(Interrupt),
        manager.lock_many(names),
    ):
        threading.Thread(target=lock_the_newest_row, daemon=True).start()
        assert row_locked.wait(10)
        releasing.set()
    done.set()
    assert fired.is_set()
    _wait_for(lambda: all(row_of(manager, k) is None for k in names), seconds=10)
    assert "never released" not in caplog.text
    assert "ended without releasing" not in caplog.text


def test_an_acquire_interrupted_inside_the_registry_or_the_batcher_leaves_nothing_taken(
    manager: LockManager, make_manager: Any, key: str
) -> None:
    """A signal handler's exception at every point of the registry's and the
    group-commit batcher's code where CPython can raise it, while a lock is
    acquired: the key is free again for other processes and for the next
    request of the same thread, at once or through the renewal thread.
    Before: one landing inside ``Registry.claim`` after the key went in left
    it taken at level 1 for as long as the thread lived (and that thread's
    next request waited for ever on a lock it never had); one landing as the
    batcher's lone statement set out left its lane taken, so every later
    request of the process queued behind nobody."""
    checker = make_manager()
    n = 0
    while True:
        n = next_point(n)
        held = None
        with (
            interrupt_at(n, "dblock/registry.py", "dblock/_store/batch.py") as armed,
            contextlib.suppress(Interrupted),
        ):
            held = manager.acquire(key, timeout=10)
        if held is not None:
            held.release()
        if armed.points < n:
            break  # an acquire went by without reaching point n
        deadline = time.monotonic() + 5
        while manager._locker.registry.get(key) is not None or not _free_elsewhere(checker, key):
            assert time.monotonic() < deadline, f"interrupted in {armed.where}: the key stayed"
            time.sleep(0.01)
        manager.acquire(key, timeout=5).release()  # the thread's own next request
    assert n > 5


def _free_elsewhere(other: LockManager, key: str) -> bool:
    try:
        other.acquire(key, blocking=False).release()
    except LockBusy:
        return False
    return True


@pytest.mark.parametrize("waiting", [False, True], ids=["alone", "handed-on"])
def test_a_release_interrupted_anywhere_leaves_nothing_taken(
    manager: LockManager, make_manager: Any, key: str, waiting: bool
) -> None:
    """A signal handler's exception at every point of the release's own code
    (lock.py, and the registry, renewal and telemetry code it calls) where
    CPython can raise it: the key comes free for the thread's next request
    and for other processes, and a local thread waiting for it gets it (as a
    hand-off or by acquiring the row itself), at once or through the renewal
    thread. Before: one landing just after the release marked the key as
    being let go, and before the DELETE's ``try``, left it so for as long as
    the process lived (the renewal pass leaves such a key to its releaser);
    one landing after the next local thread was made the key's owner, and
    before it was woken, left that thread waiting for ever."""
    checker = make_manager()
    files = (*LOCK_FILES, "dblock/registry.py", "dblock/renewal.py", "dblock/telemetry.py")
    n = 0
    while True:
        n = next_point(n)
        held = manager.acquire(key, timeout=10)
        waiter: tuple[threading.Thread, dict[str, Any]] | None = None
        if waiting:
            waiter = _start(lambda: manager.acquire(key, timeout=30).release())
            _wait_for(lambda: _queued(manager, key))
        with interrupt_at(n, *files) as armed, contextlib.suppress(Interrupted):
            held.release()
        del held  # (a lock nobody can reach is released by the renewal thread)
        _left_nothing(manager, checker, key, armed.where, waiter, "the waiter waits on")
        if armed.points < n:
            break  # a release went by without reaching point n
    assert n > 5


@pytest.mark.parametrize("queued", [False, True], ids=["alone", "queued"])
def test_an_acquire_interrupted_anywhere_leaves_nothing_taken(
    manager: LockManager, make_manager: Any, key: str, queued: bool
) -> None:
    """As above, for an acquire: alone, and queued behind a local thread that
    then hands the key on. Wherever the exception lands in the lock's own
    code, the key comes free for other processes and for the thread's next
    request, and the thread that held it finishes its release. Before: one
    landing as the acquire loop read a granted try's answer (MariaDB, where
    the queued thread tries the row itself) left the row for its lease."""
    checker = make_manager()
    files = (*LOCK_FILES, "dblock/registry.py", "dblock/renewal.py", "dblock/telemetry.py")
    n = 0
    while True:
        n = next_point(n)
        holder: tuple[threading.Thread, dict[str, Any]] | None = None
        gave_up = threading.Event()
        if queued:
            taken = threading.Event()

            def hold(taken: threading.Event, gave_up: threading.Event) -> None:
                with manager.lock(key, timeout=10):
                    taken.set()
                    _wait_for(lambda: _queued(manager, key) or gave_up.is_set(), seconds=20)

            holder = _start(functools.partial(hold, taken, gave_up))
            assert taken.wait(10)
        held = None
        with interrupt_at(n, *files) as armed, contextlib.suppress(Interrupted):
            held = manager.acquire(key, timeout=10)
        gave_up.set()
        if held is not None:
            held.release()
        del held
        _left_nothing(manager, checker, key, armed.where, holder, "the holder hangs")
        if armed.points < n:
            break  # an acquire went by without reaching point n
    assert n > 5


def _left_nothing(
    manager: LockManager,
    checker: LockManager,
    key: str,
    where: str | None,
    other: tuple[threading.Thread, dict[str, Any]] | None,
    hang: str,
) -> None:
    """After an interrupted request: the other local thread (if any) ended
    well, the key comes free for another manager, and this thread's next
    request gets it."""
    if other is not None:
        thread, out = other
        thread.join(30)
        assert not thread.is_alive(), f"interrupted in {where}: {hang}"
        assert "error" not in out, f"interrupted in {where}: {out.get('error')!r}"
    deadline = time.monotonic() + 10
    while manager._locker.registry.get(key) is not None or not _free_elsewhere(checker, key):
        assert time.monotonic() < deadline, f"interrupted in {where}: the key stayed"
        time.sleep(0.01)
    manager.acquire(key, timeout=5).release()
