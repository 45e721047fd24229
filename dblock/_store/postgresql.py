"""PostgreSQL (psycopg 3): upsert arbitration and LISTEN/NOTIFY wake-ups.

Acquire is one statement: ``INSERT … ON CONFLICT DO UPDATE … WHERE expired``
takes a free or expired key; when the key is held the same statement reads
the holder instead, so a waiter learns the holder's lease without a second
round trip. ON CONFLICT never raises, so contention leaves the server log clean.
The lock is the key's head row (``slot = ''``); the INSERT is skipped while
the key has rows of another kind (semaphore permits, rw rows), and the read
then returns one of those, so the caller raises ``KindMismatch``.

The fence is drawn from the sequence under a transaction-scoped advisory
lock on the key (two-int form: one class per lock table, the key's hash), so
two acquisitions of one key draw and write their fences one after the other.
Without it ``nextval`` ran before the conflict check: a statement held up
there (waiting for another's insert of the key to end, or descheduled) could
write a fence drawn before the one another process was granted, and
released, on that key meanwhile, and the fence went backwards.

Release deletes the row where the token is ours and, in the same statement,
``pg_notify``-s the key on the channel of its bucket (``<table>:<n>``, the
statement computing ``n`` from the key: see :data:`BUCKETS`), but only when
some process waits for that key: PostgreSQL serialises the commits of
notifying transactions, so a notification nobody hears costs every process
throughput. One listener connection per process fans the notifications out
to its waiting threads and tasks, and registers each key they wait for on
the server: a session-level shared advisory lock (class: the table's
"waiters" class, number: the key's hash) held by that connection while a
waiter of the process waits. The release tries the same lock exclusively in
its transaction, after its DELETE; if that fails, someone waits and it
notifies. The race between a waiter registering and a holder releasing:

* registered first: the release's try fails, it notifies (at commit);
* the release's try first: it holds the lock until its commit, so the
  registration waits for that commit, and only then does the listener wake
  the waiter to try again, which finds the row gone.

Either way no wake-up is missed. A waiter is therefore woken once its
registration is in (it tries again at once: a release between its first
attempt and its registration notified nobody). A hash collision only costs
a notification nobody needed. The listener LISTENs to the key's bucket
after the registration and before that wake-up, so the same holds per
bucket: a release committed before the LISTEN is found by the attempt, one
after it is heard (see :class:`Listener`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

from sqlalchemy.engine import Engine
from sqlalchemy.pool import NullPool

from .. import _threads
from ..config import Config
from ..errors import BackendError
from . import register
from .admin import COLUMNS, LockRow, SweepReason, TableHealth, lock_row
from .base import (
    Backoff,
    ExclusiveSQL,
    Grant,
    Holder,
    Lease,
    Result,
    Steps,
    Store,
    Wait,
    recheck_every,
    sqlstate,
)
from .sqlparts import BUCKETS, key_lock, lock_class, notify, unnest, waiters_class

log = logging.getLogger("dblock")

_UNDEFINED_TABLE = "42P01"
# A deadlock victim (40P01) or a serialization failure (40001): PostgreSQL
# rolled the statement's transaction back whole, and every statement of
# dblock's is its own transaction, so nothing was written and it is simply
# run again (as MySQL's deadlock victims are). The batches lock their rows in
# one order and never deadlock each other; a statement that is no batch (the
# application's own, another kind's) still can.
_LOST = frozenset(("40P01", "40001"))
_LOST_RETRIES = 3
# A notification payload starting with this addresses one fair-queue waiter
# (see dblock._store.fair); a space and a fence follow when it is handed the head.
HANDED_MARK = "\x1f"


def _acquired(rows: Sequence[tuple[Any, ...]], token: str) -> Grant | Holder:
    """What the acquire statement's answer means for the request of ``token``."""
    if not rows:
        # Held by a row our snapshot cannot see yet (committed an instant ago).
        return Holder(None, None, None)
    row_token, row_owner, fence, expires_at, now, kind = rows[0]
    expires_in = (expires_at - now).total_seconds()
    if row_token == token:
        return Grant(fence, expires_at, expires_in)
    return Holder(row_owner, row_token, expires_in, kind)


