"""The lock itself: level 1 (the registry) then level 2 (the row).

:class:`Locker` holds the two public loops, acquire and release, in the
manner of redis-py's ``Lock``: they validate, queue locally, retry and wait;
each talk with the database is one call on the store that runs one statement.

Hand-off. When a holder releases a key that another thread of the same
process is queued for, the row need not go back to the database: one UPDATE
gives it a new token, fence and lease for the next thread (instead of a
DELETE, a wake-up and an INSERT that other processes could race). After
``handoff_limit`` hand-offs in a row the row is released for real, so other
processes get their turn (lock cohorting, bounded for fairness).
"""

from __future__ import annotations

import enum
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Final

from ._store import Grant, Holder, Interrupted, Store
from ._store.base import never_sent
from .config import Config, OnLost
from .errors import (
    BackendError,
    LockBusy,
    LockLost,
    LockNotHeld,
    LockTimeout,
    SchemaMissing,
)
from .keys import db_text
from .registry import Entry, Registry, Waiter, current_owner
from .renewal import MIN_RENEWAL, RENEW_AT, Renewer

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["UNSET", "HeldLock", "LockOptions", "Locker", "Unset", "release_on_exit"]

log = logging.getLogger("dblock")

_monotonic = time.monotonic
_urandom = os.urandom
_current_thread = threading.current_thread


class Unset(enum.Enum):
    """Marks an option the caller did not give (``None`` means "no timeout")."""

    UNSET = enum.auto()

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = Unset.UNSET


class LockOptions:
    """Per-lock lease options: whether to renew, the longest hold, and whom to
    tell when the lock is lost. One shared instance carries the manager's defaults."""

    __slots__ = ("max_hold", "on_lost", "renew")

    def __init__(self, *, renew: bool, max_hold: float | None, on_lost: OnLost | None) -> None:
        self.renew = renew
        self.max_hold = max_hold
        self.on_lost = on_lost


# After a statement was cut off mid-flight we ask again, with the same token,
# this many times (waiting 50, 100, 200 ms) before giving up on learning the
# outcome and leaving the row to be deleted as soon as the database answers.
_AMBIGUITY_RETRIES = 3
# Wake this long after the holder's lease ends, so the takeover finds it expired.
_EXPIRY_MARGIN = 0.002


