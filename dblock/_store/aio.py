"""The store on an asyncio driver: the same statements, awaited.

:class:`AsyncStore` runs a dialect's operations (its :data:`~dblock._store.base.Steps`
generators, the very ones the blocking store drives) on SQLAlchemy's async
engine: psycopg 3's async connection for PostgreSQL, aiomysql for
MySQL/MariaDB, aiosqlite for SQLite. Errors are translated exactly as on the
blocking side, and the dialect's retry rule (MySQL's deadlock victims) applies.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import sqlalchemy.exc as sa_exc
from sqlalchemy.engine import URL

from ..errors import BackendError, LockArgumentError
from .base import Params, Result, Steps, Store, T

__all__ = ["ASYNC_DRIVERS", "AsyncStore", "async_url"]

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
