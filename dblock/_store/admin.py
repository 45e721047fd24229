"""What the admin side reads from the lock table: rows and counts.

The store's admin operations (``Store.rows``, ``Store.stats``,
``Store.sweep``) return these. Every time in them comes from the database's
clock, including ``now``, the moment the statement ran, so ages and leases
are differences of two database readings and never involve the client clock.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, ClassVar

from ..errors import BackendError
from ..schema import TableNames, to_utc
from .executor import Driver, Steps

log = logging.getLogger("dblock")

__all__ = [
    "LockRow",
    "LockStats",
    "SweepReason",
    "TableAdmin",
    "TableHealth",
    "filter_phrase",
    "lock_row",
    "rows_json",
]

# The columns every admin statement selects (or returns), in this order,
# followed by the database's current time.
COLUMNS = (
    "lock_key, owner, token, fence, acquired_at, expires_at, slot, kind, mode, holders, permits"
)


class SweepReason(enum.Enum):
    """Why the sweeper deletes a row."""

    EXPIRED = "expired"
    """The lease ran out (more than the grace period ago)."""
    MAX_HOLD = "max_hold"
    """Held longer than the configured maximum, lease or not: the safety net."""

    @property
    def column(self) -> str:
        """The column the condition is on (and the batch is ordered by)."""
        return "expires_at" if self is SweepReason.EXPIRED else "acquired_at"


@dataclasses.dataclass(frozen=True, slots=True)
class LockRow:
    """One lock row, read at ``now`` (database time, UTC)."""

    key: str
    owner: str
    token: str
    fence: int
    acquired_at: datetime
    expires_at: datetime
    now: datetime
    #: Which row of the key (``''``: the head row; ``p0``…: semaphore permits; ``q…``: queued).
    slot: str = ""
    #: ``exclusive``, ``rw`` or ``semaphore``.
    kind: str = "exclusive"
    #: What the row stands for within its kind (``exclusive``, ``read``, ``permit``, …).
    mode: str = "exclusive"
    #: rw read phase: shared holds counted on the head row.
    holders: int = 1
    #: semaphore: N, the key's number of permits.
    permits: int | None = None

    @property
    def kind_label(self) -> str:
        """What the row is, for people: ``exclusive``, ``semaphore p1/3``,
        ``rw read x2``, ``exclusive queued q…``."""
        if self.kind == "semaphore":
            return f"semaphore {self.slot}/{self.permits}"
        mode = "" if self.mode == self.kind else f" {self.mode}"
        holders = f" x{self.holders}" if self.kind == "rw" and self.holders != 1 else ""
        slot = f" {self.slot}" if self.slot else ""
        return f"{self.kind}{mode}{holders}{slot}"

    @property
    def age(self) -> float:
        """Seconds since it was acquired."""
        return (self.now - self.acquired_at).total_seconds()

    @property
    def lease_left(self) -> float:
        """Seconds of lease left; negative once it has expired."""
        return (self.expires_at - self.now).total_seconds()

    @property
    def expired(self) -> bool:
        return self.lease_left <= 0

    def as_json(self) -> dict[str, Any]:
        """For ``dblock list --json``: no token (it is the holder's, not the operator's)."""
        return {
            "key": self.key,
            "slot": self.slot,
            "kind": self.kind,
            "mode": self.mode,
            "holders": self.holders,
            "permits": self.permits,
            "owner": self.owner,
            "fence": self.fence,
            "acquired_at": self.acquired_at.isoformat(),
            "expires_at": self.expires_at.isoformat(),
            "age": round(self.age, 6),
            "lease_left": round(self.lease_left, 6),
            "expired": self.expired,
        }


#: Dead rows per live row above which the table is called bloated (and at least
#: :data:`DEAD_ROWS_FLOOR`): a lock table holds a few hundred live rows, so a
#: vacuum that keeps up leaves dead rows of the order of its threshold.
DEAD_PER_LIVE = 20
DEAD_ROWS_FLOOR = 10_000
#: MariaDB/MySQL: undo records not purged yet (InnoDB's history list length)
#: above which purge is called behind.
PURGE_LAG_WARN = 1_000_000


@dataclasses.dataclass(frozen=True, slots=True)
class TableHealth:
    """What the database says of the lock table's storage (``dblock stats``).

    PostgreSQL: its size with indexes, the statistics collector's live and
    dead rows, when (auto)vacuum last ran and whether autovacuum is on for it.
    MariaDB/MySQL: its size (InnoDB's estimate) and the server's purge lag
    (history list length: undo records of committed transactions not yet
    purged, the deleted rows InnoDB still keeps). A figure the database does
    not give (or the user may not read) is None."""

    size_bytes: int | None = None
    live_rows: int | None = None
    dead_rows: int | None = None
    last_autovacuum: datetime | None = None
    last_vacuum: datetime | None = None
    autovacuum_count: int | None = None
    vacuum_count: int | None = None
    #: False when the server's ``autovacuum`` or the table's ``autovacuum_enabled`` is off.
    autovacuum: bool | None = None
    purge_lag: int | None = None

    @property
    def warnings(self) -> list[str]:
        """What an operator should act on (docs/operations.md, "Vacuum and bloat")."""
        out = []
        if self.autovacuum is False:
            out.append(
                "autovacuum is off for this table: dead rows pile up until a VACUUM "
                "(the sweeper vacuums it; see docs/operations.md, Vacuum and bloat)"
            )
        dead, live = self.dead_rows, self.live_rows
        if dead is not None and dead >= DEAD_ROWS_FLOOR and dead > DEAD_PER_LIVE * (live or 0):
            out.append(
                f"{dead} dead rows to {live or 0} live: the table is bloating "
                "(VACUUM it; check autovacuum and the sweeper)"
            )
        if self.purge_lag is not None and self.purge_lag > PURGE_LAG_WARN:
            out.append(
                f"InnoDB purge lags {self.purge_lag} undo records behind "
                "(a long transaction holds it back, or purge cannot keep up)"
            )
        return out

    def summary(self) -> str:
        """One line for people (the Django admin's lock list): what is known."""
        parts = []
        if self.size_bytes is not None:
            parts.append(f"{self.size_bytes / 2**20:.1f} MB with indexes")
        if self.dead_rows is not None:
            parts.append(f"{self.dead_rows} dead rows, {self.live_rows} live")
        if self.autovacuum is not None:
            last = self.last_autovacuum
            parts.append(
                f"autovacuum {'on' if self.autovacuum else 'OFF'}, last "
                + ("never" if last is None else f"{last:%Y-%m-%d %H:%M:%S} UTC")
            )
        if self.purge_lag is not None:
            parts.append(f"InnoDB purge lag {self.purge_lag} undo records")
        return "; ".join(parts)

    def as_json(self) -> dict[str, Any]:
        def iso(value: datetime | None) -> str | None:
            return None if value is None else value.isoformat()

        return {
            "size_bytes": self.size_bytes,
            "live_rows": self.live_rows,
            "dead_rows": self.dead_rows,
            "last_autovacuum": iso(self.last_autovacuum),
            "last_vacuum": iso(self.last_vacuum),
            "autovacuum_count": self.autovacuum_count,
            "vacuum_count": self.vacuum_count,
            "autovacuum": self.autovacuum,
            "purge_lag": self.purge_lag,
            "warnings": self.warnings,
        }


@dataclasses.dataclass(frozen=True, slots=True)
class LockStats:
    """Counts over the whole lock table, and what the database says of its storage."""

    rows: int
    expired: int
    oldest: LockRow | None
    table: TableHealth | None = None

    @property
    def live(self) -> int:
        return self.rows - self.expired

    def as_json(self) -> dict[str, Any]:
        oldest = self.oldest
        out = {
            "rows": self.rows,
            "live": self.live,
            "expired": self.expired,
            "oldest": None if oldest is None else oldest.as_json(),
        }
        if self.table is not None:
            out["storage"] = self.table.as_json()
        return out


def rows_json(rows: Sequence[LockRow]) -> str:
    """What every ``list --json`` prints (``dblock list``, ``flask dblock
    list``, ``manage.py dblock_list``): one JSON array of
    :meth:`LockRow.as_json` objects, in the order given."""
    return json.dumps([row.as_json() for row in rows], indent=2)


def filter_phrase(prefix: str | None, owner: str | None, quote: Callable[[str], str] = repr) -> str:
    """How every release by ``--prefix``/``--owner`` names what it matched
    (``keys starting with 'a:' and held by 'host'``), each value through ``quote``."""
    parts = []
    if prefix is not None:
        parts.append(f"keys starting with {quote(prefix)}")
    if owner is not None:
        parts.append(f"held by {quote(owner)}")
    return " and ".join(parts)


def lock_row(row: Sequence[Any]) -> LockRow:
    """A :class:`LockRow` from ``COLUMNS`` and the database's now, as any dialect returns them."""
    key, owner, token, fence, acquired_at, expires_at = row[:6]
    slot, kind, mode, holders, permits, now = row[6:12]
    return LockRow(
        key=key,
        owner=owner,
        token=token,
        fence=int(fence),
        acquired_at=_utc(acquired_at),
        expires_at=_utc(expires_at),
        now=_utc(now),
        slot=slot,
        kind=kind,
        mode=mode,
        holders=int(holders),
        permits=None if permits is None else int(permits),
    )


def _utc(value: Any) -> datetime:
    converted = to_utc(value)
    if converted is None:
        raise TypeError("a lock row time was NULL")
    return converted


class TableAdmin(Driver):
    """The admin side of a store: ``dblock list`` / ``stats`` / ``release
    --force``, the admin pages and the sweeper (a base of every store, whose
    dialects override :meth:`sweep`, :meth:`table_health` and :meth:`vacuum`).
    Not on the lock's hot path. Every comparison uses the database's clock."""

    names: TableNames
    quoted: Callable[[str], str]

    #: SQL for the database's current time, in the form the dialect stores times.
    now_sql: ClassVar[str] = "CURRENT_TIMESTAMP"
    #: How the DBAPI driver spells a named parameter.
    param_style: ClassVar[str] = "%({})s"
    #: A read that holds its row until the reader's transaction ends, as a
    #: successor's takeover must wait for (None: the dialect has no row
    #: locks, and a no-op UPDATE takes the write lock instead).
    share_lock: ClassVar[str | None] = " FOR SHARE"

    def term_guard(self, key: str, token: str, style: str) -> tuple[str, bool]:
        """A leader's term guard (``dblock.leader.Term.guard``) for the
        application's own transaction: the statement (parameters ``key`` and
        ``token`` spelt by ``style``, ``{}`` for the name, or ``%s``/``?``
        positional) and whether it is an UPDATE (its row count says) or a
        read (a row says). Either holds the term's row until that
        transaction ends, so a successor's takeover waits for its commit."""
        t = self.quoted(self.names.table)
        k, tk = style.format("key"), style.format("token")
        where = (
            f"WHERE lock_key = {k} AND slot = '' AND token = {tk} AND expires_at > {self.now_sql}"
        )
        if self.share_lock is None:
            return f"UPDATE {t} SET token = token {where}", True
        return f"SELECT fence FROM {t} {where}{self.share_lock}", False

    def rows(
        self,
        *,
        key: str | None = None,
        prefix: str | None = None,
        owner: str | None = None,
        limit: int | None = None,
    ) -> list[LockRow]:
        """Lock rows, oldest acquisition first: all of them, the ones of
        ``key``, or those whose key starts with ``prefix`` (taken literally,
        case-sensitive) and are held by ``owner`` (the owner column exactly,
        case, accents and trailing spaces included on every database, or any
        owner under it: ``host:pid`` names every thread of that process,
        ``host`` every process of that host); at most ``limit``."""
        bind = self.param_style.format
        conditions: list[str] = []
        params: dict[str, Any] = {}
        if key is not None:
            conditions.append(f"lock_key = {bind('key')}")
            params["key"] = key
        elif prefix:
            # Not LIKE: its wildcards would need escaping, and SQLite's LIKE ignores case.
            conditions.append(f"substr(lock_key, 1, {len(prefix)}) = {bind('prefix')}")
            params["prefix"] = prefix
        if owner:
            # Exactly that owner (case, accents: the column's binary collation
            # on MySQL/MariaDB since revision 0004; trailing spaces:
            # the lengths, which a PAD SPACE collation ignores), or one under it.
            conditions.append(
                f"((owner = {bind('owner')} AND length(owner) = length({bind('owner')})) "
                f"OR substr(owner, 1, {len(owner) + 1}) = {bind('owner_under')})"
            )
            params.update(owner=owner, owner_under=f"{owner}:")
        where = f"WHERE {' AND '.join(conditions)} " if conditions else ""
        bound = f" LIMIT {int(limit)}" if limit is not None else ""
        sql = (
            f"SELECT {COLUMNS}, {self.now_sql} FROM {self.quoted(self.names.table)} "
            f"{where}ORDER BY acquired_at, lock_key, slot{bound}"
        )
        return [lock_row(r) for r in self.run(sql, params, fetch=True).rows]

    def is_locked_steps(self, key: str) -> Steps[bool]:
        """Whether some row of ``key`` holds it now, by the database's clock:
        an exclusive or fair holder, a read or write phase with holders, a
        semaphore permit; a queued or waiting request holds nothing, and a row
        whose lease ran out is as good as free (the next acquire takes it
        over). One statement."""
        bind = self.param_style.format
        sql = (
            f"SELECT 1 FROM {self.quoted(self.names.table)} WHERE lock_key = {bind('key')} "
            f"AND expires_at > {self.now_sql} AND holders > 0 "
            "AND mode NOT IN ('queued', 'waiting') LIMIT 1"
        )
        return bool((yield sql, {"key": key}, True, False).rows)

    def release_row(self, key: str, slot: str, token: str) -> bool:
        """Delete one row of ``key`` of any kind (``dblock release --force``,
        the admin pages), by its slot and the token read: False if it changed
        hands meanwhile. Waiters are woken as by a release."""
        bind = self.param_style.format
        sql = (
            f"DELETE FROM {self.quoted(self.names.table)} WHERE lock_key = {bind('key')} "
            f"AND slot = {bind('slot')} AND token = {bind('token')}"
        )
        return self.run(sql, {"key": key, "slot": slot, "token": token}).rowcount > 0

    def release_rows(self, rows: Sequence[LockRow]) -> list[LockRow]:
        """Delete ``rows`` as read (each by its slot and token, so a row that
        changed hands since stays) and return those deleted."""
        return [r for r in rows if self.release_row(r.key, r.slot, r.token)]

    def release_key(self, key: str) -> list[LockRow]:
        """Delete every row of ``key`` (each by the token read, so a row that
        changes hands meanwhile stays) and return those deleted."""
        return self.release_rows(self.rows(key=key))

    def stats(self, *, storage: bool = False) -> LockStats:
        """How many rows, how many of them expired, and the oldest; with
        ``storage``, also what the database says of the table's storage
        (:meth:`table_health`: a few more statements, for ``dblock stats``)."""
        sql = (
            f"SELECT count(*), coalesce(sum(CASE WHEN expires_at <= {self.now_sql} "
            f"THEN 1 ELSE 0 END), 0) FROM {self.quoted(self.names.table)}"
        )
        total, expired = self.run(sql, {}, fetch=True).rows[0]
        oldest = self.rows(limit=1)
        health = None
        try:
            health = self.table_health() if storage else None
        except BackendError as exc:
            # A user allowed to read the table but not the server's statistics
            # (MySQL's PROCESS privilege): the counts still stand.
            log.debug("dblock: the lock table's storage figures are unreadable: %s", exc)
        return LockStats(
            rows=int(total),
            expired=int(expired),
            oldest=oldest[0] if oldest else None,
            table=health,
        )

    def table_health(self) -> TableHealth | None:
        """What the database says of the lock table's storage (size, dead rows,
        vacuum; purge lag), or None where it says nothing useful (SQLite)."""
        return None

    def vacuum(self, dead_rows: int) -> bool:
        """PostgreSQL: VACUUM the lock table if it has at least ``dead_rows``
        dead rows (the sweeper's, after a run); True if it did. Elsewhere
        nothing to do (InnoDB's purge and SQLite's free pages need no help)."""
        return False

    def sweep(self, reason: SweepReason, *, older_than: float, limit: int) -> list[LockRow]:
        """Delete at most ``limit`` rows whose ``reason.column`` lies more than
        ``older_than`` seconds in the past (database time), in one short
        statement (or, without RETURNING, a few), and return them as deleted.
        Rows another transaction is changing right now are skipped, not waited for."""
        raise NotImplementedError
