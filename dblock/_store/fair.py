"""The fair queue's statements, one class per dialect (see :mod:`dblock.kinds.fair`).

Rows of one key (schema revision 0002): the head ``slot = ''`` is the holder,
exactly the exclusive lock's row; each waiter has a queue row ``slot = 'q' +
ticket`` (20 digits, ``mode = 'queued'``) carrying its own token and lease.
The ticket is the queue row's ``fence``, drawn from the fence counter, so the
database decides the arrival order. A queue row whose lease ran out is *dead*:
ignored by everyone, never revived (its waiter enqueues again), and swept.

A waiter is granted when its queue row is live, no live queue row has a
smaller ticket, and the head is free (or expired): it takes the head with
the exclusive lock's own upsert and deletes its queue row. The head and the
queue row carry the same token, so releasing (``DELETE … WHERE token``)
removes whatever a request left, and an orphaned token is cleaned up whole.

PostgreSQL does each step in one statement (data-modifying CTEs) and
addresses its wake-ups. A release hands the head to the first live waiter
(its token, a new fence) and notifies ``chr(31) || slot || ' ' || fence``:
only that waiter is woken, and it holds the lock without a statement of its
own; the same statement queues the releasing process's next local thread at
the tail (a :class:`Seat`). A first waiter giving up notifies the next one
(``chr(31) || slot``). With no waiter in sight, the key itself is notified
(like a plain release). SQLite and MySQL/MariaDB use a few statements per
step and their waiters poll; MariaDB's release hands the head over too, in
one statement (see :class:`MySQLFair`), and the waiter finds it at its next look.
"""

from __future__ import annotations

import dataclasses
import time
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, cast

from ..errors import KindMismatch
from .base import Grant, Holder, Result, Steps
from .sqlparts import SQLITE_NOW, key_lock, mysql_grant, mysql_take_over, notify, sqlite_grant

if TYPE_CHECKING:
    from .base import Store
    from .postgresql import PostgresStore

__all__ = [
    "DROPPED",
    "Dropped",
    "FairSQL",
    "MySQLFair",
    "PostgresFair",
    "Queued",
    "SQLiteFair",
    "Seat",
    "address",
    "poll_cap",
]

_UTC = timezone.utc
#: Queue rows' slots lie between these (``'q'`` + 20 digits; MySQL's are
#: ``'q~'`` + token: its ticket is only known once the row is in).
_Q = "slot > 'q' AND slot < 'r'"
#: Prefix of a notification addressed to one waiter (no key starts with it
#: in practice; if one did, its waiters would only wake once for nothing).
ADDRESS_MARK = "\x1f"


def address(ticket: int) -> str:
    """The NOTIFY payload that wakes the waiter holding ``ticket``."""
    return f"{ADDRESS_MARK}q{ticket:020d}"


@dataclasses.dataclass(slots=True)
class Queued:
    """We wait in the queue with ``ticket``, behind someone (``owner``) whose
    lease ends in ``expires_in`` seconds (None: unknown; 0: look again now)."""

    ticket: int
    owner: str | None
    expires_in: float | None
    #: Our own queue row's lease end and seconds left (PostgreSQL, whose
    #: release hands the head over with that lease): None if not read.
    lease: Grant | None = None
    #: Nobody live queues before us: we wait for the holder alone (polling
    #: dialects poll afresh from then on).
    first: bool = False
    #: Polling dialects: how many live waiters queue before us, and how long
    #: the holder has held the head (seconds; None: no holder), which bound
    #: how long we sleep between two looks (see :func:`poll_cap`).
    ahead: int = 0
    held: float | None = None


def poll_cap(queued: Queued, initial: float, cap: float) -> float:
    """The longest a polling waiter sleeps before looking again.

    A waiter only learns that it moved up by looking; with a backoff grown
    while it waited far back, it would notice its turn a whole backoff late,
    and every grant would wait for that. So the sleep is bounded by the
    place in the queue (``initial`` x 2^ahead: the first waiter looks every
    few milliseconds, each one further back half as often), but never below
    a quarter of how long the holder has held the head already (a long hold
    is not polled for at that rate), and never above ``cap``.
    """
    place = initial / 4 * (1 << min(queued.ahead, 16))
    held = 0.0 if queued.held is None else queued.held / 4
    return min(cap, max(place, held))


@dataclasses.dataclass(slots=True)
class Seat:
    """A place in the queue that a release took for the next local thread in
    the same statement (PostgreSQL): its token, its ticket, its queue row's
    lease, and when that statement was sent."""

    token: str
    ticket: int
    lease: Grant
    sent_at: float


class Dropped:
    """Our queue row was gone or dead (we were paused past its lease, or it
    was swept): we have lost our place."""

    __slots__ = ()


DROPPED = Dropped()


