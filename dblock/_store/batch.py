"""Group commit: the level-2 statements of one process's threads, sent together.

Many threads of one process each locking its own key send one short statement
and one commit apiece; the database's commits (and, on PostgreSQL, its
sequence and notification queue) then bound the grants per second, well
below what a few multi-row statements would carry. The :class:`Batcher` sits
between the lock (:class:`dblock.lock.Locker`) and the store and sends the
requests that meet at the same moment as one statement:

* **A lone request goes at once, no timer.** A request that finds no
  statement of its kind in flight is sent at once, alone, on its own thread
  or task, by the statement a lone request always used (one round trip,
  nothing added). Requests that arrive while a statement is in flight
  queue; when it returns, the whole queue is sent as one multi-row
  statement by a sender of the batcher's own (a thread, or an asyncio
  task), never by a requester, so every requester can leave at its own
  deadline. Batches grow only when the database is the bottleneck, and a
  lone request pays nothing.
* **A lane per kind of statement** (acquires, releases): they never share a
  statement, so a key released and taken again in one batch cannot meet
  itself in one statement. One statement of each lane is in flight
  (:data:`DEPTH`), so one or two pooled connections carry a process's
  level-2 traffic.
* **A stuck statement holds up nobody else.** A statement can wait for as
  long as the database makes it (a row or advisory lock another session
  holds on one of its keys, a connection that silently stopped forwarding:
  a TCP timeout, minutes). One in flight for longer than :data:`STALL` no
  longer counts against the lane's depth: the next request goes out at once
  on another connection (at most :data:`MAX_FLIGHTS` statements of a lane
  in flight).
* **Every request keeps its own deadline.** A request with a timeout waits
  for its batch at most until its ``until`` (the lock's deadline, never
  less than :data:`MIN_WAIT` from the try): one still queued then is
  withdrawn (never sent); one whose batch is in flight is abandoned, and
  its row, if the batch writes one, is deleted by its token once the
  batch's outcome is known (:func:`bury`). Either raises :class:`GaveUp`,
  which the lock turns into its ``LockTimeout``.
* **Leases count from the send.** A grant carries when the statement that
  granted it was sent (``Grant.sent_at``), so a request that queued first
  still has its whole lease, counted from then.
* **One key once per statement.** A key asked for twice (only possible
  without level 1, ``local_filter=False``) waits for the next batch.
* **Per-request outcomes.** The store's ``*_many_steps`` answers each
  request of the batch on its own (one key held elsewhere fails only that
  key). A batch that fails cleanly (an error answer: nothing was committed)
  is sent again as single statements, one per request, so each request
  sees its own answer (one bad key fails only itself). A batch whose
  outcome is unknown (connection lost in flight) gives every request
  :class:`Interrupted`, which each resolves as an ambiguous single
  statement is resolved today (an acquire asks again with its token; a
  release leaves an orphan to delete).
* **Interruption.** A request interrupted (a signal handler's exception, a
  task's cancellation) while still queued is withdrawn and was never sent
  (``never_sent``); one interrupted once its batch was sent raises as an
  interrupted single statement does, and its row, if granted, is deleted as
  an orphan once the batch returns.

The decisions (when a statement may go, what a batch holds, what each
request is told) live in :class:`Lane`, written once; :class:`Batcher`
waits with thread locks and sends on threads, :class:`AsyncBatcher` waits
with futures and sends in tasks.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Generic, TypeVar

from .. import _threads
from .base import Grant, Holder, Interrupted, Store, _mark_unsent, never_sent

__all__ = [
    "ANSWERS_ALL",
    "MAX_BATCH",
    "MIN_WAIT",
    "STALL",
    "AsyncBatcher",
    "Batcher",
    "GaveUp",
    "Lane",
    "Request",
    "until_for",
]

_monotonic = time.monotonic

# Requests per statement: well under every driver's parameter limit, and a
# batch this size already costs the database more than its round trip.
MAX_BATCH: Final = 256

# Statements of one lane in flight at once: one is sent alone at once, then
# requests queue. Two (so the server's own group commit could overlap two
# batches) was measured against one on PostgreSQL and MariaDB, 1-4
# processes x 8-32 threads: one made the larger batches and as many or more
# grants/s everywhere (1 x 8 threads: 1.07-1.24x the raw driver against
# 0.92-0.96x on PostgreSQL, 1.05-1.12x against 0.73-0.93x on MariaDB).
DEPTH: Final = 1

# Seconds after which a statement still in flight is taken as stuck (a lock
# another session holds on one of its keys, a half-open connection) and no
# longer holds the lane: the next request goes out beside it, on another
# connection. Far above a batch's round trip (milliseconds), and half the
# default poll_max, so a request behind a stuck statement is on its way
# within one poll interval.
STALL: Final = 0.25

# Statements of one lane in flight at most, stuck ones included: a database
# that stopped answering altogether ties up this many connections, not one
# per request.
MAX_FLIGHTS: Final = 4

# Seconds after which a flight that never landed is forgotten, when the
# lane is at MAX_FLIGHTS: a statement stuck that long (a TCP timeout) no
# longer counts, nor does a flight whose end its thread could not count (a
# signal handler's exception raised in a requester thread between its lone
# statement's return and the lane's count: a ghost). Four ghosts in a
# process's life would otherwise close the lane for good.
GHOST: Final = 60.0

# A request with a deadline gives up on its statement no sooner than this
# after its try began, whatever that deadline (a timeout of 0 is already
# past): an ordinary batch returns well within it.
MIN_WAIT: Final = 0.5

#: An attribute that marks a grouped statement's error as every request's
#: answer (see :func:`settle`): going again alone, each would only meet it again.
ANSWERS_ALL: Final = "_dblock_answers_all"

# An idle sender thread ends after this long without a batch to send.
_SENDER_IDLE = 30.0

# A request's states.
QUEUED: Final = 0  # in its lane's queue: nothing sent, can be withdrawn
SENT: Final = 2  # in a batch being sent: its outcome comes with the batch's
DONE: Final = 3  # ``outcome`` or ``error`` is set

A = TypeVar("A", bound=tuple[Any, ...])
R = TypeVar("R")


class GaveUp(Exception):
    """A request left its lane at its deadline, its statement not answered
    (held up by a statement of other requests, or in one). ``sent``: its
    batch had gone out; then the batcher deletes its row, if the batch
    wrote one, once the batch's outcome is known."""

    def __init__(self, key: str, *, sent: bool) -> None:
        state = "its batch is still in flight" if sent else "still queued, never sent"
        super().__init__(f"{key!r}: gave up waiting for the database ({state})")
        self.key = key
        self.sent = sent


