"""The store on an asyncio driver: the same statements, awaited.

:class:`AsyncStore` runs a dialect's operations (its :data:`~dblock._store.base.Steps`
generators, the very ones the blocking store drives) on SQLAlchemy's async
engine: psycopg 3's async connection (or asyncpg) for PostgreSQL, aiomysql
(or asyncmy) for MySQL/MariaDB, aiosqlite for SQLite. Errors are translated
exactly as on the blocking side, and the dialect's retry rule (deadlock and
serialization victims) applies.

As on the blocking side's fast path, a statement goes straight to the
driver's connection (psycopg's ``AsyncConnection``, asyncpg's, aiomysql's,
asyncmy's, aiosqlite's)
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
import re
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import sqlalchemy.exc as sa_exc
from sqlalchemy import event
from sqlalchemy.engine import URL
from sqlalchemy.pool import PoolProxiedConnection, QueuePool
from sqlalchemy.util import greenlet_spawn

from .. import _threads
from .._engine import (
    ASYNC_FORMS,
    SQLITE_BUSY_SLICE_MS,
    SQLITE_BUSY_TOTAL,
    drop_aiomysql_stream,
    drop_transport,
    has_events,
    invalidate_in_pool,
    max_overflow,
    pool_queue,
    sqlite_pragmas,
    unbind_closed_loop,
)
from ..errors import BackendError, LockArgumentError, install_hint
from .base import (
    IDLE_SECONDS,
    Params,
    Result,
    Steps,
    Store,
    T,
    _mark_unsent,
    not_writable,
    sqlstate,
)
from .sqlite import WAITED, sqlite_busy

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["ASYNC_DRIVERS", "AsyncStore", "async_url", "spoken_driver"]

log = logging.getLogger("dblock")

#: dialect -> the asyncio driver dblock speaks it through unless told
#: otherwise (a blocking URL's), and its extra.
ASYNC_DRIVERS: Mapping[str, tuple[str, str]] = {
    "postgresql": ("psycopg", "postgresql-async"),
    "mysql": ("aiomysql", "mysql-async"),
    "mariadb": ("aiomysql", "mysql-async"),
    "sqlite": ("aiosqlite", "sqlite-async"),
}

#: (dialect, driver) -> the extra of every asyncio driver dblock speaks, by
#: the name its engine's URL gives it (``psycopg_async`` is psycopg).
_SPOKEN: Mapping[tuple[str, str], str] = {
    (dialect, form.driver): form.extra for (dialect, _), form in ASYNC_FORMS.items()
}


def spoken_driver(dialect: str, driver: str | None) -> str:
    """The asyncio driver of ``dialect`` that ``driver`` (an asyncio URL
    form's, or None: the dialect's default) names, as dblock's async engine
    spells it; refused if dblock does not speak it."""
    if driver is None:
        return ASYNC_DRIVERS[dialect][0]
    if driver == "psycopg_async":
        driver = "psycopg"
    if (dialect, driver) not in _SPOKEN:
        spoken = sorted(d for (name, d) in _SPOKEN if name == dialect)
        raise LockArgumentError(
            f"dblock's asyncio face speaks {dialect} through {' or '.join(spoken)}, not {driver!r}"
        )
    return driver


def async_url(url: URL, driver: str | None = None) -> URL:
    """The blocking store's URL with an asyncio driver of its dialect:
    ``driver`` (see :func:`spoken_driver`), by default the dialect's."""
    dialect = url.get_backend_name()
    return url.set(drivername=f"{dialect}+{spoken_driver(dialect, driver)}")