@register("postgresql")
class PostgresStore(Store):
    can_transfer = True
    reserves_fences = True
    can_notify: ClassVar[bool] = True
    # psycopg, interrupted by KeyboardInterrupt or a cancellation, cancels
    # the statement and waits for its end itself; any other exception (a
    # SIGALRM handler's) after the statement went out leaves it running
    # (see Orphans.settle_later).
    alive_sql: ClassVar[str | None] = "SELECT 1 FROM pg_stat_activity WHERE pid = %(id)s"

    @staticmethod
    def server_thread(dbapi_connection: Any) -> int:
        # psycopg 3's (blocking and asyncio) and psycopg2's alike; asyncpg's.
        info = getattr(dbapi_connection, "info", None)
        if info is None:
            return int(dbapi_connection.get_server_pid())
        return int(info.backend_pid)

    def __init__(self, engine: Engine, *, config: Config, owns_engine: bool) -> None:
        super().__init__(engine, config=config, owns_engine=owns_engine)
        t = self.quoted(self.names.table)
        seq = self.quoted(self.names.sequence).replace("'", "''")
        lease = "now() + make_interval(secs => %(ttl)s)"
        # Materialised, and the INSERT reads its row: the lock is taken before nextval.
        self._acquire_sql = (
            f"WITH {key_lock(self.names.table)}, "
            f"ins AS ("
            f"INSERT INTO {t} AS t (lock_key, slot, owner, token, fence, acquired_at, expires_at) "
            f"SELECT %(key)s, '', %(owner)s, %(token)s, nextval('{seq}'), now(), {lease} FROM lk "
            f"WHERE NOT EXISTS (SELECT FROM {t} WHERE lock_key = %(key)s AND kind <> 'exclusive') "
            f"ON CONFLICT (lock_key, slot) DO UPDATE SET owner = excluded.owner, "
            f"token = excluded.token, fence = excluded.fence, "
            f"acquired_at = excluded.acquired_at, expires_at = excluded.expires_at "
            f"WHERE t.expires_at <= now() AND t.kind = 'exclusive' "
            f"RETURNING t.token, t.owner, t.fence, t.expires_at, t.kind) "
            f"SELECT token, owner, fence, expires_at, now(), kind FROM ins "
            f"UNION ALL "
            f"(SELECT token, owner, fence, expires_at, now(), kind FROM {t} "
            f"WHERE lock_key = %(key)s AND NOT EXISTS (SELECT FROM ins) "
            f"ORDER BY kind = 'exclusive', slot LIMIT 1)"
        )
        # Notify only if a listener registered the key (the try fails),
        # the try made after the DELETE (it reads gone); see the module's docstring.
        self._waiters = waiters_class(self.names.table)
        notify_if_waited = (
            f"CASE WHEN NOT pg_try_advisory_xact_lock({self._waiters}, hashtext(lock_key)) "
            f"THEN {notify('lock_key')} END"
        )
        self._release_sql = (
            f"WITH gone AS (DELETE FROM {t} WHERE lock_key = %(key)s AND slot = '' "
            f"AND token = %(token)s RETURNING lock_key) "
            f"SELECT {notify_if_waited} FROM gone"
        )
        # The reserve is drawn in RETURNING, after the SET's nextval and under
        # the row's lock: a takeover's fence, drawn only once the row is no
        # longer ours, is greater than all of them. The key's advisory lock
        # comes first, as in the acquire: an acquire that drew its fence and
        # has not yet met our row (descheduled between its nextval and its
        # conflict check) would otherwise find the key free once this run
        # ended and write a fence smaller than ours (seen in a Patroni
        # torture run; tests/test_postgresql_fence.py). Taken before the row
        # lock (the CTE is read before any row is updated), as every
        # statement that takes both does, so no two wait for each other.
        self._transfer_sql = (
            f"WITH {key_lock(self.names.table)} "
            f"UPDATE {t} SET token = %(new_token)s, owner = %(owner)s, "
            f"fence = nextval('{seq}'), acquired_at = now(), expires_at = {lease} "
            f"FROM lk WHERE lock_key = %(key)s AND slot = '' AND token = %(token)s "
            f"RETURNING fence, expires_at, now(), "
            f"ARRAY(SELECT nextval('{seq}') FROM generate_series(1, %(extra)s::int))"
        )
        # Rows locked first, in key order, then written: see the group commit's comment.
        self._renew_sql = (
            f"WITH mine AS MATERIALIZED (SELECT t.lock_key, t.slot, t.token, v.ttl "
            f"FROM {t} AS t JOIN "
            f"{unnest('keys::text[]', 'tokens::text[]', 'ttls::float8[]')} WITH ORDINALITY "
            f"AS v(lock_key, token, ttl, n) ON t.lock_key = v.lock_key AND t.token = v.token "
            f"ORDER BY v.n, t.slot FOR NO KEY UPDATE OF t) "
            f"UPDATE {t} AS t SET expires_at = now() + make_interval(secs => mine.ttl) "
            f"FROM mine WHERE t.lock_key = mine.lock_key AND t.slot = mine.slot "
            f"AND t.token = mine.token "
            f"RETURNING t.token, t.expires_at, now()"
        )
        # Group commit (dblock._store.batch): the same decisions for many keys
        # in one statement. Every statement that writes the rows of many keys
        # (acquire, release, renewal) takes their row locks in one global
        # order, the order of their keys as the client sorts them (code
        # points: no collation of the server's involved), which WITH
        # ORDINALITY carries into the statement; so two of them sharing keys
        # wait for each other instead of deadlocking. The acquire writes its
        # rows in that order (an INSERT … SELECT keeps its SELECT's order,
        # and ON CONFLICT locks the row it meets), after taking its advisory
        # locks in the order of their numbers. The release and the renewal
        # cannot rely on their write's plan: on a small or never-analysed
        # table PostgreSQL joins the keys to the table by a hash join over a
        # scan of it, and the rows were locked in their physical order
        # (issue 32: 2 to 7 deadlocks in 20 s of 2 processes x 32 threads). So
        # they first lock their rows by SELECT … ORDER BY n FOR UPDATE in a
        # materialised CTE (rows are locked after the sort), then write what
        # they hold, found again by key: a row updated since the statement's
        # snapshot is the locked version, which the write re-reads. A
        # deadlock PostgreSQL still detects (a row locked by a statement that
        # is no batch) fails the batch cleanly, and its requests go out
        # again one by one.
        self._acquire_many_sql = (
            f"WITH v AS MATERIALIZED (SELECT * FROM "
            f"{unnest('keys::text[]', 'owners::text[]', 'tokens::text[]', 'ttls::float8[]')} "
            f"WITH ORDINALITY "
            f"AS v(lock_key, owner, token, ttl, n)), "
            f"lk AS MATERIALIZED (SELECT pg_advisory_xact_lock({lock_class(self.names.table)}, h) "
            f"FROM (SELECT DISTINCT hashtext(lock_key) AS h FROM v ORDER BY h OFFSET 0) s), "
            f"ins AS ("
            f"INSERT INTO {t} AS t (lock_key, slot, owner, token, fence, acquired_at, expires_at) "
            f"SELECT s.lock_key, '', s.owner, s.token, nextval('{seq}'), now(), "
            f"now() + make_interval(secs => s.ttl) "
            f"FROM (SELECT * FROM v ORDER BY n OFFSET 0) s "
            f"WHERE (SELECT count(*) FROM lk) >= 0 AND NOT EXISTS (SELECT FROM {t} "
            f"WHERE lock_key = s.lock_key AND kind <> 'exclusive' OFFSET 0) "
            f"ON CONFLICT (lock_key, slot) DO UPDATE SET owner = excluded.owner, "
            f"token = excluded.token, fence = excluded.fence, "
            f"acquired_at = excluded.acquired_at, expires_at = excluded.expires_at "
            f"WHERE t.expires_at <= now() AND t.kind = 'exclusive' "
            f"RETURNING t.lock_key, t.token, t.owner, t.fence, t.expires_at, t.kind) "
            f"SELECT lock_key, token, owner, fence, expires_at, now(), kind FROM ins "
            f"UNION ALL "
            f"(SELECT DISTINCT ON (t.lock_key) t.lock_key, t.token, t.owner, t.fence, "
            f"t.expires_at, now(), t.kind FROM {t} AS t JOIN v ON t.lock_key = v.lock_key "
            f"WHERE NOT EXISTS (SELECT FROM ins WHERE ins.lock_key = v.lock_key) "
            f"ORDER BY t.lock_key, t.kind = 'exclusive', t.slot)"
        )
        self._release_many_sql = (
            f"WITH mine AS MATERIALIZED (SELECT t.lock_key, t.token FROM {t} AS t JOIN "
            f"{unnest('keys::text[]', 'tokens::text[]')} WITH ORDINALITY AS v(lock_key, token, n) "
            f"ON t.lock_key = v.lock_key AND t.slot = '' AND t.token = v.token "
            f"ORDER BY v.n FOR UPDATE OF t), "
            f"gone AS (DELETE FROM {t} AS t USING mine "
            f"WHERE t.lock_key = mine.lock_key AND t.slot = '' AND t.token = mine.token "
            f"RETURNING t.lock_key, t.token) "
            f"SELECT token, {notify_if_waited} FROM gone"
        )
        self._channel = self.names.channel_prefix
        # What runs a statement: the executor itself unless retry() says
        # more than Store's (raise), saving a call per statement.
        self._run_once = self.executor.run if type(self).retry is Store.retry else self.run
        self._listener: Listener | None = None
        self._listener_lock = threading.Lock()
        self._direct: Engine | None = None  # listen_url's engine, made on first wait

    def acquire_steps(self, key: str, token: str, owner: str, ttl: float) -> Steps[Grant | Holder]:
        params = {"key": key, "owner": owner, "token": token, "ttl": ttl}
        return _acquired((yield self._acquire_sql, params, True, False).rows, token)

    def exclusive_sql(self) -> ExclusiveSQL:
        return ExclusiveSQL(
            self._acquire_sql, self._release_sql, {"channel": self._channel}, True, True, True
        )

    def release_steps(self, key: str, token: str) -> Steps[bool]:
        params = {"key": key, "token": token, "channel": self._channel}
        return bool((yield self._release_sql, params, True, False).rows)

    # The blocking driver's one-statement operations, without a generator to
    # drive: the same statement and parameters as the steps above, and the
    # same decision (_acquired), on the hot path of every lock.

    def try_acquire(self, key: str, token: str, owner: str, ttl: float) -> Grant | Holder:
        params = {"key": key, "owner": owner, "token": token, "ttl": ttl}
        return _acquired(self._run_once(self._acquire_sql, params, True).rows, token)

    def release(self, key: str, token: str) -> bool:
        params = {"key": key, "token": token, "channel": self._channel}
        return bool(self._run_once(self._release_sql, params, True).rows)

    def acquire_many_steps(
        self, requests: Sequence[tuple[str, str, str, float]]
    ) -> Steps[list[Grant | Holder]]:
        # Sorted by key, so that every batch writes its rows in one order.
        order = sorted(range(len(requests)), key=lambda i: requests[i][0])
        keys, tokens, owners, ttls = [], [], [], []
        for i in order:
            key, token, owner, ttl = requests[i]
            keys.append(key)
            tokens.append(token)
            owners.append(owner)
            ttls.append(ttl)
        params = {"keys": keys, "owners": owners, "tokens": tokens, "ttls": ttls}
        rows = (yield self._acquire_many_sql, params, True, False).rows
        by_key: dict[str, tuple[Any, ...]] = {}
        for row in rows:
            by_key.setdefault(row[0], row[1:])
        return [
            _acquired([by_key[key]] if key in by_key else [], token)
            for key, token, _, _ in requests
        ]

    def release_many_steps(self, requests: Sequence[tuple[str, str]]) -> Steps[list[bool]]:
        ordered = sorted(requests)
        params = {
            "keys": [key for key, _ in ordered],
            "tokens": [token for _, token in ordered],
            "channel": self._channel,
        }
        rows = (yield self._release_many_sql, params, True, False).rows
        gone = {row[0] for row in rows}
        return [token in gone for _, token in requests]

    def transfer_steps(
        self, key: str, token: str, new_token: str, owner: str, ttl: float, *, extra: int = 0
    ) -> Steps[Grant | None]:
        params = {
            "key": key,
            "token": token,
            "new_token": new_token,
            "owner": owner,
            "ttl": ttl,
            "extra": extra,
        }
        rows = (yield self._transfer_sql, params, True, False).rows
        if not rows:
            return None
        fence, expires_at, now, drawn = rows[0]
        reserve = tuple(sorted(drawn))
        if reserve and reserve[0] <= fence:  # never: RETURNING runs after SET
            reserve = ()
        return Grant(fence, expires_at, (expires_at - now).total_seconds(), reserve=reserve)

    def _renew_chunk(self, locks: Sequence[tuple[str, str, float]]) -> Steps[dict[str, Lease]]:
        # Sorted by key: rows are locked in the order of every batch (see __init__).
        keys, tokens, ttls = zip(*sorted(locks), strict=True)
        params = {"keys": list(keys), "tokens": list(tokens), "ttls": list(ttls)}
        rows = (yield self._renew_sql, params, True, False).rows
        return {
            token: Lease(expires_at, (expires_at - now).total_seconds())
            for token, expires_at, now in rows
        }

    def waiter(self, key: str, since: float, address: str | None = None) -> Wait:
        listener = self.listener()
        if listener is None:
            return super().waiter(key, since)
        return NotifyWait(listener, key, since, self.config, address)

    @property
    def made_listener(self) -> Listener | None:
        """The LISTEN connection if :meth:`listener` made it, else None
        (without making one)."""
        return self._listener

    def listener(self) -> Listener | None:
        """This process's LISTEN connection (made, not yet started, on first
        use), shared by its waiting threads and tasks; None when waiters poll."""
        config = self.config
        if not config.notify or (config.pooler and config.listen_url is None):
            # A LISTEN through a transaction-mode pooler hears nothing
            # reliably (its server connection changes): poll instead.
            return None
        with self._listener_lock:
            if self._listener is None:
                engine = self._listen_engine()
                # Straight to the server (listen_url): no pool of ours to make room in.
                make_room = self.executor.release_idle if engine is self.engine else None
                self._listener = Listener(
                    engine,
                    self._channel,
                    make_room=make_room,
                    waiters=self._waiters,
                    legacy=self.names.channel,
                )
            return self._listener

    def _listen_engine(self) -> Engine:
        """Where the LISTEN connection goes: ``listen_url`` (straight to the
        server, past a pooler) if given, else the lock statements' engine."""
        if self.config.listen_url is None:
            return self.engine
        if self._direct is None:
            from .._engine import make_engine, resolve_url

            self._direct = make_engine(resolve_url(self.config.listen_url), {"poolclass": NullPool})
        return self._direct

    def is_missing_table(self, exc: BaseException) -> bool:
        return sqlstate(exc) == _UNDEFINED_TABLE

    def retry(self, sql: str, exc: BackendError, attempt: int) -> Result | float | None:
        if attempt < _LOST_RETRIES and self.lost_contention(exc):
            return 0.005 * 2.0**attempt
        return None

    def lost_contention(self, exc: BackendError) -> bool:
        cause = getattr(exc.__cause__, "orig", None) or exc.__cause__
        return cause is not None and sqlstate(cause) in _LOST

    def close(self) -> None:
        with self._listener_lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        if self._direct is not None:
            self._direct.dispose()
        super().close()

    def after_fork(self) -> None:
        # The parent's listener thread does not exist here; its socket is the
        # parent's. Forget it without closing it.
        self._listener = None
        self._listener_lock = threading.Lock()
        super().after_fork()

    # -- admin ---------------------------------------------------------------

    now_sql: ClassVar[str] = "now()"

    def release_row(self, key: str, slot: str, token: str) -> bool:
        t = self.quoted(self.names.table)
        sql = (
            f"WITH gone AS (DELETE FROM {t} WHERE lock_key = %(key)s AND slot = %(slot)s "
            f"AND token = %(token)s RETURNING lock_key) "
            f"SELECT {notify('lock_key')} FROM gone"
        )
        params = {"key": key, "slot": slot, "token": token, "channel": self._channel}
        return bool(self.run(sql, params, fetch=True).rows)

    def sweep(self, reason: SweepReason, *, older_than: float, limit: int) -> list[LockRow]:
        # SKIP LOCKED: a row being taken over or handed on right now is left
        # for the next batch instead of making the sweeper wait on it. The
        # condition is checked again on the locked row, and each deleted key
        # is announced like a release, so its waiters wake at once.
        t = self.quoted(self.names.table)
        column = reason.column
        old = f"{column} <= now() - make_interval(secs => %(older_than)s)"
        sql = (
            f"WITH gone AS (DELETE FROM {t} WHERE (lock_key, slot) IN ("
            f"SELECT lock_key, slot FROM {t} WHERE {old} ORDER BY {column} LIMIT %(limit)s "
            f"FOR UPDATE SKIP LOCKED) AND {old} RETURNING {COLUMNS}) "
            f"SELECT {COLUMNS}, now(), {notify('lock_key')} FROM gone"
        )
        params = {"older_than": older_than, "limit": limit, "channel": self._channel}
        return [lock_row(r) for r in self.run(sql, params, fetch=True).rows]

    # Autovacuum is on for the table unless the server's setting or the
    # table's own storage parameter turns it off.
    _HEALTH_SQL = (
        "SELECT pg_total_relation_size(c.oid), s.n_live_tup, s.n_dead_tup, s.last_autovacuum,"
        " s.last_vacuum, s.autovacuum_count, s.vacuum_count,"
        " current_setting('autovacuum')::boolean AND coalesce((SELECT option_value::boolean"
        " FROM pg_options_to_table(c.reloptions) WHERE option_name = 'autovacuum_enabled'),"
        " true) FROM pg_class c LEFT JOIN pg_stat_all_tables s ON s.relid = c.oid"
        " WHERE c.oid = to_regclass(%(table)s)"
    )

    def table_health(self) -> TableHealth | None:
        rows = self.run(self._HEALTH_SQL, {"table": self.quoted(self.names.table)}, fetch=True)
        if not rows.rows:
            return None
        size, live, dead, last_auto, last_vacuum, autos, vacuums, autovacuum = rows.rows[0]
        return TableHealth(
            size_bytes=size,
            live_rows=live,
            dead_rows=dead,
            last_autovacuum=last_auto,
            last_vacuum=last_vacuum,
            autovacuum_count=autos,
            vacuum_count=vacuums,
            autovacuum=autovacuum,
        )

    def vacuum(self, dead_rows: int) -> bool:
        # A lock table makes thousands of dead rows a second and autovacuum
        # visits a database once per autovacuum_naptime (a minute) at most:
        # the sweeper, already running every interval, vacuums between visits.
        # VACUUM takes no lock that blocks INSERT/UPDATE/DELETE; it cannot run
        # in a transaction, and each statement here runs in autocommit.
        sql = "SELECT n_dead_tup FROM pg_stat_all_tables WHERE relid = to_regclass(%(table)s)"
        found = self.run(sql, {"table": self.quoted(self.names.table)}, fetch=True).rows
        if not found or found[0][0] is None or found[0][0] < dead_rows:
            return False
        self.run(f"VACUUM {self.quoted(self.names.table)}", {})
        return True


