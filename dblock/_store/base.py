"""The store's contract, and what its dialects share: statement execution,
error translation, results and waiting by backoff.

Every lock statement runs alone in its own autocommit transaction on a pooled
connection that goes back to the pool right after: a held lock pins no
connection and never joins the caller's transaction.

Execution takes one of two paths. On an engine dblock made itself (AUTOCOMMIT
at the engine level) the statement goes to the DBAPI cursor of a pooled
connection, skipping SQLAlchemy's per-statement Core machinery (about 40 us
per statement here, a tenth of a whole lock cycle). Whenever anything listens
for SQLAlchemy execution events on that engine (statement counters, tracing,
logging), and always on an engine the caller passed in, statements go through
``Connection.exec_driver_sql`` so the listeners see every one of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar, TypeVar, cast

import sqlalchemy.exc as sa_exc
from sqlalchemy import Table
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import PoolProxiedConnection, QueuePool

from .._engine import (
    Dialect,
    dialect_of,
    gate_pool_wait,
    has_events,
    invalidate_in_pool,
    mask,
    mask_text,
    max_overflow,
)
from ..config import Config
from ..errors import (
    AuthenticationFailed,
    BackendError,
    ConnectionLost,
    DatabaseUnreachable,
    PoolerMismatch,
    PoolExhausted,
    SchemaMissing,
)
from ..schema import TableNames, lock_table
from .admin import COLUMNS, LockRow, LockStats, SweepReason, TableHealth, lock_row
from .orphans import ORPHAN_ATTEMPTS, Orphans

__all__ = [
    "ORPHAN_ATTEMPTS",
    "Backoff",
    "ExclusiveSQL",
    "Executor",
    "Grant",
    "Holder",
    "Interrupted",
    "Lease",
    "PoolExhausted",
    "PoolerMismatch",
    "Statement",
    "Steps",
    "Store",
    "Unreachable",
    "Wait",
    "never_sent",
    "what_failed",
]

log = logging.getLogger("dblock")
_monotonic = time.monotonic

Params = Mapping[str, Any]
T = TypeVar("T")
K = TypeVar("K")  # the statements of one kind (Store.kind_sql)


@dataclasses.dataclass(slots=True)
class Grant:
    """We hold the row: its fencing number and lease (database time)."""

    fence: int
    expires_at: datetime
    # Seconds from the database's "now" to expires_at, measured by the same
    # statement, so the caller can turn it into a local deadline without
    # trusting the client clock.
    expires_in: float
    #: Which row of the key we hold (``''``: the head row; ``p3``: a semaphore permit).
    slot: str = ""
    #: Fences drawn after ``fence`` while the row was ours (a transfer asked
    #: for them), ascending: the next local hand-offs use them without SQL.
    reserve: tuple[int, ...] = ()
    #: When the statement that granted it was sent (time.monotonic()), if
    #: not when the caller asked: a grouped statement (dblock._store.batch)
    #: goes out after its requests queued, and the lease counts from then.
    sent_at: float | None = None


@dataclasses.dataclass(slots=True)
class Lease:
    """A renewed lease: its end (database time) and seconds from the database's now."""

    expires_at: datetime
    expires_in: float


@dataclasses.dataclass(slots=True)
class Holder:
    """Someone else holds the row (as far as the statement could see)."""

    owner: str | None
    token: str | None
    expires_in: float | None
    #: The kind of lock the key's head row is (``"exclusive"``, ``"rw"``, …),
    #: when the statement read it; another kind than requested means the key
    #: is used as another kind of lock (``KindMismatch``).
    kind: str | None = None


# The public names (dblock.ConnectionLost, dblock.DatabaseUnreachable,
# dblock.PoolExhausted, dblock.PoolerMismatch); the store's code says what
# they mean to it.
Interrupted = ConnectionLost
Unreachable = DatabaseUnreachable


@dataclasses.dataclass(frozen=True)
class ExclusiveSQL:
    """The exclusive lock's acquire and release as a store sends them
    (:meth:`Store.exclusive_sql`, read by ``dblock._hooks`` for the
    benchmark), in the driver's paramstyle."""

    acquire: str
    release: str
    #: What the release takes beyond ``key`` and ``token``.
    release_params: dict[str, Any]
    #: The acquire answers with rows (else its row count says).
    returning: bool
    #: The release answers with rows to be fetched.
    release_returns: bool
    #: The acquire's rows name the holder, granted or not (else a row is a grant).
    names_holder: bool = False


@dataclasses.dataclass(slots=True)
class Result:
    rows: Sequence[tuple[Any, ...]]
    rowcount: int
    lastrowid: int | None


#: One statement to run: its SQL, parameters, whether to fetch its rows and
#: whether to read ``lastrowid``.
Statement = tuple[str, Params, bool, bool]
#: A store operation written without I/O (as psycopg writes its protocol):
#: it yields the statements it needs, receives each one's :class:`Result`,
#: and returns its answer. :meth:`Store.drive` runs it on a blocking
#: connection, ``AsyncStore.drive`` on an async one: one decision logic, two
#: kinds of I/O.
Steps = Generator[Statement, Result, T]


# A connection idle in the executor's stack longer than this goes back to
# SQLAlchemy's pool, so the pool's recycling and pre-ping settings still apply.
IDLE_SECONDS = 30.0

# How long close() waits for statements given up on to end (Orphans.unsettled).
SETTLE_AT_CLOSE = 5.0

