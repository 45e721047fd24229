"""The semaphore's statements (:mod:`dblock.kinds.semaphore`): permit rows.

A semaphore's locker keys its requests by *local permit keys* (``key`` NUL
``N`` NUL ``i``); :class:`PermitStore` maps one back to the key and takes any
free permit row of the database, trying the local index's slot first (see
the kind's module for the whole design). It lives here, with the other
dialects' SQL, so the kind itself holds no SQL text and no dialect branch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from .._engine import Dialect
from ..errors import BackendError
from ..schema import SEMAPHORE, describe
from .base import Grant, Holder, Lease, Result, Steps, Store, Wait
from .orphans import Orphans
from .sqlparts import SQLITE_NOW, key_lock, notify, sqlite_grant

__all__ = ["PermitStore", "local_key", "real_key", "size_index"]

# MySQL/MariaDB errors of a statement chosen as a deadlock victim (see PermitStore.retry).
_MYSQL_VICTIM = (1213, 1205, 1467)
_MYSQL_RETRIES = 8
_SEP = "\x00"  # never in a key: keys.check_key refuses NUL
_COLS = "lock_key, slot, kind, mode, holders, permits, owner, token"


def local_key(key: str, n: int, index: int) -> str:
    """Local permit ``index`` of the ``n``-permit semaphore ``key`` (N is in
    the name, so the store needs no table of sizes)."""
    return f"{key}{_SEP}{n}{_SEP}{index}"


def real_key(key: str) -> str:
    """The semaphore's key for a local permit key (or a key itself)."""
    return key.partition(_SEP)[0]


def size_index(key: str) -> tuple[int, int]:
    """N and the local index of a local permit key."""
    _, _, tail = key.partition(_SEP)
    n, _, index = tail.partition(_SEP)
    return int(n), int(index)


