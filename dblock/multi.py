"""Several keys held at once, taken in one order so that callers cannot deadlock.

Two requests for (A, B) and (B, A) that each took their first key would wait
for each other forever. :func:`acquire_many` sorts the keys (after
normalisation, duplicates removed) and takes them one by one in that order,
so every caller competes for the smallest key first and no cycle of waiters
can form. The order is the keys' code-point order: the same in every process
and on every machine. If one key cannot be had, every key taken so far is
released again, newest first, before the error is raised.

The guarantee covers ``lock_many`` calls among themselves. A thread that
already holds some key and then asks for others can still deadlock with
someone asking in the opposite order; ask for all of them in one call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import LockArgumentError, LockLost, LockTimeout
from .keys import check_key
from .lock import HeldLock, Locker, LockOptions, release_on_exit
from .steps import Call, Step

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["HeldLocks", "ManySteps", "acquire_many", "acquire_many_steps", "order_keys"]

log = logging.getLogger("dblock")


def order_keys(keys: Iterable[str]) -> tuple[str, ...]:
    """The normalised keys, without duplicates, in the order they are taken."""
    if isinstance(keys, (str, bytes)):
        raise LockArgumentError(
            f"lock_many takes an iterable of keys, not a single {type(keys).__name__} {keys!r}"
        )
    try:
        unique = {check_key(key) for key in keys}
    except TypeError as exc:
        raise LockArgumentError(f"lock_many takes an iterable of keys, got {keys!r}") from exc
    if not unique:
        raise LockArgumentError("lock_many needs at least one key")
    return tuple(sorted(unique))


class HeldLocks(Mapping[str, HeldLock]):
    """The locks taken by ``lock_many()``: a read-only mapping ``key ->``
    :class:`~dblock.HeldLock` in the order they were acquired, following the
    ``Mapping`` contract (``held.get(123)`` is None, ``123 in held`` is False).
    Releasing it releases all of them, newest first."""

    __slots__ = ("_by_key", "_released")

    def __init__(self, held: Iterable[HeldLock]) -> None:
        self._by_key = {lock.key: lock for lock in held}
        self._released = False

    def __getitem__(self, key: str) -> HeldLock:
        # The Mapping contract: anything that is not one of our keys is a
        # KeyError (so get() returns None and `in` says False), never a
        # LockArgumentError.
        try:
            return self._by_key[check_key(key)]
        except LockArgumentError:
            raise KeyError(key) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def released(self) -> bool:
        return self._released

    def release(self, *, force: bool = False) -> bool:
        """Release every lock, newest first. Returns False if the database
        could not be reached for some of them (see ``HeldLock.release``);
        raises the first :class:`~dblock.LockLost` after releasing the rest.
        Only the acquiring thread (or task) may, unless ``force=True``."""
        held = list(self._by_key.values())
        if not force and held:
            held[0]._locker.check_owner(held[0])  # refuse before releasing any
        self._released = True
        return release_all(held, force=force)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        release_on_exit(self.release, exc_type, list(self))

    def __repr__(self) -> str:
        state = " released" if self._released else ""
        return f"<HeldLocks {list(self._by_key)!r}{state}>"


def release_all(held: list[HeldLock], *, force: bool = False) -> bool:
    """Release ``held`` newest first, all of them even if some fail; if
    interrupted, the ones not yet released go on the renewal thread."""
    ok = True
    lost: LockLost | None = None
    for i in range(len(held) - 1, -1, -1):
        try:
            ok = held[i].release(force=force) and ok
        except LockLost as exc:
            lost = lost or exc
        except BaseException:
            if held[i].released:  # interrupted in its release, not refused (not ours, ...)
                release_later(held[:i])
            raise
    if lost is not None:
        raise lost
    return ok


def release_later(held: Iterable[HeldLock]) -> None:
    """Hand each of ``held`` to its renewal thread to release (see
    ``Locker.release_later``): what an interrupted release of several
    locks had not reached yet."""
    for lock in held:
        lock._locker.release_later(lock)


H = TypeVar("H")
#: The multi-key rule without I/O: yields the face's own calls to take one
#: key or give back what was taken (``CALL`` ops, which the face's step
#: driver calls or awaits), returns the held locks (see :func:`acquire_many_steps`).
ManySteps = Generator[Step, Any, list[H]]


def acquire_many_steps(
    keys: tuple[str, ...],
    timeout: float | None,
    take: Callable[[str, float | None], Any],
    give_back: Callable[[list[H]], Any],
) -> ManySteps[H]:
    """Take ``keys`` (already ordered by :func:`order_keys`) one by one within
    one overall ``timeout``; on any failure give back what was taken. Written
    once for threads and tasks: ``take(key, wait)`` is the face's acquire of
    one key within ``wait`` seconds, ``give_back(held)`` its release of
    several, newest first; each face's step driver runs them (the blocking
    :meth:`~dblock.lock.Locker.run` for :func:`acquire_many`, the asyncio one
    for ``AsyncLockManager``'s), as for the single-key steps."""
    deadline = None if timeout is None else time.monotonic() + timeout
    held: list[H] = []
    try:
        for key in keys:
            wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            held.append((yield Call(partial(take, key, wait))))
    except BaseException as exc:
        try:
            yield Call(partial(give_back, held))
        except LockLost:
            log.exception("dblock: a lock was lost while giving up on %r", keys)
        if isinstance(exc, LockTimeout) and timeout is not None:
            # Report the caller's timeout, not the part left for the last key.
            raise LockTimeout(
                exc.key, timeout=timeout, level=exc.level, holder=exc.holder
            ) from None
        raise
    return held


def acquire_many(
    locker: Locker,
    keys: tuple[str, ...],
    *,
    blocking: bool,
    timeout: float | None,
    ttl: float,
    options: LockOptions | None = None,
) -> HeldLocks:
    """Take ``keys`` (already ordered by :func:`order_keys`) one by one within
    one overall ``timeout``; on any failure release what was taken."""

    def take(key: str, wait: float | None) -> HeldLock:
        return locker.acquire(key, blocking=blocking, timeout=wait, ttl=ttl, options=options)

    steps: ManySteps[HeldLock] = acquire_many_steps(keys, timeout, take, release_all)
    return HeldLocks(locker.run(steps))