class Settable(Protocol):
    """What a waiter gives the listener to be woken: a ``threading.Event``,
    or the asyncio side's loop-bound event."""

    def set(self) -> None: ...


class NotifyWait(Wait):
    """Wait for a release notification of one key, with two safety nets: the
    caller's cap at the holder's expiry, and a periodic re-check."""

    __slots__ = ("_address", "_backoff", "_event", "_key", "_listener", "_poll_max", "_recheck")

    def __init__(  # noqa: PLR0917 - as Store.waiter, and the event last
        self,
        listener: Listener,
        key: str,
        since: float,
        config: Config,
        address: str | None = None,
        event: Settable | None = None,
    ) -> None:
        self._listener = listener
        self._key = key
        self._recheck = config.notify_recheck
        self._poll_max = config.poll_max
        self._backoff = Backoff(config.poll_initial, config.poll_max)
        # ``event``: the asyncio side's (dblock.aio), set through its loop;
        # the blocking side's is a threading.Event of the listener's.
        if event is None:
            self._event: Any = listener.subscribe(key, since)
        else:
            self._event = event
            listener.attach(key, since, event)
        # A fair-queue waiter: also woken by the notification addressed to it.
        self._address = address
        if address is not None:
            listener.attach(address, since, self._event)

    def prepare(self) -> None:
        self._event.clear()

    def timeout(self, limit: float) -> float:
        """How long the next sleep waits for the event, at most ``limit``
        (what both faces' waits decide alike; only the waiting differs)."""
        if not self._listener.listening:
            # No listener connection right now: notifications may be missed,
            # so poll; but the listener back (its keys registered again, its
            # buckets listened to again) wakes us at once to look again.
            return self._backoff.step(limit)
        if not self._listener.covers(self._key):
            # Its registration is not in yet: woken when it is, but no later
            # than a polling waiter's longest sleep (a busy listener thread
            # must not be what the waiter waits for).
            limit = min(limit, self._poll_max)
        return min(limit, self._listener.recheck_every(self._recheck))

    def sleep(self, limit: float) -> None:
        self._event.wait(self.timeout(limit))

    def close(self) -> None:
        self._listener.unsubscribe(self._key, self._event)
        if self._address is not None:
            self._listener.unsubscribe(self._address, self._event)


