"""The store on an asyncio driver: the same statements, awaited.

:class:`AsyncStore` runs a dialect's operations (its :data:`~dblock._store.base.Steps`
generators, the very ones the blocking store drives) on SQLAlchemy's async
engine: psycopg 3's async connection for PostgreSQL, aiomysql for
MySQL/MariaDB, aiosqlite for SQLite. Errors are translated exactly as on the
blocking side, and the dialect's retry rule (MySQL's deadlock victims) applies.

As on the blocking side's fast path, a statement goes straight to the
driver's connection (psycopg's ``AsyncConnection``, aiomysql's, aiosqlite's)
of a pooled connection kept checked out in a small LIFO stack: SQLAlchemy's
per-statement machinery on an async engine (a greenlet switch, a Core
``Connection``, a result object and a task to close it, per statement) cost
about 0.5 ms of CPU per lock cycle on PostgreSQL, three times what the driver
itself costs, all of it on the event loop. Whenever anything listens for
execution events on the engine, statements take the observed path
(``exec_driver_sql``) so the listeners see every one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import sqlalchemy.exc as sa_exc
from sqlalchemy import event
from sqlalchemy.engine import URL
from sqlalchemy.pool import PoolProxiedConnection, QueuePool
from sqlalchemy.util import greenlet_spawn

from .._engine import _sqlite_pragmas
from ..errors import BackendError, LockArgumentError
from .base import IDLE_SECONDS, Params, Result, Steps, Store, T, _mark_unsent

__all__ = ["ASYNC_DRIVERS", "AsyncStore", "async_url"]

log = logging.getLogger("dblock")

#: dialect -> the asyncio driver dblock speaks it through, and its extra.
ASYNC_DRIVERS: Mapping[str, tuple[str, str]] = {
    "postgresql": ("psycopg", "postgresql-async"),
    "mysql": ("aiomysql", "mysql-async"),
    "mariadb": ("aiomysql", "mysql-async"),
    "sqlite": ("aiosqlite", "sqlite-async"),
}


def async_url(url: URL) -> URL:
    """The blocking store's URL with the dialect's asyncio driver."""
    dialect = url.get_backend_name()
    driver, _ = ASYNC_DRIVERS[dialect]
    return url.set(drivername=f"{dialect}+{driver}")


class AsyncStore:
    """A :class:`~dblock._store.base.Store`'s operations on an async engine."""

    __slots__ = (
        "_direct",
        "_error",
        "_finish",
        "_idle",
        "_max_idle",
        "_sync_engine",
        "engine",
        "statements",
        "store",
    )

    def __init__(self, store: Store, *, engine_options: Mapping[str, Any] | None = None) -> None:
        from sqlalchemy.ext.asyncio import create_async_engine

        self.store = store
        url = async_url(store.engine.url)
        backend = url.get_backend_name()
        options: dict[str, Any] = {"isolation_level": "AUTOCOMMIT", "pool_reset_on_return": None}
        if backend == "sqlite":
            # As the blocking engine: queue for the file's write lock, do not fail.
            options["connect_args"] = {"timeout": 30.0}
        elif backend in ("mysql", "mariadb") and "charset" not in url.query:
            url = url.update_query_dict({"charset": "utf8mb4"})
        options.update(engine_options or {})
        # aiosqlite runs each statement on a thread of its own, which a
        # cancellation cannot stop; SQLAlchemy then drops the connection
        # without closing it, and an INSERT … RETURNING left unfinished keeps
        # the file's write lock until that connection is collected. A SQLite
        # statement is local and short: let it finish, then cancel.
        self._finish = backend == "sqlite"
        try:
            self.engine = create_async_engine(url, **options)
        except ImportError as exc:
            _, extra = ASYNC_DRIVERS[backend]
            raise LockArgumentError(
                f"the asyncio driver for {backend} is not installed: "
                f"pip install 'dblock[{extra}]' ({exc})"
            ) from exc
        pool_events = self.engine.sync_engine
        event.listen(pool_events, "connect", _born)
        event.listen(pool_events, "checkout", _check_home)
        self._sync_engine = self.engine.sync_engine
        # Per connection, as on the blocking engine: WAL and NORMAL sync on
        # SQLite (without them every commit waits for an fsync, ~2 ms here),
        # no prepared statements through a transaction-mode pooler.
        if backend == "sqlite":
            event.listen(self._sync_engine, "connect", _sqlite_pragmas)
        elif backend == "postgresql" and store.config.pooler:
            event.listen(self._sync_engine, "connect", _never_prepare_async)
        #: Statements sent (for the benchmark: exact on every path, and free).
        self.statements = 0
        # The direct path: each driver's own calls (the statements are in
        # the parameter style of the driver's blocking twin, which it shares).
        self._direct = _EXECUTE[backend]
        self._error: type[Exception] = self._sync_engine.dialect.loaded_dbapi.Error
        # (connection, checked in at, its event loop), newest last
        self._idle: list[tuple[PoolProxiedConnection, float, asyncio.AbstractEventLoop]] = []
        size = getattr(self._sync_engine.pool, "size", None)
        self._max_idle = size() if callable(size) else 4

    async def run(
        self, sql: str, params: Params, fetch: bool = False, lastrowid: bool = False
    ) -> Result:
        attempt = 0
        while True:
            try:
                return await self._run_once(sql, params, fetch, lastrowid)
            except BackendError as exc:
                then = self.store.retry(sql, exc, attempt)
                if then is None:
                    raise
                if isinstance(then, Result):
                    return then
                await asyncio.sleep(then)
                attempt += 1

    async def _run_once(self, sql: str, params: Params, fetch: bool, lastrowid: bool) -> Result:
        self.statements += 1
        # SQLAlchemy's own test for "does anyone listen?" (as the blocking
        # executor: if the attribute ever goes away, the observed path).
        if getattr(self._sync_engine, "_has_events", True):
            statement = self._statement(sql, params, fetch, lastrowid)
        else:
            statement = self._direct_statement(sql, params, fetch, lastrowid)
        if not self._finish:
            return await statement
        inner = asyncio.ensure_future(statement)
        cancelled: asyncio.CancelledError | None = None
        while not inner.done():
            try:
                await asyncio.wait((inner,))
            except asyncio.CancelledError as exc:
                cancelled = cancelled or exc
        if cancelled is not None:
            if not inner.cancelled():
                inner.exception()  # retrieved: the cancellation is what the caller learns
            raise cancelled
        return inner.result()

    async def _statement(self, sql: str, params: Params, fetch: bool, lastrowid: bool) -> Result:
        translate = self.store.executor._translate
        sent = False
        try:
            async with self.engine.connect() as conn:
                sent = True
                try:
                    result = await conn.exec_driver_sql(sql, dict(params))
                    rows = [tuple(r) for r in result.fetchall()] if fetch else []
                    return Result(rows, result.rowcount, result.lastrowid if lastrowid else None)
                except sa_exc.DBAPIError:
                    raise
                except BaseException:
                    # Cancelled mid-statement: the connection's state is
                    # unknown (SQLite's could even keep its write lock). Close
                    # it before the caller learns of the cancellation, so that
                    # whatever the statement did is settled when the caller
                    # looks for it by token; a second cancellation cannot
                    # stop the close.
                    await asyncio.shield(conn.invalidate())
                    raise
        except sa_exc.DBAPIError as exc:
            raise translate(
                exc.orig or exc, sent=sent, interrupted=exc.connection_invalidated
            ) from exc
        except OSError as exc:  # a connect that failed below the driver
            raise translate(exc, sent=sent) from exc

    async def _direct_statement(
        self, sql: str, params: Params, fetch: bool, lastrowid: bool
    ) -> Result:
        conn = await self._checkout()
        try:
            result = await self._direct(conn.driver_connection, sql, params, fetch, lastrowid)
        except self._error as exc:
            dialect = self._sync_engine.dialect
            interrupted = dialect.is_disconnect(exc, conn.dbapi_connection, None)  # type: ignore[arg-type]
            if interrupted:
                await self._discard(conn, exc)
            else:
                self._checkin(conn)
            raise self.store.executor._translate(exc, sent=True, interrupted=interrupted) from exc
        except BaseException:
            # Cancelled mid-statement: the connection's protocol state is
            # unknown. Close it before the caller learns of the cancellation
            # (whatever the statement did is then settled when the caller
            # looks for it by token); a second cancellation cannot stop that.
            await asyncio.shield(self._discard(conn, None))
            raise
        self._checkin(conn)
        return result

    async def _checkout(self) -> PoolProxiedConnection:
        loop = asyncio.get_running_loop()
        idle = self._idle
        while idle:
            try:
                conn, since, home = idle.pop()
            except IndexError:  # a task of another thread's loop took the last one
                break
            if home is loop and time.monotonic() - since < IDLE_SECONDS:
                return conn
            # Another loop's (one manager may serve a loop per thread or one
            # asyncio.run after another), or idle too long: back to the pool,
            # whose checkout decides where it may serve, recycles or pings it.
            await _close(conn)
        try:
            return await self.engine.raw_connection()
        except sa_exc.TimeoutError as exc:  # the pool's, raised before anything was sent
            raise self.store.executor._exhausted(exc) from exc
        except sa_exc.DBAPIError as exc:
            raise self.store.executor._translate(exc.orig or exc, sent=False) from exc
        except (self._error, OSError) as exc:
            raise self.store.executor._translate(exc, sent=False) from exc
        except BaseException as exc:  # cancelled while waiting for the pool: nothing was sent
            _mark_unsent(exc)
            raise

    def _checkin(self, conn: PoolProxiedConnection) -> None:
        if len(self._idle) < self._max_idle and not self._pool_exhausted():
            self._idle.append((conn, time.monotonic(), asyncio.get_running_loop()))
        else:
            # More tasks in statements at once than the pool's size: back to
            # the pool, where a task may be waiting for it (kept idle here,
            # it would wait until the pool's timeout). The pool's return runs
            # driver calls, on a task of its own.
            task = asyncio.ensure_future(_close(conn))
            task.add_done_callback(_retrieve)

    def _pool_exhausted(self) -> bool:
        """Whether every connection the pool may make is checked out (those
        idle here included), as the blocking executor asks: only then can a
        task be waiting for one."""
        pool = self._sync_engine.pool
        if not isinstance(pool, QueuePool):
            return False
        max_overflow: int = getattr(pool, "_max_overflow", -1)
        if max_overflow < 0 or pool.overflow() < max_overflow:  # it may still open another
            return False
        return pool.checkedout() >= pool.size() + max_overflow

    async def _discard(self, conn: PoolProxiedConnection, exc: BaseException | None) -> None:
        with contextlib.suppress(Exception):
            await greenlet_spawn(conn.invalidate, exc)

    async def _release_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn, _, _ in idle:
            await _close(conn)

    async def drive(self, steps: Steps[T]) -> T:
        """Run ``steps`` (the blocking store's own) on async connections."""
        run = self.run
        try:
            statement = next(steps)
            while True:
                statement = steps.send(await run(*statement))
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    async def close(self) -> None:
        await self._release_idle()
        await self.engine.dispose()

    def after_fork(self) -> None:
        """In a forked child: never use, close or collect the parent's connections."""
        _forsaken.append(self.engine.sync_engine.pool)  # see _forsaken
        _forsaken.append(self._idle)  # the direct path's, checked out of it
        self._idle = []
        self.engine.sync_engine.dispose(close=False)

    def forget(self) -> None:
        """Drop every pooled connection without touching it (no I/O, no
        loop needed): when the loops they belong to may be gone."""
        idle, self._idle = self._idle, []
        for conn, _, _ in idle:
            # Back into the pool first (no driver call: the pool resets
            # nothing on return), so that the pool drops them with the rest.
            with contextlib.suppress(Exception):
                conn.close()
        self.engine.sync_engine.dispose(close=False)