class FairSQL:
    """What the fair acquire loop asks the database, written as :data:`Steps`:
    one subclass per dialect, built once per store by :func:`fair_sql`."""

    @property
    def seats_on_release(self) -> bool:
        """A release can queue the next local thread in the same statement."""
        return False

    def __init__(self, store: Store) -> None:
        self.store = store
        self.t = store.quoted(store.names.table)

    def enter_steps(
        self, key: str, token: str, owner: str, ttl: float, *, enqueue: bool
    ) -> Steps[Grant | Holder | Queued]:
        """Take the head if nobody holds it and nobody queues; else (if
        ``enqueue``) join the queue. :class:`Holder` when not enqueued."""
        raise NotImplementedError

    def turn_steps(
        self, key: str, token: str, ticket: int, owner: str, ttl: float
    ) -> Steps[Grant | Queued | Dropped]:
        """Our turn yet? Take the head if so; else renew our queue row."""
        raise NotImplementedError

    def leave_steps(self, key: str, token: str) -> Steps[bool]:
        """Delete every row of ours (the head, the queue row) and wake the
        next waiter; True if the head was among them (a release)."""
        raise NotImplementedError

    def release_steps(self, key: str, token: str, *, queued: bool = True) -> Steps[bool]:
        """Release the head we hold (True if it was ours): by default as
        :meth:`leave_steps`. ``queued``: the head came from the queue (others
        likely queue behind), which a dialect may use to hand it on."""
        return (yield from self.leave_steps(key, token))

    def handed(self, address: str) -> int | None:
        """The fence of a head handed to the waiter at ``address`` by its
        predecessor's release, if the wake-up said so (PostgreSQL)."""
        return None

    def release_seating_steps(
        self, key: str, token: str, seat_token: str, owner: str, ttl: float, *, queued: bool = True
    ) -> Steps[tuple[bool, Grant | None]]:
        """Release the head and queue the next local thread (``seat_token``)
        at the tail; its queue row's lease (``fence`` = its ticket), or None.
        ``queued`` as for :meth:`release_steps`."""
        raise NotImplementedError