class Listener:
    """One LISTEN connection per store, on a thread of its own.

    Started by the first waiter; it stops (and closes its connection) after
    :attr:`LINGER` seconds without waiters. While it is reconnecting,
    :attr:`listening` is false and waiters poll instead.

    It LISTENs to the channel of a key's bucket (see :data:`BUCKETS`) from
    the key's registration until its unregistration: a bucket is listened to
    while some key of it is registered, so a process hears the releases of
    the keys its waiters wait for and of the few others sharing their
    buckets, not the cluster's. The bucket of a key is the server's answer to
    its registration; the LISTEN follows, and only then are its waiters woken
    to try again, so a release is either heard or found by that attempt.
    While it LISTENs to any bucket it also LISTENs to the table's one
    channel of earlier versions (:attr:`TableNames.channel
    <dblock.schema.TableNames.channel>`), which only their processes still
    notify (a rolling upgrade): nothing to hear once they are gone. Without
    waiters for :attr:`KEY_LINGER` it LISTENs to nothing, so its server
    session is out of the listeners every notifying commit signals.

    A waiter subscribes only after its first attempt found the key held, so
    the listener remembers the keys released in the last :attr:`RECENT`
    seconds: a release that slipped between that attempt and the subscription
    still wakes the waiter, without an extra statement to close the gap.
    """

    LINGER = 30.0
    RECENT = 2.0
    #: A key nobody of this process waits for any more stays registered this
    #: long: a key waited for again and again (a hot key) then needs no new
    #: registration (and no extra attempt) each time, at the cost of a few
    #: notifications nobody hears.
    KEY_LINGER = 2.0

    def __init__(
        self,
        engine: Engine,
        channel: str,
        *,
        waiters: int,
        make_room: Callable[[], None] | None = None,
        legacy: str | None = None,
    ) -> None:
        self._engine = engine
        self._channel = channel  # the buckets' channels: this prefix and the bucket's number
        self._legacy = legacy  # the one channel of earlier versions, listened to as well
        self._make_room = make_room
        # Registration of waited-for keys on the server (see the module's
        # docstring): the advisory lock class.
        self._waiters = waiters
        self._registered: set[str] = set()  # held by our connection now
        self._registering: set[str] = set()  # being registered by the thread
        self._to_register: set[str] = set()
        self._to_unregister: set[str] = set()
        self._unwaited: dict[str, float] = {}  # registered, no waiter since (monotonic)
        # Bucket of each registered key (the server's answer to the
        # registration); the buckets our connection LISTENs to (the thread's).
        self._bucket: dict[str, int] = {}
        self._listened: set[int] = set()
        self._subs: dict[str, set[Settable]] = {}
        self._recent: dict[str, float] = {}
        self._recent_order: deque[tuple[float, str]] = deque()
        self._handed: dict[str, int] = {}  # fair queue: address -> fence handed to it
        #: Notification payloads dispatched since the listener was made: what
        #: this process hears (``benchmarks/listeners.py`` reports it, through ``dblock._hooks``).
        self.received = 0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        # Set once the thread's first connection attempt is over (either way).
        self._tried = threading.Event()
        # monotonic time since which the current LISTEN has been active
        self._listening_since = float("inf")
        self._stopping = False
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)

    @property
    def thread(self) -> threading.Thread | None:
        """The thread that listens (None until a first waiter)."""
        return self._thread

    @property
    def listened(self) -> frozenset[int]:
        """The buckets of keys whose channels the connection LISTENs to now."""
        return frozenset(self._listened)

    @property
    def listening(self) -> bool:
        return self._ready.is_set()

    def subscribe(self, key: str, since: float) -> threading.Event:
        """An event set when ``key`` is released; already set if it may have
        been released since ``since`` (a ``time.monotonic()`` reading)."""
        event = threading.Event()
        self._add(key, event)
        # The first waiter of a process waits for the LISTEN to be active;
        # not while it reconnects (a failover): that wait could outlast the
        # key's holder, and the waiter polls meanwhile anyway (see sleep()).
        self._tried.wait(5.0)
        self._check_missed(key, since, event)
        return event

    def attach(self, key: str, since: float, event: Settable) -> None:
        """Set ``event`` when ``key`` is released (and at once if it may have
        been released since ``since``), without waiting for anything: the
        asyncio side's subscription (its event wakes a future through its loop)."""
        self._add(key, event)
        self._check_missed(key, since, event)

    def _add(self, key: str, event: Settable) -> None:
        with self._lock:
            if self._stopping:
                event.set()
                return
            self._subs.setdefault(key, set()).add(event)
            # A key registered all along needs nothing more: every release
            # since then notified. Otherwise the thread registers it and then
            # wakes its waiters, who try again (see the module's docstring).
            register = (
                not key.startswith(HANDED_MARK)
                and key not in self._registered
                and key not in self._registering
                and key not in self._to_register
            )
            if register:
                self._to_register.add(key)
            self._to_unregister.discard(key)
            self._unwaited.pop(key, None)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="dblock-listener", daemon=True
                )
                self._tried.clear()
                _threads.start(self._thread)
        if register:
            self._poke()

    def _poke(self) -> None:
        if self._stopping:  # the pipe may be closed (and its number reused)
            return
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"r")

    def _check_missed(self, key: str, since: float, event: Settable) -> None:
        with self._lock:
            if key in self._to_register or key in self._registering:
                return  # woken once registered, which covers any release before
            if self._listening_since > since or self._recent.get(key, -1.0) >= since:
                event.set()

    def recheck_every(self, every: float) -> float:
        """How often a woken waiter looks again unwoken (see base.recheck_every)."""
        return recheck_every(every, len(self._subs))

    def covers(self, key: str) -> bool:
        """Whether every release of ``key`` notifies now (its registration
        is in, or none is needed)."""
        return key in self._registered or key.startswith(HANDED_MARK)

    def take_handed(self, address: str) -> int | None:
        """The fence of the head a release handed to the fair-queue waiter
        at ``address``, if its wake-up said so (once)."""
        with self._lock:
            return self._handed.pop(address, None)

    def unsubscribe(self, key: str, event: Settable) -> None:
        with self._lock:
            events = self._subs.get(key)
            if events is not None:
                events.discard(event)
                if not events:
                    del self._subs[key]
                    self._to_register.discard(key)
                    if key in self._registered:
                        # Dropped by the thread after KEY_LINGER, unless waited for again.
                        self._unwaited[key] = time.monotonic()

    def _sync_registrations(self, conn: Any) -> None:
        """On the listener's thread: register the keys waited for since the
        last call and drop those nobody waits for any more, LISTEN to the
        buckets of the registered keys and no others, then wake the waiters
        of the newly registered keys."""
        with self._lock:
            drop = list(self._to_unregister)
            self._to_unregister.clear()
            # Not registered from here on: a waiter arriving now registers again.
            self._registered.difference_update(drop)
            add = list(self._to_register)
            self._to_register.clear()
            self._registering.update(add)
        sql = "SELECT {}(%s, hashtext(k)){} FROM unnest(%s::text[]) AS k"
        if drop:
            _execute(conn, sql.format("pg_advisory_unlock_shared", ""), (self._waiters, drop))
        buckets: dict[str, int] = {}
        if add:
            # Waits while a release that found no waiter commits (it holds
            # the same lock exclusively until then): see the module's docstring.
            # The answer is each key's bucket, as the releases compute it.
            rows = _execute(
                conn,
                sql.format("pg_advisory_lock_shared", f", k, hashtext(k) & {BUCKETS - 1}"),
                (self._waiters, add),
            )
            buckets = {key: bucket for _, key, bucket in rows}
        with self._lock:
            for key in drop:
                self._bucket.pop(key, None)
            self._bucket.update(buckets)
            wanted = {self._bucket[k] for k in self._registered if k in self._bucket}
        wanted.update(buckets.values())
        # Before the new keys' waiters are woken: a release committed after
        # this LISTEN is heard, one before it is found by their next attempt.
        self._listen(conn, wanted)
        woken: list[Settable] = []
        with self._lock:
            self._registering.difference_update(add)
            for key in add:
                events = self._subs.get(key)
                if events:
                    self._registered.add(key)
                    woken.extend(events)
                else:  # nobody waits any more: dropped after KEY_LINGER
                    self._unwaited[key] = time.monotonic()
                    self._registered.add(key)
        for event in woken:
            event.set()

    def _listen(self, conn: Any, wanted: set[int]) -> None:
        """LISTEN to the channels of the ``wanted`` buckets, UNLISTEN the
        others, in one round trip (on the listener's thread). The old
        channel is listened to while any bucket is: a session that LISTENs
        to nothing is out of the server's listeners, which every notifying
        commit signals whatever the channel (up to PostgreSQL 18)."""
        start = [f"{self._channel}{b}" for b in sorted(wanted - self._listened)]
        stop = [f"{self._channel}{b}" for b in sorted(self._listened - wanted)]
        if not start and not stop:
            return
        if self._legacy is not None and not self._listened:
            start.append(self._legacy)
        elif self._legacy is not None and not wanted:
            stop.append(self._legacy)
        quote = self._engine.dialect.identifier_preparer.quote_identifier
        _execute(
            conn,
            "; ".join(
                [f"LISTEN {quote(name)}" for name in start]
                + [f"UNLISTEN {quote(name)}" for name in stop]
            ),
        )
        self._listened = wanted

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            thread = self._thread
        os.write(self._wake_w, b"x")
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _wake_all(self, *, registering: bool = True) -> None:
        with self._lock:
            # On connect, keys waiting for their registration are woken when it is in.
            pending = self._to_register if not registering else ()
            events = [e for k, subs in self._subs.items() if k not in pending for e in subs]
        for event in events:
            event.set()

    def _run(self) -> None:
        delay = 0.05
        while True:
            conn: Any = None
            try:
                conn = self._connect()
                delay = 0.05
                with self._lock:
                    self._listening_since = time.monotonic()
                self._ready.set()
                self._tried.set()
                self._wake_all(registering=False)  # released while we were not listening
                self._serve(conn)
                return
            except Exception as exc:
                if not self._stopping:
                    log.warning("dblock: LISTEN connection failed (%s); retrying", exc)
                self._tried.set()
            finally:
                if conn is not None:
                    with contextlib.suppress(Exception):  # already broken
                        conn.close()
            with self._lock:
                self._ready.clear()
                self._listening_since = float("inf")
                if self._stopping:
                    self._thread = None
                    return
            self._wake_all()  # waiters fall back to polling while we reconnect
            time.sleep(delay)
            # At most half a second between tries: a failover's end is not
            # announced, and until we listen again, waiters poll (measured on
            # Patroni with a 2 s cap: LISTEN back 1.8 s after writes were).
            delay = min(delay * 2, 0.5)

    def _connect(self) -> Any:
        if self._make_room is not None:
            # The statements' idle connections go back to the pool first: in
            # a pool without overflow they could be all it has, and this
            # connection would wait for one until the pool's timeout.
            self._make_room()
        proxied = self._engine.raw_connection()
        proxied.detach()  # ours alone for as long as we listen, not the pool's
        conn: Any = proxied.dbapi_connection
        conn.autocommit = True
        if hasattr(conn, "add_notify_handler"):
            # psycopg 3: notifications that arrive while our own statements
            # run (the registrations) are taken by psycopg, and handed here.
            # psycopg2 queues them in conn.notifies, which _serve drains.
            conn.add_notify_handler(lambda note: self._dispatch([note.payload], time.monotonic()))
        self._listened = set()  # a new session LISTENs to nothing yet
        with self._lock:
            # A new session holds no registration and LISTENs to no bucket:
            # register every waited-for key again, which LISTENs to its
            # bucket again (its waiters are woken once that is done).
            self._registered.clear()
            self._registering.clear()
            self._to_unregister.clear()
            self._unwaited.clear()
            self._bucket.clear()
            self._to_register = {k for k in self._subs if not k.startswith(HANDED_MARK)}
        return conn

    def _serve(self, conn: Any) -> None:
        """Dispatch notifications until told to stop or idle for too long;
        raises when the connection breaks."""
        receive = _receiver(conn)
        fileno = conn.fileno()
        idle_since: float | None = None
        while True:
            readable, _, _ = select.select([fileno, self._wake_r], [], [], 1.0)
            if self._wake_r in readable:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 64)
            now = time.monotonic()
            with self._lock:
                if self._subs:
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                if self._stopping or (idle_since is not None and now - idle_since > self.LINGER):
                    # Clear under the lock: a new thread started right after
                    # this must not have its readiness cleared by us.
                    self._ready.clear()
                    self._listening_since = float("inf")
                    self._thread = None
                    return
            if self._unwaited:
                with self._lock:
                    stale = [k for k, t in self._unwaited.items() if now - t > self.KEY_LINGER]
                    for key in stale:
                        del self._unwaited[key]
                        self._to_unregister.add(key)
            if self._to_register or self._to_unregister:
                self._sync_registrations(conn)
            keys = receive(fileno in readable)
            if keys:
                self._dispatch(keys, now)

    def _dispatch(self, keys: list[str], now: float) -> None:
        """Wake the waiters of each released key (a notification's payload)."""
        woken: list[Settable] = []
        with self._lock:
            self.received += len(keys)
            for payload in keys:
                key = payload
                if key.startswith(HANDED_MARK):
                    # A fair-queue waiter's address, with the fence of the
                    # head handed to it: kept until it takes it (or RECENT).
                    key, _, fence = key.partition(" ")
                    if fence.isdigit():
                        self._handed[key] = int(fence)
                self._remember(key, now)
                woken.extend(self._subs.get(key, ()))
        for event in woken:
            event.set()

    def _remember(self, key: str, now: float) -> None:
        self._recent[key] = now
        self._recent_order.append((now, key))
        horizon = now - self.RECENT
        order = self._recent_order
        while order and order[0][0] < horizon:
            seen, old = order.popleft()
            if self._recent.get(old) == seen:
                del self._recent[old]
                self._handed.pop(old, None)


