"""Keeping held locks alive, and saying so at once when one is lost.

One :class:`Renewer` thread per manager (started by the first lock it tracks)
extends every held lock once a third of its lease has passed, together with
every other lock that is at most a sixth of its lease from being due, in one
batched statement per dialect (two on MySQL/MariaDB, which has no
``UPDATE … RETURNING``).

A lock is *lost* when

* a renewal finds its row gone or carrying another token (swept, or taken
  over after the lease ran out, for instance while this process was paused);
* renewal keeps failing (database unreachable) until the lease runs out: it is
  retried with backoff, then given up, because past that point another
  process may hold the key;
* its lease runs out without renewal (``renew=False``, or ``max_hold`` reached);
* renewal reaches a server that takes no writes, and again on a fresh
  connection: the process's route to the database leads to a standby (a
  demoted primary behind a single-host URL, a pooler or a virtual IP that did
  not move), so the lock cannot be renewed from here, and waiting for its
  lease to run out would only hide that.

Then, at once: ``held.lost`` turns true, the error is logged with the key, the
lock's ``on_lost`` callback (or the manager's) is handed to the callback
thread (never run here: a slow or failing callback must not delay or stop the
renewal of any other lock), and ``check()`` and ``release()`` raise
:class:`~dblock.LockLost`.

Every pass also checks that each lock's owner (thread or asyncio task) still
runs, and releases with a WARNING a lock whose owner ended without releasing
it. Passes are planned at least once per renewal interval of every lock
(a third of its lease, also for locks that are not renewed), so an abandoned
lock is released within one renewal interval and before its lease ends.

The renewer refers to held locks only weakly: a lock its holder dropped
without releasing is collected, and released here (see ``Locker``).

The lock's hot path pays two dict operations for this (track on acquire,
untrack on release); the thread is not woken unless a newly tracked lock is
due before the thread's next planned wake-up.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from . import _threads
from ._store import Store
from ._store.base import Lease, not_writable
from .callbacks import Callbacks
from .errors import BackendError, SchemaMissing
from .registry import owner_alive, owner_gone_reason

if TYPE_CHECKING:
    from .config import OnLost
    from .telemetry import Recorder

__all__ = ["Renewable", "Renewer"]


class RenewalState(Protocol):
    """A held lock's state the renewal thread reads and writes (``LockRef``
    in :mod:`dblock._held`, a floor above): a weak reference to the lock,
    with its lease's local deadlines and what became of it."""

    key: str
    token: str
    live: bool
    tracked: bool
    deferred: bool
    released: bool
    lost: str | None
    renew_error: str | None
    expires_mono: float
    next_check: float
    holder: Any

    def __call__(self) -> Any: ...


class Renewable(Protocol):
    """What the renewal thread reads and writes of a held lock: the contract
    between this module and the locks it renews (``HeldLock`` in
    :mod:`dblock._held`, a floor above, and the read-write lock's holders).
    The lock's own state is ``state``; the underscored methods are the
    lock's, overridden by the read-write lock's holders, and not API."""

    key: str
    token: str
    ttl: float
    renew: bool
    max_hold: float | None
    on_lost: OnLost | None

    @property
    def state(self) -> RenewalState: ...

    @property
    def remaining(self) -> float: ...

    @property
    def lost(self) -> bool: ...

    def _renewal_ttl(self, now: float) -> float: ...

    def _renewable(self) -> bool: ...

    def _renewed(self, expires_at: datetime, expires_mono: float) -> None: ...

    def _mark_lost(self, reason: str) -> bool: ...


#: The kind of lock one renewer renews (each locker has its own).
L = TypeVar("L", bound=Renewable)

log = logging.getLogger("dblock")

_monotonic = time.monotonic

#: Renew when this fraction of the lease has passed ...
RENEW_AT = 1 / 3
#: ... and take along locks that would be due within this fraction of theirs.
BATCH_WINDOW = 1 / 6
#: A renewal this late (a fraction of the lease, past when it was due) is
#: logged as a WARNING: with the renewal due at a third of the lease, it then
#: runs with at most a third of the lease left.
LATE_AFTER = 1 / 3
#: Retry a failed renewal after at most this long (less when the lease is short).
RETRY_MAX = 1.0
#: Shortest lease renewal will ask for when capped by max_hold.
MIN_RENEWAL = 0.01


def _read_only(exc: BackendError) -> bool:
    """The renewal's statement was refused by a server that takes no writes."""
    cause = exc.__cause__
    return cause is not None and not_writable(getattr(cause, "orig", None) or cause)


