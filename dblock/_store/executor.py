"""Running the store's statements: the executor (one statement in its own
autocommit transaction, its errors in dblock's terms) and :class:`Driver`,
what every store runs its statements and step sequences with.

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
import re
import threading
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any, TypeVar, cast

import sqlalchemy.exc as sa_exc
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.pool import PoolProxiedConnection, QueuePool

from .._engine import (
    gate_pool_wait,
    has_events,
    invalidate_in_pool,
    mask,
    mask_text,
    max_overflow,
    unshield_waits,
)
from .._signals import handlers_exception, shielded
from ..errors import (
    AuthenticationFailed,
    BackendError,
    ConnectionLost,
    DatabaseUnreachable,
    PoolerMismatch,
    PoolExhausted,
    SchemaMissing,
)

__all__ = [
    "IDLE_SECONDS",
    "Driver",
    "Executor",
    "Interrupted",
    "Params",
    "Result",
    "Statement",
    "Steps",
    "Unreachable",
    "auth_failure",
    "never_sent",
    "not_writable",
    "sqlstate",
    "what_failed",
]

_monotonic = time.monotonic
T = TypeVar("T")

Params = Mapping[str, Any]

# The public names (dblock.ConnectionLost, dblock.DatabaseUnreachable,
# dblock.PoolExhausted, dblock.PoolerMismatch); the store's code says what
# they mean to it.
Interrupted = ConnectionLost
Unreachable = DatabaseUnreachable


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
        "sends",
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
        #: Statements about to be sent, counted (not exactly, across threads:
        #: a count that did not move says none was sent, see Driver.drive).
        self.sends = 0

    @property
    def engine(self) -> Engine:
        return self._engine

    def run(  # noqa: PLR0912, PLR0915 - the hot path, its helpers' common cases inlined
        self, sql: str, params: Params, fetch: bool = False, lastrowid: bool = False
    ) -> Result:
        """Run ``sql``; ``fetch`` its rows if it returns any."""
        # Anyone listening for execution events: the observed path.
        try:
            observed = not self._owns or has_events(self._engine)
        except BaseException as exc:  # a signal handler's: nothing sent yet
            _mark_unsent(exc)
            raise
        if observed:
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
                    # Back to the pool, which recycles or pings it as configured.
                    shielded(conn.close)
                    conn, kept = self._checkout(), None
        except BaseException as exc:  # a signal handler's, say, while waiting for the pool
            _mark_unsent(exc)
            raise
        try:
            self.sends += 1
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
            shielded(conn.invalidate, exc)
            shielded(invalidate_in_pool, self._engine.pool, conn, exc)
            self.release_idle()
        else:
            self._checkin(conn, kept)
        return self.translate(exc, sent=True, interrupted=interrupted)

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
            shielded(conn.invalidate, exc)
            return self.translate(exc, sent=True, interrupted=True)
        # Interrupted mid-statement (KeyboardInterrupt, a signal handler),
        # or parameters the driver cannot encode.
        if self.on_interrupted is not None:
            self.on_interrupted(conn.dbapi_connection)
        shielded(conn.invalidate)
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
            shielded(conn.close)  # back to the pool, which recycles or pings it as configured
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
                shielded(last[0].close)
            self._wait_for_pool()
            return self._connect()
        finally:
            with self._mutex:
                self._pool_waiters -= 1

    def _gate(self, pool: object) -> None:
        """Gate a bounded pool's wait (see the class docstring): whoever is
        about to wait in it (``QueuePool._do_get``) counts itself and first
        hands one idle connection of our stack back to the pool."""
        unshield_waits(self._engine)  # (the pool's waits in dblock's shield: see _connect)
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
            # Shielded: a signal handler's exception inside the pool's
            # bookkeeping would leave its mutex held or its count wrong.
            return shielded(self._engine.raw_connection, undo=_give_back)
        except sa_exc.TimeoutError as exc:
            raise self.exhausted(exc) from exc
        except (sa_exc.DBAPIError, self._dbapi_error) as exc:
            # (SQLAlchemy 2.1 lets connect errors through unwrapped.)
            own = handlers_exception(exc)
            if own is not None:  # the application's, met by the driver's connect
                raise own from None
            orig = exc.orig if isinstance(exc, sa_exc.DBAPIError) else None
            raise self.translate(orig or exc, sent=False) from exc

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
                raise self.exhausted(None)
            time.sleep(min(step, left))
            step = min(step * 2, 0.05)

    def exhausted(self, exc: BaseException | None) -> PoolExhausted:
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
            shielded(conn.invalidate)
        else:
            shielded(conn.close)

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
                shielded(conn.close)

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
            # The checkout and the return shielded (see _connect).
            conn = shielded(self._engine.connect, undo=_give_back)
            try:
                sent = True
                self.sends += 1
                return self._observed_statement(conn, sql, params, fetch, lastrowid)
            finally:
                shielded(conn.close)
        except sa_exc.TimeoutError as exc:  # the pool's, raised before anything was sent
            raise self.exhausted(exc) from exc
        except (sa_exc.DBAPIError, self._dbapi_error) as exc:
            own = None if sent else handlers_exception(exc)
            if own is not None:  # the application's, met by the driver's connect
                _mark_unsent(own)
                raise own from None
            if isinstance(exc, sa_exc.DBAPIError):
                raise self.translate(
                    exc.orig or exc, sent=sent, interrupted=exc.connection_invalidated
                ) from exc
            raise self.translate(exc, sent=sent) from exc
        except BaseException as exc:
            if sent and _undecodable(exc):  # see run()
                raise self.translate(exc, sent=True, interrupted=True) from exc
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
                shielded(conn.invalidate, exc.orig)
                shielded(invalidate_in_pool, self._engine.pool, fairy, exc.orig)
                self.release_idle()
            raise
        except BaseException:
            # Interrupted mid-statement (see run()): SQLAlchemy drops the
            # connection itself only for KeyboardInterrupt and its kin.
            if on_interrupted is not None:
                on_interrupted(dbapi_connection)
            if not conn.invalidated:
                shielded(conn.invalidate)
            raise
        return Result(rows, result.rowcount, result.lastrowid if lastrowid else None)

    def translate(
        self, exc: BaseException, *, sent: bool, interrupted: bool = False
    ) -> BackendError | SchemaMissing:
        if self._is_missing_table(exc):
            return SchemaMissing(self._table, self._url)
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if sent and _prepared_elsewhere(exc):
            return PoolerMismatch(
                f"statement failed on {self._url}: {detail}; the server looks like a "
                "transaction-mode pooler (pgbouncer, ...): pass pooler=True or add "
                "prepare_threshold=None (connect_args of an engine you make; "
                "asyncpg: statement_cache_size=0)"
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


#: How the drivers name the statements they prepare: psycopg ``_pg3_N``,
#: asyncpg ``__asyncpg_stmt_N__``.
_PREPARED_NAMES = ('"_pg3_', '"__asyncpg_stmt_')


def _prepared_elsewhere(exc: BaseException) -> bool:
    """A driver's prepared statements (psycopg's, asyncpg's) found missing
    or different on the server: see :class:`PoolerMismatch`."""
    if getattr(exc, "sqlstate", None) not in _PREPARED_STATES:
        return False
    text = str(exc)
    return any(name in text for name in _PREPARED_NAMES)


def _give_back(conn: PoolProxiedConnection | Connection) -> None:
    """A connection checked out for a statement that will not run (a signal
    handler's exception as the checkout returned): back to the pool."""
    conn.close()


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


def _mark_unsent(exc: BaseException) -> None:
    with contextlib.suppress(AttributeError, TypeError):
        setattr(exc, _UNSENT, True)


def never_sent(exc: BaseException) -> bool:
    """True if ``exc`` (any exception, say a signal handler's) interrupted a
    statement before it reached the database: nothing it would have written
    can have been committed."""
    return getattr(exc, _UNSENT, False) is True


class Driver:
    """Statements run on blocking connections, one at a time under the
    dialect's retry rule (:meth:`run`, :meth:`retry`), or a whole
    :data:`Steps` sequence (:meth:`drive`): a base of every store, which
    sets :attr:`executor`."""

    executor: Executor

    def drive(self, steps: Steps[T]) -> T:
        """Run ``steps`` on blocking connections."""
        run, executor = self.run, self.executor
        sends = executor.sends
        try:
            statement = next(steps)
            while True:
                statement = steps.send(run(*statement))
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except BaseException as exc:
            if executor.sends == sends:
                # Cut off before any statement of these steps left (as a
                # statement's frame started, say): nothing written.
                _mark_unsent(exc)
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

    def lost_contention(self, exc: BackendError) -> bool:
        """Whether the database rolled ``exc``'s statement back as a loser of
        contention (MySQL's deadlock victims): run it again, nothing was
        written. False where statements never lose that way."""
        return False

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
