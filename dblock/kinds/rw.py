"""The read-write lock: ``locks.read_lock(key)`` and ``locks.write_lock(key)``.

Two levels, as for the exclusive lock:

Level 1 (this process). One :class:`_Entry` per key in use. Readers of a
key share ONE database-level hold: the first local reader takes it, later
ones join it locally (no SQL), the last one releases it. A local writer
queues behind the holders; once a writer queues, new local readers queue
behind it (writer preference), and a read hold is shared locally at most
``handoff_limit`` times before new readers wait for it to drain, so a
writer of another process (whose intent the database-level grant respects)
is not starved by a stream of overlapping readers here. Re-entrant per
owner (thread or asyncio task); a writer may read its own key (and keeps
the read when it releases the write: a downgrade, done in one statement);
a reader asking to write is refused (:class:`~dblock.UpgradeRefused`)
instead of deadlocking.

Level 2 (the database): see :mod:`dblock._store.rw`. The head row decides
every grant in one statement.

Every local holder has its own :class:`RwHeld` (a :class:`~dblock.HeldLock`:
fence, expires_at, lost, extend(), release()), tracked by a renewal thread of
its own; holders sharing one database hold are renewed by one statement.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import warnings
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, cast

from .._signals import wait
from .._store import Backoff, Lease, Store
from .._store.base import Interrupted, PoolerMismatch, never_sent, what_failed
from .._store.rw import READ, WRITE, RwRow, RwStatements, rw_statements
from ..config import Config
from ..errors import (
    BackendError,
    KindMismatch,
    LockBusy,
    LockLost,
    LockNotAcquired,
    LockNotHeld,
    LockTimeout,
    ManagerClosed,
    UpgradeRefused,
)
from ..lock import HeldLock, Locker, LockOptions, LockRef, release_at_close
from ..registry import current_owner, owner_name, thread_owner
from ..renewal import RENEW_AT, Renewer
from ..steps import refuse_on_event_loop

if TYPE_CHECKING:
    from .._store import Grant

__all__ = ["RwHeld", "RwLocker"]

log = logging.getLogger("dblock")
_monotonic = time.monotonic

# Wake this long after the holder's lease ends, so the takeover finds it expired.
EXPIRY_MARGIN = 0.002
# A waiting writer renews its intent row when this fraction of its lease has passed.
_INTENT_RENEW = 1 / 3
# A waiting request that loses the database retries after 50 ms, doubling up to 1 s.
OUTAGE_INITIAL = 0.05
OUTAGE_MAX = 1.0
#: A turn at level 1 that must first look for writers of other processes.
_CHECK: Any = object()
_TOKEN_LEN = 32


class _Hold:
    """One database-level grant of this process: a read phase joined (or
    started), or a write hold. ``token`` is the head row's token (the read
    phase's epoch, or the writer's). ``expires_mono`` is the end of its lease
    by this process's clock, counted from before the statement was sent."""

    __slots__ = ("expires_at", "expires_mono", "fence", "lost", "mode", "token")

    def __init__(
        self, mode: str, token: str, fence: int, expires_at: datetime, expires_mono: float
    ) -> None:
        self.mode = mode
        self.token = token
        self.fence = fence
        self.expires_at = expires_at
        self.expires_mono = expires_mono
        self.lost: str | None = None


class _Who:
    """What HeldLock reads from a registry entry (the key and the owner),
    and what it takes to release a handle nobody can reach any more (its
    weak reference keeps this, see RwLocker._collected): the key's entry,
    the mode and the hold."""

    __slots__ = ("entry", "hold", "key", "mode", "owner")

    def __init__(self, entry: _Entry, owner: object, mode: str, hold: _Hold) -> None:
        self.key = entry.key
        self.owner = owner
        self.entry = entry
        self.mode = mode
        self.hold = hold


def _refs(entry: _Entry) -> list[LockRef]:
    """The handles of ``entry``'s holders (weak references)."""
    refs = list(entry.readers.values())
    if entry.writer is not None:
        refs.append(entry.writer)
    return refs


class _Request:
    __slots__ = ("led", "mode", "owner")

    def __init__(self, mode: str, owner: object) -> None:
        self.mode = mode
        self.owner = owner
        # The entry, once this request was made its lead (see _wait_turn).
        self.led: _Entry | None = None


