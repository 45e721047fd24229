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
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Mapping, Sequence
from datetime import datetime
from typing import Any, ClassVar, TypeVar, cast

import sqlalchemy.exc as sa_exc
from sqlalchemy import Table
from sqlalchemy.engine import Engine
from sqlalchemy.pool import PoolProxiedConnection, QueuePool

from .._engine import mask
from ..config import Config
from ..errors import BackendError, SchemaMissing
from ..schema import TableNames, lock_table
from .admin import COLUMNS, LockRow, LockStats, SweepReason, lock_row

__all__ = [
    "Backoff",
    "Executor",
    "Grant",
    "Holder",
    "Interrupted",
    "Lease",
    "PoolExhausted",
    "Statement",
    "Steps",
    "Store",
    "Unreachable",
    "Wait",
    "never_sent",
]

log = logging.getLogger("dblock")
_monotonic = time.monotonic

Params = Mapping[str, Any]
T = TypeVar("T")


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


class Interrupted(BackendError):
    """The connection broke while a statement was in flight: it may or may not
    have been committed."""


class Unreachable(BackendError):
    """No statement was sent: the database could not be reached (or no
    connection could be had). Nothing was written; trying again may work."""


class PoolExhausted(Unreachable):
    """Every connection of the engine's pool is checked out, and none came
    free in time. Nothing was sent."""


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

# Answers with an error the DELETE of an orphan may get before it is dropped.
ORPHAN_ATTEMPTS = 3

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
    """

    __slots__ = (
        "_bounded",
        "_dbapi_error",
        "_direct",
        "_engine",
        "_idle",
        "_is_missing_table",
        "_keep_cursor",
        "_max_idle",
        "_owns",
        "_table",
        "_url",
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
        pool = engine.pool
        self._bounded: QueuePool | None = None
        if isinstance(pool, QueuePool) and getattr(pool, "_max_overflow", -1) >= 0:
            self._bounded = pool
        # Per thread: ``deadline``, the time.monotonic() by which the
        # acquisition under way must end (None: none), so a wait for a pooled
        # connection ends with the request's own timeout rather than the pool's.
        self.request = threading.local()

    @property
    def engine(self) -> Engine:
        return self._engine

    def run(  # noqa: PLR0912, PLR0915 - the hot path, its helpers' common cases inlined
        self, sql: str, params: Params, fetch: bool = False, lastrowid: bool = False
    ) -> Result:
        """Run ``sql``; ``fetch`` its rows if it returns any."""
        # SQLAlchemy's own test for "does anyone listen?"; if the attribute ever
        # goes away we fall back to the observed path, which is always correct.
        if not self._owns or getattr(self._engine, "_has_events", True):
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
            interrupted = self._engine.dialect.is_disconnect(
                cast(Any, exc), conn.dbapi_connection, None
            )
            if interrupted:
                # Like SQLAlchemy on a disconnect: drop this connection and
                # recycle every older one, which is likely dead too.
                conn.invalidate(exc)
                self._engine.pool._invalidate(conn, exc)
                self.release_idle()
            else:
                self._checkin(conn, kept)
            raise self._translate(exc, sent=True, interrupted=interrupted) from exc
        except BaseException as exc:
            if _undecodable(exc):
                # The driver could not decode the answer (seen on Galera: a row
                # of empty fields from a statement brute-force aborted as it
                # ran): the connection's protocol state is unknown, and so is
                # the outcome.
                conn.invalidate(exc)
                raise self._translate(exc, sent=True, interrupted=True) from exc
            # Interrupted mid-statement (KeyboardInterrupt, a signal handler),
            # or parameters the driver cannot encode: the connection's
            # protocol state is unknown.
            conn.invalidate()
            raise
        # _checkin(conn), inlined (the hot path), with the first test of
        # _pool_exhausted(): a pool that may still open another connection.
        pool = self._bounded
        if len(self._idle) < self._max_idle and (
            pool is None or pool.overflow() < pool._max_overflow or not self._pool_exhausted()
        ):
            self._idle.append((conn, _monotonic(), kept))
        else:
            conn.close()
        return result

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
        if self._bounded is not None:
            self._wait_for_pool()
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
                f"pool_size {pool.size()}, max_overflow {getattr(pool, '_max_overflow', '?')}, "
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
        if len(self._idle) < self._max_idle and not self._pool_exhausted():
            self._idle.append((conn, _monotonic(), kept))
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
        max_overflow: int = pool._max_overflow
        if pool.overflow() < max_overflow:  # it may still open another
            return False
        return pool.checkedout() >= pool.size() + max_overflow

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
        """In a forked child: drop the parent's connections without touching them."""
        self._idle = []

    def _run_observed(self, sql: str, params: Params, fetch: bool, lastrowid: bool) -> Result:
        sent = False
        try:
            if self._bounded is not None:
                self._wait_for_pool()
            with self._engine.connect() as conn:
                sent = True
                result = conn.exec_driver_sql(sql, dict(params))
                rows = [tuple(r) for r in result.fetchall()] if fetch else []
                return Result(rows, result.rowcount, result.lastrowid if lastrowid else None)
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

    def _translate(
        self, exc: BaseException, *, sent: bool, interrupted: bool = False
    ) -> BackendError | SchemaMissing:
        if self._is_missing_table(exc):
            return SchemaMissing(self._table, self._url)
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if not sent:
            return Unreachable(f"cannot connect to {self._url}: {detail}")
        if interrupted:
            return Interrupted(f"connection to {self._url} lost during a statement: {detail}")
        return BackendError(f"statement failed on {self._url}: {detail}")


