"""A held lock, as its holder sees it (:class:`HeldLock`), and the weak
reference (:class:`LockRef`) through which everything else in dblock
refers to it: the registry's entry, the renewer, the release that runs
when its holder dropped it unreleased.

The lock's machinery (``dblock.lock.Locker``, a floor up) is reached only
through :class:`Custodian`, the few calls a holder makes of it.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from ._store import Grant
from ._store.base import Lease
from .config import OnLost, check_lease
from .errors import LockLost
from .registry import Entry, current_owner, thread_owner
from .renewal import MIN_RENEWAL, RENEW_AT, Renewer
from .steps import Op

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("dblock")

_monotonic = time.monotonic
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
    """A held lock's state inside dblock, and how the registry and the
    renewer refer to the lock: weakly, with what it takes to release it once
    nobody can reach it any more. The holder's :class:`HeldLock` keeps it as
    ``state``: what the lock's machinery reads and writes lives here, not in
    attributes of the public object."""

    __slots__ = (
        "acquired_mono",
        "adopt",
        "deferred",
        "entry",
        "expires_mono",
        "fair",
        "holder",
        "key",
        "live",
        "lost",
        "next_check",
        "released",
        "renew_error",
        "reserve",
        "revoked",
        "ticket",
        "token",
        "tracked",
    )

    entry: Entry
    key: str
    token: str
    live: bool  # not released yet
    tracked: bool  # the renewer watches it
    #: Who holds it: a thread's or a task's owner (see dblock.registry);
    #: ``HeldLock.owner`` is the label written in the row.
    holder: Any
    released: bool
    revoked: bool  # released by dblock (owner gone, manager closed)
    fair: bool  # granted by the fair queue: released to it, never handed on locally
    ticket: int | None
    # Its release waits for a commit or a response (dblock.deferral): the
    # taking thread or task may end first without abandoning it.
    deferred: bool
    # Taken by a task that only ran the acquire (asyncio.wait_for before
    # Python 3.12, create_task, gather): its owner is whoever awaited
    # that task, known once it uses the lock (see Lifecycle.adopt).
    adopt: bool
    # Fences this row may still hand on without SQL (see HandOff._hand_off).
    reserve: tuple[int, ...]
    # Local deadline of the lease, counted from before the statement was
    # sent, so it is never later than the database's own.
    acquired_mono: float
    expires_mono: float
    next_check: float  # when the renewal pass looks at it next
    lost: str | None  # why it was lost, once it is
    renew_error: str | None  # the last renewal's failure, while it is retried


class HeldLock:
    """A lock this process holds, as yielded by ``LockManager.lock()``.

    ``fence`` is greater than every fence the key had before (and unique
    across keys): pass it to the systems you write to and have them reject
    writes carrying a smaller one (see docs/leases.md). ``expires_at`` is the
    end of the lease in database time (UTC); the renewal thread moves it
    forward while the lock is held. ``lost`` turns true
    the moment dblock learns (or must assume) that the lock is no longer ours;
    ``check()`` raises :class:`~dblock.LockLost` from then on.

    ``state`` is dblock's own (:class:`LockRef`), not part of the API.
    """

    __slots__ = (
        "__weakref__",
        "_locker",
        "expires_at",
        "fence",
        "key",
        "max_hold",
        "on_lost",
        "owner",
        "renew",
        "state",
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
        state = self.state = LockRef(self, locker.collect)
        state.entry = entry
        state.key = entry.key
        state.token = token
        state.live = live  # (a hand-off's is not until delivered: see HandOff._handed)
        state.tracked = False
        state.holder = entry.owner
        state.released = False
        state.revoked = False
        state.fair = False
        state.ticket = None
        state.deferred = False
        state.adopt = False
        state.reserve = grant.reserve
        state.acquired_mono = sent_at
        state.expires_mono = sent_at + grant.expires_in
        state.next_check = sent_at + grant.expires_in * (RENEW_AT if options.renew else 1.0)
        state.lost = None
        state.renew_error = None
        self.key = entry.key
        self.token = token
        self.owner = owner
        self.ttl = ttl
        self.fence = grant.fence
        self.expires_at: datetime = grant.expires_at
        self.renew = options.renew
        self.max_hold = options.max_hold
        self.on_lost = options.on_lost

    @property
    def released(self) -> bool:
        return self.state.released

    @property
    def ticket(self) -> int | None:
        """A fair lock's place in its key's queue when it was granted (the
        order of arrival, from the fence counter); None if it was granted
        without queueing, or is not a fair lock."""
        return self.state.ticket

    @property
    def remaining(self) -> float:
        """Seconds of lease left, by this process's monotonic clock (conservative)."""
        return self.state.expires_mono - _monotonic()

    @property
    def lost(self) -> bool:
        """True once the lock is known or must be assumed lost (see ``check()``):
        also once its lease has ended by this process's clock, whether or not
        the renewal thread has looked (it may be waiting for a server that
        stopped answering)."""
        if (
            self.state.lost is None
            and not self.state.released
            and self.state.expires_mono <= _monotonic()
        ):
            self._lose_expired()
            return True
        return self.state.lost is not None

    @property
    def lost_reason(self) -> str | None:
        if self.lost and self.state.lost is None:  # expired, but its renewer no longer watches it
            return Renewer._expired_reason(self)
        return self.state.lost

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
        if (
            self.state.released
            or self.state.lost is not None
            or self.state.expires_mono <= _monotonic()
        ):
            return False
        if self.state.adopt:
            self._locker.adopt(self)
        # As for release: a lock taken by a thread outside any task is held by
        # a task running on that thread too.
        return self.state.holder is current_owner() or self.state.holder is _thread_owner()

    def check(self) -> None:
        """Raise :class:`~dblock.LockLost` if the lock was lost. Call it before
        work that must not run without the lock."""
        if self.state.lost is not None:
            raise LockLost(self.key, self.state.lost)
        if not self.state.released and self.state.expires_mono <= _monotonic():
            # The renewal thread may not have looked yet: the lease is over.
            self._lose_expired()
            raise LockLost(self.key, self.state.lost or Renewer._expired_reason(self))

    # -- for the renewal thread ----------------------------------------------

    def _renewal_ttl(self, now: float) -> float:
        if self.max_hold is None:
            return self.ttl
        return min(self.ttl, self.max_hold - (now - self.state.acquired_mono))

    def _renewable(self) -> bool:
        """Can renewal still extend the lease (renewal on, max_hold not reached)?"""
        if not self.renew:
            return False
        if self.max_hold is None:
            return True
        return self.state.acquired_mono + self.max_hold > self.state.expires_mono + MIN_RENEWAL

    def _renewed(self, expires_at: datetime, expires_mono: float) -> None:
        now = _monotonic()
        self.expires_at = expires_at
        self.state.expires_mono = expires_mono
        self.state.renew_error = None
        self.state.next_check = now + (expires_mono - now) * RENEW_AT

    def _mark_lost(self, reason: str) -> bool:
        if self.state.lost is not None or self.state.released:
            return False
        self.state.lost = reason
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

    # -- former names, read by modules not yet moved to ``state`` --------------

    @property
    def _released(self) -> bool:
        return self.state.released

    @property
    def _deferred(self) -> bool:
        return self.state.deferred

    @_deferred.setter
    def _deferred(self, value: bool) -> None:
        self.state.deferred = value

    def __repr__(self) -> str:
        state = "released" if self.state.released else f"expires_at={self.expires_at.isoformat()}"
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
