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
from typing import TYPE_CHECKING

from .._store.base import (
    Backoff,
    Grant,
    Holder,
    Interrupted,
    PoolerMismatch,
    never_sent,
    what_failed,
)
from .._store.fair import DROPPED, Queued, Seat, address, poll_cap
from ..errors import BackendError, LockBusy, LockTimeout, ManagerClosed
from ..lock import (
    _CLEAN_OP,
    _EXPIRY_MARGIN,
    _OUTAGE_INITIAL,
    _OUTAGE_MAX,
    _SLEEP,
    _STEPS,
    _WAIT,
    HeldLock,
    Locker,
    LockOptions,
    Op,
    _noop,
)
from ..renewal import RENEW_AT

if TYPE_CHECKING:
    from ..registry import Entry
    from ..telemetry import Watch

__all__ = ["queued_loop"]

log = logging.getLogger("dblock")
_monotonic = time.monotonic


def queued_loop(  # noqa: PLR0912, PLR0915 - one function, so one `except` owns the clean-up
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
    store = locker.store
    sql = store.fair_sql()
    key = entry.key
    handed = token  # a token a failed local hand-off may have written
    token = token or os.urandom(16).hex()
    deadline = None if timeout is None else start + timeout
    request = store.executor.request
    request.deadline = deadline
    ticket: int | None = None  # our place in the queue, once we have one
    lease: Grant | None = None  # our queue row's lease, as last renewed (PostgreSQL)
    lease_sent = 0.0
    if seat is not None:  # our predecessor's release queued us: no statement yet
        token, ticket, lease, lease_sent = seat.token, seat.ticket, seat.lease, seat.sent_at
    outage: Backoff | None = None
    waiting = False
    in_flight = False
    try:
        while True:
            if locker._closing:
                raise ManagerClosed(f"the LockManager was closed while waiting for {key!r}")
            if store.has_orphans:
                yield _CLEAN_OP
            sent_at = _monotonic()
            try:
                in_flight = True
                if seat is not None:
                    result: object = Queued(seat.ticket, None, None, seat.lease)
                    sent_at, seat = seat.sent_at, None
                elif ticket is None:
                    enqueue = blocking and (deadline is None or deadline > sent_at)
                    result = yield (
                        _STEPS,
                        sql.enter_steps(key, token, owner, ttl, enqueue=enqueue),
                    )
                else:
                    result = yield (_STEPS, sql.turn_steps(key, token, ticket, owner, ttl))
                in_flight = False
            except BackendError as exc:
                in_flight = False
                if ticket is not None or isinstance(exc, Interrupted) or handed:
                    # Rows carrying our token may exist (our queue row, or a
                    # head granted as the connection broke): delete them once
                    # the database answers, and go on with a fresh token.
                    lost = isinstance(exc, Interrupted)
                    store.add_orphan(key, token, released=not lost, whole=True, unreachable=lost)
                limit = float("inf") if deadline is None else deadline - _monotonic()
                if limit <= 0 or not (waiting or handed) or isinstance(exc, PoolerMismatch):
                    raise
                log.warning(
                    "dblock: waiting for %r in its fair queue; %s, retrying (the request "
                    "joins the queue again): %s",
                    key,
                    what_failed(exc),
                    exc,
                )
                outage = outage or Backoff(_OUTAGE_INITIAL, _OUTAGE_MAX)
                yield (_SLEEP, outage.step(limit))
                token, ticket, handed, lease = os.urandom(16).hex(), None, None, None
                continue
            outage = None
            if isinstance(result, Grant):
                held = HeldLock(
                    locker,
                    entry,
                    token=token,
                    owner=owner,
                    ttl=ttl,
                    grant=result,
                    sent_at=sent_at,
                    options=opts,
                )
                held._fair = True
                held._ticket = ticket
                return held
            if result is DROPPED:
                # Paused past our queue row's lease (or it was swept): join
                # again at the tail, with a fresh token; the dead row goes.
                log.warning(
                    "dblock: the queue row of %r ran out while waiting; queueing again", key
                )
                store.add_orphan(key, token, released=True, whole=True)
                token, ticket, lease = os.urandom(16).hex(), None, None
                continue
            assert isinstance(result, (Holder, Queued))
            if isinstance(result, Holder):  # not queued: fail-fast, or no time left
                if not blocking:
                    raise LockBusy(key, level=2, holder=result.owner)
                raise LockTimeout(key, timeout=timeout or 0.0, level=2, holder=result.owner)
            ticket = result.ticket
            if result.lease is not None:
                lease, lease_sent = result.lease, sent_at
            limit = float("inf") if deadline is None else deadline - _monotonic()
            if limit <= 0:
                raise LockTimeout(key, timeout=timeout or 0.0, level=2, holder=result.owner)
            if result.expires_in is not None:
                limit = min(limit, max(result.expires_in, 0.0) + _EXPIRY_MARGIN)
            # Look again (and so renew our queue row) well before it runs out.
            limit = min(limit, ttl * RENEW_AT)
            if not store.can_notify:
                # Polling: look again soon enough to notice moving up.
                config = store.config
                limit = min(limit, poll_cap(result, config.poll_initial, config.poll_max))
            if not waiting:
                waiting = True
                if watch is not None:
                    watch.waiting(2)
            # Polling dialects poll afresh (from poll_initial) when whom we
            # wait behind changes: the first waiter must notice a release soon.
            blocker = None if store.can_notify else (result.owner, result.first)
            yield (_WAIT, key, limit, sent_at, address(ticket), blocker)
            fence = sql.handed(address(ticket))
            if fence is not None and lease is not None:
                # The holder's release handed us the head with our queue
                # row's lease, which we renewed last at lease_sent.
                held = HeldLock(
                    locker,
                    entry,
                    token=token,
                    owner=owner,
                    ttl=ttl,
                    grant=Grant(fence, lease.expires_at, lease.expires_in),
                    sent_at=lease_sent,
                    options=opts,
                )
                held._fair = True
                held._ticket = ticket
                return held
    except BaseException as exc:
        if in_flight and not never_sent(exc):
            # Cut off mid-statement (an interruption, a cancellation): our
            # rows may or may not exist; the renewal thread deletes them.
            store.add_orphan(key, token, whole=True)
            locker.renewer.post(_noop)
        elif ticket is not None:
            yield from _withdraw(locker, key, token)
        raise
    finally:
        request.deadline = None


# Its waiters may be queued in the database by their predecessor's release.
queued_loop.seats = True  # type: ignore[attr-defined]


def _withdraw(locker: Locker, key: str, token: str) -> Op[None]:
    """Leave the queue as if we had never joined it (best effort, like a
    release): delete our rows and wake the next waiter if we were the first."""
    try:
        yield (_STEPS, locker.store.fair_sql().leave_steps(key, token))
    except BackendError as exc:
        log.error(
            "dblock: leaving the fair queue of %r failed; our queue row stays until its "
            "lease ends or the sweeper removes it: %s",
            key,
            exc,
        )
        locker.store.add_orphan(key, token, released=True, whole=True)
    except BaseException:
        locker.store.add_orphan(key, token, whole=True)
        locker.renewer.post(_noop)
        raise
