"""MySQL and MariaDB (PyMySQL): INSERT IGNORE arbitration.

The uncontended acquire is one ``INSERT IGNORE``: a duplicate key is not an
error, just zero rows. The fence comes from ``AUTO_INCREMENT`` (read as
``lastrowid``). MariaDB 10.5+ returns the lease from the same statement
(``INSERT … RETURNING``); on MySQL the lease end is computed from a measured
offset between our clock and the server's.

Only when the INSERT was ignored do we read the holder, and delete its row if
its lease has run out (the takeover), then insert again. The fence of a
taken-over key comes from a fresh INSERT, which is why MySQL has no in-place
takeover or hand-off: ``AUTO_INCREMENT`` only advances on INSERT.

Why ``INSERT … SELECT`` and not ``INSERT … VALUES``: InnoDB draws an
``AUTO_INCREMENT`` value *before* it looks for the key in the index. A plain
``INSERT … VALUES`` draws it under a mutex it lets go at once, so a statement
held up between the two steps (a thread descheduled on a loaded server) could
insert a fence drawn earlier than the one another process was granted, and
released, on the same key in the meantime: the fence went backwards.
``INSERT … SELECT`` is a "bulk insert" to InnoDB, which (with
``innodb_autoinc_lock_mode`` 0 or 1, MariaDB's default) holds the table's
AUTO-INC lock from the draw to the end of the statement, so fences are drawn
in the order the rows are written. Mode 2 (MySQL 8's default, and Galera's
requirement) takes no such lock; we warn about it once.

SQLAlchemy's MySQL dialects set CLIENT_FOUND_ROWS, so UPDATE row counts are
rows *matched*; we only act on INSERT and DELETE counts, which it leaves alone.

Galera (detected at first use from ``wsrep_on``). Every node accepts writes;
a race between nodes is settled by certification at commit, and the loser is
rolled back with error 1213. With the server default
``wsrep_retry_autocommit=1`` the loser's autocommit statement is silently run
again after the rows of its rolled-back ``INSERT … RETURNING`` already went to
the client: both racers would read a grant. So on Galera the INSERT carries
``SET STATEMENT wsrep_retry_autocommit=0``: the statement's rows then reach
the client only followed by the OK of its commit, or are followed by 1213,
which counts as "someone else got it" (we read the holder next). The INSERT
also carries ``wsrep_sync_wait=4``: it first waits until this node has applied
every transaction committed anywhere before it started, so the
``AUTO_INCREMENT`` fence it takes is above every fence already handed out
(nodes allocate from interleaved series, offset n, increment N; without the
wait, fences of different keys came out of order across nodes). That does
not make the fences of one key grow: the INSERT draws its value before it
finds the key free, and one stalled between the two while other nodes took
and let go of the key wrote a value drawn before theirs. So on Galera a
granted row's fence is drawn again at once, while the row is ours (see
``MySQLStore._ours``). The holder read after a lost race waits the same way
(``wsrep_sync_wait=1``), so it sees the winner's row instead of an empty key.
The other kinds' statements (read-write, fair queue, semaphore) take the same
prefixes through :meth:`MySQLStore.for_galera`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import datetime, timedelta, timezone
from typing import Any, ClassVar

from sqlalchemy.engine import Engine

from .._engine import Dialect
from ..config import Config
from ..errors import BackendError
from . import register
from .admin import COLUMNS, LockRow, SweepReason, TableHealth, lock_row
from .base import ExclusiveSQL, Grant, Holder, Interrupted, Lease, Result, Steps, Store, log
from .sqlparts import mysql_grant, mysql_take_over
from .wake import PROBE_SQL, NamedLockWaker, WokenStore

_NO_SUCH_TABLE = 1146
# Chosen as a deadlock victim (1213), a lock wait timed out (1205), or either
# while waiting for the table's AUTO-INC lock, which InnoDB reports as "Failed
# to read auto-increment value from storage engine" (1467): an INSERT … SELECT
# holds that lock to its end, so two racing for one key can deadlock there
# (seen on the read-write grant, two processes at once). Rolled back whole
# each time, like any autocommit statement that failed.
_DEADLOCK = (1213, 1205, 1467)
_DEADLOCK_RETRIES = 3
_UTC = timezone.utc
# How many times one attempt may find the key freed or expired under its feet
# (deleted between our INSERT and our SELECT) before reporting it busy.
_RACE_RETRIES = 3
# Statement prefixes on Galera (see the module docstring).
_GALERA_INSERT = "SET STATEMENT wsrep_retry_autocommit=0, wsrep_sync_wait=4 FOR "
_GALERA_READ = "SET STATEMENT wsrep_sync_wait=1 FOR "


class _DialectFlag:
    """A flag of the store's :class:`~dblock._engine.Dialect` read as the
    store's attribute (what the other kinds and the tests read); setting it
    (a test that turns RETURNING off) makes the dialect's copy say so."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, store: Any, owner: Any = None) -> Any:
        return getattr(store.dialect, self.name)

    def __set__(self, store: Any, value: Any) -> None:
        store.dialect = store.dialect.connected(**{self.name: value})


