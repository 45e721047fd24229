"""Deferred releases for locks held by asyncio tasks (see :mod:`dblock.deferral`).

The hooks are the blocking side's own (``until=session``, Django's
``on_commit`` and streamed responses): they install :class:`~dblock.deferral.Trigger`
objects where an end will call them. What differs is the release once the
last trigger fires. A trigger may fire on the event loop's thread (an
``AsyncSession`` commits inside a greenlet of the loop), on a server's worker
thread (Django's ASGI handler closes a response through ``sync_to_async``) or
on dblock's worker thread (a trigger collected uncalled). None of them may
block the loop with a blocking statement, so the release is sent as a task on
the loop of the task that took the lock, through the async engine. Only if
that loop is gone does a thread of its own release it with the blocking driver.

As on the blocking side, once a trigger exists the taking task may end first:
renewal keeps the lock until the triggers fire.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from . import _threads
from .deferral import DeferHook, Deferred, release_quietly
from .errors import LockLost

if TYPE_CHECKING:
    from .lock import HeldLock
    from .multi import HeldLocks

__all__ = [
    "AsyncDeferred",
    "AsyncHeld",
    "AsyncHeldMany",
    "acall_deferring",
    "aexit_deferring",
    "release_on_exit",
]

log = logging.getLogger("dblock")

R = TypeVar("R")


class AsyncHeld(Protocol):
    """What a deferred release needs of the async face's lock (``AsyncHeldLock``
    in :mod:`dblock.aio`, a floor above: named here so no import runs up)."""

    @property
    def held(self) -> HeldLock: ...

    async def release(self, *, force: bool = False) -> bool: ...


class AsyncHeldMany(Protocol):
    """The same for a ``lock_many`` set (``AsyncHeldLocks``): a mapping by key."""

    def values(self) -> Any: ...

    async def release(self, *, force: bool = False) -> bool: ...


async def release_on_exit(
    release: Callable[[], Awaitable[object]], exc_type: type[BaseException] | None, what: object
) -> None:
    """Release as an ``async with`` exit does: a lost lock is raised, unless
    the body is already failing (then it is logged, not put in its place)."""
    try:
        await release()
    except LockLost:
        if exc_type is None:
            raise
        log.exception("dblock: %r was lost while its holder failed", what)


# Release tasks in flight: the loop keeps only weak references to its tasks.
_releasing: set[asyncio.Task[None]] = set()


class AsyncDeferred(Deferred):
    """The pending release of a lock (or ``lock_many`` set) an asyncio task holds."""

    __slots__ = ("_aheld", "_loop")

    def __init__(self, aheld: AsyncHeld | AsyncHeldMany) -> None:
        # The hooks see the blocking face (``deferred.held``), as on that side;
        # a set (a mapping by key) is passed as it is.
        sync: Any = aheld if isinstance(aheld, Mapping) else cast("AsyncHeld", aheld).held
        super().__init__(cast("HeldLock | HeldLocks", sync))
        self._aheld = aheld
        self._loop = asyncio.get_running_loop()

    def _locks(self) -> list[HeldLock]:
        aheld = self._aheld
        if isinstance(aheld, Mapping):
            return [a.held for a in aheld.values()]
        return [cast("AsyncHeld", aheld).held]

    def finish(self, exc_type: type[BaseException] | None) -> None:
        raise TypeError("an AsyncDeferred finishes with `await finish_async()`")

    async def finish_async(self, exc_type: type[BaseException] | None) -> None:
        """The exit path is done installing triggers; with none, release now
        (as ``async with`` would)."""
        if self._count_down():
            await release_on_exit(self._aheld.release, exc_type, self._what)

    def _fired(self) -> None:  # any thread
        if self._count_down():
            self._release_soon()

    def _release_soon(self) -> None:
        loop = self._loop
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            _spawn(self._release())
            return
        release = self._release()
        try:
            loop.call_soon_threadsafe(_spawn, release)
        except RuntimeError:  # the loop is closed: nobody awaits there any more
            release.close()
            _threads.start(
                threading.Thread(
                    target=release_quietly,
                    args=(self.held, self._what),
                    name="dblock-deferred-release",
                    daemon=True,
                )
            )

    async def _release(self) -> None:
        try:
            # NB: from a task other than the one that took it: an explicit hand-over.
            await self._aheld.release(force=True)
        except LockLost as exc:
            log.error("dblock: %r was lost before its deferred release: %s", self._what, exc)
        except Exception:
            log.exception("dblock: the deferred release of %r failed", self._what)


def _spawn(release: Awaitable[None]) -> None:
    task = asyncio.ensure_future(release)
    _releasing.add(task)
    task.add_done_callback(_releasing.discard)


async def aexit_deferring(
    aheld: AsyncHeld | AsyncHeldMany,
    hook: DeferHook,
    result: Any,
    exc_type: type[BaseException] | None,
) -> Any:
    """:func:`dblock.deferral.exit_deferring` for a task's lock (or set): the
    same hooks and count of ends (:class:`~dblock.deferral.Deferred`); only
    the release the exit path is left with is awaited, on the async engine."""
    deferred = AsyncDeferred(aheld)
    try:
        result = hook(deferred, result)
    finally:
        await deferred.finish_async(exc_type)
    return result


async def acall_deferring(
    aheld: AsyncHeld | AsyncHeldMany,
    hook: DeferHook,
    func: Callable[..., Awaitable[R]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> R:
    """Await ``func`` holding ``aheld``, then let ``hook`` decide what the
    release waits for (the async decorator's exit path)."""
    try:
        result = await func(*args, **kwargs)
    except BaseException as exc:
        await aexit_deferring(aheld, hook, None, type(exc))
        raise
    return await aexit_deferring(aheld, hook, result, None)  # type: ignore[no-any-return]
