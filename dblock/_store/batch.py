"""Group commit: the level-2 statements of one process's threads, sent together.

Many threads of one process each locking its own key send one short statement
and one commit apiece; the database's commits (and, on PostgreSQL, its
sequence and notification queue) then bound the grants per second, well
below what a few multi-row statements would carry. The :class:`Batcher` sits
between the lock (:class:`dblock.lock.Locker`) and the store and sends the
requests that meet at the same moment as one statement:

* **Leader and followers, no timer.** A request that finds no statement of
  its kind in flight is sent at once, alone, by the statement a lone request
  always used (one round trip, nothing added). Requests that arrive while a
  statement is in flight queue; when it returns, the oldest of them is woken
  to lead and sends the whole queue as one multi-row statement. So batches
  grow only when the database is the bottleneck, and a lone request pays
  nothing.
* **A lane per kind of statement** (acquires, releases): they never share a
  statement, so a key released and taken again in one batch cannot meet
  itself in one statement. At most one statement of each lane is in
  flight (:data:`DEPTH`), so one or two pooled connections carry a
  process's level-2 traffic.
* **One key once per statement.** A key asked for twice (only possible
  without level 1, ``local_filter=False``) waits for the next batch.
* **Per-request outcomes.** The store's ``*_many_steps`` answers each
  request of the batch on its own (one key held elsewhere fails only that
  key). A batch that fails cleanly (an error answer: nothing was committed)
  is sent again as single statements, one per request, so each request
  sees its own answer (one bad key fails only itself). A batch whose
  outcome is unknown (connection lost in flight, or the leader interrupted
  with the statement sent) gives every request :class:`Interrupted`, which
  each resolves as an ambiguous single statement is resolved today (an
  acquire asks again with its token; a release leaves an orphan to delete).
* **Interruption.** A request interrupted (a signal handler's exception)
  while still queued is withdrawn and was never sent (``never_sent``); one
  interrupted once its batch was sent raises as an interrupted single
  statement does, and the lock deletes its row, if granted, as an orphan.
  A leader interrupted before sending passes the lead on.

The decisions (who leads, what a batch holds, what each request is told)
live in :class:`Lane`, written once; :class:`Batcher` waits with thread
locks, and the asyncio side (``dblock._store.aio``) can wait with futures.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Generic, TypeVar

from .base import Grant, Holder, Interrupted, Store, _mark_unsent, never_sent

__all__ = ["MAX_BATCH", "AsyncBatcher", "Batcher", "Lane", "Request"]

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

# A request's states.
QUEUED: Final = 0  # in its lane's queue: nothing sent, can be withdrawn
LEAD: Final = 1  # woken to send its batch (``batch``), which is not sent yet
SENT: Final = 2  # in a batch being sent: its outcome comes with the batch's
DONE: Final = 3  # ``outcome`` or ``error`` is set

A = TypeVar("A", bound=tuple[Any, ...])
R = TypeVar("R")


class _Alone:
    """Marks a request to be sent again on its own (its batch failed cleanly)."""


ALONE: Final = _Alone()


class Request(Generic[A, R]):
    """One request waiting in a lane; ``wake`` is the face's way to wake it."""

    __slots__ = ("abandoned", "args", "batch", "error", "key", "outcome", "state", "wake")

    def __init__(self, key: str, args: A, wake: Any) -> None:
        self.key = key
        self.args = args
        self.state = QUEUED
        self.batch: list[Request[A, R]] | None = None
        self.outcome: R | _Alone | None = None
        self.error: BaseException | None = None
        self.wake = wake
        # Interrupted while its batch was in flight: nobody takes its outcome.
        self.abandoned = False


class Lane(Generic[A, R]):
    """One kind of statement (acquire, release): whether one is in flight,
    and the requests queued behind it. Every method runs under the owner's
    mutex; none of them waits or sends anything."""

    __slots__ = ("depth", "in_flight", "queue")

    def __init__(self, depth: int = 1) -> None:
        #: Statements of this lane in flight at once, at most.
        self.depth = depth
        self.in_flight = 0
        self.queue: list[Request[A, R]] = []

    @property
    def busy(self) -> bool:
        """No room for another statement: a request now queues."""
        return self.in_flight >= self.depth

    def enter(self) -> bool:
        """True: room for a statement, the caller sends its request alone at once."""
        if self.in_flight >= self.depth:
            return False
        self.in_flight += 1
        return True

    def next_leader(self) -> Request[A, R] | None:
        """The statement in flight returned: the request to lead the next
        batch (its ``batch`` set, to be woken by the caller), or None and the
        lane is idle."""
        queue = self.queue
        if not queue:
            self.in_flight -= 1
            return None
        batch: list[Request[A, R]] = []
        rest: list[Request[A, R]] = []
        seen: set[str] = set()
        for request in queue:
            if request.key in seen or len(batch) >= MAX_BATCH:
                rest.append(request)
            else:
                seen.add(request.key)
                batch.append(request)
                request.state = SENT
        self.queue = rest
        leader = batch[0]
        leader.state = LEAD
        leader.batch = batch
        return leader

    def withdraw(self, request: Request[A, R]) -> bool:
        """Take back a request that was never sent: True if it was still queued."""
        if request.state == QUEUED:
            self.queue.remove(request)
            request.state = DONE
            return True
        return False

    def pass_lead(self, request: Request[A, R]) -> Request[A, R] | None:
        """A leader interrupted before sending: the next member of its batch
        leads it instead (returned, to be woken), or, if it was alone, the
        lane moves on to the next batch."""
        assert request.batch is not None
        batch = [r for r in request.batch if r is not request]
        request.batch = None
        request.state = DONE
        if not batch:
            return self.next_leader()
        leader = batch[0]
        leader.state = LEAD
        leader.batch = batch
        return leader


