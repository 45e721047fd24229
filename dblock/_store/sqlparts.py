"""SQL a dialect's statement families share: the store's own, the fair
queue's (:mod:`dblock._store.fair`), the read-write lock's and the
semaphore's. Each family builds its statements from these, so none reaches
into another's module, and the dialect modules import the families, never
the other way round."""

from __future__ import annotations

import zlib
from datetime import datetime, timezone

from .base import Grant

__all__ = [
    "BUCKETS",
    "SQLITE_CLOCK_STEP",
    "SQLITE_NOW",
    "lock_class",
    "mysql_grant",
    "notify",
    "sqlite_grant",
    "unnest",
    "waiters_class",
]

_UTC = timezone.utc

# -- PostgreSQL ---------------------------------------------------------------

#: Releases are announced on one channel per key bucket, ``<prefix><n>``
#: with ``n = hashtext(key) & (BUCKETS - 1)`` computed by the notifying
#: statement itself, and a listener LISTENs only to the buckets of the keys
#: its process waits for: it hears its own keys' releases and, of the rest of
#: the cluster, only those of the keys that share their buckets.
BUCKETS = 1024


def notify(key: str, payload: str | None = None) -> str:
    """The SQL that announces ``payload`` (default: the key) on the channel
    of ``key``'s bucket; both are SQL expressions, the channel's prefix is the
    ``channel`` parameter."""
    return f"pg_notify(%(channel)s || (hashtext({key}) & {BUCKETS - 1}), {payload or key})"


def lock_class(table: str) -> int:
    """The advisory lock class of a lock table: its name's CRC-32 as a signed int4."""
    return (zlib.crc32(table.encode()) ^ 0x80000000) - 0x80000000


def key_lock(table: str) -> str:
    """The CTE ``lk`` that takes the key's transaction advisory lock (the
    ``key`` parameter): every PostgreSQL statement that draws a fence for a
    key reads it first, so the draws of one key are made one at a time and
    in the order their statements meet the row (see docs/internals.md,
    Fencing). It comes before any row lock of the statement."""
    return (
        f"lk AS MATERIALIZED (SELECT pg_advisory_xact_lock({lock_class(table)}, hashtext(%(key)s)))"
    )


def waiters_class(table: str) -> int:
    """The advisory lock class in which listeners register the keys their
    process waits for (see the module's docstring)."""
    return lock_class(table + "\x00waiters")


def unnest(*arrays: str) -> str:
    """``unnest`` of array parameters (``"keys::text[]"``), each read through
    a scalar subquery. PostgreSQL plans a prepared statement afresh at every
    run (a custom plan) while that looks cheaper than its one generic plan;
    an array parameter it can see counts its rows exactly, so a batch's
    custom plan always looks cheaper and the statement was planned at every
    run: half a millisecond a batch, as much as its round trip on this
    machine. Hidden in a subquery, the arrays count as the same estimate in
    both plans, and after five runs the generic plan is kept (a batch of 3
    acquires: 1.04 -> 0.60 ms). The plan does not depend on the arrays'
    lengths: each element is one key, looked up by the primary key."""
    parts = []
    for array in arrays:
        name, cast = array.split("::", 1)
        parts.append(f"(SELECT %({name})s::{cast})")
    return f"unnest({', '.join(parts)})"


# -- SQLite -------------------------------------------------------------------

#: The time as a REAL of seconds since the epoch, in the statement itself.
SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
# SQLite's 'now' is truncated to the millisecond, so a lease may start (and
# end) up to this much before the client sent its statement; the holder's
# view of the lease is shortened by as much, so it never outlasts the row's.
SQLITE_CLOCK_STEP = 0.001


def mysql_take_over(t: str, mine: str, now: str) -> str:
    """MySQL/MariaDB: the ``ON DUPLICATE KEY UPDATE`` of an ``INSERT … SELECT``
    that meets a held row and makes it the inserted row's where ``mine`` (a
    condition on the row's token) holds, and leaves it as it was elsewhere:
    a fresh fence (the inserted row's draw), owner, start and lease, and the
    token last (assignments are made left to right, and those before it
    must still see the row's token as it was). Used by the hand-off and the
    fair queue's hand-over."""
    return (
        f"ON DUPLICATE KEY UPDATE "
        f"fence = IF({mine}, VALUES(fence), {t}.fence), "
        f"owner = IF({mine}, VALUES(owner), {t}.owner), "
        f"acquired_at = IF({mine}, {now}, {t}.acquired_at), "
        f"expires_at = IF({mine}, VALUES(expires_at), {t}.expires_at), "
        f"token = IF({mine}, VALUES(token), {t}.token) "
    )


def mysql_grant(
    fence: int, expires_at: datetime, now: datetime, reserve: tuple[int, ...] = ()
) -> Grant:
    """A grant from a MySQL/MariaDB row: its ``DATETIME(6)`` columns come back
    naive (they hold UTC), the lease measured against the statement's own now."""
    return Grant(
        fence, expires_at.replace(tzinfo=_UTC), (expires_at - now).total_seconds(), reserve=reserve
    )


def sqlite_grant(row: tuple[object, ...]) -> Grant:
    fence, expires_at, now = row
    assert isinstance(fence, int)
    # RETURNING hands back a REAL column's whole-number value as an int (SQLite
    # stores those as integers): a lease that ends on a whole second, about
    # one grant in a thousand (its clock counts milliseconds).
    assert isinstance(expires_at, (int, float))
    assert isinstance(now, (int, float))
    expires_at, now = float(expires_at), float(now)
    return Grant(
        fence, datetime.fromtimestamp(expires_at, _UTC), expires_at - now - SQLITE_CLOCK_STEP
    )
