"""Hand-off: a release whose key another thread of this process waits for
gives it the row (one UPDATE, or no SQL while the row has fences in
reserve) instead of deleting it; a run of hand-offs is bounded
(``handoff_limit``) so other processes get their turn (see ``GiveWay``).
A fair lock's release seats the next local waiter in the database's queue.
"""

from __future__ import annotations

import logging
import os
import time
from functools import partial

from ._held import HeldLock
from ._lockbase import (
    GIVE_WAY_MAX,
    GIVE_WAY_MIN,
    GIVE_WAY_RTTS,
    RESERVE_LEASE,
    LockerBase,
    Ticket,
)
from ._store import Grant
from ._store.fair import Seat, fair_sql
from ._store.jobs import statements as job_statements
from .errors import BackendError, LockLost
from .registry import Entry, Waiter
from .steps import (
    Op,
    Release,
    Run,
    Transfer,
    noop,
)

log = logging.getLogger("dblock")

_monotonic = time.monotonic
_urandom = os.urandom


class HandOff(LockerBase):
    """The release's statement, and the hand-off to a local waiter."""

    @property
    def _handoff_limit(self) -> int:
        # Read from the store each time: MariaDB's is known once its server answered.
        return self.config.handoff_limit if self.store.can_transfer else 0

    @property
    def _run_limit(self) -> int:
        """Without hand-off (MySQL) every local grant is a row of its own, and
        a run of them is counted in grants (see _keep and release)."""
        return 0 if self.store.can_transfer else self.config.handoff_limit

    def _release_row(
        self, entry: Entry, held: HeldLock, keep: float
    ) -> Op[tuple[bool, float | None]]:
        """The release's statement: (deleted, the give-way's grace if this
        ends a run of local grants: see _run_ended)."""
        run_ended = self._run_ended(entry, held, keep)
        if run_ended is None:  # nobody seen lately: ask (MySQL's waiter names)
            asking = self.store.others_wait_steps(held.key)
            try:
                run_ended = asking is not None and bool((yield Run(asking)))
            except BackendError:
                # Only a hint (whether to give way): a killed connection or
                # an outage fails the release's own statement, if anything.
                run_ended = False
            if not run_ended:
                entry.handoffs = 0  # a new run: asked again at its end, not at every grant
        # A lost lock's row is deleted too if it is still ours (renewal
        # may have failed only because the database was unreachable).
        if held.state.fair:  # wakes the next waiter of the queue, and only it
            queued = held.state.ticket is not None  # others likely queue behind
            deleted = yield Run(
                fair_sql(self.store).release_steps(held.key, held.token, queued=queued),
            )
            return deleted, None
        if keep:
            deleted = yield Run(
                job_statements(self.store).keep_steps(held.key, held.token, keep, held.owner),
            )
            return deleted, None
        if entry.queue:  # local threads wait: others likely do too
            self.store.hot(held.key, run_ended)
        sent_at = _monotonic()
        deleted = yield Release(held.key, held.token)
        if run_ended and deleted:
            took = (_monotonic() - sent_at) * GIVE_WAY_RTTS
            entry.handoffs = 0
            return deleted, min(max(took, GIVE_WAY_MIN), GIVE_WAY_MAX)
        return deleted, None

    def _run_ended(self, entry: Entry, held: HeldLock, keep: float) -> bool | None:
        """Whether a release ends a run of local grants while local threads
        still wait: the next gives way to other processes (see
        GIVE_WAY_RTTS). Without hand-off (MySQL) a run ends so only when
        another process waits: the pause would be idle time otherwise.
        None: it would if another process waits, and none was seen lately."""
        limit = self._handoff_limit or self._run_limit
        # Local grants in the run so far: the row's own and its hand-offs, or
        # (without hand-off) each a row of its own, counted in _keep.
        run = entry.handoffs + 1 if self._handoff_limit else entry.handoffs
        if not limit or run < limit or not entry.queue or held.state.fair or keep:
            return False
        if self._handoff_limit or self.store.others_wait(held.key):
            return True
        return None

    def _release_seating(self, held: HeldLock, waiter: Waiter) -> Op[bool]:
        """Release a fair lock whose key the next local thread (``waiter``,
        already given level 1) waits for: one statement hands the row to the
        queue and, for a fair waiter, takes its place at the queue's tail (a
        :class:`Seat`); a plain waiter, or one this fails for, acquires by itself."""
        ticket: Ticket = waiter.ticket
        sql = fair_sql(self.store)
        key, token = held.key, held.token
        seat_token = _urandom(16).hex() if ticket.seats else None
        seat: Seat | None = None
        sent_at = _monotonic()
        queued = held.state.ticket is not None
        try:
            if seat_token is None:
                deleted = yield Run(sql.release_steps(key, token, queued=queued))
            else:
                deleted, lease = yield Run(
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
        if held.state.lost is not None:
            raise LockLost(key, held.state.lost)
        if not deleted:
            raise LockLost(key, "its row was gone or held by another owner at release")
        return True

    def _hand_off(self, entry: Entry, held: HeldLock, waiter: Waiter) -> Op[bool]:
        """Give our row to the next local thread: without SQL while the row
        has fences in reserve, otherwise in one statement."""
        ticket: Ticket = waiter.ticket
        sent_at = _monotonic()
        reserve = held.state.reserve
        if (
            reserve
            and ticket.ttl == held.ttl
            and ticket.options.renew
            and held.state.expires_mono - sent_at >= held.ttl * RESERVE_LEASE
        ):
            # The row stays as it is (token, owner, lease: renewal keeps it);
            # the successor's fence was drawn while the row was ours, after
            # every fence it carried before, so fences still grow for this key.
            kept = Grant(
                reserve[0],
                held.expires_at,
                held.state.expires_mono - sent_at,
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
            grant = yield Transfer(
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
        ticket: Ticket = waiter.ticket
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
        ref = successor.state
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