class _Entry:
    """Level 1 for one key: who holds it here, and who waits."""

    __slots__ = ("busy", "draining", "hold", "joins", "key", "queue", "readers", "writer")

    def __init__(self, key: str) -> None:
        self.key = key
        # Each holder's handle, weakly (its LockRef): a handle dropped without
        # release is collected and released, as an exclusive lock's is.
        self.readers: dict[object, LockRef] = {}
        self.writer: LockRef | None = None
        self.hold: _Hold | None = None
        # A statement on the hold is under way (acquire, release, downgrade):
        # nobody else may start one or join meanwhile.
        self.busy = False
        self.queue: list[_Request] = []
        # Local shares of the read hold since it was taken or last checked, and
        # whether it is draining (a writer of another process waits).
        self.joins = 0
        self.draining = False

    @property
    def empty(self) -> bool:
        return not self.readers and self.writer is None and not self.busy and not self.queue


class RwHeld(HeldLock):
    """A read or write lock held by one owner (``mode`` says which)."""

    __slots__ = ("_depth", "_hold", "_rw", "mode")

    _locker: Any

    def __init__(
        self,
        rw: RwLocker,
        entry: _Entry,
        owner: object,
        hold: _Hold,
        *,
        mode: str,
        label: str,
        ttl: float,
        options: LockOptions,
    ) -> None:
        rw._serial += 1
        now = _monotonic()
        super().__init__(
            cast(Locker, rw),
            cast(Any, _Who(entry, owner, mode, hold)),
            token=f"{hold.token}:{rw._serial}",
            owner=label,
            ttl=ttl,
            grant=cast("Grant", _GrantView(hold, now)),
            sent_at=now,
            options=options,
        )
        self.mode = mode
        self._hold = hold
        self._rw = entry
        self._depth = 1

    def _renewed(self, expires_at: datetime, expires_mono: float) -> None:
        super()._renewed(expires_at, expires_mono)
        hold = self._hold
        if expires_mono > hold.expires_mono:  # local holders joining later start from it
            hold.expires_at, hold.expires_mono = expires_at, expires_mono

    def _mark_lost(self, reason: str) -> bool:
        if not super()._mark_lost(reason):
            return False
        # Nobody of this process joins a hold one of its holders lost.
        self._hold.lost = self._hold.lost or reason
        return True

    def __repr__(self) -> str:
        state = "released" if self.state.released else f"expires_at={self.expires_at.isoformat()}"
        return f"<RwHeld {self.mode} {self.key!r} fence={self.fence} {state}>"


class _GrantView:
    """A hold seen as a store Grant (what HeldLock is built from)."""

    __slots__ = ("expires_at", "expires_in", "fence")
    reserve: tuple[int, ...] = ()  # a hold hands nothing on from a fence reserve

    def __init__(self, hold: _Hold, now: float) -> None:
        self.fence = hold.fence
        self.expires_at = hold.expires_at
        self.expires_in = hold.expires_mono - now


class _Renewals:
    """The store face the renewal thread sees: renews the head rows of the
    holds behind the handles it is given (one row per hold, however many
    local holders share it)."""

    def __init__(self, store: Store, statements: RwStatements) -> None:
        self._store = store
        self._statements = statements

    @property
    def has_orphans(self) -> bool:
        return self._store.has_orphans

    def clean_orphans(self) -> None:
        self._store.clean_orphans()

    def renew(self, locks: Sequence[tuple[str, str, float]]) -> dict[str, Lease]:
        rows: dict[tuple[str, str], float] = {}
        for key, token, ttl in locks:
            row = (key, token[:_TOKEN_LEN])
            rows[row] = max(rows.get(row, 0.0), ttl)
        leases = self._statements.renew([(k, t, ttl) for (k, t), ttl in rows.items()])
        out: dict[str, Lease] = {}
        for _, token, _ in locks:
            lease = leases.get(token[:_TOKEN_LEN])
            if lease is not None:
                out[token] = lease
        return out