class PostgresFair(FairSQL):
    @property
    def seats_on_release(self) -> bool:
        return True

    def __init__(self, store: Store) -> None:
        super().__init__(store)

        t = self.t
        seq = store.quoted(store.names.sequence).replace("'", "''")
        lease = "now() + make_interval(secs => %(ttl)s)"
        lk = key_lock(store.names.table)
        # The exclusive lock's upsert of the head, from a one-row source.
        head = (
            f"head AS (INSERT INTO {t} AS t (lock_key, slot, owner, token, fence, "
            f"acquired_at, expires_at) "
            f"SELECT %(key)s, '', %(owner)s, %(token)s, nextval('{seq}'), now(), {lease} "
            "FROM {source} "
            f"ON CONFLICT (lock_key, slot) DO UPDATE SET owner = excluded.owner, "
            f"token = excluded.token, fence = excluded.fence, "
            f"acquired_at = excluded.acquired_at, expires_at = excluded.expires_at "
            f"WHERE t.expires_at <= now() AND t.kind = 'exclusive' "
            f"RETURNING t.fence, t.expires_at)"
        )
        live_q = f"lock_key = %(key)s AND {_Q} AND expires_at > now()"
        self._enter_sql = (
            f"WITH {lk}, "
            f"busy AS MATERIALIZED (SELECT EXISTS (SELECT FROM {t} WHERE {live_q}) AS b FROM lk), "
            + head.format(source="busy WHERE NOT busy.b")
            + ", "
            f"tk AS (SELECT nextval('{seq}') AS n FROM lk "
            f"WHERE %(enqueue)s AND NOT EXISTS (SELECT FROM head)), "
            f"enq AS (INSERT INTO {t} (lock_key, slot, owner, token, fence, acquired_at, "
            f"expires_at, mode) "
            f"SELECT %(key)s, 'q' || lpad(n::text, 20, '0'), %(owner)s, %(token)s, n, now(), "
            f"{lease}, 'queued' FROM tk RETURNING fence, expires_at) "
            f"SELECT 'h', fence, expires_at, now(), NULL, NULL FROM head "
            f"UNION ALL SELECT 'q', fence, expires_at, now(), NULL, NULL FROM enq "
            # Who we wait behind: the last live waiter, else the holder.
            f"UNION ALL (SELECT 'b', NULL, expires_at, now(), owner, kind FROM {t} "
            f"WHERE lock_key = %(key)s AND (slot = '' OR ({_Q} AND expires_at > now())) "
            f"AND NOT EXISTS (SELECT FROM head) ORDER BY slot DESC LIMIT 1)"
        )
        me = f"lock_key = %(key)s AND {_Q} AND token = %(token)s"
        self._turn_sql = (
            f"WITH {lk}, "
            f"me AS MATERIALIZED (SELECT fence FROM {t}, lk WHERE {me} AND expires_at > now()), "
            f"ahead AS MATERIALIZED (SELECT owner, expires_at FROM {t} "
            f"WHERE {live_q} AND fence < %(ticket)s ORDER BY fence DESC LIMIT 1), "
            + head.format(source="me WHERE NOT EXISTS (SELECT FROM ahead)")
            + ", "
            f"gone AS (DELETE FROM {t} WHERE {me} AND EXISTS (SELECT FROM head)), "
            f"kept AS (UPDATE {t} SET expires_at = {lease} WHERE {me} AND expires_at > now() "
            f"AND NOT EXISTS (SELECT FROM head) RETURNING fence, expires_at) "
            f"SELECT 'h', fence, expires_at, now(), NULL, NULL FROM head "
            f"UNION ALL SELECT 'm', fence, expires_at, now(), NULL, NULL FROM kept "
            # Handed to us by the holder's release (its wake-up was missed).
            f"UNION ALL SELECT 'o', fence, expires_at, now(), NULL, NULL FROM {t} "
            f"WHERE lock_key = %(key)s AND slot = '' AND token = %(token)s "
            f"AND NOT EXISTS (SELECT FROM head) "
            f"UNION ALL SELECT 'b', NULL, expires_at, now(), owner, NULL FROM ahead "
            f"UNION ALL SELECT 'b', NULL, expires_at, now(), owner, kind FROM {t} "
            f"WHERE lock_key = %(key)s AND slot = '' AND NOT EXISTS (SELECT FROM ahead) "
            f"AND NOT EXISTS (SELECT FROM head)"
        )
        # Wake the first live waiter if we held the head or were the first
        # waiter; the key itself when we held the head and saw no waiter.
        self._leave_sql = (
            f"WITH gone AS (DELETE FROM {t} WHERE lock_key = %(key)s AND token = %(token)s "
            f"RETURNING slot, fence), "
            f"g AS (SELECT min(slot) AS slot, min(fence) AS fence FROM gone), "
            f"nxt AS (SELECT slot FROM {t} WHERE {live_q} AND token <> %(token)s "
            f"ORDER BY fence LIMIT 1) "
            f"SELECT g.slot = '', (SELECT "
            + notify("%(key)s", "coalesce(chr(31) || (SELECT slot FROM nxt), %(key)s)")
            + " "
            f"WHERE g.slot = '' OR (EXISTS (SELECT FROM nxt) AND NOT EXISTS ("
            f"SELECT FROM {t} WHERE {live_q} AND fence < g.fence AND token <> %(token)s))) "
            f"FROM g WHERE g.slot IS NOT NULL"
        )
        # The holder's release hands the head to the first live waiter (its
        # token, owner and queue lease; a fresh fence) in the same statement,
        # deletes that waiter's queue row, and tells it the fence in the
        # wake-up: the next grant costs no statement of its own. The queue
        # row's DELETE decides: a waiter leaving at that instant keeps it
        # (the DELETE finds nothing) and the head is released instead.
        # Every wake-up goes to the key's bucket, where its waiter listens.
        handed = "chr(31) || slot || ' ' || fence"
        self._release_sql = (
            f"WITH {lk}, "
            f"mine AS MATERIALIZED (SELECT FROM {t}, lk WHERE lock_key = %(key)s AND slot = '' "
            f"AND token = %(token)s), "
            f"nxt AS MATERIALIZED (SELECT slot, token FROM {t}, mine WHERE {live_q} "
            f"AND token <> %(token)s ORDER BY fence LIMIT 1), "
            f"dq AS (DELETE FROM {t} WHERE lock_key = %(key)s AND slot = (SELECT slot FROM nxt) "
            f"AND token = (SELECT token FROM nxt) RETURNING slot, token, owner, expires_at), "
            f"moved AS (UPDATE {t} AS t SET token = dq.token, owner = dq.owner, "
            f"fence = nextval('{seq}'), acquired_at = now(), expires_at = dq.expires_at "
            f"FROM dq WHERE t.lock_key = %(key)s AND t.slot = '' AND t.token = %(token)s "
            f"RETURNING t.fence, dq.slot), "
            f"gone AS (DELETE FROM {t} WHERE lock_key = %(key)s AND token = %(token)s "
            f"AND NOT EXISTS (SELECT FROM moved) RETURNING slot), "
            # The next thread of this process, queued at the tail (seat).
            f"tk AS (SELECT nextval('{seq}') AS n FROM lk WHERE %(seat)s), "
            f"enq AS (INSERT INTO {t} (lock_key, slot, owner, token, fence, acquired_at, "
            f"expires_at, mode) "
            f"SELECT %(key)s, 'q' || lpad(n::text, 20, '0'), %(owner2)s, %(token2)s, n, now(), "
            f"now() + make_interval(secs => %(ttl2)s), 'queued' FROM tk "
            f"RETURNING fence, expires_at) "
            f"SELECT EXISTS (SELECT FROM moved) OR EXISTS (SELECT FROM gone WHERE slot = ''), "
            f"(SELECT {notify('%(key)s', handed)} FROM moved), "
            f"(SELECT {notify('%(key)s')} WHERE EXISTS "
            f"(SELECT FROM gone WHERE slot = '')), "
            f"(SELECT fence FROM enq), (SELECT expires_at FROM enq), now()"
        )
        self._mine_sql = (
            f"SELECT fence, expires_at, now() FROM {t} "
            f"WHERE lock_key = %(key)s AND slot = '' AND token = %(token)s"
        )
        self._channel = store.names.channel_prefix

    def release_steps(self, key: str, token: str, *, queued: bool = True) -> Steps[bool]:
        released, _ = yield from self._release(key, token, None, "", 1.0)
        return released

    def release_seating_steps(
        self, key: str, token: str, seat_token: str, owner: str, ttl: float, *, queued: bool = True
    ) -> Steps[tuple[bool, Grant | None]]:
        return (yield from self._release(key, token, seat_token, owner, ttl))

    def _release(
        self, key: str, token: str, seat_token: str | None, owner: str, ttl: float
    ) -> Steps[tuple[bool, Grant | None]]:
        params = {
            "key": key,
            "token": token,
            "channel": self._channel,
            "seat": seat_token is not None,
            "token2": seat_token or "",
            "owner2": owner,
            "ttl2": ttl,
        }
        rows = (yield self._release_sql, params, True, False).rows
        released, _, _, ticket, expires_at, now = rows[0]
        if ticket is None:
            return bool(released), None
        return bool(released), Grant(ticket, expires_at, (expires_at - now).total_seconds())

    def handed(self, address: str) -> int | None:
        listener = cast("PostgresStore", self.store).made_listener
        return None if listener is None else listener.take_handed(address)

    def enter_steps(
        self, key: str, token: str, owner: str, ttl: float, *, enqueue: bool
    ) -> Steps[Grant | Holder | Queued]:
        params = {"key": key, "owner": owner, "token": token, "ttl": ttl, "enqueue": enqueue}
        rows = (yield self._enter_sql, params, True, False).rows
        ticket: int | None = None
        lease: Grant | None = None
        blocker: Holder = Holder(None, None, None)
        for tag, fence, expires_at, now, who, kind in rows:
            if tag == "h":
                return Grant(fence, expires_at, (expires_at - now).total_seconds())
            if tag == "q":
                ticket = fence
                lease = Grant(fence, expires_at, (expires_at - now).total_seconds())
            else:
                _check_kind(key, kind)
                blocker = Holder(who, None, (expires_at - now).total_seconds())
        if ticket is None:
            return blocker
        wait = blocker.expires_in if blocker.owner else 0.0
        return Queued(ticket, blocker.owner, wait, lease)

    def turn_steps(
        self, key: str, token: str, ticket: int, owner: str, ttl: float
    ) -> Steps[Grant | Queued | Dropped]:
        params = {"key": key, "owner": owner, "token": token, "ttl": ttl, "ticket": ticket}
        rows = (yield self._turn_sql, params, True, False).rows
        lease: Grant | None = None
        blocker: Queued = Queued(ticket, None, 0.0)
        for tag, fence, expires_at, now, who, kind in rows:
            if tag in ("h", "o"):
                return Grant(fence, expires_at, (expires_at - now).total_seconds())
            if tag == "m":
                lease = Grant(fence, expires_at, (expires_at - now).total_seconds())
            else:
                _check_kind(key, kind)
                blocker = Queued(ticket, who, (expires_at - now).total_seconds())
        if lease is None:
            # Our row went while this statement ran: perhaps a release handed
            # us the head (its commit came after our snapshot). Look again.
            found = (yield self._mine_sql, params, True, False).rows
            if not found:
                return DROPPED
            fence, expires_at, now = found[0]
            return Grant(fence, expires_at, (expires_at - now).total_seconds())
        blocker.lease = lease
        return blocker

    def leave_steps(self, key: str, token: str) -> Steps[bool]:
        params = {"key": key, "token": token, "channel": self._channel}
        rows = (yield self._leave_sql, params, True, False).rows
        return bool(rows) and bool(rows[0][0])


