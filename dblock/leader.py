"""Leadership: one leader per role across the cluster, in terms whose fence
guards every write.

A role (``"outbox-relay"``) is led by whoever holds its lock,
``leader:<role>``, an exclusive lock like any other: a lease on the
database's clock, renewed while the leader lives, a fence drawn from the
table's sequence at each grant. A **term** is one holding of that lock: its
fence is greater than every earlier term's, on every database and across a
failover (the fence's guarantee, see the lock row). So:

* ``with locks.leader("outbox-relay") as term:`` waits until elected, runs
  the block while leading, and steps down at its end. ``leader.leading``
  answers "still leading?" without SQL (the lease by this process's clock,
  and what the renewal thread learned); ``leader.check()`` raises
  :class:`~dblock.LeadershipLost` once it is not; ``leader.ended`` is an
  event set when the term ends, and ``on_revoked(term)`` is called then.
* ``leader.campaign()`` stands for election in a thread of its own until
  ``stop()`` (or the manager's ``close()``, or interpreter exit): it calls
  ``on_elected(term)`` at each election and ``on_revoked(term)`` at each
  term's end, and stands again. A standby waits as a lock's waiter does, so
  a leader that steps down wakes it at once (no polling of the lease).
* :meth:`Term.guard` makes a write in the application's own transaction, on
  the same database, commit only while the term is current: it reads the
  term's row with a shared row lock (PostgreSQL ``FOR SHARE``, MySQL/MariaDB
  ``LOCK IN SHARE MODE``; SQLite takes the file's write lock by a no-op
  ``UPDATE``), which a successor's takeover must wait for, and raises
  :class:`~dblock.LeadershipLost` if the row is no longer the term's. A
  leader paused past its lease therefore cannot commit after its successor
  started: either its guard ran first (the successor waits for its commit)
  or it finds the row gone.

The asyncio face (:class:`dblock.aleader.AsyncLeader`, ``AsyncLockManager.leader``) is the
same election awaited; a term lost while its ``async with`` block runs
cancels the task running the block, and the block's exit raises
``LeadershipLost`` in place of that cancellation.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from .config import check_lease
from .errors import LeadershipLost, LockArgumentError, LockNotAcquired, LockTimeout, ManagerClosed
from .keys import check_key
from .options import LockArgs

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._held import HeldLock
    from ._store.admin import LockRow
    from .telemetry import Recorder

__all__ = [
    "LEADER_PREFIX",
    "Elector",
    "Guarded",
    "Leader",
    "LeaderArgs",
    "LeaderBase",
    "OnTerm",
    "Term",
    "leader_key",
    "leaders_of",
]

log = logging.getLogger("dblock.leader")
_monotonic = time.monotonic

#: A role's lock key is this prefix and the role's name.
LEADER_PREFIX = "leader:"


def leader_key(role: str) -> str:
    """The lock key of ``role`` (a usage error, before any SQL, if it makes none)."""
    if not isinstance(role, str) or not role:
        raise LockArgumentError(f"a leader's role must be a non-empty string, got {role!r}")
    return check_key(LEADER_PREFIX + role)


def leaders_of(rows: Iterable[LockRow]) -> list[LockRow]:
    """Those of the lock table's ``rows`` that are a role's leadership now
    (``leader:<role>``, exclusive, inside its lease): what ``dblock stats``,
    ``dblock top`` and the Django admin name as leaders."""
    return [
        row
        for row in rows
        if row.key.startswith(LEADER_PREFIX)
        and row.kind == "exclusive"
        and row.slot == ""
        and row.lease_left > 0
    ]


class Guarded(Protocol):
    """What a term's guard needs of the store: the statement, per dialect."""

    def term_guard(self, key: str, token: str, style: str) -> tuple[str, bool]: ...


class Elector(Protocol):
    """What a leader needs of its manager (``LockManager`` is one)."""

    def acquire(self, key: str, *, fair: bool = ..., **options: Unpack[LockArgs]) -> HeldLock: ...

    @property
    def store(self) -> Guarded: ...