class RwLocker:
    """Read-write locks over one store; made by the manager on first use."""

    def __init__(self, store: Store, config: Config, locker: Locker) -> None:
        self.store = store
        self.config = config
        self._locker = locker
        self.statements = rw_statements(store)
        self.defaults = locker.defaults
        self._entries: dict[str, _Entry] = {}
        # An RLock: a wait cut off by a signal handler can tell whether it
        # still holds it (dblock._signals.wait).
        self._mutex = threading.RLock()
        self._changed = threading.Condition(self._mutex)
        self._join_limit = max(config.handoff_limit, 1)
        self._serial = 0
        self._closing = False
        self.renewer = Renewer(
            cast(Store, _Renewals(store, self.statements)),
            idle_tick=config.ttl * RENEW_AT,
            abandon=self._abandon,
            collected=self._release_collected,
        )
        # Renewals (and how late they run) reported as the exclusive locks' are.
        self.renewer.telemetry = locker.telemetry
        self.collect = self._collected  # the callback HeldLock's weak reference takes

    # -- what HeldLock asks of its locker ------------------------------------

    def extend(self, held: HeldLock, ttl: float) -> None:
        assert isinstance(held, RwHeld)
        if held.state.released:
            raise LockNotHeld(f"lock {held.key!r} is not held (already released)")
        if held.state.lost is not None:
            raise LockLost(held.key, held.state.lost)
        sent_at = _monotonic()
        token = held._hold.token
        lease = self.statements.renew([(held.key, token, ttl)]).get(token)
        if lease is None:
            self.renewer.lose(held, "its row was gone or held by another owner at extend()")
            raise LockLost(held.key, held.state.lost or "its row was gone or held by another owner")
        held._renewed(lease.expires_at, sent_at + lease.expires_in)

    # -- acquire -------------------------------------------------------------

    def acquire(
        self,
        key: str,
        mode: str,
        *,
        blocking: bool,
        timeout: float | None,
        ttl: float,
        options: LockOptions | None = None,
    ) -> RwHeld:
        opts = options or self.defaults
        me = current_owner()
        deadline = None if timeout is None else _monotonic() + timeout
        # Set with no call before the try that undoes them: this request
        # leads (the entry is busy), and the hold it was granted (see
        # _acquire_row: a call's result can be lost as the call returns).
        entry: _Entry | None = None
        request: _Request | None = None
        got: list[_Hold] = []
        done: list[Any] = [False, None]  # _lead_done ran; the holder it made
        label = ""
        try:
            with self._mutex:
                if self._closing:
                    raise ManagerClosed("this LockManager is closed")
                found = self._entries.get(key)
                if found is None:
                    # Nobody here holds or wants the key: straight to the database.
                    if self._locker.registry.get(key) is not None:
                        raise KindMismatch(
                            key, requested="rw", existing="exclusive", where="in this process"
                        )
                    found = self._entries[key] = _Entry(key)
                else:
                    mine = self._reenter(found, me, mode, ttl, opts)
                    if mine is not None:
                        return mine
                    request = _Request(mode, me)
                    lead = self._queue(found, request, blocking, deadline, timeout)
                    if not lead:  # shared the read hold of this process
                        assert found.hold is not None
                        label = self._locker.owner_label(me)
                        return self._new_holder(found, me, found.hold, READ, label, ttl, opts)
                found.busy = True
                entry = found
            # Level 2: this request alone talks to the database for this key.
            label = self._locker.owner_label(me)
            self._acquire_row(key, mode, label, blocking, deadline, timeout, ttl, got)
        finally:
            if entry is None and request is not None:
                entry = request.led  # (made lead, cut off as _queue returned)
            if entry is not None:
                try:
                    self._lead_done(entry, me, mode, label, ttl, opts, got, done)
                except BaseException:
                    self._lead_done(entry, me, mode, label, ttl, opts, got, done)  # see there
                    raise
        held: RwHeld | None = done[1]
        if held is None:  # (never: no hold means _acquire_row raised)
            raise LockNotAcquired(f"lock {key!r} not acquired", key=key, level=2)
        return held

    def _lead_done(  # noqa: PLR0917 - private: the lead's state
        self,
        entry: _Entry,
        me: object,
        mode: str,
        label: str,
        ttl: float,
        opts: LockOptions,
        got: list[_Hold],
        done: list[Any],
    ) -> None:
        """The lead's request has its answer (``got``: the hold, if granted):
        the entry is idle again, and the hold becomes ``me``'s (``done[1]``).
        Called from a ``finally``, and once more if a signal handler's
        exception cut that call off: ``done[0]`` makes the repeat finish
        what the first left, never do it twice."""
        with self._mutex:
            if done[0]:
                hold = got[0] if got else None
                unheld = not any(r() is not None for r in _refs(entry))
                if hold is not None and done[1] is None and entry.hold is hold and unheld:
                    # Cut off before the holder existed: give the row back.
                    entry.hold = None
                    self._forget(entry)
                    self._orphan_hold(entry.key, mode, hold)
                self._changed.notify_all()
                return
            done[0] = True
            entry.busy = False
            if got:
                hold = got[0]
                entry.hold = hold
                entry.joins = 0
                entry.draining = False
                done[1] = self._new_holder(entry, me, hold, mode, label, ttl, opts)
            else:
                self._forget(entry)
            if entry.queue:
                self._changed.notify_all()

    def _orphan_hold(self, key: str, mode: str, hold: _Hold) -> None:
        """Give back a granted hold nobody took (the renewal thread sends it)."""
        if mode == WRITE:
            self.store.add_orphan(key, hold.token)
        else:
            settle = functools.partial(self.statements.release_read_steps, key, hold.token)
            self.store.add_orphan(key, hold.token, settle=settle)
        self.renewer.post(noop)

    def _reenter(
        self, entry: _Entry, me: object, mode: str, ttl: float, opts: LockOptions
    ) -> RwHeld | None:
        """Under the mutex: what ``me`` already holds answers at once."""
        # (A handle collected and not released yet counts as nobody's here:
        # its release is on its way, and this request waits for it.)
        writer = None if entry.writer is None else cast("RwHeld | None", entry.writer())
        if mode == READ:
            ref = entry.readers.get(me)
            mine = None if ref is None else cast("RwHeld | None", ref())
            if mine is not None:
                if mine.state.lost is not None:
                    raise LockLost(entry.key, mine.state.lost)
                mine._depth += 1
                return mine
            if writer is not None and writer.state.holder is me:
                # A writer reads its own key: no SQL (the write hold covers it).
                label = self._locker.owner_label(me)
                return self._new_holder(entry, me, writer._hold, READ, label, ttl, opts)
            return None
        if writer is not None and writer.state.holder is me:
            if writer.state.lost is not None:
                raise LockLost(entry.key, writer.state.lost)
            writer._depth += 1
            return writer
        if me in entry.readers:
            raise UpgradeRefused(
                f"{owner_name(me)} holds a read lock on {entry.key!r} and asked for its write "
                "lock: an upgrade could deadlock (two readers upgrading wait for each other), "
                "so it is refused; release the read lock first, or take the write lock from "
                "the start (a writer may take the read lock of its own key)"
            )
        return None

    def _queue(
        self,
        entry: _Entry,
        request: _Request,
        blocking: bool,
        deadline: float | None,
        timeout: float | None,
    ) -> bool:
        """Under the mutex: queue behind this process's holders and earlier
        requests; True to lead (talk to the database; ``request.led`` is then
        the entry, marked busy), False to share the read hold."""
        try:
            entry.queue.append(request)  # (in the try: a handler's exception may land after it)
            while True:
                turn = self._wait_turn(entry, request, blocking, deadline, timeout)
                if turn is not _CHECK:
                    return bool(turn)
                self._check_writers(entry)
        except BaseException:
            if request in entry.queue:
                entry.queue.remove(request)
            self._changed.notify_all()
            self._forget(entry)
            raise

    def _check_writers(self, entry: _Entry) -> None:
        """Under the mutex, which it lets go meanwhile: the read hold of this
        process was shared ``handoff_limit`` times; if a writer of another
        process waits for the key, let the hold drain (new local readers wait
        for it to be released and taken again at the database, where the
        writer's intent holds them back); else share on."""
        entry.busy = True
        waiting = True
        self._mutex.release()
        try:
            waiting = self.store.drive(self.statements.writer_waiting_steps(entry.key))
        except BackendError as exc:
            log.warning("dblock: could not look for writers waiting on %r: %s", entry.key, exc)
        finally:
            self._mutex.acquire()
            entry.busy = False
        if waiting:
            entry.draining = True
        else:
            entry.joins = 0
        self._changed.notify_all()

    def _wait_turn(
        self,
        entry: _Entry,
        request: _Request,
        blocking: bool,
        deadline: float | None,
        timeout: float | None,
    ) -> object:
        """Under the mutex: wait until ``request`` may share this process's read
        hold (False), talk to the database itself (True: the entry is busy,
        and ``request.led`` is the entry, set with no call between, so the
        caller's ``finally`` undoes it however it is cut off), or must first
        look for writers of other processes (:data:`_CHECK`)."""
        waited = False
        while True:
            if self._closing:
                raise ManagerClosed(f"the LockManager was closed while waiting for {entry.key!r}")
            turn = self._turn(entry, request)
            if turn is _CHECK:
                return turn
            if turn is not None:
                if turn is True:
                    entry.busy = True
                    request.led = entry
                entry.queue.remove(request)
                if turn is False:
                    entry.joins += 1
                return turn
            if not blocking:
                raise LockBusy(entry.key, level=1)
            left = None if deadline is None else deadline - _monotonic()
            if left is not None and left <= 0:
                raise LockTimeout(entry.key, timeout=timeout or 0.0, level=1)
            if not waited and left != 0:
                refuse_on_event_loop(entry.key)
                waited = True
            wait(self._changed, self._mutex, left)

    def _turn(self, entry: _Entry, request: _Request) -> object:
        """True: lead (talk to the database); False: share the read hold;
        :data:`_CHECK`: look for writers elsewhere first; None: wait."""
        if entry.busy or entry.writer is not None:
            return None
        at = entry.queue.index(request)
        hold = entry.hold
        if request.mode == WRITE:
            return True if at == 0 and not entry.readers and hold is None else None
        if any(r.mode == WRITE for r in entry.queue[:at]):
            return None  # a writer queued first: no overtaking
        if hold is None:
            return True
        if hold.mode != READ or hold.lost is not None or entry.draining:
            return None
        return False if entry.joins < self._join_limit else _CHECK

    def _new_holder(  # noqa: PLR0917 - private, called in three places
        self,
        entry: _Entry,
        me: object,
        hold: _Hold,
        mode: str,
        label: str,
        ttl: float,
        opts: LockOptions,
    ) -> RwHeld:
        held = RwHeld(
            self,
            entry,
            me,
            hold,
            mode=mode,
            label=label,
            ttl=ttl,
            options=opts,
        )
        if mode == READ:
            entry.readers[me] = held.state
        else:
            entry.writer = held.state
        self.renewer.track(held)
        held.state.tracked = True
        return held

    def _acquire_row(  # noqa: PLR0912, PLR0915, PLR0917 - one loop, so one `finally` owns the clean-up
        self,
        key: str,
        mode: str,
        owner: str,
        blocking: bool,
        deadline: float | None,
        timeout: float | None,
        ttl: float,
        got: list[_Hold],
    ) -> None:
        """Level 2: grant statements until granted (or refused, or out of
        time): the hold is put in ``got`` (a call's result can be lost to a
        signal handler's exception as the call returns; what is in ``got``
        the caller owns). A waiting writer keeps an intent row, so new
        readers hold back."""
        store, statements = self.store, self.statements
        token = intent = os.urandom(16).hex()
        wait = None
        intent_at: float | None = None
        outage: Backoff | None = None
        # A read grant's outcome is unknown (interrupted, or an answer the
        # driver could not decode): it may have committed. Read the head row
        # before granting again, or a second run would count us twice.
        unsure = False
        # Refused once, we wait: an outage from then on is ridden out (the
        # waiter may not exist yet if the intent's answer was what got cut).
        waiting = False
        try:
            while True:
                if self._closing:
                    raise ManagerClosed(f"the LockManager was closed while waiting for {key!r}")
                if wait is not None:
                    wait.prepare()
                sent_at = _monotonic()
                try:
                    row = None
                    if unsure:
                        row = _own_read_phase(store.drive(statements.holder_steps(key)), token)
                        unsure = False
                    if row is None:
                        row = store.drive(statements.grant_steps(mode, key, token, owner, ttl))
                    if row is not None and row.granted:
                        epoch = token if mode == WRITE else row.token
                        expires_mono = sent_at + row.expires_in
                        got.append(_Hold(mode, epoch, row.fence, row.expires_at, expires_mono))
                        return
                except BackendError as exc:
                    if store.lost_contention(exc):
                        row = None  # an InnoDB deadlock victim: contention, try again
                    elif mode == READ and _unsure_read(exc, unsure, deadline):
                        unsure = True
                        continue
                    else:
                        if mode == WRITE and isinstance(exc, Interrupted):
                            self._orphan(key, token, unreachable=True)
                            token = os.urandom(16).hex()  # that one may be in the row now
                        outage = outage or Backoff(OUTAGE_INITIAL, OUTAGE_MAX)
                        self._ride_out(key, exc, deadline, outage, waiting=waiting)
                        continue
                except BaseException as exc:
                    if got:
                        raise  # granted, and the caller has the hold
                    if mode == WRITE and not never_sent(exc):
                        self._orphan(key, token)
                    elif mode == READ and not never_sent(exc):
                        # A read phase this grant began carries its token
                        # (the epoch): ended by the renewal thread at once.
                        # One it only joined cannot be told from one it did
                        # not join (counts carry no names): that share ends
                        # with the phase's lease.
                        store.add_orphan(
                            key,
                            token,
                            settle=functools.partial(statements.release_read_steps, key, token),
                        )
                        self.renewer.post(noop)
                    raise
                outage = None
                limit = self._refused(key, row, blocking, deadline, timeout)
                waiting = True
                if mode == WRITE:  # our intent row, renewed before it runs out
                    limit = min(limit, ttl * _INTENT_RENEW)
                    if intent_at is None or _monotonic() - intent_at > ttl * _INTENT_RENEW:
                        intent_at = _monotonic()
                        outage = self._write_intent(key, intent, owner, ttl, deadline, outage)
                        if outage is not None:  # written again next time
                            intent_at = float("-inf")
                            continue
                if wait is None:
                    refuse_on_event_loop(key)
                    wait = store.waiter(key, sent_at)
                wait.sleep(limit)
        finally:
            if wait is not None:
                wait.close()
            if intent_at is not None:
                self._drop_intent(key, intent)

    def _write_intent(  # noqa: PLR0917 - the wait loop's state, passed on
        self,
        key: str,
        intent: str,
        owner: str,
        ttl: float,
        deadline: float | None,
        outage: Backoff | None,
    ) -> Backoff | None:
        """A waiting writer's intent row (new readers hold back), written or
        renewed: None, or the outage it met. Written or not, the writer waits:
        the failure is ridden out as a grant statement's outage. (Seen in a
        full run: the connection cut as the intent's answer was on its way,
        the writer failed.)"""
        try:
            self.store.drive(self.statements.intent_steps(key, intent, owner, ttl))
        except BackendError as exc:
            outage = outage or Backoff(OUTAGE_INITIAL, OUTAGE_MAX)
            self._ride_out(key, exc, deadline, outage, waiting=True)
            return outage
        return None

    def _drop_intent(self, key: str, intent: str) -> None:
        try:
            self.store.drive(self.statements.drop_intent_steps(key, intent))
        except BackendError as exc:
            log.warning("dblock: could not drop the write intent on %r: %s", key, exc)

    @staticmethod
    def _refused(
        key: str, row: RwRow | None, blocking: bool, deadline: float | None, timeout: float | None
    ) -> float:
        """A grant statement did not grant: raise (a row of another kind,
        fail-fast, no time left), or return how long to wait before the
        next (at most until the holder's lease ends)."""
        if row is not None and row.kind != "rw":
            raise KindMismatch(key, requested="rw", existing=row.kind, where="in the table")
        holder = None if row is None else row.owner
        if not blocking:
            raise LockBusy(key, level=2, holder=holder)
        limit = float("inf") if deadline is None else deadline - _monotonic()
        if limit <= 0:
            raise LockTimeout(key, timeout=timeout or 0.0, level=2, holder=holder)
        if row is not None:
            limit = min(limit, max(row.expires_in, 0.0) + EXPIRY_MARGIN)
        return limit

    @staticmethod
    def _ride_out(
        key: str, exc: BackendError, deadline: float | None, outage: Backoff, *, waiting: bool
    ) -> None:
        """A waiting request that lost the database (a restart, a failover)
        waits and tries again until its own deadline, then raises what it saw;
        one that was not waiting yet (a wrong URL, a dead server) raises at once.
        A read grant whose outcome stayed unknown is looked up (the head row)
        before granting again (see :func:`_own_read_phase`)."""
        limit = float("inf") if deadline is None else deadline - _monotonic()
        if limit <= 0 or not waiting or isinstance(exc, PoolerMismatch):
            raise exc
        log.warning("dblock: waiting for %r; %s, retrying: %s", key, what_failed(exc), exc)
        time.sleep(outage.step(limit))

    def _orphan(self, key: str, token: str, *, unreachable: bool = False) -> None:
        """A write grant that may have committed unseen: its row (slot '', our
        token) is deleted as soon as the database answers, by the renewal thread."""
        self.store.add_orphan(key, token, unreachable=unreachable)
        self.renewer.post(noop)

    # -- release -------------------------------------------------------------

    def release(self, held: HeldLock, *, force: bool = False) -> bool:
        assert isinstance(held, RwHeld)
        if held.state.released:
            if held.state.revoked and held.state.lost is not None:
                raise LockLost(held.key, held.state.lost)
            raise LockNotHeld(f"lock {held.key!r} is not held (already released)")
        if not force and held.state.holder is not thread_owner():
            self._locker.check_owner(held)
        with self._mutex:
            if held.state.released:
                raise LockNotHeld(f"lock {held.key!r} is not held (already released)")
            if held._depth > 1 and not force:
                held._depth -= 1
                return True
        return self._let_go(held, None)

    def _let_go(self, held: RwHeld, revoked: str | None) -> bool:
        """Release every level of ``held``."""
        return self._let_go_ref(held.state, held, revoked)

    def _let_go_ref(self, ref: LockRef, held: RwHeld | None, revoked: str | None) -> bool:
        """Release every level of the handle ``ref`` refers to (``held``, or
        None once it was collected): False if it was released already.

        A signal handler's exception can land after any call here (the
        mutex's release included): once the handle is claimed, whatever cut
        this off, level 1 lets the key go and the statement is sent (on the
        renewal thread) and the entry made idle again; before, the key
        stayed busy, or listed as held, in this process for good."""
        who: _Who = ref.entry  # type: ignore[assignment]
        entry, hold = who.entry, who.hold
        claimed = False
        progress = [0]  # 1: _send_release's first line ran (it finishes the entry)
        statement: str | None = None
        try:
            with self._mutex:
                if not ref.live or (held is not None and held.state.released):
                    return False
                ref.live = False
                if held is not None:
                    held.state.released = True
                claimed = True
                try:
                    statement = self._leave(entry, who, ref)
                except BaseException:
                    statement = self._leave(entry, who, ref)  # once more: it repeats, no more
                    raise
                self.renewer.untrack_token(ref.token)
                if revoked is not None and held is not None:
                    held.state.revoked = True
                    if held.state.lost is None:
                        held.state.lost = revoked
                        self.renewer.notify_lost(held)
            if statement is None:
                return True if held is None else self._outcome(held, True)
            ok = self._send_release(entry, who.key, hold, statement, progress)
        except BaseException:
            if claimed and not progress[0]:
                self.renewer.untrack_token(ref.token)
                if statement is not None:
                    self.renewer.post(
                        functools.partial(self._send_release, entry, who.key, hold, statement, [0])
                    )
            raise
        if held is None:
            return ok
        if not ok and held.state.lost is None:
            held.state.lost = "its row was gone or held by another owner at release"
        return self._outcome(held, True)

    def _collected(self, ref: object) -> None:
        """Weak-reference callback: a handle nobody can reach any more, not
        released. Runs wherever the last reference went (even inside a
        mutex), so it only warns and hands the release to the renewal thread
        (whose pass also finds it, should this be cut off)."""
        assert isinstance(ref, LockRef)
        if not ref.live or self._locker.pid != os.getpid():
            return  # (a forked child's copy of its parent's lock)
        try:
            warnings.warn(
                f"dblock: lock {ref.key!r} was never released; releasing it now",
                ResourceWarning,
                stacklevel=2,
            )
        finally:
            with contextlib.suppress(RuntimeError):  # (no new thread at interpreter exit)
                self.renewer.post(functools.partial(self._release_collected, ref))

    def _release_collected(self, ref: LockRef) -> None:
        if ref.live:
            log.warning("dblock: lock %r was never released by its holder; releasing it", ref.key)
            self._let_go_ref(ref, None, None)

    def _send_release(
        self, entry: _Entry, key: str, hold: _Hold, statement: str, progress: list[int]
    ) -> bool:
        """Send the statement a release's hold needs; the entry is idle again
        after it, whatever happened. ``progress`` is marked first thing (no
        call before the ``try``): a caller cut off as this frame started
        finds it unmarked and has the renewal thread do it all instead; and
        :meth:`_finish` marks it done, so that its clean-up may repeat it."""
        progress[0] = 1
        statements, drive = self.statements, self.store.drive
        sends = self.store.executor.sends  # (no call before the try: see above)
        ok = statement != "downgrade"  # (what a failure leaves the hold: see _finish)
        try:
            try:
                if statement == "release_read":
                    ok = drive(statements.release_read_steps(key, hold.token))
                elif statement == "release_write":
                    ok = drive(statements.release_write_steps(key, hold.token))
                else:
                    ok = drive(statements.downgrade_steps(key, hold.token))
            except BackendError as exc:
                log.error(
                    "dblock: releasing %r failed; the row stays until its lease ends or the "
                    "sweeper removes it: %s",
                    key,
                    exc,
                )
                if statement == "release_write":
                    # Deleted (if still ours) as soon as the database answers again.
                    self.store.add_orphan(key, hold.token, released=True)
                return False  # (the entry is finished below)
            except BaseException as exc:
                if statement == "release_write":
                    # Cut off with the statement perhaps not committed.
                    self.store.add_orphan(key, hold.token, released=True)
                    self.renewer.post(noop)
                elif statement == "release_read" and (
                    never_sent(exc) or self.store.executor.sends == sends
                ):
                    # Cut off before the statement left (waiting for a
                    # connection): no share was dropped, so the renewal
                    # thread drops it. One that was sent may have dropped
                    # it (read counts carry no names): left to the lease.
                    self.renewer.post(
                        functools.partial(_drop_share, self.store, statements, key, hold.token)
                    )
                raise
        finally:
            try:
                self._finish(entry, hold, statement, ok, progress)
            except BaseException:
                self._finish(entry, hold, statement, ok, progress)  # cut off as it started
                raise
        return ok

    @staticmethod
    def _leave(entry: _Entry, who: _Who, ref: LockRef) -> str | None:
        """Under the mutex: take the handle ``ref`` out of level 1; the
        statement its database hold needs now, if any (and the entry is busy
        until it ran). Called twice for one handle (a clean-up repeating a
        step that may or may not have run), it answers the same."""
        me = who.owner
        if who.mode == READ:
            if entry.readers.get(me) is ref:
                del entry.readers[me]
            if entry.writer is not None or entry.readers:
                return None  # the hold is still someone else's here
            statement = "release_read"
        else:
            if entry.writer is ref:
                entry.writer = None
            statement = "downgrade" if me in entry.readers else "release_write"
        entry.busy = True
        if statement != "downgrade":
            entry.hold = None
            entry.draining = False
        return statement

    def _finish(
        self, entry: _Entry, hold: _Hold, statement: str, ok: bool, progress: list[int]
    ) -> None:
        """The entry is idle again after a release's statement. Done once
        (``progress``); a repeat only wakes the waiters again, which a cut
        off first call may not have done."""
        lost_readers: list[RwHeld] = []
        with self._mutex:
            if progress[0] == 2:
                self._forget(entry)
                self._changed.notify_all()
                return
            progress[0] = 2
            entry.busy = False
            if statement == "downgrade":
                hold.mode = READ
                entry.hold = hold
                entry.joins = 1
                if not ok:
                    hold.lost = "its row was gone or held by another owner at downgrade"
                    found = (ref() for ref in entry.readers.values())
                    lost_readers = [cast(RwHeld, r) for r in found if r is not None]
            self._forget(entry)
            self._changed.notify_all()
        for reader in lost_readers:
            self.renewer.lose(reader, hold.lost or "lost")

    @staticmethod
    def _outcome(held: RwHeld, ok: bool) -> bool:
        if held.state.lost is not None and not held.state.revoked:
            raise LockLost(held.key, held.state.lost)
        return ok

    def _forget(self, entry: _Entry) -> None:
        """Under the mutex: drop the key's entry once nobody holds or wants it."""
        if entry.empty and self._entries.get(entry.key) is entry:
            del self._entries[entry.key]

    def _abandon(self, held: HeldLock, reason: str) -> None:
        """The renewal thread found the owner gone (or the manager closes)."""
        assert isinstance(held, RwHeld)
        log.warning("dblock: lock %r released: %s", held.key, reason)
        self._let_go(held, reason)

    # -- life cycle ----------------------------------------------------------

    def close(self, timeout: float) -> None:
        with self._mutex:
            self._closing = True
            self._changed.notify_all()
        deadline = _monotonic() + timeout
        while self.renewer.tracked and _monotonic() < deadline:
            time.sleep(min(0.02, max(deadline - _monotonic(), 0.0)))
        reason = "the LockManager was closed while it was held"
        held_locks = [h for h in self.renewer.held_locks() if isinstance(h, RwHeld)]
        for held in held_locks:
            # Every one is lost before any SQL (see Locker.close).
            log.error("dblock: lock %r released and lost: the LockManager was closed", held.key)
            with self._mutex:
                if not held.state.released and held.state.lost is None:
                    held.state.lost = reason
                    self.renewer.notify_lost(held)
        try:
            if held_locks:
                release_at_close(
                    held_locks, lambda held: self._let_go(held, reason), Locker.CLOSE_RELEASES
                )
        finally:
            self.renewer.close()

    def after_fork(self) -> None:
        self._entries = {}
        self._mutex = threading.RLock()
        self._changed = threading.Condition(self._mutex)
        self.renewer.after_fork()