class SQLiteFair(FairSQL):
    def __init__(self, store: Store) -> None:
        super().__init__(store)
        now = SQLITE_NOW

        t = self.t
        fence = f"(SELECT value + 1 FROM {store.quoted(store.names.fence_table)} WHERE id = 1)"
        live_q = f"lock_key = :key AND {_Q} AND expires_at > {now}"
        me = f"lock_key = :key AND {_Q} AND token = :token"
        # An expired exclusive head is taken over; a live one is left alone.
        takeover = (
            f"ON CONFLICT (lock_key, slot) DO UPDATE SET owner = excluded.owner, "
            f"token = excluded.token, fence = excluded.fence, "
            f"acquired_at = excluded.acquired_at, expires_at = excluded.expires_at "
            f"WHERE {t}.expires_at <= excluded.acquired_at AND {t}.kind = 'exclusive' "
        )
        head = (
            f"INSERT INTO {t} (lock_key, slot, owner, token, fence, acquired_at, expires_at) "
            f"SELECT :key, '', :owner, :token, {fence}, {now}, {now} + :ttl WHERE {{cond}} "
            f"{takeover}RETURNING fence, expires_at, acquired_at"
        )
        self._head_if_empty_sql = head.format(cond=f"NOT EXISTS (SELECT 1 FROM {t} WHERE {live_q})")
        self._head_if_first_sql = head.format(
            cond=f"EXISTS (SELECT 1 FROM {t} WHERE {me} AND expires_at > {now}) "
            f"AND NOT EXISTS (SELECT 1 FROM {t} WHERE {live_q} AND fence < :ticket)"
        )
        self._enqueue_sql = (
            f"INSERT INTO {t} (lock_key, slot, owner, token, fence, acquired_at, expires_at, mode) "
            f"SELECT :key, 'q' || printf('%020d', n), :owner, :token, n, {now}, {now} + :ttl, "
            f"'queued' FROM (SELECT {fence} AS n) RETURNING fence"
        )
        # A waiting request's entry in one write: the head if nobody queues
        # and it is free (or expired: taken over), else a queue row. (Two
        # writes before, the head's try and the queue row: with SQLite's one
        # writer at a time, each write of a contended key is a grant's cost.)
        free = (
            f"NOT EXISTS (SELECT 1 FROM {t} WHERE {live_q}) AND NOT EXISTS "
            f"(SELECT 1 FROM {t} WHERE lock_key = :key AND slot = '' AND expires_at > {now})"
        )
        self._enter_sql = (
            f"INSERT INTO {t} (lock_key, slot, owner, token, fence, acquired_at, expires_at, mode) "
            f"SELECT :key, CASE WHEN f THEN '' ELSE 'q' || printf('%020d', n) END, :owner, "
            f":token, n, {now}, {now} + :ttl, CASE WHEN f THEN 'exclusive' ELSE 'queued' END "
            f"FROM (SELECT {fence} AS n, {free} AS f) WHERE true "
            f"{takeover}RETURNING slot, fence, expires_at, acquired_at"
        )
        # Our turn, the head free: our queue row becomes the head (a new
        # fence; the update trigger moves the counter), in one write instead
        # of the head's INSERT and the queue row's DELETE. A head there
        # (expired, or taken by a barging plain request since our look)
        # makes the rename a conflict: OR IGNORE skips it, nothing is
        # written, and the two-step path below runs.
        self._rename_sql = (
            f"UPDATE OR IGNORE {t} SET slot = '', mode = 'exclusive', holders = 1, "
            f"fence = {fence}, acquired_at = {now}, expires_at = {now} + :ttl "
            f"WHERE {me} AND expires_at > {now} "
            f"AND NOT EXISTS (SELECT 1 FROM {t} WHERE {live_q} AND fence < :ticket) "
            f"RETURNING fence, expires_at, acquired_at"
        )
        self._renew_sql = (
            f"UPDATE {t} SET expires_at = {now} + :ttl WHERE {me} AND expires_at > {now}"
        )
        self._drop_queued_sql = f"DELETE FROM {t} WHERE {me}"
        # The last live waiter before ticket (or, without one, the holder).
        self._blocker_sql = (
            f"SELECT owner, expires_at - {now}, kind, slot FROM {t} WHERE lock_key = :key AND "
            f"(slot = '' OR ({_Q} AND expires_at > {now} AND fence < :ticket)) "
            f"ORDER BY slot DESC LIMIT 1"
        )
        self._leave_sql = f"DELETE FROM {t} WHERE lock_key = :key AND token = :token RETURNING slot"
        # The head, the live waiters before us, and our own row.
        self._look_sql = (
            f"SELECT slot, owner, expires_at - {now}, kind, token, fence, {now} - acquired_at "
            f"FROM {t} WHERE lock_key = :key AND (slot = '' OR ({_Q} AND fence <= :ticket "
            f"AND (expires_at > {now} OR token = :token)))"
        )
        # Another connection holding the file's write lock: a write of the
        # acquire path answers "held" within the exclusive lock's bound (its
        # steps read it so, see _locked), a release (or a withdrawal from
        # the queue) gives up after its (see SQLiteStore.retry).
        from .sqlite import SQLiteStore

        if isinstance(store, SQLiteStore):
            store.bound_busy(
                acquire=[
                    self._enter_sql,
                    self._head_if_empty_sql,
                    self._head_if_first_sql,
                    self._enqueue_sql,
                    self._rename_sql,
                    self._renew_sql,
                    self._drop_queued_sql,
                ],
                release=[self._leave_sql],
            )

    def _locked(self, result: Result) -> Holder | None:
        """A write of the acquire path found the file's write lock taken by
        another connection (nothing written): held, as the exclusive lock
        answers then."""
        from .sqlite import file_was_locked

        if not file_was_locked(result):
            return None
        return Holder(getattr(self.store, "busy_holder", None), None, None)

    def enter_steps(  # noqa: PLR0911 - each write may find the file locked
        self, key: str, token: str, owner: str, ttl: float, *, enqueue: bool
    ) -> Steps[Grant | Holder | Queued]:

        params: dict[str, Any] = {"key": key, "owner": owner, "token": token, "ttl": ttl}
        if enqueue:
            result = yield self._enter_sql, params, True, False
            entered = result.rows
            if entered:
                slot, ticket, expires_at, now = entered[0]
                if slot == "":
                    return sqlite_grant((ticket, expires_at, now))
                return (yield from self._queued_steps(key, token, ticket, params))
            locked = self._locked(result)
            if locked is not None:  # not queued: the request waits and enters again
                return locked
            # Nothing written: an expired head of another kind. The two steps.
        result = yield self._head_if_empty_sql, params, True, False
        rows = result.rows
        if rows:
            return sqlite_grant(rows[0])
        locked = self._locked(result)
        if locked is not None:
            return locked
        if not enqueue:
            params["ticket"] = 2**63 - 1
            found = (yield self._blocker_sql, params, True, False).rows
            if not found:
                return Holder(None, None, 0.0)
            _check_kind(key, found[0][2])
            return Holder(found[0][0], None, found[0][1])
        result = yield self._enqueue_sql, params, True, False
        locked = self._locked(result)
        if locked is not None:
            return locked
        (ticket,) = result.rows[0]
        return (yield from self._queued_steps(key, token, ticket, params))

    def _queued_steps(
        self, key: str, token: str, ticket: int, params: dict[str, Any]
    ) -> Steps[Queued]:
        """Just queued with ``ticket``: whom we wait behind."""
        params["ticket"] = ticket
        rows = (yield self._look_sql, params, True, False).rows
        look = _Look(key, token, ticket, rows)
        return look.queued() if look.mine else Queued(ticket, None, 0.0)

    def turn_steps(  # noqa: PLR0911 - each write may find the file locked
        self, key: str, token: str, ticket: int, owner: str, ttl: float
    ) -> Steps[Grant | Queued | Dropped]:

        params = {"key": key, "owner": owner, "token": token, "ttl": ttl, "ticket": ticket}
        # Look first (a read: WAL readers never wait for the one writer), and
        # write only to take the head or when our row's lease needs renewing.
        rows = (yield self._look_sql, params, True, False).rows
        look = _Look(key, token, ticket, rows)
        if look.mine is None or look.mine <= 0:
            return DROPPED  # gone, or dead: never revived
        # A write that found the file's write lock taken by another
        # connection wrote nothing: our turn (or our row's renewal) waits
        # for the next look, our row still live.
        if look.due:
            if look.head is None:
                result = yield self._rename_sql, params, True, False
                if result.rows:
                    return sqlite_grant(result.rows[0])
                if self._locked(result) is not None:
                    return look.queued()
            result = yield self._head_if_first_sql, params, True, False
            if result.rows:
                # (Found locked, the queue row stays: it carries our token,
                # so a look skips it as the holder's and the release deletes it.)
                yield self._drop_queued_sql, params, False, False
                return sqlite_grant(result.rows[0])
            if self._locked(result) is not None:
                return look.queued()
        if look.mine < ttl * 2 / 3:
            result = yield self._renew_sql, params, False, False
            if not result.rowcount and self._locked(result) is None:
                return DROPPED
        return look.queued()

    def leave_steps(self, key: str, token: str) -> Steps[bool]:
        rows = (yield self._leave_sql, {"key": key, "token": token}, True, False).rows
        return any(slot == "" for (slot,) in rows)