class HeldLock:
    """A lock this process holds, as yielded by ``LockManager.lock()``.

    ``fence`` grows with every acquisition of any key: pass it to the systems
    you write to and have them reject writes carrying a smaller one (see the
    README). ``expires_at`` is the end of the lease in database time (UTC); the
    renewal thread moves it forward while the lock is held. ``lost`` turns true
    the moment dblock learns (or must assume) that the lock is no longer ours;
    ``check()`` raises :class:`~dblock.LockLost` from then on.
    """

    __slots__ = (
        "_acquired_mono",
        "_entry",
        "_expires_mono",
        "_locker",
        "_lost",
        "_next_check",
        "_released",
        "_renew_error",
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

    def __init__(
        self,
        locker: Locker,
        entry: Entry,
        *,
        token: str,
        owner: str,
        ttl: float,
        grant: Grant,
        sent_at: float,
        options: LockOptions,
    ) -> None:
        self._locker = locker
        self._entry = entry
        self._released = False
        self.key = entry.key
        self.token = token
        self.owner = owner
        self.ttl = ttl
        self.fence = grant.fence
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
    def remaining(self) -> float:
        """Seconds of lease left, by this process's monotonic clock (conservative)."""
        return self._expires_mono - _monotonic()

    @property
    def lost(self) -> bool:
        """True once the lock is known or must be assumed lost (see ``check()``)."""
        return self._lost is not None

    @property
    def lost_reason(self) -> str | None:
        return self._lost

    def check(self) -> None:
        """Raise :class:`~dblock.LockLost` if the lock was lost. Call it before
        work that must not run without the lock."""
        if self._lost is not None:
            raise LockLost(self.key, self._lost)
        if not self._released and self._expires_mono <= _monotonic():
            # The renewal thread may not have looked yet: the lease is over.
            self._locker.renewer.lose(self, "its lease ran out")
            raise LockLost(self.key, self._lost or "its lease ran out")

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

    def release(self) -> bool:
        """Release one level of this lock.

        Returns False if the database could not be reached (the local lock is
        freed anyway and the row is left to its lease and the sweeper; the
        error is logged). Raises :class:`LockLost` if the row was no longer ours.
        """
        return self._locker.release(self)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        release_on_exit(self.release, exc_type, self.key)

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


class _Ticket:
    """What a queued thread asks for, so its predecessor can hand it the row."""

    __slots__ = ("options", "owner", "ttl")

    def __init__(self, owner: str, ttl: float, options: LockOptions) -> None:
        self.owner = owner
        self.ttl = ttl
        self.options = options


class Locker:
    """Acquire and release, over one registry and one store."""

    def __init__(self, store: Store, config: Config) -> None:
        self.store = store
        self.config = config
        self.registry = Registry()
        self._local = config.local_filter
        self._handoff_limit = config.handoff_limit if store.can_transfer else 0
        self.defaults = LockOptions(
            renew=config.renew, max_hold=config.max_hold, on_lost=config.on_lost
        )
        self.renewer = Renewer(store, idle_tick=config.ttl * RENEW_AT)
        self._client_id = ""
        self._set_client_id()

    def _set_client_id(self) -> None:
        self._client_id = self.config.client_id or f"{socket.gethostname()}:{os.getpid()}"

    def after_fork(self) -> None:
        self.registry.clear()
        self.renewer.after_fork()
        self._set_client_id()

    def close(self) -> None:
        self.renewer.close()

    def owner_label(self) -> str:
        label = f"{self._client_id}:{_current_thread().name}"
        # A thread name may hold what no database stores (a lone surrogate).
        return (label if label.isascii() else db_text(label))[:255]

    # -- acquire -----------------------------------------------------------

    def acquire(
        self,
        key: str,
        *,
        blocking: bool,
        timeout: float | None,
        ttl: float,
        options: LockOptions | None = None,
    ) -> HeldLock:
        opts = options or self.defaults
        me = current_owner()
        if not self._local:
            entry = Entry(key, me)
            return self._acquire_row(
                entry, blocking=blocking, timeout=timeout, ttl=ttl, start=_monotonic(), opts=opts
            )

        entry_or_none = self.registry.get(key)
        if entry_or_none is not None and entry_or_none.owner == me:
            held: HeldLock | None = entry_or_none.held
            if held is not None:
                if held._lost is not None:
                    raise LockLost(key, held._lost)
                entry_or_none.depth += 1  # re-entrant: no SQL
                return held

        start = _monotonic()
        if not blocking:
            if entry_or_none is not None:
                raise LockBusy(key, level=1)  # no SQL
            claimed = self.registry.claim(key, me)
            if claimed is None:
                raise LockBusy(key, level=1)
            return self._acquire_row(
                claimed, blocking=False, timeout=timeout, ttl=ttl, start=start, opts=opts
            )

        ticket = _Ticket(self.owner_label(), ttl, opts)
        got = self.registry.join(key, me, ticket)
        if isinstance(got, Entry):
            return self._acquire_row(
                got,
                blocking=True,
                timeout=timeout,
                ttl=ttl,
                start=start,
                opts=opts,
                owner=ticket.owner,
            )
        return self._wait_local(key, got, timeout=timeout, ttl=ttl, start=start, opts=opts)

    def _wait_local(
        self,
        key: str,
        waiter: Waiter,
        *,
        timeout: float | None,
        ttl: float,
        start: float,
        opts: LockOptions,
    ) -> HeldLock:
        if not waiter.wait(timeout):
            if self.registry.abandon(key, waiter):
                raise LockTimeout(key, timeout=timeout or 0.0, level=1)
            # The key was handed to us as we gave up; the wake-up follows the
            # hand-off statement. Take what we were given.
            waiter.wait(None)
        entry = waiter.entry
        grant = waiter.grant
        if isinstance(grant, HeldLock):
            return grant  # the previous holder handed us the row
        token = grant if isinstance(grant, str) else None
        return self._acquire_row(
            entry,
            blocking=True,
            timeout=timeout,
            ttl=ttl,
            start=start,
            opts=opts,
            owner=waiter.ticket.owner,
            token=token,
        )

    def _acquire_row(
        self,
        entry: Entry,
        *,
        blocking: bool,
        timeout: float | None,
        ttl: float,
        start: float,
        opts: LockOptions,
        owner: str | None = None,
        token: str | None = None,
    ) -> HeldLock:
        """Level 2, for the thread that owns ``entry`` at level 1. Whatever
        happens, the entry is either holding a row or handed on."""
        try:
            held = self._acquire_loop(
                entry,
                blocking=blocking,
                timeout=timeout,
                ttl=ttl,
                start=start,
                opts=opts,
                owner=owner or self.owner_label(),
                token=token,
            )
        except BaseException:
            self._leave(entry)
            raise
        entry.held = held
        entry.handoffs = 0
        self.renewer.track(held)
        return held

    def _acquire_loop(
        self,
        entry: Entry,
        *,
        blocking: bool,
        timeout: float | None,
        ttl: float,
        start: float,
        opts: LockOptions,
        owner: str,
        token: str | None,
    ) -> HeldLock:
        store = self.store
        key = entry.key
        token = token or _urandom(16).hex()
        deadline = None if timeout is None else start + timeout
        wait = None
        if deadline is not None:
            # A wait for a pooled connection ends with this request's timeout too.
            store.executor.request_deadline(deadline)
        try:
            while True:
                if wait is not None:
                    wait.prepare()
                if store.has_orphans:
                    store.clean_orphans()
                sent_at = _monotonic()
                result = self._attempt(key, token, owner, ttl)
                if isinstance(result, Grant):
                    return HeldLock(
                        self,
                        entry,
                        token=token,
                        owner=owner,
                        ttl=ttl,
                        grant=result,
                        sent_at=sent_at,
                        options=opts,
                    )
                if not blocking:
                    raise LockBusy(key, level=2, holder=result.owner)
                limit = float("inf") if deadline is None else deadline - _monotonic()
                if limit <= 0:
                    raise LockTimeout(key, timeout=timeout or 0.0, level=2, holder=result.owner)
                if result.expires_in is not None:
                    limit = min(limit, max(result.expires_in, 0.0) + _EXPIRY_MARGIN)
                if wait is None:
                    wait = store.waiter(key, sent_at)
                wait.sleep(limit)
        finally:
            if deadline is not None:
                store.executor.request_deadline(None)
            if wait is not None:
                wait.close()

    def _attempt(self, key: str, token: str, owner: str, ttl: float) -> Grant | Holder:
        """One try at the row, settling an ambiguous outcome: if the connection
        broke with the statement in flight, ask again with the same token;
        the row itself then says whether we got it."""
        store = self.store
        in_doubt = False
        for attempt in range(_AMBIGUITY_RETRIES + 1):
            try:
                return store.try_acquire(key, token, owner, ttl)
            except Interrupted as exc:
                in_doubt = True
                last: BackendError = exc
            except SchemaMissing:
                raise
            except BackendError as exc:
                if not in_doubt:
                    raise  # failed cleanly: nothing was written
                last = exc
            except BaseException as exc:
                # Interrupted (KeyboardInterrupt, a signal handler's exception)
                # with the INSERT possibly committed, unless it was never sent.
                if in_doubt or not never_sent(exc):
                    store.add_orphan(key, token)
                raise
            if attempt < _AMBIGUITY_RETRIES:
                time.sleep(0.05 * 2**attempt)
        store.add_orphan(key, token)
        raise BackendError(
            f"lost the database connection while acquiring {key!r} and could not reach it "
            f"again to learn the outcome; the row, if it was written, will be deleted once "
            f"the database answers ({last})"
        ) from last

    # -- release -----------------------------------------------------------

    def release(self, held: HeldLock) -> bool:
        entry = held._entry
        if held._released or entry.held is not held:
            raise LockNotHeld(f"lock {held.key!r} is not held (already released)")
        entry.depth -= 1
        if entry.depth > 0:
            return True
        held._released = True
        entry.held = None
        self.renewer.untrack(held)
        waiter = None
        if entry.handoffs < self._handoff_limit and held._lost is None:
            waiter = self.registry.pop_waiter(entry)
        if waiter is not None:
            return self._hand_off(entry, held, waiter)
        try:
            # A lost lock's row is deleted too if it is still ours (renewal
            # may have failed only because the database was unreachable).
            deleted = self.store.release(held.key, held.token)
        except BackendError as exc:
            log.error(
                "dblock: releasing %r failed; the row stays until its lease ends or the "
                "sweeper removes it: %s",
                held.key,
                exc,
            )
            return False
        finally:
            self._leave(entry)
        if held._lost is not None:
            raise LockLost(held.key, held._lost)
        if not deleted:
            raise LockLost(held.key, "its row was gone or held by another owner at release")
        return True

    def _hand_off(self, entry: Entry, held: HeldLock, waiter: Waiter) -> bool:
        """Give our row to the next local thread in one statement."""
        ticket: _Ticket = waiter.ticket
        new_token = _urandom(16).hex()
        grant: Grant | None = None
        try:
            sent_at = _monotonic()
            grant = self.store.transfer(held.key, held.token, new_token, ticket.owner, ticket.ttl)
        except BackendError as exc:
            # The row may carry the new token or still ours: the waiter tries
            # with the new token, which settles it either way.
            waiter.grant = new_token
            waiter.wake()
            log.error(
                "dblock: handing %r to the next thread failed; the row stays until its "
                "lease ends or the sweeper removes it: %s",
                held.key,
                exc,
            )
            return False
        except BaseException:
            waiter.grant = None
            waiter.wake()
            raise
        if grant is None:
            waiter.grant = None  # it acquires the row itself
            waiter.wake()
            raise LockLost(held.key, "its row was gone or held by another owner at release")
        successor = HeldLock(
            self,
            entry,
            token=new_token,
            owner=ticket.owner,
            ttl=ticket.ttl,
            grant=grant,
            sent_at=sent_at,
            options=ticket.options,
        )
        entry.held = successor
        entry.handoffs += 1
        self.renewer.track(successor)
        waiter.grant = successor
        waiter.wake()
        return True

    def _leave(self, entry: Entry) -> None:
        """Pass level 1 on (the next thread acquires the row itself) or forget the key."""
        if not self._local:
            return
        waiter = self.registry.leave(entry)
        if waiter is not None:
            waiter.grant = None
            waiter.wake()