@dataclass(frozen=True)
class Term:
    """One term of a role's leadership: one holding of its lock.

    ``fence`` is greater than every earlier term's (pass it to whatever the
    leader writes to, or guard the write with :meth:`guard`); ``token`` is
    the lock row's owner token; ``since`` when the term began (the
    database's clock, as the row's lease); ``holder`` who leads (host, pid,
    thread)."""

    role: str
    fence: int
    token: str
    holder: str
    since: datetime
    key: str
    _guard: Guarded = field(repr=False, compare=False)

    def guard_sql(
        self, paramstyle: str = "named"
    ) -> tuple[str, Mapping[str, str] | Sequence[str], bool]:
        """The guard's statement for a connection of the application's own:
        the SQL, its parameters and whether it is an ``UPDATE`` (then its row
        count says, else whether it returned a row). ``paramstyle``:
        ``"named"`` (``:key``, for SQLAlchemy's ``text()``), ``"format"``
        (``%s``: psycopg, PyMySQL, mysqlclient, Django's cursors) or
        ``"qmark"`` (``?``: sqlite3)."""
        styles = {"named": ":{}", "format": "%s", "qmark": "?", "pyformat": "%({})s"}
        if paramstyle not in styles:
            raise LockArgumentError(
                f"paramstyle must be one of {', '.join(sorted(styles))}, got {paramstyle!r}"
            )
        sql, update = self._guard.term_guard(self.key, self.token, styles[paramstyle])
        if paramstyle in ("format", "qmark"):
            return sql, (self.key, self.token), update
        return sql, {"key": self.key, "token": self.token}, update

    def guard(self, connection: Any) -> None:
        """In the application's open transaction on ``connection`` (a
        SQLAlchemy ``Connection`` or ``Session``, or a DB-API cursor such as
        Django's ``connection.cursor()``), on the lock table's database:
        hold the term's row against a successor until that transaction ends,
        or raise :class:`~dblock.LeadershipLost` if the term is over (then
        roll back). Call it before the writes it guards commit; a successor's
        takeover waits for the commit."""
        if hasattr(connection, "cursor") and not hasattr(connection, "execute"):
            connection = connection.cursor()  # a DB-API connection
        if _is_sqlalchemy(connection):
            from sqlalchemy import text

            sql, params, update = self.guard_sql("named")
            result = connection.execute(text(sql), params)
            current = result.rowcount == 1 if update else result.first() is not None
        else:
            style = "qmark" if _is_sqlite_cursor(connection) else "format"
            sql, params, update = self.guard_sql(style)
            connection.execute(sql, params)
            current = connection.rowcount == 1 if update else connection.fetchone() is not None
        if not current:
            raise LeadershipLost(self.role, self.fence, "its row is gone or its lease ran out")


def _is_sqlalchemy(connection: Any) -> bool:
    module = type(connection).__module__
    return module.startswith("sqlalchemy.")


def _is_sqlite_cursor(cursor: Any) -> bool:
    module = type(cursor).__module__
    if module.startswith("django."):
        return False  # Django's cursors take %s on every backend
    return module.startswith("sqlite3")


OnTerm = Callable[[Term], object]


class LeaderArgs(TypedDict, total=False):
    """What ``leader()`` takes beside the role, on both faces. ``ttl``: the
    term's lease (default: the manager's); ``on_elected(term)`` and
    ``on_revoked(term)``: called as each term begins and ends."""

    ttl: float | None
    on_elected: OnTerm | None
    on_revoked: OnTerm | None