def until_for(deadline: float | None, now: float) -> float | None:
    """How long a try started at ``now`` may wait for its statement: the
    request's deadline, never less than :data:`MIN_WAIT`; None (as long as
    it takes) without one. A fail-fast request has none: it is sent beside
    a stuck statement as any other, and then waits for its own statement's
    answer, as it would sent alone (a slow database is no refusal)."""
    return None if deadline is None else max(deadline, now + MIN_WAIT)


class _Alone:
    """Marks a request to be sent again on its own (its batch failed cleanly)."""


ALONE: Final = _Alone()


class Request(Generic[A, R]):
    """One request waiting in a lane; ``wake`` is the face's way to wake it."""

    __slots__ = ("abandoned", "args", "error", "gave_up", "key", "outcome", "state", "wake")

    def __init__(self, key: str, args: A, wake: Any) -> None:
        self.key = key
        self.args = args
        self.state = QUEUED
        self.outcome: R | _Alone | None = None
        self.error: BaseException | None = None
        self.wake = wake
        # Left while its batch was in flight: nobody takes its outcome.
        self.abandoned = False
        # Left at its deadline (not interrupted): the batcher alone settles its row.
        self.gave_up = False


class Lane(Generic[A, R]):
    """One kind of statement (acquire, release): the statements in flight
    (when each was sent) and the requests queued behind them. Every method
    runs under the owner's mutex; none of them waits or sends anything."""

    __slots__ = ("depth", "flights", "in_flight", "queue", "stall")

    def __init__(self, depth: int = 1) -> None:
        #: Statements of this lane in flight at once that are not stuck, at most.
        self.depth = depth
        #: Seconds in flight after which a statement is stuck (:data:`STALL`;
        #: the tests that hold a statement up to make a batch set it higher).
        self.stall = STALL
        self.in_flight = 0
        #: When each statement in flight was sent (time.monotonic()), as
        #: keys: a flight is known by its time alone, noted and forgotten
        #: with no call (a signal handler's exception lands after calls).
        #: Two sent at the same instant share one key; the one not noted
        #: counts as moving, as any flight not noted here.
        self.flights: dict[float, bool] = {}
        self.queue: list[Request[A, R]] = []

    @property
    def busy(self) -> bool:
        """No room for another statement: a request now queues."""
        return self.in_flight >= self.depth

    def room(self, now: float, stall: float | None = None) -> bool:
        """Room for another statement at ``now``: fewer than ``depth`` in
        flight that are not stuck (sent ``stall`` ago or more, by default
        the lane's :data:`STALL`), and fewer than :data:`MAX_FLIGHTS` in all."""
        if self.in_flight < self.depth:
            return True
        if self.in_flight >= MAX_FLIGHTS:
            for sent in [t for t in self.flights if now - t >= GHOST]:
                del self.flights[sent]  # (and counted out, with no call between)
                self.in_flight -= 1
            if self.in_flight >= MAX_FLIGHTS:
                return False
        # (A flight not in ``flights`` counts as moving.)
        moving = self.in_flight - len(self.flights)
        if stall is None:
            stall = self.stall
        for sent in self.flights:
            if now - sent < stall:
                moving += 1
        return moving < self.depth

    def patience(self, arrived: float, until: float | None) -> float:
        """How long a request that arrived at ``arrived`` and must be answered
        by ``until`` lets a statement in flight hold it up before it goes
        beside it: the lane's stall bound, or a quarter of its time if that
        is less (a request with half a second left does not spend half of
        it waiting to be sent)."""
        if until is None or self.stall == float("inf"):  # (inf: a test's held-up lane)
            return self.stall
        return min(self.stall, (until - arrived) / 4)

    def stall_at(self, stall: float | None = None) -> float | None:
        """When the lane will next have room, its oldest flight stuck (by
        ``stall``, by default the lane's); None if it never will by time alone."""
        if stall is None:
            stall = self.stall
        if self.in_flight >= MAX_FLIGHTS:
            return min(self.flights) + GHOST if self.flights else None
        if len(self.flights) < self.in_flight or stall == float("inf"):
            return None
        moving = sorted(self.flights)
        # Room once all but depth - 1 of the moving flights are stuck.
        index = len(moving) - self.depth
        return None if index < 0 else moving[index] + stall

    def enter(self, now: float, stall: float | None = None) -> bool:
        """True: room for a statement, the caller sends its request alone at once."""
        if self.queue or not self.room(now, stall):
            return False
        self.in_flight += 1
        self.flights[now] = True
        return True

    def take(self) -> list[Request[A, R]]:
        """The queued requests that go in the next statement, marked sent."""
        batch: list[Request[A, R]] = []
        rest: list[Request[A, R]] = []
        seen: set[str] = set()
        for request in self.queue:
            if request.key in seen or len(batch) >= MAX_BATCH:
                rest.append(request)
            else:
                seen.add(request.key)
                batch.append(request)
                request.state = SENT
        self.queue = rest
        return batch

    def open(self, now: float) -> list[Request[A, R]]:
        """A new statement for the queue, beside the ones in flight (the
        caller checked :meth:`room`)."""
        self.in_flight += 1
        self.flights[now] = True
        return self.take()

    def landed(self, sent: float, now: float) -> list[Request[A, R]] | None:
        """The statement sent at ``sent`` returned: the next batch, whose
        statement takes its place (sent at ``now``), or None and one
        statement fewer is in flight."""
        if self.ended(sent, now):
            return self.take()
        return None

    def ended(self, sent: float, now: float) -> bool:
        """:meth:`landed` without the take: True if a statement for the
        queue takes the place of the one sent at ``sent`` (sent at ``now``;
        a sender thread takes its batch, see :meth:`Batcher._fly`)."""
        if sent in self.flights:  # (not a flight a test made by hand)
            del self.flights[sent]
        if not self.queue:
            if self.in_flight > 0:  # (0: forgotten as a ghost meanwhile)
                self.in_flight -= 1
            return False
        self.flights[now] = True
        return True

    def withdraw(self, request: Request[A, R]) -> bool:
        """Take back a request that was never sent: True if it was still queued."""
        if request.state == QUEUED:
            self.queue.remove(request)
            request.state = DONE
            return True
        return False