# Locks renewed per statement: well under every driver's parameter limit.
RENEW_CHUNK = 500

# Drivers whose DBAPI connection has execute() returning a cursor.
_DIRECT_DRIVERS = frozenset({"psycopg", "pysqlite"})
# Drivers whose cursor the executor keeps with its connection and uses for
# every statement: psycopg's cursors cost more to make than the statement's
# own client side (an adapters map and a transformer each), and its results
# are read in full at execute(), so a kept cursor holds nothing on the server.
_KEEP_CURSOR_DRIVERS = frozenset({"psycopg"})


class Executor:
    """Runs one statement in its own autocommit transaction and translates errors.

    On the fast path the executor keeps a small LIFO stack of connections it
    checked out of SQLAlchemy's pool (lock statements come in bursts; checking
    a connection out and in again costs more CPU than the statement's own
    client side). A connection idle there for :data:`IDLE_SECONDS` is handed
    back to the pool first.

    A bounded pool (``max_overflow`` not negative) counts the stack's
    connections as checked out, so whoever waits in the pool (a thread of
    ours that found the stack empty, or anyone else using the engine) would
    wait for ever while our threads pass them around. So the pool's wait is
    gated (:meth:`_gate`): a waiter first takes one from the stack into the
    pool, and while anyone waits, connections coming back go to the pool,
    not the stack. Both sides decide under one mutex, so none is missed.
    Without that gate the stack was only usable while the pool could still
    open connections, and a pool sized to the threads (``max_overflow=0``)
    paid a pool check-out and check-in per statement.
    """

    __slots__ = (
        "_bounded",
        "_closed",
        "_dbapi_error",
        "_direct",
        "_engine",
        "_idle",
        "_is_missing_table",
        "_keep_cursor",
        "_max_idle",
        "_mutex",
        "_owns",
        "_pool_waiters",
        "_table",
        "_url",
        "on_interrupted",
        "request",
    )

    def __init__(
        self,
        engine: Engine,
        *,
        owns_engine: bool,
        table: str,
        is_missing_table: Callable[[BaseException], bool],
    ) -> None:
        self._owns = owns_engine
        self._engine = (
            engine if owns_engine else engine.execution_options(isolation_level="AUTOCOMMIT")
        )
        self._dbapi_error: type[Exception] = engine.dialect.loaded_dbapi.Error
        self._is_missing_table = is_missing_table
        self._table = table
        self._url = mask(engine.url)
        self._direct = engine.dialect.driver in _DIRECT_DRIVERS
        self._keep_cursor = engine.dialect.driver in _KEEP_CURSOR_DRIVERS
        # (connection, when it was put here, its kept cursor or None)
        self._idle: list[tuple[PoolProxiedConnection, float, Any]] = []
        size = getattr(engine.pool, "size", None)
        self._max_idle = size() if callable(size) else 4
        self._mutex = threading.Lock()
        self._closed = False
        self._pool_waiters = 0  # threads in (or about to enter) the bounded pool's wait
        self._bounded: QueuePool | None = None
        self._gate(engine.pool)
        # Per thread: ``deadline``, the time.monotonic() by which the
        # acquisition under way must end (None: none), so a wait for a pooled
        # connection ends with the request's own timeout rather than the pool's.
        self.request = threading.local()
        #: Called with the DBAPI connection of a statement interrupted after
        #: it was sent, before that connection is dropped (Orphans.settle_later
        #: where the dialect can watch it), or None.
        self.on_interrupted: Callable[[Any], None] | None = None

    @property
    def engine(self) -> Engine:
        return self._engine

    def run(  # noqa: PLR0912 - the hot path, its helpers' common cases inlined
        self, sql: str, params: Params, fetch: bool = False, lastrowid: bool = False
    ) -> Result:
        """Run ``sql``; ``fetch`` its rows if it returns any."""
        # Anyone listening for execution events: the observed path.
        if not self._owns or has_events(self._engine):
            return self._run_observed(sql, params, fetch, lastrowid)
        try:
            # _checkout(), its first step inlined: the connection on top of the stack.
            idle = self._idle
            try:
                conn, since, kept = idle.pop()
            except IndexError:  # none idle (or another thread took the last one)
                conn, kept = self._checkout(), None
            else:
                if _monotonic() - since >= IDLE_SECONDS:
                    conn.close()  # back to the pool, which recycles or pings it as configured
                    conn, kept = self._checkout(), None
        except BaseException as exc:  # a signal handler's, say, while waiting for the pool
            _mark_unsent(exc)
            raise
        try:
            if self._keep_cursor:
                if kept is None:
                    kept = conn.dbapi_connection.cursor()  # type: ignore[union-attr]
                cursor = kept
                cursor.execute(sql, params)
                rows = cursor.fetchall() if fetch else ()
                result = Result(rows, cursor.rowcount, cursor.lastrowid if lastrowid else None)
            elif self._direct:
                cursor = conn.dbapi_connection.execute(sql, params)  # type: ignore[union-attr]
                rows = cursor.fetchall() if fetch else ()
                result = Result(rows, cursor.rowcount, cursor.lastrowid if lastrowid else None)
            else:
                cursor = conn.cursor()
                cursor.execute(sql, params)
                rows = cursor.fetchall() if fetch else ()
                result = Result(rows, cursor.rowcount, cursor.lastrowid if lastrowid else None)
                cursor.close()
        except self._dbapi_error as exc:
            raise self._failed(conn, kept, exc) from exc
        except BaseException as exc:
            translated = self._cut_off(conn, exc)
            if translated is not None:
                raise translated from exc
            raise
        # _checkin(conn, kept), inlined (the hot path).
        if len(self._idle) < self._max_idle and not self._pool_waiters:
            if self._bounded is None:
                self._idle.append((conn, _monotonic(), kept))
                return result
            with self._mutex:
                if not self._pool_waiters:
                    self._idle.append((conn, _monotonic(), kept))
                    return result
        self._put_back(conn)
        return result

    def _failed(
        self, conn: PoolProxiedConnection, kept: Any, exc: Exception
    ) -> BackendError | SchemaMissing:
        """The driver raised ``exc`` for a statement on ``conn``: keep the
        connection or drop it, and say what went wrong in dblock's terms."""
        interrupted = self._engine.dialect.is_disconnect(
            cast(Any, exc), conn.dbapi_connection, None
        )
        if interrupted or not_writable(exc):
            # Like SQLAlchemy on a disconnect: drop this connection and
            # recycle every older one, which is likely dead too. A server
            # that answers "read-only" is a standby (a demoted primary
            # behind a route that still points at it): a new connection
            # goes wherever the route points now (a balancer's, a
            # multi-host URL's read-write choice), this one never will.
            conn.invalidate(exc)
            invalidate_in_pool(self._engine.pool, conn, exc)
            self.release_idle()
        else:
            self._checkin(conn, kept)
        return self._translate(exc, sent=True, interrupted=interrupted)

    def _cut_off(
        self, conn: PoolProxiedConnection, exc: BaseException
    ) -> BackendError | SchemaMissing | None:
        """Something other than a database error ended a statement on
        ``conn`` midway: the connection's protocol state is unknown, so it
        goes. What to raise instead of ``exc``, if anything."""
        if _undecodable(exc):
            # The driver could not decode the answer (seen on Galera: a row
            # of empty fields from a statement brute-force aborted as it
            # ran): the connection's protocol state is unknown, and so is
            # the outcome.
            conn.invalidate(exc)
            return self._translate(exc, sent=True, interrupted=True)
        # Interrupted mid-statement (KeyboardInterrupt, a signal handler),
        # or parameters the driver cannot encode.
        if self.on_interrupted is not None:
            self.on_interrupted(conn.dbapi_connection)
        conn.invalidate()
        return None

    def _checkout(self) -> PoolProxiedConnection:
        idle = self._idle
        while idle:
            try:
                conn, since, _ = idle.pop()
            except IndexError:  # another thread took the last one
                break
            if _monotonic() - since < IDLE_SECONDS:
                return conn
            conn.close()  # back to the pool, which recycles or pings it as configured
        if self._bounded is None:
            return self._connect()
        with self._mutex:
            # From here on, connections coming back go to the pool (see _gate);
            # one put in the stack before we counted ourselves is ours.
            self._pool_waiters += 1
            last = idle.pop() if idle else None
        try:
            if last is not None:
                if _monotonic() - last[1] < IDLE_SECONDS:
                    return last[0]
                last[0].close()
            self._wait_for_pool()
            return self._connect()
        finally:
            with self._mutex:
                self._pool_waiters -= 1

    def _gate(self, pool: object) -> None:
        """Gate a bounded pool's wait (see the class docstring): whoever is
        about to wait in it (``QueuePool._do_get``) counts itself and first
        hands one idle connection of our stack back to the pool."""
        self._bounded = None
        if not isinstance(pool, QueuePool) or max_overflow(pool) < 0:
            return
        self._bounded = pool
        if not self._owns:
            # A borrowed engine's statements never use the stack (see run()),
            # and its pool is the application's: leave it as it is.
            return

        def gated_get(get: Callable[[], Any]) -> Any:
            with self._mutex:
                self._pool_waiters += 1
                spare = self._idle.pop() if self._idle else None
            try:
                if spare is not None:
                    spare[0].close()  # into the pool, for this very wait
                return get()
            finally:
                with self._mutex:
                    self._pool_waiters -= 1

        gate_pool_wait(pool, gated_get)

    def _connect(self) -> PoolProxiedConnection:
        try:
            return self._engine.raw_connection()
        except sa_exc.TimeoutError as exc:
            raise self._exhausted(exc) from exc
        except sa_exc.DBAPIError as exc:
            raise self._translate(exc.orig or exc, sent=False) from exc
        except self._dbapi_error as exc:  # SQLAlchemy 2.1 lets connect errors through
            raise self._translate(exc, sent=False) from exc

    def _wait_for_pool(self) -> None:
        """If every pooled connection is checked out and this thread has a
        deadline, wait for one to come free (polling) until that deadline:
        the pool's own wait knows only the pool's timeout. A connection freed
        and taken by another thread between the check and the checkout still
        leaves us in the pool's wait, bounded by its timeout."""
        deadline: float | None = getattr(self.request, "deadline", None)
        if deadline is None:
            return
        step = 0.001
        while self._pool_exhausted():
            left = deadline - _monotonic()
            if left <= 0:
                raise self._exhausted(None)
            time.sleep(min(step, left))
            step = min(step * 2, 0.05)

    def _exhausted(self, exc: BaseException | None) -> PoolExhausted:
        pool = self._engine.pool
        if isinstance(pool, QueuePool):
            what = (
                f"pool_size {pool.size()}, max_overflow {max_overflow(pool)}, "
                f"pool_timeout {pool.timeout():g} s"
            )
        else:
            what = type(pool).__name__
        why = (
            "no connection came free within the pool's timeout"
            if exc is not None
            else "no connection came free before the request's timeout"
        )
        return PoolExhausted(
            f"the connection pool of {self._url} is exhausted ({what}; all checked out): "
            f"{why}; nothing was sent to the database"
        )

    def _checkin(self, conn: PoolProxiedConnection, kept: Any = None) -> None:
        if len(self._idle) < self._max_idle and not self._pool_waiters:
            with self._mutex:
                if not self._pool_waiters:
                    self._idle.append((conn, _monotonic(), kept))
                    return
        self._put_back(conn)

    def _put_back(self, conn: PoolProxiedConnection) -> None:
        if self._closed and self._owns:
            # The store closed while this statement ran (a thread releasing
            # as the manager closes): the pool it came from is disposed, and
            # a connection checked in there would stay open until collected.
            conn.invalidate()
        else:
            conn.close()

    def _pool_exhausted(self) -> bool:
        """Whether every connection the pool may make is checked out (those
        idle here included): only then can a thread be waiting for one, and
        a connection kept idle here would leave it waiting until the pool's
        timeout."""
        pool = self._bounded
        if pool is None:
            return False
        overflow = max_overflow(pool)
        if pool.overflow() < overflow:  # it may still open another
            return False
        return pool.checkedout() >= pool.size() + overflow

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Keep no connection from now on: hand back the idle ones, and close
        those in use when their statements return (see :meth:`_put_back`)."""
        self._closed = True
        self._max_idle = 0
        self.release_idle()

    def release_idle(self) -> None:
        """Hand every idle connection back to the pool."""
        while self._idle:
            try:
                conn, _, _ = self._idle.pop()
            except IndexError:
                return
            with contextlib.suppress(Exception):
                conn.close()

    def forget_idle(self) -> None:
        """In a forked child: drop the parent's connections without touching
        them, and gate the child's new pool (``engine.dispose()`` made it)."""
        self._idle = []
        self._mutex = threading.Lock()  # perhaps held by a parent's thread at the fork
        self._pool_waiters = 0
        self._gate(self._engine.pool)

    def _run_observed(self, sql: str, params: Params, fetch: bool, lastrowid: bool) -> Result:
        sent = False
        try:
            if self._bounded is not None:
                self._wait_for_pool()
            with self._engine.connect() as conn:
                sent = True
                return self._observed_statement(conn, sql, params, fetch, lastrowid)
        except sa_exc.TimeoutError as exc:  # the pool's, raised before anything was sent
            raise self._exhausted(exc) from exc
        except sa_exc.DBAPIError as exc:
            raise self._translate(
                exc.orig or exc, sent=sent, interrupted=exc.connection_invalidated
            ) from exc
        except self._dbapi_error as exc:
            raise self._translate(exc, sent=sent) from exc
        except BaseException as exc:
            if sent and _undecodable(exc):  # see run()
                raise self._translate(exc, sent=True, interrupted=True) from exc
            if not sent:
                _mark_unsent(exc)
            raise

    def _observed_statement(
        self, conn: Connection, sql: str, params: Params, fetch: bool, lastrowid: bool
    ) -> Result:
        on_interrupted = self.on_interrupted
        if on_interrupted is not None:
            dbapi_connection = conn.connection.dbapi_connection
        try:
            result = conn.exec_driver_sql(sql, dict(params))
            rows = [tuple(r) for r in result.fetchall()] if fetch else []
        except sa_exc.DBAPIError as exc:
            if exc.orig is not None and not_writable(exc.orig):  # see run()
                fairy = conn.connection
                conn.invalidate(exc.orig)
                invalidate_in_pool(self._engine.pool, fairy, exc.orig)
                self.release_idle()
            raise
        except BaseException:
            # Interrupted mid-statement (see run()): SQLAlchemy drops the
            # connection itself only for KeyboardInterrupt and its kin.
            if on_interrupted is not None:
                on_interrupted(dbapi_connection)
            if not conn.invalidated:
                conn.invalidate()
            raise
        return Result(rows, result.rowcount, result.lastrowid if lastrowid else None)

    def _translate(
        self, exc: BaseException, *, sent: bool, interrupted: bool = False
    ) -> BackendError | SchemaMissing:
        if self._is_missing_table(exc):
            return SchemaMissing(self._table, self._url)
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if sent and _prepared_elsewhere(exc):
            return PoolerMismatch(
                f"statement failed on {self._url}: {detail}; the server looks like a "
                "transaction-mode pooler (pgbouncer, ...): pass pooler=True or add "
                "prepare_threshold=None (connect_args of an engine you make)"
            )
        if not sent:
            reason = auth_failure(exc)
            if reason is not None:
                return AuthenticationFailed(
                    f"authentication failed on {self._url}: {mask_text(reason)} "
                    "(check the user, password and grants in the URL)"
                )
            return Unreachable(f"cannot connect to {self._url}: {mask_text(detail)}")
        if interrupted:
            return Interrupted(f"connection to {self._url} lost during a statement: {detail}")
        return BackendError(f"statement failed on {self._url}: {detail}")


