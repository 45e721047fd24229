"""The lock itself: level 1 (the registry) then level 2 (the row).

:class:`Locker` holds the two public loops, acquire and release, in the
manner of redis-py's ``Lock``: they validate, queue locally, retry and wait;
each talk with the database is one call on the store that runs one statement.

Holders. A lock belongs to its owner (a thread or an asyncio task, see
:mod:`dblock.registry`) for as long as that owner runs and keeps a reference
to it. Only the user holds a :class:`HeldLock` strongly; the registry and the
renewer hold weak references (:class:`_Ref`), so a lock dropped without
release is collected, warned about (``ResourceWarning``, like an unclosed
file) and released on the renewal thread; a lock whose owner ended is
released by the renewal thread too.

Interruption. After the registry is asked, one ``try`` in :meth:`Locker._acquire`
owns the clean-up: whatever is raised (a timeout, a signal handler's
exception, ``KeyboardInterrupt``) at whatever point, the registry and the
table are left as if the request had never been made; a key handed to us at
that instant is released, or passed on to the next waiter.

Hand-off. When a holder releases a key that another thread of the same
process is queued for, the row need not go back to the database: one UPDATE
gives it a new token, fence and lease for the next thread (instead of a
DELETE, a wake-up and an INSERT that other processes could race), and where
the store can (PostgreSQL) draws, under the row's lock, fences for the next
hand-offs of the run, which then send no SQL. After ``handoff_limit``
hand-offs in a row the row is released for real, so other processes get
their turn (lock cohorting, bounded for fairness); the next local thread
gives way to them for a few round trips before it tries the row (_GiveWay).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from . import _threads
from ._store import Backoff, Grant, Holder, Interrupted, Store, Wait
from ._store.base import Lease, PoolerMismatch, Steps, never_sent, what_failed
from ._store.batch import Batcher, GaveUp, batches, until_for
from ._store.fair import Seat, fair_sql
from ._store.jobs import statements as job_statements
from .config import UNSET, Config, OnLost, Unset, check_lease
from .errors import (
    BackendError,
    DBLockError,
    KindMismatch,
    LockBusy,
    LockLost,
    LockNotAcquired,
    LockNotHeld,
    LockTimeout,
    ManagerClosed,
    SchemaMissing,
)
from .keys import db_text
from .registry import (
    CLOSED,
    Entry,
    HandedOn,
    Registry,
    ThreadOwner,
    Waiter,
    current_owner,
    owner_alive,
    owner_gone_reason,
    owner_name,
    thread_owner,
)
from .renewal import MIN_RENEWAL, RENEW_AT, Renewer
from .steps import (
    CALL,
    CLEAN_OP,
    EXPIRY_MARGIN,
    OUTAGE_INITIAL,
    OUTAGE_MAX,
    RELEASE,
    SETTLE,
    SLEEP,
    STEPS,
    TRANSFER,
    TRY,
    TURN,
    WAIT,
    Op,
    noop,
    refuse_on_event_loop,
)
from .telemetry import GRANTED, Recorder, Watch, outcome_of, recorder_for

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "UNSET",
    "HeldLock",
    "LockOptions",
    "Locker",
    "Unset",
    "live_lockers",
    "release_on_exit",
]

log = logging.getLogger("dblock")

_monotonic = time.monotonic
_urandom = os.urandom
_current_thread = threading.current_thread
_thread_owner = thread_owner


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
# A hand-off without SQL keeps the row's lease as it is: only while at least
# this share of it is left (renewal, at RENEW_AT, is not far behind).
_RESERVE_LEASE = 0.5
# A grant whose statement came back with less than this share of its lease
# left (by this process's clock, counted from when it was sent) is not handed
# back: its row is deleted and the request goes on as if refused. The caller
# would start work under a lease that has run out, or would before renewal
# could reach the database (an overloaded machine, a statement held up).
_LIVE_LEASE = 0.1
# When a run of hand-offs ends (``handoff_limit``) the row is deleted and the
# next local thread gives way before it tries the row: for this many times
# the DELETE's own round trip, at least _GIVE_WAY_MIN and at most
# _GIVE_WAY_MAX seconds. A waiter of another process, woken by the release
# (NOTIFY, or dblock._store.wake), needs about a round trip to be told and one
# to take the row; without the pause the local thread, woken by a mutex and
# one round trip from the row, won that race nearly every time, and the
# other processes never had their turn.
_GIVE_WAY_RTTS = 4
_GIVE_WAY_MIN = 0.005
_GIVE_WAY_MAX = 0.05


class _GiveWay:
    """What a local waiter is handed with the key when the run of hand-offs
    it would have continued ended: try the row only after ``grace`` seconds."""

    __slots__ = ("grace",)

    def __init__(self, grace: float) -> None:
        self.grace = grace


#: The row's acquire loop (``Locker._acquire_loop``, or another kind's): called
#: with the locker, the entry and the keywords of ``_acquire_loop``.
Level2 = Callable[..., Op["HeldLock"]]
T = TypeVar("T")


class FirstTry(NamedTuple):
    """A try at the row already made: when it was sent and what it answered
    or raised. The acquire loop starts from it instead of sending its own."""

    sent_at: float
    answer: Grant | Holder | BaseException


class Claimed(NamedTuple):
    """What :meth:`Locker._acquire_alone` hands on to
    :meth:`Locker.acquire_steps` when its one statement did not grant a live
    lease: the key it claimed at level 1, with the token and owner that try
    used, and the try itself."""

    entry: Entry
    token: str
    owner: str
    first: FirstTry


class _Custody:
    """What one acquire owns at each moment, so that whatever interrupts it
    gives back exactly that (:meth:`Locker._undo`): the key at level 1
    (``entry``), a place in its queue (``waiter``) or the row too
    (``held``); with what a predecessor passed on with the key (the row's
    ``token``, a fair-queue ``seat``) and the owner label its ticket carried."""

    __slots__ = ("entry", "held", "owner", "seat", "token", "waiter")

    def __init__(self) -> None:
        self.entry: Entry | None = None
        self.waiter: Waiter | None = None
        self.held: HeldLock | None = None
        self.token: str | None = None
        self.seat: Seat | None = None
        self.owner: str | None = None


class _Ref(weakref.ref["HeldLock"]):
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
        locker: Locker,
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
        ref = self._ref = _Ref(self, locker._collect)
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


class _Ticket:
    """What a queued thread asks for, so its predecessor can hand it the row
    (or, ``seats``: a fair request, take its place in the database's queue)."""

    __slots__ = ("options", "owner", "seats", "ttl")

    def __init__(self, owner: str, ttl: float, options: LockOptions, seats: bool) -> None:
        self.owner = owner
        self.ttl = ttl
        self.options = options
        self.seats = seats


#: Every locker of this process (held weakly): interpreter exit releases
#: what their holders left (see :meth:`Locker.release_at_exit`), also for a
#: manager that was itself dropped while its renewal thread still had
#: collected locks to release.
_lockers: weakref.WeakSet[Locker] = weakref.WeakSet()


def live_lockers() -> list[Locker]:
    return list(_lockers)


class Locker:
    """Acquire and release, over one registry and one store."""

    def __init__(self, store: Store, config: Config) -> None:
        self.store = store
        self.config = config
        self.registry = Registry()
        self._local = config.local_filter
        self.defaults = LockOptions(
            renew=config.renew, max_hold=config.max_hold, on_lost=config.on_lost
        )
        self.renewer: Renewer[HeldLock] = Renewer(
            store,
            idle_tick=config.ttl * RENEW_AT,
            abandon=self._abandon,
            reap=self._reap,
            collected=self._release_collected,
        )
        store.wake_cleaner = self._post_noop
        #: What sends the row statements of this process's threads: the
        #: batcher (group commit, dblock._store.batch) where the dialect can
        #: answer many requests in one statement, else the store itself.
        self.batcher: Batcher | None = Batcher(store) if config.batch and batches(store) else None
        self._rows: Batcher | Store = self.batcher or store
        self._closing = False
        #: The ``kind`` of the rows this locker writes; a holder row of another
        #: kind means the key is used as another kind of lock.
        self.kind = "exclusive"
        #: What a grant becomes (a subclass for other kinds of lock).
        self.held_type: type[HeldLock] = HeldLock
        #: Called with each key a request asks for, before level 1: refuses
        #: (``KindMismatch``) a key this process uses as another kind of lock.
        self.kind_guard: Callable[[str], None] | None = None
        self._client_id = ""
        self._set_client_id()
        #: The process whose locks these are: a forked child holds none of
        #: them, and must never release its parent's rows at its own exit.
        self.pid = os.getpid()
        self.telemetry: Recorder | None = recorder_for(config.telemetry, config.table)
        self.renewer.telemetry = self.telemetry
        # The weak-reference callback of every held lock, bound once (not per lock).
        self._collect: Callable[[_Ref], None] = self._collected
        # What release_at_exit claimed, and the tokens whose release it posted.
        self._exit_candidates: list[HeldLock] = []
        self._exit_posted: set[str] = set()
        _lockers.add(self)

    def _post_noop(self) -> None:
        self.renewer.post(noop)  # the renewal thread cleans orphans on its pass

    def _set_client_id(self) -> None:
        self._client_id = self.config.client_id or f"{socket.gethostname()}:{os.getpid()}"

    def after_fork(self) -> None:
        self.pid = os.getpid()
        self.registry.clear()
        self.renewer.after_fork()
        if self.batcher is not None:
            self.batcher.after_fork()
        self._set_client_id()

    def close(self, timeout: float) -> None:
        """Refuse new requests, send every waiter away with
        :class:`~dblock.ManagerClosed`, keep renewing the locks still held for
        up to ``timeout`` seconds, then release them and mark them lost."""
        self._closing = True
        try:
            for waiter in self.registry.close():
                waiter.wake(CLOSED)
            deadline = _monotonic() + timeout
            while self.renewer.tracked and _monotonic() < deadline:
                # Holders release on their own threads; close() is rare: poll.
                time.sleep(min(0.02, max(deadline - _monotonic(), 0.0)))
            # Every lock still held is lost from here on, before any SQL: a
            # release that waits for the database must not leave the ones
            # after it believed held.
            reason = "the LockManager was closed while it was held"
            revoked = [h for h in self.renewer.held_locks() if self._revoke(h, reason, True)]
            if revoked:
                release_at_close(revoked, self._let_revoked_go, self.CLOSE_RELEASES)
        finally:
            self.renewer.close()

    #: Seconds close() waits for the database to answer its releases (see
    #: :func:`release_at_close`).
    CLOSE_RELEASES = 10.0

    #: Seconds interpreter exit waits for the database to answer its
    #: releases (see :meth:`release_at_exit`); then the rows are left to their leases.
    EXIT_RELEASES = 3.0

    def release_at_exit(
        self, seconds: float, cut: list[BaseException] | None = None
    ) -> threading.Event | None:
        """At interpreter exit (``dblock.manager``'s atexit hook): take every
        lock whose holder can never run again (the main thread, whose code
        is done; a thread or task that ended; a task whose loop no longer
        runs) and delete its row on the renewal thread, which still runs
        (a daemon). Returns the event set once they are deleted (None: none
        to delete); the caller waits for it at most ``seconds``. A lock held
        by a thread that still runs (a daemon thread, which runs until the
        interpreter stops it) is left to its lease: releasing it could let
        another process in while its holder still works under it.

        Nothing here for a forked child (its registry was cleared; a child
        forked by other means must not release its parent's rows), nor for
        a row released already: a job's row kept for ``at_least`` stays.
        ``cut``: where an exception that cut the claims short goes (the
        locks claimed so far are still released), for the caller to raise
        once it has waited."""
        if self.pid != os.getpid() or self._closing:
            return None  # (closed: close() released what it held)
        me = _current_thread()
        # Kept on the locker, not in a local: a run cut off after claiming
        # (the renewal pass then stops watching what it claimed) leaves them
        # to the next run, atexit's second call (see dblock.manager).
        candidates = self._exit_candidates
        try:
            candidates.extend(
                held for held in self.renewer.held_locks() if not _runs_at_exit(held._owner, me)
            )
            for held in candidates:
                ref = held._ref
                if not ref.live:
                    continue  # somebody else claimed it first
                # Claimed and marked with no call in between (see _let_go):
                # the mark, not a list it joins, says it is ours to delete.
                ref.live = False
                held._released = True
                held._revoked = True
                held._lost = _AT_EXIT
                entry = held._entry
                if entry.held is ref:
                    entry.leaving = True  # (before held: see _let_go)
                    entry.held = None
        except BaseException as exc:
            # Whatever cut the loop off (a signal handler's exception at
            # exit), the locks claimed so far are released below; the
            # caller raises it once they are.
            if cut is None:
                raise
            cut.append(exc)
        posted = self._exit_posted
        taken = [h for h in candidates if h._lost is _AT_EXIT and h.token not in posted]
        for held in taken:
            self.renewer.untrack(held)
        if not taken and not self.renewer.running:
            return None
        # Posted after whatever the renewal thread has in hand (a collected
        # lock's release, as when a script's last reference to it went at
        # its end): done once that is sent too.
        done = threading.Event()

        def release_all() -> None:
            try:
                for held in taken:
                    entry = held._entry
                    try:
                        deleted = self.run(_release_op(held.key, held.token))
                    except Exception as exc:  # logged; the lease ends the row
                        log.warning(
                            "dblock: lock %r could not be released at interpreter exit; its "
                            "row stays until its lease ends or the sweeper removes it: %s",
                            held.key,
                            exc,
                        )
                    else:
                        log.info(
                            "dblock: lock %r %s at interpreter exit (%s had not released it)",
                            held.key,
                            "released" if deleted else "found gone (not ours any more)",
                            owner_name(held._owner),
                        )
                    finally:
                        self._leave(entry)
            finally:
                done.set()

        try:
            self.renewer.post(release_all)
            posted.update(held.token for held in taken)
        except RuntimeError:  # no renewal thread, and none can start now
            done.set()
            log.warning(
                "dblock: %d lock(s) still held at interpreter exit (%s) are left to their "
                "leases (at most %g s): no thread could release them",
                len(taken),
                ", ".join(repr(h.key) for h in taken),
                max(h.ttl for h in taken),
            )
        return done

    def owner_label(self, me: object = None) -> str:
        """Who holds a row, for people reading ``dblock list``: host, pid and
        thread (or asyncio task)."""
        if isinstance(me, ThreadOwner):
            name = me.thread.name
        elif me is None:
            name = _current_thread().name
        else:
            get_name = getattr(me, "get_name", None)
            name = get_name() if get_name is not None else repr(me)
        label = f"{self._client_id}:{name}"
        # A thread name may hold what no database stores (a lone surrogate).
        return (label if label.isascii() else db_text(label))[:255]

    # -- acquire -----------------------------------------------------------

    def acquire(  # noqa: PLR0917 - positional: the manager's partial calls it per lock
        self,
        key: str,
        blocking: bool,
        timeout: float | None,
        ttl: float,
        options: LockOptions | None = None,
        level2: Level2 | None = None,
    ) -> HeldLock:
        opts = options or self.defaults
        me = current_owner()
        if self.kind_guard is not None:
            self.kind_guard(key)
        entry = None
        if self._local:
            entry = self.registry.get(key)
            if entry is not None:
                held = self.reenter(entry, me, blocking)
                if held is not None:
                    return held
            elif level2 is None:
                return self._acquire_alone(key, me, blocking, timeout, ttl, opts)
        return self.run(
            self.acquire_steps(
                key,
                me,
                blocking=blocking,
                timeout=timeout,
                ttl=ttl,
                opts=opts,
                waiter_type=Waiter,
                level2=level2,
                seen=entry,
            )
        )

    def _acquire_alone(  # noqa: PLR0912, PLR0915, PLR0917 - the hot path, inlined
        self,
        key: str,
        me: object,
        blocking: bool,
        timeout: float | None,
        ttl: float,
        opts: LockOptions,
    ) -> HeldLock:
        """The common request (a key nobody of this process holds or waits
        for, granted at the first try) without the step machinery: claim the
        key, send the one statement, keep the grant. Anything else (the key
        claimed meanwhile, the row held elsewhere, a failed or interrupted
        statement) goes on in :meth:`acquire_steps`, handed what was done so
        far: the claimed key, the token and the first try's outcome. At one
        thread per process the machinery's own work was a tenth of a grant's
        client CPU (most of it cache misses after each round trip)."""
        start = _monotonic()
        store = self.store
        try:
            entry = None if self._closing or store.has_orphans else self.registry.claim(key, me)
        except BaseException:
            try:
                self.run(self._forget_left_behind(key, me))
            except BaseException:
                # Cut off as it started (a signal at a frame's first
                # instruction): once more, it finds what the first left.
                self.run(self._forget_left_behind(key, me))
                raise
            raise
        if entry is None:
            return self.run(
                self.acquire_steps(
                    key, me, blocking=blocking, timeout=timeout, ttl=ttl, opts=opts,
                    waiter_type=Waiter, start=start,
                )
            )  # fmt: skip
        held: HeldLock | None = None
        first: Grant | Holder | BaseException | None = None
        token = ""
        try:
            token = _urandom(16).hex()
            owner = self.owner_label(me)
            request = store.executor.request
            deadline = None if timeout is None else start + timeout
            request.deadline = deadline
            batcher = self.batcher
            sent_at = _monotonic()
            try:
                if batcher is None:
                    first = store.try_acquire(key, token, owner, ttl)
                else:
                    until = until_for(deadline, sent_at)
                    first = batcher.try_acquire(key, token, owner, ttl, until)
            except BaseException as exc:
                first = exc
            finally:
                request.deadline = None
            if isinstance(first, Grant) and first.sent_at is not None:
                sent_at = first.sent_at  # a grouped statement's, sent after we queued
            if not isinstance(first, Grant) or (
                sent_at + first.expires_in - _monotonic() < ttl * _LIVE_LEASE
            ):
                # Not granted at once (or granted a lease that ran out on
                # the way): on with the machinery, as if it had made the
                # try. It gives the key back on any failure; this try still
                # covers the instant before it starts (a signal there), and a
                # second leave of one entry changes nothing.
                claimed = Claimed(entry, token, owner, FirstTry(sent_at, first))
                return self.run(
                    self.acquire_steps(
                        key, me, blocking=blocking, timeout=timeout, ttl=ttl, opts=opts,
                        waiter_type=Waiter, start=start, claimed=claimed,
                    )
                )  # fmt: skip
            held = self.held_type(self, entry, token, owner, ttl, first, sent_at, opts)
            self._keep(entry, held)
            if self._closing:
                raise ManagerClosed(f"the LockManager was closed while acquiring {key!r}")
            if self.telemetry is not None:
                self.telemetry.granted_at_once()
            return held
        except BaseException as exc:
            try:
                self._alone_failed(exc, entry, me, token=token, held=held, first=first)
            except BaseException:
                # Cut off as it started: once more (each of its steps is
                # done once: the claim, the orphan's token, the leave's owner).
                self._alone_failed(exc, entry, me, token=token, held=held, first=first)
                raise
            raise

    def _alone_failed(
        self,
        exc: BaseException,
        entry: Entry,
        me: object,
        *,
        token: str,
        held: HeldLock | None,
        first: Grant | Holder | BaseException | None,
    ) -> None:
        """:meth:`_acquire_alone` ends in ``exc``: give back what it had."""
        if held is not None:
            if self.telemetry is not None:
                Watch(self.telemetry, entry.key).done(*outcome_of(exc))
            self.run(self._give_back(held))
            return
        if isinstance(first, Grant):
            # Granted, and interrupted before the held lock existed: the row
            # is deleted at once, not left for its lease.
            self.store.add_orphan(entry.key, token)
            self.renewer.post(noop)
        # Not if the machinery returned a held lock and we were interrupted
        # before returning it: level 1 goes with that lock's release (when it
        # is collected), not before its row is gone.
        if entry.owner is me and entry.held is None:
            self._leave(entry, None, me)

    @property
    def _handoff_limit(self) -> int:
        # Read from the store each time: MariaDB's is known once its server answered.
        return self.config.handoff_limit if self.store.can_transfer else 0

    @property
    def _run_limit(self) -> int:
        """Without hand-off (MySQL) every local grant is a row of its own, and
        a run of them is counted in grants (see _keep and release)."""
        return 0 if self.store.can_transfer else self.config.handoff_limit

    def _keep(self, entry: Entry, held: HeldLock) -> None:
        """A granted row becomes the key's at level 1, and renewal watches it."""
        entry.held = held._ref
        if self._run_limit:
            # No hand-off: the entry (alive while local threads queue) counts
            # its row grants in a row instead, so a run of them ends too.
            entry.handoffs += 1
        else:
            entry.handoffs = 0
        self.renewer.track(held)
        held._ref.tracked = True

    def owns(self, key: str) -> bool:
        """Whether the calling thread or task holds ``key`` (see :meth:`HeldLock.owned`)."""
        entry = self.registry.get(key)
        ref: _Ref | None = None if entry is None else entry.held
        held = None if ref is None else ref()
        return held is not None and held.owned()

    def reenter(self, entry: Entry, me: object, blocking: bool) -> HeldLock | None:
        """Level 1 alone, for a key someone of this process holds or waits
        for: our own lock again (re-entrant, no SQL), or a fail-fast refusal
        (no SQL); None when the request must queue."""
        if entry.owner is me:
            ref: _Ref | None = entry.held
            held = None if ref is None else ref()
            if held is not None:
                if held._lost is not None:
                    raise LockLost(entry.key, held._lost)
                entry.depth += 1
                return held
            # Our own lock, dropped without release (collected): acquire
            # takes it back (see _take_back), never refused as another's.
            return None
        if not blocking:
            if self.telemetry is not None:
                self.telemetry.refused_locally()
            if not owner_alive(entry.owner):
                self.renewer.ensure_running()  # its pass passes the key on (_reap)
            raise LockBusy(entry.key, level=1)
        return None

    def acquire_steps(
        self,
        key: str,
        me: object,
        *,
        blocking: bool,
        timeout: float | None,
        ttl: float,
        opts: LockOptions,
        waiter_type: type[Waiter],
        level2: Level2 | None = None,
        seen: Entry | Unset | None = UNSET,
        start: float | None = None,
        claimed: Claimed | None = None,
    ) -> Op[HeldLock]:
        """Level 1, then level 2, written once for threads and tasks: what to
        wait for and which statement to send are yielded as :data:`Op`
        tuples, carried out by :meth:`run` (blocking) or by the asyncio
        driver, whose answers come back here. What this request owns at each
        moment is in its :class:`_Custody`; the one ``except`` below gives
        back exactly that. ``level2`` replaces the row's acquire loop (the
        fair queue's, :func:`dblock.kinds.fair.queued_loop`). ``claimed``:
        what :meth:`_acquire_alone` did before it handed the request on (the
        key claimed at level 1, the token and owner, when the first try was
        sent and what it answered or raised)."""
        start = _monotonic() if start is None else start
        c = _Custody()
        telemetry = self.telemetry
        watch = None if telemetry is None else Watch(telemetry, key)
        try:
            if claimed is not None:
                c.entry, c.token, c.owner = claimed.entry, claimed.token, claimed.owner
            else:
                yield from self._level1(
                    c,
                    key,
                    me,
                    blocking=blocking,
                    timeout=timeout,
                    start=start,
                    ttl=ttl,
                    opts=opts,
                    waiter_type=waiter_type,
                    level2=level2,
                    seen=seen,
                    watch=watch,
                )
            if c.held is None:
                assert c.entry is not None
                c.held = yield from (level2 or Locker._acquire_loop)(
                    self,
                    c.entry,
                    blocking=blocking,
                    timeout=timeout,
                    ttl=ttl,
                    start=start,
                    opts=opts,
                    owner=c.owner or self.owner_label(me),
                    token=c.token,
                    watch=watch,
                    seat=c.seat,
                    **({} if claimed is None else {"first": claimed.first}),
                )
                self._keep(c.entry, c.held)
            if self._closing:
                raise ManagerClosed(f"the LockManager was closed while acquiring {key!r}")
            if watch is not None:
                watch.done(GRANTED, c.held.fence)
            return c.held
        except BaseException as exc:
            if watch is not None:
                watch.done(*outcome_of(exc))
            yield from self._undo(key, me, c)
            raise

    def _level1(
        self,
        c: _Custody,
        key: str,
        me: object,
        *,
        blocking: bool,
        timeout: float | None,
        start: float,
        ttl: float,
        opts: LockOptions,
        waiter_type: type[Waiter],
        level2: Level2 | None,
        seen: Entry | Unset | None,
        watch: Watch | None,
    ) -> Op[None]:
        """Level 1 of :meth:`acquire_steps`: the key's entry in ``c`` (ours
        again, free, or passed on to us after a wait in its queue), or the
        row too when the previous holder handed it over. Everything taken is
        recorded in ``c`` the moment it is ours, for the caller's ``except``."""
        if self._local:
            # (``seen``: the caller's own look-up of the key, not made twice.)
            mine = self.registry.get(key) if seen is UNSET else seen
            if mine is not None and mine.owner is me:
                c.entry = yield from self._take_back(mine, me, blocking, timeout, start)
                if c.entry is not None:
                    return  # ours at level 1 already: on to level 2
        if not self._local:
            c.entry = Entry(key, me)
            return
        if not blocking:
            c.entry = self.registry.claim(key, me)
            if c.entry is None:
                raise LockBusy(key, level=1)
            return
        got, c.owner = self._claim_or_join(
            key, me, ttl=ttl, opts=opts, waiter_type=waiter_type, level2=level2
        )
        if isinstance(got, Entry):
            c.entry = got
            return
        c.waiter = got
        # Its passes hand on what a dead owner left (see _reap).
        self.renewer.ensure_running()
        if watch is not None:
            watch.waiting(1)
        grant = yield (TURN, got, timeout)
        if grant is CLOSED:
            c.waiter = None
            raise ManagerClosed(f"the LockManager was closed while waiting for {key!r}")
        if isinstance(grant, HeldLock):
            c.held, c.waiter = grant, None  # the previous holder handed us the row
            return
        c.entry, c.waiter = got.entry, None
        c.token = grant if isinstance(grant, str) else None
        c.seat = grant if isinstance(grant, Seat) else None
        if isinstance(grant, _GiveWay):
            yield from self._give_way(grant, start, timeout)

    def _claim_or_join(
        self,
        key: str,
        me: object,
        *,
        ttl: float,
        opts: LockOptions,
        waiter_type: type[Waiter],
        level2: Level2 | None,
    ) -> tuple[Entry | Waiter, str | None]:
        """Level 1 for a request that may wait: the key's entry if it was
        free, else a place in its queue (and the owner label its ticket
        carries). A free key needs no ticket (what a queued request asks its
        predecessor for): take it first, and queue only if that fails.
        Interrupted between the two, :meth:`_forget_left_behind` finds what
        either left."""
        got = self.registry.claim(key, me)
        if got is not None:
            return got, None
        seats = bool(getattr(level2, "seats", False))
        ticket = _Ticket(self.owner_label(me), ttl, opts, seats)
        return self.registry.join(key, me, ticket, waiter_type), ticket.owner

    @staticmethod
    def _give_way(grant: _GiveWay, start: float, timeout: float | None) -> Op[None]:
        """The run of hand-offs ended: another process's waiter gets the
        chance to take the row first (the key is ours at level 1 already)."""
        pause = grant.grace
        if timeout is not None:
            pause = min(pause, start + timeout - _monotonic())
        if pause > 0:
            yield (SLEEP, pause)

    def _undo(self, key: str, me: object, c: _Custody) -> Op[None]:
        """Give back exactly what an acquire that raised owned: its place in
        the queue, the row too, or the key at level 1 (else what an
        interrupted claim or join left behind)."""
        entry = c.entry
        if c.waiter is not None:
            yield from self._withdraw(c.waiter)
        elif c.held is not None:
            yield from self._give_back(c.held)
        elif entry is not None:
            if entry.owner is me:
                # (Not ours any more: evicted as an owner that could never run
                # again, its coroutine now closed by the garbage collector.)
                self._leave(entry, None, me)
        else:
            yield from self._forget_left_behind(key, me)

    def _forget_left_behind(self, key: str, me: object) -> Op[None]:
        """Give back what an interrupted claim or join left in the registry
        (see :meth:`Registry.left_behind`): else the key stayed taken at
        level 1 for every thread of the process while ours lived, and ours
        waited on its next request for a lock it never had."""
        if not self._local:
            return
        left = self.registry.left_behind(key, me)
        if isinstance(left, Entry):
            self._leave(left, None, me)
        elif left is not None:
            yield from self._withdraw(left)

    def run(self, steps: Op[T]) -> T:  # noqa: PLR0912, PLR0915 - one branch per op
        """Carry out ``steps`` on this thread, blocking."""
        store = self.store
        rows = self._rows
        batcher = self.batcher
        wait: Wait | None = None
        waiting_for: tuple[Any, ...] = ()
        # How the steps go on: sent the last step's answer, or thrown what it raised.
        resume: Callable[[Any], Any] = steps.send
        value: Any = None
        try:
            while True:
                try:
                    op = resume(value)
                except StopIteration:
                    raise
                except BaseException as exc:
                    if getattr(steps, "gi_frame", None) is None:
                        raise  # theirs: they are done
                    op = _thrown_in(steps, exc)
                finally:
                    # (An exception kept here would hold this frame through
                    # its traceback, and with it the steps' locks, until the
                    # garbage collector came by.)
                    value = None
                try:
                    tag = op[0]
                    if tag is TRY:
                        if wait is not None:
                            wait.prepare()
                        answer: object = (
                            rows.try_acquire(op[1], op[2], op[3], op[4])
                            if batcher is None
                            else batcher.try_acquire(op[1], op[2], op[3], op[4], op[5])
                        )
                    elif tag is RELEASE:
                        answer = rows.release(op[1], op[2])
                    elif tag is TRANSFER:
                        answer = store.transfer(op[1], op[2], op[3], op[4], op[5], extra=op[6])
                    elif tag is STEPS:
                        if wait is not None:
                            wait.prepare()
                        answer = store.drive(op[1])
                    elif tag is TURN:
                        answer = self._wait_turn(op[1], op[2])
                    elif tag is WAIT:
                        if wait is None or op[4:] != waiting_for:
                            # (A fair-queue waiter that joined again has a new address.)
                            if wait is not None:
                                wait.close()
                            refuse_on_event_loop(op[1])
                            wait = store.waiter(op[1], op[3], *op[4:5])
                            waiting_for = op[4:]
                        wait.sleep(op[2])
                        answer = None
                    elif tag is SETTLE:
                        answer = op[1].settle()
                    elif tag is SLEEP:
                        time.sleep(op[1])
                        answer = None
                    elif tag is CALL:
                        if wait is not None:  # (nothing to wait for while it runs)
                            wait.close()
                            wait = None
                        answer = op[1]()
                    else:  # CLEAN
                        store.clean_orphans()
                        answer = None
                except BaseException as exc:
                    resume, value = steps.throw, exc
                else:
                    resume, value = steps.send, answer
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        finally:
            if wait is not None:
                wait.close()

    def _wait_turn(self, waiter: Waiter, timeout: float | None) -> object:
        """Wait in the queue of ``key`` until the key is handed to us; returns
        what came with it (see :meth:`acquire_steps`)."""
        key = waiter.entry.key
        if timeout != 0:
            refuse_on_event_loop(key)
        if not waiter.wait(timeout):
            if self.registry.abandon(key, waiter):
                raise LockTimeout(key, timeout=timeout or 0.0, level=1)
            # The key was handed to us as we gave up; the wake-up follows the
            # hand-off statement. Take what we were given.
            pending = waiter.settle()
            if pending is not None:
                raise pending
        return waiter.grant

    def _withdraw(self, waiter: Waiter) -> Op[None]:
        """Leave the queue of a key as if we had never joined it: if the key
        was handed to us meanwhile, pass it on (or release the row)."""
        entry = waiter.entry
        if self.registry.abandon(entry.key, waiter):
            return
        yield (SETTLE, waiter)  # an interruption now changes nothing: we are raising already
        grant = waiter.grant
        if grant is CLOSED:
            return
        if isinstance(grant, HeldLock):
            yield from self._give_back(grant)
            return
        owner = entry.owner  # (ours: the key was handed to us)
        try:
            if isinstance(grant, str):  # a failed hand-off: the row may carry this token
                yield from self._delete_row(entry.key, grant)
            elif isinstance(grant, Seat):  # our place in the fair queue: leave it
                yield from self._leave_queue(entry.key, grant.token)
        finally:
            try:
                self._leave(entry, None, owner)
            except BaseException:
                self._leave(entry, None, owner)  # cut off as it started: see _leave
                raise

    def _give_back(self, held: HeldLock) -> Op[None]:
        """Release a lock its acquirer never got to return (interrupted, or
        the manager closed meanwhile). Nothing if dblock released it already."""
        if not self._claim(held):
            return
        held._released = True
        entry = held._entry
        owner = entry.owner
        if entry.held is held._ref:
            entry.leaving = True  # (before held: see _let_go)
            entry.held = None
        try:
            yield from self._delete_row(held.key, held.token)
        finally:
            try:
                self._leave(entry, None, owner)
            except BaseException:
                self._leave(entry, None, owner)  # cut off as it started: see _leave
                raise

    def _leave_queue(self, key: str, token: str) -> Op[None]:
        """Best effort, as :meth:`_delete_row`: delete a fair request's rows."""
        try:
            yield (STEPS, fair_sql(self.store).leave_steps(key, token))
        except BackendError as exc:
            log.error("dblock: leaving the fair queue of %r failed: %s", key, exc)
            self.store.add_orphan(
                key,
                token,
                released=True,
                settle=partial(fair_sql(self.store).leave_steps, key, token),
            )
        except BaseException:
            self.store.add_orphan(
                key, token, settle=partial(fair_sql(self.store).leave_steps, key, token)
            )
            self.renewer.post(noop)
            raise

    def _delete_row(self, key: str, token: str) -> Op[None]:
        """Best effort: delete the row if it carries ``token``, and never
        leave it behind for longer than the database takes to answer again."""
        try:
            yield (RELEASE, key, token)
        except BackendError as exc:
            log.error(
                "dblock: releasing %r failed; the row stays until its lease ends or the "
                "sweeper removes it: %s",
                key,
                exc,
            )
        except SchemaMissing as exc:
            log.error("dblock: releasing %r failed: %s", key, exc)  # no table, no row
        except BaseException:
            self.store.add_orphan(key, token, released=True)
            self.renewer.post(noop)  # the renewal thread cleans orphans on its pass
            raise

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
        watch: Watch | None = None,
        seat: Seat | None = None,  # always None: only the fair queue's loop is handed one
        first: FirstTry | None = None,
    ) -> Op[HeldLock]:
        store = self.store
        key = entry.key
        # A token handed over by a hand-off that failed mid-statement: the row
        # may carry it already. This thread was waiting, so it rides out an
        # outage too, and if it still fails the row must not outlive it.
        # (``first``: the first try, made by _acquire_alone with this token.)
        handed = token if first is None else None
        token = token or _urandom(16).hex()
        deadline = None if timeout is None else start + timeout
        # A wait for a pooled connection ends with this request's timeout too
        # (the blocking driver's executor reads it on this thread).
        request = store.executor.request
        request.deadline = deadline
        outage: Backoff | None = None
        waiting = False
        # The token a row of ours may carry, from the try on until we know
        # (refused) or the lock holds it: a signal handler's exception in
        # between deletes the row at once, not at its lease's end.
        unsettled: str | None = None
        try:
            while True:
                unsettled = token
                if first is not None:
                    sent_at, answer = first
                    first = None
                else:
                    sent_at, answer = yield from self._try_row(key, token, owner, ttl, deadline)
                # (A failed try's retries settle it: see _attempt.)
                unsettled = None if isinstance(answer, BaseException) else token
                try:
                    result = yield from self._answer(
                        key, answer, token=token, owner=owner, ttl=ttl, deadline=deadline,
                        blocking=blocking, timeout=timeout,
                    )  # fmt: skip
                except BackendError as exc:
                    outage = outage or Backoff(OUTAGE_INITIAL, OUTAGE_MAX)
                    token = yield from self._ride_out(
                        key, token, exc, deadline, outage, waiting=waiting, handed=handed
                    )
                    continue
                outage = None
                if isinstance(result, Grant):
                    # A grouped statement's time, sent after we queued, if any.
                    sent_at = sent_at if result.sent_at is None else result.sent_at
                    if sent_at + result.expires_in - _monotonic() >= ttl * _LIVE_LEASE:
                        held = self.held_type(self, entry, token, owner, ttl, result, sent_at, opts)
                        unsettled = None
                        return held
                    yield from self._stale_grant(key, token, blocking, deadline, timeout)
                    token, handed = _urandom(16).hex(), None
                    continue
                unsettled = None  # refused: the row is another's
                limit = self._refused(key, result, blocking, deadline, timeout)
                if not waiting and watch is not None:
                    watch.waiting(2)
                waiting = True
                yield (WAIT, key, limit, sent_at)
        except BaseException as exc:
            # (dblock's own errors have settled the row already, if any.)
            if unsettled is not None and not isinstance(exc, DBLockError):
                store.add_orphan(key, unsettled)
                self.renewer.post(noop)
            raise
        finally:
            request.deadline = None

    def _stale_grant(
        self, key: str, token: str, blocking: bool, deadline: float | None, timeout: float | None
    ) -> Op[None]:
        """The answer came back after the lease it set had run out (or
        nearly), by our clock: the row is not worth handing back. Delete it,
        and go on as if refused (out of time if no time is left)."""
        yield from self._delete_row(key, token)
        if not blocking or (deadline is not None and _monotonic() >= deadline):
            raise self._out_of_time(key, blocking, timeout)

    def _answer(
        self,
        key: str,
        answer: Grant | Holder | BaseException,
        *,
        token: str,
        owner: str,
        ttl: float,
        deadline: float | None,
        blocking: bool,
        timeout: float | None,
    ) -> Op[Grant | Holder]:
        """The try's answer; if it raised, the retries' (:meth:`_attempt`)."""
        if not isinstance(answer, BaseException):
            return answer
        until = until_for(deadline, _monotonic())
        try:
            return (yield from self._attempt(key, token, owner, ttl, until, answer))
        except GaveUp:
            # Our statement was held up past our deadline (by another key's,
            # or in one with it): as a timeout. The batcher deletes our row
            # if the statement, still in flight, writes one.
            raise self._out_of_time(key, blocking, timeout) from None

    def _try_row(
        self, key: str, token: str, owner: str, ttl: float, deadline: float | None
    ) -> Op[tuple[float, Grant | Holder | BaseException]]:
        """One try at the row (the first here, the rest, if it fails, in
        :meth:`_attempt`): when it was sent and what it answered or raised."""
        if self._closing:
            raise ManagerClosed(f"the LockManager was closed while waiting for {key!r}")
        if self.store.has_orphans:
            yield CLEAN_OP
        sent_at = _monotonic()
        until = until_for(deadline, sent_at)
        try:
            answer: Grant | Holder | BaseException = yield (TRY, key, token, owner, ttl, until)
        except BaseException as failed:
            answer = failed
        return sent_at, answer

    def _refused(
        self,
        key: str,
        result: Holder,
        blocking: bool,
        deadline: float | None,
        timeout: float | None,
    ) -> float:
        """The row is held: raise (a row of another kind, fail-fast, no time
        left), or return how long to wait before the next try (at most until
        the holder's lease ends)."""
        if result.kind is not None and result.kind != self.kind:
            raise KindMismatch(key, requested=self.kind, existing=result.kind, where="in the table")
        if not blocking:
            raise LockBusy(key, level=2, holder=result.owner)
        limit = float("inf") if deadline is None else deadline - _monotonic()
        if limit <= 0:
            raise LockTimeout(key, timeout=timeout or 0.0, level=2, holder=result.owner)
        if result.expires_in is not None:
            limit = min(limit, max(result.expires_in, 0.0) + EXPIRY_MARGIN)
        return limit

    @staticmethod
    def _out_of_time(key: str, blocking: bool, timeout: float | None) -> LockNotAcquired:
        """What a request that ran out of time raises: a fail-fast one
        ``LockBusy``, a waiting one ``LockTimeout``."""
        if not blocking:
            return LockBusy(key, level=2)
        return LockTimeout(key, timeout=timeout or 0.0, level=2)

    def _ride_out(
        self,
        key: str,
        token: str,
        exc: BackendError,
        deadline: float | None,
        outage: Backoff,
        *,
        waiting: bool,
        handed: str | None,
    ) -> Op[str]:
        """A waiting acquire lost the database (a restart, a failover): wait
        and try again until its own deadline, then raise what it saw. One
        that is not waiting yet (its first attempt: a wrong URL, a dead
        server) raises at once. Returns the token to go on with: a fresh one
        if the last attempt's outcome stayed unknown (that row is an orphan
        now, deleted once the database answers, and must not be taken for ours)."""
        limit = float("inf") if deadline is None else deadline - _monotonic()
        # A misconfigured pooler is no outage: waiting would not cure it.
        if limit <= 0 or not (waiting or handed) or isinstance(exc, PoolerMismatch):
            if handed is not None:
                self.store.add_orphan(key, handed, released=True)
            raise exc
        log.warning("dblock: waiting for %r; %s, retrying: %s", key, what_failed(exc), exc)
        yield (SLEEP, outage.step(limit))
        return _urandom(16).hex() if self.store.is_orphan(key, token) else token

    def _attempt(  # noqa: PLR0917 - positional, as the op it yields
        self,
        key: str,
        token: str,
        owner: str,
        ttl: float,
        until: float | None,
        first: BaseException | None = None,
    ) -> Op[Grant | Holder]:
        """One try at the row, settling an ambiguous outcome: if the connection
        broke with the statement in flight, ask again with the same token;
        the row itself then says whether we got it. ``first``: the first
        try was made by the caller and raised that."""
        store = self.store
        in_doubt = False
        for attempt in range(_AMBIGUITY_RETRIES + 1):
            try:
                if first is not None:
                    failed, first = first, None
                    raise failed
                result: Grant | Holder = yield (TRY, key, token, owner, ttl, until)
                return result
            except Interrupted as exc:
                in_doubt = True
                last: BackendError = exc
            except GaveUp:
                if in_doubt:  # an earlier try's row may exist: delete it
                    store.add_orphan(key, token, unreachable=True)
                    self.renewer.post(noop)
                raise
            except SchemaMissing:
                raise
            except BackendError as exc:
                if not in_doubt:
                    raise  # failed cleanly: nothing was written
                last = exc
            except BaseException as exc:
                # Interrupted (KeyboardInterrupt, a signal handler's exception,
                # a task's cancellation) with the INSERT possibly committed
                # (unless it was never sent): the renewal thread deletes the
                # row at once, without delaying the interruption here.
                # Logged as a database fault only if the connection had
                # failed (in_doubt) or the clean-up finds it unreachable: an
                # ordinary cancellation on a healthy database is DEBUG.
                if in_doubt or not never_sent(exc):
                    store.add_orphan(key, token, unreachable=in_doubt)
                    self.renewer.post(noop)
                raise
            if attempt < _AMBIGUITY_RETRIES:
                try:
                    yield (SLEEP, 0.05 * 2**attempt)
                except BaseException:
                    # Interrupted between tries, the outcome still in doubt.
                    store.add_orphan(key, token, unreachable=True)
                    self.renewer.post(noop)
                    raise
        store.add_orphan(key, token, unreachable=True)
        raise BackendError(
            f"lost the database connection while acquiring {key!r} and could not reach it "
            f"again to learn the outcome; the row, if it was written, will be deleted once "
            f"the database answers ({last})"
        ) from last

    # -- release -----------------------------------------------------------

    def release(self, held: HeldLock, *, force: bool = False) -> bool:
        entry = held._entry
        if (
            held._owner is _thread_owner()
            and entry.depth == 1
            and not entry.queue
            and not held._released
            and not held._fair
            and held._lost is None
            and not force
        ):
            # The common release (this thread's lock, held once, nobody of
            # this process waiting for the key): release_steps's own path,
            # without the step machinery (see _acquire_alone).
            ref = held._ref
            if not ref.live:
                raise LockLost(held.key, held._lost or "dblock released it meanwhile")
            # Claimed, and marked released, with no call in between nor
            # before the try: see _let_go.
            ref.live = False
            held._released = True
            entry.leaving = True
            entry.held = None
            owner = entry.owner
            try:
                self._let_go(held)
                deleted = self._rows.release(held.key, held.token)
            except BaseException as exc:
                return self._release_failed(held, exc)
            finally:
                try:
                    self._leave(entry, None, owner)
                except BaseException:
                    self._leave(entry, None, owner)  # cut off as it started: see _leave
                    raise
            if not deleted:
                raise LockLost(held.key, "its row was gone or held by another owner at release")
            return True
        return self.run(self.release_steps(held, force))

    def release_later(self, held: HeldLock) -> None:
        """Release ``held`` on the renewal thread, quietly: its holder asked
        for it but was interrupted before its turn came (a signal handler's
        exception or a task's cancellation while the locks of ``lock_many``
        went one by one). Without this they stayed until the holder ended,
        and were then reported as never released."""
        entry = held._entry
        if entry.depth > 1 and entry.held is held._ref:
            entry.depth -= 1
            return
        if not self._claim(held):
            return  # released already, by its holder or by dblock
        held._released = True
        entry.leaving = True  # its releaser's until passed on (see Registry)
        if self.telemetry is not None:
            self.telemetry.released(_monotonic() - held._acquired_mono)
        self.renewer.post(functools.partial(self._let_revoked_go, held))

    def _let_go(self, held: HeldLock) -> None:
        """The rest of a release's bookkeeping, once its caller has claimed
        ``held`` and marked it released, before its DELETE.

        The caller does that inline, as ``_claim`` does: test ``ref.live``,
        set it false, set ``held._released``, then ``entry.leaving`` and
        only then ``entry.held = None`` (leaving first: at no instant does
        the entry look stranded to a renewal pass, which would pass the key
        on while our DELETE is still to come). Those are attribute loads and
        stores with no call between them and the ``try`` whose ``finally``
        passes the key on: CPython switches threads and runs signal
        handlers only at calls, backward jumps and function starts, so of
        the holder, the renewal thread and ``close()`` exactly one claims
        the lock, and a signal handler's exception lands either before the
        claim (nothing changed: the lock is still held) or inside that
        ``try``. Before, the claim and the marks were a call of their own:
        an exception landing as it returned left the key being let go, in
        this process, for as long as the process lived."""
        self.renewer.untrack(held)
        if self.telemetry is not None:
            self.telemetry.released(_monotonic() - held._acquired_mono)

    def _release_failed(self, held: HeldLock, exc: BaseException, keep: float = 0.0) -> bool:
        """A release's DELETE raised ``exc``: False if the database failed
        (the row is left to be deleted later, or with ``keep`` to have its
        lease set as the release meant to: a job's ``at_least`` outlives an
        outage), else ``exc`` again."""
        kept = self._settle(held, keep)
        if isinstance(exc, BackendError):
            log.error(
                "dblock: releasing %r failed; the row stays until its lease ends, this "
                "manager reaches the database again, or the sweeper removes it: %s",
                held.key,
                exc,
            )
            # After a failover the next acquire deletes it at once, instead of
            # the key staying blocked for the rest of the lease.
            self.store.add_orphan(held.key, held.token, released=True, settle=kept)
            return False
        if not isinstance(exc, SchemaMissing):  # no table, no row to delete later
            # Interrupted with the DELETE perhaps not committed.
            self.store.add_orphan(held.key, held.token, released=True, settle=kept)
            self.renewer.post(noop)
        raise exc

    def _settle(self, held: HeldLock, keep: float = 0.0) -> Callable[[], Steps[bool]] | None:
        """How the orphan clean-up settles ``held``'s rows after a release
        that failed or was cut off: a job's release was to keep its row for
        at_least, and so is the clean-up; a fair holder's queue row goes with
        its head (MariaDB keeps it to the release); else the DELETE."""
        if keep:
            return partial(
                job_statements(self.store).keep_steps, held.key, held.token, keep, held.owner
            )
        if held._fair:
            return partial(fair_sql(self.store).leave_steps, held.key, held.token)
        return None

    def release_steps(  # noqa: PLR0912, PLR0915
        self, held: HeldLock, force: bool, *, keep: float = 0.0
    ) -> Op[bool]:
        """Release, written once for threads and tasks (see :meth:`acquire_steps`).
        ``keep`` (seconds, a job's ``at_least``): the row stays, its lease
        ending ``keep`` after it was acquired (database time), if that is
        still to come; it is never handed to a local waiter then."""
        if held._released:
            if held._revoked and held._lost is not None:
                raise LockLost(held.key, held._lost)
            raise LockNotHeld(f"lock {held.key!r} is not held (already released)")
        if not force and held._owner is not _thread_owner():
            # Not this thread's: perhaps this asyncio task's (the full check).
            self.check_owner(held)
        entry = held._entry
        if entry.depth > 1 and not force and entry.held is held._ref:
            entry.depth -= 1
            return True
        ref = held._ref
        if not ref.live:
            raise LockLost(held.key, held._lost or "dblock released it meanwhile")
        ref.live = False  # claimed and marked with no call before the try: see _let_go
        held._released = True
        entry.leaving = True
        entry.held = None
        owner = entry.owner
        waiter: Waiter | None = None
        grace: float | None = None
        try:
            self._let_go(held)
            if held._fair:
                if held._lost is None and fair_sql(self.store).seats_on_release:
                    waiter = self.registry.pop_waiter(entry)
                if waiter is not None:
                    return (yield from self._release_seating(held, waiter))
            elif (
                # A run is handoff_limit local grants: the row's own, then
                # handoff_limit - 1 hand-offs (entry.handoffs of them so far).
                entry.queue
                and entry.handoffs + 1 < self._handoff_limit
                and held._lost is None
                and not keep
            ):
                waiter = self.registry.pop_waiter(entry)
            if waiter is not None:
                return (yield from self._hand_off(entry, held, waiter))
            deleted, grace = yield from self._release_row(entry, held, keep)
        except BaseException as exc:
            if waiter is None and entry.heir is not None and not entry.heir.ready:
                waiter = entry.heir  # interrupted as pop_waiter returned it
            if waiter is None:
                return self._release_failed(held, exc, keep)
            if not waiter.ready:
                # Interrupted after the next local thread was made the key's
                # owner and before it was told: it acquires the row itself,
                # once ours is deleted.
                self.store.add_orphan(
                    held.key, held.token, released=True, settle=self._settle(held)
                )
                self.renewer.post(noop)
                waiter.wake(None)
            raise
        finally:
            if waiter is None:
                try:
                    self._leave(entry, grace, owner)
                except BaseException:
                    self._leave(entry, grace, owner)  # cut off as it started: see _leave
                    raise
        if held._lost is not None:
            raise LockLost(held.key, held._lost)
        if not deleted:
            raise LockLost(held.key, "its row was gone or held by another owner at release")
        return True

    def _release_row(
        self, entry: Entry, held: HeldLock, keep: float
    ) -> Op[tuple[bool, float | None]]:
        """The release's statement: (deleted, the give-way's grace if this
        ends a run of local grants: see _run_ended)."""
        run_ended = self._run_ended(entry, held, keep)
        if run_ended is None:  # nobody seen lately: ask (MySQL's waiter names)
            asking = self.store.others_wait_steps(held.key)
            try:
                run_ended = asking is not None and bool((yield (STEPS, asking)))
            except BackendError:
                # Only a hint (whether to give way): a killed connection or
                # an outage fails the release's own statement, if anything.
                run_ended = False
            if not run_ended:
                entry.handoffs = 0  # a new run: asked again at its end, not at every grant
        # A lost lock's row is deleted too if it is still ours (renewal
        # may have failed only because the database was unreachable).
        if held._fair:  # wakes the next waiter of the queue, and only it
            queued = held._ticket is not None  # others likely queue behind
            deleted = yield (
                STEPS,
                fair_sql(self.store).release_steps(held.key, held.token, queued=queued),
            )
            return deleted, None
        if keep:
            deleted = yield (
                STEPS,
                job_statements(self.store).keep_steps(held.key, held.token, keep, held.owner),
            )
            return deleted, None
        if entry.queue:  # local threads wait: others likely do too
            self.store.hot(held.key, run_ended)
        sent_at = _monotonic()
        deleted = yield (RELEASE, held.key, held.token)
        if run_ended and deleted:
            took = (_monotonic() - sent_at) * _GIVE_WAY_RTTS
            entry.handoffs = 0
            return deleted, min(max(took, _GIVE_WAY_MIN), _GIVE_WAY_MAX)
        return deleted, None

    def _run_ended(self, entry: Entry, held: HeldLock, keep: float) -> bool | None:
        """Whether a release ends a run of local grants while local threads
        still wait: the next gives way to other processes (see
        _GIVE_WAY_RTTS). Without hand-off (MySQL) a run ends so only when
        another process waits: the pause would be idle time otherwise.
        None: it would if another process waits, and none was seen lately."""
        limit = self._handoff_limit or self._run_limit
        # Local grants in the run so far: the row's own and its hand-offs, or
        # (without hand-off) each a row of its own, counted in _keep.
        run = entry.handoffs + 1 if self._handoff_limit else entry.handoffs
        if not limit or run < limit or not entry.queue or held._fair or keep:
            return False
        if self._handoff_limit or self.store.others_wait(held.key):
            return True
        return None

    def handed_on(self, held: HeldLock) -> None:
        """``held`` was taken by a task that ran nothing but the acquire and
        so ends at once (``asyncio.wait_for`` before Python 3.12,
        ``create_task``, ``gather``): the lock is the task's result, handed
        to whoever awaits it. That task's end does not abandon it (the
        renewal pass leaves it be); the first task or thread to use it
        (``release()``, ``owned()``) becomes its owner. Dropped unused, it
        is collected and released like any other."""
        task = held._owner
        placeholder = HandedOn(task)
        if not self._local or self.registry.adopt(held._entry, task, placeholder):
            held._owner = placeholder
            held._adopt = True

    def adopt(self, held: HeldLock) -> None:
        """The caller becomes the owner of a handed-on lock (see :meth:`handed_on`)."""
        old = held._owner
        if not held._adopt or not isinstance(old, HandedOn) or not old.returned():
            return  # the acquiring task has not even returned it yet
        me = current_owner()
        if held._released or not self._local or self.registry.adopt(held._entry, old, me):
            held._owner = me
        held._adopt = False

    @staticmethod
    def check_owner(held: HeldLock) -> None:
        """Refuse a release by anyone but the holder, as ``threading.RLock`` does.
        (A lock taken by a thread outside any task may be released by a task
        running on that same thread: the thread is the holder.)"""
        me = current_owner()
        if held._adopt:
            held._locker.adopt(held)
        if held._owner is not me and held._owner is not _thread_owner() and not held._released:
            raise LockNotHeld(
                f"lock {held.key!r} is held by {owner_name(held._owner)}, not by "
                f"{owner_name(me)}: only its holder may release it "
                "(release(force=True) hands the release over explicitly)"
            )

    def _claim(self, held: HeldLock) -> bool:
        """Take the job of releasing ``held``: True for exactly one of the
        holder, the renewal thread and ``close()`` (see _let_go)."""
        ref = held._ref
        if not ref.live:
            return False  # somebody else claimed it first
        ref.live = False  # (no call since the test: see _let_go)
        self.renewer.untrack(held)
        return True

    def _abandon(self, held: HeldLock, reason: str, *, closing: bool = False) -> None:
        """Release a lock whose holder cannot: its owner ended, or the manager
        closes. It is marked lost (``check()`` and ``release()`` raise
        :class:`LockLost`) and its ``on_lost`` is called."""
        if self._revoke(held, reason, closing):
            self._let_revoked_go(held)

    def _revoke(self, held: HeldLock, reason: str, closing: bool) -> bool:
        """The first half of :meth:`_abandon`, no SQL: take the job of
        releasing ``held`` and mark it lost. False if another has it."""
        if not self._claim(held):
            return False
        if closing:
            log.error("dblock: lock %r released and lost: %s", held.key, reason)
        else:
            log.warning("dblock: lock %r released: %s", held.key, reason)
        if held._lost is None:
            held._lost = reason
            self.renewer.notify_lost(held)
        held._revoked = True
        held._released = True
        return True

    def _let_revoked_go(self, held: HeldLock) -> None:
        """The second half of :meth:`_abandon`: delete the row, pass the key on."""
        entry = held._entry
        try:
            self.run(self._delete_row(held.key, held.token))
        finally:
            if entry.held is held._ref:
                entry.leaving = True  # (before held: see _let_go)
                entry.held = None
                self._leave(entry)

    def _take_back(
        self, entry: Entry, me: object, blocking: bool, timeout: float | None, start: float
    ) -> Op[Entry | None]:
        """The owner asks again for a key whose lock it dropped without
        release (collected; its release is posted to the renewal thread).
        Release it here and keep the key at level 1 (returned: level 2
        follows), or, if the renewal thread is releasing it already, wait
        until it has passed the key on (None: ask for it as anyone would).
        A waiting request gives up at its timeout there: that DELETE may
        wait for a row lock or an unreachable server. A fail-fast one waits
        for it as for a statement of its own (the key is nobody else's; its
        own INSERT would wait for the same row lock)."""
        key = entry.key
        ref: _Ref | None = entry.held
        if ref is not None and ref() is None and self._claim_collected(ref):
            entry.held = None
            entry.depth = 1
            entry.handoffs = 0
            yield from self._delete_row(key, ref.token)
            return entry
        # The renewal thread (or close()) is releasing it: a DELETE away, or
        # longer (a row lock, a server away): look again, less often.
        pause = 0.001
        while self.registry.get(key) is entry and entry.owner is me:
            ref = entry.held
            if ref is not None and ref() is not None:
                break  # (never: only we could have taken it again)
            if blocking and timeout is not None and _monotonic() - start >= timeout:
                raise LockTimeout(key, timeout=timeout, level=1)
            yield (SLEEP, pause)
            pause = min(pause * 2, 0.02)
        return None

    def _reap(self) -> None:
        """On the renewal thread: a key whose local owner can never run
        again (a task of a closed event loop, stopped while it acquired)
        and holds no row yet is passed on to the next local waiter, instead
        of keeping every thread and task of the process out for ever. (One
        that holds a row is the renewal pass's: released like a dead thread's.)"""
        if not self._local:
            return
        for entry in self.registry.stranded():
            owner = entry.owner
            evicted, waiter = self.registry.evict(entry, owner)
            if evicted:
                log.warning(
                    "dblock: lock %r passed on at level 1: %s",
                    entry.key,
                    owner_gone_reason(owner),
                )
                if waiter is not None:
                    waiter.wake(None)

    def _collected(self, ref: _Ref) -> None:
        """Weak-reference callback: a held lock nobody can reach any more.
        Runs wherever the last reference went (even inside a mutex), so it
        only warns and hands the release to the renewal thread."""
        if not ref.live or self.pid != os.getpid():
            # (A forked child's copy of its parent's lock: the parent's to release.)
            return
        try:
            warnings.warn(
                f"dblock: lock {ref.key!r} was never released; releasing it now",
                ResourceWarning,
                stacklevel=2,
            )
        finally:
            # No new thread at interpreter exit: the lease ends it then.
            with contextlib.suppress(RuntimeError):
                self.renewer.post(lambda: self._release_collected(ref))

    def _claim_collected(self, ref: _Ref) -> bool:
        """Take the job of releasing a collected lock: True for exactly one
        of the renewal thread, close() and the owner's next acquire of its
        key (one atomic pop, ``untrack``, decides)."""
        if not ref.live:
            return False
        ref.live = False  # (no call since the test: see _let_go)
        self.renewer.untrack_token(ref.token)
        log.warning("dblock: lock %r was never released by its holder; releasing it", ref.key)
        return True

    def _release_collected(self, ref: _Ref) -> None:
        if not self._claim_collected(ref):
            return
        entry = ref.entry
        try:
            self.run(self._delete_row(ref.key, ref.token))
        finally:
            if entry.held is ref:
                entry.leaving = True  # (before held: see _let_go)
                entry.held = None
                self._leave(entry)

    def extend(self, held: HeldLock, ttl: float) -> None:
        self.check_extend(held)
        sent_at = _monotonic()
        self.extended(held, self.store.renew([(held.key, held.token, ttl)]), sent_at)

    def check_extend(self, held: HeldLock) -> None:
        """Before ``extend()`` sends its statement (no SQL): the lock must be
        held and not known to be lost."""
        if held._released:
            self.release(held)  # raises the right error, without SQL
        if held._lost is not None:
            raise LockLost(held.key, held._lost)

    def extended(self, held: HeldLock, leases: Mapping[str, Lease], sent_at: float) -> None:
        """What the renew statement sent at ``sent_at`` answered for ``held``
        (written once for ``HeldLock.extend`` and the awaited one)."""
        lease = leases.get(held.token)
        if lease is None:
            self.renewer.lose(held, "its row was gone or held by another owner at extend()")
            raise LockLost(held.key, held._lost or "its row was gone or held by another owner")
        held._renewed(lease.expires_at, sent_at + lease.expires_in)

    def _release_seating(self, held: HeldLock, waiter: Waiter) -> Op[bool]:
        """Release a fair lock whose key the next local thread (``waiter``,
        already given level 1) waits for: one statement hands the row to the
        queue and, for a fair waiter, takes its place at the queue's tail (a
        :class:`Seat`); a plain waiter, or one this fails for, acquires by itself."""
        ticket: _Ticket = waiter.ticket
        sql = fair_sql(self.store)
        key, token = held.key, held.token
        seat_token = _urandom(16).hex() if ticket.seats else None
        seat: Seat | None = None
        sent_at = _monotonic()
        queued = held._ticket is not None
        try:
            if seat_token is None:
                deleted = yield (STEPS, sql.release_steps(key, token, queued=queued))
            else:
                deleted, lease = yield (
                    STEPS,
                    sql.release_seating_steps(
                        key, token, seat_token, ticket.owner, ticket.ttl, queued=queued
                    ),
                )
                if lease is not None:
                    seat = Seat(seat_token, lease.fence, lease, sent_at)
        except BackendError as exc:
            log.error(
                "dblock: releasing %r failed; the row stays until its lease ends, this "
                "manager reaches the database again, or the sweeper removes it: %s",
                key,
                exc,
            )
            self.store.add_orphan(key, token, released=True, settle=self._settle(held))
            if seat_token is not None:
                self.store.add_orphan(
                    key,
                    seat_token,
                    released=True,
                    settle=partial(fair_sql(self.store).leave_steps, key, seat_token),
                )
            return False
        except BaseException:
            self.store.add_orphan(key, token, settle=self._settle(held))
            if seat_token is not None:
                self.store.add_orphan(
                    key,
                    seat_token,
                    settle=partial(fair_sql(self.store).leave_steps, key, seat_token),
                )
            self.renewer.post(noop)
            raise
        finally:
            waiter.wake(seat)  # None: it queues by itself
        if held._lost is not None:
            raise LockLost(key, held._lost)
        if not deleted:
            raise LockLost(key, "its row was gone or held by another owner at release")
        return True

    def _hand_off(self, entry: Entry, held: HeldLock, waiter: Waiter) -> Op[bool]:
        """Give our row to the next local thread: without SQL while the row
        has fences in reserve, otherwise in one statement."""
        ticket: _Ticket = waiter.ticket
        sent_at = _monotonic()
        reserve = held._reserve
        if (
            reserve
            and ticket.ttl == held.ttl
            and ticket.options.renew
            and held._expires_mono - sent_at >= held.ttl * _RESERVE_LEASE
        ):
            # The row stays as it is (token, owner, lease: renewal keeps it);
            # the successor's fence was drawn while the row was ours, after
            # every fence it carried before, so fences still grow for this key.
            kept = Grant(
                reserve[0],
                held.expires_at,
                held._expires_mono - sent_at,
                reserve=reserve[1:],
            )
            return self._handed(entry, waiter, token=held.token, grant=kept, sent_at=sent_at)
        new_token = _urandom(16).hex()
        # Fences for the hand-offs that may follow in this run, drawn now (the
        # run's handoff_limit - 1 hand-offs, this one and those before it aside).
        extra = (
            max(self._handoff_limit - entry.handoffs - 2, 0) if self.store.reserves_fences else 0
        )
        grant: Grant | None = None
        try:
            grant = yield (
                TRANSFER,
                held.key,
                held.token,
                new_token,
                ticket.owner,
                ticket.ttl,
                extra,
            )
        except BackendError as exc:
            # The row may carry the new token or still ours: the waiter tries
            # with the new token, which settles it either way.
            # If the row still carries our token, the waiter's next attempt
            # deletes it (once the database answers) rather than wait out the lease.
            self.store.add_orphan(held.key, held.token, released=True)
            waiter.wake(new_token)
            log.error(
                "dblock: handing %r to the next thread failed; the row stays until its "
                "lease ends, this manager reaches the database again, or the sweeper "
                "removes it: %s",
                held.key,
                exc,
            )
            return False
        except BaseException:
            # Interrupted with the UPDATE perhaps committed: as above, the
            # waiter's attempt with the new token settles it; if it was not,
            # our row goes as soon as the database answers (not at its lease's end).
            self.store.add_orphan(held.key, held.token, released=True)
            self.renewer.post(noop)
            waiter.wake(new_token)
            raise
        if grant is None:
            waiter.wake(None)  # it acquires the row itself
            raise LockLost(held.key, "its row was gone or held by another owner at release")
        try:
            return self._handed(entry, waiter, token=new_token, grant=grant, sent_at=sent_at)
        except BaseException:
            if not waiter.ready:  # interrupted: the row carries the new token
                waiter.wake(new_token)
            raise

    def _handed(
        self, entry: Entry, waiter: Waiter, *, token: str, grant: Grant, sent_at: float
    ) -> bool:
        """The hand-off happened: ``waiter`` holds the row with ``grant``."""
        ticket: _Ticket = waiter.ticket
        successor = HeldLock(
            self,
            entry,
            token=token,
            owner=ticket.owner,
            ttl=ticket.ttl,
            grant=grant,
            sent_at=sent_at,
            options=ticket.options,
            live=False,
        )
        # Not live until delivered: one a signal handler's exception strands
        # here is never released when collected (its row is the waiter's,
        # woken with its token instead: see _hand_off).
        ref = successor._ref
        entry.held = ref
        entry.handoffs += 1
        try:
            if self.telemetry is not None:
                self.telemetry.handoff()
            self.renewer.track(successor)
            ref.tracked = True
            ref.live = True
            waiter.wake(successor)
        except BaseException:
            if not waiter.ready:
                ref.live = False
                self.renewer.untrack(successor)
                entry.held = None
            raise
        return True

    def _leave(self, entry: Entry, grace: float | None = None, owner: object = None) -> None:
        """Pass level 1 on (the next thread acquires the row itself, after
        ``grace`` seconds if given: see _GiveWay) or forget the key.

        ``owner``: who held the key when the caller decided to leave it,
        read by the caller before its ``try``. With it, a second call is a
        no-op once the first has passed the key on or forgotten it, so a
        caller whose call was cut off as this method *started* (a signal
        handler's exception at a frame's first instruction, before any
        ``try`` here can catch it) calls it once more from its ``except``::

            try:
                self._leave(entry, grace, owner)
            except BaseException:
                self._leave(entry, grace, owner)
                raise

        Without that the key stayed being let go, in this process, for as
        long as the process lived."""
        if not self._local:
            return
        grant = None if grace is None else _GiveWay(grace)
        if owner is None:
            owner = entry.owner
        try:
            waiter = self.registry.leave(entry, owner)
            if waiter is not None:
                waiter.wake(grant)
        except BaseException:
            # A signal handler's exception cut this short: finish it, or the
            # key stays ours for as long as the process lives, or the thread
            # it was passed to sleeps until its timeout (for ever by default).
            self._finish_leave(entry, grant, owner)
            raise

    def _finish_leave(self, entry: Entry, grant: _GiveWay | None, owner: object) -> None:
        """What :meth:`_leave` left undone when it was cut off: the key not
        passed on yet, or passed on to a thread not woken yet."""
        waiter = self.registry.leave(entry, owner)  # (nothing if passed on already)
        if waiter is not None:
            waiter.wake(grant)
        elif entry.heir is not None and not entry.heir.ready:
            entry.heir.wake(grant)