class PermitStore(Store):
    """The dialect store's statements for permit rows (see the module)."""

    can_transfer = False  # a released permit goes back to the database, for every process

    def __init__(self, base: Store) -> None:
        # Not Store.__init__: the base store's engine, executor and names are shared.
        self.base = base
        self.config = base.config
        self.names = base.names
        self.table = base.table
        self.engine = base.engine
        self.owns_engine = False
        self.executor = base.executor
        self.quoted = base.quoted
        self.can_notify = base.can_notify  # type: ignore[misc]
        self._kind_sql: dict[Any, Any] = {}
        self.wake_cleaner = base.wake_cleaner  # (the lock facade sets ours)
        # Statements still running after their caller gave up run on the
        # base store's engines: its orphans and ours wait for the same ones.
        self.orphans = Orphans(self, running=base.orphans.running)
        self._orphans_lock = self.orphans.lock
        #: key -> N, while some local permit of the key is held or asked for.
        self.permits_of: dict[str, int] = {}  # (only for KindMismatch in this process)
        #: This dialect's permit statements (one class per dialect, below).
        self.sql: PermitSQL = base.kind_sql(permit_sql)

    @property
    def dialect(self) -> Dialect:
        """The base store's (which learns the server's facts)."""
        return self.base.dialect

    @dialect.setter
    def dialect(self, dialect: Dialect) -> None:
        self.base.dialect = dialect

    def server_steps(self) -> Steps[Dialect]:
        return self.base.server_steps()

    # -- one attempt ------------------------------------------------------------

    def acquire_steps(self, key: str, token: str, owner: str, ttl: float) -> Steps[Grant | Holder]:
        k = real_key(key)
        n, index = size_index(key)
        slot = f"p{index}"
        for _ in range(n + 2):
            grant = yield from self._insert_steps(k, slot, n, token=token, owner=owner, ttl=ttl)
            if grant is not None:
                return grant  # (or, SQLite, the file's write lock held by another connection)
            rows = (yield self.sql.rows_sql, {"key": k}, True, False).rows
            found = yield from self._decide_steps(k, n, token, rows)
            if not isinstance(found, str):
                return found
            slot = found
        return Holder(None, None, None)

    def _insert_steps(
        self, key: str, slot: str, n: int, *, token: str, owner: str, ttl: float
    ) -> Steps[Grant | Holder | None]:
        params = {"key": key, "slot": slot, "n": n, "owner": owner, "token": token}
        return (yield from self.sql.insert_steps(params, ttl))

    def _decide_steps(
        self, key: str, n: int, token: str, rows: Sequence[tuple[Any, ...]]
    ) -> Steps[Grant | Holder | str]:
        """From the key's rows: our own row (an earlier attempt committed),
        another kind (the caller raises ``KindMismatch``), a slot to try
        next, or the holder whose lease ends first."""
        from ..schema import to_utc

        by_slot: dict[str, tuple[Any, ...]] = {}
        soonest: tuple[float, str] | None = None
        for slot, kind, permits, owner, row_token, fence, expires_at, now in rows:
            left = _seconds(expires_at, now)
            if kind != SEMAPHORE or permits != n:
                return Holder(owner, row_token, left, describe(kind, permits))
            if row_token == token:
                at = to_utc(expires_at)
                assert at is not None
                return Grant(int(fence), at, left, slot)
            by_slot[slot] = (row_token, left)
            if left > 0 and (soonest is None or left < soonest[0]):
                soonest = (left, owner)
        free = [f"p{i}" for i in range(n) if f"p{i}" not in by_slot]
        if free:
            return free[0]
        for slot, (row_token, left) in by_slot.items():
            if left <= 0:
                if self.sql.takeover_sql is not None:
                    params = {"key": key, "slot": slot, "token": row_token}
                    yield self.sql.takeover_sql, params, False, False
                return slot
        assert soonest is not None
        return Holder(soonest[1], None, soonest[0])

    def retry(self, sql: str, exc: BackendError, attempt: int) -> Result | float | None:
        again = self.sql.retry(exc, attempt)
        return again if again is not None else self.base.retry(sql, exc, attempt)

    def release_steps(self, key: str, token: str) -> Steps[bool]:
        return (yield from self.sql.release_steps({"key": real_key(key), "token": token}))

    def transfer_steps(
        self, key: str, token: str, new_token: str, owner: str, ttl: float, *, extra: int = 0
    ) -> Steps[Grant | None]:
        raise NotImplementedError("permits are never handed over locally")

    def renew_steps(self, locks: Sequence[tuple[str, str, float]]) -> Steps[dict[str, Lease]]:
        # Renewal matches (key, token), whatever the slot: the base store's statement.
        return self.base.renew_steps([(real_key(k), t, ttl) for k, t, ttl in locks])

    def waiter(self, key: str, since: float, address: str | None = None) -> Wait:
        return self.base.waiter(real_key(key), since, address)

    def notify_key(self, key: str) -> str:
        return real_key(key)

    def listener(self) -> Any:
        """The base store's LISTEN connection (PostgreSQL), for asyncio waiters."""
        listener = getattr(self.base, "listener", None)
        return listener() if listener is not None else None

    def is_missing_table(self, exc: BaseException) -> bool:
        return self.base.is_missing_table(exc)

    def close(self) -> None:
        self.clean_orphans()

    def after_fork(self) -> None:
        # Not the running statements: the base store's after_fork clears
        # them (shared), here or before.
        self.orphans.queue.clear()
        self.orphans.settles = {}
        self.orphans.lock = self._orphans_lock = threading.RLock()


class PermitSQL:
    """One dialect's permit statements, picked by the base store's dialect
    (:func:`permit_sql`): the INSERT of a permit row, the read of the key's
    rows, the takeover of an expired one (where the INSERT cannot take it
    over itself) and the release."""

    acquire_sql: str
    release_sql: str
    rows_sql: str
    takeover_sql: str | None = None

    def __init__(self, base: Store) -> None:
        self.base = base
        self.names = base.names

    def insert_steps(self, params: dict[str, Any], ttl: float) -> Steps[Grant | Holder | None]:
        """Take the permit row ``params`` names if it is free or expired:
        its grant, or None."""
        raise NotImplementedError

    def release_steps(self, params: dict[str, Any]) -> Steps[bool]:
        return (yield self.release_sql, params, False, False).rowcount > 0

    def retry(self, exc: BackendError, attempt: int) -> float | None:
        """A rule of the dialect's own for a failed permit statement (None:
        the base store's)."""
        return None


