"""A held lock, as its holder sees it (:class:`HeldLock`), and the weak
reference (:class:`LockRef`) through which everything else in dblock
refers to it: the registry's entry, the renewer, the release that runs
when its holder dropped it unreleased.

The lock's machinery (``dblock.lock.Locker``, a floor up) is reached only
through :class:`Custodian`, the few calls a holder makes of it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from ._store import Grant
from ._store.base import Lease
from .config import OnLost, check_lease
from .errors import (
    LockLost,
)
from .registry import (
    Entry,
    current_owner,
    thread_owner,
)
from .renewal import MIN_RENEWAL, RENEW_AT, Renewer
from .steps import Op

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("dblock")

_monotonic = time.monotonic
_urandom = os.urandom
_current_thread = threading.current_thread
_thread_owner = thread_owner


class Custodian(Protocol):
    """What a held lock asks of the locker that granted it (``dblock.lock.Locker``
    or a semaphore's): its release, a lease extension by hand, taking over a
    handed-on lock, the renewer that marks it lost, and the callback its weak
    reference runs once nobody can reach it."""

    @property
    def renewer(self) -> Renewer[Any]: ...

    @property
    def collect(self) -> Callable[[LockRef], None]: ...

    def release(self, held: HeldLock, *, force: bool = False) -> bool: ...

    def extend(self, held: HeldLock, ttl: float) -> None: ...

    def adopt(self, held: HeldLock) -> None: ...

    def release_steps(self, held: HeldLock, force: bool, *, keep: float = 0.0) -> Op[bool]: ...

    def check_extend(self, held: HeldLock) -> None: ...

    def extended(self, held: HeldLock, leases: Mapping[str, Lease], sent_at: float) -> None: ...

    def handed_on(self, held: HeldLock) -> None: ...

    def check_owner(self, held: HeldLock) -> None: ...

    def release_later(self, held: HeldLock) -> None: ...


class LockOptions:
    """Per-lock lease options: whether to renew, the longest hold, and whom to
    tell when the lock is lost. One shared instance carries the manager's defaults."""

    __slots__ = ("max_hold", "on_lost", "renew")

    def __init__(self, *, renew: bool, max_hold: float | None, on_lost: OnLost | None) -> None:
        self.renew = renew
        self.max_hold = max_hold
        self.on_lost = on_lost


class LockRef(weakref.ref["HeldLock"]):
    """How the registry and the renewer refer to a held lock: weakly, with
    what it takes to release the lock once nobody can reach it any more."""

    __slots__ = ("entry", "key", "live", "token", "tracked")

    entry: Entry
    key: str
    token: str
    live: bool  # not released yet
    tracked: bool  # the renewer watches it


class HeldLock:
    """A lock this process holds, as yielded by ``LockManager.lock()``.

    ``fence`` is greater than every fence the key had before (and unique
    across keys): pass it to the systems you write to and have them reject
    writes carrying a smaller one (see docs/leases.md). ``expires_at`` is the
    end of the lease in database time (UTC); the renewal thread moves it
    forward while the lock is held. ``lost`` turns true
    the moment dblock learns (or must assume) that the lock is no longer ours;
    ``check()`` raises :class:`~dblock.LockLost` from then on.
    """

    __slots__ = (
        "__weakref__",
        "_acquired_mono",
        "_adopt",
        "_deferred",
        "_entry",
        "_expires_mono",
        "_fair",
        "_locker",
        "_lost",
        "_next_check",
        "_owner",
        "_ref",
        "_released",
        "_renew_error",
        "_reserve",
        "_revoked",
        "_ticket",
        "expires_at",
        "fence",
        "key",
        "max_hold",
        "on_lost",
        "owner",
        "renew",
        "token",
        "ttl",
    )

    def __init__(  # noqa: PLR0917 - positional: called once per lock
        self,
        locker: Custodian,
        entry: Entry,
        token: str,
        owner: str,
        ttl: float,
        grant: Grant,
        sent_at: float,
        options: LockOptions,
        live: bool = True,
    ) -> None:
        # (Positional parameters: a class called with keywords gets them as a dict.)
        self._locker = locker
        self._entry = entry
        self._owner = entry.owner
        self._released = False
        self._revoked = False  # released by dblock (owner gone, manager closed)
        self._fair = False  # granted by the fair queue: released to it, never handed on locally
        self._ticket: int | None = None
        # Its release waits for a commit or a response (dblock.deferral): the
        # taking thread or task may end first without abandoning it.
        self._deferred = False
        # Taken by a task that only ran the acquire (asyncio.wait_for before
        # Python 3.12, create_task, gather): its owner is whoever awaited
        # that task, known once it uses the lock (see Locker.adopt).
        self._adopt = False
        ref = self._ref = LockRef(self, locker.collect)
        ref.entry = entry
        ref.key = entry.key
        ref.token = token
        ref.live = live  # (a hand-off's is not until delivered: see Locker._handed)
        ref.tracked = False
        self.key = entry.key
        self.token = token
        self.owner = owner
        self.ttl = ttl
        self.fence = grant.fence
        # Fences this row may still hand on without SQL (see Locker._hand_off).
        self._reserve = grant.reserve
        self.expires_at: datetime = grant.expires_at
        self.renew = options.renew
        self.max_hold = options.max_hold
        self.on_lost = options.on_lost
        # Local deadline of the lease, counted from before the statement was
        # sent, so it is never later than the database's own.
        self._acquired_mono = sent_at
        self._expires_mono = sent_at + grant.expires_in
        self._next_check = sent_at + grant.expires_in * (RENEW_AT if self.renew else 1.0)
        self._lost: str | None = None
        self._renew_error: str | None = None

    @property
    def released(self) -> bool:
        return self._released

    @property
    def ticket(self) -> int | None:
        """A fair lock's place in its key's queue when it was granted (the
        order of arrival, from the fence counter); None if it was granted
        without queueing, or is not a fair lock."""
        return self._ticket

    @property
    def remaining(self) -> float:
        """Seconds of lease left, by this process's monotonic clock (conservative)."""
        return self._expires_mono - _monotonic()

    @property
    def lost(self) -> bool:
        """True once the lock is known or must be assumed lost (see ``check()``):
        also once its lease has ended by this process's clock, whether or not
        the renewal thread has looked (it may be waiting for a server that
        stopped answering)."""
        if self._lost is None and not self._released and self._expires_mono <= _monotonic():
            self._lose_expired()
            return True
        return self._lost is not None

    @property
    def lost_reason(self) -> str | None:
        if self.lost and self._lost is None:  # expired, but its renewer no longer watches it
            return Renewer._expired_reason(self)
        return self._lost

    def _lose_expired(self) -> None:
        # Whichever thread notices the lease's end first (the renewal pass,
        # its lease watch, or the holder reading ``lost`` or calling
        # ``check()``) gives the same reason: why the lease was not renewed.
        self._locker.renewer.lose(self, Renewer._expired_reason(self))

    def owned(self) -> bool:
        """Whether the calling thread (or asyncio task) holds this lock now:
        not released, not known to be lost, its lease not run out by this
        process's clock. No SQL (as ``redis.lock.Lock.owned()`` or Redisson's
        ``isHeldByCurrentThread()``); :meth:`check` raises instead of answering."""
        if self._released or self._lost is not None or self._expires_mono <= _monotonic():
            return False
        if self._adopt:
            self._locker.adopt(self)
        # As for release: a lock taken by a thread outside any task is held by
        # a task running on that thread too.
        return self._owner is current_owner() or self._owner is _thread_owner()

    def check(self) -> None:
        """Raise :class:`~dblock.LockLost` if the lock was lost. Call it before
        work that must not run without the lock."""
        if self._lost is not None:
            raise LockLost(self.key, self._lost)
        if not self._released and self._expires_mono <= _monotonic():
            # The renewal thread may not have looked yet: the lease is over.
            self._lose_expired()
            raise LockLost(self.key, self._lost or Renewer._expired_reason(self))

    # -- for the renewal thread ----------------------------------------------

    def _renewal_ttl(self, now: float) -> float:
        if self.max_hold is None:
            return self.ttl
        return min(self.ttl, self.max_hold - (now - self._acquired_mono))

    def _renewable(self) -> bool:
        """Can renewal still extend the lease (renewal on, max_hold not reached)?"""
        if not self.renew:
            return False
        if self.max_hold is None:
            return True
        return self._acquired_mono + self.max_hold > self._expires_mono + MIN_RENEWAL

    def _renewed(self, expires_at: datetime, expires_mono: float) -> None:
        now = _monotonic()
        self.expires_at = expires_at
        self._expires_mono = expires_mono
        self._renew_error = None
        self._next_check = now + (expires_mono - now) * RENEW_AT

    def _mark_lost(self, reason: str) -> bool:
        if self._lost is not None or self._released:
            return False
        self._lost = reason
        return True

    def release(self, *, force: bool = False) -> bool:
        """Release one level of this lock.

        Returns False if the database could not be reached (the local lock is
        freed anyway and the row is left to its lease and the sweeper; the
        error is logged). Raises :class:`LockLost` if the row was no longer ours.
        Only the thread (or asyncio task) that acquired the lock may release
        it; anyone else gets :class:`~dblock.LockNotHeld` unless they say
        ``force=True`` (an explicit hand-over: it releases every level).
        """
        return self._locker.release(self, force=force)

    def extend(self, ttl: float | None = None) -> None:
        """Renew the lease now, to ``ttl`` seconds from now (default: the
        lock's ``ttl``), in one statement: for holders that renew by hand
        (``renew=False``). Raises :class:`~dblock.LockLost` if the row is no
        longer ours, :class:`~dblock.LockNotHeld` if the lock was released."""
        self._locker.extend(self, self.ttl if ttl is None else check_lease(ttl))

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # release_on_exit(self.release, exc_type, self.key), inlined: the hot path.
        try:
            self.release()
        except LockLost:
            if exc_type is None:
                raise
            log.exception("dblock: %r was lost while its holder failed", self.key)

    def __repr__(self) -> str:
        state = "released" if self._released else f"expires_at={self.expires_at.isoformat()}"
        return f"<HeldLock {self.key!r} fence={self.fence} {state}>"


def release_on_exit(
    release: Callable[[], object], exc_type: type[BaseException] | None, what: object
) -> None:
    """Leaving a ``with`` block: release, and raise :class:`LockLost` only if
    the block itself did not raise (that error matters more; the loss is logged)."""
    try:
        release()
    except LockLost:
        if exc_type is None:
            raise
        log.exception("dblock: %r was lost while its holder failed", what)