class _LoopPool:
    """The connections of one event loop: an async engine (its pool and the
    pool's checkout queue, an ``asyncio.Queue`` bound to the loop that first
    waits on it) and the direct path's stack of idle connections.

    A connection of aiomysql is bound to the loop that opened it, and the
    pool's queue to the loop that first waited on it: shared between two
    running loops, one loop's checkout could be woken from the other's
    thread, which asyncio does not allow (the loop never wakes: a hang), or
    fail with "Future attached to a different loop". So every running loop
    gets a pool of its own. A pool whose loop is closed is taken over by the
    next loop (one ``asyncio.run`` after another, Django's loop per request):
    its connections are dropped at checkout (see ``_check_home``)."""

    __slots__ = (
        "connect_errors",
        "direct",
        "engine",
        "error",
        "idle",
        "loop",
        "lost",
        "max_idle",
        "sync_engine",
    )

    def __init__(self, engine: AsyncEngine, driver: str) -> None:
        self.engine = engine
        self.sync_engine = engine.sync_engine
        # The direct path: each driver's own calls (the statements are in
        # the parameter style of the driver's blocking twin, which it shares,
        # or translated from it: asyncpg's numbered parameters).
        spec = _DIRECT[driver]
        self.direct = spec.execute
        #: What the driver's own calls raise for a failed statement or a
        #: lost connection (anything else is the caller's: a cancellation).
        self.error: tuple[type[BaseException], ...] = spec.errors(self.sync_engine.dialect)
        # (A connect's failure may also come as the adapter's error, as
        # SQLAlchemy's asyncpg adapter raises it, unwrapped.)
        self.connect_errors: tuple[type[BaseException], ...] = (
            *self.error,
            self.sync_engine.dialect.loaded_dbapi.Error,
            OSError,
        )
        #: Whether a failure of the driver's own call lost its connection.
        self.lost = spec.lost
        # (connection, checked in at), newest last
        self.idle: list[tuple[PoolProxiedConnection, float]] = []
        size = getattr(self.sync_engine.pool, "size", None)
        self.max_idle = size() if callable(size) else 4
        self.loop: asyncio.AbstractEventLoop | None = None

    def adopt(self, loop: asyncio.AbstractEventLoop) -> None:
        """Serve ``loop`` from now on (the pool's previous loop is closed)."""
        self.loop = loop
        # Idle connections go back to the pool untouched (its return resets
        # nothing), where the checkout drops those of the closed loop.
        idle, self.idle = self.idle, []
        for conn, _ in idle:
            with contextlib.suppress(Exception):
                conn.close()
        # A queue that waited on the closed loop is bound to it (asyncio's
        # mixin raises for any other loop): unbind it, so the new loop's first
        # wait binds it again. Only when it is bound to a closed loop.
        unbind_closed_loop(self.sync_engine.pool)

    def exhausted(self) -> bool:
        """Whether every connection the pool may make is checked out (those
        idle here included), as the blocking executor asks: only then can a
        task be waiting for one."""
        pool = self.sync_engine.pool
        if not isinstance(pool, QueuePool):
            return False
        overflow = max_overflow(pool)
        if overflow < 0 or pool.overflow() < overflow:  # it may still open another
            return False
        return pool.checkedout() >= pool.size() + overflow

    async def aclose(self) -> None:
        idle, self.idle = self.idle, []
        for conn, _ in idle:
            await _close(conn)
        await self.engine.dispose()

    def forget(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Drop every connection without I/O on its loop (``loop``, default
        its own): when that loop may be gone or busy."""
        loop = loop or self.loop
        idle, self.idle = self.idle, []
        for conn, _ in idle:
            # Back into the pool first (no driver call: the pool resets
            # nothing on return), so that the pool drops them with the rest.
            with contextlib.suppress(Exception):
                conn.close()
        if loop is not None and loop.is_closed():
            # Nobody can close them on their loop any more: quietly here.
            queue = pool_queue(self.sync_engine.pool)
            while queue is not None:
                try:
                    record = queue.get_nowait()
                except Exception:  # empty
                    break
                dead = getattr(record, "dbapi_connection", None)
                if dead is not None:
                    record.dbapi_connection = None
                    _drop_dead(dead)
        self.sync_engine.dispose(close=False)


class AsyncStore:
    """A :class:`~dblock._store.base.Store`'s operations on async engines,
    one per running event loop (see :class:`_LoopPool`)."""

    __slots__ = (
        "_backend",
        "_driver",
        "_finish",
        "_lock",
        "_options",
        "_pools",
        "_primary",
        "_url",
        "engine",
        "statements",
        "store",
    )

    def __init__(
        self,
        store: Store,
        *,
        engine_options: Mapping[str, Any] | None = None,
        driver: str | None = None,
    ) -> None:
        """``driver``: the asyncio driver an asyncio URL form named
        (``asyncpg``, ``asyncmy``, ...); None: the dialect's default."""
        self.store = store
        url = async_url(store.engine.url, driver)
        backend = url.get_backend_name()
        self._driver = url.get_driver_name()
        dialect = store.dialect
        options: dict[str, Any] = {"isolation_level": "AUTOCOMMIT", "pool_reset_on_return": None}
        if dialect.file:
            # As the blocking engine: the pragmas at connect wait this long
            # for the file's write lock; statements wait in slices after.
            options["connect_args"] = {"timeout": SQLITE_BUSY_TOTAL}
        elif dialect.charset is not None and "charset" not in url.query:
            url = url.update_query_dict({"charset": dialect.charset})
        options.update(engine_options or {})
        if self._driver == "asyncpg" and store.config.pooler:
            # asyncpg prepares every statement it is given with parameters,
            # named and cached per connection: behind a transaction-mode
            # pooler the next transaction's server connection lacks it, or
            # has another of that name. Unnamed statements only: on the
            # direct path (asyncpg's own cache off) and on the observed one
            # (SQLAlchemy's adapter's cache off, its statements unnamed).
            options["connect_args"] = {
                "statement_cache_size": 0,
                "prepared_statement_cache_size": 0,
                "prepared_statement_name_func": _unnamed_statement,
                **(options.get("connect_args") or {}),
            }
        self._url = url
        self._options = options
        self._backend = backend
        # aiosqlite runs each statement on a thread of its own, which a
        # cancellation cannot stop; SQLAlchemy then drops the connection
        # without closing it, and an INSERT … RETURNING left unfinished keeps
        # the file's write lock until that connection is collected. So a
        # SQLite statement is not abandoned but cut short (see _run_sqlite):
        # interrupted if it runs, and its wait for the file's write lock
        # taken in slices (the connection's busy timeout, set by
        # sqlite_pragmas), since SQLite's busy handler ignores interrupt();
        # the store says how many slices each statement may wait (run,
        # SQLiteStore.retry).
        self._finish = dialect.file
        #: Statements sent (for the benchmark: exact on every path, and free).
        self.statements = 0
        # The first loop's pool; its engine is ``engine`` (event listeners
        # attached to it see that loop's statements, and every later loop's
        # that takes it over).
        self._primary = _LoopPool(self._make_engine(), self._driver)
        self.engine = self._primary.engine
        self._pools: dict[asyncio.AbstractEventLoop, _LoopPool] = {}
        self._lock = threading.Lock()

    def _make_engine(self) -> AsyncEngine:
        extra = _SPOKEN[self._backend, self._driver]
        try:
            # Without greenlet (SQLAlchemy 2.1 no longer installs it; the
            # asyncio extras do) this import is what fails.
            from sqlalchemy.ext.asyncio import create_async_engine
        except ImportError as exc:
            raise LockArgumentError(
                f"AsyncLockManager needs SQLAlchemy's asyncio support (greenlet), "
                f"which is not installed: {install_hint(extra)} ({exc})"
            ) from exc
        try:
            engine = create_async_engine(self._url, **self._options)
        except ImportError as exc:
            raise LockArgumentError(
                f"the asyncio driver for {self._backend} ({self._driver}) is not installed: "
                f"{install_hint(extra)} ({exc})"
            ) from exc
        sync_engine = engine.sync_engine
        event.listen(sync_engine, "connect", _born)
        event.listen(sync_engine, "checkout", _check_home)
        # Per connection, as on the blocking engine: WAL and NORMAL sync on
        # SQLite (without them every commit waits for an fsync, ~2 ms here),
        # no prepared statements through a transaction-mode pooler.
        if self._driver == "asyncpg":
            # SQLAlchemy closes an asyncpg connection (the pool's dispose,
            # an overflow connection checked in) by waiting, without a
            # timeout, for the server to end the session: forever, if the
            # server hangs. psycopg's close does not wait; this one waits a
            # moment, then drops the socket (nothing of dblock's is open on
            # a connection: every statement committed on its own). (An
            # invalidated one, lost or cut off mid-statement, keeps
            # SQLAlchemy's goodbye of at most 2 s, which lets a statement
            # cut off in flight be settled as on the other drivers.)
            sync_engine.dialect.do_close = _close_asyncpg  # type: ignore[method-assign]
        if self.store.dialect.file:
            event.listen(sync_engine, "connect", sqlite_pragmas)
        elif self._driver == "psycopg" and self.store.config.pooler:
            # (asyncpg's: connect_args, see __init__.)
            event.listen(sync_engine, "connect", _never_prepare_async)
        return engine

    def _pool(self) -> _LoopPool:
        """The running loop's pool (made, or taken over, on its first statement)."""
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is not None:
            return pool
        with self._lock:
            pools = self._pools
            # Pools of closed loops: the first is taken over, the rest dropped.
            free: _LoopPool | None = None
            for old, candidate in list(pools.items()):
                if old.is_closed():
                    del pools[old]
                    if free is None or candidate is self._primary:
                        if free is not None:
                            free.forget()
                        free = candidate
                    else:
                        candidate.forget()
            if self._primary.loop is None:
                free, spare = self._primary, free
                if spare is not None:
                    spare.forget()
            if free is None:
                free = _LoopPool(self._make_engine(), self._driver)
            free.adopt(loop)
            pools[loop] = free
            return free

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
                try:
                    await asyncio.sleep(then)
                except BaseException as cut:
                    if sqlite_busy(exc):  # nothing written, nothing under way
                        _mark_unsent(cut)
                    raise
                attempt += 1

    async def _run_once(self, sql: str, params: Params, fetch: bool, lastrowid: bool) -> Result:
        pool = self._pool()
        if self._finish:
            return await self._run_sqlite(pool, sql, params, fetch, lastrowid)
        self.statements += 1
        # Anyone listening for execution events: the observed path (as the
        # blocking executor).
        if has_events(pool.sync_engine):
            return await self._statement(pool, sql, params, fetch, lastrowid)
        return await self._direct_statement(pool, sql, params, fetch, lastrowid)

    async def _run_sqlite(
        self, pool: _LoopPool, sql: str, params: Params, fetch: bool, lastrowid: bool
    ) -> Result:
        """A statement on SQLite, which a cancellation cuts short without
        abandoning it (see ``__init__``): the statement is interrupted if it
        runs, and a wait for the file's write lock, taken in slices of
        ``SQLITE_BUSY_SLICE_MS``, ends with the slice under way. Either way
        the caller learns of the cancellation once the statement has ended,
        its effect settled (an interrupted INSERT rolled back, or committed
        before the interruption: the acquire path settles it by token).
        A statement that found the write lock taken after one slice raises
        (marked as having waited that long): the store's rule says whether
        it waits another slice (:meth:`run`), as on the blocking engine."""
        cancelled: BaseException | None = None
        while True:
            self.statements += 1
            running: list[Any] = []  # the aiosqlite connection, while the statement runs
            if has_events(pool.sync_engine):
                statement = self._statement(pool, sql, params, fetch, lastrowid, running)
            else:
                statement = self._direct_statement(pool, sql, params, fetch, lastrowid, running)
            # The task starts at the loop's next turn, and only if the gate
            # was opened: a signal handler's exception landing as
            # ensure_future returned (before ``inner`` is ours to wait for)
            # leaves a task that sends nothing, instead of an INSERT that
            # commits behind our back.
            gate = [False]
            inner = asyncio.ensure_future(_gated(gate, statement))
            gate[0] = True
            while True:
                try:
                    if inner.done():
                        break
                    await asyncio.wait((inner,))
                except BaseException as exc:
                    # Cancelled, or a signal handler's exception: the
                    # statement is cut short, never abandoned (see above).
                    cancelled = cancelled or exc
                    for driver in running:
                        with contextlib.suppress(Exception):  # closed meanwhile
                            await driver.interrupt()
            if cancelled is not None:
                # (Retrieved: the cancellation is what the caller learns.)
                failed = None if inner.cancelled() else inner.exception()
                if failed is not None and sqlite_busy(failed):
                    _mark_unsent(cancelled)  # it waited for the write lock: nothing written
                raise cancelled
            failure = inner.exception()
            if failure is None:
                return inner.result()
            if sqlite_busy(failure):
                setattr(failure, WAITED, _SLICE)
            raise failure

    async def _statement(  # noqa: PLR0917 - positional: called per statement
        self,
        pool: _LoopPool,
        sql: str,
        params: Params,
        fetch: bool,
        lastrowid: bool,
        running: list[Any] | None = None,
    ) -> Result:
        translate = self.store.executor.translate
        sent = False
        try:
            asked = _cancels_asked()
            async with pool.engine.connect() as conn:
                if _cancels_asked() > asked:  # swallowed by the connect: see _checkout
                    raise asyncio.CancelledError("cancelled while connecting")
                sent = True
                if running is not None:
                    running.append((await conn.get_raw_connection()).driver_connection)
                on_interrupted = self.store.executor.on_interrupted
                if on_interrupted is not None:  # (SQLAlchemy may drop it before we look)
                    driver = (await conn.get_raw_connection()).driver_connection
                try:
                    if self._driver == "asyncpg":  # numbered parameters, in order
                        text, names = numbered(sql)
                        args = tuple(params[name] for name in names)
                        result = await conn.exec_driver_sql(text, args)
                    else:
                        result = await conn.exec_driver_sql(sql, dict(params))
                    rows = [tuple(r) for r in result.fetchall()] if fetch else []
                    return Result(rows, result.rowcount, result.lastrowid if lastrowid else None)
                except sa_exc.DBAPIError as exc:
                    if exc.orig is not None and not_writable(exc.orig):
                        # A standby: the next statement must connect afresh
                        # (see Executor.run).
                        fairy = await conn.get_raw_connection()
                        await conn.invalidate(exc.orig)
                        invalidate_in_pool(pool.sync_engine.pool, fairy, exc.orig)
                    raise
                except BaseException:
                    # Cancelled mid-statement: the connection's state is
                    # unknown (SQLite's could even keep its write lock). Close
                    # it before the caller learns of the cancellation, so that
                    # whatever the statement did is settled when the caller
                    # looks for it by token; a second cancellation cannot
                    # stop the close.
                    if on_interrupted is not None:  # see Orphans.settle_later
                        on_interrupted(driver)
                    await asyncio.shield(conn.invalidate())
                    raise
        except sa_exc.DBAPIError as exc:
            raise translate(
                exc.orig or exc, sent=sent, interrupted=exc.connection_invalidated
            ) from exc
        except OSError as exc:  # a connect that failed below the driver
            raise translate(exc, sent=sent) from exc

    async def _direct_statement(  # noqa: PLR0917 - positional: called per statement
        self,
        pool: _LoopPool,
        sql: str,
        params: Params,
        fetch: bool,
        lastrowid: bool,
        running: list[Any] | None = None,
    ) -> Result:
        conn = await self._checkout(pool)
        if running is not None:
            running.append(conn.driver_connection)
        try:
            result = await pool.direct(conn.driver_connection, sql, params, fetch, lastrowid)
        except pool.error as exc:
            interrupted = pool.lost(pool.sync_engine.dialect, exc, conn)
            if interrupted or not_writable(exc):  # a standby: see Executor.run
                await self._discard(conn, exc)
                if not interrupted:  # the idle ones reach the same standby
                    invalidate_in_pool(pool.sync_engine.pool, conn, exc)
                    stale, pool.idle[:] = list(pool.idle), []
                    for other, _ in stale:
                        await self._discard(other, exc)
            else:
                self._checkin(pool, conn)
            raise self.store.executor.translate(exc, sent=True, interrupted=interrupted) from exc
        except BaseException:
            # Cancelled mid-statement: the connection's protocol state is
            # unknown. Close it before the caller learns of the cancellation
            # (whatever the statement did is then settled when the caller
            # looks for it by token); a second cancellation cannot stop that.
            on_interrupted = self.store.executor.on_interrupted
            if on_interrupted is not None:
                on_interrupted(conn.driver_connection)
            await asyncio.shield(self._discard(conn, None))
            raise
        self._checkin(pool, conn)
        return result

    async def _checkout(self, pool: _LoopPool) -> PoolProxiedConnection:
        idle = pool.idle
        while idle:
            conn, since = idle.pop()
            if time.monotonic() - since < IDLE_SECONDS:
                return conn
            # Idle too long: back to the pool, whose checkout recycles or pings it.
            await _close(conn)
        asked = _cancels_asked()
        try:
            conn = await pool.engine.raw_connection()
        except sa_exc.TimeoutError as exc:  # the pool's, raised before anything was sent
            raise self.store.executor.exhausted(exc) from exc
        except sa_exc.DBAPIError as exc:
            raise self.store.executor.translate(exc.orig or exc, sent=False) from exc
        except pool.connect_errors as exc:
            raise self.store.executor.translate(exc, sent=False) from exc
        except BaseException as exc:  # cancelled while waiting for the pool: nothing was sent
            _mark_unsent(exc)
            raise
        if _cancels_asked() > asked:
            # A cancellation the driver's connect swallowed (asyncmy's
            # handshake does, at some of its awaits): the connection is
            # good, the task was cancelled all the same. Nothing was sent.
            self._checkin(pool, conn)
            cut = asyncio.CancelledError("cancelled while connecting")
            _mark_unsent(cut)
            raise cut
        return conn

    def _checkin(self, pool: _LoopPool, conn: PoolProxiedConnection) -> None:
        if len(pool.idle) < pool.max_idle and not pool.exhausted():
            pool.idle.append((conn, time.monotonic()))
        else:
            # More tasks in statements at once than the pool's size: back to
            # the pool, where a task may be waiting for it (kept idle here,
            # it would wait until the pool's timeout). The pool's return runs
            # driver calls, on a task of its own.
            task = asyncio.ensure_future(_close(conn))
            task.add_done_callback(_retrieve)

    async def _discard(self, conn: PoolProxiedConnection, exc: BaseException | None) -> None:
        with contextlib.suppress(Exception):
            await greenlet_spawn(conn.invalidate, exc)

    async def drive(self, steps: Steps[T]) -> T:
        """Run ``steps`` (the blocking store's own) on async connections."""
        run = self.run
        try:
            statement = next(steps)
            while True:
                statement = steps.send(await run(*statement))
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        except BaseException:
            steps.close()  # (their clean-up here, not in the collector: see Store.drive)
            raise

    def _all_pools(self) -> list[_LoopPool]:
        """Every pool, forgotten by the store (a pool keeps its loop, for
        the caller to decide how to close it; the primary serves the next loop)."""
        with self._lock:
            pools = list(dict.fromkeys([self._primary, *self._pools.values()]))
            self._pools = {}
        return pools

    async def close(self) -> None:
        """Close every loop's connections: this loop's here, a running
        loop's on that loop (waiting at most a few seconds for it), a closed
        or stopped loop's dropped untouched. Always finishes."""
        here = asyncio.get_running_loop()
        for pool in self._all_pools():
            loop, pool.loop = pool.loop, None
            if loop is None or loop is here:
                try:
                    await pool.aclose()
                except Exception as exc:  # a connection of a dead loop that cannot close
                    log.debug("dblock: closing async connections: %r", exc)
                    pool.forget()
            elif loop.is_closed() or not loop.is_running():
                pool.forget(loop)
            else:
                try:
                    done = asyncio.run_coroutine_threadsafe(pool.aclose(), loop)
                    await asyncio.wait_for(asyncio.wrap_future(done), _CLOSE_ELSEWHERE)
                except Exception as exc:  # that loop is busy, stopping or gone
                    log.debug("dblock: closing another loop's connections: %r", exc)
                    pool.forget(loop)

    def after_fork(self) -> None:
        """In a forked child: never use, close or collect the parent's connections."""
        for pool in self._all_pools():
            _forsaken.append(pool.sync_engine.pool)  # see _forsaken
            _forsaken.append(pool.idle)  # the direct path's, checked out of it
            pool.idle = []
            pool.sync_engine.dispose(close=False)

    def forget(self) -> None:
        """Drop every pooled connection without touching it (no I/O, no
        loop needed): when the loops they belong to may be gone."""
        for pool in self._all_pools():
            loop, pool.loop = pool.loop, None
            pool.forget(loop)


#: How long ``AsyncStore.close`` waits for another running loop to close its connections.
_CLOSE_ELSEWHERE = 5.0


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


# The running loop or None, without raising where none runs (as
# get_running_loop() does): asyncio's own fast path, which it exports
# under this name only (the two connection events below).
_running_loop = asyncio._get_running_loop


def _born(dbapi_connection: Any, record: Any) -> None:
    loop = _running_loop()
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
    if loop is _running_loop() or (loop is not None and not loop.is_closed()):
        # Its own loop, or another loop still running (psycopg and aiosqlite
        # connections serve any loop; a closed one serves none).
        return
    # Of a closed loop: closed here as best the driver can from this loop
    # (psycopg and aiosqlite cleanly; aiomysql sends its QUIT, then fails to
    # schedule on the dead loop, and its socket closes when collected), quietly,
    # and the pool opens a new one.
    dead = record.dbapi_connection
    record.dbapi_connection = proxy.dbapi_connection = None
    _drop_dead(dead)
    raise sa_exc.DisconnectionError("an asyncio connection of a closed event loop")


def _drop_dead(dbapi_connection: Any) -> None:
    """Close a connection whose event loop is closed, as well as its driver
    allows from outside that loop, and quietly: psycopg and aiosqlite close
    cleanly; aiomysql's close schedules on the dead loop and fails, then
    fails again, loudly, when the connection is collected, so its socket is
    closed here and its stream forgotten."""
    driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
    try:
        pgconn = getattr(driver, "pgconn", None)  # psycopg's libpq connection
        if drop_aiomysql_stream(driver) or drop_transport(driver):
            pass  # (aiomysql's, asyncpg's, asyncmy's: their sockets closed here)
        elif pgconn is not None:
            pgconn.finish()  # libpq's own close: no event loop involved
        elif callable(getattr(driver, "stop", None)):
            # aiosqlite: its thread closes the file. stop() asks for an answer
            # on the calling thread's event loop, if it has one, which may be
            # closed by the time the answer comes: call it on a thread that
            # has no loop, so no answer is asked for.
            stopper = threading.Thread(target=driver.stop, name="dblock-aiosqlite-stop")
            _threads.start(stopper)
            stopper.join(1.0)
        else:
            dbapi_connection.close()
    except Exception as exc:
        log.debug("dblock: closing a connection of a closed event loop: %r", exc)


#: How long a statement on SQLite waits for the file's write lock at a time
#: (the busy timeout sqlite_pragmas sets): the end of the slice under way is
#: when a cancellation ends such a wait.
_SLICE = SQLITE_BUSY_SLICE_MS / 1000


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


# -- asyncpg -------------------------------------------------------------------
#
# asyncpg takes PostgreSQL's own numbered parameters ($1, $2, ...) where the
# dialect's statements are written for psycopg (``%(name)s``, ``%%`` for a
# percent sign): each statement's text is translated once, a name used twice
# getting one number (as psycopg sends it), and its parameters picked by name.

_PYFORMAT = re.compile(r"%\((\w+)\)s|%%")


@functools.lru_cache(maxsize=1024)
def numbered(sql: str) -> tuple[str, tuple[str, ...]]:
    """``sql`` (psycopg's named parameters) in asyncpg's numbered ones, and
    the parameters' names in their numbers' order."""
    names: dict[str, int] = {}

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "%"
        return f"${names.setdefault(name, len(names) + 1)}"

    return _PYFORMAT.sub(number, sql), tuple(names)


async def _asyncpg(conn: Any, sql: str, params: Params, fetch: bool, lastrowid: bool) -> Result:
    text, names = numbered(sql)
    args = [params[name] for name in names]
    if fetch:
        rows = await conn.fetch(text, *args)
        return Result([tuple(row) for row in rows], len(rows), None)
    # The command tag ("UPDATE 2", "INSERT 0 1") ends with the row count.
    status = await conn.execute(text, *args)
    count = status.rpartition(" ")[2]
    return Result((), int(count) if count.isdigit() else -1, None)


def _asyncpg_errors(_dialect: Any) -> tuple[type[BaseException], ...]:
    import asyncpg

    # The server's answers, the client's own failures (a connection closed
    # mid-statement, a value it cannot encode), and the socket's.
    return (asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError)


# The server ending the session: admin_shutdown, crash_shutdown, cannot_connect_now.
_PG_SHUTDOWN = frozenset({"57P01", "57P02", "57P03"})


def _asyncpg_lost(_dialect: Any, exc: BaseException, conn: PoolProxiedConnection) -> bool:
    """Whether asyncpg's connection is gone with the statement's answer
    (what psycopg reports as a closed connection, SQLAlchemy's disconnect)."""
    from asyncpg.exceptions import ConnectionDoesNotExistError

    if isinstance(exc, (ConnectionDoesNotExistError, OSError)):
        return True
    code = sqlstate(exc) or ""
    if code.startswith("08") or code in _PG_SHUTDOWN:
        return True
    with contextlib.suppress(Exception):
        return bool(conn.driver_connection.is_closed())  # type: ignore[union-attr]
    return True


#: How long closing an asyncpg connection waits for the server's goodbye.
_ASYNCPG_CLOSE = 0.5


def _close_asyncpg(dbapi_connection: Any) -> None:
    """Close SQLAlchemy's adapted asyncpg connection, waiting at most
    :data:`_ASYNCPG_CLOSE` for the server (asyncpg drops the socket then)."""
    from sqlalchemy.util import await_
    from sqlalchemy.util.concurrency import in_greenlet

    driver = dbapi_connection.driver_connection
    if not in_greenlet():  # (no loop to wait on: the collector's case)
        driver.terminate()
        return
    try:
        await_(driver.close(timeout=_ASYNCPG_CLOSE))
    except Exception:  # timed out (asyncpg aborted it), or busy: dropped
        driver.terminate()


def _unnamed_statement() -> str:
    """The name of each statement SQLAlchemy's asyncpg adapter prepares when
    a pooler is in front: none, PostgreSQL's unnamed statement, which asyncpg
    parses and binds without a Sync between them (a Flush), so the pooler
    keeps them on one server connection, as on the direct path."""
    return ""


# -- asyncmy -------------------------------------------------------------------


@functools.cache
def _quiet_asyncmy_cursor() -> type:
    """asyncmy's cursor without its ``SHOW WARNINGS`` round trip (see
    :func:`_quiet_cursor`)."""
    from asyncmy.cursors import Cursor

    class QuietCursor(Cursor):
        async def _show_warnings(self, conn: Any) -> None:
            pass

    return QuietCursor


async def _asyncmy(conn: Any, sql: str, params: Params, fetch: bool, lastrowid: bool) -> Result:
    # Not ``async with``: the cursor's exit reads what is left of the answer,
    # which after a cancellation mid-read (asyncmy closes the connection)
    # raises, and that error would replace the cancellation.
    cursor = conn.cursor(_quiet_asyncmy_cursor())
    await cursor.execute(sql, params)
    rows = await cursor.fetchall() if fetch else ()
    result = Result(rows, cursor.rowcount, cursor.lastrowid if lastrowid else None)
    await cursor.close()
    return result


def _asyncmy_errors(dialect: Any) -> tuple[type[BaseException], ...]:
    # asyncmy's errors (SQLAlchemy's adapter hands them out as they are),
    # and the socket's; a network failure inside asyncmy can surface as an
    # AttributeError on its dropped stream (SQLAlchemy's adapter says so too).
    return (dialect.loaded_dbapi.Error, OSError, AttributeError)


def _asyncmy_lost(dialect: Any, exc: BaseException, conn: PoolProxiedConnection) -> bool:
    if isinstance(exc, (OSError, AttributeError)):
        return True
    if dialect.is_disconnect(exc, conn.dbapi_connection, None):
        return True
    with contextlib.suppress(Exception):
        return not conn.driver_connection.connected  # type: ignore[union-attr]
    return True


# -- the drivers' table ----------------------------------------------------------


def _dbapi_errors(dialect: Any) -> tuple[type[BaseException], ...]:
    return (dialect.loaded_dbapi.Error,)


def _disconnect(dialect: Any, exc: BaseException, conn: PoolProxiedConnection) -> bool:
    return bool(dialect.is_disconnect(exc, conn.dbapi_connection, None))


_Execute = Callable[[Any, str, Params, bool, bool], Awaitable[Result]]


class _Direct(NamedTuple):
    """An asyncio driver's direct path: its statement call, what it raises
    for a failed statement, and whether such a failure lost the connection."""

    execute: _Execute
    errors: Callable[[Any], tuple[type[BaseException], ...]]
    lost: Callable[[Any, BaseException, PoolProxiedConnection], bool]


_DIRECT: Mapping[str, _Direct] = {
    "psycopg": _Direct(_psycopg, _dbapi_errors, _disconnect),
    "asyncpg": _Direct(_asyncpg, _asyncpg_errors, _asyncpg_lost),
    "aiomysql": _Direct(_aiomysql, _dbapi_errors, _disconnect),
    "asyncmy": _Direct(_asyncmy, _asyncmy_errors, _asyncmy_lost),
    "aiosqlite": _Direct(_aiosqlite, _dbapi_errors, _disconnect),
}


def _cancels_asked() -> int:
    """How many cancellations of the running task are pending (Python 3.11's
    ``Task.cancelling``; 0 before it): one more after an await than before
    it means a cancellation was asked for there and swallowed below."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return int(cancelling()) if cancelling is not None else 0


async def _close(conn: PoolProxiedConnection) -> None:
    """Give a connection back to the pool (in greenlet context: the pool's
    return may call the driver)."""
    with contextlib.suppress(Exception):
        await greenlet_spawn(conn.close)


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


async def _gated(gate: list[bool], statement: Coroutine[Any, Any, Result]) -> Result:
    """Run ``statement`` if the gate is open by the time this task starts;
    else close it unsent (see :meth:`AsyncStore._run_sqlite`)."""
    if not gate[0]:
        statement.close()
        raise asyncio.CancelledError("abandoned before it was sent")
    return await statement