class Renewer(Generic[L]):
    """The renewal thread of one manager, and the set of locks it watches."""

    def __init__(
        self,
        store: Store,
        idle_tick: float,
        abandon: Callable[[L, str], None],
        reap: Callable[[], None] | None = None,
        collected: Callable[[Any], None] | None = None,
    ) -> None:
        self._store = store
        self._idle_tick = idle_tick
        # What to do with a lock whose owner ended: the lock facade releases it.
        self._abandon = abandon
        # Pass on the keys of level 1 whose owners can never run again.
        self._reap = reap
        # Release a watched lock nobody can reach any more, given its weak
        # reference: its weak-reference callback posts that as a job, but a
        # signal handler's exception can cut the callback off before it
        # posts (CPython then only prints it), and the key stayed taken.
        self._collected = collected
        # The manager's telemetry recorder, when it reports (set by the lock facade).
        self.telemetry: Recorder | None = None
        # token -> weak reference to the lock: renewal never keeps it alive.
        self._held: dict[str, RenewalState] = {}
        # Work for this thread posted from elsewhere (releasing collected locks).
        self._jobs: deque[Callable[[], object]] = deque()
        self.callbacks = Callbacks()
        # Reentrant: a lock collected while this thread holds the condition
        # posts its release from inside (weak-reference callbacks run anywhere).
        # Taken as ``with self._mutex`` (a lock written in C), never ``with
        # self._cond``: Condition.__enter__ is Python, and a signal handler's
        # exception landing as it returns left the mutex held for good, and
        # renewal stopped for every lock of the process.
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        # When the thread will look next; +inf while it is looking, so that
        # track() during a pass always flags the pass as stale (_dirty).
        self._wake_at = float("inf")
        self._dirty = False
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._losing = threading.Lock()

    # -- called by the lock ------------------------------------------------

    def track(self, held: L) -> None:
        self._held[held.token] = held.state
        # Usually the thread already plans to look before this lock is due
        # (leases are mostly the manager's default): then no wake-up at all.
        if held.state.next_check < self._wake_at:
            self._nudge()

    def untrack(self, held: L) -> bool:
        """Stop watching ``held``; False if it was not watched. One atomic
        ``dict.pop``: of several threads releasing one lock, exactly one wins."""
        return self._held.pop(held.token, None) is not None

    def untrack_token(self, token: str) -> bool:
        return self._held.pop(token, None) is not None

    def post(self, job: Callable[[], object]) -> None:
        """Run ``job`` on the renewal thread soon."""
        self._jobs.append(job)
        self._nudge()

    def ensure_running(self) -> None:
        """Start the thread if it is not running (its passes look after
        level 1 as well: see ``reap``)."""
        if self._thread is None and not self._stopping:
            self._nudge()

    def _nudge(self) -> None:
        if sys.is_finalizing():
            # Nothing runs a job now (a lock collected as its module's
            # globals go: the lease ends it), and the renewal thread, frozen
            # where finalization found it, may hold the mutex for ever.
            return
        with self._mutex:
            # Not while the interpreter finalizes (a lock collected as its
            # module's globals go): such a thread never starts, and start()
            # would wait for it for ever.
            if self._thread is None and not self._stopping and not sys.is_finalizing():
                thread = self._thread = threading.Thread(
                    target=self._run, name="dblock-renewal", daemon=True
                )
                try:
                    _threads.start(thread)
                except RuntimeError:  # no new thread now (interpreter exit)
                    self._thread = None
                    raise
                except BaseException:
                    # Cut off by a signal handler's exception: if the thread
                    # never started, the next nudge must start one (else
                    # renewal never ran again in this process). Once started
                    # it runs until close(), so is_alive() tells.
                    deadline = _monotonic() + 1.0
                    while not thread.is_alive() and _monotonic() < deadline:
                        time.sleep(0.005)
                    if not thread.is_alive():
                        self._thread = None
                    raise
            self._dirty = True
            self._cond.notify()

    @property
    def running(self) -> bool:
        """Is the thread running (it may have work in hand)?"""
        return self._thread is not None and not self._stopping

    @property
    def tracked(self) -> int:
        return len(self._held)

    def held_locks(self) -> list[L]:
        """The locks watched now that are still reachable."""
        found = (ref() for ref in list(self._held.values()))
        return [held for held in found if held is not None]

    # -- life cycle --------------------------------------------------------

    def close(self) -> None:
        with self._mutex:
            self._stopping = True
            thread = self._thread
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(10.0)
        self.run_jobs()  # posted after the thread's last pass
        self.callbacks.close(10.0)

    def after_fork(self) -> None:
        """A forked child holds none of its parent's locks and has no thread."""
        self._held = {}
        self._jobs = deque()
        self.callbacks.after_fork()
        self._mutex = threading.RLock()
        self._cond = threading.Condition(self._mutex)
        self._wake_at = float("inf")
        self._dirty = False
        self._thread = None

    # -- the thread --------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._mutex:
                if not self._dirty and not self._stopping:
                    delay = self._wake_at - _monotonic()
                    if delay > 0:
                        self._cond.wait(delay)
                if self._stopping:
                    self._thread = None
                    return
                self._dirty = False
                self._wake_at = float("inf")
            try:
                plan = self._tick()
            except Exception:  # never let the thread die with locks to watch
                log.exception("dblock: renewal pass failed")
                plan = _monotonic() + RETRY_MAX
            with self._mutex:
                self._wake_at = plan

    def run_jobs(self) -> None:
        while self._jobs:
            try:
                job = self._jobs.popleft()
            except IndexError:
                return
            try:
                job()
            except Exception:
                log.exception("dblock: releasing an abandoned lock failed")

    def _tick(self) -> float:  # noqa: PLR0912 - one branch per state of a watched lock
        """Release what was abandoned, renew what is due, mark what is lost;
        return when to look next."""
        self.run_jobs()
        if self._reap is not None:
            self._reap()
        if self._store.has_orphans:
            self._store.clean_orphans()
        now = _monotonic()
        due: list[L] = []
        next_check = now + self._idle_tick
        for token, ref in list(self._held.items()):
            held = ref()
            if held is None:
                # Collected: its release is posted as a job, unless the
                # weak-reference callback was cut off first (then here).
                if self._collected is not None and getattr(ref, "live", False):
                    self._collected(ref)
                continue
            if not getattr(ref, "live", True):
                # Claimed for release, and the release was cut off before
                # it stopped the watch (a signal handler's exception as
                # untrack started): renewing it would fail for ever, its
                # row gone, at every pass.
                self._held.pop(token, None)
                continue
            if not held.state.deferred and not owner_alive(held.state.holder):
                self._abandon(held, owner_gone_reason(held.state.holder))
                continue
            if held.state.lost is not None:
                continue
            if now >= held.state.expires_mono:
                self.lose(held, self._expired_reason(held))
            elif not held._renewable():
                # Watch it run out, and look at its owner once per renewal interval.
                next_check = min(next_check, held.state.expires_mono, now + held.ttl * RENEW_AT)
            elif held.state.next_check <= now + held.ttl * BATCH_WINDOW:
                due.append(held)
            else:
                next_check = min(next_check, held.state.next_check)
        if due:
            next_check = min(next_check, self._renew(due))
        return next_check

    def _renew(self, due: list[L]) -> float:
        """One batched renewal; returns the earliest retry time if it failed."""
        now = _monotonic()
        batch = self._plan(due, now)
        sent_at = _monotonic()
        watch = _LeaseWatch(self, due)
        try:
            sent = self._send(batch, due)
        except (BackendError, SchemaMissing) as exc:
            retry = now + RETRY_MAX
            for held in due:
                held.state.renew_error = str(exc)
                # Retry well before the lease runs out: a quarter of what is left.
                held.state.next_check = now + min(RETRY_MAX, max(held.remaining / 4, 0.01))
                retry = min(retry, held.state.next_check)
            log.warning("dblock: renewing %d lock(s) failed, will retry: %s", len(due), exc)
            if self.telemetry is not None:
                self.telemetry.renewals(len(due), ok=False)
            return retry
        finally:
            watch.cancel()
        if sent is None:
            return float("inf")  # all lost (see _send)
        leases, sent_at = sent[0], sent[1] or sent_at
        if self.telemetry is not None:
            self.telemetry.renewals(len(leases), ok=True)
        for held in due:
            if self._held.get(held.token) is not held.state:
                # Released while the statement ran. (Also when a hand-off
                # from the fence reserve gave the row, and so its token, to
                # the next local thread meanwhile: that answer is skipped
                # for the new holder, whose next renewal asks again. Safe:
                # the reserve is used only with at least half the lease left
                # by a conservative estimate, so the row cannot have been
                # taken over in between.)
                continue
            lease = leases.get(held.token)
            if lease is None:
                self.lose(held, "its row was gone or held by another owner at renewal")
                continue
            held._renewed(lease.expires_at, sent_at + lease.expires_in)
        return min((h.state.next_check for h in due if h.state.lost is None), default=float("inf"))

    def _plan(self, due: list[L], now: float) -> list[tuple[str, str, float]]:
        """The renewal statement's rows; and how late this pass runs: the
        lock most overdue (locks taken along before they are due count as on
        time), measured and, past a third of its lease, warned of."""
        batch = []
        worst, latest = 0.0, due[0]
        for h in due:
            batch.append((h.key, h.token, h._renewal_ttl(now)))
            if now - h.state.next_check > worst:
                worst, latest = now - h.state.next_check, h
        if self.telemetry is not None:
            self.telemetry.renewal_lateness(worst)
        if worst > latest.ttl * LATE_AFTER:
            self._warn_late(
                latest, worst, sum(now - h.state.next_check > h.ttl * LATE_AFTER for h in due)
            )
        return batch

    def _send(
        self, batch: list[tuple[str, str, float]], due: list[L]
    ) -> tuple[dict[str, Lease], float | None] | None:
        """Send the renewal: its leases and, if it was sent a second time,
        when; None if every lock of ``due`` was lost (a standby answered twice)."""
        try:
            return self._store.renew(batch), None
        except BackendError as first:
            if not _read_only(first):
                raise
        # A standby answered (a demoted primary): the executor dropped that
        # connection and the pool's older ones. Once more, on a fresh
        # connection, which a balancer or a multi-host URL takes to the new primary.
        sent_at = _monotonic()
        try:
            return self._store.renew(batch), sent_at
        except BackendError as again:
            if not _read_only(again):
                raise
            # This process's route leads to a standby, even afresh: it cannot
            # renew these locks, so say so now rather than at the end of their
            # leases (a new primary without our rows, under asynchronous
            # replication, grants them at once).
            for held in due:
                self.lose(
                    held,
                    "renewal reached a server that takes no writes, twice, the second "
                    "time on a fresh connection (a standby: the primary moved and this "
                    f"process's route to the database did not follow): {again}",
                )
            return None

    @staticmethod
    def _warn_late(held: Renewable, late: float, count: int) -> None:
        # Seen on a starved machine (load 7 on 2 cores): renewals ran later
        # and later until leases ran out and the sweeper took live locks.
        others = f" (and {count - 1} more lock(s))" if count > 1 else ""
        log.warning(
            "dblock: renewal of %r%s ran %.2f s late, more than a third of its %g s lease: "
            "this process was paused or starved of CPU; one more such delay and the lock "
            "is lost (choose a longer lease for a loaded machine)",
            held.key,
            others,
            late,
            held.ttl,
        )

    @staticmethod
    def _expired_reason(held: Renewable) -> str:
        if held.state.renew_error is not None:
            return f"its lease ran out while renewal kept failing ({held.state.renew_error})"
        if not held.renew:
            return "its lease ran out (renewal is off for this lock)"
        if held.max_hold is not None:
            return f"it was held longer than max_hold ({held.max_hold:g} s)"
        return "its lease ran out before it could be renewed"

    def lose(self, held: L, reason: str) -> None:
        """Mark ``held`` lost (once), log it and hand its callback to the
        callback thread. Any thread may (the renewal thread, its lease
        watch, a holder's ``check()``): one of them marks it."""
        with self._losing:
            if self._held.get(held.token) is not held.state or not held._mark_lost(reason):
                return
        log.error("dblock: lock %r lost: %s", held.key, reason)
        self.notify_lost(held)

    def notify_lost(self, held: L) -> None:
        if self.telemetry is not None:
            self.telemetry.lost()
        callback = held.on_lost
        if callback is not None:
            self.callbacks.submit(f"on_lost callback for {held.key!r}", callback, held)