def settle(
    batch: Sequence[Request[A, R]],
    outcomes: Sequence[R] | None,
    exc: BaseException | None,
    sent: float,
) -> None:
    """Give each request of a batch its outcome: ``outcomes`` (in order;
    a grant learns when its statement was ``sent``), or what the batch's
    failure ``exc`` means for it."""
    if outcomes is not None:
        for request, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, Grant):
                outcome.sent_at = sent
            request.outcome = outcome
            request.state = DONE
        return
    assert exc is not None
    if len(batch) == 1:  # a lone statement: its error is its own, as without batching
        batch[0].error = exc
        batch[0].state = DONE
        return
    if getattr(exc, ANSWERS_ALL, False):
        # Each alone would meet it again (SQLite's file locked by another
        # connection, waited for in full): each request is told at once,
        # nothing having been written, with an error of its own (one
        # exception raised in many threads would share its traceback).
        for request in batch:
            error = type(exc)(*exc.args)
            error.__cause__ = exc.__cause__
            request.error = error
            request.state = DONE
        return
    # An error answer (or one raised before the statement left, such as a
    # parameter the driver cannot encode) committed nothing: each request
    # goes again alone and gets its own answer. A lost connection leaves the
    # outcome unknown: each request settles it as a lone statement in doubt does.
    in_doubt = isinstance(exc, Interrupted) or not (isinstance(exc, Exception) or never_sent(exc))
    for request in batch:
        if in_doubt:
            request.error = Interrupted(
                f"a grouped statement's outcome is unknown: {type(exc).__name__}: {exc}"
            )
        else:
            request.outcome = ALONE
        request.state = DONE