def _execute(conn: Any, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    """Run ``sql`` on the listener's own DBAPI connection (psycopg 3's or
    psycopg2's: both take pyformat parameters through a cursor); its rows."""
    cursor = conn.cursor()
    try:
        cursor.execute(sql, params)
        return list(cursor.fetchall()) if cursor.description is not None else []
    finally:
        cursor.close()


def _receiver(conn: Any) -> Callable[[bool], list[str]]:
    """A function taking whether the listener's socket is readable and
    returning the payloads of the notifications received (raising when the
    connection is gone), for the driver of ``conn``."""
    pgconn = getattr(conn, "pgconn", None)
    if pgconn is not None:  # psycopg 3: libpq's own queue, read without a statement
        encoding = conn.info.encoding

        def receive_psycopg(readable: bool) -> list[str]:
            if not readable:
                return []
            pgconn.consume_input()
            if pgconn.status != 0:  # CONNECTION_OK
                raise ConnectionError("LISTEN connection closed by the server")
            keys = []
            while (note := pgconn.notifies()) is not None:
                keys.append(note.extra.decode(encoding))
            return keys

        return receive_psycopg

    def receive_psycopg2(readable: bool) -> list[str]:
        # poll() reads what the socket has (raising OperationalError if
        # the server closed it) into conn.notifies, where notifications
        # that came in during our own statements already wait: drained on
        # every turn, readable or not, or those would wait for the next one.
        if readable:
            conn.poll()
        keys = []
        while conn.notifies:
            keys.append(conn.notifies.pop(0).payload)
        return keys

    return receive_psycopg2