def _unsure_read(exc: BackendError, unsure: bool, deadline: float | None) -> bool:
    """A read grant interrupted (its outcome unknown), not already being
    looked up, with time left: look up the head row before granting again."""
    return (
        isinstance(exc, Interrupted)
        and not unsure
        and (deadline is None or _monotonic() < deadline)
    )


def _own_read_phase(head: RwRow | None, token: str) -> RwRow | None:
    """``head`` as a read grant if it is the live read phase our read grant
    with ``token`` started (an epoch is the token of the grant that began the
    phase, and ours is unique); None otherwise. A read grant whose outcome
    was unknown and that only joined another reader's phase cannot be told
    from one that did not run: its count, if it was counted, is a crashed
    reader's, ended with the read phase's lease."""
    if (
        head is None
        or head.kind != "rw"
        or head.mode != READ
        or head.token != token
        or head.holders <= 0
        or head.expires_in <= 0
    ):
        return None
    head.granted = True
    return head


def noop() -> None:
    """A job that only wakes the renewal thread (which cleans orphans on its pass)."""


def _drop_share(store: Store, statements: RwStatements, key: str, epoch: str) -> None:
    """On the renewal thread: a read release whose statement never left."""
    try:
        store.drive(statements.release_read_steps(key, epoch))
    except BackendError as exc:
        log.error(
            "dblock: releasing %r failed; the row stays until its lease ends or the "
            "sweeper removes it: %s",
            key,
            exc,
        )