def bury(store: Store, batch: Sequence[Request[Any, Any]]) -> bool:
    """Register as orphans the rows of a returned batch whose requesters
    left while it was in flight (True if any): a grant, or, for one that
    gave up at its deadline, an outcome in doubt (the row may have been
    written). An interrupted requester's lock
    registered its own orphan when it raised, but that DELETE may have run
    before the batch committed and found nothing: register it again now
    that the row exists. Acquires only (a release's args have no owner)."""
    buried = False
    for request in batch:
        if not request.abandoned or len(request.args) < 4:
            continue
        if isinstance(request.outcome, Grant):
            store.add_orphan(request.args[0], request.args[1])
            buried = True
        elif request.gave_up and isinstance(request.error, Interrupted):
            # (An interrupted requester's lock registered its orphan when it
            # raised, the outcome in doubt already; one that gave up did not.)
            store.add_orphan(request.args[0], request.args[1], unreachable=True)
            buried = True
    return buried


class _Sender:
    """An idle sender thread's wake-up and the work handed to it."""

    __slots__ = ("wake", "work")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()
        self.work: tuple[Any, ...] | None = None


class Batcher:
    """Group commit for one store, on blocking connections (see the module)."""

    __slots__ = ("_acquires", "_idle", "_mutex", "_releases", "_store", "_wake_cleaner")

    def __init__(self, store: Store, wake_cleaner: Callable[[], None] = lambda: None) -> None:
        self._store = store
        # Asks for the orphans to be deleted soon (the renewal thread's pass).
        self._wake_cleaner = wake_cleaner
        self._mutex = threading.Lock()
        self._acquires: Lane[tuple[str, str, str, float], Grant | Holder] = Lane(DEPTH)
        self._releases: Lane[tuple[str, str], bool] = Lane(DEPTH)
        self._idle: list[_Sender] = []  # sender threads waiting for a batch

    @property
    def store(self) -> Store:
        return self._store

    def after_fork(self) -> None:
        """In a forked child: no statement of the parent's is in flight here,
        and none of its sender threads exists."""
        self._mutex = threading.Lock()
        self._acquires = Lane(DEPTH)
        self._releases = Lane(DEPTH)
        self._idle = []

    # The store's own signatures (and how long the request may wait): the
    # lock calls these instead of the store's.

    def try_acquire(
        self, key: str, token: str, owner: str, ttl: float, until: float | None = None
    ) -> Grant | Holder:
        return self._submit(
            self._acquires,
            key,
            (key, token, owner, ttl),
            self._store.try_acquire,
            self._many_acquires,
            until,
        )

    def release(self, key: str, token: str) -> bool:
        return self._submit(
            self._releases, key, (key, token), self._store.release, self._many_releases, None
        )

    def _many_acquires(self, requests: list[tuple[str, str, str, float]]) -> list[Grant | Holder]:
        return self._store.drive(self._store.acquire_many_steps(requests))

    def _many_releases(self, requests: list[tuple[str, str]]) -> list[bool]:
        return self._store.drive(self._store.release_many_steps(requests))

    def _submit(  # noqa: PLR0912, PLR0917 - Lane's steps inlined on purpose (see below)
        self,
        lane: Lane[A, R],
        key: str,
        args: A,
        single: Callable[..., R],
        many: Callable[[list[A]], list[R]],
        until: float | None,
    ) -> R:
        mutex = self._mutex
        request: Request[A, R] | None = None
        kick = False
        now = _monotonic()
        # A signal handler's exception lands after any call (and as any
        # function starts): the lane's count and our note of it change with
        # no call between them (Lane.enter, inlined), inside the try whose
        # finally gives the place back. Else one exception at that instant
        # left the lane taken for good, and every later request of the
        # process queued behind nobody.
        alone = False
        try:
            with mutex:
                if lane.in_flight < lane.depth or (
                    not lane.queue and lane.room(now, lane.patience(now, until))
                ):
                    lane.in_flight += 1
                    alone = True
                    lane.flights[now] = True
                else:
                    wake = threading.Lock()
                    wake.acquire()
                    # (Not Request[A, R](...): calling a subscripted generic goes
                    # through typing, several µs per request.)
                    request = Request(key, args, wake)
                    lane.queue.append(request)
                    if lane.room(now, lane.patience(now, until)):  # the ones in flight are stuck
                        # Lane.open without its take (a sender thread takes
                        # the batch), no call between the two.
                        lane.in_flight += 1
                        lane.flights[now] = kick = True
            if alone:
                return single(*args)
        finally:
            if alone:
                # Lane.landed's first case, inlined for the same reason:
                # with nobody queued, the lane has one statement fewer.
                with mutex:
                    if not lane.queue:
                        lane.in_flight -= 1
                        alone = False
                        if now in lane.flights:
                            del lane.flights[now]
                if alone:
                    self._landed(lane, now)
        assert request is not None
        try:
            if kick:
                self._dispatch(lane, now, single, many)
        finally:
            self._await(lane, request, now, until, single, many)
        if request.error is not None:
            raise request.error
        if request.outcome is ALONE:
            return single(*args)
        return request.outcome  # type: ignore[return-value]

    def _await(  # noqa: PLR0912, PLR0917 - one wait loop, its exits inline
        self,
        lane: Lane[A, R],
        request: Request[A, R],
        arrived: float,
        until: float | None,
        single: Callable[..., R],
        many: Callable[[list[A]], list[R]],
    ) -> None:
        """Wait until ``request`` is answered; on the way, send the queue
        beside a stuck statement, and leave at ``until``."""
        mutex = self._mutex
        wake = request.wake
        patience = lane.patience(arrived, until)
        try:
            while True:
                with mutex:
                    if request.state == DONE:
                        return  # (its wake-up may come after: nobody waits for it)
                    now = _monotonic()
                    if until is not None and now >= until:
                        if lane.withdraw(request):
                            raise _mark(GaveUp(request.key, sent=False))
                        request.abandoned = request.gave_up = True  # its row is buried
                        raise GaveUp(request.key, sent=True)
                    kick = False
                    stall = None
                    if request.state == QUEUED:
                        if lane.room(now, patience):
                            lane.in_flight += 1  # (as in _submit)
                            lane.flights[now] = kick = True
                        else:
                            stall = lane.stall_at(patience)
                if kick:
                    self._dispatch(lane, now, single, many)
                    continue
                ends = [t for t in (until, stall) if t is not None]
                if wake.acquire(timeout=max(min(ends) - now, 0.0) + 0.001 if ends else -1):
                    return
        except GaveUp:
            raise
        except BaseException as exc:
            with mutex:
                if lane.withdraw(request):
                    _mark_unsent(exc)
                elif request.state != DONE:
                    request.abandoned = True
            raise  # sent with a batch: the lock treats it as an interrupted statement

    def _landed(self, lane: Lane[A, R], sent: float) -> None:
        """A lone statement returned with requests queued behind it: they go
        out together, on a sender thread."""
        with self._mutex:
            now = _monotonic()
            kick = lane.ended(sent, now)
        if kick:
            single, many = self._calls(lane)
            self._dispatch(lane, now, single, many)

    def _calls(self, lane: Lane[Any, Any]) -> tuple[Callable[..., Any], Callable[[Any], Any]]:
        if lane is self._acquires:
            return self._store.try_acquire, self._many_acquires
        return self._store.release, self._many_releases

    def _dispatch(
        self,
        lane: Lane[A, R],
        sent: float,
        single: Callable[..., R],
        many: Callable[[list[A]], list[R]],
    ) -> None:
        """Have a sender thread (an idle one, else a new one) send the
        statement the lane counted in flight since ``sent``: the thread takes
        its batch from the queue. A requester thread never holds a batch: a
        signal handler's exception raised in it, anywhere in here, at most
        loses this statement before it takes anything (its place in the lane,
        not moving, is stuck after STALL, and the requests still queued go
        out beside it; see GHOST), never requests taken from the queue."""
        work = (lane, sent, single, many)
        with self._mutex:
            sender = self._idle.pop() if self._idle else None
            if sender is not None:
                sender.work = work
        if sender is not None:
            sender.wake.release()
            return
        try:
            _threads.start(
                threading.Thread(
                    target=self._sending, args=(work,), name="dblock-batch", daemon=True
                )
            )
        except RuntimeError as exc:
            # No thread (at interpreter exit): the batch is failed cleanly
            # and each request goes alone on its own thread.
            self._fly(lane, sent, single, many, failed=exc)

    def _sending(self, work: tuple[Any, ...]) -> None:
        """A sender thread: sends the batches handed to it, then waits a while
        for more."""
        me = _Sender()
        while True:
            self._fly(*work)
            with self._mutex:
                self._idle.append(me)
            if not me.wake.acquire(timeout=_SENDER_IDLE):
                with self._mutex:
                    if me in self._idle:
                        self._idle.remove(me)
                        return
                # Taken for work as we timed out: it is coming, unless the
                # requester thread was cut off before waking us (see _dispatch).
                if not me.wake.acquire(timeout=_SENDER_IDLE):
                    return
            if me.work is None:  # (cut off between taking us and handing the work)
                return
            work, me.work = me.work, None

    def _fly(
        self,
        lane: Lane[A, R],
        sent: float,
        single: Callable[..., R],
        many: Callable[[list[A]], list[R]],
        failed: BaseException | None = None,
    ) -> None:
        """Take the batch of the statement counted in flight since ``sent``,
        send it, settle it, and go on with the next one queued meanwhile,
        until the lane's queue is empty."""
        with self._mutex:
            batch: list[Request[A, R]] | None = lane.take()
        if not batch:  # (every request withdrew meanwhile: the statement is not sent)
            with self._mutex:
                now = _monotonic()
                batch = lane.landed(sent, now)
            sent = now
        while batch:
            if failed is not None:
                settle(batch, None, ValueError(f"not sent: {failed!r}"), sent)
            else:
                try:
                    if len(batch) == 1:
                        outcomes = [single(*batch[0].args)]
                    else:
                        outcomes = many([r.args for r in batch])
                except BaseException as exc:
                    settle(batch, None, exc, sent)
                else:
                    settle(batch, outcomes, None, sent)
            with self._mutex:
                now = _monotonic()
                # (Under the mutex: a requester decides to leave under it,
                # seeing its request not yet done, before this reads it.)
                buried = bury(self._store, batch)
                following = lane.landed(sent, now)
            # The next batch is on its way as soon as this thread sends it;
            # ours only need waking.
            for request in batch:
                request.wake.release()
            if buried:
                self._wake_cleaner()
            batch, sent = following, now