def _thrown_in(steps: Op[T], exc: BaseException) -> Any:
    """``exc`` came out of resuming ``steps``: raised by them (they are done),
    or a signal handler's, landing as they yielded their next step. That one
    is thrown in at that step, as if the step had raised it: else the steps
    stayed suspended, their clean-up for an interrupted statement (a waiter
    to wake, a row to delete) waiting for the garbage collector."""
    while getattr(steps, "gi_frame", None) is not None:  # suspended at a yield: not done
        try:
            return steps.throw(exc)
        except StopIteration:
            raise
        except BaseException as again:
            exc = again
    try:
        raise exc
    finally:
        del exc  # (the traceback holds this frame: no cycle keeping the locks alive)


def release_at_close(
    locks: Sequence[Any], release: Callable[[Any], object], seconds: float
) -> None:
    """Run ``release`` for each of ``locks`` (already marked lost) on a
    thread of its own, and wait for it at most ``seconds``: a server that
    stopped answering (frozen, a stalled disk, a black-holed network) must
    not keep ``close()`` for ever. The releases left go on by themselves and
    end when it answers again; the rows meanwhile are left to their leases.
    A failure is logged once per lock, never raised past the clean-up."""

    def release_all() -> None:
        for held in locks:
            try:
                release(held)
            except Exception as exc:
                log.warning(
                    "dblock: lock %r could not be released at close; its row stays "
                    "until its lease ends or the sweeper removes it: %s",
                    held.key,
                    exc,
                )

    worker = threading.Thread(target=release_all, name="dblock-close", daemon=True)
    try:
        _threads.start(worker)
    except RuntimeError:  # at interpreter exit: no new thread
        release_all()
        return
    worker.join(seconds)
    if worker.is_alive():
        log.error(
            "dblock: the database did not answer close()'s releases of %d lock(s) "
            "within %g s; close() returns, the releases finish when it answers, "
            "and until then the rows are left to their leases",
            len(locks),
            seconds,
        )


#: What a lock released at interpreter exit is marked lost with (and how
#: release_at_exit knows the locks it claimed).
_AT_EXIT = "released at interpreter exit"


def _release_op(key: str, token: str) -> Op[bool]:
    deleted: bool = yield (RELEASE, key, token)
    return deleted


def _runs_at_exit(owner: object, me: threading.Thread) -> bool:
    """At interpreter exit: can ``owner`` still run? Only a thread other
    than the exiting one that has not ended (a daemon thread), or a task of
    a loop running on such a thread."""
    if isinstance(owner, ThreadOwner):
        return owner.alive() and owner.thread is not me
    if not owner_alive(owner):
        return False
    get_loop = getattr(owner, "get_loop", None)
    return get_loop is not None and get_loop().is_running()
