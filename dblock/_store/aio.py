"""The store on an asyncio driver: the same statements, awaited.

:class:`AsyncStore` runs a dialect's operations (its :data:`~dblock._store.base.Steps`
generators, the very ones the blocking store drives) on SQLAlchemy's async
engine: psycopg 3's async connection for PostgreSQL, aiomysql for
MySQL/MariaDB, aiosqlite for SQLite. Errors are translated exactly as on the
blocking side, and the dialect's retry rule (MySQL's deadlock victims) applies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Mapping
from typing import Any

import sqlalchemy.exc as sa_exc
from sqlalchemy import event
from sqlalchemy.engine import URL

from ..errors import BackendError, LockArgumentError
from .base import Params, Result, Steps, Store, T

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

    __slots__ = ("_finish", "engine", "store")

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
        if not self._finish:
            return await self._statement(sql, params, fetch, lastrowid)
        inner = asyncio.ensure_future(self._statement(sql, params, fetch, lastrowid))
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
        await self.engine.dispose()

    def after_fork(self) -> None:
        """In a forked child: never use, close or collect the parent's connections."""
        _forsaken.append(self.engine.sync_engine.pool)  # see _forsaken
        self.forget()

    def forget(self) -> None:
        """Drop every pooled connection without touching it (no I/O, no
        loop needed): when the loops they belong to may be gone."""
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