class _PostgresPermits(PermitSQL):
    def __init__(self, base: Store) -> None:
        super().__init__(base)
        names, quoted = self.names, base.quoted
        t = quoted(names.table)
        cols = _COLS
        seq = quoted(names.sequence).replace("'", "''")
        mismatch = (
            f"SELECT FROM {t} AS b WHERE b.lock_key = %(key)s "
            f"AND (b.kind <> 'semaphore' OR b.permits IS DISTINCT FROM %(n)s)"
        )
        self.acquire_sql = (
            f"WITH {key_lock(names.table)}, "
            f"ins AS (INSERT INTO {t} AS t ({cols}, fence, acquired_at, expires_at) "
            f"SELECT %(key)s, %(slot)s, 'semaphore', 'permit', 1, %(n)s, %(owner)s, "
            f"%(token)s, nextval('{seq}'), now(), "
            f"now() + make_interval(secs => %(ttl)s) FROM lk WHERE NOT EXISTS ({mismatch}) "
            f"ON CONFLICT (lock_key, slot) DO UPDATE SET owner = excluded.owner, "
            f"token = excluded.token, fence = excluded.fence, "
            f"acquired_at = excluded.acquired_at, expires_at = excluded.expires_at "
            f"WHERE t.expires_at <= now() AND t.kind = 'semaphore' "
            f"AND t.permits = excluded.permits "
            f"RETURNING t.fence, t.expires_at) "
            f"SELECT fence, expires_at, now() FROM ins"
        )
        self.release_sql = (
            f"WITH gone AS (DELETE FROM {t} WHERE lock_key = %(key)s AND token = %(token)s "
            f"AND kind = 'semaphore' RETURNING lock_key) "
            f"SELECT {notify('lock_key')} FROM gone"
        )
        self.rows_sql = (
            f"SELECT slot, kind, permits, owner, token, fence, expires_at, now() "
            f"FROM {t} WHERE lock_key = %(key)s"
        )
        self.takeover_sql = None

    def insert_steps(self, params: dict[str, Any], ttl: float) -> Steps[Grant | Holder | None]:
        params["ttl"] = ttl
        rows = (yield self.acquire_sql, params, True, False).rows
        if not rows:
            return None
        fence, expires_at, now = rows[0]
        return Grant(fence, expires_at, (expires_at - now).total_seconds(), params["slot"])

    def release_steps(self, params: dict[str, Any]) -> Steps[bool]:
        params["channel"] = self.names.channel_prefix
        return bool((yield self.release_sql, params, True, False).rows)


class _SQLitePermits(PermitSQL):
    def __init__(self, base: Store) -> None:
        super().__init__(base)
        names, quoted = self.names, base.quoted
        t = quoted(names.table)
        cols = _COLS
        NOW = SQLITE_NOW
        fence = f"(SELECT value + 1 FROM {quoted(names.fence_table)} WHERE id = 1)"
        self.acquire_sql = (
            f"INSERT INTO {t} ({cols}, fence, acquired_at, expires_at) "
            f"SELECT :key, :slot, 'semaphore', 'permit', 1, :n, :owner, :token, {fence}, "
            f"{NOW}, {NOW} + :ttl WHERE NOT EXISTS (SELECT 1 FROM {t} AS b "
            f"WHERE b.lock_key = :key AND (b.kind <> 'semaphore' OR b.permits IS NOT :n)) "
            f"ON CONFLICT (lock_key, slot) DO UPDATE SET owner = excluded.owner, "
            f"token = excluded.token, fence = excluded.fence, "
            f"acquired_at = excluded.acquired_at, expires_at = excluded.expires_at "
            f"WHERE {t}.expires_at <= excluded.acquired_at AND {t}.kind = 'semaphore' "
            f"RETURNING fence, expires_at, acquired_at"
        )
        self.release_sql = (
            f"DELETE FROM {t} WHERE lock_key = :key AND token = :token AND kind = 'semaphore'"
        )
        self.rows_sql = (
            f"SELECT slot, kind, permits, owner, token, fence, expires_at, {NOW} "
            f"FROM {t} WHERE lock_key = :key"
        )
        self.takeover_sql = None
        # The file's write lock taken by another connection: an attempt
        # answers "held" within the exclusive lock's bound, a release
        # gives up after its (see SQLiteStore.retry).
        from .sqlite import SQLiteStore

        if isinstance(base, SQLiteStore):
            base.bound_busy(acquire=[self.acquire_sql], release=[self.release_sql])

    def insert_steps(self, params: dict[str, Any], ttl: float) -> Steps[Grant | Holder | None]:
        from .sqlite import file_was_locked

        params["ttl"] = ttl
        result = yield self.acquire_sql, params, True, False
        rows = result.rows
        if not rows:
            if file_was_locked(result):  # nothing written: held, by whom is unknown
                return Holder(self.base.busy_holder, None, None)  # type: ignore[attr-defined]
            return None
        grant = sqlite_grant(rows[0])
        grant.slot = params["slot"]
        return grant


