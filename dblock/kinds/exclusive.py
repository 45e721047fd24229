"""The exclusive lock's level 2: the row's acquire loop.

One statement per try (an INSERT that takes a free or expired row, or
answers who holds it); a refused request waits for the release (woken by
the store's waiter) and tries again; an ambiguous outcome (the connection
broke with the statement in flight) is settled by asking again with the
same token; a waiting request rides out an outage until its deadline.
The fair queue replaces this loop with its own (:mod:`dblock.kinds.fair`).
"""

from __future__ import annotations

import logging
import os
import time

from .._held import HeldLock, LockOptions
from .._lockbase import (
    AMBIGUITY_RETRIES,
    LIVE_LEASE,
    FirstTry,
    LockerBase,
)
from .._store import Backoff, Grant, Holder, Interrupted
from .._store.base import PoolerMismatch, never_sent, what_failed
from .._store.batch import GaveUp, until_for
from .._store.fair import Seat
from ..errors import (
    BackendError,
    DBLockError,
    KindMismatch,
    LockBusy,
    LockNotAcquired,
    LockTimeout,
    ManagerClosed,
    SchemaMissing,
)
from ..registry import Entry
from ..steps import (
    CLEAN_UP,
    EXPIRY_MARGIN,
    OUTAGE_INITIAL,
    OUTAGE_MAX,
    Op,
    Sleep,
    Try,
    Wait,
    noop,
)
from ..telemetry import Watch

log = logging.getLogger("dblock")

_monotonic = time.monotonic
_urandom = os.urandom


class RowLoop(LockerBase):
    """The row's acquire loop of an exclusive lock, as steps."""

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
                    if sent_at + result.expires_in - _monotonic() >= ttl * LIVE_LEASE:
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
                yield Wait(key, limit, sent_at)
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
            yield CLEAN_UP
        sent_at = _monotonic()
        until = until_for(deadline, sent_at)
        try:
            answer: Grant | Holder | BaseException = yield Try(key, token, owner, ttl, until)
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
        yield Sleep(outage.step(limit))
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
        for attempt in range(AMBIGUITY_RETRIES + 1):
            try:
                if first is not None:
                    failed, first = first, None
                    raise failed
                result: Grant | Holder = yield Try(key, token, owner, ttl, until)
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
            if attempt < AMBIGUITY_RETRIES:
                try:
                    yield Sleep(0.05 * 2**attempt)
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