def settle(
    batch: Sequence[Request[A, R]], outcomes: Sequence[R] | None, exc: BaseException | None
) -> None:
    """Give each request of a batch its outcome: ``outcomes`` (in order), or
    what the batch's failure ``exc`` means for it."""
    if outcomes is not None:
        for request, outcome in zip(batch, outcomes, strict=True):
            request.outcome = outcome
            request.state = DONE
        return
    assert exc is not None
    # An error answer (or one raised before the statement left, such as a
    # parameter the driver cannot encode) committed nothing: each request
    # goes again alone and gets its own answer. A lost connection, or an
    # interruption once the statement may have left, leaves the outcome
    # unknown: each request settles it as a lone statement in doubt does.
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
    """Register as orphans the grants of a returned batch whose requesters
    were interrupted while it was in flight (True if any). The lock
    registered each as an orphan when it raised, but that orphan's DELETE
    may have run before the batch committed and found nothing: register it
    again now that the row exists."""
    buried = False
    for request in batch:
        if request.abandoned and isinstance(request.outcome, Grant):
            store.add_orphan(request.args[0], request.args[1])
            buried = True
    return buried


class Batcher:
    """Group commit for one store, on blocking connections (see the module)."""

    __slots__ = ("_acquires", "_mutex", "_releases", "_store", "_wake_cleaner")

    def __init__(self, store: Store, wake_cleaner: Callable[[], None] = lambda: None) -> None:
        self._store = store
        # Asks for the orphans to be deleted soon (the renewal thread's pass).
        self._wake_cleaner = wake_cleaner
        self._mutex = threading.Lock()
        self._acquires: Lane[tuple[str, str, str, float], Grant | Holder] = Lane(DEPTH)
        self._releases: Lane[tuple[str, str], bool] = Lane(DEPTH)

    @property
    def store(self) -> Store:
        return self._store

    def after_fork(self) -> None:
        """In a forked child: no statement of the parent's is in flight here."""
        self._mutex = threading.Lock()
        self._acquires = Lane(DEPTH)
        self._releases = Lane(DEPTH)

    # The store's own signatures: the lock calls these instead of the store's.

    def try_acquire(self, key: str, token: str, owner: str, ttl: float) -> Grant | Holder:
        return self._submit(
            self._acquires,
            key,
            (key, token, owner, ttl),
            self._store.try_acquire,
            self._many_acquires,
        )

    def release(self, key: str, token: str) -> bool:
        return self._submit(
            self._releases, key, (key, token), self._store.release, self._many_releases
        )

    def _many_acquires(self, requests: list[tuple[str, str, str, float]]) -> list[Grant | Holder]:
        return self._store.drive(self._store.acquire_many_steps(requests))

    def _many_releases(self, requests: list[tuple[str, str]]) -> list[bool]:
        return self._store.drive(self._store.release_many_steps(requests))

    def _submit(
        self,
        lane: Lane[A, R],
        key: str,
        args: A,
        single: Callable[..., R],
        many: Callable[[list[A]], list[R]],
    ) -> R:
        mutex = self._mutex
        request: Request[A, R] | None
        with mutex:
            if lane.enter():
                request = None
            else:
                wake = threading.Lock()
                wake.acquire()
                # (Not Request[A, R](...): calling a subscripted generic goes
                # through typing, several µs per request.)
                request = Request(key, args, wake)
                lane.queue.append(request)
        if request is None:
            try:
                return single(*args)
            finally:
                self._next(lane)
        try:
            request.wake.acquire()  # released when we lead, or when our outcome is in
        except BaseException as exc:
            with mutex:
                if lane.withdraw(request):
                    _mark_unsent(exc)
                    raise
                leader = lane.pass_lead(request) if request.state == LEAD else None
                if leader is not None:
                    _mark_unsent(exc)  # we never sent it: the next member does
                request.abandoned = True
            if leader is not None:
                leader.wake.release()
            raise  # sent with a batch: the lock treats it as an interrupted statement
        if request.state == LEAD:
            self._lead(lane, request, single, many)
        if request.error is not None:
            raise request.error
        if request.outcome is ALONE:
            return single(*args)
        return request.outcome  # type: ignore[return-value]

    def _lead(
        self,
        lane: Lane[A, R],
        leader: Request[A, R],
        single: Callable[..., R],
        many: Callable[[list[A]], list[R]],
    ) -> None:
        batch = leader.batch
        assert batch is not None
        leader.batch = None
        try:
            alone = len(batch) == 1
            outcomes = [single(*leader.args)] if alone else many([r.args for r in batch])
        except BaseException as exc:
            if len(batch) == 1:
                leader.state = DONE
                raise  # a lone statement: its error is its own, as without batching
            settle(batch, None, exc)
            if not isinstance(exc, Exception):
                raise  # the leader's own interruption (the others were told above)
        else:
            settle(batch, outcomes, None)
        finally:
            # The next batch first: it is on the critical path of every request
            # queued behind it, while ours only need waking.
            self._next(lane)
            for request in batch:
                if request is not leader:
                    request.wake.release()
            self._bury(batch)

    def _bury(self, batch: Sequence[Request[A, R]]) -> None:
        if bury(self._store, batch):
            self._wake_cleaner()

    def _next(self, lane: Lane[A, R]) -> None:
        with self._mutex:
            leader = lane.next_leader()
        if leader is not None:
            leader.wake.release()