#: SQLSTATEs of a prepared statement missing (26000), already there (42P05),
#: or bound with another statement's parameters (08P01, a protocol violation).
_PREPARED_STATES = frozenset({"26000", "42P05", "08P01"})


def _prepared_elsewhere(exc: BaseException) -> bool:
    """psycopg's prepared statements (named ``_pg3_N``) found missing or
    different on the server: see :class:`PoolerMismatch`."""
    return getattr(exc, "sqlstate", None) in _PREPARED_STATES and '"_pg3_' in str(exc)


def what_failed(exc: BackendError) -> str:
    """How a log line names the fault ``exc``: an unreachable database only
    when it was one (no connection, or the connection lost mid-statement)."""
    if isinstance(exc, (Unreachable, Interrupted)):
        return "the database is unreachable"
    return "the database failed a statement"


# MySQL / MariaDB: access denied to the database (1044), for the user and
# password (1045), for the user by its authentication plugin (1698).
_MYSQL_AUTH_ERRORS = frozenset({1044, 1045, 1698})
# PostgreSQL: invalid_password, invalid_authorization_specification.
_PG_AUTH_SQLSTATES = frozenset({"28P01", "28000"})
# libpq gives no SQLSTATE for a refused login (there is no result to carry
# it), only the server's FATAL message: these are the authentication ones.
_PG_AUTH_MESSAGE = re.compile(
    r"FATAL:\s+((?:password|ident|peer|md5|scram|sspi|gss|ldap|radius|cert|pam)"
    r"[\w-]* authentication failed.*|role \S+ does not exist.*|"
    r"role \S+ is not permitted to log in.*|no pg_hba\.conf entry.*|"
    r"permission denied for database.*)",
    re.IGNORECASE,
)


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE a PostgreSQL driver's error carries: psycopg 3 names it
    ``sqlstate``, psycopg2 ``pgcode``; None for any other error."""
    code = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
    return code if isinstance(code, str) else None


def auth_failure(exc: BaseException) -> str | None:
    """The server's reason if ``exc`` (a driver's connect error) says the
    server refused to log in, as opposed to not answering at all."""
    args: tuple[Any, ...] = getattr(exc, "args", ())
    if len(args) >= 2 and isinstance(args[0], int) and args[0] in _MYSQL_AUTH_ERRORS:
        return f"{args[1]} (error {args[0]})"
    text = str(exc)
    if sqlstate(exc) in _PG_AUTH_SQLSTATES:
        return text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    found = _PG_AUTH_MESSAGE.search(text)
    return found.group(1).strip() if found else None


_UNSENT = "_dblock_unsent"


# The answers of a server that takes no writes: PostgreSQL's
# read_only_sql_transaction (a hot standby, default_transaction_read_only),
# MySQL/MariaDB's "running with --read-only" (1290) and "read-only
# transaction" (1792).
_READ_ONLY_SQLSTATES = frozenset({"25006"})
_READ_ONLY_ERRNOS = frozenset({1290, 1792})


def not_writable(exc: BaseException) -> bool:
    """``exc`` says the server that ran the statement takes no writes: the
    connection reached a standby, and only a new connection can reach the
    primary. Nothing was written: the statement was refused, not interrupted."""
    if sqlstate(exc) in _READ_ONLY_SQLSTATES:
        return True
    code = exc.args[0] if exc.args else None
    return isinstance(code, int) and code in _READ_ONLY_ERRNOS


def _undecodable(exc: BaseException) -> bool:
    """An answer the driver failed to decode: a ValueError, but not the
    UnicodeEncodeError of parameters it cannot encode (those never reach the
    server, and an orphan with such a key is given up, not retried)."""
    return isinstance(exc, ValueError) and not isinstance(exc, UnicodeEncodeError)


def _nothing() -> None:
    pass


def _mark_unsent(exc: BaseException) -> None:
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, _UNSENT, True)


def never_sent(exc: BaseException) -> bool:
    """True if ``exc`` (any exception, say a signal handler's) interrupted a
    statement before it reached the database: nothing it would have written
    can have been committed."""
    return getattr(exc, _UNSENT, False) is True


class Wait:
    """How a level-1 winner waits between attempts on the database."""

    def prepare(self) -> None:
        """Called before every attempt, so a wake-up after it is not missed."""

    def sleep(self, limit: float) -> None:
        """Sleep until woken, or ``limit`` seconds at most."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class Backoff(Wait):
    """Capped exponential backoff with jitter. The caller caps each sleep by
    the holder's remaining lease and its own deadline."""

    __slots__ = ("_cap", "_next")

    def __init__(self, initial: float, cap: float) -> None:
        self._next = initial
        self._cap = cap

    def step(self, limit: float) -> float:
        """How long the next sleep lasts (at most ``limit``)."""
        step = min(self._next, limit)
        self._next = min(self._next * 2, self._cap)
        if step <= 0:
            return 0.0
        # "Equal jitter": half the step is fixed so waiters keep making
        # progress, half is random so they do not retry in lockstep.
        return step / 2 + random.random() * step / 2

    def sleep(self, limit: float) -> None:
        step = self.step(limit)
        if step > 0:
            time.sleep(step)


class Store:
    """One dialect's lock statements. Subclasses register with
    :func:`dblock._store.register` under the SQLAlchemy dialect name."""

    #: The dialect can hand a held row to a new token and fence in one statement.
    #: (Read at each release: a dialect may know it only once it met its server.)
    can_transfer: bool = False
    #: Its transfer can also draw fences for the hand-offs after it
    #: (``transfer_steps(extra=n)``), all under the row's lock.
    reserves_fences: bool = False
    #: The dialect can wake waiters when a key is released.
    can_notify: ClassVar[bool] = False

    def __init__(self, engine: Engine, *, config: Config, owns_engine: bool) -> None:
        self.config = config
        self.names = TableNames.of(config)
        self.table: Table = lock_table(self.names)
        self.engine = engine
        self.owns_engine = owns_engine
        self.executor = Executor(
            engine,
            owns_engine=owns_engine,
            table=self.names.table,
            is_missing_table=self.is_missing_table,
        )
        self.quoted = engine.dialect.identifier_preparer.quote
        #: What this store's database is and can do: from the dialect's name
        #: now, with the server's own facts once :meth:`server_steps` ran.
        self.dialect: Dialect = dialect_of(engine.dialect.name)
        #: Rows of acquisitions whose outcome we never learned (see
        #: dblock._store.orphans), deleted as soon as the database answers.
        self.orphans = Orphans(self)
        self._orphans_lock = self.orphans.lock  # (the tests' name for it)
        #: Wakes whoever deletes the orphans (the lock facade's renewal thread).
        self.wake_cleaner: Callable[[], None] = _nothing
        if self.alive_sql is not None:
            self.executor.on_interrupted = self.orphans.settle_later
        self._kind_sql: dict[Callable[[Any], Any], Any] = {}

    def kind_sql(self, make: Callable[[Store], K]) -> K:
        """The statements of one kind of lock (the fair queue, jobs, ...) in
        this store's dialect, built once per store by ``make``, which the
        kind's own module in this package offers (it picks the dialect's
        class): the one way a kind speaks a dialect."""
        found = self._kind_sql.get(make)
        if found is None:
            found = self._kind_sql[make] = make(self)
        return cast("K", found)

    def server_steps(self) -> Steps[Dialect]:
        """Read what only the server can say of the dialect (once: the
        dialect's store sets :attr:`dialect` the first time); nothing to
        read where the name says it all."""
        yield from ()  # nothing to send
        return self.dialect

    def known_dialect(self) -> Dialect:
        """:attr:`dialect`, the server's facts read first if need be (one
        blocking statement or three, once per store)."""
        if not self.dialect.known:
            self.drive(self.server_steps())
        return self.dialect

    # -- the contract ------------------------------------------------------

    # Each operation is written once, as :data:`Steps`; the methods without
    # ``_steps`` drive it here, on a blocking connection.

    def acquire_steps(self, key: str, token: str, owner: str, ttl: float) -> Steps[Grant | Holder]:
        """One attempt. :class:`Grant` if we hold the row now (new, taken over
        from an expired holder, or already ours with this token)."""
        raise NotImplementedError

    def release_steps(self, key: str, token: str) -> Steps[bool]:
        """Delete our row; False if it was not ours any more."""
        raise NotImplementedError

    def transfer_steps(
        self, key: str, token: str, new_token: str, owner: str, ttl: float, *, extra: int = 0
    ) -> Steps[Grant | None]:
        """Give our row to ``new_token`` with a new fence and lease; None if it
        was not ours any more. Only when :attr:`can_transfer`. With ``extra``
        (only when :attr:`reserves_fences`) the grant's ``reserve`` carries up
        to that many more fences, each greater than its ``fence`` and smaller
        than any fence drawn for this key after the row leaves us."""
        raise NotImplementedError

    def acquire_many_steps(
        self, requests: Sequence[tuple[str, str, str, float]]
    ) -> Steps[list[Grant | Holder]]:
        """Group commit (:mod:`dblock._store.batch`): one attempt for each
        ``(key, token, owner, ttl)`` of distinct keys, in one statement and
        one commit where the dialect allows, each answered as
        :meth:`acquire_steps` would answer it alone, in order. Dialects that
        cannot leave it out, and their requests go one by one."""
        raise NotImplementedError

    def release_many_steps(self, requests: Sequence[tuple[str, str]]) -> Steps[list[bool]]:
        """Group commit: :meth:`release_steps` for each ``(key, token)`` of
        distinct keys, answered in order."""
        raise NotImplementedError

    def exclusive_sql(self) -> ExclusiveSQL:
        """The exclusive lock's two statements as this store sends them (on
        the MySQL family, once the server said whether it has RETURNING)."""
        raise NotImplementedError

    def try_acquire(self, key: str, token: str, owner: str, ttl: float) -> Grant | Holder:
        return self.drive(self.acquire_steps(key, token, owner, ttl))

    def release(self, key: str, token: str) -> bool:
        return self.drive(self.release_steps(key, token))

    def transfer(
        self, key: str, token: str, new_token: str, owner: str, ttl: float, *, extra: int = 0
    ) -> Grant | None:
        return self.drive(self.transfer_steps(key, token, new_token, owner, ttl, extra=extra))

    def drive(self, steps: Steps[T]) -> T:
        """Run ``steps`` on blocking connections."""
        run = self.run
        try:
            statement = next(steps)
            while True:
                statement = steps.send(run(*statement))
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except BaseException:
            # Their clean-up (a ``finally`` around a statement) runs here,
            # where an exception it meets reaches the caller, not later in
            # the garbage collector, which only prints it.
            steps.close()
            raise

    def retry(self, sql: str, exc: BackendError, attempt: int) -> Result | float | None:
        """What to do when ``sql`` failed with ``exc`` (its ``attempt``-th
        failure in a row): ``None`` raises it, a number runs the statement
        again after that many seconds, a :class:`Result` stands for its outcome."""
        return None

    def renew(self, locks: Sequence[tuple[str, str, float]]) -> dict[str, Lease]:
        """Extend each ``(key, token, ttl)`` whose row is still ours, in as few
        statements as the dialect allows; returns the new lease per token.
        A token missing from the result was not ours any more."""
        return self.drive(self.renew_steps(locks))

    def renew_steps(self, locks: Sequence[tuple[str, str, float]]) -> Steps[dict[str, Lease]]:
        """:meth:`renew`, written once for blocking and async connections."""
        leases: dict[str, Lease] = {}
        for start in range(0, len(locks), RENEW_CHUNK):
            leases.update((yield from self._renew_chunk(locks[start : start + RENEW_CHUNK])))
        return leases

    def _renew_chunk(self, locks: Sequence[tuple[str, str, float]]) -> Steps[dict[str, Lease]]:
        raise NotImplementedError

    def waiter(self, key: str, since: float, address: str | None = None) -> Wait:
        """How to wait for ``key`` after an attempt that started at ``since``
        (``time.monotonic()``) found it held; a fair-queue waiter is also
        woken by wake-ups sent to its ``address``."""
        return Backoff(self.config.poll_initial, self.config.poll_max)

    def hot(self, key: str, ends_run: bool = False) -> None:
        """``key`` is released while local threads wait for it (dblock.lock):
        other processes likely wait for it too. A store whose wake-ups cost a
        statement per held key (MySQL's named locks) keeps the key named for
        the next local grant, which follows at once, unless the release
        ``ends_run`` (gives way to other processes: they are woken)."""

    def lost_contention(self, exc: BackendError) -> bool:
        """Whether the database rolled ``exc``'s statement back as a loser of
        contention (MySQL's deadlock victims): run it again, nothing was
        written. False where statements never lose that way."""
        return False

    def others_wait(self, key: str) -> bool:
        """Whether waiters of other processes were seen waiting for ``key``
        lately. Asked by a store without hand-off (:attr:`can_transfer`
        false), whose threads end a long run of local grants only when
        somebody else waits; False where nobody can tell."""
        return False

    def others_wait_steps(self, key: str) -> Steps[bool] | None:
        """A statement asking whether a waiter of another process waits for
        ``key`` now, for a run's end that :meth:`others_wait` knows nothing
        of; None where nobody can tell."""
        return None

    def is_missing_table(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def notify_key(self, key: str) -> str:
        """The key a release of ``key`` is announced under (see the semaphore's store)."""
        return key

    def close(self) -> None:
        # A statement given up on may still be running (see Orphans.unsettled):
        # its orphans are deleted once it ended, if that is soon.
        deadline = time.monotonic() + SETTLE_AT_CLOSE
        while self.orphans.running and time.monotonic() < deadline:
            time.sleep(0.01)
        self.clean_orphans()
        self.executor.close()
        if self.owns_engine:
            self.engine.dispose()

    def after_fork(self) -> None:
        """In a forked child: never reuse the parent's connections."""
        self.engine.dispose(close=False)
        self.executor.forget_idle()
        self.orphans.after_fork()
        self._orphans_lock = self.orphans.lock

    # -- orphans (see dblock._store.orphans) ---------------------------------

    def add_orphan(
        self,
        key: str,
        token: str,
        *,
        released: bool = False,
        unreachable: bool = False,
        settle: Callable[[], Steps[bool]] | None = None,
    ) -> None:
        """:meth:`Orphans.add`: delete the row of ``(key, token)`` once the
        database answers (``settle``: what to send instead)."""
        self.orphans.add(key, token, released=released, unreachable=unreachable, settle=settle)

    def is_orphan(self, key: str, token: str) -> bool:
        return self.orphans.is_orphan(key, token)

    @property
    def has_orphans(self) -> bool:
        return bool(self.orphans.queue)

    def clean_orphans(self) -> None:
        """:meth:`Orphans.clean`: delete them now, if the database answers."""
        self.orphans.clean()

    # -- helpers for the dialects -----------------------------------------

    def run(self, sql: str, params: Params, fetch: bool = False, lastrowid: bool = False) -> Result:
        attempt = 0
        while True:
            try:
                return self.executor.run(sql, params, fetch, lastrowid)
            except BackendError as exc:
                then = self.retry(sql, exc, attempt)
                if then is None:
                    raise
                if isinstance(then, Result):
                    return then
                time.sleep(then)
                attempt += 1

    # -- admin: dblock list / stats / release --force, and the sweeper ------
    # Not on the lock's hot path. Every comparison uses the database's clock.

    #: SQL finding the server's thread (or process) of a connection by its
    #: id, while it exists (see :meth:`Orphans.settle_later`); None: nothing to watch.
    alive_sql: ClassVar[str | None] = None

    @staticmethod
    def server_thread(dbapi_connection: Any) -> int:
        """The id :attr:`alive_sql` looks for, of a DBAPI connection."""
        raise NotImplementedError

    #: SQL for the database's current time, in the form the dialect stores times.
    now_sql: ClassVar[str] = "CURRENT_TIMESTAMP"
    #: How the DBAPI driver spells a named parameter.
    param_style: ClassVar[str] = "%({})s"

    def rows(
        self,
        *,
        key: str | None = None,
        prefix: str | None = None,
        owner: str | None = None,
        limit: int | None = None,
    ) -> list[LockRow]:
        """Lock rows, oldest acquisition first: all of them, the ones of
        ``key``, or those whose key starts with ``prefix`` (taken literally,
        case-sensitive) and are held by ``owner`` (the owner column exactly,
        case, accents and trailing spaces included on every database, or any
        owner under it: ``host:pid`` names every thread of that process,
        ``host`` every process of that host); at most ``limit``."""
        bind = self.param_style.format
        conditions: list[str] = []
        params: dict[str, Any] = {}
        if key is not None:
            conditions.append(f"lock_key = {bind('key')}")
            params["key"] = key
        elif prefix:
            # Not LIKE: its wildcards would need escaping, and SQLite's LIKE ignores case.
            conditions.append(f"substr(lock_key, 1, {len(prefix)}) = {bind('prefix')}")
            params["prefix"] = prefix
        if owner:
            # Exactly that owner (case, accents: the column's binary collation
            # on MySQL/MariaDB since revision 0004; trailing spaces:
            # the lengths, which a PAD SPACE collation ignores), or one under it.
            conditions.append(
                f"((owner = {bind('owner')} AND length(owner) = length({bind('owner')})) "
                f"OR substr(owner, 1, {len(owner) + 1}) = {bind('owner_under')})"
            )
            params.update(owner=owner, owner_under=f"{owner}:")
        where = f"WHERE {' AND '.join(conditions)} " if conditions else ""
        bound = f" LIMIT {int(limit)}" if limit is not None else ""
        sql = (
            f"SELECT {COLUMNS}, {self.now_sql} FROM {self.quoted(self.names.table)} "
            f"{where}ORDER BY acquired_at, lock_key, slot{bound}"
        )
        return [lock_row(r) for r in self.run(sql, params, fetch=True).rows]

    def is_locked_steps(self, key: str) -> Steps[bool]:
        """Whether some row of ``key`` holds it now, by the database's clock:
        an exclusive or fair holder, a read or write phase with holders, a
        semaphore permit; a queued or waiting request holds nothing, and a row
        whose lease ran out is as good as free (the next acquire takes it
        over). One statement."""
        bind = self.param_style.format
        sql = (
            f"SELECT 1 FROM {self.quoted(self.names.table)} WHERE lock_key = {bind('key')} "
            f"AND expires_at > {self.now_sql} AND holders > 0 "
            "AND mode NOT IN ('queued', 'waiting') LIMIT 1"
        )
        return bool((yield sql, {"key": key}, True, False).rows)

    def release_row(self, key: str, slot: str, token: str) -> bool:
        """Delete one row of ``key`` of any kind (``dblock release --force``,
        the admin pages), by its slot and the token read: False if it changed
        hands meanwhile. Waiters are woken as by a release."""
        bind = self.param_style.format
        sql = (
            f"DELETE FROM {self.quoted(self.names.table)} WHERE lock_key = {bind('key')} "
            f"AND slot = {bind('slot')} AND token = {bind('token')}"
        )
        return self.run(sql, {"key": key, "slot": slot, "token": token}).rowcount > 0

    def release_rows(self, rows: Sequence[LockRow]) -> list[LockRow]:
        """Delete ``rows`` as read (each by its slot and token, so a row that
        changed hands since stays) and return those deleted."""
        return [r for r in rows if self.release_row(r.key, r.slot, r.token)]

    def release_key(self, key: str) -> list[LockRow]:
        """Delete every row of ``key`` (each by the token read, so a row that
        changes hands meanwhile stays) and return those deleted."""
        return self.release_rows(self.rows(key=key))

    def stats(self, *, storage: bool = False) -> LockStats:
        """How many rows, how many of them expired, and the oldest; with
        ``storage``, also what the database says of the table's storage
        (:meth:`table_health`: a few more statements, for ``dblock stats``)."""
        sql = (
            f"SELECT count(*), coalesce(sum(CASE WHEN expires_at <= {self.now_sql} "
            f"THEN 1 ELSE 0 END), 0) FROM {self.quoted(self.names.table)}"
        )
        total, expired = self.run(sql, {}, fetch=True).rows[0]
        oldest = self.rows(limit=1)
        health = None
        try:
            health = self.table_health() if storage else None
        except BackendError as exc:
            # A user allowed to read the table but not the server's statistics
            # (MySQL's PROCESS privilege): the counts still stand.
            log.debug("dblock: the lock table's storage figures are unreadable: %s", exc)
        return LockStats(
            rows=int(total),
            expired=int(expired),
            oldest=oldest[0] if oldest else None,
            table=health,
        )

    def table_health(self) -> TableHealth | None:
        """What the database says of the lock table's storage (size, dead rows,
        vacuum; purge lag), or None where it says nothing useful (SQLite)."""
        return None

    def vacuum(self, dead_rows: int) -> bool:
        """PostgreSQL: VACUUM the lock table if it has at least ``dead_rows``
        dead rows (the sweeper's, after a run); True if it did. Elsewhere
        nothing to do (InnoDB's purge and SQLite's free pages need no help)."""
        return False

    def sweep(self, reason: SweepReason, *, older_than: float, limit: int) -> list[LockRow]:
        """Delete at most ``limit`` rows whose ``reason.column`` lies more than
        ``older_than`` seconds in the past (database time), in one short
        statement (or, without RETURNING, a few), and return them as deleted.
        Rows another transaction is changing right now are skipped, not waited for."""
        raise NotImplementedError


def first(rows: Sequence[tuple[Any, ...]]) -> tuple[Any, ...] | None:
    return rows[0] if rows else None