class _LeaseWatch:
    """While a renewal statement is out: at each lease end among its locks,
    mark the lock lost if the statement has not come back. A server that
    stops answering without closing anything (frozen, its disk stalled, the
    network black-holed) keeps that statement waiting for ever, and the
    renewal thread with it: the holder must still learn at its lease's end
    (``lost``, ``on_lost``), as the renewal pass would have told it. (A
    timer thread per renewal statement, one per third of a lease at most,
    asleep until the first lease end unless the statement returns first.)"""

    __slots__ = ("_due", "_renewer", "_stop", "_timer")

    def __init__(self, renewer: Renewer[Any], due: list[Any]) -> None:
        self._renewer = renewer
        self._due = due
        self._stop = threading.Event()
        delay = max(min(h.state.expires_mono for h in due) - _monotonic(), 0.0)
        self._timer = threading.Timer(delay, self._watch)
        self._timer.name = "dblock-lease-watch"
        self._timer.daemon = True
        try:
            _threads.start(self._timer)
        except RuntimeError:  # at interpreter exit: no new thread, leases end anyway
            self._stop.set()

    def cancel(self) -> None:
        self._stop.set()
        self._timer.cancel()

    def _watch(self) -> None:
        while not self._stop.is_set():
            now = _monotonic()
            pending = [h for h in self._due if h.state.lost is None and not h.state.released]
            if not pending:
                return
            for held in pending:
                if held.state.expires_mono <= now:
                    self._renewer.lose(
                        held,
                        self._renewer._expired_reason(held)
                        if held.state.renew_error is not None  # failing before this try too
                        else "its lease ran out while its renewal waited for the database's answer",
                    )
            ends = [h.state.expires_mono for h in pending if h.state.expires_mono > now]
            if not ends:
                return
            self._stop.wait(min(ends) - now)
