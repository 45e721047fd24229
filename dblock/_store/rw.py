"""Level 2 of the read-write lock: its statements, per dialect.

The key's head row (``slot = ''``, ``kind = 'rw'``) is the single arbiter.
Every grant is ONE conditional upsert of that row, serialised by its row
lock, whose condition is evaluated on the row's latest committed version
(PostgreSQL re-checks ``ON CONFLICT DO UPDATE … WHERE`` on the locked row
under READ COMMITTED; InnoDB's ``ON DUPLICATE KEY UPDATE`` locks the
duplicate and reads its current version; SQLite has one writer at a time):

* a read grant turns a free head (absent, lease run out, or ``holders = 0``)
  into a read phase (``mode = 'read'``, ``holders = 1``, a new epoch token),
  or joins the live read phase (``holders + 1``, the lease becomes the later
  of the two);
* a write grant takes only a free head (``mode = 'write'``).

So a reader and a writer can never both be granted: they write the same row
and each condition reads what the other wrote (no write skew, which two rows
checked against each other would allow under snapshot reads).

A read release decrements ``holders`` where the token is still the read
phase's epoch (one statement: the last one deletes the row); a crashed
reader's count is never decremented, so the read phase ends when the live
readers are gone and the lease (extended by every reader, never shortened)
runs out.

Writer preference: a waiting writer keeps an intent row (``slot = 'w' +
its token``, ``mode = 'waiting'``) with its own lease; a read grant requires
that no live intent row exists. Races on the intent row only affect who goes
first, never exclusion.

Fences: each grant (a join too) writes a new fence into the head row, so
fences grow per key with every grant: PostgreSQL ``nextval`` under the
key's advisory lock (as the exclusive lock), SQLite the counter table,
MariaDB the ``AUTO_INCREMENT`` value the upsert draws (``VALUES(fence)`` in
``ON DUPLICATE KEY UPDATE`` is the freshly drawn value).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from ..errors import DBLockError
from .base import Lease, Result, Steps, Store
from .sqlparts import SQLITE_NOW, key_lock, notify, unnest

__all__ = ["RwRow", "RwStatements", "rw_statements"]

_UTC = timezone.utc
READ = "read"
WRITE = "write"


@dataclasses.dataclass(slots=True)
class RwRow:
    """The head row as a grant statement left it (or found it)."""

    granted: bool
    kind: str
    mode: str
    token: str
    owner: str
    fence: int
    expires_at: datetime
    expires_in: float
    holders: int


class RwStatements:
    """The read-write statements of one store (one subclass per dialect)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.t = store.quoted(store.names.table)

    # Each returns :data:`Steps`, driven by ``store.drive``.

    def grant_steps(
        self, mode: str, key: str, token: str, owner: str, ttl: float
    ) -> Steps[RwRow | None]:
        """One try at a ``mode`` grant with ``token`` (the new epoch for a
        read). The head row afterwards (``granted`` says whether we got it),
        or None when there is none (free, but held back by a writer's intent)."""
        raise NotImplementedError

    def release_read_steps(self, key: str, epoch: str) -> Steps[bool]:
        """Drop one shared hold of the read phase ``epoch``; False if that
        read phase is over (the lock was lost)."""
        raise NotImplementedError

    def release_write_steps(self, key: str, token: str) -> Steps[bool]:
        raise NotImplementedError

    def downgrade_steps(self, key: str, token: str) -> Steps[bool]:
        """Our write hold becomes a read phase of one holder (epoch = token), atomically."""
        raise NotImplementedError

    def intent_steps(self, key: str, token: str, owner: str, ttl: float) -> Steps[None]:
        raise NotImplementedError

    def drop_intent_steps(self, key: str, token: str) -> Steps[None]:
        raise NotImplementedError

    def renew(self, locks: Sequence[tuple[str, str, float]]) -> dict[str, Lease]:
        """Extend the head rows of ``(key, token, ttl)``: a read phase's lease
        only ever grows (``max``), a writer's is set to now + ttl."""
        raise NotImplementedError

    def holder_steps(self, key: str) -> Steps[RwRow | None]:
        raise NotImplementedError

    #: SQL for the database's current time, and a named parameter, per dialect.
    now_sql = "now()"
    param = "%({})s"

    #: The statement of :meth:`writer_waiting_steps`, once a dialect fixed it.
    _waiting_sql: str | None = None

    def _waiting_statement(self) -> str:
        return (
            f"SELECT 1 FROM {self.t} WHERE lock_key = {self.param.format('key')} "
            f"AND slot > '' AND mode = 'waiting' AND expires_at > {self.now_sql} LIMIT 1"
        )

    def writer_waiting_steps(self, key: str) -> Steps[bool]:
        """Whether a writer (of any process) waits for ``key`` now: a live intent row."""
        sql = self._waiting_sql or self._waiting_statement()
        return bool((yield sql, {"key": key}, True, False).rows)