def batches(store: Store) -> bool:
    """Whether ``store``'s dialect can answer many requests in one statement."""
    return type(store).acquire_many_steps is not Store.acquire_many_steps


# An event loop's acquire and release lanes.
_Lanes = tuple[Lane[Any, Any], Lane[Any, Any]]


class AsyncBatcher:
    """Group commit for asyncio tasks: the same lanes and rules as
    :class:`Batcher`, waiting with futures instead of thread locks. Only the
    waiting differs: a batch is sent by a task of its own rather than by its
    oldest request, so cancelling any request (its leader's included) never
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

    async def try_acquire(self, key: str, token: str, owner: str, ttl: float) -> Grant | Holder:
        store = self._store
        result: Grant | Holder = await self._submit(
            self._lanes_here()[0],
            key,
            (key, token, owner, ttl),
            lambda args: store.acquire_steps(*args),
            store.acquire_many_steps,
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
        )
        return result

    async def _submit(
        self,
        lane: Lane[A, R],
        key: str,
        args: A,
        single: Callable[[A], Any],
        many: Callable[[list[A]], Any],
    ) -> R:
        if lane.enter():
            try:
                return await self._drive(single(args))  # type: ignore[no-any-return]
            finally:
                self._next(lane, single, many)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        request: Request[A, R] = Request(key, args, future)
        lane.queue.append(request)
        try:
            await future
        except BaseException as exc:
            if lane.withdraw(request):
                _mark_unsent(exc)
            else:
                request.abandoned = True  # its batch task goes on for the others
            raise
        if request.error is not None:
            raise request.error
        if request.outcome is ALONE:
            return await self._drive(single(args))  # type: ignore[no-any-return]
        return request.outcome  # type: ignore[return-value]

    def _next(
        self, lane: Lane[A, R], single: Callable[[A], Any], many: Callable[[list[A]], Any]
    ) -> None:
        leader = lane.next_leader()
        if leader is None:
            return
        batch = leader.batch
        assert batch is not None
        leader.batch = None
        leader.state = SENT
        task = asyncio.get_running_loop().create_task(self._send(lane, batch, single, many))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(
        self,
        lane: Lane[A, R],
        batch: list[Request[A, R]],
        single: Callable[[A], Any],
        many: Callable[[list[A]], Any],
    ) -> None:
        alone = len(batch) == 1
        try:
            if alone:
                outcomes = [await self._drive(single(batch[0].args))]
            else:
                outcomes = await self._drive(many([r.args for r in batch]))
        except BaseException as exc:
            if alone:  # a lone statement: its error is its own, as without batching
                batch[0].error = exc
                batch[0].state = DONE
            else:
                settle(batch, None, exc)
            if not isinstance(exc, Exception):
                raise
        else:
            settle(batch, outcomes, None)
        finally:
            self._next(lane, single, many)
            for request in batch:
                if not request.wake.done():
                    request.wake.set_result(None)
            if bury(self._store, batch):
                self._wake_cleaner()
