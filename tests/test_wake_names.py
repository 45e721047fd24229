"""MariaDB's named-lock wake-ups (``NamedLockWaker``) under a stopped former
holder, with more waited-for keys than probe slots, and with exceptions
landing inside the waker where CPython runs signal handlers.

Real processes where a process matters (a holder SIGSTOPped past its lease
keeps its session, and so the key's name); elsewhere two managers stand for
two processes (each has its own waker and connections), as in test_wake.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest

from dblock import LockManager
from dblock._store.wake import NamedLockWaker, WokenWait
from tests.support.notify import start_waiter, until
from tests.support.procs import hold_forever

pytestmark = pytest.mark.databases("mariadb")

# A waiter woken by its re-check or by polling fails the tests.
SLOW = {"notify_recheck": 30.0, "poll_initial": 30.0, "poll_max": 30.0}
# The same, but a probe that finds a name free the instant before its new
# holder takes it probes again within the usual few milliseconds (the pause
# starts at poll_initial).
RACING = {"notify_recheck": 30.0, "poll_initial": 0.005, "poll_max": 30.0}
# A wake-up's bound here: the target is 100 ms; a shared, loaded server and
# machine get some room, polling or the re-check none.
WAKE = 2.0


def waker_of(manager: LockManager) -> Any:
    """``manager``'s named-lock waker, made (the server's capabilities read) if need be."""
    store: Any = manager.store
    if store.returning is None:
        store._capabilities()
    waker = store.waker_or_none()
    assert waker is not None
    return waker


def name_used_by(manager: LockManager, name: str) -> int | None:
    with manager.engine.connect() as conn:
        found = conn.exec_driver_sql(f"SELECT IS_USED_LOCK('{name}')").scalar_one()
    return None if found is None else int(found)


@pytest.fixture
def stopped_holder(db_url: str, key: str) -> Iterator[multiprocessing.process.BaseProcess]:
    """A process that took ``key`` (a lease of 1 s) and named it, then was
    SIGSTOPped: its session keeps the name for as long as it is stopped."""
    ctx = multiprocessing.get_context("spawn")
    report = ctx.Queue()
    proc = ctx.Process(target=hold_forever, args=(db_url, key, 1.0, report), daemon=True)
    proc.start()
    try:
        report.get(timeout=30)
        yield proc
    finally:
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        os.kill(proc.pid, signal.SIGCONT)
        proc.join(10)


def test_a_stopped_former_holder_costs_the_new_holder_nothing_and_wakes_nobody_late(
    make_manager: Callable[..., LockManager],
    key: str,
    stopped_holder: multiprocessing.process.BaseProcess,
) -> None:
    """Before: the new holder's names thread tried for the name every 2 ms
    for as long as it held the key (~480 statements a second), and a third
    process's waiter, blocked on a name nobody let go, woke at its re-check
    only. Now the stale session is killed once it has held the name for
    STALE seconds: the new holder names the key, and its release wakes the
    waiter at once."""
    holder = make_manager()
    waiter = make_manager(**RACING)
    _warm(waiter, f"{key}:warm")
    name = waker_of(holder).name(key)
    until(lambda: name_used_by(holder, name) is not None, "the first holder's name")
    stale = name_used_by(holder, name)
    assert stopped_holder.pid is not None
    os.kill(stopped_holder.pid, signal.SIGSTOP)
    held = holder.acquire(key, timeout=10)  # its lease ran out: taken over
    t, got = start_waiter(waiter, key)
    time.sleep(1.0)  # (STALE is 0.5 s)
    waker = waker_of(holder)
    before = waker.statements
    time.sleep(2.0)
    sent = waker.statements - before
    assert sent <= 2, f"{sent} named-lock statements in 2 s while holding the key"
    assert name_used_by(holder, name) not in (None, stale), "the name is still the stale session's"
    until(lambda: waker_of(waiter).covers(key), "the waiter's probe")
    time.sleep(0.2)
    released = time.monotonic()
    held.release()
    until(lambda: got, "the waiter's grant", timeout=15)
    assert got[0] - released < WAKE
    t.join(10)


def test_a_release_of_a_name_never_taken_wakes_the_waiters_blocked_on_the_stale_one(
    make_manager: Callable[..., LockManager],
    key: str,
    stopped_holder: multiprocessing.process.BaseProcess,
) -> None:
    """The new holder cannot kill the stale session before its release
    (here: it is not allowed to kill it before the release): the release
    itself does, so the waiter blocked on the stale name wakes at once."""
    holder = make_manager()
    waiter = make_manager(**RACING)
    _warm(waiter, f"{key}:warm")
    name = waker_of(holder).name(key)
    until(lambda: name_used_by(holder, name) is not None, "the first holder's name")
    assert stopped_holder.pid is not None
    os.kill(stopped_holder.pid, signal.SIGSTOP)
    waker = waker_of(holder)
    waker.STALE = 60.0  # not killed while held ...
    held = holder.acquire(key, timeout=10)
    t, got = start_waiter(waiter, key)
    until(lambda: waker_of(waiter).covers(key), "the waiter's probe")
    time.sleep(0.5)  # (its names thread tried for the name, and backs off)
    waker.STALE = 0.2  # ... but by the release, it has held it long enough
    released = time.monotonic()
    held.release()
    until(lambda: got, "the waiter's grant", timeout=15)
    assert got[0] - released < WAKE
    t.join(10)


def test_waiters_of_keys_beyond_the_slots_are_woken_by_the_release(
    make_manager: Callable[..., LockManager], keys: Any
) -> None:
    """More keys waited for than the waker has probe connections: the rest
    were polled (with the polling backoff: 270 ms p50, 857 ms p99 with 1,000
    keys); now one statement looks at all their names, every 40 ms."""
    many = keys(NamedLockWaker.SLOTS + 6)
    holder = make_manager()
    waiter = make_manager(**SLOW)
    _warm(waiter, f"{many[0]}:warm")
    held = [holder.acquire(k) for k in many]
    hwaker = waker_of(holder)
    until(lambda: all(k in hwaker._have for k in many), "the holder's names")
    waiting = [start_waiter(waiter, k) for k in many]
    wwaker = waker_of(waiter)
    until(lambda: all(wwaker.covers(k) for k in many), "every key covered", timeout=20)
    time.sleep(0.2)
    late = []
    for lock, (t, got) in zip(held, waiting, strict=True):
        released = time.monotonic()
        lock.release()
        until(lambda got=got: got, "a grant", timeout=15)  # type: ignore[misc]
        if got[0] - released >= WAKE:
            late.append(got[0] - released)
        t.join(10)
    assert not late


def _warm(manager: LockManager, key: str) -> None:
    """``manager``'s names thread connected (at its first grant of a waited-
    for key it would open a connection beside the grant's, PyMySQL's TLS
    context alone some 100-300 ms), so the first wake-up measures a wake-up."""
    held = manager.acquire(key)
    waker = waker_of(manager)
    until(lambda: key in waker._have, "the warm-up's name")
    held.release()


# -- an exception wherever CPython runs a signal handler ------------------------


class _Raised(Exception):
    pass


def _injecting(at: int, files: tuple[str, ...]) -> tuple[Callable[..., Any], list[int]]:
    """A trace function raising ``_Raised`` at the ``at``-th point of frames
    of ``files`` where CPython 3.11 runs a signal handler: a frame's start
    (``call``), right after a call returned (raised at the callee's
    ``return``, it comes out of the call in the caller), and a backward jump
    (a ``line`` event at an earlier offset than the frame's last)."""
    seen = [0]
    last: dict[int, int] = {}

    def trace(frame: FrameType, event: str, arg: object) -> Any:
        if not frame.f_code.co_filename.endswith(files) or _masked(frame):
            return trace
        # (The called method's own start and return are the caller's points.)
        outer = frame.f_back is None or not frame.f_back.f_code.co_filename.endswith(files)
        point = event in ("call", "return") and not outer
        if event == "line":
            point = frame.f_lasti < last.get(id(frame), -1)
            last[id(frame)] = frame.f_lasti
        if point:
            seen[0] += 1
            if seen[0] == at:
                raise _Raised(f"{event} {frame.f_code.co_name}:{frame.f_lineno}")
        return trace

    return trace, seen


def _masked(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside ``dblock._threads.start``, which blocks
    signals while a thread starts (no handler runs there)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "start" and code.co_filename.endswith("_threads.py"):
            return True
        frame = frame.f_back
    return False


def _walk(op: Callable[[], object], check: Callable[[], None], limit: int = 400) -> int:
    """``op`` with an exception at each point in turn, ``check`` after each."""
    files = (os.path.join("_store", "wake.py"), "threading.py")
    for at in range(1, limit):
        trace, _ = _injecting(at, files)
        sys.settrace(trace)
        try:
            op()
        except _Raised as exc:
            where = str(exc)
        else:
            return at  # ran to its end: every point was visited
        finally:
            sys.settrace(None)
        try:
            check()
        except AssertionError as exc:
            raise AssertionError(f"{exc} (an exception at {where})") from None
    raise AssertionError(f"{op} not done after {limit} interruptions")


def _done_within(what: Callable[[], object], seconds: float = 5.0) -> None:
    t = threading.Thread(target=what, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{what} still blocked after {seconds} s"


def test_an_exception_anywhere_in_the_waker_leaves_no_mutex_held(
    make_manager: Callable[..., LockManager], key: str
) -> None:
    """Before: an exception as ``Condition.__enter__`` returned inside
    ``took`` left the names mutex held, and the next grant of the process
    on another thread blocked for good; one inside ``WokenWait.sleep`` left
    its event's lock held, and the next wake-up blocked the thread that
    rang it."""
    manager = make_manager()
    waker = waker_of(manager)
    other = f"{key}:other"

    def free() -> None:
        # (The waker's threads hold them for instants: not held for good.)
        for name, lock in (("names", waker._hmutex._lock), ("waiters'", waker._mutex)):
            assert lock.acquire(timeout=5), f"the {name} mutex is held"
            lock.release()
        _done_within(lambda: (waker.took(other), waker.let_go(other)))

    for op in (
        lambda: waker.took(key),
        lambda: waker.let_go(key),
        lambda: (waker.hot(key), waker.let_go(key)),
        lambda: waker.expect(key),
    ):
        _walk(op, free)
        waker.let_go(key)

    config = manager.store.config

    def woken() -> None:
        free()
        for events in list(waker._subs.values()):
            for event in list(events):
                _done_within(event.set)

    since = time.monotonic()
    subscribed: list[Any] = []
    for op in (
        lambda: subscribed.append(waker.subscribe(key, since)),
        lambda: subscribed.append(WokenWait(waker, key, since, config)),
    ):

        def nothing_left() -> None:
            woken()
            assert not waker._subs.get(key), "an interrupted subscription was left"

        _walk(op, nothing_left)
        assert len(subscribed) == 1
        waiting = subscribed.pop()
        if isinstance(waiting, WokenWait):
            _walk(lambda: waiting.sleep(0.001), woken)  # noqa: B023
            _walk(waiting.close, woken)
        else:
            _walk(lambda: waker.unsubscribe(key, waiting), woken)  # noqa: B023
        assert not waker._subs.get(key), "a subscription outlived its wait"
    waker.close()
