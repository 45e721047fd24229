"""SQLite (the embedded default): upsert arbitration on a local file.

SQLite serialises writers, so one ``INSERT … ON CONFLICT DO UPDATE … WHERE
expired … RETURNING`` both takes free keys and takes over expired ones. The
fence comes from a one-row counter table that triggers keep at the highest
fence ever handed out. Times are REAL unix seconds from SQLite's own clock.

The engine dblock makes for SQLite uses WAL (readers never block the writer),
and its statements wait for the file's one write lock in slices
(``dblock._engine.SQLITE_BUSY_SLICE_MS``), each statement as long as what it
serves allows (:meth:`SQLiteStore.retry`): an acquire attempt
:data:`ACQUIRE_BUSY`, then it answers that the key is held by "another
connection, which had the database file locked", and the lock waits and
tries again within its timeout or raises ``LockBusy``/``LockTimeout`` as for
any holder; a release, hand-off or renewal :data:`RELEASE_BUSY`, then it
fails with ``DatabaseUnreachable`` (a release then returns False and its row
is deleted once the file is free, as after an outage); anything else the
connection's whole busy timeout (30 s, or ``connect_args["timeout"]``).
Before, every statement waited up to 30 s, whatever the request's timeout.
The fair queue's, the read/write lock's and the semaphore's statements are
told apart the same way (:meth:`SQLiteStore.bound_busy`), and their steps
read the "held" answer (:func:`file_was_locked`) as the exclusive lock's do.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import ClassVar

from sqlalchemy.engine import Engine

from .._engine import SQLITE_BUSY_SLICE_MS, sqlite_busy_total
from ..config import Config
from ..errors import BackendError, DatabaseUnreachable
from . import register
from .admin import COLUMNS, LockRow, SweepReason, lock_row
from .base import ExclusiveSQL, Grant, Holder, Lease, Result, Steps
from .batch import ANSWERS_ALL
from .sqlparts import SQLITE_CLOCK_STEP, sqlite_grant
from .sqlparts import SQLITE_NOW as NOW
from .wake import SocketWaker, WokenStore

_UTC = timezone.utc

#: How long an acquire attempt waits for the database file's write lock
#: (another connection's transaction) before it answers "held": the lock
#: then waits and tries again as for any holder, within its own timeout, or
#: raises ``LockBusy`` (fail-fast). Kept under 0.1 s with room for a request
#: queued behind another's attempt (group commit: see retry). Write
#: transactions of dblock's own take well under a millisecond, but a
#: process preempted while it holds the lock holds it longer: on a machine
#: at load 14 (2 cores), 8 processes x 4 threads each locking a key of its
#: own fail-fast saw 1 request in 1,200-4,500 refused so (0 on the old code,
#: whose slowest such request waited 1.07 s for the lock); 4 x 4 at load 13,
#: none in 24,000.
ACQUIRE_BUSY = 0.04
#: How long a release (its DELETE), a hand-off (its UPDATE) or a renewal
#: waits for the write lock before it fails with ``DatabaseUnreachable``:
#: a release then returns False, logs an error and leaves its row to the
#: orphan clean-up, which deletes it once the file is free (before: up to
#: 30 s, the caller blocked all along, and a stopped process holding the
#: lock made every release take that long). Far longer than any write of
#: dblock's own holds the lock (well under a millisecond).
RELEASE_BUSY = 1.0
#: How long one failed statement waited on a connection of an engine dblock
#: made (its busy timeout is one slice).
_SLICE = SQLITE_BUSY_SLICE_MS / 1000
#: SQLite's primary result code for "database is locked" (sqlite3.SQLITE_BUSY,
#: which typeshed does not declare).
_SQLITE_BUSY = 5
#: The attribute a busy failure may carry, set by whoever ran it: how long
#: its statement waited for the write lock (the asyncio store's connections
#: wait one slice, whatever the blocking engine's do).
WAITED = "_dblock_busy_waited"
#: What an acquire statement that found the write lock taken answers
#: (:meth:`SQLiteStore.retry`), told by identity from any real result.
_FILE_LOCKED = Result((), 0, None)


def file_was_locked(result: Result) -> bool:
    """``result`` is the answer of an acquire statement that gave up waiting
    for the file's write lock (:meth:`SQLiteStore.retry`): nothing was
    written, and who holds the key is unknown (the steps answer "held" by
    :attr:`SQLiteStore.busy_holder`)."""
    return result is _FILE_LOCKED


# When the statement under way began to wait for the write lock (the
# time.monotonic() of its first busy answer less one slice): per thread and
# per asyncio task, since each runs its statements one at a time.
_busy_since: ContextVar[float] = ContextVar("dblock_sqlite_busy_since", default=0.0)
_monotonic = time.monotonic


def sqlite_busy(exc: BaseException) -> bool:
    """``exc`` (a translated error) says SQLite's write lock was taken
    ("database is locked"): the statement wrote nothing, and may be run again."""
    cause = exc.__cause__
    orig = getattr(cause, "orig", None) or cause
    code = getattr(orig, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF == _SQLITE_BUSY


@register("sqlite")
class SQLiteStore(WokenStore):
    can_transfer = True

    def __init__(self, engine: Engine, *, config: Config, owns_engine: bool) -> None:
        super().__init__(engine, config=config, owns_engine=owns_engine)
        t = self._t = self.quoted(self.names.table)
        fence = f"(SELECT value + 1 FROM {self.quoted(self.names.fence_table)} WHERE id = 1)"
        self._acquire_sql = (
            f"INSERT INTO {t} (lock_key, slot, owner, token, fence, acquired_at, expires_at) "
            f"SELECT :key, '', :owner, :token, {fence}, {NOW}, {NOW} + :ttl "
            f"WHERE NOT EXISTS (SELECT 1 FROM {t} AS b "
            f"WHERE b.lock_key = :key AND b.kind <> 'exclusive') "
            f"ON CONFLICT (lock_key, slot) DO UPDATE SET owner = excluded.owner, "
            f"token = excluded.token, fence = excluded.fence, "
            f"acquired_at = excluded.acquired_at, expires_at = excluded.expires_at "
            f"WHERE {t}.expires_at <= excluded.acquired_at AND {t}.kind = 'exclusive' "
            f"RETURNING fence, expires_at, acquired_at"
        )
        self._holder_sql = (
            f"SELECT token, owner, fence, expires_at, {NOW}, kind FROM {t} "
            f"WHERE lock_key = :key ORDER BY kind = 'exclusive', slot LIMIT 1"
        )
        self._release_sql = (
            f"DELETE FROM {t} WHERE lock_key = :key AND slot = '' AND token = :token"
        )
        self._transfer_sql = (
            f"UPDATE {t} SET token = :new_token, owner = :owner, fence = {fence}, "
            f"acquired_at = {NOW}, expires_at = {NOW} + :ttl "
            f"WHERE lock_key = :key AND slot = '' AND token = :token "
            f"RETURNING fence, expires_at, acquired_at"
        )
        # The statements whose wait for the write lock is bounded by what
        # they serve (see retry): the batch statements are made per batch,
        # known by their start.
        head = f"INSERT INTO {t} (lock_key, slot, owner, token, fence, acquired_at, expires_at) "
        self._acquire_many_head = f"{head}SELECT v.column1"
        self._release_many_head = f"DELETE FROM {t} WHERE slot = '' AND lock_key IN ("
        self._renew_head = f"UPDATE {t} SET expires_at = "
        #: How long an acquire attempt, and a release, wait for the write
        #: lock (:data:`ACQUIRE_BUSY`, :data:`RELEASE_BUSY`; a test that
        #: holds statements up with the write lock sets them longer).
        self.acquire_busy = ACQUIRE_BUSY
        self.release_busy = RELEASE_BUSY
        # When an acquire attempt last answered "held" for the file's lock.
        self._file_locked_at = -float("inf")
        # How long a busy statement waited on this engine's connections:
        # one slice on an engine dblock made; on an engine passed in, its
        # own busy timeout, unknown here (one failure is then the whole wait).
        total = sqlite_busy_total(engine)
        self._slice: float | None = None if total is None else _SLICE
        self._busy_total = total
        database = engine.url.database or ""
        self._file = os.path.abspath(database) if database else "(unnamed)"
        self._busy_holder = f"another connection, which had the database file {self._file} locked"
        # The statements of the other kinds (fair queue, read/write,
        # semaphore permits) waiting as an acquire or as a release (see
        # bound_busy): replaced whole, never changed in place.
        self._acquire_like: frozenset[str] = frozenset()
        self._release_like: frozenset[str] = frozenset()
        self._rules_lock = threading.Lock()
        # Wake-ups of other processes' waiters (see dblock._store.wake):
        # beside a database file, when notify is on; else waiters poll.
        self._wake_dir = _wake_dir(engine) if config.notify else None
        self._waker: SocketWaker | None = None
        self._waker_lock = threading.Lock()

    def acquire_steps(
        self, key: str, token: str, owner: str, ttl: float, first: Result | None = None
    ) -> Steps[Grant | Holder]:
        """``first``: the acquire statement's result, when it was sent
        already (see :meth:`try_acquire`)."""
        params = {"key": key, "owner": owner, "token": token, "ttl": ttl}
        for attempt in range(2):
            if attempt == 0 and first is not None:
                result = first
            else:
                result = yield self._acquire_sql, params, True, False
            if result is _FILE_LOCKED:  # nothing written: who holds the key is unknown
                return Holder(self._busy_holder, None, None)
            rows = result.rows
            if rows:
                return sqlite_grant(rows[0])
            rows = (yield self._holder_sql, {"key": key}, True, False).rows
            if rows:
                row_token, row_owner, fence, expires_at, now, kind = rows[0]
                if row_token == token and kind == "exclusive":
                    return sqlite_grant((fence, expires_at, now))
                if kind == "exclusive" and self._wake_dir is not None:
                    self.waker_or_none(expect=key)
                return Holder(row_owner, row_token, expires_at - now, kind)
            # released between the two statements: try once more
        return Holder(None, None, None)

    @property
    def busy_holder(self) -> str:
        """Who holds a key whose acquire statement found the file's write lock taken."""
        return self._busy_holder

    def bound_busy(self, *, acquire: Sequence[str] = (), release: Sequence[str] = ()) -> None:
        """The statements of another kind (the fair queue's, the read/write
        lock's, the semaphore's permits) whose wait for the file's write
        lock is bounded as the exclusive lock's are (see :meth:`retry`):
        ``acquire`` ones wait :attr:`acquire_busy`, then answer
        :data:`_FILE_LOCKED` (their steps must read it as "held", see
        :func:`file_was_locked`); ``release`` ones wait :attr:`release_busy`,
        then raise ``DatabaseUnreachable``. Told by their text."""
        with self._rules_lock:
            self._acquire_like = self._acquire_like | frozenset(acquire)
            self._release_like = self._release_like | frozenset(release)

    def exclusive_sql(self) -> ExclusiveSQL:
        return ExclusiveSQL(self._acquire_sql, self._release_sql, {}, True, True)

    def release_steps(self, key: str, token: str) -> Steps[bool]:
        gone = (yield self._release_sql, {"key": key, "token": token}, False, False).rowcount > 0
        if gone and self._wake_dir is not None:
            self._released(key)
        return gone

    # The lone request's path on the blocking driver, without a generator to
    # drive (its send, its frames: 3-4 us of a SQLite lock+unlock's client
    # CPU): the same statements and decisions as the steps above, which take
    # over from the first statement's answer when it granted nothing.

    def try_acquire(self, key: str, token: str, owner: str, ttl: float) -> Grant | Holder:
        params = {"key": key, "owner": owner, "token": token, "ttl": ttl}
        first = self.run(self._acquire_sql, params, True)
        if first is not _FILE_LOCKED and first.rows:
            return sqlite_grant(first.rows[0])
        return self.drive(self.acquire_steps(key, token, owner, ttl, first))

    def release(self, key: str, token: str) -> bool:
        gone = self.run(self._release_sql, {"key": key, "token": token}).rowcount > 0
        if gone and self._wake_dir is not None:
            self._released(key)
        return gone

    # -- wake-ups (dblock._store.wake) -------------------------------------

    def waker_or_none(self, *, expect: str | None = None) -> SocketWaker | None:
        """This process's waker (made on first use), or None: waiters poll."""
        waker = self._waker
        if waker is None:
            if self._wake_dir is None:
                return None
            with self._waker_lock:
                waker = self._waker
                if waker is None:
                    waker = self._waker = SocketWaker(self._wake_dir, self.names.table, self.config)
        if expect is not None:
            waker.expect(expect)
        return waker

    def _released(self, key: str) -> None:
        """After the DELETE of ``key``'s row committed: ring its waiters."""
        waker = self._waker or self.waker_or_none()
        if waker is not None:
            waker.released(key)

    def after_fork(self) -> None:
        waker, self._waker = self._waker, None
        if waker is not None:
            waker.forget()  # the parent's socket and thread are the parent's
        self._waker_lock = threading.Lock()
        self._rules_lock = threading.Lock()
        super().after_fork()

    # Group commit (dblock._store.batch): the single upsert for many keys,
    # one write transaction instead of one per key. The fence counter is read
    # once per statement (an uncorrelated subquery), so each row adds its
    # place in the batch to it: the statement holds the database's one write
    # lock, nobody draws in between, and the triggers then raise the counter
    # to the highest fence written (a skipped place leaves a gap, never a
    # repeat). Keys the upsert did not take go on alone (the holder read).

    def acquire_many_steps(
        self, requests: Sequence[tuple[str, str, str, float]]
    ) -> Steps[list[Grant | Holder]]:
        t = self._t
        counter = f"(SELECT value FROM {self.quoted(self.names.fence_table)} WHERE id = 1)"
        params: dict[str, object] = {}
        values = []
        for i, (key, token, owner, ttl) in enumerate(sorted(requests)):
            params[f"k{i}"], params[f"o{i}"], params[f"t{i}"], params[f"l{i}"] = (
                key,
                owner,
                token,
                ttl,
            )
            values.append(f"(:k{i}, :o{i}, :t{i}, :l{i}, {i + 1})")
        sql = (
            f"INSERT INTO {t} (lock_key, slot, owner, token, fence, acquired_at, expires_at) "
            f"SELECT v.column1, '', v.column2, v.column3, {counter} + v.column5, {NOW}, "
            f"{NOW} + v.column4 FROM (VALUES {', '.join(values)}) AS v "
            f"WHERE NOT EXISTS (SELECT 1 FROM {t} AS b "
            f"WHERE b.lock_key = v.column1 AND b.kind <> 'exclusive') "
            f"ON CONFLICT (lock_key, slot) DO UPDATE SET owner = excluded.owner, "
            f"token = excluded.token, fence = excluded.fence, "
            f"acquired_at = excluded.acquired_at, expires_at = excluded.expires_at "
            f"WHERE {t}.expires_at <= excluded.acquired_at AND {t}.kind = 'exclusive' "
            f"RETURNING token, fence, expires_at, acquired_at"
        )
        result = yield sql, params, True, False
        if result is _FILE_LOCKED:  # nothing written: each is answered as alone
            return [Holder(self._busy_holder, None, None) for _ in requests]
        granted = {row[0]: row[1:] for row in result.rows}
        answers: list[Grant | Holder] = []
        for key, token, owner, ttl in requests:
            row = granted.get(token)
            if row is None:  # held (or of another kind): the single attempt says by whom
                answers.append((yield from self.acquire_steps(key, token, owner, ttl)))
            else:
                answers.append(sqlite_grant(row))
        return answers

    def release_many_steps(self, requests: Sequence[tuple[str, str]]) -> Steps[list[bool]]:
        params: dict[str, object] = {}
        for i, (key, token) in enumerate(requests):
            params[f"k{i}"], params[f"t{i}"] = key, token
        n = range(len(requests))
        # lock_key IN (…) for the primary key's index, the pairs for the tokens.
        sql = (
            f"DELETE FROM {self._t} WHERE slot = '' "
            f"AND lock_key IN ({', '.join(f':k{i}' for i in n)}) "
            f"AND (lock_key, token) IN (VALUES {', '.join(f'(:k{i}, :t{i})' for i in n)}) "
            f"RETURNING token"
        )
        gone = {row[0] for row in (yield sql, params, True, False).rows}
        if gone and self._wake_dir is not None:
            for key, token in requests:
                if token in gone:
                    self._released(key)
        return [token in gone for _, token in requests]

    def transfer_steps(
        self, key: str, token: str, new_token: str, owner: str, ttl: float, *, extra: int = 0
    ) -> Steps[Grant | None]:
        params = {"key": key, "token": token, "new_token": new_token, "owner": owner, "ttl": ttl}
        rows = (yield self._transfer_sql, params, True, False).rows
        return sqlite_grant(rows[0]) if rows else None

    def _renew_chunk(self, locks: Sequence[tuple[str, str, float]]) -> Steps[dict[str, Lease]]:
        params: dict[str, object] = {}
        values = []
        for i, (key, token, ttl) in enumerate(locks):
            params[f"k{i}"], params[f"t{i}"], params[f"l{i}"] = key, token, ttl
            values.append(f"(:k{i}, :t{i}, :l{i})")
        sql = (
            f"UPDATE {self._t} SET expires_at = {NOW} + v.column3 "
            f"FROM (VALUES {', '.join(values)}) AS v "
            f"WHERE {self._t}.lock_key = v.column1 AND {self._t}.token = v.column2 "
            f"RETURNING token, expires_at, {NOW}"
        )
        rows = (yield sql, params, True, False).rows
        return {
            token: Lease(
                datetime.fromtimestamp(expires_at, _UTC), expires_at - now - SQLITE_CLOCK_STEP
            )
            for token, expires_at, now in rows
        }

    def is_missing_table(self, exc: BaseException) -> bool:
        return "no such table" in str(exc)

    # -- the file's write lock ----------------------------------------------

    def retry(self, sql: str, exc: BackendError, attempt: int) -> Result | float | None:
        """A statement found the file's write lock taken by another
        connection (its ``attempt``-th such answer in a row, each after a
        wait of one slice): run it again at once while what it serves has
        time left (see the module), then give up as that asks: an acquire
        answers "held" (:data:`_FILE_LOCKED`), anything else raises
        ``DatabaseUnreachable`` saying the file was locked. Nothing was
        written either way."""
        if not sqlite_busy(exc):
            return None
        batch = sql.startswith(self._acquire_many_head)
        acquire = batch or sql is self._acquire_sql or sql in self._acquire_like
        if acquire:
            budget = self.acquire_busy
            if batch and attempt == 0 and _monotonic() - self._file_locked_at < budget:
                # The requests of a batch queued behind an attempt that has
                # just found the lock taken (it answered "held" within the
                # last ACQUIRE_BUSY): one slice, so they do not wait twice
                # as long. (A single attempt, a waiter's next try too, waits
                # the whole ACQUIRE_BUSY: the lock may be free by then.)
                budget = 0.0
        elif (
            sql is self._release_sql
            or sql is self._transfer_sql
            or sql in self._release_like
            or sql.startswith(self._release_many_head)
            or sql.startswith(self._renew_head)
        ):
            budget = self.release_busy
        else:
            budget = self._busy_total or 0.0
        waited = getattr(exc, WAITED, None) or self._slice
        if waited is not None:
            # Counted in time, not slices: on a loaded machine a slice's
            # sleeps overrun (1,200 slices took 38-47 s, not 30).
            now = _monotonic()
            if attempt == 0:
                _busy_since.set(now - waited)
            spent = now - _busy_since.get()
            if spent < budget:
                return 0.0  # SQLite's busy handler has just waited: no sleep here
        else:
            spent = None  # one failure was the whole wait (an engine passed in)
        if acquire:
            self._file_locked_at = _monotonic()
            return _FILE_LOCKED
        raise self.file_locked(exc, spent) from exc.__cause__

    def file_locked(self, exc: BaseException, waited: float | None) -> DatabaseUnreachable:
        """The error of a statement that gave up waiting for the file's write lock."""
        how_long = f" for {waited:.1f} s" if waited else ""
        locked = DatabaseUnreachable(
            f"the SQLite database file {self._file} was locked by another connection"
            f"{how_long} (it holds the file's write lock: a long transaction, or a process "
            f"stopped or stuck in one); nothing was written ({exc})"
        )
        setattr(locked, ANSWERS_ALL, True)
        return locked

    # -- admin ---------------------------------------------------------------

    now_sql: ClassVar[str] = NOW
    param_style: ClassVar[str] = ":{}"
    share_lock: ClassVar[str | None] = None  # (no row locks: the file's write lock)

    def sweep(self, reason: SweepReason, *, older_than: float, limit: int) -> list[LockRow]:
        # One writer at a time anyway; the bound keeps each write transaction
        # (and so every other process's wait for the file lock) short.
        t = self.quoted(self.names.table)
        column = reason.column
        sql = (
            f"DELETE FROM {t} WHERE rowid IN (SELECT rowid FROM {t} "
            f"WHERE {column} <= {NOW} - :older_than ORDER BY {column} LIMIT :limit) "
            f"RETURNING {COLUMNS}, {NOW}"
        )
        rows = self.run(sql, {"older_than": older_than, "limit": limit}, fetch=True).rows
        return [lock_row(r) for r in rows]


def _wake_dir(engine: Engine) -> str | None:
    """Where the waiters of a database file meet (``<file>-dblock``), if
    the platform can wake them (see :class:`SocketWaker`); None for an
    in-memory database, whose one process needs none (level 1)."""
    database = engine.url.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return None
    directory = os.path.abspath(database) + "-dblock"
    return directory if SocketWaker.usable(directory) else None