def _intent_slot(token: str) -> str:
    return "w" + token


class PostgresRw(RwStatements):
    def __init__(self, store: Store) -> None:
        super().__init__(store)

        t = self.t
        names = store.names
        seq = store.quoted(names.sequence).replace("'", "''")
        lease = "now() + make_interval(secs => %(ttl)s)"
        lk = f"WITH {key_lock(names.table)}, "
        cols = "kind, mode, token, owner, fence, expires_at, holders, now()"
        tail = (
            f"RETURNING t.kind, t.mode, t.token, t.owner, t.fence, t.expires_at, t.holders) "
            f"SELECT true, {cols} FROM ins UNION ALL "
            f"SELECT false, {cols} FROM {t} WHERE lock_key = %(key)s AND slot = '' "
            f"AND NOT EXISTS (SELECT FROM ins)"
        )
        insert = (
            f"INSERT INTO {t} AS t (lock_key, slot, kind, mode, holders, owner, token, fence, "
            f"acquired_at, expires_at) SELECT %(key)s, '', 'rw', %(mode)s, 1, %(owner)s, "
            f"%(token)s, nextval('{seq}'), now(), {lease} FROM lk "
        )
        reset = "(t.expires_at <= now() OR t.mode <> 'read' OR t.holders <= 0)"
        self._read_sql = (
            lk + "ins AS (" + insert + f"WHERE NOT EXISTS (SELECT FROM {t} AS w "
            f"WHERE w.lock_key = %(key)s AND w.slot > '' AND w.mode = 'waiting' "
            f"AND w.expires_at > now()) "
            f"ON CONFLICT (lock_key, slot) DO UPDATE SET mode = 'read', fence = excluded.fence, "
            f"holders = CASE WHEN {reset} THEN 1 ELSE t.holders + 1 END, "
            f"token = CASE WHEN {reset} THEN excluded.token ELSE t.token END, "
            f"owner = CASE WHEN {reset} THEN excluded.owner ELSE t.owner END, "
            f"acquired_at = CASE WHEN {reset} THEN excluded.acquired_at ELSE t.acquired_at END, "
            f"expires_at = CASE WHEN t.expires_at <= now() THEN excluded.expires_at "
            f"ELSE greatest(t.expires_at, excluded.expires_at) END "
            f"WHERE t.kind = 'rw' AND (t.expires_at <= now() OR t.mode = 'read') " + tail
        )
        self._write_sql = (
            lk + "ins AS (" + insert + "ON CONFLICT (lock_key, slot) DO UPDATE SET "
            "mode = 'write', holders = 1, owner = excluded.owner, token = excluded.token, "
            "fence = excluded.fence, acquired_at = excluded.acquired_at, "
            "expires_at = excluded.expires_at "
            "WHERE t.kind = 'rw' AND (t.expires_at <= now() "
            "OR (t.mode = 'read' AND t.holders <= 0)) " + tail
        )
        head = "lock_key = %(key)s AND slot = '' AND token = %(token)s"
        self._release_read_sql = (
            f"WITH d AS (DELETE FROM {t} WHERE {head} AND mode = 'read' AND holders <= 1 "
            f"RETURNING lock_key), "
            f"u AS (UPDATE {t} SET holders = holders - 1 WHERE {head} AND mode = 'read' "
            f"AND holders > 1 RETURNING holders) "
            f"SELECT 0, {notify('lock_key')}::text FROM d "
            f"UNION ALL SELECT holders, NULL FROM u"
        )
        self._release_write_sql = (
            f"WITH gone AS (DELETE FROM {t} WHERE {head} AND mode = 'write' "
            f"RETURNING lock_key) SELECT {notify('lock_key')} FROM gone"
        )
        self._downgrade_sql = (
            f"WITH u AS (UPDATE {t} SET mode = 'read', holders = 1 WHERE {head} "
            f"AND mode = 'write' RETURNING lock_key) "
            f"SELECT {notify('lock_key')} FROM u"
        )
        self._intent_sql = (
            f"INSERT INTO {t} (lock_key, slot, kind, mode, holders, owner, token, fence, "
            f"acquired_at, expires_at) VALUES (%(key)s, %(slot)s, 'rw', 'waiting', 0, "
            f"%(owner)s, %(token)s, 0, now(), {lease}) "
            f"ON CONFLICT (lock_key, slot) DO UPDATE SET expires_at = excluded.expires_at"
        )
        self._drop_intent_sql = (
            f"WITH gone AS (DELETE FROM {t} WHERE lock_key = %(key)s AND slot = %(slot)s "
            f"RETURNING lock_key) SELECT {notify('lock_key')} FROM gone"
        )
        # The head rows locked first, in the order of their keys (sorted by
        # renew()), then written: the exclusive store's batches lock their
        # rows in that order too, so none of them deadlocks with this one
        # (see PostgresStore's group commit).
        self._renew_sql = (
            f"WITH mine AS MATERIALIZED (SELECT t.lock_key, t.token, v.ttl FROM {t} AS t JOIN "
            f"{unnest('keys::text[]', 'tokens::text[]', 'ttls::float8[]')} WITH ORDINALITY "
            f"AS v(lock_key, token, ttl, n) "
            f"ON t.lock_key = v.lock_key AND t.slot = '' AND t.token = v.token "
            f"ORDER BY v.n FOR NO KEY UPDATE OF t) "
            f"UPDATE {t} AS t SET expires_at = CASE WHEN t.mode = 'read' THEN "
            f"greatest(t.expires_at, now() + make_interval(secs => mine.ttl)) "
            f"ELSE now() + make_interval(secs => mine.ttl) END "
            f"FROM mine WHERE t.lock_key = mine.lock_key AND t.slot = '' "
            f"AND t.token = mine.token "
            f"RETURNING t.token, t.expires_at, now()"
        )
        self._holder_sql = f"SELECT false, {cols} FROM {t} WHERE lock_key = %(key)s AND slot = ''"
        self._channel = names.channel_prefix

    def grant_steps(
        self, mode: str, key: str, token: str, owner: str, ttl: float
    ) -> Steps[RwRow | None]:
        sql = self._read_sql if mode == READ else self._write_sql
        params = {"key": key, "mode": mode, "token": token, "owner": owner, "ttl": ttl}
        rows = (yield sql, params, True, False).rows
        return _row(rows[0]) if rows else None

    def release_read_steps(self, key: str, epoch: str) -> Steps[bool]:
        params = {"key": key, "token": epoch, "channel": self._channel}
        for _ in range(8):
            if (yield self._release_read_sql, params, True, False).rows:
                return True
            # Nothing matched: the read phase is over, or another reader's
            # release changed ``holders`` under our statement; look and retry.
            head = yield from self.holder_steps(key)
            if head is None or head.token != epoch or head.mode != READ or head.holders <= 0:
                return False
        return False

    def release_write_steps(self, key: str, token: str) -> Steps[bool]:
        params = {"key": key, "token": token, "channel": self._channel}
        return bool((yield self._release_write_sql, params, True, False).rows)

    def downgrade_steps(self, key: str, token: str) -> Steps[bool]:
        params = {"key": key, "token": token, "channel": self._channel}
        return bool((yield self._downgrade_sql, params, True, False).rows)

    def intent_steps(self, key: str, token: str, owner: str, ttl: float) -> Steps[None]:
        params = {"key": key, "slot": _intent_slot(token), "token": token, "owner": owner}
        yield self._intent_sql, {**params, "ttl": ttl}, False, False

    def drop_intent_steps(self, key: str, token: str) -> Steps[None]:
        params = {"key": key, "slot": _intent_slot(token), "channel": self._channel}
        yield self._drop_intent_sql, params, True, False

    def renew(self, locks: Sequence[tuple[str, str, float]]) -> dict[str, Lease]:
        keys, tokens, ttls = zip(*sorted(locks), strict=True)
        rows = self.store.run(
            self._renew_sql,
            {"keys": list(keys), "tokens": list(tokens), "ttls": list(ttls)},
            fetch=True,
        ).rows
        return {
            token: Lease(expires_at, (expires_at - now).total_seconds())
            for token, expires_at, now in rows
        }

    def holder_steps(self, key: str) -> Steps[RwRow | None]:
        rows = (yield self._holder_sql, {"key": key}, True, False).rows
        return _row(rows[0]) if rows else None