class LeaderBase:
    """What both faces share: the role, the options, the current term. Made
    by the manager's ``leader()``, with what it names (``elector``: the
    manager; ``telemetry``: its recorder, if any)."""

    def __init__(
        self,
        elector: Any,
        role: str,
        options: LeaderArgs,
        telemetry: Recorder | None = None,
    ) -> None:
        unknown = sorted(set(options) - set(LeaderArgs.__annotations__))
        if unknown:
            raise LockArgumentError(
                f"unknown option {unknown[0]!r}; the options are: on_elected, on_revoked, ttl"
            )
        self.role = role
        self.key = leader_key(role)
        ttl = options.get("ttl")
        on_elected, on_revoked = options.get("on_elected"), options.get("on_revoked")
        for name, callback in (("on_elected", on_elected), ("on_revoked", on_revoked)):
            if callback is not None and not callable(callback):
                raise LockArgumentError(f"{name} must be callable, got {callback!r}")
        self.ttl = None if ttl is None else check_lease(ttl)
        self.on_elected = on_elected
        self.on_revoked = on_revoked
        self._elector = elector
        self._telemetry = telemetry
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mutex = threading.Lock()
        self._held: HeldLock | None = None
        self._term: Term | None = None
        #: Set while no term is running (before the first, and once one has
        #: ended and its ``on_revoked`` returned).
        self.ended = threading.Event()
        self.ended.set()
        self._told: Term | None = None  # the term on_revoked was called for
        self.elections = 0

    @property
    def term(self) -> Term | None:
        """The current term (None while not leading)."""
        return self._term if self.leading else None

    @property
    def leading(self) -> bool:
        """Whether this process leads the role now. No SQL: the term's lease
        by this process's clock and what the renewal thread learned."""
        held = self._held
        if held is None or held.released or held.lost:
            if held is not None:
                self._end(held, held.lost_reason or "released")
            return False
        return True

    @property
    def held(self) -> HeldLock | None:
        """The current term's lock (its ``lost``, ``fence``, lease), or None."""
        return self._held if self.leading else None

    def check(self) -> None:
        """Raise :class:`~dblock.LeadershipLost` unless leading (no SQL)."""
        term = self._term
        if not self.leading:
            reason = "not elected" if term is None else self._reason or "stepped down"
            raise LeadershipLost(self.role, None if term is None else term.fence, reason)

    _reason: str | None = None

    def _begin(self, held: HeldLock, guard: Guarded, stood: float) -> Term:
        term = Term(
            role=self.role,
            fence=held.fence,
            token=held.token,
            holder=held.owner,
            since=_since(held),
            key=self.key,
            _guard=guard,
        )
        with self._mutex:
            self._held = held
            self._term = term
            self._reason = None
            self.elections += 1
            self.ended.clear()
        log.debug("dblock: %s leads %r (term %s)", held.owner, self.role, held.fence)
        if self._telemetry is not None:
            self._telemetry.elected(self.role, _monotonic() - stood)
        if self.on_elected is not None:
            self.on_elected(term)
        return term

    def _end(self, held: HeldLock, reason: str) -> None:
        """The term of ``held`` ended (lost, or stepped down): once per term."""
        with self._mutex:
            if self._held is not held or self._told is self._term:
                return
            term = self._term
            self._told = term
            self._reason = reason
        assert term is not None
        if self._telemetry is not None:
            self._telemetry.term_ended(
                self.role, "stepped_down" if reason == "stepped down" else "lost"
            )
        if reason != "stepped down":
            log.warning(
                "dblock: leadership of %r lost (term %s): %s", self.role, term.fence, reason
            )
        try:
            if self.on_revoked is not None:
                self.on_revoked(term)
        except Exception:
            log.exception("dblock: on_revoked of %r raised", self.role)
        finally:
            self.ended.set()  # (once on_revoked returned: a waiter sees its effects)

    def _on_lost(self, held: HeldLock) -> None:
        self._end(held, held.lost_reason or "lost")

    def _options(self, timeout: float | None) -> LockArgs:
        return {"timeout": timeout, "ttl": self.ttl, "on_lost": self._on_lost}


def _since(held: HeldLock) -> datetime:
    """When a term began, on the database's clock: its grant's lease end
    less the lease (read as it begins, before any renewal moved it)."""
    return held.expires_at - timedelta(seconds=held.ttl)