def _mark(exc: BaseException) -> BaseException:
    _mark_unsent(exc)
    return exc


def batches(store: Store) -> bool:
    """Whether ``store``'s dialect can answer many requests in one statement."""
    return type(store).acquire_many_steps is not Store.acquire_many_steps


# An event loop's acquire and release lanes.
_Lanes = tuple[Lane[Any, Any], Lane[Any, Any]]


class AsyncBatcher:
    """Group commit for asyncio tasks: the same lanes and rules as
    :class:`Batcher`, waiting with futures instead of thread locks, and a
    batch sent by a task of its own, so cancelling any request never
    cancels the statement the others share; the cancelled request is
    withdrawn if still queued, else abandoned (its grant, if any, deleted as
    an orphan once the batch returns). A lone request is sent at once, in
    its own task, as without batching. Lanes are per event loop (futures
    belong to one)."""

    __slots__ = ("_drive", "_lanes", "_store", "_tasks", "_wake_cleaner")

    def __init__(
        self,
        store: Store,
        drive: Callable[[Any], Awaitable[Any]],
        wake_cleaner: Callable[[], None] = lambda: None,
    ) -> None:
        self._store = store
        self._drive = drive  # AsyncStore.drive: runs Steps on async connections
        self._wake_cleaner = wake_cleaner
        self._lanes: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[Lane[Any, Any], Lane[Any, Any]]
        ] = weakref.WeakKeyDictionary()
        self._tasks: set[asyncio.Task[None]] = set()  # batches in flight, kept from the GC

    def after_fork(self) -> None:
        self._lanes = weakref.WeakKeyDictionary()
        self._tasks = set()

    def _lanes_here(self) -> _Lanes:
        loop = asyncio.get_running_loop()
        lanes = self._lanes.get(loop)
        if lanes is None:
            lanes = self._lanes[loop] = (Lane(DEPTH), Lane(DEPTH))
        return lanes

    async def try_acquire(
        self, key: str, token: str, owner: str, ttl: float, until: float | None = None
    ) -> Grant | Holder:
        store = self._store
        result: Grant | Holder = await self._submit(
            self._lanes_here()[0],
            key,
            (key, token, owner, ttl),
            lambda args: store.acquire_steps(*args),
            store.acquire_many_steps,
            until,
        )
        return result

    async def release(self, key: str, token: str) -> bool:
        store = self._store
        result: bool = await self._submit(
            self._lanes_here()[1],
            key,
            (key, token),
            lambda args: store.release_steps(*args),
            store.release_many_steps,
            None,
        )
        return result

    async def _submit(  # noqa: PLR0912, PLR0917 - one wait loop, its exits inline
        self,
        lane: Lane[A, R],
        key: str,
        args: A,
        single: Callable[[A], Any],
        many: Callable[[list[A]], Any],
        until: float | None,
    ) -> R:
        now = _monotonic()
        patience = lane.patience(now, until)
        if lane.enter(now, patience):
            try:
                return await self._drive(single(args))  # type: ignore[no-any-return]
            finally:
                landed = _monotonic()
                self._launch(lane, lane.landed(now, landed), landed, single, many)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        request: Request[A, R] = Request(key, args, future)
        lane.queue.append(request)
        try:
            while not future.done():
                now = _monotonic()
                if until is not None and now >= until:
                    if lane.withdraw(request):
                        raise _mark(GaveUp(key, sent=False))
                    request.abandoned = request.gave_up = True  # its row is buried
                    raise GaveUp(key, sent=True)
                stall = None
                if request.state == QUEUED:
                    if lane.room(now, patience):
                        self._launch(lane, lane.open(now), now, single, many)
                        continue
                    stall = lane.stall_at(patience)
                ends = [t for t in (until, stall) if t is not None]
                await asyncio.wait(
                    (future,), timeout=max(min(ends) - now, 0.0) + 0.001 if ends else None
                )
        except GaveUp:
            raise
        except BaseException as exc:
            if lane.withdraw(request):
                _mark_unsent(exc)
            elif request.state != DONE:
                request.abandoned = True  # its batch task goes on for the others
            raise
        if request.error is not None:
            raise request.error
        if request.outcome is ALONE:
            return await self._drive(single(args))  # type: ignore[no-any-return]
        return request.outcome  # type: ignore[return-value]

    def _launch(
        self,
        lane: Lane[A, R],
        batch: list[Request[A, R]] | None,
        sent: float,
        single: Callable[[A], Any],
        many: Callable[[list[A]], Any],
    ) -> None:
        if not batch:
            return
        task = asyncio.get_running_loop().create_task(self._send(lane, batch, sent, single, many))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(
        self,
        lane: Lane[A, R],
        batch: list[Request[A, R]] | None,
        sent: float,
        single: Callable[[A], Any],
        many: Callable[[list[A]], Any],
    ) -> None:
        while batch:
            try:
                if len(batch) == 1:
                    outcomes = [await self._drive(single(batch[0].args))]
                else:
                    outcomes = await self._drive(many([r.args for r in batch]))
            except BaseException as exc:
                settle(batch, None, exc, sent)
                if not isinstance(exc, Exception):
                    # This task is cancelled (its loop is closing): the next
                    # batch goes in a task of its own.
                    self._finish(batch)
                    landed = _monotonic()
                    self._launch(lane, lane.landed(sent, landed), landed, single, many)
                    raise
            else:
                settle(batch, outcomes, None, sent)
            now = _monotonic()
            following = lane.landed(sent, now)
            self._finish(batch)
            batch, sent = following, now

    def _finish(self, batch: list[Request[A, R]]) -> None:
        for request in batch:
            if not request.wake.done():
                request.wake.set_result(None)
        if bury(self._store, batch):
            self._wake_cleaner()
