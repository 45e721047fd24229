"""What every part of the blocking lock shares: the records an acquire
and a release pass between them (a queued thread's :class:`Ticket`, what
an interrupted acquire owned, :class:`Custody`), the lease shares they
decide by, and :class:`LockerBase`, the locker's state and the level-1
custody its parts build on (keep a granted row, claim a release, pass a
key on, delete a row at best effort).

``dblock.lock.Locker`` is assembled from the parts, one module each:
the lone request's path (:mod:`dblock._alone`), the exclusive row's
acquire loop (:mod:`dblock.kinds.exclusive`), hand-off between local
threads (:mod:`dblock._handoff`), the lock's life after its grant and the
clean-up of locks nobody releases (:mod:`dblock._lifecycle`), and the
blocking step driver (:mod:`dblock._drive`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from ._driver import Ops
from ._held import Custodian, HeldLock, LockOptions, LockRef
from ._store import Grant, Holder, Store
from ._store.base import Steps
from ._store.batch import Batcher
from ._store.fair import Seat, fair_sql
from ._store.jobs import statements as job_statements
from .config import UNSET, Config, Unset
from .errors import BackendError, SchemaMissing
from .keys import db_text
from .registry import (
    Entry,
    Registry,
    ThreadOwner,
    Waiter,
)
from .renewal import Renewer
from .steps import (
    Op,
    Release,
    Run,
    noop,
)

if TYPE_CHECKING:
    from .telemetry import Recorder

log = logging.getLogger("dblock")

_current_thread = threading.current_thread


# After a statement was cut off mid-flight we ask again, with the same token,
# this many times (waiting 50, 100, 200 ms) before giving up on learning the
# outcome and leaving the row to be deleted as soon as the database answers.
AMBIGUITY_RETRIES = 3

# A hand-off without SQL keeps the row's lease as it is: only while at least
# this share of it is left (renewal, at RENEW_AT, is not far behind).
RESERVE_LEASE = 0.5

# A grant whose statement came back with less than this share of its lease
# left (by this process's clock, counted from when it was sent) is not handed
# back: its row is deleted and the request goes on as if refused. The caller
# would start work under a lease that has run out, or would before renewal
# could reach the database (an overloaded machine, a statement held up).
LIVE_LEASE = 0.1

# When a run of hand-offs ends (``handoff_limit``) the row is deleted and the
# next local thread gives way before it tries the row: for this many times
# the DELETE's own round trip, at least GIVE_WAY_MIN and at most
# GIVE_WAY_MAX seconds. A waiter of another process, woken by the release
# (NOTIFY, or dblock._store.wake), needs about a round trip to be told and one
# to take the row; without the pause the local thread, woken by a mutex and
# one round trip from the row, won that race nearly every time, and the
# other processes never had their turn.
GIVE_WAY_RTTS = 4

GIVE_WAY_MIN = 0.005

GIVE_WAY_MAX = 0.05


class GiveWay:
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


class Custody:
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


class Ticket:
    """What a queued thread asks for, so its predecessor can hand it the row
    (or, ``seats``: a fair request, take its place in the database's queue)."""

    __slots__ = ("options", "owner", "seats", "ttl")

    def __init__(self, owner: str, ttl: float, options: LockOptions, seats: bool) -> None:
        self.owner = owner
        self.ttl = ttl
        self.options = options
        self.seats = seats


if TYPE_CHECKING:
    # (For the type checker: a locker is what a held lock calls back.)
    _Contract = Custodian
else:
    _Contract = object


class LockerBase(_Contract):
    """The locker's state and level-1 custody, shared by its parts (see the
    module's docstring). What the parts call of each other is declared
    below for the type checker; each is defined once, in its part."""

    # Set by ``Locker.__init__``.
    store: Store
    config: Config
    registry: Registry
    renewer: Renewer[HeldLock]
    #: What sends the row statements of this process's threads: the
    #: batcher (group commit, dblock._store.batch) where the dialect can
    #: answer many requests in one statement, else the store itself.
    batcher: Batcher | None
    telemetry: Recorder | None
    #: The ``kind`` of the rows this locker writes; a holder row of another
    #: kind means the key is used as another kind of lock.
    kind: str
    #: What a grant becomes (a subclass for other kinds of lock).
    held_type: type[HeldLock]
    #: The process whose locks these are: a forked child holds none of
    #: them, and must never release its parent's rows at its own exit.
    pid: int
    #: The weak-reference callback of every held lock, bound once (not per lock).
    collect: Callable[[LockRef], None]
    #: Level 1 on (``local_filter``): requests of this process queue here first.
    local: bool
    _closing: bool
    #: Where the row statements go: the batcher, else the store itself.
    rows: Batcher | Store
    #: What each step of a lock operation does on the blocking face.
    ops: Ops
    _client_id: str
    # What release_at_exit claimed, and the tokens whose release it posted.
    _exit_candidates: list[HeldLock]
    _exit_posted: set[str]

    if TYPE_CHECKING:
        # What the parts call of each other beyond the holder's calls (the
        # Custodian protocol, declared there): each defined once, in its part.

        def run(self, steps: Op[T]) -> T: ...

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
        ) -> Op[HeldLock]: ...

        def _forget_left_behind(self, key: str, me: object) -> Op[None]: ...

        def _give_back(self, held: HeldLock) -> Op[None]: ...

        @property
        def _run_limit(self) -> int: ...

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

    def _keep(self, entry: Entry, held: HeldLock) -> None:
        """A granted row becomes the key's at level 1, and renewal watches it."""
        entry.held = held.state
        if self._run_limit:
            # No hand-off: the entry (alive while local threads queue) counts
            # its row grants in a row instead, so a run of them ends too.
            entry.handoffs += 1
        else:
            entry.handoffs = 0
        self.renewer.track(held)
        held.state.tracked = True

    def _claim(self, held: HeldLock) -> bool:
        """Take the job of releasing ``held``: True for exactly one of the
        holder, the renewal thread and ``close()`` (see _let_go)."""
        ref = held.state
        if not ref.live:
            return False  # somebody else claimed it first
        ref.live = False  # (no call since the test: see _let_go)
        self.renewer.untrack(held)
        return True

    def _leave(self, entry: Entry, grace: float | None = None, owner: object = None) -> None:
        """Pass level 1 on (the next thread acquires the row itself, after
        ``grace`` seconds if given: see GiveWay) or forget the key.

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
        if not self.local:
            return
        grant = None if grace is None else GiveWay(grace)
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

    def _finish_leave(self, entry: Entry, grant: GiveWay | None, owner: object) -> None:
        """What :meth:`_leave` left undone when it was cut off: the key not
        passed on yet, or passed on to a thread not woken yet."""
        waiter = self.registry.leave(entry, owner)  # (nothing if passed on already)
        if waiter is not None:
            waiter.wake(grant)
        elif entry.heir is not None and not entry.heir.ready:
            entry.heir.wake(grant)

    def _delete_row(self, key: str, token: str) -> Op[None]:
        """Best effort: delete the row if it carries ``token``, and never
        leave it behind for longer than the database takes to answer again."""
        try:
            yield Release(key, token)
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

    def _leave_queue(self, key: str, token: str) -> Op[None]:
        """Best effort, as :meth:`_delete_row`: delete a fair request's rows."""
        try:
            yield Run(fair_sql(self.store).leave_steps(key, token))
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

    def _settle(self, held: HeldLock, keep: float = 0.0) -> Callable[[], Steps[bool]] | None:
        """How the orphan clean-up settles ``held``'s rows after a release
        that failed or was cut off: a job's release was to keep its row for
        at_least, and so is the clean-up; a fair holder's queue row goes with
        its head (MariaDB keeps it to the release); else the DELETE."""
        if keep:
            return partial(
                job_statements(self.store).keep_steps, held.key, held.token, keep, held.owner
            )
        if held.state.fair:
            return partial(fair_sql(self.store).leave_steps, held.key, held.token)
        return None
