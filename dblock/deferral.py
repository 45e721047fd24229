"""Releasing a held lock when something outside the locked code ends.

A lock protects what its holder writes only if it is released after that
write is durable and after the work it guards is done. Sometimes both end
later than the function or ``with`` block that took the lock: the caller's
transaction commits afterwards (Django's ``ATOMIC_REQUESTS``, a SQLAlchemy
session committed by the caller), or a view returns a response whose body is
produced while the server sends it.

:class:`Deferred` takes over the release of a held lock (a
:class:`~dblock.HeldLock` or :class:`~dblock.HeldLocks`) from the exit path
that took it. Whoever knows of such an end asks it for a :class:`Trigger`
(a one-shot, zero-argument callable) and installs it where that end calls it
(``transaction.on_commit``, a session event, a response's close callbacks).
The lock is released when the exit path is done and every trigger has fired;
renewal keeps it alive meanwhile, as for any held lock.

A trigger that is garbage-collected without having been called fires then:
a Django ``on_commit`` callback is dropped by a rollback (the normal end of
a rolled-back transaction, so quietly), a session or response vanishes
without ending its transaction or being closed (a bug in the caller: a
WARNING and a :class:`ResourceWarning`). Such a release runs on a worker
thread, never inside the garbage collector's caller.

The locked code's thread keeps the lock while it waits (an inner lock of the
same key in the same transaction re-enters it, as before), but once a trigger
exists the lock no longer ends with that thread: a worker thread that hands a
streamed body to the server, or commits elsewhere, may end first, and renewal
keeps the lock until the triggers fire. The release itself may run on another
thread (a server closing a response elsewhere).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from . import _threads
from .errors import LockLost
from .lock import HeldLock, release_on_exit

if TYPE_CHECKING:
    from .multi import HeldLocks

__all__ = ["DeferHook", "Deferred", "Trigger", "call_deferring", "exit_deferring"]

log = logging.getLogger("dblock")

R = TypeVar("R")

#: ``hook(deferred, result) -> result``: called when the locked code is done
#: (``result`` is None if it raised, or for a ``with`` block); installs
#: triggers from ``deferred`` where the ends it knows of will call them, and
#: returns the result to hand back (the same, or one wrapped to call a trigger).
DeferHook = Callable[["Deferred", Any], Any]


class Deferred:
    """The pending release of one held lock (or ``lock_many`` set)."""

    __slots__ = ("_held", "_mutex", "_pending", "_what")

    def __init__(self, held: HeldLock | HeldLocks) -> None:
        self._held = held
        self._mutex = threading.Lock()
        self._pending = 1  # the exit path's own, dropped by finish()
        self._what: object = held.key if isinstance(held, HeldLock) else list(held)

    @property
    def held(self) -> HeldLock | HeldLocks:
        return self._held

    @property
    def pending(self) -> int:
        """Ends still awaited (the exit path counts as one until it finishes)."""
        return self._pending

    def trigger(self, *, dropped: str | None = None) -> Trigger:
        """A one-shot callable that counts one end as reached. If it is
        garbage-collected uncalled, it fires then; ``dropped`` is the warning
        to give in that case (None: dropping it is a normal end, e.g. a
        rollback discarding an on_commit callback)."""
        with self._mutex:
            if self._pending <= 0:
                raise RuntimeError(f"the release of {self._what!r} is no longer pending")
            self._pending += 1
        # From now on the triggers, not the taking thread or task, decide when
        # the lock ends: renewal must not release it when that owner ends.
        for held in self._locks():
            held._deferred = True
        return Trigger(self, dropped)

    def _locks(self) -> list[HeldLock]:
        held = self._held
        return [held] if isinstance(held, HeldLock) else list(held.values())

    def finish(self, exc_type: type[BaseException] | None) -> None:
        """The exit path is done installing triggers. With none installed the
        lock is released now, as a ``with`` block would (raising
        :class:`~dblock.LockLost` only if the block itself did not raise)."""
        if self._count_down():
            release_on_exit(self._held.release, exc_type, self._what)

    def _fired(self) -> None:
        if self._count_down():
            release_quietly(self._held, self._what)

    def _count_down(self) -> bool:
        with self._mutex:
            self._pending -= 1
            return self._pending == 0

    def __repr__(self) -> str:
        return f"<Deferred release of {self._what!r}, {self._pending} pending>"


class Trigger:
    """One end a deferred release waits for; call it (once, any thread) when
    that end is reached. Further calls do nothing."""

    __slots__ = ("__weakref__", "_finalizer")

    def __init__(self, deferred: Deferred, dropped: str | None) -> None:
        self._finalizer = weakref.finalize(self, _dropped, deferred, dropped)
        # At interpreter exit rows expire with their leases; no SQL then.
        self._finalizer.atexit = False

    @property
    def fired(self) -> bool:
        return not self._finalizer.alive

    def __call__(self, *_args: Any, **_kwargs: Any) -> None:
        detached = self._finalizer.detach()
        if detached is not None:
            deferred: Deferred = detached[2][0]
            deferred._fired()


def _dropped(deferred: Deferred, warning: str | None) -> None:
    """A trigger was collected uncalled: fire it from the worker thread."""
    _worker.submit(deferred, warning)


def release_quietly(held: HeldLock | HeldLocks, what: object) -> None:
    """Release from a trigger: whatever happens is logged, nothing raised
    into the code that reached the end (a commit, a server closing a response)."""
    try:
        # NB: may run on a thread other than the one that acquired the lock.
        held.release(force=True)  # an explicit hand-over (see HeldLock.release)
    except LockLost as exc:
        log.error("dblock: %r was lost before its deferred release: %s", what, exc)
    except Exception:
        log.exception("dblock: the deferred release of %r failed", what)


class _Worker:
    """One daemon thread per process, started on first use, that runs the
    releases of dropped triggers."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Deferred, str | None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def submit(self, deferred: Deferred, warning: str | None) -> None:
        self._queue.put((deferred, warning))
        if self._thread is None or self._pid != os.getpid():
            with self._lock:
                if self._thread is None or self._pid != os.getpid():
                    self._pid = os.getpid()
                    self._thread = threading.Thread(
                        target=self._run, name="dblock-deferred-release", daemon=True
                    )
                    _threads.start(self._thread)

    def _run(self) -> None:
        while True:
            deferred, warning = self._queue.get()
            if warning is not None:
                message = f"dblock: {deferred._what!r} released late: {warning}"
                log.warning("%s", message)
                warnings.warn(message, ResourceWarning, stacklevel=1)
            try:
                deferred._fired()
            except Exception:  # never let the thread die with releases to run
                log.exception("dblock: deferred release of %r failed", deferred._what)


_worker = _Worker()


def call_deferring(
    held: HeldLock | HeldLocks,
    hook: DeferHook,
    func: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> R:
    """Call ``func`` holding ``held``, then let ``hook`` decide what the
    release waits for (the decorator's exit path)."""
    try:
        result = func(*args, **kwargs)
    except BaseException as exc:
        exit_deferring(held, hook, None, type(exc))
        raise
    return exit_deferring(held, hook, result, None)  # type: ignore[no-any-return]


def exit_deferring(
    held: HeldLock | HeldLocks,
    hook: DeferHook,
    result: Any,
    exc_type: type[BaseException] | None,
) -> Any:
    """Leave the locked code: ``hook`` installs the triggers the release waits
    for; with none, release now. Returns what ``hook`` returned."""
    deferred = Deferred(held)
    try:
        result = hook(deferred, result)
    finally:
        deferred.finish(exc_type)
    return result
