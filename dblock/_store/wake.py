"""Wake-ups without NOTIFY: how a waiter of another process learns that the
key it waits for was released, on MySQL/MariaDB and SQLite.

PostgreSQL has LISTEN/NOTIFY (``postgresql.Listener``); these databases do
not, and their waiters used to find out only by asking again on a timer.
A :class:`Waker` is the same kind of object as that listener (one per
store, shared by the process's waiting threads and tasks; ``attach``,
``subscribe``, ``unsubscribe``, ``covers``), so the blocking side's
:class:`WokenWait` and the asyncio side's waiter both sleep on an event it
sets. How it learns of a release is the dialect's:

* MySQL/MariaDB (:class:`NamedLockWaker`): the holder's process holds a
  named lock (``GET_LOCK``) per key it holds, on a connection of its own;
  a waiting process blocks on that name (``GET_LOCK`` with a timeout, then
  ``RELEASE_LOCK`` at once) on one of a few connections of its own, and
  the release lets the name go after its ``DELETE`` committed.
* SQLite (:class:`SocketWaker`): a waiting process registers the key with
  a read lock on one byte of a side file (``<database>-dblock/waiters``,
  the byte's offset a hash of the table and key); a release looks for such
  a lock after its ``DELETE`` committed and, if some process holds one,
  sends the key as a datagram to each waiting process's socket in that
  directory.

The row stays the only truth: a wake-up only says "look again", a lost one
costs at most the poll it replaces, and nothing about exclusion depends on
a named lock, a file lock or a socket.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import math
import os
import random
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from .. import _threads
from ..config import Config
from .base import Backoff, Steps, Store, Wait, recheck_every

log = logging.getLogger("dblock")

_monotonic = time.monotonic


class Settable(Protocol):
    """A waiter's event: ``threading.Event`` or the asyncio side's."""

    def set(self) -> None: ...


def name_hash(*parts: str) -> str:
    """A key's fixed-length name (GET_LOCK names are at most 64 characters)."""
    return hashlib.sha1("\x00".join(parts).encode(), usedforsecurity=False).hexdigest()


class Waker:
    """Subscriptions per key and the safety nets every dialect shares.

    A key is *watched* (the dialect learns of its releases) or *polled*: a
    key nobody announces (a kind of lock whose release does not wake, say,
    or more keys than the dialect can watch at once) is rung on a timer
    instead, with the polling waiter's capped exponential backoff, so
    whoever sleeps on the event never waits longer than polling would
    have. Releases rung in the last :attr:`RECENT` seconds are remembered:
    one that slipped between a waiter's attempt and its subscription still
    wakes it."""

    RECENT = 2.0

    def hot(self, key: str, ends_run: bool = False) -> None:
        """``key`` is released while local threads wait (see Store.hot)."""

    def others_wait(self, key: str) -> bool:
        """Whether another process was seen waiting for ``key`` (see Store.others_wait)."""
        return False

    def waiting_steps(self, key: str) -> Steps[bool] | None:
        """A statement asking whether another process waits for ``key`` now
        (see Store.others_wait_steps); None where nobody can tell."""
        return None

    def __init__(self, config: Config) -> None:
        self._poll_initial = config.poll_initial
        self._poll_max = config.poll_max
        self._mutex = threading.Lock()
        self._subs: dict[str, set[Settable]] = {}
        self._recent: dict[str, float] = {}
        self._recent_pruned = 0.0
        # Keys rung on a timer: key -> (when next, current step).
        self._polled: dict[str, tuple[float, float]] = {}
        self._timer: threading.Thread | None = None
        self._timer_cond = threading.Condition(self._mutex)
        self._closed = False
        #: Keys whose last attempt found them held by an exclusive holder,
        #: whose release the dialect announces (see :meth:`expect`).
        self._expected: dict[str, None] = {}
        #: Wake-ups dispatched (releases heard), for tests and the bench.
        self.received = 0

    # -- what the waiters see (the PostgreSQL listener's interface) ---------

    @property
    def listening(self) -> bool:
        return not self._closed

    def subscribe(self, key: str, since: float) -> Bell:
        event = Bell()
        try:
            self.attach(key, since, event)
        except BaseException:
            # (Interrupted as attach returned: the caller never gets the event.)
            self.unsubscribe(key, event)
            raise
        return event

    def expects(self, key: str) -> bool:
        """Whether a release of ``key`` is announced to this waker (see
        :meth:`expect`), so a waiter needs no statement to learn of it."""
        return key in self._expected

    def attach(self, key: str, since: float, event: Settable) -> None:
        with self._mutex:
            events = self._subs.get(key)
            first = events is None
            if events is None:
                events = self._subs[key] = set()
            events.add(event)
            missed = self._recent.get(key, -1.0) >= since
            watched = key in self._expected
            self._expected.pop(key, None)
        again = False
        try:
            if first:
                again = self._watch(key) if watched else False
                if not watched or not self.covers(key):
                    self._poll(key)
        except BaseException:
            # (A signal handler's exception, say.) The caller never gets
            # its wait, so never unsubscribes: a key left subscribed would
            # be probed, and taken for a waited-for key, for ever.
            self.unsubscribe(key, event)
            raise
        if missed or again:
            event.set()

    def unsubscribe(self, key: str, event: Settable) -> None:
        with self._mutex:
            events = self._subs.get(key)
            if events is None:
                return
            events.discard(event)
            if events:
                return
            del self._subs[key]
            self._polled.pop(key, None)
        self._unwatch(key)

    def covers(self, key: str) -> bool:
        """Whether a release of ``key`` wakes its waiters now (else they poll)."""
        return False

    def recheck_every(self, every: float) -> float:
        """How often a woken waiter looks again unwoken (see base.recheck_every)."""
        return recheck_every(every, len(self._subs))

    def take_handed(self, address: str) -> int | None:
        return None  # fair-queue hand-overs are not announced here

    def expect(self, key: str) -> None:
        """An exclusive acquire of ``key`` found it held by an exclusive
        holder: if a waiter follows, its release will be announced. (The
        other kinds' releases are not: their waiters poll.)"""
        expected = self._expected
        if len(expected) > 10_000:  # attempts no waiter followed (non-blocking, timed out)
            expected.clear()
        expected[key] = None

    def waiting(self, key: str) -> bool:
        return key in self._subs

    # -- for the dialects ----------------------------------------------------

    def _watch(self, key: str) -> bool:
        """Start learning of ``key``'s releases; True if its waiters must
        look again once that is in place (a release may have slipped by)."""
        return False

    def _unwatch(self, key: str) -> None:
        pass

    def ring(self, key: str) -> None:
        """``key`` was released (or may have been): its waiters look again."""
        now = _monotonic()
        with self._mutex:
            self.received += 1
            if now - self._recent_pruned > self.RECENT:
                self._recent = {k: t for k, t in self._recent.items() if now - t < self.RECENT}
                self._recent_pruned = now
            self._recent[key] = now
            events = list(self._subs.get(key, ()))
        for event in events:
            event.set()

    def _poll(self, key: str) -> None:
        """Ring ``key`` on the polling waiter's schedule while it is waited for."""
        with self._mutex:
            if self._closed or key not in self._subs:
                return
            self._polled[key] = (_monotonic() + _jitter(self._poll_initial), self._poll_initial)
            timer = self._timer
            if timer is None or not timer.is_alive():
                # (Not alive: made, but an exception came before it started.)
                timer = self._timer = threading.Thread(
                    target=self._run_timer, name="dblock-wake-timer", daemon=True
                )
                _threads.start(timer)
            self._timer_cond.notify()

    def _unpoll(self, key: str) -> None:
        with self._mutex:
            self._polled.pop(key, None)

    def _run_timer(self) -> None:
        with self._mutex:
            while not self._closed:
                now = _monotonic()
                due = [k for k, (at, _) in self._polled.items() if at <= now]
                for key in due:
                    _, step = self._polled[key]
                    step = min(step * 2, self._poll_max)
                    self._polled[key] = (now + _jitter(step), step)
                if due:
                    self._mutex.release()
                    try:
                        for key in due:
                            for event in list(self._subs.get(key, ())):
                                event.set()
                    finally:
                        self._mutex.acquire()
                    continue
                nearest = min((at for at, _ in self._polled.values()), default=now + 1.0)
                self._timer_cond.wait(max(nearest - now, 0.0))
            if self._timer is threading.current_thread():
                self._timer = None

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            self._timer_cond.notify_all()
            events = [e for subs in self._subs.values() for e in subs]
        for event in events:  # they poll from here on
            event.set()