class Leader(LeaderBase):
    """A role's leadership for this process, on the blocking face (see the
    module). Made by :meth:`dblock.LockManager.leader`."""

    _elector: Elector

    def __repr__(self) -> str:
        state = (
            f"leading (term {self._term.fence})" if self.leading and self._term else "standing by"
        )
        return f"<Leader {self.role!r} {state}>"

    # -- one term, in a with block -------------------------------------------

    def elect(self, timeout: float | None = None) -> Term:
        """Wait until elected (at most ``timeout`` seconds: then
        :class:`~dblock.LockTimeout`; None waits as long as it takes) and
        begin a term."""
        if self.leading:
            raise LockArgumentError(f"already leading {self.role!r}: step down first")
        stood = _monotonic()
        held = self._elector.acquire(self.key, **self._options(timeout))
        return self._begin(held, self._elector.store, stood)

    def step_down(self) -> None:
        """End the current term: the role's lock is released at once, and a
        standby waiting for it is woken. Does nothing while not leading."""
        held = self._held
        if held is None or held.released:
            return
        self._end(held, "stepped down")
        with contextlib.suppress(LockNotAcquired, Exception):
            held.release(force=True)

    def __enter__(self) -> Term:
        return self.elect()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.step_down()

    # -- a campaign, in a thread of its own -------------------------------------

    def campaign(self) -> Leader:
        """Stand for election in a thread of its own until :meth:`stop`: at
        each election ``on_elected(term)``, at each term's end
        ``on_revoked(term)``, then stand again. Returns the leader."""
        with self._mutex:
            if self._thread is not None:
                raise LockArgumentError(f"a campaign for {self.role!r} is running already")
            self._stop.clear()
            self._thread = threading.Thread(
                target=self._campaign, name=f"dblock-leader-{self.role}", daemon=True
            )
        _CAMPAIGNS.add(self)
        _step_down_on_sigterm()
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """End the campaign: step down if leading and stop standing. Waits
        (at most ``timeout`` seconds) for a leading campaign's thread; a
        standby's, waiting for the role, ends at its next look (a term it
        wins meanwhile is given back at once, no ``on_elected`` called)."""
        self._stop.set()
        self.step_down()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout if self._term is not None and self._told is not self._term else 0.1)
        self._thread = None
        _CAMPAIGNS.discard(self)

    #: How long a standby waits in one request: a release wakes it at once,
    #: so this only bounds how often an idle standby sends a statement (once
    #: per this many seconds) and how late a stopped one's thread ends.
    STANDBY = 10.0

    def _campaign(self) -> None:
        while not self._stop.is_set():
            stood = _monotonic()
            try:
                held = self._elector.acquire(self.key, **self._options(self.STANDBY))
            except LockTimeout:
                continue
            except ManagerClosed:
                return
            except Exception as exc:
                log.warning("dblock: standing for %r failed: %s; again in 1 s", self.role, exc)
                self._stop.wait(1.0)
                continue
            if self._stop.is_set():  # stopped while standing: give it back, untold
                with contextlib.suppress(Exception):
                    held.release(force=True)
                return
            self._begin(held, self._elector.store, stood)
            while not self._stop.is_set() and self.leading:
                self.ended.wait(0.2)
            self.step_down()


_CAMPAIGNS: weakref.WeakSet[Leader] = weakref.WeakSet()


@atexit.register
def _stop_campaigns() -> None:
    """At interpreter exit every campaign steps down, so a standby elsewhere
    takes over at once instead of at the lease's end."""
    for leader in list(_CAMPAIGNS):
        with contextlib.suppress(Exception):
            leader.stop(timeout=2.0)


#: Seconds a SIGTERM waits for the campaigns to step down before the process
#: ends as SIGTERM ends it (then their leases end their terms).
SIGTERM_GRACE = 3.0
_sigterm_installed = False


def _step_down_on_sigterm() -> None:
    """SIGTERM's default ends the process without ``atexit``: where nobody
    handles it (its handler is still the default, and this is the main
    thread, which alone may set one), the campaigns step down first, then
    the process ends as the default would have ended it. The step-down runs
    on a thread of its own, the handler waiting for it at most
    :data:`SIGTERM_GRACE` seconds: the handler interrupts the main thread
    anywhere, perhaps holding a lock the release needs."""
    global _sigterm_installed
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return  # the application (or its server) handles SIGTERM: its exit runs atexit
    _sigterm_installed = True

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        stopping = threading.Thread(target=_stop_campaigns, name="dblock-leader-sigterm")
        stopping.start()
        stopping.join(SIGTERM_GRACE)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