# -- where a pooled connection may be used ------------------------------------------
#
# An asyncio connection belongs to the process and, for most drivers, to the
# event loop that opened it (aiomysql's streams, aiosqlite's thread). The pool
# would hand it to whoever asks next: a forked child (whose statements would
# interleave with the parent's on one socket, or wait forever for a thread
# that did not survive the fork), or a new loop after ``asyncio.run`` returned
# (Django's async views served under WSGI get a loop per request). At
# checkout a parent's connection is dropped *without touching it* (closing it
# would end the parent's server session), one of a closed loop is closed as
# well as it can be, and the pool opens a new one. A few attribute reads per
# checkout.

_pid = os.getpid()

# What a forked child dropped of its parent's, kept referenced until the child
# exits: collected, a driver's connection would close its transport, and
# unregistering its socket from the parent's event loop (an epoll instance
# shared across the fork) would leave the parent's loop deaf to it.
_forsaken: list[object] = []


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _born(dbapi_connection: Any, record: Any) -> None:
    loop = asyncio._get_running_loop()
    if loop is not None:
        record.info["dblock.home"] = (_pid, weakref.ref(loop))


def _check_home(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    home = record.info.get("dblock.home")
    if home is None:
        return
    pid, loop_ref = home
    if pid != _pid:
        # The parent's: dropped untouched (a close would end its session).
        _forsaken.append(record.dbapi_connection)
        record.dbapi_connection = proxy.dbapi_connection = None
        raise sa_exc.DisconnectionError("an asyncio connection of the parent process")
    loop = loop_ref()
    if loop is asyncio._get_running_loop() or (loop is not None and not loop.is_closed()):
        # Its own loop, or another loop still running (psycopg and aiosqlite
        # connections serve any loop; a closed one serves none).
        return
    # Of a closed loop: closed here as best the driver can from this loop
    # (psycopg and aiosqlite cleanly; aiomysql sends its QUIT, then fails to
    # schedule on the dead loop, and its socket closes when collected), quietly,
    # and the pool opens a new one.
    dead = record.dbapi_connection
    record.dbapi_connection = proxy.dbapi_connection = None
    try:
        dead.close()
    except Exception as exc:
        log.debug("dblock: closing a connection of a closed event loop: %r", exc)
    raise sa_exc.DisconnectionError("an asyncio connection of a closed event loop")


def _never_prepare_async(dbapi_connection: Any, _record: Any) -> None:
    """The blocking engine's rule (see ``dblock._engine``), on psycopg's
    ``AsyncConnection`` under SQLAlchemy's adapter."""
    getattr(dbapi_connection, "driver_connection", dbapi_connection).prepare_threshold = None


async def _psycopg(conn: Any, sql: str, params: Params, fetch: bool, lastrowid: bool) -> Result:
    cursor = await conn.execute(sql, params)
    rows = await cursor.fetchall() if fetch else ()
    return Result(rows, cursor.rowcount, None)


@functools.cache
def _quiet_cursor() -> type:
    """aiomysql's cursor, without the ``SHOW WARNINGS`` round trip (and the
    Python warning) it adds after every statement that had a warning, as a
    duplicate key in ``INSERT IGNORE`` has (SQLAlchemy's adapter does the same)."""
    import aiomysql

    class QuietCursor(aiomysql.Cursor):  # type: ignore[misc]
        async def _show_warnings(self, conn: Any) -> None:
            pass

    return QuietCursor


async def _aiomysql(conn: Any, sql: str, params: Params, fetch: bool, lastrowid: bool) -> Result:
    async with conn.cursor(_quiet_cursor()) as cursor:
        await cursor.execute(sql, params)
        rows = await cursor.fetchall() if fetch else ()
        return Result(rows, cursor.rowcount, cursor.lastrowid if lastrowid else None)


async def _aiosqlite(conn: Any, sql: str, params: Params, fetch: bool, lastrowid: bool) -> Result:
    cursor = await conn.execute(sql, params)
    try:
        rows = await cursor.fetchall() if fetch else ()
        return Result(rows, cursor.rowcount, cursor.lastrowid if lastrowid else None)
    finally:
        await cursor.close()


_Execute = Callable[[Any, str, Params, bool, bool], Awaitable[Result]]
_EXECUTE: Mapping[str, _Execute] = {
    "postgresql": _psycopg,
    "mysql": _aiomysql,
    "mariadb": _aiomysql,
    "sqlite": _aiosqlite,
}


async def _close(conn: PoolProxiedConnection) -> None:
    """Give a connection back to the pool (in greenlet context: the pool's
    return may call the driver)."""
    with contextlib.suppress(Exception):
        await greenlet_spawn(conn.close)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