class MySQLFair(FairSQL):
    """InnoDB's ``AUTO_INCREMENT`` is only known after the INSERT, so a queue
    row's slot is ``'q~' + token`` (not ``'q' + ticket``: renaming it would
    cost a second write per request); the order is the ``fence`` column. The
    head's ``INSERT … SELECT`` takes shared locks on the queue rows it reads,
    so a waiter whose INSERT is not committed yet is waited for, not missed.

    MariaDB (10.5+: RETURNING) outside Galera keeps a granted waiter's queue
    row to its release, which deletes every row of its token (``DELETE … RETURNING``
    tells the head apart): while it lives the row says only what is true
    anyway (everyone else waits; a look does not count it as ahead), and
    the grant saves a statement before its holder may run.

    MariaDB outside Galera, with ``innodb_autoinc_lock_mode`` below 2, also
    hands the head over as PostgreSQL does: the release of a head that came
    from the queue is one ``INSERT … SELECT … ON DUPLICATE KEY UPDATE`` that
    gives our head row the first live waiter's token and owner, its queue
    row's lease and a fresh fence (a bulk insert: drawn under the table's
    AUTO-INC lock, so above every fence of the key before it, and a head
    found gone is inserted for that waiter with a fence above its last
    holder's); it marks our own queue row dead in the same statement (a
    second deletes it), and, if a local thread waits, adds that thread's
    queue row at the tail (a :class:`Seat`). The waiter's next look finds
    the head carrying its token: the grant costs it no write. A waiter
    giving up at that instant deletes the head with its queue row (same
    token): the key is released. With no live waiter the head is deleted
    by a second statement, as a plain release would. Waiters still poll
    (see :func:`poll_cap`): waking them through named locks, as the
    exclusive lock's are, cost more than it saved on two cores (measured:
    90-105 against 133-137 grants/s at 4 processes x 8 threads; each
    wake-up is three thread hops on a saturated machine)."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        t = self.t
        now = "UTC_TIMESTAMP(6)"
        lease = f"{now} + INTERVAL %(ttl_us)s MICROSECOND"
        live_q = f"lock_key = %(key)s AND {_Q} AND expires_at > {now}"
        me = f"lock_key = %(key)s AND {_Q} AND token = %(token)s"
        head = (
            f"INSERT IGNORE INTO {t} (lock_key, slot, owner, token, acquired_at, expires_at) "
            f"SELECT %(key)s, '', %(owner)s, %(token)s, {now}, {lease} FROM DUAL WHERE {{cond}}"
        )
        self._head_if_empty_sql = head.format(cond=f"NOT EXISTS (SELECT 1 FROM {t} WHERE {live_q})")
        self._head_if_first_sql = head.format(
            cond=f"EXISTS (SELECT 1 FROM {t} WHERE {me} AND expires_at > {now}) "
            f"AND NOT EXISTS (SELECT 1 FROM {t} WHERE {live_q} AND fence < %(ticket)s)"
        )
        returning = " RETURNING fence, expires_at, acquired_at"
        # Each head INSERT without and with RETURNING (MariaDB 10.5+).
        self._heads = {
            sql: (sql, sql + returning)
            for sql in (self._head_if_empty_sql, self._head_if_first_sql)
        }
        self._head_sql = (
            f"SELECT token, fence, expires_at, {now}, kind FROM {t} "
            f"WHERE lock_key = %(key)s AND slot = ''"
        )
        self._takeover_sql = (
            f"DELETE FROM {t} WHERE lock_key = %(key)s AND slot = '' AND token = %(token)s "
            f"AND expires_at <= {now} AND kind = 'exclusive'"
        )
        # A plain VALUES insert: InnoDB draws its AUTO_INCREMENT under a
        # short mutex, where an INSERT … SELECT would hold the table's
        # AUTO-INC lock to the statement's end.
        self._enqueue_sql = (
            f"INSERT INTO {t} (lock_key, slot, owner, token, acquired_at, expires_at, mode) "
            f"VALUES (%(key)s, CONCAT('q~', %(token)s), %(owner)s, %(token)s, {now}, {lease}, "
            f"'queued')"
        )
        self._renew_sql = f"UPDATE {t} SET expires_at = {lease} WHERE {me} AND expires_at > {now}"
        self._drop_queued_sql = f"DELETE FROM {t} WHERE {me}"
        self._leave_head_sql = f"DELETE FROM {t} WHERE lock_key = %(key)s AND token = %(token)s"
        self._leave_returning_sql = self._leave_head_sql + " RETURNING slot"
        # As SQLite's: the head, the live waiters before us, and our own row
        # (a consistent read: it takes no lock and waits for nobody).
        self._look_sql = (
            f"SELECT slot, owner, TIMESTAMPDIFF(MICROSECOND, {now}, expires_at) / 1e6, kind, "
            f"token, fence, TIMESTAMPDIFF(MICROSECOND, acquired_at, {now}) / 1e6, expires_at, "
            f"{now} FROM {t} "
            f"WHERE lock_key = %(key)s AND (slot = '' OR ({_Q} AND fence <= %(ticket)s "
            f"AND (expires_at > {now} OR token = %(token)s)))"
        )
        self._plain_heads = dict(self._heads)
        self._plain = (self._enqueue_sql, self._head_sql, self._look_sql)
        self._galera = False
        # The hand-over (see the class docstring). Rows in this order: our
        # own queue row, if the head came from the queue (it meets the row,
        # which ends dead: nobody counts it from the commit on, and we delete
        # it next); the seat's queue row; then the first live waiter's head
        # row, which meets ours. Queue rows first, so the statement takes no
        # lock on the head before it wrote in the queue's range (a waiter's
        # INSERT … SELECT of the head holds shared locks there and may wait
        # for the head). The select is read whole before the first row is
        # written. Every assignment keys on the row's token being ours, and
        # ``token`` goes last (they are made left to right).
        mine = f"{t}.token = %(token)s"
        dead = (
            f"SELECT %(key)s AS lock_key, CONCAT('q~', %(token)s) AS slot, '' AS owner, "
            f"%(token)s AS token, {now} AS acquired_at, "
            f"{now} - INTERVAL 1 MICROSECOND AS expires_at, 'queued' AS mode "
            f"FROM DUAL WHERE %(queued)s"
        )
        seat = (
            f"SELECT %(key)s, CONCAT('q~', %(token2)s), %(owner2)s, %(token2)s, {now}, "
            f"{now} + INTERVAL %(ttl2_us)s MICROSECOND, 'queued' FROM DUAL WHERE %(seat)s"
        )
        first = (
            f"(SELECT lock_key, '', owner, token, {now} - INTERVAL 1 MICROSECOND, expires_at, "
            f"'exclusive' FROM {t} WHERE {live_q} AND token <> %(token)s ORDER BY fence LIMIT 1)"
        )
        self._hand_sql = (
            f"INSERT INTO {t} (lock_key, slot, owner, token, acquired_at, expires_at, mode) "
            f"SELECT * FROM ({dead} UNION ALL {seat} UNION ALL {first}) AS x "
            + mysql_take_over(t, mine, now)
            + f"RETURNING slot, fence, token, acquired_at, expires_at, {now}"
        )

    @property
    def seats_on_release(self) -> bool:
        return self._hands_over()

    def _hands_over(self) -> bool:
        """MariaDB 10.5+, not Galera, fences drawn under the AUTO-INC lock
        (known once the capabilities were read: always, by the time a lock
        is released)."""
        dialect = self.store.dialect
        return bool(dialect.returning) and dialect.galera is False and not dialect.redraws_fences

    def _on_galera(self, store: Any) -> None:
        """Galera: every statement that decides or reads the order carries the
        exclusive lock's prefixes (:meth:`MySQLStore.for_galera`). Taking the
        head is the exclusive lock's INSERT IGNORE: no silent re-run after a
        lost certification (which counts as ignored), and it first applies
        every transaction committed anywhere, so it sees each queue row
        committed before it started (a waiter on a lagging node would otherwise pass one queued
        earlier on another node). Queueing waits the same way, so its ticket
        (the node's ``AUTO_INCREMENT``) is above every ticket handed out
        before it started, whichever node drew it. The reads of the head and
        the waiter's look see other nodes' rows. Idempotent: computed
        from the plain statements, so two first uses may race."""
        on = store.for_galera
        enqueue, head, look = self._plain
        self._heads = {
            sql: (on(plain, ignored=True), on(returning, ignored=True))
            for sql, (plain, returning) in self._plain_heads.items()
        }
        self._enqueue_sql = on(enqueue, write=True)
        self._head_sql = on(head, read=True)
        self._look_sql = on(look, read=True)
        self._galera = True

    def _ready_steps(self) -> Steps[None]:
        """The store's capabilities known, and the statements fit for them."""
        store: Any = self.store
        if not store.dialect.known:
            yield from store.server_steps()
        if store.dialect.galera and not self._galera:
            self._on_galera(store)

    def _head_steps(
        self, sql: str, params: dict[str, Any], ttl: float, *, read: bool = True
    ) -> Steps[Grant | Holder | None]:
        """Try ``sql`` (an INSERT IGNORE of the head); Grant, or the holder
        (None: the head was free or expired and we may try again now; also
        when ``read`` is false and we did not read the head)."""
        store: Any = self.store  # a MySQLStore: its capabilities and clock offset
        yield from self._ready_steps()
        plain, returning = self._heads[sql]
        if store.dialect.returning:
            rows = (yield returning, params, True, False).rows
            if rows:
                return mysql_grant(*rows[0])
        else:
            sent = time.time()
            result = yield plain, params, False, True
            if result.rowcount == 1:
                # As the exclusive lock does on MySQL: the lease's end from
                # the measured clock offset, erring early.
                offset = yield from store.server_offset_steps()
                start = datetime.fromtimestamp(sent + offset, _UTC)
                return Grant(int(result.lastrowid or 0), start + timedelta(seconds=ttl), ttl)
        if not read:
            return None
        rows = (yield self._head_sql, params, True, False).rows
        if not rows:
            return None
        token, _, expires_at, now, kind = rows[0]
        _check_kind(params["key"], kind)
        if expires_at <= now:
            yield self._takeover_sql, {"key": params["key"], "token": token}, False, False
            return None
        return Holder(None, token, (expires_at - now).total_seconds())

    def enter_steps(
        self, key: str, token: str, owner: str, ttl: float, *, enqueue: bool
    ) -> Steps[Grant | Holder | Queued]:
        params: dict[str, Any] = {
            "key": key,
            "owner": owner,
            "token": token,
            "ttl_us": round(ttl * 1e6),
        }
        # Queueing anyway if the head is taken: no need to read who holds it
        # (an expired head is taken over by the first waiter's turn).
        got = yield from self._head_steps(self._head_if_empty_sql, params, ttl, read=not enqueue)
        if isinstance(got, Grant):
            return got
        if not enqueue:
            return got or Holder(None, None, 0.0)
        ticket = (yield self._enqueue_sql, params, False, True).lastrowid
        assert ticket
        params["ticket"] = ticket
        rows = (yield self._look_sql, params, True, False).rows
        look = _Look(key, token, ticket, rows)
        return look.queued() if look.mine else Queued(ticket, None, 0.0)

    def turn_steps(
        self, key: str, token: str, ticket: int, owner: str, ttl: float
    ) -> Steps[Grant | Queued | Dropped]:
        params: dict[str, Any] = {
            "key": key,
            "owner": owner,
            "token": token,
            "ttl_us": round(ttl * 1e6),
            "ticket": ticket,
        }
        # Look first (one read), and write only to take the head or when our
        # row's lease needs renewing: a waiter's poll is one statement.
        yield from self._ready_steps()
        rows = (yield self._look_sql, params, True, False).rows
        look = _Look(key, token, ticket, rows)
        head = look.head
        if head is not None and head[4] == token and float(head[2]) > 0 and self._hands_over():
            # The holder's release handed us the head (see the class docstring).
            # Only where releases hand over: on Galera, granting a head found
            # carrying our token let the torture run's fair-order check find
            # grants out of ticket order (2-3 in 400-800 queued grants; none
            # without it). Such a head is waited out there, as before.
            return mysql_grant(head[5], head[7], head[8])
        if look.mine is None or look.mine <= 0:
            return DROPPED  # gone, or dead: never revived
        if look.due:
            got = yield from self._head_steps(self._head_if_first_sql, params, ttl)
            if isinstance(got, Grant):
                if not self._lingers():
                    yield self._drop_queued_sql, params, False, False
                return got
            if got is None:  # the head was free or just taken over: look again now
                return Queued(ticket, None, 0.0, first=True)
        if look.mine < ttl * 2 / 3 and not (yield self._renew_sql, params, False, False).rowcount:
            return DROPPED
        return look.queued()

    def _lingers(self) -> bool:
        """A granted waiter's queue row stays to its release, whose DELETE …
        RETURNING tells the head apart (MariaDB; see the class docstring).
        Not on Galera, whose fair path stays as it was (see turn_steps)."""
        dialect = self.store.dialect
        return bool(dialect.returning) and not dialect.galera

    def leave_steps(self, key: str, token: str) -> Steps[bool]:
        params = {"key": key, "token": token}
        if self._lingers():
            rows = (yield self._leave_returning_sql, params, True, False).rows
            return any(slot == "" for (slot,) in rows)
        return (yield self._leave_head_sql, params, False, False).rowcount > 0

    def release_steps(self, key: str, token: str, *, queued: bool = True) -> Steps[bool]:
        if not (queued and self._hands_over()):
            return (yield from self.leave_steps(key, token))
        released, _ = yield from self._hand_over(key, token, None, "", 1.0, queued=queued)
        return released

    def release_seating_steps(
        self, key: str, token: str, seat_token: str, owner: str, ttl: float, *, queued: bool = True
    ) -> Steps[tuple[bool, Grant | None]]:
        return (yield from self._hand_over(key, token, seat_token, owner, ttl, queued=queued))

    def _hand_over(
        self, key: str, token: str, seat_token: str | None, owner: str, ttl: float, *, queued: bool
    ) -> Steps[tuple[bool, Grant | None]]:
        params = {
            "key": key,
            "token": token,
            "queued": queued,
            "seat": seat_token is not None,
            "token2": seat_token or "",
            "owner2": owner,
            "ttl2_us": round(ttl * 1e6),
        }
        rows = (yield self._hand_sql, params, True, False).rows
        seat: Grant | None = None
        handed: bool | None = None  # None: no live waiter, our head untouched
        for slot, fence, row_token, acquired_at, expires_at, now in rows:
            if slot == "":
                # Ours and handed over (stamped now), else not ours to hand:
                # taken by another, or gone (a fresh row, stamped a
                # microsecond early, granted to the first waiter).
                handed = acquired_at == now and row_token != token
            elif row_token == seat_token:
                seat = mysql_grant(fence, expires_at, now)
        if handed is None:
            # Nobody to hand it to: released as usual.
            return (yield from self.leave_steps(key, token)), seat
        if queued:  # our queue row, dead since the hand-over
            yield self._leave_head_sql, params, False, False
        return handed, seat


class _Look:
    """What a waiter's look (one read on SQLite and MySQL) saw: rows of
    ``(slot, owner, expires_in, kind, token, fence, held)`` for the head, the
    live queue rows up to our ticket, and our own row (live or not)."""

    __slots__ = ("ahead", "head", "key", "mine", "ticket")

    def __init__(self, key: str, token: str, ticket: int, rows: Any) -> None:
        self.key = key
        self.ticket = ticket
        #: Seconds left on our queue row's lease (None: the row is gone).
        self.mine: float | None = None
        self.head: tuple[Any, ...] | None = None
        #: The live waiters before us, by ticket.
        self.ahead: list[tuple[Any, ...]] = []
        for row in rows:
            if row[0] == "":
                self.head = tuple(row)
            elif row[4] == token:
                self.mine = float(row[2])
            else:
                self.ahead.append(tuple(row))
        if self.head is not None:
            # The holder's own queue row (MariaDB keeps it to its release):
            # it waits for nobody, so it is not ahead of us.
            self.ahead = [row for row in self.ahead if row[4] != self.head[4]]
        self.ahead.sort(key=lambda r: int(r[5]))

    @property
    def due(self) -> bool:
        """Nobody live before us and the head free or expired: try to take it."""
        return not self.ahead and (self.head is None or float(self.head[2]) <= 0)

    def queued(self) -> Queued:
        """Whom we wait behind: the last live waiter before us, else the holder."""
        held = None if self.head is None else max(float(self.head[6]), 0.0)
        n = len(self.ahead)
        if self.ahead:
            last = self.ahead[-1]
            return Queued(self.ticket, last[1], float(last[2]), ahead=n, held=held)
        if self.head is None:
            return Queued(self.ticket, None, 0.0, first=True)
        _check_kind(self.key, self.head[3])
        left = max(float(self.head[2]), 0.0)
        return Queued(self.ticket, self.head[1], left, first=True, held=held)


def _check_kind(key: str, kind: str | None) -> None:
    """A fair request waits for an exclusive head; one of another kind never frees for it."""
    if kind is not None and kind != "exclusive":
        raise KindMismatch(key, requested="exclusive (fair)", existing=kind, where="in the table")


def fair_sql(store: Store) -> FairSQL:
    """The fair queue's statements in ``store``'s dialect, built once per store."""
    return store.kind_sql(_for_dialect)


def _for_dialect(store: Store) -> FairSQL:
    cls: type[FairSQL] = store.dialect.pick(
        postgresql=PostgresFair, mysql=MySQLFair, sqlite=SQLiteFair
    )
    return cls(store)