def _row(row: Sequence[Any]) -> RwRow:
    granted, kind, mode, token, owner, fence, expires_at, holders, now = row
    if isinstance(expires_at, (int, float)):  # SQLite: unix seconds (whole ones as int)
        expires_in = expires_at - now - 0.001  # its 'now' is truncated to the millisecond
        expires_at = datetime.fromtimestamp(expires_at, _UTC)
    else:
        expires_in = (expires_at - now).total_seconds()
        if expires_at.tzinfo is None:
            expires_at = expires_at.replace(tzinfo=_UTC)
    return RwRow(
        bool(granted),
        str(kind),
        str(mode),
        str(token),
        str(owner),
        int(fence),
        expires_at,
        expires_in,
        int(holders),
    )


class SQLiteRw(RwStatements):
    param = ":{}"

    def __init__(self, store: Store) -> None:
        super().__init__(store)

        self.now_sql = SQLITE_NOW
        t = self.t
        names = store.names
        fence = f"(SELECT value + 1 FROM {store.quoted(names.fence_table)} WHERE id = 1)"
        cols = f"kind, mode, token, owner, fence, expires_at, holders, {SQLITE_NOW}"
        insert = (
            f"INSERT INTO {t} (lock_key, slot, kind, mode, holders, owner, token, fence, "
            f"acquired_at, expires_at) SELECT :key, '', 'rw', :mode, 1, :owner, :token, "
            f"{fence}, {SQLITE_NOW}, {SQLITE_NOW} + :ttl "
        )
        expired = f"{t}.expires_at <= {SQLITE_NOW}"
        reset = f"({expired} OR {t}.mode <> 'read' OR {t}.holders <= 0)"
        self._read_sql = (
            insert + f"WHERE NOT EXISTS (SELECT 1 FROM {t} AS w WHERE w.lock_key = :key "
            f"AND w.slot > '' AND w.mode = 'waiting' AND w.expires_at > {SQLITE_NOW}) "
            f"ON CONFLICT (lock_key, slot) DO UPDATE SET mode = 'read', fence = excluded.fence, "
            f"holders = CASE WHEN {reset} THEN 1 ELSE {t}.holders + 1 END, "
            f"token = CASE WHEN {reset} THEN excluded.token ELSE {t}.token END, "
            f"owner = CASE WHEN {reset} THEN excluded.owner ELSE {t}.owner END, "
            f"acquired_at = CASE WHEN {reset} THEN excluded.acquired_at "
            f"ELSE {t}.acquired_at END, "
            f"expires_at = CASE WHEN {expired} THEN excluded.expires_at "
            f"ELSE max({t}.expires_at, excluded.expires_at) END "
            f"WHERE {t}.kind = 'rw' AND ({expired} OR {t}.mode = 'read') "
            f"RETURNING true, {cols}"
        )
        self._write_sql = (
            insert + "WHERE true ON CONFLICT (lock_key, slot) DO UPDATE SET "
            "mode = 'write', holders = 1, owner = excluded.owner, token = excluded.token, "
            "fence = excluded.fence, acquired_at = excluded.acquired_at, "
            "expires_at = excluded.expires_at "
            f"WHERE {t}.kind = 'rw' AND ({expired} OR ({t}.mode = 'read' AND {t}.holders <= 0)) "
            f"RETURNING true, {cols}"
        )
        head = "lock_key = :key AND slot = '' AND token = :token"
        self._delete_last_sql = f"DELETE FROM {t} WHERE {head} AND mode = 'read' AND holders <= 1"
        self._decrement_sql = (
            f"UPDATE {t} SET holders = holders - 1, expires_at = CASE WHEN holders <= 1 "
            f"THEN {SQLITE_NOW} ELSE expires_at END WHERE {head} AND mode = 'read' AND holders > 0"
        )
        self._release_write_sql = f"DELETE FROM {t} WHERE {head} AND mode = 'write'"
        self._downgrade_sql = (
            f"UPDATE {t} SET mode = 'read', holders = 1 WHERE {head} AND mode = 'write'"
        )
        self._intent_sql = (
            f"INSERT INTO {t} (lock_key, slot, kind, mode, holders, owner, token, fence, "
            f"acquired_at, expires_at) VALUES (:key, :slot, 'rw', 'waiting', 0, :owner, "
            f":token, 0, {SQLITE_NOW}, {SQLITE_NOW} + :ttl) "
            f"ON CONFLICT (lock_key, slot) DO UPDATE SET expires_at = excluded.expires_at"
        )
        self._drop_intent_sql = f"DELETE FROM {t} WHERE lock_key = :key AND slot = :slot"
        self._holder_sql = f"SELECT false, {cols} FROM {t} WHERE lock_key = :key AND slot = ''"
        self._intent_there_sql = f"SELECT 1 FROM {t} WHERE lock_key = :key AND slot = :slot"
        self._now = SQLITE_NOW
        # Another connection holding the file's write lock: a grant (or a
        # writer's intent) answers "held" within the exclusive lock's bound,
        # a release or downgrade gives up after its (see SQLiteStore.retry).
        from .sqlite import SQLiteStore

        self._sqlite = store if isinstance(store, SQLiteStore) else None
        if self._sqlite is not None:
            self._sqlite.bound_busy(
                acquire=[self._read_sql, self._write_sql, self._intent_sql, self._drop_intent_sql],
                release=[
                    self._delete_last_sql,
                    self._decrement_sql,
                    self._release_write_sql,
                    self._downgrade_sql,
                ],
            )

    def _locked(self, result: Result) -> RwRow | None:
        """A grant that found the file's write lock taken by another
        connection (nothing written): held by it, for how long unknown."""
        from .sqlite import file_was_locked

        if self._sqlite is None or not file_was_locked(result):
            return None
        never = datetime.fromtimestamp(0, _UTC)
        return RwRow(False, "rw", "", "", self._sqlite.busy_holder, 0, never, float("inf"), 0)

    def grant_steps(
        self, mode: str, key: str, token: str, owner: str, ttl: float
    ) -> Steps[RwRow | None]:
        sql = self._read_sql if mode == READ else self._write_sql
        params = {"key": key, "mode": mode, "token": token, "owner": owner, "ttl": ttl}
        result = yield sql, params, True, False
        rows = result.rows
        if rows:
            return _row(rows[0])
        return self._locked(result) or (yield from self.holder_steps(key))

    def release_read_steps(self, key: str, epoch: str) -> Steps[bool]:
        params = {"key": key, "token": epoch}
        if (yield self._delete_last_sql, params, False, False).rowcount:
            return True
        return (yield self._decrement_sql, params, False, False).rowcount > 0

    def release_write_steps(self, key: str, token: str) -> Steps[bool]:
        params = {"key": key, "token": token}
        return (yield self._release_write_sql, params, False, False).rowcount > 0

    def downgrade_steps(self, key: str, token: str) -> Steps[bool]:
        params = {"key": key, "token": token}
        return (yield self._downgrade_sql, params, False, False).rowcount > 0

    def intent_steps(self, key: str, token: str, owner: str, ttl: float) -> Steps[None]:
        params = {"key": key, "slot": _intent_slot(token), "token": token, "owner": owner}
        yield self._intent_sql, {**params, "ttl": ttl}, False, False

    def drop_intent_steps(self, key: str, token: str) -> Steps[None]:
        params = {"key": key, "slot": _intent_slot(token)}
        result = yield self._drop_intent_sql, params, False, False
        # The file's write lock taken by another connection: the acquire's
        # own time is not spent on it. Said (a warning) only if the row is
        # there: it holds new readers back until its lease ends.
        if (
            self._sqlite is not None
            and self._locked(result) is not None
            and (yield self._intent_there_sql, params, True, False).rows
        ):
            raise self._sqlite.file_locked(RuntimeError("database is locked"), None)

    def renew(self, locks: Sequence[tuple[str, str, float]]) -> dict[str, Lease]:
        params: dict[str, object] = {}
        values = []
        for i, (key, token, ttl) in enumerate(locks):
            params[f"k{i}"], params[f"t{i}"], params[f"l{i}"] = key, token, ttl
            values.append(f"(:k{i}, :t{i}, :l{i})")
        t, now = self.t, self._now
        rows = self.store.run(
            f"UPDATE {t} SET expires_at = CASE WHEN {t}.mode = 'read' THEN "
            f"max({t}.expires_at, {now} + v.column3) ELSE {now} + v.column3 END "
            f"FROM (VALUES {', '.join(values)}) AS v "
            f"WHERE {t}.lock_key = v.column1 AND {t}.slot = '' AND {t}.token = v.column2 "
            f"RETURNING token, expires_at, {now}",
            params,
            fetch=True,
        ).rows
        return {
            token: Lease(datetime.fromtimestamp(expires_at, _UTC), expires_at - now - 0.001)
            for token, expires_at, now in rows
        }

    def holder_steps(self, key: str) -> Steps[RwRow | None]:
        rows = (yield self._holder_sql, {"key": key}, True, False).rows
        return _row(rows[0]) if rows else None


