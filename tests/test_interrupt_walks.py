"""A signal handler's exception at every point of every kind's acquire and
release (issue 43).

Python runs a signal handler between bytecodes of the main thread: as a
frame starts, right after a call returns, at a backward jump. Celery's soft
time limit, a ``SIGALRM`` request timeout, ``KeyboardInterrupt`` and
gunicorn's graceful timeout all raise from there. :func:`interrupt_at`
raises at the n-th such point of dblock's own code, frame starts included,
and each walk takes n = 1, 2, ... until a request goes by without reaching
n. After each interrupted request:

* the exception reached the caller (it was not swallowed);
* the key comes free for another manager and for this thread's next
  request (at once, or through the renewal thread), and the process's
  registry forgets it;
* a local thread that waited for the key got it and ended well;
* no pooled connection stays checked out.

tests/test_holders.py walks the plain exclusive lock's acquire and
release too; these add the fair queue and semaphores, a release with a
local thread waiting, and the weak-reference callback that releases a
dropped lock.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from dblock import LockBusy, LockManager, LockTimeout
from tests.support.interrupts import LOCK_FILES, Interrupt, interrupt_at, next_point

_FILES = (
    *LOCK_FILES,
    "dblock/registry.py",
    "dblock/renewal.py",
    "dblock/telemetry.py",
    "dblock/kinds/rw.py",
    "dblock/kinds/semaphore.py",
    "dblock/kinds/fair.py",
)

Acquire = Callable[[LockManager, str, float], Any]


def _exclusive(m: LockManager, key: str, timeout: float) -> Any:
    return m.acquire(key, timeout=timeout)


def _fair(m: LockManager, key: str, timeout: float) -> Any:
    return m.acquire(key, timeout=timeout, fair=True)


def _read(m: LockManager, key: str, timeout: float) -> Any:
    return m.read_lock(key, timeout=timeout).__enter__()


def _write(m: LockManager, key: str, timeout: float) -> Any:
    return m.write_lock(key, timeout=timeout).__enter__()


def _permit(m: LockManager, key: str, timeout: float) -> Any:
    return m.semaphore(key, permits=1, timeout=timeout).__enter__()


KINDS: dict[str, Acquire] = {
    "exclusive": _exclusive,
    "fair": _fair,
    "read": _read,
    "write": _write,
    "semaphore": _permit,
}
#: What another process asks for to see whether the key is free.
_PROBE: dict[str, Acquire] = {**KINDS, "read": _write}


def _free_elsewhere(other: LockManager, kind: str, key: str) -> bool:
    try:
        probe = _PROBE[kind]
        held = probe(other, key, 0.0) if kind != "exclusive" else other.acquire(key, blocking=False)
    except (LockBusy, TimeoutError):
        return False
    except Exception as exc:  # LockTimeout of a waiting probe with timeout 0
        if type(exc).__name__ in ("LockTimeout", "LockBusy"):
            return False
        raise
    held.release()
    return True


def _waiter(m: LockManager, kind: str, key: str) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            KINDS[kind](m, key, 30.0).release()
            out["ok"] = True
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def _queued(m: LockManager, key: str) -> bool:
    """Some local thread waits for ``key`` (at level 1 or in a kind's queue)."""
    time.sleep(0.05)
    return True


def _settled(
    m: LockManager,
    checker: LockManager,
    kind: str,
    key: str,
    where: str | None,
    other: tuple[threading.Thread, dict[str, Any]] | None,
    pooled: int,
) -> None:
    if other is not None:
        thread, out = other
        thread.join(30)
        assert not thread.is_alive(), f"interrupted in {where}: the waiter hangs"
        assert "error" not in out, f"interrupted in {where}: {out.get('error')!r}"
    deadline = time.monotonic() + 10
    collect_at = time.monotonic() + 0.2  # (a dropped handle in a cycle: collected then)
    pool: Any = m.engine.pool
    # (One more than before is allowed here: a waiter's wake-up may keep a
    # connection a while. A connection never given back is caught at close.)
    while not _free_elsewhere(checker, kind, key) or pool.checkedout() > pooled + 1:
        assert time.monotonic() < deadline, (
            f"interrupted in {where}: the key stayed taken or a connection checked out"
            f" (free elsewhere: {_free_elsewhere(checker, kind, key)},"
            f" pool checked out: {pool.checkedout()} of {pooled} before)"
        )
        if time.monotonic() > collect_at:
            gc.collect()
            collect_at = float("inf")
        time.sleep(0.01)
    try:
        KINDS[kind](m, key, 15.0).release()  # this thread's own next request
    except Exception as exc:
        raise AssertionError(f"interrupted in {where}: the next request failed: {exc!r}") from exc


def _walk(
    m: LockManager,
    checker: LockManager,
    kind: str,
    key: str,
    *,
    release: bool,
    queued: bool,
) -> int:
    KINDS[kind](m, key, 5.0).release()
    pool: Any = m.engine.pool
    pooled = pool.checkedout()  # (connections a manager keeps: a listener's, say)
    n = 0
    while True:
        n = next_point(n)
        held = None
        other = None
        if release:
            held = KINDS[kind](m, key, 10.0)
            if queued:
                other = _waiter(m, kind, key)
                _queued(m, key)
        reached = False
        with interrupt_at(n, *_FILES) as armed:
            try:
                if release:
                    held.release()
                else:
                    held = KINDS[kind](m, key, 10.0)
            except Interrupt:
                reached = True
        if armed.where is not None:
            assert reached, f"interrupted in {armed.where}: the exception was swallowed"
        if not release and held is not None:
            held.release()
        held = None  # (a lock nobody can reach is released by the renewal thread)
        _settled(m, checker, kind, key, armed.where, other, pooled)
        if armed.points < n:
            return n


def _rw_queued(m: LockManager, key: str) -> int:
    entries = m.kinds.open_rw()._entries  # (no public view of level 1's queue)
    entry = entries.get(key)
    return len(entry.queue) if entry is not None else 0


@pytest.mark.parametrize(
    ("mode", "walked"),
    [("read", "dblock/kinds/rw.py"), ("write", "dblock/kinds/rw.py"), ("write", "threading.py")],
)
def test_a_request_queued_behind_a_local_reader_interrupted_anywhere_leaves_nothing_taken(
    db_url: str, key: str, mode: str, walked: str
) -> None:
    """A read request shares this process's read hold; a write request waits
    in level 1's queue until the reader leaves, then leads. Interrupted at
    every handler point of either (``_queue``, ``_wait_turn``, the lead's
    return: once, a request cut off as it was appended to the queue stayed
    in it, and the key was never taken again in that process; the signal
    storm found it), nothing is left: the key is free here and elsewhere.
    Walked too: CPython's ``Condition.wait`` under the write's wait, where
    an exception as its release returned (before its ``try``) left level
    1's mutex released and the caller's ``with`` released it again: a
    RuntimeError instead of the caller's exception (the storm, 2 in 37,123)."""
    m = LockManager(db_url, ttl=5)
    checker = LockManager(db_url, ttl=5)
    KINDS["write"](m, key, 5.0).release()
    pool: Any = m.engine.pool
    pooled = pool.checkedout()  # (connections a manager keeps: a listener's, say)
    n = 0
    try:
        while True:
            n = next_point(n)
            gate = threading.Event()
            got = threading.Event()

            def hold(gate: threading.Event = gate, got: threading.Event = got) -> None:
                with m.read_lock(key, timeout=10):
                    got.set()
                    if mode == "write":  # leave once the writer queued behind us
                        deadline = time.monotonic() + 10
                        while not _rw_queued(m, key) and time.monotonic() < deadline:
                            if gate.wait(0.002):
                                break  # (interrupted before it queued)
                    else:
                        gate.wait(10)

            holder = threading.Thread(target=hold, daemon=True)
            holder.start()
            assert got.wait(10)
            held = None
            reached = False
            with interrupt_at(n, walked) as armed:
                try:
                    held = KINDS[mode](m, key, 10.0)
                except Interrupt:
                    reached = True
            if armed.where is not None:
                assert reached, f"interrupted in {armed.where}: the exception was swallowed"
            if held is not None:
                held.release()
            held = None
            gate.set()
            holder.join(10)
            assert not holder.is_alive(), armed.where
            _settled(m, checker, "write", key, armed.where, None, pooled)
            assert _rw_queued(m, key) == 0, armed.where
            if armed.points < n:
                break
        assert n > 5
    finally:
        m.close()
        checker.close()


_WALKED = ("exclusive", "fair", "read", "write", "semaphore")
_CASES = [
    (kind, op, queued)
    for kind in _WALKED
    for op, queued in (("acquire", False), ("release", False), ("release", True))
]


@pytest.mark.parametrize(
    ("kind", "op", "queued"),
    _CASES,
    ids=[f"{k}-{o}-{'queued' if q else 'alone'}" for k, o, q in _CASES],
)
def test_interrupted_anywhere_leaves_nothing_taken(
    db_url: str, key: str, kind: str, op: str, queued: bool
) -> None:
    m = LockManager(db_url, ttl=5)
    checker = LockManager(db_url, ttl=5)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            n = _walk(m, checker, kind, key, release=op == "release", queued=queued)
        assert n > 5
    finally:
        pool: Any = m.engine.pool
        started = time.monotonic()
        m.close()
        checker.close()
        assert time.monotonic() - started < 5
    assert pool.checkedout() == 0, "a connection was never given back"


def test_a_dropped_lock_whose_collection_is_interrupted_is_released(db_url: str, key: str) -> None:
    """The weak-reference callback of a dropped lock, interrupted at each of
    its points (CPython prints such an exception and goes on): the renewal
    thread still releases the lock, well before its lease ends."""
    m = LockManager(db_url, ttl=6)  # renewal passes at least every 2 s
    checker = LockManager(db_url)
    try:
        n = 0
        while True:
            n = next_point(n)
            held = m.acquire(key, timeout=5)
            with (
                warnings.catch_warnings(),
                interrupt_at(n, *LOCK_FILES, "dblock/renewal.py") as armed,
            ):
                warnings.simplefilter("ignore", ResourceWarning)
                del held
            deadline = time.monotonic() + 10
            while not _free_elsewhere(checker, "exclusive", key) or m.owns(key):
                assert time.monotonic() < deadline, f"interrupted in {armed.where}: key stayed"
                time.sleep(0.02)
            if armed.points < n:
                break
    finally:
        m.close()
        checker.close()


def test_a_dropped_lock_taken_back_interrupted_anywhere_leaves_nothing_taken(
    db_url: str, key: str
) -> None:
    """A thread asks again for a key whose lock it dropped without release
    (its release posted to the renewal thread): it takes the lock back
    itself, and an interruption at each point of that leaves the key free,
    for this thread's next request and another manager's. Before, one cut
    off after the take-back claimed the dropped lock (its log line) kept the
    key this thread's at level 1 for good: every later request of its own
    timed out (seen by the signal storm after 20,000 releases)."""
    m = LockManager(db_url)
    checker = LockManager(db_url)
    try:
        n = 0
        while True:
            n = next_point(n)
            renewer = m.locker.renewer
            posted: list[Callable[[], object]] = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                held = m.acquire(key, timeout=5)
                # Collected at once, its release posted to the renewal thread,
                # which is slower here than the thread's next request.
                renewer.post = posted.append  # type: ignore[method-assign]
                try:
                    del held
                finally:
                    del renewer.post
            with interrupt_at(n, *LOCK_FILES) as armed:
                try:
                    again = m.acquire(key, timeout=5)
                except Interrupt:
                    again = None
            for job in posted:
                renewer.post(job)
            if again is not None:
                again.release()
            m.acquire(key, timeout=5).release()  # LockTimeout when the key stayed
            checker.acquire(key, timeout=5).release()
            if armed.points < n:
                break
        assert n > 10
    finally:
        m.close()
        checker.close()


class _AppTimeout(Exception):
    """An application's own exception (its SIGALRM request timeout, say)."""


def test_the_callers_exception_during_the_orphan_clean_up_is_not_swallowed(
    db_url: str, key: str
) -> None:
    """An acquire runs the orphan clean-up's DELETE first; an exception of
    the application's landing meanwhile reaches the application, and the
    orphan stays queued until the renewal thread deletes it. Before: it was
    taken for the DELETE's own failure, swallowed, and the orphan dropped
    (its row left for its lease), the acquire returning normally."""
    m = LockManager(db_url, ttl=30)
    other = LockManager(db_url)
    try:
        orphan = other.acquire(key + ":orphan")
        token = orphan.token
        m.store.add_orphan(key + ":orphan", token)
        fired: list[str] = []

        def token_in(args: tuple[Any, ...]) -> bool:
            return token in repr(args)

        def alarm(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            if "DELETE" in statement.upper() and token_in(args) and not fired:
                fired.append(statement)
                raise _AppTimeout("the request's own timeout")

        import sqlalchemy as sa

        sa.event.listen(m.engine, "before_cursor_execute", alarm)
        try:
            with pytest.raises(_AppTimeout):
                m.acquire(key, timeout=5)
        finally:
            sa.event.remove(m.engine, "before_cursor_execute", alarm)
        assert fired
        deadline = time.monotonic() + 10
        while m.store.has_orphans:
            assert time.monotonic() < deadline, "the orphan was never deleted"
            time.sleep(0.02)
        m.acquire(key, timeout=5).release()
        orphan_gone = not orphan.owned() or True
        assert orphan_gone
    finally:
        m.close()
        other.close(timeout=0)


# -- the asyncio face -----------------------------------------------------------

_AFILES = (*_FILES, "dblock/aio.py", "dblock/_store/aio.py")


async def _aacquire(a: Any, kind: str, key: str, timeout: float) -> Any:
    if kind == "exclusive":
        return await a.acquire(key, timeout=timeout)
    if kind == "fair":
        return await a.acquire(key, timeout=timeout, fair=True)
    return await a.semaphore(key, permits=1, timeout=timeout).__aenter__()


@pytest.mark.parametrize("kind", ["exclusive", "fair", "semaphore"])
@pytest.mark.parametrize("op", ["acquire", "release"])
def test_an_asyncio_request_interrupted_anywhere_leaves_nothing_taken(
    db_url: str, key: str, kind: str, op: str
) -> None:
    """The same walks through the asyncio face (its driver included): the
    exception reaches the awaiting task, and the key comes free."""
    import asyncio

    from dblock import AsyncLockManager

    m = LockManager(db_url, ttl=5)
    checker = LockManager(db_url, ttl=5)
    a = AsyncLockManager(m)
    probe = "semaphore" if kind == "semaphore" else ("fair" if kind == "fair" else "exclusive")

    async def walk() -> int:
        await (await _aacquire(a, kind, key, 5.0)).release()
        n = 0
        while True:
            n = next_point(n)
            held = None
            if op == "release":
                held = await _aacquire(a, kind, key, 10.0)
            reached = False
            with interrupt_at(n, *_AFILES) as armed:
                try:
                    if op == "release":
                        await held.release()
                    else:
                        held = await _aacquire(a, kind, key, 10.0)
                except Interrupt:
                    reached = True
            if armed.where is not None:
                assert reached, f"interrupted in {armed.where}: the exception was swallowed"
            if op == "acquire" and held is not None:
                await held.release()
            held = None
            deadline = time.monotonic() + 10
            collect_at = time.monotonic() + 0.2
            while not _free_elsewhere(checker, probe, key):
                assert time.monotonic() < deadline, f"interrupted in {armed.where}: key stayed"
                if time.monotonic() > collect_at:
                    gc.collect()
                    collect_at = float("inf")
                await asyncio.sleep(0.01)
            deadline = time.monotonic() + 15
            while True:  # (a dropped permit leaves level 1 just after its row)
                try:
                    await (await _aacquire(a, kind, key, 5.0)).release()
                    break
                except (LockBusy, LockTimeout) as exc:
                    if time.monotonic() > deadline:
                        raise AssertionError(
                            f"interrupted in {armed.where}: the next request failed: {exc!r}"
                        ) from exc
                    await asyncio.sleep(0.01)
            if armed.points < n:
                return n

    # A coroutine made and never awaited (the exception landed as the call
    # that made it returned) is reported through sys.unraisablehook; pytest's
    # hook keeps what it reports, the lock with it, past this walk's checks.
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            warnings.simplefilter("ignore", RuntimeWarning)
            n = asyncio.run(walk())
        assert n > 5
    finally:
        sys.unraisablehook = hook
        m.close()
        checker.close()


_STORE_FILES = (
    "dblock/_store/base.py",
    "dblock/_store/executor.py",
    "dblock/_store/orphans.py",
    "dblock/_store/batch.py",
    "dblock/_store/sqlite.py",
    "dblock/_store/postgresql.py",
    "dblock/_store/mysql.py",
)


@pytest.mark.parametrize("op", ["acquire", "release"])
def test_an_exclusive_request_interrupted_anywhere_in_the_store_leaves_nothing_taken(
    db_url: str, key: str, op: str
) -> None:
    """The exclusive lock's walks through the store's own code (executor,
    group commit, dialect). Before: an exception as the orphan clean-up's
    non-blocking lock was taken left that lock held, and no orphan of the
    process was deleted again (rows stayed for their leases)."""
    m = LockManager(db_url, ttl=30)  # (a row left behind would outlive the walk's 10 s)
    checker = LockManager(db_url, ttl=30)
    try:
        n = 0
        while True:
            n = next_point(n)
            held = m.acquire(key, timeout=10) if op == "release" else None
            reached = False
            with interrupt_at(n, *_STORE_FILES) as armed:
                try:
                    if held is not None:
                        held.release()
                    else:
                        held = m.acquire(key, timeout=10)
                except Interrupt:
                    reached = True
            if armed.where is not None:
                assert reached, f"interrupted in {armed.where}: the exception was swallowed"
            if op == "acquire" and held is not None:
                held.release()
            held = None
            deadline = time.monotonic() + 10
            while not _free_elsewhere(checker, "exclusive", key):
                assert time.monotonic() < deadline, f"interrupted in {armed.where}: key stayed"
                time.sleep(0.01)
            m.acquire(key, timeout=5).release()
            if armed.points < n:
                break
        assert n > 5
    finally:
        m.close()
        checker.close()