class _MySQLPermits(PermitSQL):
    """MySQL / MariaDB: INSERT IGNORE, and an expired permit is deleted first."""

    def __init__(self, base: Store) -> None:
        super().__init__(base)
        names, quoted = self.names, base.quoted
        t = quoted(names.table)
        cols = _COLS
        now = "UTC_TIMESTAMP(6)"
        self.acquire_sql = (
            f"INSERT IGNORE INTO {t} ({cols}, acquired_at, expires_at) "
            f"SELECT %(key)s, %(slot)s, 'semaphore', 'permit', 1, %(n)s, %(owner)s, "
            f"%(token)s, {now}, {now} + INTERVAL %(ttl_us)s MICROSECOND FROM DUAL "
            f"WHERE NOT EXISTS (SELECT 1 FROM {t} AS b WHERE b.lock_key = %(key)s "
            f"AND (b.kind <> 'semaphore' OR NOT (b.permits <=> %(n)s)))"
        )
        self.acquire_returning_sql = self.acquire_sql + " RETURNING fence, expires_at, acquired_at"
        self.release_sql = (
            f"DELETE FROM {t} WHERE lock_key = %(key)s AND token = %(token)s AND kind = 'semaphore'"
        )
        self.rows_sql = (
            f"SELECT slot, kind, permits, owner, token, fence, expires_at, {now} "
            f"FROM {t} WHERE lock_key = %(key)s"
        )
        self.galera = False
        self.plain = (self.acquire_sql, self.acquire_returning_sql, self.rows_sql)
        self.takeover_sql = (
            f"DELETE FROM {t} WHERE lock_key = %(key)s AND slot = %(slot)s "
            f"AND token = %(token)s AND expires_at <= {now}"
        )

    def insert_steps(self, params: dict[str, Any], ttl: float) -> Steps[Grant | Holder | None]:
        import time
        from datetime import datetime, timedelta, timezone

        base: Any = self.base
        if not base.dialect.known:
            yield from base.server_steps()
        params["ttl_us"] = round(ttl * 1e6)
        if base.dialect.galera and not self.galera:
            # As the exclusive lock's statements there (see dblock._store.mysql):
            # never report rows of a run Galera rolled back and ran again.
            plain_insert, plain_returning, plain_read = self.plain  # idempotent: may race
            self.acquire_sql = base.for_galera(plain_insert, write=True)
            self.acquire_returning_sql = base.for_galera(plain_returning, write=True)
            self.rows_sql = base.for_galera(plain_read, read=True)
            self.galera = True
        if base.dialect.returning:
            rows = (yield self.acquire_returning_sql, params, True, False).rows
            if not rows:
                return None
            fence, expires_at, now = rows[0]
            utc = expires_at.replace(tzinfo=timezone.utc)
            return Grant(fence, utc, (expires_at - now).total_seconds(), params["slot"])
        sent = time.time()
        result = yield self.acquire_sql, params, False, True
        if result.rowcount != 1:
            return None
        offset = yield from base.server_offset_steps()
        start = datetime.fromtimestamp(sent + offset, timezone.utc)
        return Grant(
            int(result.lastrowid or 0), start + timedelta(seconds=ttl), ttl, params["slot"]
        )

    def retry(self, exc: BackendError, attempt: int) -> float | None:
        """The permit INSERT reads the key's rows (shared locks) and then
        takes the table's AUTO-INC lock, so two of them can deadlock; InnoDB
        reports that as 1213, or as 1467 ("failed to read auto-increment
        value") when it happens on the AUTO-INC lock. The victim was rolled
        back whole: run it again."""
        if attempt < _MYSQL_RETRIES:
            cause = exc.__cause__
            args: tuple[object, ...] = getattr(getattr(cause, "orig", None) or cause, "args", ())
            if args and args[0] in _MYSQL_VICTIM:
                return 0.005 * 2.0**attempt
        return None


def permit_sql(base: Store) -> PermitSQL:
    """The permit statements of ``base``'s dialect, built once per store."""
    cls: type[PermitSQL] = base.dialect.pick(
        postgresql=_PostgresPermits, mysql=_MySQLPermits, sqlite=_SQLitePermits
    )
    return cls(base)


def _seconds(expires_at: Any, now: Any) -> float:
    if isinstance(expires_at, (int, float)):
        return float(expires_at) - float(now)
    return float((expires_at - now).total_seconds())
