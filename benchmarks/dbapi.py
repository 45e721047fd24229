"""Counting statements and commits where every contender's SQL goes: the driver.

The ``many`` benchmark compares dblock with the raw driver, sqlalchemy-dlock
and others in worker processes of its own, so it can count at the one place
they all pass through, whatever path each takes (dblock's direct executor,
SQLAlchemy's observed path, the async store, a multi-row statement, an
explicit transaction): it wraps the drivers' ``execute`` and ``commit`` in
the worker process. An engine listener would move dblock to its slower
observed path; a wrapper costs every contender the same (well under a
microsecond per statement) and changes nobody's path.

* A *statement* is one ``execute`` sent to the server (``executemany``
  counts each parameter set), transaction control (``BEGIN``, ``COMMIT``,
  ``ROLLBACK``, ``SAVEPOINT``) and session set-up (``SET``, SQLite's
  ``PRAGMA``) aside.
* A *commit* is a transaction the client ended by committing: a statement
  run in autocommit mode outside a transaction (its own transaction), or a
  ``commit()`` / ``COMMIT`` that ends an open one. Read-only transactions
  count too (a ``SELECT`` in autocommit mode is a commit; what it costs the
  server is another matter). psycopg's ``executemany`` in autocommit mode
  is one commit when it runs in a pipeline (its statements up to the Sync
  are one implicit transaction). Not seen: psycopg's ``with
  conn.transaction()`` blocks, which commit below ``Connection.commit``, and
  separate ``execute`` calls inside an explicit ``with conn.pipeline()``
  (counted a commit each, though they share one up to a Sync); nothing
  measured here uses them.

SQLite (``sqlite3`` is C, its classes cannot be patched): ``sqlite3.connect``
makes connections of a counting subclass (``factory=``), whose cursors are
a counting subclass too; aiosqlite and SQLAlchemy both call
``sqlite3.connect`` through the module, so theirs too. (Not a trace
callback: Python's passes a trigger's firing as its statement's text again.)
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any

__all__ = ["DriverCounter", "install"]

# Upper-cased starts of what is not counted as a statement.
_CONTROL = ("BEGIN", "START", "COMMIT", "END", "ROLLBACK", "SAVEPOINT", "RELEASE", "SET ", "PRAGMA")
_COMMIT = ("COMMIT", "END")


class DriverCounter:
    """Statements and commits seen in this process since :meth:`reset`."""

    __slots__ = ("_lock", "commits", "statements")

    def __init__(self) -> None:
        self.statements = 0
        self.commits = 0
        self._lock = threading.Lock()

    def add(self, statements: int, commits: int) -> None:
        with self._lock:
            self.statements += statements
            self.commits += commits

    def reset(self) -> None:
        with self._lock:
            self.statements = self.commits = 0

    def read(self) -> tuple[int, int]:
        with self._lock:
            return self.statements, self.commits


def _kind(sql: Any) -> str:
    """``"commit"``, ``"control"`` or ``"statement"``."""
    if isinstance(sql, bytes):
        sql = sql.decode("utf-8", "replace")
    if not isinstance(sql, str):  # psycopg's sql.Composed and the like
        return "statement"
    head = sql[:12].lstrip().upper()
    if head.startswith(_CONTROL):
        return "commit" if head.startswith(_COMMIT) else "control"
    return "statement"


_installed: DriverCounter | None = None


def install() -> DriverCounter:
    """Wrap every driver this process may use (once) and return the counter."""
    global _installed
    if _installed is not None:
        return _installed
    counter = _installed = DriverCounter()
    for wrap in (_psycopg, _pymysql, _aiomysql, _sqlite):
        with contextlib.suppress(ImportError):
            wrap(counter)
    return counter


def _psycopg(counter: DriverCounter) -> None:
    import psycopg
    from psycopg.pq import TransactionStatus

    idle = TransactionStatus.IDLE
    add = counter.add

    # executemany() sends its statements in a pipeline when libpq can, and
    # up to the pipeline's Sync they are one implicit transaction: one commit.
    many_commits_one = psycopg.Pipeline.is_supported()

    def seen(conn: Any, query: Any, n: int = 1) -> None:
        kind = _kind(query)
        in_tx = conn.pgconn.transaction_status != idle
        if kind == "statement":
            own = conn.autocommit and not in_tx
            add(n, (1 if n > 1 and many_commits_one else n) if own else 0)
        elif kind == "commit" and in_tx:
            add(0, 1)

    execute, executemany = psycopg.Cursor.execute, psycopg.Cursor.executemany
    aexecute, aexecutemany = psycopg.AsyncCursor.execute, psycopg.AsyncCursor.executemany
    commit, acommit = psycopg.Connection.commit, psycopg.AsyncConnection.commit

    @functools.wraps(execute)
    def c_execute(self: Any, query: Any, *args: Any, **kw: Any) -> Any:
        seen(self._conn, query)
        return execute(self, query, *args, **kw)

    @functools.wraps(executemany)
    def c_executemany(self: Any, query: Any, params_seq: Any, *args: Any, **kw: Any) -> Any:
        params_seq = list(params_seq)
        seen(self._conn, query, len(params_seq))
        return executemany(self, query, params_seq, *args, **kw)

    @functools.wraps(aexecute)
    async def a_execute(self: Any, query: Any, *args: Any, **kw: Any) -> Any:
        seen(self._conn, query)
        return await aexecute(self, query, *args, **kw)

    @functools.wraps(aexecutemany)
    async def a_executemany(self: Any, query: Any, params_seq: Any, *args: Any, **kw: Any) -> Any:
        params_seq = list(params_seq)
        seen(self._conn, query, len(params_seq))
        return await aexecutemany(self, query, params_seq, *args, **kw)

    @functools.wraps(commit)
    def c_commit(self: Any) -> Any:
        if self.pgconn.transaction_status != idle:
            add(0, 1)
        return commit(self)

    @functools.wraps(acommit)
    async def a_commit(self: Any) -> Any:
        if self.pgconn.transaction_status != idle:
            add(0, 1)
        return await acommit(self)

    psycopg.Cursor.execute = c_execute  # type: ignore[method-assign]
    psycopg.Cursor.executemany = c_executemany  # type: ignore[method-assign]
    psycopg.AsyncCursor.execute = a_execute  # type: ignore[method-assign]
    psycopg.AsyncCursor.executemany = a_executemany  # type: ignore[method-assign]
    psycopg.Connection.commit = c_commit  # type: ignore[method-assign]
    psycopg.AsyncConnection.commit = a_commit  # type: ignore[method-assign]


_IN_TRANS = 1  # MySQL's SERVER_STATUS_IN_TRANS


def _mysql_seen(counter: DriverCounter, conn: Any, query: Any) -> None:
    kind = _kind(query)
    in_tx = bool(conn.server_status & _IN_TRANS)
    if kind == "statement":
        counter.add(1, 1 if conn.autocommit_mode and not in_tx else 0)
    elif kind == "commit" and in_tx:
        counter.add(0, 1)


def _pymysql(counter: DriverCounter) -> None:
    import pymysql.connections
    import pymysql.cursors

    # executemany sends through execute (a statement per row, or one per
    # multi-row INSERT chunk): wrapping execute counts what is sent.
    execute = pymysql.cursors.Cursor.execute
    commit = pymysql.connections.Connection.commit

    @functools.wraps(execute)
    def c_execute(self: Any, query: Any, args: Any = None) -> Any:
        _mysql_seen(counter, self.connection, query)
        return execute(self, query, args)

    @functools.wraps(commit)
    def c_commit(self: Any) -> Any:
        if self.server_status & _IN_TRANS:
            counter.add(0, 1)
        return commit(self)

    pymysql.cursors.Cursor.execute = c_execute
    pymysql.connections.Connection.commit = c_commit


def _aiomysql(counter: DriverCounter) -> None:
    import aiomysql.connection
    import aiomysql.cursors

    execute = aiomysql.cursors.Cursor.execute
    commit = aiomysql.connection.Connection.commit

    @functools.wraps(execute)
    async def c_execute(self: Any, query: Any, args: Any = None) -> Any:
        _mysql_seen(counter, self._connection, query)
        return await execute(self, query, args)

    @functools.wraps(commit)
    async def c_commit(self: Any) -> Any:
        if self.server_status & _IN_TRANS:
            counter.add(0, 1)
        return await commit(self)

    aiomysql.cursors.Cursor.execute = c_execute
    aiomysql.connection.Connection.commit = c_commit


def _sqlite(counter: DriverCounter) -> None:
    import sqlite3
    import sqlite3.dbapi2

    connect = sqlite3.connect
    add = counter.add

    def seen(conn: Any, sql: Any, n: int = 1) -> None:
        kind = _kind(sql)
        if kind == "statement":
            # Outside BEGIN … COMMIT a statement is its own transaction.
            add(n, 0 if conn.in_transaction else n)
        elif kind == "commit" and conn.in_transaction:
            add(0, 1)

    class Cursor(sqlite3.Cursor):
        def execute(self, sql: str, parameters: Any = (), /) -> Any:
            seen(self.connection, sql)
            return super().execute(sql, parameters)

        def executemany(self, sql: str, seq: Any, /) -> Any:
            seq = list(seq)
            seen(self.connection, sql, len(seq))
            return super().executemany(sql, seq)

    # Connection.execute makes its cursor with self.cursor() and runs it in
    # C, past Cursor.execute: counted here, once.
    class Connection(sqlite3.Connection):
        def cursor(self, factory: Any = Cursor) -> Any:
            return super().cursor(factory)

        def execute(self, sql: str, parameters: Any = (), /) -> Any:
            seen(self, sql)
            return super().execute(sql, parameters)

        def executemany(self, sql: str, seq: Any, /) -> Any:
            seq = list(seq)
            seen(self, sql, len(seq))
            return super().executemany(sql, seq)

        def commit(self) -> None:
            if self.in_transaction:
                add(0, 1)
            super().commit()

    @functools.wraps(connect)
    def c_connect(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("factory", Connection)
        return connect(*args, **kwargs)

    # SQLAlchemy's pysqlite dialect calls sqlite3.dbapi2.connect, aiosqlite sqlite3.connect.
    sqlite3.connect = sqlite3.dbapi2.connect = c_connect