class MySQLRw(RwStatements):
    """MariaDB 10.5+ (``INSERT … ON DUPLICATE KEY UPDATE … RETURNING``).

    ``ON DUPLICATE KEY UPDATE`` assigns left to right, each assignment seeing
    the ones before it. So the decision is recorded first, in two columns
    whose new values are unique: ``token`` takes the new epoch exactly when
    the read phase starts afresh (``reset``), ``fence`` takes the freshly drawn
    ``AUTO_INCREMENT`` value exactly when the request is granted; every later
    assignment tests those two instead of the columns it changes."""

    now_sql = "UTC_TIMESTAMP(6)"

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        t = self.t
        now = "UTC_TIMESTAMP(6)"
        lease = f"{now} + INTERVAL %(ttl_us)s MICROSECOND"
        cols = f"kind, mode, token, owner, fence, expires_at, holders, {now}"
        insert = (
            f"INSERT INTO {t} (lock_key, slot, kind, mode, holders, owner, token, "
            f"acquired_at, expires_at) SELECT %(key)s, '', 'rw', %(mode)s, 1, %(owner)s, "
            f"%(token)s, {now}, {lease} FROM DUAL "
        )
        expired = f"expires_at <= {now}"
        # Assigned only where the grant is decided, so reset implies granted.
        reset = f"({expired} OR (mode = 'read' AND holders <= 0))"
        granted = "fence = VALUES(fence)"
        fresh = "token = VALUES(token)"
        self._read_sql = (
            insert + f"WHERE NOT EXISTS (SELECT 1 FROM {t} AS w WHERE w.lock_key = %(key)s "
            f"AND w.slot > '' AND w.mode = 'waiting' AND w.expires_at > {now}) "
            f"ON DUPLICATE KEY UPDATE "
            f"token = IF(kind = 'rw' AND {reset}, VALUES(token), token), "
            f"fence = IF(kind = 'rw' AND ({expired} OR mode = 'read'), VALUES(fence), fence), "
            f"owner = IF({fresh}, VALUES(owner), owner), "
            f"acquired_at = IF({fresh}, VALUES(acquired_at), acquired_at), "
            f"holders = IF({fresh}, 1, IF({granted}, holders + 1, holders)), "
            f"mode = IF({granted}, 'read', mode), "
            f"expires_at = IF({granted}, IF({expired}, VALUES(expires_at), "
            f"GREATEST(expires_at, VALUES(expires_at))), expires_at) "
            f"RETURNING 0, {cols}"
        )
        self._write_sql = (
            insert + "WHERE true ON DUPLICATE KEY UPDATE "
            f"token = IF(kind = 'rw' AND ({expired} OR (mode = 'read' AND holders <= 0)), "
            f"VALUES(token), token), "
            f"fence = IF({fresh}, VALUES(fence), fence), "
            f"owner = IF({fresh}, VALUES(owner), owner), "
            f"acquired_at = IF({fresh}, VALUES(acquired_at), acquired_at), "
            f"holders = IF({fresh}, 1, holders), "
            f"mode = IF({fresh}, 'write', mode), "
            f"expires_at = IF({fresh}, VALUES(expires_at), expires_at) "
            f"RETURNING 0, {cols}"
        )
        head = "lock_key = %(key)s AND slot = '' AND token = %(token)s"
        self._delete_last_sql = f"DELETE FROM {t} WHERE {head} AND mode = 'read' AND holders <= 1"
        self._decrement_sql = (
            f"UPDATE {t} SET expires_at = IF(holders <= 1, {now}, expires_at), "
            f"holders = holders - 1 WHERE {head} AND mode = 'read' AND holders > 0"
        )
        self._release_write_sql = f"DELETE FROM {t} WHERE {head} AND mode = 'write'"
        self._downgrade_sql = (
            f"UPDATE {t} SET mode = 'read', holders = 1 WHERE {head} AND mode = 'write'"
        )
        # INSERT … VALUES: a "simple insert" takes no table-level AUTO-INC lock.
        self._intent_sql = (
            f"INSERT INTO {t} (lock_key, slot, kind, mode, holders, owner, token, "
            f"acquired_at, expires_at) VALUES (%(key)s, %(slot)s, 'rw', 'waiting', 0, "
            f"%(owner)s, %(token)s, {now}, {lease}) "
            f"ON DUPLICATE KEY UPDATE expires_at = VALUES(expires_at)"
        )
        self._drop_intent_sql = f"DELETE FROM {t} WHERE lock_key = %(key)s AND slot = %(slot)s"
        self._holder_sql = f"SELECT 0, {cols} FROM {t} WHERE lock_key = %(key)s AND slot = ''"
        self._now = now
        # Galera (rw_statements read the capabilities first): the grants carry
        # the exclusive INSERT's prefix, since their RETURNING rows tell the
        # client it won: no silent re-run after a lost certification (the
        # store's retry runs the statement again, up to three times, then the
        # 1213 counts as busy), and every transaction committed anywhere
        # before is applied first, so the head row read is current. Every
        # grant, release and expiry writes the head row, so certification
        # lets only one of two racing nodes' decisions on it commit (two
        # readers racing on two nodes: the loser runs again and joins). The
        # read grant is ``once``: an answer the driver cannot decode (a
        # brute-force abort as it ran; seen committed) is not run again by the
        # store, the locker reads the head row instead (a second run would
        # join its own read phase: a count nobody releases).
        galera: Any = getattr(store, "for_galera", None)
        if galera is not None:
            self._read_sql = galera(self._read_sql, write=True, once=True)
            self._write_sql = galera(self._write_sql, write=True)
            self._holder_sql = galera(self._holder_sql, read=True)
            self._waiting_sql = galera(self._waiting_statement(), read=True)
        # Galera, and InnoDB without its AUTO-INC lock: a write grant's fence
        # drawn again once the row is ours (see _redraw_steps). A row that
        # was gone meanwhile is inserted as a dead read phase (expired, no
        # holders: nobody waits for it) and deleted.
        self._redraw = store.dialect.redraws_fences and galera is not None
        if self._redraw:
            self._redraw_sql = galera(
                f"INSERT INTO {t} (lock_key, slot, kind, mode, holders, owner, token, "
                f"acquired_at, expires_at) VALUES (%(key)s, '', 'rw', 'read', 0, %(owner)s, "
                f"%(token)s, {now}, {now}) ON DUPLICATE KEY UPDATE "
                f"fence = IF(kind = 'rw' AND mode = 'write' AND token = %(token)s, "
                f"VALUES(fence), fence) RETURNING 0, {cols}",
                write=True,
            )
            self._drop_dead_sql = f"DELETE FROM {t} WHERE {head} AND mode = 'read' AND holders <= 0"

    def grant_steps(
        self, mode: str, key: str, token: str, owner: str, ttl: float
    ) -> Steps[RwRow | None]:
        sql = self._read_sql if mode == READ else self._write_sql
        params = {
            "key": key,
            "mode": mode,
            "token": token,
            "owner": owner,
            "ttl_us": round(ttl * 1e6),
        }
        rows = (yield sql, params, True, False).rows
        if not rows:
            return (yield from self.holder_steps(key))
        row = _row(rows[0])
        # RETURNING cannot read VALUES(): tell a grant by the row it left. A
        # reader is refused only by a live write hold or another kind (a live
        # read phase is always joined); a writer's grant carries its token.
        if mode == READ:
            row.granted = row.kind == "rw" and row.mode == READ
        else:
            row.granted = row.token == token and row.mode == WRITE
            if row.granted and self._redraw:
                return (yield from self._redraw_steps(params))
        return row

    def _redraw_steps(self, params: dict[str, Any]) -> Steps[RwRow]:
        """Galera runs InnoDB with ``innodb_autoinc_lock_mode=2``: the write
        grant's ``INSERT`` draws its ``AUTO_INCREMENT`` before it finds the
        key free, with no lock over the two, so a statement stalled between
        them while other nodes took and let go of the key wrote an older
        fence (seen with the server thread held under a debugger). Drawn
        again while the row is ours, the fence is above every earlier
        holder's (as :meth:`MySQLStore._ours` does for the exclusive lock;
        a read grant's ``INSERT … SELECT`` takes gap locks that the other
        node's rows, applied here, break: it is run again, a new draw). A
        row gone meanwhile (its lease ran out, taken and let go) is not a
        grant: the writer waits on."""
        rows = (yield self._redraw_sql, params, True, False).rows
        row = _row(rows[0])
        row.granted = row.token == params["token"] and row.mode == WRITE
        if not row.granted and row.token == params["token"]:
            yield self._drop_dead_sql, params, False, False
            row.expires_in = 0.0  # look again now
        return row

    def release_read_steps(self, key: str, epoch: str) -> Steps[bool]:
        params = {"key": key, "token": epoch}
        if (yield self._delete_last_sql, params, False, False).rowcount:
            return True
        return (yield self._decrement_sql, params, False, False).rowcount > 0

    def release_write_steps(self, key: str, token: str) -> Steps[bool]:
        params = {"key": key, "token": token}
        return (yield self._release_write_sql, params, False, False).rowcount > 0

    def downgrade_steps(self, key: str, token: str) -> Steps[bool]:
        # Found rows, not changed ones (CLIENT_FOUND_ROWS): a match is ours.
        params = {"key": key, "token": token}
        return (yield self._downgrade_sql, params, False, False).rowcount > 0

    def intent_steps(self, key: str, token: str, owner: str, ttl: float) -> Steps[None]:
        params = {
            "key": key,
            "slot": _intent_slot(token),
            "token": token,
            "owner": owner,
            "ttl_us": round(ttl * 1e6),
        }
        yield self._intent_sql, params, False, False

    def drop_intent_steps(self, key: str, token: str) -> Steps[None]:
        yield self._drop_intent_sql, {"key": key, "slot": _intent_slot(token)}, False, False

    def renew(self, locks: Sequence[tuple[str, str, float]]) -> dict[str, Lease]:
        # Sorted by key, in the order the batches lock rows (see MySQLStore's renewal).
        params: dict[str, object] = {}
        rows_sql = []
        for i, (key, token, ttl) in enumerate(sorted(locks)):
            params[f"k{i}"], params[f"t{i}"], params[f"l{i}"] = key, token, round(ttl * 1e6)
            rows_sql.append(f"SELECT %(k{i})s AS lock_key, %(t{i})s AS token, %(l{i})s AS ttl_us")
        t, now = self.t, self._now
        self.store.run(
            f"UPDATE {t} AS t JOIN ({' UNION ALL '.join(rows_sql)}) AS v "
            f"ON t.lock_key = v.lock_key AND t.slot = '' AND t.token = v.token "
            f"SET t.expires_at = IF(t.mode = 'read', GREATEST(t.expires_at, "
            f"{now} + INTERVAL v.ttl_us MICROSECOND), {now} + INTERVAL v.ttl_us MICROSECOND)",
            params,
        )
        keys = ", ".join(f"%(k{i})s" for i in range(len(locks)))
        rows = self.store.run(
            f"SELECT token, expires_at, {now} FROM {t} WHERE lock_key IN ({keys}) AND slot = ''",
            params,
            fetch=True,
        ).rows
        ours = {token for _, token, _ in locks}
        return {
            token: Lease(expires_at.replace(tzinfo=_UTC), (expires_at - now).total_seconds())
            for token, expires_at, now in rows
            if token in ours
        }

    def holder_steps(self, key: str) -> Steps[RwRow | None]:
        rows = (yield self._holder_sql, {"key": key}, True, False).rows
        return _row(rows[0]) if rows else None


def rw_statements(store: Store) -> RwStatements:
    """The read-write statements for ``store``'s dialect, built once per store."""
    return store.kind_sql(_for_dialect)


def _for_dialect(store: Store) -> RwStatements:
    make: Callable[[Store], RwStatements] = store.dialect.pick(
        postgresql=PostgresRw, mysql=_mysql_rw, sqlite=SQLiteRw
    )
    return make(store)


def _mysql_rw(store: Store) -> RwStatements:
    # The server's facts: one statement, once per store.
    if not store.known_dialect().returning:
        raise DBLockError(
            "read-write locks on the MySQL family need MariaDB 10.5 or later "
            "(INSERT … ON DUPLICATE KEY UPDATE … RETURNING); this server is not"
        )
    return MySQLRw(store)


# ``Result`` is part of the Steps protocol these generators receive.
_ = Result