@register("mysql", "mariadb")
class MySQLStore(WokenStore):
    # MariaDB (RETURNING) hands a held row to the next local thread with
    # fences in reserve, as PostgreSQL does (see transfer_steps); set once
    # the server is known. MySQL proper: every local grant is a row of its own.
    can_transfer = False
    reserves_fences = False
    # What the server said at the first connection (server_steps), read
    # from the store's dialect: RETURNING (MariaDB 10.5+), Galera, and
    # whether a granted row's fence is drawn again: InnoDB without its
    # AUTO-INC lock (innodb_autoinc_lock_mode = 2: Galera requires it, MySQL
    # 8 defaults to it) draws a fence before it finds the key free, so a
    # granted row's fence is drawn again once the row is ours (see _ours),
    # where the server has RETURNING. None (False) until the server is known.
    returning = _DialectFlag("returning")
    galera = _DialectFlag("galera")
    redraws_fences = _DialectFlag("redraws_fences")
    # PROCESSLIST shows a user its own threads (see Orphans.settle_later).
    alive_sql: ClassVar[str | None] = (
        "SELECT 1 FROM information_schema.PROCESSLIST WHERE ID = %(id)s"
    )

    @staticmethod
    def server_thread(dbapi_connection: Any) -> int:
        return int(dbapi_connection.thread_id())  # PyMySQL's, aiomysql's and asyncmy's alike

    #: A waiting process's probe of a key's named lock (see dblock._store.wake),
    #: here beside the store's other statements, which the docs' SQL is checked against.
    _probe_sql: ClassVar[str] = PROBE_SQL

    def __init__(self, engine: Engine, *, config: Config, owns_engine: bool) -> None:
        super().__init__(engine, config=config, owns_engine=owns_engine)
        t = self.quoted(self.names.table)
        now = "UTC_TIMESTAMP(6)"
        self._insert_sql = (
            f"INSERT IGNORE INTO {t} (lock_key, slot, owner, token, acquired_at, expires_at) "
            f"SELECT %(key)s, '', %(owner)s, %(token)s, {now}, "
            f"{now} + INTERVAL %(ttl_us)s MICROSECOND"
        )
        self._insert_returning_sql = self._insert_sql + " RETURNING fence, expires_at, acquired_at"
        self._holder_sql = (
            f"SELECT token, owner, fence, expires_at, {now}, kind FROM {t} "
            f"WHERE lock_key = %(key)s AND slot = ''"
        )
        self._takeover_sql = (
            f"DELETE FROM {t} WHERE lock_key = %(key)s AND slot = '' AND token = %(token)s "
            f"AND expires_at <= {now}"
        )
        self._release_sql = (
            f"DELETE FROM {t} WHERE lock_key = %(key)s AND slot = '' AND token = %(token)s"
        )
        self._now_sql = f"SELECT {now}"
        self._t = t
        # The server's facts are read on first use, not at import (server_steps).
        self._galera_sql = (
            _GALERA_INSERT + self._insert_sql,
            _GALERA_INSERT + self._insert_returning_sql,
            _GALERA_READ + self._holder_sql,
        )
        self._offset: float | None = None  # server UTC minus local time.time()
        self._offset_at = 0.0
        # Other kinds' INSERT IGNOREs whose certification failure means
        # "ignored" (see for_galera and retry).
        self._ignored_on_conflict: set[str] = set()
        self._galera_writes: set[str] = set()
        # Writes of for_galera(once=True): never run again after a garbled answer.
        self._once: set[str] = set()
        self._transfers: dict[int, str] = {}  # by the number of fences drawn beyond the first
        # Wake-ups by named locks (see dblock._store.wake): not through a
        # pooler (a session-moving proxy), and not on Galera (GET_LOCK is
        # not replicated), where waiters poll.
        self._wakes = config.notify and not config.pooler
        self._waker: NamedLockWaker | None = None
        self._waker_lock = threading.Lock()

    def server_steps(self) -> Steps[Dialect]:
        # Read from the server on first use, not at import; idempotent (only
        # assignments of values computed in advance), so two first uses
        # racing each other do no harm.
        (version,) = (yield "SELECT VERSION()", {}, True, False).rows[0]
        mariadb = "mariadb" in str(version).lower()
        # SHOW VARIABLES, not @@wsrep_on: MySQL has no such variable.
        wsrep = (yield "SHOW VARIABLES LIKE 'wsrep_on'", {}, True, False).rows
        galera = mariadb and bool(wsrep) and str(wsrep[0][1]).upper() == "ON"
        if galera:
            # Other strings: retry() tells the INSERTs apart by identity.
            self._insert_sql, self._insert_returning_sql, self._holder_sql = self._galera_sql
        (mode,) = (yield "SELECT @@innodb_autoinc_lock_mode", {}, True, False).rows[0]
        returning = _mariadb_returning(str(version))
        if int(mode) >= 2 and not self.dialect.known and not returning:
            log.warning(
                "dblock: innodb_autoinc_lock_mode = %s on %s: InnoDB may hand out fences "
                "out of order under load, so a fence can be smaller than the one granted "
                "on the same key just before it; set it to 1 to keep fences growing",
                mode,
                self.executor.engine.url.render_as_string(hide_password=True),
            )
        self.dialect = self.dialect.connected(
            server_version=str(version),
            galera=galera,
            autoinc_mode=int(mode),
            redraws_fences=returning and int(mode) >= 2,
            returning=returning,
        )
        self.can_transfer = self.reserves_fences = returning
        return self.dialect

    def for_galera(
        self,
        sql: str,
        *,
        write: bool = False,
        ignored: bool = False,
        read: bool = False,
        once: bool = False,
    ) -> str:
        """``sql`` as it must run on this server, for the other kinds'
        statements: unchanged unless the server is Galera (known once the
        capabilities were read). There, a ``write`` whose rows (or
        ``AUTO_INCREMENT`` value) tell the client what it won carries the
        exclusive INSERT's prefix: no silent re-run after a lost
        certification, whose 1213 :meth:`retry` then runs it again (the loser
        was rolled back whole), and every transaction committed anywhere
        before it is applied first. An ``ignored`` write's certification
        failure counts as an empty result instead, as for the exclusive
        ``INSERT IGNORE`` (someone else took the row). A ``read`` (of who
        holds, who queues) first applies what other nodes committed. A
        ``once`` write is one that must not run twice (a read grant counts
        one more reader each time it runs): an answer the driver cannot
        decode, whose statement may have committed, is raised as
        :class:`~dblock._store.base.Interrupted` for the caller to resolve,
        instead of being run again (see :meth:`_garbled`)."""
        if not self.dialect.galera:
            return sql
        if write or ignored:
            sql = _GALERA_INSERT + sql
            (self._ignored_on_conflict if ignored else self._galera_writes).add(sql)
            if once:
                self._once.add(sql)
            return sql
        return _GALERA_READ + sql if read else sql

    #: The tests' older name of :meth:`known_dialect`.
    _capabilities = Store.known_dialect

    def server_offset_steps(self) -> Steps[float]:
        """Server clock minus ours, refreshed every ten minutes (MySQL only)."""
        if self._offset is None or time.monotonic() - self._offset_at > 600:
            before = time.time()
            (server_now,) = (yield self._now_sql, {}, True, False).rows[0]
            after = time.time()
            server = server_now.replace(tzinfo=_UTC).timestamp()
            self._offset = server - (before + after) / 2
            self._offset_at = time.monotonic()
        return self._offset

    def acquire_steps(
        self, key: str, token: str, owner: str, ttl: float, first: Result | None = None
    ) -> Steps[Grant | Holder]:
        """``first``: the answer to the first INSERT … RETURNING, sent by
        :meth:`try_acquire` (only where the server has RETURNING)."""
        if not self.dialect.known:
            yield from self.server_steps()
        params = {"key": key, "owner": owner, "token": token, "ttl_us": round(ttl * 1e6)}
        for _ in range(_RACE_RETRIES):
            if self.dialect.returning:
                rows = (
                    (yield self._insert_returning_sql, params, True, False).rows
                    if first is None
                    else first.rows
                )
                first = None
                if rows:
                    settled = yield from self._ours(key, token, owner, ttl, mysql_grant(*rows[0]))
                    if settled is None:
                        continue  # gone at once (swept, or released by force): again
                    return settled
            else:
                sent = time.time()
                result = yield self._insert_sql, params, False, True
                if result.rowcount == 1:
                    # The server stamped the lease after we sent: our estimate
                    # of its end errs on the early side, the safe one.
                    offset = yield from self.server_offset_steps()
                    start = datetime.fromtimestamp(sent + offset, _UTC)
                    self._took(key)
                    return Grant(int(result.lastrowid or 0), start + timedelta(seconds=ttl), ttl)
            holder = yield from self._holder_steps(key, token)
            if isinstance(holder, Grant):
                settled = yield from self._ours(key, token, owner, ttl, holder)
                if settled is None:
                    continue
                return settled
            if holder is not None:
                if holder.kind is None and self._wakes:
                    self._expect(key)
                return holder
        return Holder(None, None, None)

    def transfer_steps(
        self, key: str, token: str, new_token: str, owner: str, ttl: float, *, extra: int = 0
    ) -> Steps[Grant | None]:
        # AUTO_INCREMENT only advances on INSERT: so the hand-off is an INSERT
        # of 1 + extra rows for the key, each meeting our row and, through
        # ON DUPLICATE KEY UPDATE, giving it the value that row drew
        # (VALUES(fence)), with RETURNING after each. The first turns our
        # token into the new one; the others (the run's reserve) find the new
        # token. Every fence is drawn while the row is ours, so each is above
        # every earlier fence of the key and below any drawn after it leaves us.
        # The row ends with the largest; the grant takes the smallest.
        params = {
            "key": key,
            "token": token,
            "new_token": new_token,
            "owner": owner,
            "ttl_us": round(ttl * 1e6),
        }
        rows = (yield self._transfer_sql(extra), params, True, False).rows
        if not rows or rows[0][1] != new_token:
            return None  # held by another owner: nothing written
        _, _, acquired_at, _, now = rows[0]
        if acquired_at != now:
            # The first row was inserted (its acquired_at is a microsecond
            # early): ours was gone. That row is not the next thread's to
            # keep; the next thread acquires the key itself.
            yield self._release_sql, {"key": key, "token": new_token}, False, False
            return None
        fences = sorted(row[0] for row in rows if row[1] == new_token)
        return mysql_grant(fences[0], rows[-1][3], now, tuple(fences[1:]))

    def _transfer_sql(self, extra: int) -> str:
        sql = self._transfers.get(extra)
        if sql is None:
            now = "UTC_TIMESTAMP(6)"
            t = self._t
            row = (
                f"SELECT %(key)s AS lock_key, '' AS slot, %(owner)s AS owner, "
                f"%(new_token)s AS token, {now} - INTERVAL 1 MICROSECOND AS acquired_at, "
                f"{now} + INTERVAL %(ttl_us)s MICROSECOND AS expires_at"
            )
            mine = f"{t}.token IN (%(token)s, %(new_token)s)"
            # INSERT … SELECT, not INSERT … VALUES: a bulk insert takes the
            # table's AUTO-INC lock before it touches our row, as a waiter's
            # acquisition (INSERT … SELECT) does. With VALUES the first row
            # locked ours and the second then waited for the AUTO-INC lock,
            # which such a waiter held while it waited for our row: a
            # deadlock that MariaDB 10.11 resolved only about 2 s later,
            # every process of a hot key standing still meanwhile (seen with
            # benchmarks/rounds.py in about one 5 s run in ten).
            sql = (
                f"INSERT INTO {t} (lock_key, slot, owner, token, acquired_at, expires_at) "
                f"SELECT * FROM ({' UNION ALL '.join([row] * (1 + extra))}) AS x "
                + mysql_take_over(t, mine, now)
                + f"RETURNING fence, token, acquired_at, expires_at, {now}"
            )
            sql = self._transfers[extra] = self.for_galera(sql, write=True)
        return sql

    def _holder_steps(self, key: str, token: str) -> Steps[Grant | Holder | None]:
        """Who holds ``key``; None when it is free (or was just freed) to try again."""
        rows = (yield self._holder_sql, {"key": key}, True, False).rows
        if not rows:
            return None
        row_token, row_owner, fence, expires_at, now, kind = rows[0]
        expires_in = (expires_at - now).total_seconds()
        if kind != "exclusive":
            return Holder(row_owner, row_token, expires_in, kind)
        if row_token == token:
            # Our own row: an earlier attempt with this token committed although
            # its answer was lost.
            return Grant(fence, expires_at.replace(tzinfo=_UTC), expires_in)
        if expires_in <= 0:
            yield self._takeover_sql, {"key": key, "token": row_token}, False, False
            return None
        return Holder(row_owner, row_token, expires_in)

    def exclusive_sql(self) -> ExclusiveSQL:
        returning = bool(self.known_dialect().returning)  # one statement, once per store
        acquire = self._insert_returning_sql if returning else self._insert_sql
        return ExclusiveSQL(acquire, self._release_sql, {}, returning, False)

    def release_steps(self, key: str, token: str) -> Steps[bool]:
        try:
            return (
                yield self._release_sql, {"key": key, "token": token}, False, False
            ).rowcount > 0
        finally:
            self._let_go(key)

    # The lone request's path on the blocking driver, without a generator to
    # drive (as SQLite's and PostgreSQL's): the same statements and decisions
    # as the steps above, which take over from the first answer when it
    # granted nothing, or where the grant needs more (a fence drawn again).

    def try_acquire(self, key: str, token: str, owner: str, ttl: float) -> Grant | Holder:
        dialect = self.dialect
        if not (dialect.known and dialect.returning) or dialect.redraws_fences:
            return self.drive(self.acquire_steps(key, token, owner, ttl))
        params = {"key": key, "owner": owner, "token": token, "ttl_us": round(ttl * 1e6)}
        first = self.run(self._insert_returning_sql, params, True)
        if first.rows:
            self._took(key)
            return mysql_grant(*first.rows[0])
        return self.drive(self.acquire_steps(key, token, owner, ttl, first))

    def release(self, key: str, token: str) -> bool:
        try:
            return self.run(self._release_sql, {"key": key, "token": token}).rowcount > 0
        finally:
            self._let_go(key)

    # -- wake-ups (dblock._store.wake) -------------------------------------

    def waker_or_none(self) -> NamedLockWaker | None:
        """This process's named-lock waker (made on first use), or None."""
        waker = self._waker
        if waker is None:
            if not self._wakes or self.dialect.galera is not False:
                return None
            with self._waker_lock:
                waker = self._waker
                if waker is None:
                    scope = f"{self.engine.url.database}.{self.names.table}"
                    waker = self._waker = NamedLockWaker(self._wake_connection, scope, self.config)
        return waker

    def _wake_connection(self) -> Any:
        """A connection of the waker's own, outside the pool (as the
        PostgreSQL listener's): a waiter's blocks in GET_LOCK."""
        self.executor.release_idle()  # room in a pool without overflow
        proxied = self.engine.raw_connection()
        proxied.detach()
        conn: Any = proxied.dbapi_connection
        conn.autocommit(True)
        return conn

    def _took(self, key: str) -> None:
        waker = self._waker or self.waker_or_none()
        if waker is not None:
            waker.took(key)

    def _let_go(self, key: str) -> None:
        waker = self._waker
        if waker is not None:
            waker.let_go(key)

    def _expect(self, key: str) -> None:
        waker = self._waker or self.waker_or_none()
        if waker is not None:
            waker.expect(key)

    def after_fork(self) -> None:
        self._waker = None  # the parent's threads and connections are the parent's
        self._waker_lock = threading.Lock()
        super().after_fork()

    # Group commit (dblock._store.batch). MariaDB 10.5+: one multi-row
    # ``INSERT IGNORE … SELECT … UNION ALL … RETURNING`` takes every free key
    # of the batch (a bulk insert: fences drawn in row order under the
    # AUTO-INC lock, as for one key); only the keys it did not insert go on
    # alone, through the single attempt (read the holder, take over an
    # expired row, insert again). Rows are written in key order, so two
    # batches sharing keys lock them in one order. Releases: one DELETE …
    # RETURNING. On Galera the INSERT carries the single INSERT's prefix
    # (no silent re-run after a lost certification); a lost certification
    # or a deadlock (1213) rolls the whole batch back and retry() runs it
    # again, as any victim; an undecodable answer is never run again (it may
    # have committed: the batch is no for_galera write): each request
    # settles it by its token, as a lone acquire in doubt does. Any other
    # error answer sends each request again alone. MySQL (no RETURNING):
    # one by one.

    def acquire_many_steps(
        self, requests: Sequence[tuple[str, str, str, float]]
    ) -> Steps[list[Grant | Holder]]:
        if not self.dialect.known:
            yield from self.server_steps()
        if not self.dialect.returning:
            alone: list[Grant | Holder] = []
            for request in requests:
                alone.append((yield from self.acquire_steps(*request)))
            return alone
        now = "UTC_TIMESTAMP(6)"
        params: dict[str, object] = {}
        rows_sql = []
        for i, (key, token, owner, ttl) in enumerate(sorted(requests)):
            params[f"k{i}"], params[f"o{i}"], params[f"t{i}"] = key, owner, token
            params[f"l{i}"] = round(ttl * 1e6)
            rows_sql.append(
                f"SELECT %(k{i})s, '', %(o{i})s, %(t{i})s, {now}, "
                f"{now} + INTERVAL %(l{i})s MICROSECOND"
            )
        sql = (
            f"INSERT IGNORE INTO {self._t} "
            f"(lock_key, slot, owner, token, acquired_at, expires_at) "
            f"{' UNION ALL '.join(rows_sql)} RETURNING token, fence, expires_at, acquired_at"
        )
        if self.dialect.galera:
            sql = _GALERA_INSERT + sql
        rows = (yield sql, params, True, False).rows
        granted = {row[0]: row[1:] for row in rows}
        answers: list[Grant | Holder] = []
        for key, token, owner, ttl in requests:
            row = granted.get(token)
            if row is None:  # not inserted: held, expired or freed meanwhile
                answers.append((yield from self.acquire_steps(key, token, owner, ttl)))
                continue
            settled = yield from self._ours(key, token, owner, ttl, mysql_grant(*row))
            answers.append(
                settled
                if settled is not None
                else (yield from self.acquire_steps(key, token, owner, ttl))
            )
        return answers

    def _ours(
        self, key: str, token: str, owner: str, ttl: float, grant: Grant
    ) -> Steps[Grant | None]:
        """``grant`` (the row is ours with ``token``) as the caller gets it:
        with a fence drawn again, now that the row is ours, where InnoDB
        runs without its AUTO-INC lock (Galera; MySQL 8's default); None if
        the row was gone by then.

        Galera runs InnoDB with ``innodb_autoinc_lock_mode=2``, where an
        INSERT draws its ``AUTO_INCREMENT`` value before it looks for the
        key, with no lock over the two. An INSERT stalled between them (a
        descheduled server thread) while holders on other nodes took and let
        go of the key meanwhile found the key free and wrote the value it
        drew before them: a fence smaller than the previous holder's (seen
        once in the suite under load; forced every time by pausing the
        server thread there under a debugger). Drawn again while the row is
        ours (the hand-off's statement, with our own token), the fence is
        above every earlier holder's: this node applied each one's row
        before it could see the key free. A single server in that mode has
        the same window (another session takes and lets go of the key
        meanwhile). One more statement per acquire, there only; hand-offs
        draw under the row's lock already. (MySQL, and MariaDB before 10.5,
        without ``RETURNING``, have no such statement: there the window
        stays, and a warning says so.)"""
        if self.dialect.redraws_fences and self.dialect.returning:
            redrawn = yield from self.transfer_steps(key, token, token, owner, ttl)
            if redrawn is None:
                return None
            grant = redrawn
        self._took(key)
        return grant

    def release_many_steps(self, requests: Sequence[tuple[str, str]]) -> Steps[list[bool]]:
        if not self.dialect.known:
            yield from self.server_steps()
        if not self.dialect.returning:
            gone_alone: list[bool] = []
            for key, token in requests:
                gone_alone.append((yield from self.release_steps(key, token)))
            return gone_alone
        params: dict[str, object] = {}
        for i, (key, token) in enumerate(sorted(requests)):
            params[f"k{i}"], params[f"t{i}"] = key, token
        n = range(len(requests))
        # lock_key IN (…) for the primary key's range scan, the pairs for the tokens.
        sql = (
            f"DELETE FROM {self._t} WHERE slot = '' "
            f"AND lock_key IN ({', '.join(f'%(k{i})s' for i in n)}) "
            f"AND (lock_key, token) IN ({', '.join(f'(%(k{i})s, %(t{i})s)' for i in n)}) "
            f"RETURNING token"
        )
        try:
            rows = (yield sql, params, True, False).rows
        finally:
            for key, _ in requests:
                self._let_go(key)
        gone = {row[0] for row in rows}
        return [token in gone for _, token in requests]

    def _renew_chunk(self, locks: Sequence[tuple[str, str, float]]) -> Steps[dict[str, Lease]]:
        # No UPDATE ... RETURNING here: one UPDATE joined to the batch, then
        # one SELECT (by primary key) to see which rows carry our tokens.
        # Sorted by key, as the batches' rows: InnoDB locks the rows of the
        # join in the order of the derived table (or of the primary key, if
        # it scans the table first), so both orders are the batches' order.
        params: dict[str, object] = {}
        rows_sql = []
        for i, (key, token, ttl) in enumerate(sorted(locks)):
            params[f"k{i}"], params[f"t{i}"], params[f"l{i}"] = key, token, round(ttl * 1e6)
            rows_sql.append(f"SELECT %(k{i})s AS lock_key, %(t{i})s AS token, %(l{i})s AS ttl_us")
        now = "UTC_TIMESTAMP(6)"
        update = (
            f"UPDATE {self._t} AS t JOIN ({' UNION ALL '.join(rows_sql)}) AS v "
            f"ON t.lock_key = v.lock_key AND t.token = v.token "
            f"SET t.expires_at = {now} + INTERVAL v.ttl_us MICROSECOND"
        )
        yield update, params, False, False
        keys = ", ".join(f"%(k{i})s" for i in range(len(locks)))
        select = f"SELECT token, expires_at, {now} FROM {self._t} WHERE lock_key IN ({keys})"
        rows = (yield select, params, True, False).rows
        ours = {token for _, token, _ in locks}
        return {
            token: Lease(expires_at.replace(tzinfo=_UTC), (expires_at - now).total_seconds())
            for token, expires_at, now in rows
            if token in ours
        }

    def lost_contention(self, exc: BackendError) -> bool:
        return deadlocked(exc)

    def is_missing_table(self, exc: BaseException) -> bool:
        args: tuple[object, ...] = getattr(exc, "args", ())
        return bool(args) and args[0] == _NO_SUCH_TABLE

    # -- admin ---------------------------------------------------------------

    now_sql: ClassVar[str] = "UTC_TIMESTAMP(6)"
    share_lock: ClassVar[str | None] = " LOCK IN SHARE MODE"  # (MySQL 8 and MariaDB alike)

    def sweep(self, reason: SweepReason, *, older_than: float, limit: int) -> list[LockRow]:
        self.known_dialect()
        t = self.quoted(self.names.table)
        column = reason.column
        old = f"{column} <= UTC_TIMESTAMP(6) - INTERVAL %(older_us)s MICROSECOND"
        params = {"older_us": round(older_than * 1e6), "limit": limit}
        if self.dialect.returning:
            # MariaDB: one bounded DELETE walking the index in order; its row
            # locks cover at most ``limit`` rows and end with the statement.
            # InnoDB may pick it as a deadlock victim against concurrent
            # acquires and renewals; run() below runs it again.
            sql = (
                f"DELETE FROM {t} WHERE {old} ORDER BY {column} LIMIT %(limit)s "
                f"RETURNING {COLUMNS}, UTC_TIMESTAMP(6)"
            )
            if self.dialect.galera:
                # As for the INSERT: never report rows of a run that was rolled
                # back; and first apply what other nodes committed, so rows
                # written there are seen.
                sql = "SET STATEMENT wsrep_retry_autocommit=0, wsrep_sync_wait=2 FOR " + sql
            return [lock_row(r) for r in self.run(sql, params, fetch=True).rows]
        # MySQL has no DELETE ... RETURNING: read a batch, then delete each row
        # by its token, so a row taken over in between is left alone.
        found = self.run(
            f"SELECT {COLUMNS}, UTC_TIMESTAMP(6) FROM {t} WHERE {old} "
            f"ORDER BY {column} LIMIT %(limit)s",
            params,
            fetch=True,
        ).rows
        delete = f"DELETE FROM {t} WHERE lock_key = %(key)s AND token = %(token)s AND {old}"
        gone = []
        for row in map(lock_row, found):
            if self.run(delete, {**params, "key": row.key, "token": row.token}).rowcount:
                gone.append(row)
        return gone

    def table_health(self) -> TableHealth | None:
        # InnoDB keeps a deleted row until purge has removed it, after every
        # transaction that could still see it ended: the history list length
        # (server-wide) is that lag. Its metric needs the PROCESS privilege;
        # without it the size alone is shown.
        found = self.run(
            "SELECT data_length + index_length, table_rows FROM information_schema.tables "
            "WHERE table_schema = DATABASE() AND table_name = %(table)s",
            {"table": self.names.table},
            fetch=True,
        ).rows
        if not found:
            return None
        size, rows = found[0]
        lag = None
        try:
            metric = self.run(
                "SELECT count FROM information_schema.innodb_metrics "
                "WHERE name = 'trx_rseg_history_len'",
                {},
                fetch=True,
            ).rows
        except BackendError:
            metric = []
        if metric:
            lag = int(metric[0][0])
        return TableHealth(
            size_bytes=None if size is None else int(size),
            live_rows=None if rows is None else int(rows),
            purge_lag=lag,
        )

    def retry(self, sql: str, exc: BackendError, attempt: int) -> Result | float | None:
        """InnoDB's deadlock and lock-wait victims, and Galera's certification
        losers (also 1213), are contention, not failure. A victim was rolled
        back whole (it is its own transaction), so an INSERT IGNORE victim
        counts as ignored (the caller reads the holder next) and any other
        statement is simply run again."""
        if attempt == _DEADLOCK_RETRIES:
            return None
        if not deadlocked(exc) and not self._garbled(sql, exc):
            return None
        if sql is self._insert_sql or sql is self._insert_returning_sql:
            return Result((), 0, None)
        if sql in self._ignored_on_conflict:  # the other kinds' (for_galera)
            return Result((), 0, None)
        return 0.01 * 2.0**attempt

    def _garbled(self, sql: str, exc: BackendError) -> bool:
        """Galera: a write of :meth:`for_galera` whose answer the driver could
        not decode, to be run again. Seen here on the read-write grant
        (``INSERT … ON DUPLICATE KEY UPDATE … RETURNING``): a node that
        brute-force aborts the statement as it runs (another node's
        conflicting write set arrived) sends a row of empty fields before the
        error. Such a statement is NOT always rolled back: a read grant with
        a garbled answer was seen committed (its new read phase, carrying the
        reader's token, in the head row right after; the statement, already
        certified, was replayed). Running it again is harmless only where the
        statement is idempotent (a write grant: its token; an ``INSERT
        IGNORE``: the duplicate is ignored and the holder read next). A
        ``once`` statement (a read grant: running it again after it committed
        joined the reader's own read phase a second time, a count nobody
        releases, which held every writer and reader off until the lease ran
        out) is not run again: its ``Interrupted`` goes to the caller, which
        reads the head row to learn the outcome."""
        return (
            bool(self.dialect.galera)
            and isinstance(exc, Interrupted)
            and isinstance(exc.__cause__, ValueError)
            and sql not in self._once
            and (
                sql is self._insert_returning_sql
                or sql in self._galera_writes
                or sql in self._ignored_on_conflict
            )
        )


def _mariadb_returning(version: str) -> bool:
    """Whether the server is MariaDB 10.5 or later (INSERT … RETURNING)."""
    if "mariadb" not in version.lower():
        return False
    numbers = version.split("-", 1)[0].split(".")
    try:
        return tuple(int(n) for n in numbers[:2]) >= (10, 5)
    except ValueError:
        return False


def deadlocked(exc: BackendError) -> bool:
    """Whether MySQL/MariaDB rolled ``exc``'s statement back as a loser of
    contention (see ``_DEADLOCK``): run it again, nothing was written."""
    cause = exc.__cause__
    args: tuple[object, ...] = getattr(getattr(cause, "orig", None) or cause, "args", ())
    return bool(args) and args[0] in _DEADLOCK
