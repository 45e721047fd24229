"""The fair queue: ``locks.lock(key, fair=True)``.

Waiters of a key, across processes, are granted in the order they arrived,
and each is woken only when its turn may have come, as in ZooKeeper's lock
recipe (every waiter watches only its predecessor; no herd).

Level 1 is unchanged: the threads (and tasks) of one process queue for the key
first come, first served, and only the one that passed level 1 goes to the
database. So the database sees at most one request per process per key: the
process's holder (the head row) or its first local waiter (one queue row).
A fair lock is never handed on locally (that is the default mode's cohorting,
which lets one process keep the key for ``handoff_limit`` grants): a release
goes back to the database queue, and the next local thread joins its tail.
Processes therefore take turns, one grant each per round, and threads take
turns inside each process: every request waits about (its place in the
local queue) x (processes in the queue) grants, whatever the timing of its
arrival, which is what keeps the tail of the wait close to its median.

Level 2 (statements in :mod:`dblock._store.fair`):

1. *Enter*: one statement takes the head if it is free and nobody queues
   (the uncontended case: one round trip on PostgreSQL and SQLite as for the
   exclusive lock), else adds our queue row, whose ticket comes from the fence
   counter: the database's own order of arrival.
2. *Wait*: on PostgreSQL for the notification addressed to us (a release
   hands the head to the first live waiter and names it, with the new fence,
   in its payload; the process's one listener wakes only that waiter, which
   then holds the lock without a statement; the same release queues its
   process's next local thread, which so starts waiting without a statement
   either), elsewhere by polling our position with backoff;
   always at the latest when the lease of whoever we wait behind (the holder,
   or our predecessor in the queue) runs out, so a crashed holder or waiter
   is skipped after its lease, and after a third of our own lease, to renew
   our queue row (a dead queue row is never revived: its waiter joins again
   at the tail).
3. *Turn*: one statement (a few on SQLite and MySQL) takes the head if our
   row is live, no live row precedes it and the head is free, and deletes
   our queue row; else it renews our row and says whom we wait behind.

Interrupted, timed out or cancelled while queued: the request's one
``try`` deletes its queue row (and, with it, a head the database may have
granted in the same instant: both carry its token), waking the next waiter
if ours was first. A statement cut off in flight leaves the token to the
orphan clean-up, which deletes every row carrying it once the database answers.

Fair and plain requests for one key share level 1 (one local FIFO queue) and
the head row, so they never overlap; a plain request from another process
ignores the queue (it takes a free head at once: it barges), as documented.
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial
from typing import TYPE_CHECKING

from .._store.base import (
    Backoff,
    Grant,
    Holder,
    Interrupted,
    PoolerMismatch,
    Steps,
    never_sent,
    what_failed,
)
from .._store.fair import DROPPED, Queued, Seat, address, fair_sql, poll_cap
from ..errors import BackendError, LockBusy, LockTimeout, ManagerClosed
from ..lock import HeldLock, Locker, LockOptions
from ..renewal import RENEW_AT
from ..steps import (
    CLEAN_UP,
    EXPIRY_MARGIN,
    OUTAGE_INITIAL,
    OUTAGE_MAX,
    Op,
    Run,
    Sleep,
    Wait,
    noop,
)

if TYPE_CHECKING:
    from ..registry import Entry
    from ..telemetry import Watch

__all__ = ["queued_loop"]

log = logging.getLogger("dblock")
_monotonic = time.monotonic


def queued_loop(
    locker: Locker,
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
    seat: Seat | None = None,
) -> Op[HeldLock]:
    """Level 2 of a fair request (``Locker.acquire_steps`` calls it in place
    of the exclusive lock's loop, inside its own clean-up)."""
    request = _FairRequest(
        locker,
        entry,
        blocking=blocking,
        timeout=timeout,
        ttl=ttl,
        start=start,
        opts=opts,
        owner=owner,
        token=token,
    )
    request.watch = watch
    if seat is not None:  # our predecessor's release queued us: no statement yet
        request.seat = seat
        request.token, request.ticket = seat.token, seat.ticket
        request.lease, request.lease_sent = seat.lease, seat.sent_at
    return (yield from request.run())


class _FairRequest:
    """One fair request at level 2: its place in the queue and how it got
    there. :meth:`run` is the loop, and its one ``except`` owns the clean-up
    (whatever was interrupted where, it reads the state kept here); each
    other method is one step of it."""

    __slots__ = (
        "blocking",
        "deadline",
        "entry",
        "handed",
        "in_flight",
        "lease",
        "lease_sent",
        "locker",
        "opts",
        "outage",
        "owner",
        "seat",
        "sql",
        "store",
        "ticket",
        "timeout",
        "token",
        "ttl",
        "waiting",
        "watch",
    )

    def __init__(
        self,
        locker: Locker,
        entry: Entry,
        *,
        blocking: bool,
        timeout: float | None,
        ttl: float,
        start: float,
        opts: LockOptions,
        owner: str,
        token: str | None,
    ) -> None:
        self.locker = locker
        self.store = locker.store
        self.sql = fair_sql(self.store)
        self.entry = entry
        self.blocking = blocking
        self.timeout = timeout
        self.ttl = ttl
        self.opts = opts
        self.owner = owner
        self.handed = token  # a token a failed local hand-off may have written
        self.token = token or os.urandom(16).hex()
        self.deadline = None if timeout is None else start + timeout
        self.ticket: int | None = None  # our place in the queue, once we have one
        # Our queue row's lease, as last renewed (PostgreSQL), and when.
        self.lease: Grant | None = None
        self.lease_sent = 0.0
        self.seat: Seat | None = None
        self.outage: Backoff | None = None
        self.waiting = False
        self.in_flight = False
        self.watch: Watch | None = None

    def run(self) -> Op[HeldLock]:
        store, key = self.store, self.entry.key
        request = store.executor.request
        request.deadline = self.deadline
        try:
            while True:
                if self.locker._closing:
                    raise ManagerClosed(f"the LockManager was closed while waiting for {key!r}")
                if store.has_orphans:
                    yield CLEAN_UP
                sent_at = _monotonic()
                try:
                    self.in_flight = True
                    result, sent_at = yield from self._ask(sent_at)
                    self.in_flight = False
                except BackendError as exc:
                    self.in_flight = False
                    yield from self._retry_after(exc)
                    continue
                self.outage = None
                if isinstance(result, Grant):
                    # Granted, not yet a handle: cut off here (a signal handler's
                    # exception as the handle's frame starts), our rows are an
                    # orphan's, as mid-statement.
                    self.in_flight = True
                    granted = self._held(result, sent_at)
                    self.in_flight = False
                    return granted
                if result is DROPPED:
                    self._queue_again()
                    continue
                assert isinstance(result, (Holder, Queued))
                held = yield from self._wait(result, sent_at)
                if held is not None:
                    return held
        except BaseException as exc:
            if self.in_flight and not never_sent(exc):
                # Cut off mid-statement (an interruption, a cancellation): our
                # rows may or may not exist; the renewal thread deletes them.
                store.add_orphan(key, self.token, settle=self._settle())
                self.locker.renewer.post(noop)
            elif self.ticket is not None:
                yield from self._withdraw()
            raise
        finally:
            request.deadline = None

    def _settle(self) -> partial[Steps[bool]]:
        """How the orphan clean-up deletes the rows of our token as it is now
        (bound here: the request goes on with a fresh one)."""
        return partial(self.sql.leave_steps, self.entry.key, self.token)

    def _withdraw(self) -> Op[None]:
        """Leave the queue as if we had never joined it (best effort, like a
        release): delete our rows and wake the next waiter if we were the first."""
        store, key = self.store, self.entry.key
        try:
            yield Run(self.sql.leave_steps(key, self.token))
        except BackendError as exc:
            log.error(
                "dblock: leaving the fair queue of %r failed; our queue row stays until its "
                "lease ends or the sweeper removes it: %s",
                key,
                exc,
            )
            store.add_orphan(key, self.token, released=True, settle=self._settle())
        except BaseException:
            store.add_orphan(key, self.token, settle=self._settle())
            self.locker.renewer.post(noop)
            raise

    def _ask(self, sent_at: float) -> Op[tuple[object, float]]:
        """One look at the queue: join it, or see whether our turn came
        (none when our predecessor's release already queued us)."""
        key, token, owner, ttl = self.entry.key, self.token, self.owner, self.ttl
        seat = self.seat
        if seat is not None:
            self.seat = None
            return Queued(seat.ticket, None, None, seat.lease), seat.sent_at
        if self.ticket is None:
            enqueue = self.blocking and (self.deadline is None or self.deadline > sent_at)
            result = yield Run(self.sql.enter_steps(key, token, owner, ttl, enqueue=enqueue))
        else:
            result = yield Run(self.sql.turn_steps(key, token, self.ticket, owner, ttl))
        return result, sent_at

    def _retry_after(self, exc: BackendError) -> Op[None]:
        """A statement failed: give up (raise) or join again after a pause."""
        store, key = self.store, self.entry.key
        if self.ticket is not None or isinstance(exc, Interrupted) or self.handed:
            # Rows carrying our token may exist (our queue row, or a head
            # granted as the connection broke): delete them once the
            # database answers, and go on with a fresh token.
            lost = isinstance(exc, Interrupted)
            store.add_orphan(
                key, self.token, released=not lost, unreachable=lost, settle=self._settle()
            )
        limit = self._left()
        if limit <= 0 or not (self.waiting or self.handed) or isinstance(exc, PoolerMismatch):
            raise exc
        log.warning(
            "dblock: waiting for %r in its fair queue; %s, retrying (the request "
            "joins the queue again): %s",
            key,
            what_failed(exc),
            exc,
        )
        self.outage = self.outage or Backoff(OUTAGE_INITIAL, OUTAGE_MAX)
        yield Sleep(self.outage.step(limit))
        self.token, self.ticket, self.handed, self.lease = os.urandom(16).hex(), None, None, None

    def _queue_again(self) -> None:
        """Paused past our queue row's lease (or it was swept): join again at
        the tail, with a fresh token; the dead row goes."""
        key = self.entry.key
        log.warning("dblock: the queue row of %r ran out while waiting; queueing again", key)
        self.store.add_orphan(key, self.token, released=True, settle=self._settle())
        self.token, self.ticket, self.lease = os.urandom(16).hex(), None, None

    def _left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - _monotonic()

    def _held(self, grant: Grant, sent_at: float) -> HeldLock:
        held = HeldLock(
            self.locker,
            self.entry,
            token=self.token,
            owner=self.owner,
            ttl=self.ttl,
            grant=grant,
            sent_at=sent_at,
            options=self.opts,
        )
        held.state.fair = True
        held.state.ticket = self.ticket
        return held

    def _now_waiting(self) -> None:
        if not self.waiting:
            self.waiting = True
            if self.watch is not None:
                self.watch.waiting(2)

    def _wait(self, result: Holder | Queued, sent_at: float) -> Op[HeldLock | None]:
        """Not our turn: refused (fail-fast, no time left), or wait until it
        may have come; the lock if the release handed it to us (PostgreSQL)."""
        key, store = self.entry.key, self.store
        if isinstance(result, Holder):  # not queued: fail-fast, or no time left
            if not self.blocking:
                raise LockBusy(key, level=2, holder=result.owner)
            limit = self._left()
            if limit <= 0:
                raise LockTimeout(key, timeout=self.timeout or 0.0, level=2, holder=result.owner)
            # Time left, yet not queued: SQLite's file write lock was taken
            # by another connection (nothing written). Wait as the exclusive
            # lock does for such a holder, then enter again.
            self._now_waiting()
            yield Wait(key, limit, sent_at)
            return None
        ticket = self.ticket = result.ticket
        if result.lease is not None:
            self.lease, self.lease_sent = result.lease, sent_at
        limit = self._left()
        if limit <= 0:
            raise LockTimeout(key, timeout=self.timeout or 0.0, level=2, holder=result.owner)
        if result.expires_in is not None:
            limit = min(limit, max(result.expires_in, 0.0) + EXPIRY_MARGIN)
        # Look again (and so renew our queue row) well before it runs out.
        limit = min(limit, self.ttl * RENEW_AT)
        if not store.can_notify:
            # Polling: look again soon enough to notice moving up.
            config = store.config
            limit = min(limit, poll_cap(result, config.poll_initial, config.poll_max))
        self._now_waiting()
        # Polling dialects poll afresh (from poll_initial) when whom we
        # wait behind changes: the first waiter must notice a release soon.
        blocker = None if store.can_notify else (result.owner, result.first)
        yield Wait(key, limit, sent_at, address(ticket), blocker)
        fence = self.sql.handed(address(ticket))
        if fence is None or self.lease is None:
            return None
        # The holder's release handed us the head with our queue row's
        # lease, which we renewed last at lease_sent.
        lease = self.lease
        return self._held(Grant(fence, lease.expires_at, lease.expires_in), self.lease_sent)


# Its waiters may be queued in the database by their predecessor's release.
queued_loop.seats = True  # type: ignore[attr-defined]