_UNSENT = "_dblock_unsent"


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
    can_transfer: ClassVar[bool] = False
    #: Its transfer can also draw fences for the hand-offs after it
    #: (``transfer_steps(extra=n)``), all under the row's lock.
    reserves_fences: ClassVar[bool] = False
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
        # (key, token) pairs whose acquisition may have committed although the
        # caller was told it failed; deleted as soon as the database answers.
        self._orphans: deque[tuple[str, str, int]] = deque()
        # Orphaned tokens of fair-queue requests: every row carrying them
        # goes (the queue row as well as the head).
        self._whole: set[str] = set()
        self._orphans_lock = threading.Lock()

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

    def is_missing_table(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def notify_key(self, key: str) -> str:
        """The key a release of ``key`` is announced under (see the semaphore's store)."""
        return key

    def close(self) -> None:
        self.clean_orphans()
        self.executor.release_idle()
        if self.owns_engine:
            self.engine.dispose()

    def after_fork(self) -> None:
        """In a forked child: never reuse the parent's connections."""
        self.executor.forget_idle()
        self.engine.dispose(close=False)
        self._orphans.clear()
        self._whole = set()
        self._orphans_lock = threading.Lock()

    # -- orphans -----------------------------------------------------------

    def add_orphan(
        self, key: str, token: str, *, released: bool = False, whole: bool = False
    ) -> None:
        """Delete the row of ``(key, token)`` once the database answers: an
        acquisition whose outcome we never learned, or (``released``) a
        release that could not reach the database."""
        if not released:
            log.warning(
                "dblock: acquisition of %r may have committed while the database was "
                "unreachable; its row will be deleted once the database answers",
                key,
            )
        if whole:
            self._whole.add(token)
        self._orphans.append((key, token, 0))

    def is_orphan(self, key: str, token: str) -> bool:
        return any(k == key and t == token for k, t, _ in self._orphans)

    @property
    def has_orphans(self) -> bool:
        return bool(self._orphans)

    def clean_orphans(self) -> None:
        """Delete rows left by acquisitions whose outcome we never learned.

        While the database does not answer, every orphan waits for it. An
        orphan whose DELETE the database answers with an error is tried again
        later, after the others, and dropped (with an ERROR line) after
        :data:`ORPHAN_ATTEMPTS` such answers; one whose DELETE cannot even be
        sent (say, a value the driver cannot encode) is dropped at once. Either
        way its row, if it exists, is left to its lease and the sweeper, and
        no orphan ever holds up the others or the caller."""
        if not self._orphans or not self._orphans_lock.acquire(blocking=False):
            return
        try:
            for _ in range(len(self._orphans)):
                key, token, failures = self._orphans[0]
                try:
                    if token in self._whole:
                        from .fair import statements

                        self.drive(statements(self).leave_steps(key, token))
                    else:
                        self.release(key, token)
                except (Unreachable, Interrupted):
                    return  # still unreachable; try again next time
                except SchemaMissing:
                    pass  # no table, so no row to delete
                except BackendError as exc:
                    self._orphans.popleft()
                    if failures + 1 < ORPHAN_ATTEMPTS:
                        self._orphans.append((key, token, failures + 1))
                    else:
                        self._whole.discard(token)
                        self._give_up_orphan(key, exc)
                    continue
                except Exception as exc:
                    self._orphans.popleft()
                    self._whole.discard(token)
                    self._give_up_orphan(key, exc)
                    continue
                self._orphans.popleft()
                self._whole.discard(token)
                log.info("dblock: removed the row of %r left by an unanswered statement", key)
        finally:
            self._orphans_lock.release()

    @staticmethod
    def _give_up_orphan(key: str, exc: BaseException) -> None:
        log.error(
            "dblock: cannot delete the row of an unconfirmed acquisition of %r (%s: %s); "
            "giving up: the row, if it was written, stays until its lease ends or the "
            "sweeper removes it",
            key,
            type(exc).__name__,
            exc,
        )

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

    #: SQL for the database's current time, in the form the dialect stores times.
    now_sql: ClassVar[str] = "CURRENT_TIMESTAMP"
    #: How the DBAPI driver spells a named parameter.
    param_style: ClassVar[str] = "%({})s"

    def rows(
        self, *, key: str | None = None, prefix: str | None = None, limit: int | None = None
    ) -> list[LockRow]:
        """Lock rows, oldest acquisition first: all of them, the one of
        ``key``, or those whose key starts with ``prefix`` (taken literally,
        case-sensitive); at most ``limit``."""
        bind = self.param_style.format
        where = ""
        params: dict[str, Any] = {}
        if key is not None:
            where, params = f"WHERE lock_key = {bind('key')} ", {"key": key}
        elif prefix:
            # Not LIKE: its wildcards would need escaping, and SQLite's LIKE ignores case.
            where = f"WHERE substr(lock_key, 1, {len(prefix)}) = {bind('prefix')} "
            params = {"prefix": prefix}
        bound = f" LIMIT {int(limit)}" if limit is not None else ""
        sql = (
            f"SELECT {COLUMNS}, {self.now_sql} FROM {self.quoted(self.names.table)} "
            f"{where}ORDER BY acquired_at, lock_key, slot{bound}"
        )
        return [lock_row(r) for r in self.run(sql, params, fetch=True).rows]

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

    def release_key(self, key: str) -> list[LockRow]:
        """Delete every row of ``key`` (each by the token read, so a row that
        changes hands meanwhile stays) and return those deleted."""
        return [r for r in self.rows(key=key) if self.release_row(r.key, r.slot, r.token)]

    def stats(self) -> LockStats:
        """How many rows, how many of them expired, and the oldest."""
        sql = (
            f"SELECT count(*), coalesce(sum(CASE WHEN expires_at <= {self.now_sql} "
            f"THEN 1 ELSE 0 END), 0) FROM {self.quoted(self.names.table)}"
        )
        total, expired = self.run(sql, {}, fetch=True).rows[0]
        oldest = self.rows(limit=1)
        return LockStats(
            rows=int(total), expired=int(expired), oldest=oldest[0] if oldest else None
        )

    def sweep(self, reason: SweepReason, *, older_than: float, limit: int) -> list[LockRow]:
        """Delete at most ``limit`` rows whose ``reason.column`` lies more than
        ``older_than`` seconds in the past (database time), in one short
        statement (or, without RETURNING, a few), and return them as deleted.
        Rows another transaction is changing right now are skipped, not waited for."""
        raise NotImplementedError


def first(rows: Sequence[tuple[Any, ...]]) -> tuple[Any, ...] | None:
    return rows[0] if rows else None