def _jitter(step: float) -> float:
    return step / 2 + random.random() * step / 2


class Bell:
    """A blocking waiter's event, as ``threading.Event`` but safe to
    interrupt: set while its lock is free. ``Event.wait`` enters its
    condition through ``Condition.__enter__``, a Python frame: a signal
    handler's exception as that frame returned (a point where CPython runs
    handlers) left the event's lock held, and the next ``set()``, from a
    thread of the waker (a probe's, the timer's), blocked for ever. Here
    ``set`` never blocks and ``wait`` holds nothing when it returns."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()  # clear

    def set(self) -> None:
        with contextlib.suppress(RuntimeError):  # set already
            self._lock.release()

    def clear(self) -> None:
        self._lock.acquire(False)

    def is_set(self) -> bool:
        return not self._lock.locked()

    def wait(self, timeout: float | None = None) -> bool:
        """Until set, or ``timeout`` seconds; whether it was set."""
        if not self._lock.acquire(True, -1 if timeout is None else max(timeout, 0.0)):
            return False
        self.set()  # (still set: only clear() clears)
        return True


class WokenWait(Wait):
    """A blocking waiter woken by a :class:`Waker`, with the safety nets of
    ``NotifyWait``: the caller's cap at the holder's expiry, a periodic
    re-check, and polling while the key is not covered."""

    __slots__ = ("_backoff", "_event", "_key", "_recheck", "_waker")

    def __init__(self, waker: Waker, key: str, since: float, config: Config) -> None:
        self._waker = waker
        self._key = key
        self._recheck = config.notify_recheck
        self._backoff = Backoff(config.poll_initial, config.poll_max)
        self._event = event = Bell()
        try:
            waker.attach(key, since, event)
        except BaseException:
            # (Interrupted as attach returned: no caller will close us.)
            waker.unsubscribe(key, event)
            raise

    def prepare(self) -> None:
        self._event.clear()

    def sleep(self, limit: float) -> None:
        if not self._waker.listening:
            time.sleep(self._backoff.step(limit))
        elif not self._waker.covers(self._key):
            self._event.wait(self._backoff.step(limit))
        else:
            self._event.wait(min(limit, self._waker.recheck_every(self._recheck)))

    def close(self) -> None:
        self._waker.unsubscribe(self._key, self._event)


# -- MySQL/MariaDB: named locks ------------------------------------------------

#: A waiting process's probe of a key's name ``n``: -1 if nobody holds the
#: name (no evidence of a holder: look again, then poll), 1 once its holder
#: let it go (a release), 0 at the timeout. Before it blocks it takes the
#: key's waiter name ``w`` (without waiting: one waiter of the key holds it
#: at a time), so a holder letting ``n`` go sees that somebody waits (see
#: NamedLockWaker.others_wait). Both are let go at once, left to right in the
#: select list (``IF`` fixes the order within the first), so a new holder
#: can take ``n``.
PROBE_SQL = (
    "SELECT IF(IS_USED_LOCK(%(n)s) IS NULL, -1,"
    " IF(GET_LOCK(%(w)s, 0) IS NULL, GET_LOCK(%(n)s, %(t)s), GET_LOCK(%(n)s, %(t)s))),"
    " RELEASE_LOCK(%(n)s), RELEASE_LOCK(%(w)s)"
)


# KILL's answers: no such session (gone already); not ours to kill.
_NO_SUCH_THREAD = 1094
_NO_SUCH_COLUMN = 1054
_NOT_OWNER = (1095, 1227)


class NamedLockWaker(Waker):
    """MySQL/MariaDB: the holder's process holds a named lock per key it
    holds; a waiting process blocks on it.

    Holder side: one connection per store (:meth:`took`, :meth:`let_go`),
    served by a thread that sends the names to take and to let go as one
    ``SELECT GET_LOCK(…, 0), …, RELEASE_LOCK(…)``: a lock held and released
    before the thread got to it costs no statement at all. A name is let go
    only after the release's ``DELETE`` returned (committed). A name it
    cannot take at once (a waiter's probe holds it for an instant) is tried
    again shortly while the key is still held.

    Waiter side: up to ``slots`` connections, each serving one key at a
    time (only the level-1 winner of a key waits at level 2, so one per key
    per process): ``PROBE_SQL`` with the timeout ``notify_recheck``. A key
    beyond them is polled. The race between a waiter's arrival and a
    release: the probe runs after the waiter's attempt found the row held;
    if the name is free then (released since, or not yet taken by the new
    holder) the waiter is told to look again and the key is polled with
    backoff until a probe finds the name held, which then wakes it at the
    release. So no release is missed, and a name that is never taken (a
    holder on another Galera node, an older dblock) costs only polling.
    A slot whose key nobody waits for any more ends its probe at the next
    release of that key or at its timeout, then serves the next key.
    """

    SLOTS = 8
    #: A key nobody of this process waited for is named once held this long.
    GRACE = 0.005
    #: ... unless it was released while local threads waited less than this long ago.
    HOT = 1.0
    LINGER = 30.0  # a slot's idle connection is closed after this long
    #: A hot key's name kept through a release is let go if no local grant
    #: took the key again within this long (its waiters gave up).
    KEEP = 0.05
    #: The longest pause between probes that found the name free, while the
    #: key's holders are known to name it (see _serve): a few GRACEs.
    RACE_CAP = 0.02
    #: A session holding the name of a key we hold, idle on the server this
    #: long, is a former holder's that cannot let it go (a stopped process):
    #: killed (see _settle).
    STALE = 0.5
    #: How long a try at a name finds it held before that session's idle
    #: time is asked (a probe's instant, a running holder's lag: not asked).
    SUSPECT = 0.05
    #: The longest pause between tries at a name held by another session.
    BLOCKED_RETRY = 1.0
    #: How often the keys beyond the slots are looked at (see _run_looker),
    #: and how many names one statement asks for.
    LOOK_EVERY = 0.04
    LOOK_CHUNK = 500

    def __init__(
        self,
        connect: Callable[[], Any],
        scope: str,
        config: Config,
        *,
        slots: int = SLOTS,
    ) -> None:
        super().__init__(config)
        self._connect = connect
        self._scope = scope  # the database and table: names are server-wide
        self._timeout = config.notify_recheck
        self._names: dict[str, str] = {}
        # Holder side (guarded by _hmutex).
        # MariaDB's idle time in milliseconds (MySQL has seconds only).
        self._idle_ms = "TIME_MS"
        # Entered as ``with self._hlock`` (a lock's C-level __enter__), never
        # ``with self._hmutex``: Condition.__enter__ is a Python frame, and a
        # signal handler's exception as it returned left the lock held, every
        # grant of the process then blocked in took() (see Bell). Reentrant:
        # the garbage collector may finalize an abandoned statement's steps
        # (whose clean-up lets a name go) on the names thread while it holds
        # this lock, which then waited for itself for ever.
        self._hlock = threading.RLock()
        self._hmutex = threading.Condition(self._hlock)
        self._want: dict[str, float] = {}  # key -> when to take its name (monotonic)
        self._have: set[str] = set()
        self._drop: set[str] = set()
        # key -> when to let its kept name go (0.0: not let go yet): see hot().
        self._keep: dict[str, float] = {}
        # key -> when it was last released while local threads waited (hot()).
        self._hot: dict[str, float] = {}
        # key -> when a waiter of another process last had its name granted
        # as ours was let go (others_wait()).
        self._waited: dict[str, float] = {}
        # key -> (the session that held its name when ours could not take
        # it, since when in this hold of ours it was seen holding it): see
        # _settle.
        self._blocked: dict[str, tuple[int, float]] = {}
        self._suspects: set[int] = set()  # sessions to kill if idle STALE (next pass)
        self._can_kill = True  # until the server says we may not
        self._holder: threading.Thread | None = None
        # When the holder thread wakes by itself (inf: only when told; -inf:
        # it is awake and looks at everything before it sleeps again). A new
        # name due no earlier needs no wake-up: a loop of short lone holds
        # woke the thread at every grant, only for it to sleep until GRACE.
        self._wake_at = math.inf
        # Waiter side (guarded by self._mutex): key -> its slot, and the slots.
        self._slots: list[_Slot] = []
        self._max_slots = slots
        self._slot_of: dict[str, _Slot] = {}
        # Keys beyond the slots: key -> the session seen holding its name at
        # the last look (0: nobody; None: not looked at yet). See _run_looker.
        self._looked: dict[str, int | None] = {}
        self._looker: threading.Thread | None = None
        self._look_cond = threading.Condition(self._mutex)
        #: Statements sent on the waker's own connections (names taken and
        #: let go; probes), which the engine's listeners do not see.
        self.statements = 0

    def name(self, key: str) -> str:
        """``key``'s name, held by its holder's process (server-wide, so
        the database and table are in the hash; 47 characters of MySQL's 64)."""
        name = self._names.get(key)
        if name is None:
            if len(self._names) > 10_000:
                self._names.clear()
            name = self._names[key] = "dblock:" + name_hash(self._scope, key)[:40]
        return name

    @staticmethod
    def waiter_name(name: str) -> str:
        """The name a waiter of another process holds while it blocks on ``name``."""
        return "dblock;" + name[7:]

    # -- holder side -----------------------------------------------------------

    def took(self, key: str) -> None:
        with self._hlock:
            if self._closed:
                return
            # A key this process waited for, or released within HOT seconds
            # while local threads waited (hot: others likely wait too), is
            # named at once, so a waiter of another process that
            # lost the race for it finds the name held when it looks again;
            # any other only once held for GRACE, so a short lone hold (a
            # loop on one key included) costs no statement (a waiter
            # meanwhile polls).
            now = _monotonic()
            hot = key in self._subs or now - self._hot.get(key, -self.HOT) < self.HOT
            due = now + (0.0 if hot else self.GRACE)
            self._blocked.pop(key, None)  # (a new hold)
            holder = self._holder
            if holder is None or not holder.is_alive():
                # (Not alive: made, but an exception came before it started.)
                holder = self._holder = threading.Thread(
                    target=self._run_holder, name="dblock-names", daemon=True
                )
                _threads.start(holder)
            if due < self._wake_at:
                self._hmutex.notify()  # (it runs once we let go of the lock)
            self._want[key] = due
            self._drop.discard(key)
            self._keep.pop(key, None)  # named still: taken again by its next grant

    def hot(self, key: str, ends_run: bool = False) -> None:
        with self._hlock:
            if len(self._hot) > 10_000:
                self._hot.clear()
            self._hot[key] = _monotonic()
            # The next local grant follows at once: the name stays ours
            # through this release (see let_go), unless the release gives
            # way to the other processes, whose waiters block on the name.
            # Dropped at each release and taken again at each grant, a hot
            # key's name was free at most moments a waiter looked (the
            # names thread starved of the GIL by the local threads), the
            # waiter fell back to polling, and it missed runs by the hundred.
            if ends_run:
                self._keep.pop(key, None)
            else:
                self._keep[key] = 0.0  # (due once let go: see let_go)

    def waiting_steps(self, key: str) -> Steps[bool] | None:
        # A hot key's name stays ours across local grants, so no release of
        # it shows a waiter for as long: ask for its waiter name directly,
        # on the store's connection (names are server-wide).
        if not self.listening:
            return None
        return self._waiting_steps(key)

    def _waiting_steps(self, key: str) -> Steps[bool]:
        w = self.waiter_name(self.name(key))
        (owner,) = (yield "SELECT IS_USED_LOCK(%(w)s)", {"w": w}, True, False).rows[0]
        if owner is None:
            return False
        if len(self._waited) > 10_000:
            self._waited.clear()
        self._waited[key] = _monotonic()
        return True

    def others_wait(self, key: str) -> bool:
        """Whether a session of another process was seen waiting for
        ``key``'s name in the last :attr:`HOT` seconds: its waiter name was
        held as ours was let go (``IS_USED_LOCK`` in the statement of the
        ``RELEASE_LOCK``, which costs nothing more)."""
        seen = self._waited.get(key)
        return seen is not None and _monotonic() - seen < self.HOT

    def let_go(self, key: str) -> None:
        with self._hlock:
            if key in self._keep:
                # Kept (or still to be taken) for the next local grant (see
                # hot); let go after all if none comes within KEEP (it gave up).
                self._keep[key] = _monotonic() + self.KEEP
                self._hmutex.notify()
                return
            self._want.pop(key, None)
            if key in self._have:
                self._drop.add(key)
                self._hmutex.notify()
                return
            # Never named: a stale session may still hold the name, and the
            # waiters of other processes block on it, not knowing of this
            # release. Killed, it lets them go (see _settle).
            seen = self._blocked.pop(key, None)
            if seen is not None and self._can_kill:
                self._suspects.add(seen[0])
                self._hmutex.notify()

    def _run_holder(self) -> None:  # noqa: PLR0912, PLR0915 - the thread's loop
        conn: Any = None
        delay = 0.05
        while True:
            with self._hlock:
                while not self._closed:
                    now = _monotonic()
                    for k, due in list(self._keep.items()):
                        if due and due <= now:  # kept, and no local grant came
                            del self._keep[k]
                            self._want.pop(k, None)
                            if k in self._have:
                                self._drop.add(k)
                    drop = self._drop & self._have
                    kept = self._have - drop
                    take = [k for k, due in self._want.items() if due <= now and k not in kept]
                    kill, self._suspects = self._suspects, set()
                    if drop or take or kill:
                        break
                    later = [due for k, due in self._want.items() if k not in kept]
                    later += [due for due in self._keep.values() if due]
                    wait = max(min(later) - now, 0.0) if later else None
                    if not later and not self._have:
                        wait = self.LINGER if conn is not None else None
                        self._wake_at = math.inf
                        if not self._hmutex.wait(wait) and conn is not None:
                            with contextlib.suppress(Exception):
                                conn.close()
                            conn = None
                        self._wake_at = -math.inf
                        continue
                    self._wake_at = math.inf if wait is None else now + wait
                    self._hmutex.wait(wait)
                    self._wake_at = -math.inf
                else:
                    if self._holder is threading.current_thread():
                        self._holder = None
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            conn.close()
                    return
                self._drop -= drop
            # Each name let go is preceded, in the same statement, by a look
            # at the key's waiter name: held, it says a session of another
            # process blocks on the name (PROBE_SQL takes it first). Asking
            # for the name's new owner after RELEASE_LOCK instead raced the
            # woken waiter, which lets the name go at once: on a loaded
            # machine it sometimes did so first, and the waiter went unseen.
            # A name not taken says which session has it (0: taken; -1:
            # nobody, let go meanwhile), for _settle to tell a probe's
            # instant from a stale holder.
            names = [n for k in drop for n in (self.waiter_name(self.name(k)), self.name(k))]
            names += [self.name(k) for k in take for _ in (0, 1)]
            sql = "SELECT " + ", ".join(
                ["IS_USED_LOCK(%s), RELEASE_LOCK(%s)"] * len(drop)
                + ["IF(GET_LOCK(%s, 0) = 1, 0, IFNULL(IS_USED_LOCK(%s), -1))"] * len(take)
            )
            row: Sequence[Any] = ()
            try:
                if conn is None:
                    conn = self._connect()
                if kill:
                    self._kill_stale(conn, kill)
                if drop or take:
                    self.statements += 1
                    with conn.cursor() as cursor:
                        cursor.execute(sql, names)
                        row = cursor.fetchone()
                delay = 0.05
            except Exception as exc:
                log.debug("dblock: named-lock connection failed (%r); reconnecting", exc)
                with contextlib.suppress(Exception):
                    conn.close()
                conn = None
                with self._hlock:
                    # The server let every name of that session go.
                    self._have.clear()
                    self._drop.clear()
                    self._keep.clear()
                    for key in self._want:
                        self._want[key] = _monotonic() + delay
                delay = min(delay * 2, 1.0)
                continue
            if drop or take:
                self._settle(drop, take, row)

    def _kill_stale(self, conn: Any, suspects: set[int]) -> None:
        """Kill those of ``suspects`` (sessions that held the names of keys we
        hold) idle on the server for :attr:`STALE` seconds (see _settle)."""
        ids = ", ".join(str(int(s)) for s in suspects)
        self.statements += 1
        try:
            with conn.cursor() as cursor:
                cursor.execute(
                    "SELECT ID FROM information_schema.PROCESSLIST "
                    f"WHERE ID IN ({ids}) AND COMMAND = 'Sleep' AND {self._idle_ms} >= %s",
                    (round(self.STALE * 1000),),
                )
                sessions = [int(r[0]) for r in cursor.fetchall()]
        except Exception as exc:
            if getattr(exc, "args", (None,))[0] != _NO_SUCH_COLUMN or self._idle_ms != "TIME_MS":
                raise
            self._idle_ms = "TIME * 1000"  # MySQL: whole seconds
            return
        if sessions:
            with self._hlock:  # their names are free in a moment: try again then
                soon = _monotonic() + 0.005
                for key, (holder, _) in self._blocked.items():
                    if holder in sessions and key in self._want:
                        self._want[key] = soon
        for session in sessions:
            self.statements += 1
            try:
                with conn.cursor() as cursor:
                    cursor.execute("KILL CONNECTION %s", (session,))
                log.debug("dblock: killed session %s, which held a name it no longer owns", session)
            except Exception as exc:
                code = getattr(exc, "args", (None,))[0]
                if code == _NO_SUCH_THREAD:
                    continue  # gone by itself
                if code not in _NOT_OWNER:
                    raise  # the connection's own failure: reconnect
                with self._hlock:
                    self._can_kill = False
                log.warning(
                    "dblock: session %s holds the named lock of a key this process holds "
                    "(a stopped former holder?) and this user may not kill it: waiters of "
                    "other processes will wake on their periodic re-check (%r)",
                    session,
                    exc,
                )

    def _settle(self, drop: set[str], take: list[str], row: Sequence[Any]) -> None:
        """The holder thread's statement answered: the names let go (and
        which of them a waiter of another process was blocked on), the
        names taken, and those another session holds.

        A name another session holds is a waiter's probe holding it for an
        instant (it lets it go in the same statement), or a former holder's
        that has not let it go yet: at once if its process is running, never
        if the process is stopped (SIGSTOP, a debugger, a VM paused) past
        its lease, which is how we came to hold the key. Its waiters then
        block on a name nobody lets go at our release (they woke at their
        re-check only), and we used to try again every 2 ms for as long as
        we held the key (~480 statements a second). Now the pause between
        tries doubles (to :attr:`BLOCKED_RETRY`), and a session seen holding
        the name for :attr:`SUSPECT` seconds of our hold, or at a release of
        ours that never took the name, is killed if the server says it has
        been idle for :attr:`STALE` seconds: the server lets its names go,
        its waiters wake and look again, and we take the name. The server's
        idle time, not ours, tells a stopped process from a running one
        whose names thread merely lags (it sends its statements): a running
        former holder of a hot key is never killed for being seen holding
        the name at the start of each of our runs. (Killing a live one
        would cost it no more than a reconnection of its names thread: a
        name is only ever a hint, the row is the truth.) A user who may not
        kill it (or see it) tries again once a second."""
        got = row[2 * len(drop) :]
        with self._hlock:
            self._have -= drop
            now = _monotonic()
            for key, owner in zip(drop, row[0 : 2 * len(drop) : 2], strict=True):
                if owner is not None:
                    if len(self._waited) > 10_000:
                        self._waited.clear()
                    self._waited[key] = now
            for key, holder in zip(take, got, strict=True):
                if holder == 0:
                    self._have.add(key)
                    self._blocked.pop(key, None)
                    if key not in self._want:  # let go meanwhile
                        self._drop.add(key)
                elif key not in self._want:
                    pass  # let go meanwhile
                elif holder is None or holder < 0:  # free since: again soon
                    self._want[key] = now + 0.002
                else:
                    seen = self._blocked.get(key)
                    since = seen[1] if seen is not None and seen[0] == holder else now
                    if len(self._blocked) > 10_000:
                        self._blocked.clear()
                    self._blocked[key] = (holder, since)
                    age = now - since
                    if age >= self.SUSPECT and self._can_kill:
                        # Killed with our next try if idle STALE seconds.
                        self._suspects.add(holder)
                    self._want[key] = now + min(max(age, 0.002), self.BLOCKED_RETRY)

    # -- waiter side -------------------------------------------------------------

    def covers(self, key: str) -> bool:
        slot = self._slot_of.get(key)
        return (slot is not None and slot.armed) or bool(self._looked.get(key))

    def _watch(self, key: str) -> bool:
        with self._mutex:
            if self._closed:
                return False
            slot = self._slot_of.get(key)
            if slot is None:
                slot = next((s for s in self._slots if s.key is None), None)
                if slot is None:
                    slot = next((s for s in self._slots if s.key not in self._subs), None)
                    if slot is not None and slot.key is not None:
                        del self._slot_of[slot.key]
                if slot is None and len(self._slots) < self._max_slots:
                    slot = _Slot(self, self._mutex)
                    self._slots.append(slot)
                if slot is None:
                    self._look_at(key)
                    return False  # polled until a look finds its name held (see attach)
                slot.key = key
                slot.armed = False
                self._slot_of[key] = slot
            slot.cond.notify()
            slot.start()
        return False

    def _unwatch(self, key: str) -> None:
        pass  # the slot finds out after its probe (see _Slot), the looker at its next look

    def _look_at(self, key: str) -> None:
        """A key beyond the slots: looked at with the others (see _run_looker).
        Called with ``_mutex`` held."""
        if key not in self._looked:
            self._looked[key] = None
        looker = self._looker
        if looker is None or not looker.is_alive():
            # (Not alive: made, but an exception came before it started.)
            looker = self._looker = threading.Thread(
                target=self._run_looker, name="dblock-name-look", daemon=True
            )
            _threads.start(looker)
        self._look_cond.notify()

    def _run_looker(self) -> None:
        """The keys waited for beyond the slots, each on a timer of their own
        before: one statement asks who holds each key's name, every
        :attr:`LOOK_EVERY` seconds while any is waited for.

        A slot blocks on one name, so 8 slots served 8 keys and every other
        key was polled with the polling backoff (up to ``poll_max``): with
        1,000 keys awaited from another process a grant came 270 ms (p50),
        857 ms (p99) after its release, and the waiters' attempts made some
        4,000 statements a second. A name is let go when its key is, so a
        name seen held at one look and free (or held by another session) at
        the next says the key was released meanwhile: its waiters look
        again. A key whose name is not held (its holder has not named it
        yet, or never does) is polled as before until a look finds it held.
        The row stays the truth: a look only says "look again"."""
        conn: Any = None
        try:
            while True:
                keys = self._to_look()
                if keys is None:
                    return
                try:
                    if conn is None:
                        conn = self._connect()
                    holders = self._look(conn, keys)
                except Exception as exc:
                    if not self.listening:  # closed
                        return
                    log.debug("dblock: named-lock look failed (%r); polling meanwhile", exc)
                    with contextlib.suppress(Exception):
                        conn.close()
                    conn = None
                    self._looked_at(keys, None)
                    self._look_pause(0.1)
                    continue
                self._looked_at(keys, holders)
                self._look_pause(self.LOOK_EVERY)
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()

    def _to_look(self) -> list[str] | None:
        """The keys to look at now (waiting for one); None when the looker
        ends (closed, or idle for :attr:`LINGER`)."""
        with self._mutex:
            while not self._closed:
                for key in [k for k in self._looked if k not in self._subs]:
                    del self._looked[key]
                if self._looked:
                    return list(self._looked)
                if not self._look_cond.wait(self.LINGER) and not self._looked:
                    break
            if self._looker is threading.current_thread():
                self._looker = None
            return None

    def _look_pause(self, seconds: float) -> None:
        with self._mutex:
            if not self._closed:
                self._look_cond.wait(seconds)

    def _look(self, conn: Any, keys: list[str]) -> list[int]:
        """The session holding each key's name (0: nobody)."""
        holders: list[int] = []
        for at in range(0, len(keys), self.LOOK_CHUNK):
            names = [self.name(k) for k in keys[at : at + self.LOOK_CHUNK]]
            self.statements += 1
            with conn.cursor() as cursor:
                cursor.execute("SELECT " + ", ".join(["IS_USED_LOCK(%s)"] * len(names)), names)
                holders += [int(h or 0) for h in cursor.fetchone()]
        return holders

    def _looked_at(self, keys: list[str], holders: list[int] | None) -> None:
        """What a look found (None: it failed, so nothing is covered)."""
        rung: list[str] = []
        freed: list[str] = []
        with self._mutex:
            if holders is None:
                for key in keys:
                    if key in self._looked:
                        self._looked[key] = None
                freed = keys
                holders = []
            for key, holder in zip(keys, holders, strict=False):
                if key not in self._looked:
                    continue  # nobody waits for it now
                before = self._looked[key]
                self._looked[key] = holder
                if before and holder != before:  # let go since the last look
                    rung.append(key)
                if holder:
                    self._polled.pop(key, None)  # covered from here on
                elif before:
                    freed.append(key)
        for key in rung:
            self.ring(key)
        for key in freed:  # not named now: polled until a look finds it named
            self._poll(key)

    def serve_slot(self, slot: _Slot) -> None:
        """A slot's thread: probe the name of the key it serves, over and over."""
        conn: Any = None
        probing: _Probing | None = None
        try:
            while True:
                found = self._next_key(slot)
                if found is None:
                    return
                key, name, fresh = found
                if fresh or probing is None or probing.key != key:
                    probing = _Probing(key, self._poll_initial)  # a new wait: afresh
                try:
                    if conn is None:
                        conn = self._connect()
                        slot.thread_id = conn.thread_id()
                    self.statements += 1
                    with conn.cursor() as cursor:
                        cursor.execute(
                            PROBE_SQL,
                            {"n": name, "w": self.waiter_name(name), "t": self._timeout},
                        )
                        got = cursor.fetchone()[0]
                except Exception as exc:
                    if not self.listening:  # closed
                        return
                    log.debug("dblock: named-lock wait failed (%r); polling meanwhile", exc)
                    with contextlib.suppress(Exception):
                        conn.close()
                    conn = None
                    with self._mutex:
                        slot.armed = False
                    self._poll(key)
                    time.sleep(0.1)
                    continue
                self._heard(slot, probing, got)
        finally:
            slot.armed = False
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()

    def _next_key(self, slot: _Slot) -> tuple[str, str, bool] | None:
        """The key ``slot`` serves next, its name, and whether it is a new
        wait (nobody waited for the slot's key when asked); None when the
        slot ends (closed, or idle for :attr:`LINGER`)."""
        with self._mutex:
            key = slot.key
            fresh = key is None or key not in self._subs
            while not self._closed and (key is None or key not in self._subs):
                if key is not None and slot.key == key:
                    slot.armed = False
                if not slot.cond.wait(self.LINGER) and (
                    slot.key is None or slot.key not in self._subs
                ):
                    if slot.key is not None:
                        self._slot_of.pop(slot.key, None)
                    slot.key = None
                    self._slots.remove(slot)
                    return None
                key = slot.key
            if self._closed or key is None:
                return None
            slot.armed = True
            self._polled.pop(key, None)  # covered from here on
            return key, self.name(key), fresh

    def _heard(self, slot: _Slot, probing: _Probing, got: int) -> None:
        """What a probe of ``probing.key``'s name answered (see PROBE_SQL)."""
        key = probing.key
        if got == 1:  # its holder let it go: a release
            probing.step = self._poll_initial
            probing.rang_at = probing.named_at = _monotonic()
            self._unpoll(key)
            self.ring(key)
        elif got == 0:  # held throughout: a holder that names its keys
            probing.named_at = _monotonic()
        elif got == -1:
            # Nobody holds the name: released since the waiter's attempt, or
            # its new holder has not taken it yet. Look again, then probe
            # again later. If its holders have been naming it lately, the
            # name is free only between a release and the next grant's
            # naming, which is the moment to look (a holder of another
            # process giving way leaves the row free for a few round trips
            # only), and to probe again soon: a step grown to poll_max let a
            # run of hundreds of grants pass before the next look. Holders
            # that never name it (another Galera node, an older dblock) get
            # the poll's backoff, and a look at most once a step.
            now = _monotonic()
            named = now - probing.named_at < self._timeout
            if named or now - probing.rang_at > probing.step:
                probing.rang_at = now
                self.ring(key)
            with self._mutex:
                if slot.key == key and key in self._subs:
                    slot.cond.wait(_jitter(probing.step))
            cap = self.RACE_CAP if named else self._poll_max
            probing.step = min(probing.step * 2, max(cap, self._poll_initial))

    def close(self) -> None:
        super().close()
        with self._hlock:
            holder = self._holder
            self._hmutex.notify_all()
        with self._mutex:
            idle = [s.thread for s in self._slots if not s.armed]
            for slot in self._slots:
                slot.cond.notify_all()
            self._look_cond.notify_all()
        # The threads that end at once are waited for (briefly), so a process
        # that exits right after close() (`dblock run`) does not finalize the
        # interpreter under a thread of ours still closing its connection. A
        # slot blocked in its probe (GET_LOCK, up to notify_recheck) is not;
        # nor is one reassigned while its probe of another key ran (it is
        # unarmed, yet blocked): one second in all bounds what close() waits.
        until = _monotonic() + 1.0
        for thread in (holder, self._timer, self._looker, *idle):
            if thread is not None and thread is not threading.current_thread():
                thread.join(max(until - _monotonic(), 0.0))


class _Probing:
    """A slot's probing of one waited-for key: the poll step, when its
    waiters were last told to look, and when a probe last found its name
    held (see NamedLockWaker._heard)."""

    __slots__ = ("key", "named_at", "rang_at", "step")

    def __init__(self, key: str, step: float) -> None:
        self.key = key
        self.step = step
        self.rang_at = 0.0
        self.named_at = -float("inf")


class _Slot:
    """One waiter connection of a :class:`NamedLockWaker` and its thread."""

    __slots__ = ("armed", "cond", "key", "thread", "thread_id", "waker")

    def __init__(self, waker: NamedLockWaker, mutex: threading.Lock) -> None:
        self.waker = waker
        self.key: str | None = None
        self.armed = False
        self.cond = threading.Condition(mutex)  # the waker's waiter-side mutex
        self.thread: threading.Thread | None = None
        self.thread_id: int | None = None

    def start(self) -> None:
        thread = self.thread
        if thread is None or not thread.is_alive():
            # (Not alive: made, but an exception came before it started.)
            thread = self.thread = threading.Thread(
                target=self.waker.serve_slot, args=(self,), name="dblock-name-wait", daemon=True
            )
            _threads.start(thread)


# -- SQLite: a byte lock per waited-for key and a datagram per release ----------

# Linux's open file description locks: owned by the open file, not the
# process, so two stores (or a store's ring and its registrations) in one
# process see each other's locks, and closing another descriptor of the
# file drops nothing.
_OFD_GETLK: int = getattr(fcntl, "F_OFD_GETLK", -1)
_OFD_SETLK: int = getattr(fcntl, "F_OFD_SETLK", -1)
# struct flock on Linux: l_type, l_whence, l_start, l_len, l_pid (+ padding).
_FLOCK = "hhqqi4x"
_SUN_PATH_MAX = 100
_OFFSETS = 1 << 62


def _flock(kind: int, offset: int) -> bytes:
    return struct.pack(_FLOCK, kind, os.SEEK_SET, offset, 1, 0)


class SocketWaker(Waker):
    """SQLite on one host: registrations as byte locks, wake-ups as datagrams.

    A waiting process holds a read lock on the byte of each key it waits
    for, in ``<dir>/waiters``; it registers before it tells its waiter to
    look again (:meth:`_watch` returns True), or the key was registered all
    along (a key stays registered :attr:`KEY_LINGER` seconds after its last
    waiter left, so a hot key costs no new registration). A release, after
    its ``DELETE`` committed (:meth:`released`), asks whether any lock
    covers that byte (one ``fcntl``; nothing more when nobody waits) and if
    so sends the key to every socket in ``<dir>``. So either the
    registration came first and the release rings, or the release's look
    came first, its ``DELETE`` had committed, and the waiter's next attempt
    finds the key free. Each process's thread reads its socket and wakes
    the waiters of the key named (not those of other keys). Sockets of
    processes that died are removed by whoever finds them refusing."""

    KEY_LINGER = 2.0

    def __init__(self, directory: str, table: str, config: Config) -> None:
        super().__init__(config)
        self._dir = directory
        self._table = table
        self._path = os.path.join(directory, "waiters")
        # Made by the first waiter (never by a release: a directory beside
        # the database only once some process of it waited).
        self._reg_fd: int | None = None
        self._look_fd: int | None = None
        self._sock: socket.socket | None = None
        self._sock_path: str | None = None
        self._thread: threading.Thread | None = None
        self._registered: dict[str, float] = {}  # key -> unwaited since (inf: waited)
        self._offsets: dict[str, int] = {}
        self._out: socket.socket | None = None

    @staticmethod
    def usable(directory: str) -> bool:
        return (
            sys.platform.startswith("linux")
            and _OFD_GETLK >= 0
            and len(directory) + 24 < _SUN_PATH_MAX
        )

    def _offset(self, key: str) -> int:
        offset = self._offsets.get(key)
        if offset is None:
            if len(self._offsets) > 10_000:
                self._offsets.clear()
            digest = hashlib.sha1(
                f"{self._table}\x00{key}".encode(), usedforsecurity=False
            ).digest()
            offset = self._offsets[key] = int.from_bytes(digest[:8], "big") % _OFFSETS
        return offset

    def covers(self, key: str) -> bool:
        return key in self._registered and self._sock is not None

    def _watch(self, key: str) -> bool:
        with self._mutex:
            if self._closed:
                return False
            try:
                self._start()
            except OSError as exc:  # a read-only directory, say: poll
                log.debug("dblock: no wake-ups beside the database: %s", exc)
                return False
            if key in self._registered:
                self._registered[key] = float("inf")
                return False  # registered all along: a release since rang
            assert self._reg_fd is not None  # (_start made it)
            try:
                fcntl.fcntl(self._reg_fd, _OFD_SETLK, _flock(fcntl.F_RDLCK, self._offset(key)))
            except OSError as exc:  # a writer holds it for an instant: poll
                log.debug("dblock: could not register %r for wake-ups: %s", key, exc)
                return False
            self._registered[key] = float("inf")
        return True  # a release before the registration rang nobody: look again

    def _unwatch(self, key: str) -> None:
        with self._mutex:
            if key in self._registered:
                self._registered[key] = _monotonic()

    def _start(self) -> None:
        if self._thread is not None:
            return
        if self._reg_fd is None:
            os.makedirs(self._dir, exist_ok=True)
            self._reg_fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        path = os.path.join(self._dir, f"{os.getpid()}.{id(self) & 0xFFFFFF:x}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        sock.bind(path)
        sock.settimeout(0.5)
        self._sock, self._sock_path = sock, path
        self._thread = threading.Thread(target=self._run, name="dblock-wake", daemon=True)
        _threads.start(self._thread)

    def _run(self) -> None:
        sock = self._sock
        assert sock is not None
        prefix = f"{self._table}\x00".encode()
        while not self._closed:
            try:
                data = sock.recv(4096)
            except TimeoutError:
                data = b""
            except OSError:
                return
            if data.startswith(prefix):
                self.ring(data[len(prefix) :].decode())
            self._drop_unwaited()

    def _drop_unwaited(self) -> None:
        now = _monotonic()
        with self._mutex:
            gone = [k for k, t in self._registered.items() if now - t > self.KEY_LINGER]
            for key in gone:
                del self._registered[key]
                if self._reg_fd is not None:
                    with contextlib.suppress(OSError):
                        fcntl.fcntl(
                            self._reg_fd, _OFD_SETLK, _flock(fcntl.F_UNLCK, self._offset(key))
                        )

    def released(self, key: str) -> None:
        """After a release of ``key`` committed: wake its waiters, if any."""
        look = self._look_fd
        try:
            if look is None:
                # No such file: no process ever waited on this database. Asked
                # without an exception first: a lone request's every release
                # comes here (a failed open and its OSError cost 2.4 us, this
                # 0.75 us, of a SQLite lock+unlock's 48 us).
                if not os.access(self._path, os.F_OK):
                    return
                look = self._look_fd = os.open(self._path, os.O_RDWR | os.O_CLOEXEC)
            found = fcntl.fcntl(look, _OFD_GETLK, _flock(fcntl.F_WRLCK, self._offset(key)))
        except OSError:
            return
        if struct.unpack(_FLOCK, found)[0] == fcntl.F_UNLCK:
            return  # nobody waits
        message = f"{self._table}\x00{key}".encode()
        try:
            names = os.listdir(self._dir)
        except OSError:
            return
        out = self._out
        if out is None:
            out = self._out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            out.setblocking(False)
        for name in names:
            if name == "waiters":
                continue
            path = os.path.join(self._dir, name)
            try:
                out.sendto(message, path)
            except (ConnectionRefusedError, FileNotFoundError):
                # Its process is gone (a bound socket's file outlives it).
                with contextlib.suppress(OSError):
                    os.unlink(path)
            except OSError as exc:  # a full queue: that process polls
                if exc.errno not in (errno.EAGAIN, errno.ENOBUFS):
                    log.debug("dblock: wake-up to %s failed: %s", path, exc)

    def close(self) -> None:
        super().close()
        with self._mutex:
            sock, self._sock = self._sock, None
            path, self._sock_path = self._sock_path, None
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(1.0)
        self.forget()
        if self._out is not None:
            with contextlib.suppress(OSError):
                self._out.close()

    def forget(self) -> None:
        """Close our descriptors (in a forked child too: the parent's
        registrations stay its own, as other descriptors hold them)."""
        for fd in (self._reg_fd, self._look_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._reg_fd = self._look_fd = None


class WokenStore(Store):
    """What a store whose waiters are woken through a :class:`Waker` of its
    own (MySQL/MariaDB's named locks, SQLite's byte lock and datagram) does
    alike: a waiter of an expected key waits on the waker, asyncio waiters
    reach it as the store's listener, and closing the store closes it. The
    dialect makes its waker (``_waker``, under ``_waker_lock``)."""

    _waker: Waker | None
    _waker_lock: threading.Lock

    def waiter(self, key: str, since: float, address: str | None = None) -> Wait:
        waker = self._waker
        if address is None and waker is not None and waker.expects(key):
            return WokenWait(waker, key, since, self.config)
        return super().waiter(key, since, address)

    def listener(self) -> Any:
        """The waker, for asyncio waiters (see ``dblock.aio``)."""
        return self._waker

    def hot(self, key: str, ends_run: bool = False) -> None:
        waker = self._waker
        if waker is not None:
            waker.hot(key, ends_run)

    def others_wait(self, key: str) -> bool:
        waker = self._waker
        return waker is not None and waker.others_wait(key)

    def others_wait_steps(self, key: str) -> Steps[bool] | None:
        waker = self._waker
        return None if waker is None else waker.waiting_steps(key)

    def close(self) -> None:
        with self._waker_lock:
            waker, self._waker = self._waker, None
        if waker is not None:
            waker.close()
        super().close()
