"""The lock itself: level 1 (the registry) then level 2 (the row).

:class:`Locker` holds the two public loops, acquire and release, in the
manner of redis-py's ``Lock``: they validate, queue locally, retry and wait;
each talk with the database is one call on the store that runs one statement.

Holders. A lock belongs to its owner (a thread or an asyncio task, see
:mod:`dblock.registry`) for as long as that owner runs and keeps a reference
to it. Only the user holds a :class:`HeldLock` strongly; the registry and the
renewer hold weak references (:class:`LockRef`), so a lock dropped without
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
gives way to them for a few round trips before it tries the row (GiveWay).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import weakref
from collections.abc import Callable

from ._alone import Alone
from ._drive import BlockingDriver, BlockingOps
from ._handoff import HandOff
from ._held import HeldLock, LockOptions, LockRef, release_on_exit
from ._lifecycle import Lifecycle, release_at_close
from ._lockbase import (
    Claimed,
    Custody,
    GiveWay,
    Level2,
    LockerBase,
    Ticket,
)
from ._store import Store
from ._store.batch import Batcher, batches
from ._store.fair import Seat, fair_sql
from .config import UNSET, Config, Unset
from .errors import (
    BackendError,
    LockBusy,
    LockLost,
    LockNotHeld,
    ManagerClosed,
    SchemaMissing,
)
from .kinds.exclusive import RowLoop
from .registry import (
    CLOSED,
    Entry,
    Registry,
    Waiter,
    current_owner,
    owner_alive,
    thread_owner,
)
from .renewal import RENEW_AT, Renewer
from .steps import (
    Op,
    Settle,
    Sleep,
    Turn,
    noop,
)
from .telemetry import GRANTED, Recorder, Watch, outcome_of, recorder_for

__all__ = [
    "UNSET",
    "HeldLock",
    "Level2",
    "LockOptions",
    "LockRef",
    "Locker",
    "Unset",
    "live_lockers",
    "release_at_close",
    "release_on_exit",
]

log = logging.getLogger("dblock")

_monotonic = time.monotonic
_thread_owner = thread_owner


#: Every locker of this process (held weakly): interpreter exit releases
#: what their holders left (see :meth:`Locker.release_at_exit`), also for a
#: manager that was itself dropped while its renewal thread still had
#: collected locks to release.
all_lockers: weakref.WeakSet[Locker] = weakref.WeakSet()


def live_lockers() -> list[Locker]:
    return list(all_lockers)


class Locker(Alone, RowLoop, HandOff, Lifecycle, BlockingDriver, LockerBase):
    """Acquire and release, over one registry and one store: level 1 (the
    key's entry, a queue of local waiters) then level 2 (the row, through
    the kind's acquire loop). Its other parts are modules of their own (see
    :mod:`dblock._lockbase`)."""

    def __init__(self, store: Store, config: Config) -> None:
        self.store = store
        self.config = config
        self.registry = Registry()
        self.local = config.local_filter
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
        self.rows: Batcher | Store = self.batcher or store
        #: What each step does on this face (see dblock._driver).
        self.ops = BlockingOps(self)
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
        self.collect: Callable[[LockRef], None] = self._collected
        # What release_at_exit claimed, and the tokens whose release it posted.
        self._exit_candidates: list[HeldLock] = []
        self._exit_posted: set[str] = set()
        all_lockers.add(self)

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
        entry, held = self.enter(key, me, blocking)
        if held is not None:
            return held
        if entry is None and level2 is None and self.local:
            return self._acquire_alone(key, me, blocking, timeout, ttl, opts)
        return self.run(
            self.acquire_steps(
                key, me, blocking=blocking, timeout=timeout, ttl=ttl, opts=opts,
                waiter_type=Waiter, level2=level2, seen=entry,
            )
        )  # fmt: skip

    def owns(self, key: str) -> bool:
        """Whether the calling thread or task holds ``key`` (see :meth:`HeldLock.owned`)."""
        entry = self.registry.get(key)
        ref: LockRef | None = None if entry is None else entry.held
        held = None if ref is None else ref()
        return held is not None and held.owned()

    def enter(self, key: str, me: object, blocking: bool) -> tuple[Entry | None, HeldLock | None]:
        """What a request does first on both faces, without SQL: refuse a key
        this process uses as another kind of lock (``kind_guard``), then look
        at level 1: the key's entry if someone of this process holds or waits
        for it (else None), and our own lock again if we hold it (re-entrant;
        see :meth:`reenter`, which also refuses a fail-fast request)."""
        if self.kind_guard is not None:
            self.kind_guard(key)
        if not self.local:
            return None, None
        entry = self.registry.get(key)
        if entry is None:
            return None, None
        return entry, self.reenter(entry, me, blocking)

    def reenter(self, entry: Entry, me: object, blocking: bool) -> HeldLock | None:
        """Level 1 alone, for a key someone of this process holds or waits
        for: our own lock again (re-entrant, no SQL), or a fail-fast refusal
        (no SQL); None when the request must queue."""
        if entry.owner is me:
            ref: LockRef | None = entry.held
            held = None if ref is None else ref()
            if held is not None:
                if held.state.lost is not None:
                    raise LockLost(entry.key, held.state.lost)
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
        moment is in its :class:`Custody`; the one ``except`` below gives
        back exactly that. ``level2`` replaces the row's acquire loop (the
        fair queue's, :func:`dblock.kinds.fair.queued_loop`). ``claimed``:
        what :meth:`_acquire_alone` did before it handed the request on (the
        key claimed at level 1, the token and owner, when the first try was
        sent and what it answered or raised)."""
        start = _monotonic() if start is None else start
        c = Custody()
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
        c: Custody,
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
        if self.local:
            # (``seen``: the caller's own look-up of the key, not made twice.)
            mine = self.registry.get(key) if seen is UNSET else seen
            if mine is not None and mine.owner is me:
                c.entry = yield from self._take_back(mine, me, blocking, timeout, start)
                if c.entry is not None:
                    return  # ours at level 1 already: on to level 2
        if not self.local:
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
        grant = yield Turn(got, timeout)
        if grant is CLOSED:
            c.waiter = None
            raise ManagerClosed(f"the LockManager was closed while waiting for {key!r}")
        if isinstance(grant, HeldLock):
            c.held, c.waiter = grant, None  # the previous holder handed us the row
            return
        c.entry, c.waiter = got.entry, None
        c.token = grant if isinstance(grant, str) else None
        c.seat = grant if isinstance(grant, Seat) else None
        if isinstance(grant, GiveWay):
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
        ticket = Ticket(self.owner_label(me), ttl, opts, seats)
        return self.registry.join(key, me, ticket, waiter_type), ticket.owner

    @staticmethod
    def _give_way(grant: GiveWay, start: float, timeout: float | None) -> Op[None]:
        """The run of hand-offs ended: another process's waiter gets the
        chance to take the row first (the key is ours at level 1 already)."""
        pause = grant.grace
        if timeout is not None:
            pause = min(pause, start + timeout - _monotonic())
        if pause > 0:
            yield Sleep(pause)

    def _undo(self, key: str, me: object, c: Custody) -> Op[None]:
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
        if not self.local:
            return
        left = self.registry.left_behind(key, me)
        if isinstance(left, Entry):
            self._leave(left, None, me)
        elif left is not None:
            yield from self._withdraw(left)

    def _withdraw(self, waiter: Waiter) -> Op[None]:
        """Leave the queue of a key as if we had never joined it: if the key
        was handed to us meanwhile, pass it on (or release the row)."""
        entry = waiter.entry
        if self.registry.abandon(entry.key, waiter):
            return
        yield Settle(waiter)  # an interruption now changes nothing: we are raising already
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
        held.state.released = True
        entry = held.state.entry
        owner = entry.owner
        if entry.held is held.state:
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

    # -- release -----------------------------------------------------------

    def release(self, held: HeldLock, *, force: bool = False) -> bool:
        entry = held.state.entry
        if (
            held.state.holder is _thread_owner()
            and entry.depth == 1
            and not entry.queue
            and not held.state.released
            and not held.state.fair
            and held.state.lost is None
            and not force
        ):
            # The common release (this thread's lock, held once, nobody of
            # this process waiting for the key): release_steps's own path,
            # without the step machinery (see _acquire_alone).
            ref = held.state
            if not ref.live:
                raise LockLost(held.key, held.state.lost or "dblock released it meanwhile")
            # Claimed, and marked released, with no call in between nor
            # before the try: see _let_go.
            ref.live = False
            held.state.released = True
            entry.leaving = True
            entry.held = None
            owner = entry.owner
            try:
                self._let_go(held)
                deleted = self.rows.release(held.key, held.token)
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

    def _let_go(self, held: HeldLock) -> None:
        """The rest of a release's bookkeeping, once its caller has claimed
        ``held`` and marked it released, before its DELETE.

        The caller does that inline, as ``_claim`` does: test ``ref.live``,
        set it false, set ``held.state.released``, then ``entry.leaving`` and
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
            self.telemetry.released(_monotonic() - held.state.acquired_mono)

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

    def release_steps(  # noqa: PLR0912, PLR0915
        self, held: HeldLock, force: bool, *, keep: float = 0.0
    ) -> Op[bool]:
        """Release, written once for threads and tasks (see :meth:`acquire_steps`).
        ``keep`` (seconds, a job's ``at_least``): the row stays, its lease
        ending ``keep`` after it was acquired (database time), if that is
        still to come; it is never handed to a local waiter then."""
        if held.state.released:
            if held.state.revoked and held.state.lost is not None:
                raise LockLost(held.key, held.state.lost)
            raise LockNotHeld(f"lock {held.key!r} is not held (already released)")
        if not force and held.state.holder is not _thread_owner():
            # Not this thread's: perhaps this asyncio task's (the full check).
            self.check_owner(held)
        entry = held.state.entry
        if entry.depth > 1 and not force and entry.held is held.state:
            entry.depth -= 1
            return True
        ref = held.state
        if not ref.live:
            raise LockLost(held.key, held.state.lost or "dblock released it meanwhile")
        ref.live = False  # claimed and marked with no call before the try: see _let_go
        held.state.released = True
        entry.leaving = True
        entry.held = None
        owner = entry.owner
        waiter: Waiter | None = None
        grace: float | None = None
        try:
            self._let_go(held)
            if held.state.fair:
                if held.state.lost is None and fair_sql(self.store).seats_on_release:
                    waiter = self.registry.pop_waiter(entry)
                if waiter is not None:
                    return (yield from self._release_seating(held, waiter))
            elif (
                # A run is handoff_limit local grants: the row's own, then
                # handoff_limit - 1 hand-offs (entry.handoffs of them so far).
                entry.queue
                and entry.handoffs + 1 < self._handoff_limit
                and held.state.lost is None
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
        if held.state.lost is not None:
            raise LockLost(held.key, held.state.lost)
        if not deleted:
            raise LockLost(held.key, "its row was gone or held by another owner at release")
        return True
