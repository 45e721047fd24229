"""The admin operations the integrations offer: list, sweep, force-release,
and a background sweeper.

Interim home. Issue 3 builds dblock's own admin side (``dblock sweep``,
``list``, ``release --force``, ``LockManager.start_sweeper()``); when it is
merged, these functions become thin calls into it. The Flask command group,
the Django management commands and admin page reach the lock table only
through this module, so that re-pointing happens here alone.

Times come from the database's clock, as everywhere in dblock. Statements
run on the manager's engine in autocommit, outside any application
transaction. On PostgreSQL every row deleted here is announced like a
release, so waiters wake at once instead of at their next re-check.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from ..config import check_ttl
from ..errors import BackendError, DBLockError, LockArgumentError, LockBusy, SchemaMissing
from ..keys import check_key
from ..schema import MYSQL_FAMILY, to_utc

if TYPE_CHECKING:
    from ..manager import LockManager

__all__ = [
    "LockInfo",
    "Sweeper",
    "force_release",
    "list_locks",
    "list_report",
    "release_report",
    "render_table",
    "sweep",
    "sweep_report",
]

log = logging.getLogger("dblock")

_DEADLOCK_RETRIES = 3
_MYSQL_DEADLOCK = (1213, 1205)  # deadlock victim, lock wait timeout

# The database's "now", in the representation each dialect stores times in.
_NOW = {
    "postgresql": "now()",
    "mysql": "UTC_TIMESTAMP(6)",
    "mariadb": "UTC_TIMESTAMP(6)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class LockInfo:
    """One row of the lock table, as an admin sees it."""

    key: str
    owner: str
    fence: int
    acquired_at: datetime
    expires_at: datetime
    #: Seconds of lease left by the database's clock (negative: expired).
    expires_in: float

    @property
    def expired(self) -> bool:
        return self.expires_in <= 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "owner": self.owner,
            "fence": self.fence,
            "acquired_at": self.acquired_at.isoformat(),
            "expires_at": self.expires_at.isoformat(),
            "expires_in": round(self.expires_in, 3),
            "expired": self.expired,
        }


def _now_sql(manager: LockManager) -> str:
    return _NOW[manager.dialect]


def _older_than(manager: LockManager, seconds: float) -> tuple[str, dict[str, Any]]:
    """A condition on ``acquired_at``: held longer than ``seconds``."""
    now = _now_sql(manager)
    if manager.dialect == "postgresql":
        return f"acquired_at < {now} - make_interval(secs => :age)", {"age": seconds}
    if manager.dialect in MYSQL_FAMILY:
        return f"acquired_at < {now} - INTERVAL :age_us MICROSECOND", {
            "age_us": round(seconds * 1e6)
        }
    return f"acquired_at < {now} - :age", {"age": seconds}


def list_locks(manager: LockManager, *, prefix: str | None = None) -> list[LockInfo]:
    """Every row of the lock table (keys starting with ``prefix``), by key."""
    table = manager.store.table
    query = sa.select(table).order_by(table.c.lock_key)
    if prefix:
        query = query.where(table.c.lock_key.startswith(prefix, autoescape=True))
    try:
        with manager.engine.connect() as conn:
            now = to_utc(conn.execute(sa.text(f"SELECT {_now_sql(manager)}")).scalar_one())
            rows = conn.execute(query).all()
    except sa.exc.DBAPIError as exc:
        raise _backend_error(manager, exc) from exc
    assert now is not None
    return [
        LockInfo(
            key=row.lock_key,
            owner=row.owner,
            fence=row.fence,
            acquired_at=row.acquired_at,
            expires_at=row.expires_at,
            expires_in=(row.expires_at - now).total_seconds(),
        )
        for row in rows
    ]


def sweep(manager: LockManager, *, max_age: float | None = None) -> int:
    """Delete rows whose lease ended and, with ``max_age``, rows held longer
    than that many seconds. Returns how many rows were deleted."""
    where = f"expires_at <= {_now_sql(manager)}"
    params: dict[str, Any] = {}
    if max_age is not None:
        older, params = _older_than(manager, check_ttl(max_age, "max_age"))
        where = f"({where}) OR {older}"
    return _delete(manager, where, params)


def force_release(manager: LockManager, key: str) -> bool:
    """Delete the row of ``key`` whoever holds it. True if there was one.

    The holder is not told: its work goes on without mutual exclusion until
    it finds out on release (:class:`~dblock.LockLost`). Meant for locks whose
    holder is known to be gone.
    """
    return _delete(manager, "lock_key = :key", {"key": check_key(key)}) > 0


def _delete(manager: LockManager, where: str, params: dict[str, Any]) -> int:
    table = manager.engine.dialect.identifier_preparer.quote(manager.names.table)
    if manager.dialect == "postgresql":
        sql = (
            f"WITH gone AS (DELETE FROM {table} WHERE {where} RETURNING lock_key) "
            f"SELECT count(pg_notify(:channel, lock_key)) FROM gone"
        )
        params = {**params, "channel": manager.names.channel}
    else:
        sql = f"DELETE FROM {table} WHERE {where}"
    for attempt in range(_DEADLOCK_RETRIES + 1):
        try:
            with manager.engine.connect() as conn:
                result = conn.execute(sa.text(sql), params)
                count = result.scalar_one() if manager.dialect == "postgresql" else result.rowcount
                conn.commit()
            return int(count)
        except sa.exc.DBAPIError as exc:
            # InnoDB may pick a range DELETE as the victim of a deadlock with
            # concurrent acquires and renewals; nothing was deleted, so retry.
            if attempt < _DEADLOCK_RETRIES and _is_deadlock(exc):
                time.sleep(0.05 * 2**attempt)
                continue
            raise _backend_error(manager, exc) from exc
    raise AssertionError("unreachable")


def _is_deadlock(exc: sa.exc.DBAPIError) -> bool:
    args: tuple[object, ...] = tuple(getattr(exc.orig, "args", ()))
    return bool(args) and args[0] in _MYSQL_DEADLOCK


def _backend_error(manager: LockManager, exc: sa.exc.DBAPIError) -> DBLockError:
    if manager.store.is_missing_table(exc.orig or exc):
        return SchemaMissing(manager.names.table, manager.url)
    detail = str(exc.orig or exc).strip().splitlines()[0]
    return BackendError(f"statement failed on {manager.url}: {detail}")


def render_table(locks: list[LockInfo]) -> str:
    """The rows as a plain-text table for a terminal."""
    if not locks:
        return "no locks held"
    header = ("KEY", "OWNER", "FENCE", "ACQUIRED (UTC)", "LEASE")
    rows = [
        (
            info.key,
            info.owner,
            str(info.fence),
            info.acquired_at.strftime("%Y-%m-%d %H:%M:%S"),
            "expired" if info.expired else f"{info.expires_in:.1f} s left",
        )
        for info in locks
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in (header, *rows)
    ]
    return "\n".join(lines)


class Sweeper:
    """A background job sweeping the lock table every ``interval`` seconds.

    Several sweepers (one per application process) may run: each round first
    takes the dblock lock ``dblock:sweeper:<table>`` fail-fast, so one sweeps
    at a time and the others skip that round.
    """

    def __init__(
        self, manager: LockManager, *, interval: float = 60.0, max_age: float | None = None
    ) -> None:
        self.manager = manager
        self.interval = check_ttl(interval, "sweeper interval")
        self.max_age = None if max_age is None else check_ttl(max_age, "max_age")
        self.key = f"dblock:sweeper:{manager.names.table}"
        self.swept = 0
        self.rounds = 0
        self._scheduler: Any = None
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._scheduler is not None

    def start(self) -> Sweeper:
        from apscheduler.schedulers.background import BackgroundScheduler

        with self._lock:
            if self._scheduler is None:
                scheduler = BackgroundScheduler(daemon=True)
                scheduler.add_job(
                    self.run_once,
                    "interval",
                    seconds=self.interval,
                    id=self.key,
                    next_run_time=datetime.now().astimezone(),
                    max_instances=1,
                    coalesce=True,
                )
                scheduler.start()
                self._scheduler = scheduler
        return self

    def stop(self) -> None:
        with self._lock:
            scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.shutdown(wait=True)

    def run_once(self) -> int | None:
        """One round; None if another sweeper had the round or it failed."""
        try:
            with self.manager.lock(self.key, blocking=False, ttl=max(self.interval, 30.0)):
                count = sweep(self.manager, max_age=self.max_age)
        except LockBusy:
            return None
        except DBLockError as exc:
            # A sweeper that dies would leave expired rows for good; log and go on.
            log.error("dblock: sweeping %s failed: %s", self.manager.names.table, exc)
            return None
        self.rounds += 1
        self.swept += count
        if count:
            log.info("dblock: swept %d row(s) from %s", count, self.manager.names.table)
        return count


# -- what the integrations' commands print --------------------------------------


def list_report(manager: LockManager, *, prefix: str | None, as_json: bool) -> str:
    locks = list_locks(manager, prefix=prefix)
    if as_json:
        return "\n".join(json.dumps(info.as_dict()) for info in locks)
    return render_table(locks)


def sweep_report(manager: LockManager, *, max_age: float | None) -> str:
    count = sweep(manager, max_age=max_age)
    return f"swept {count} row(s) from {manager.names.table}"


def release_report(manager: LockManager, key: str, *, force: bool) -> str:
    if not force:
        raise LockArgumentError(
            f"releasing {key!r} takes it from its holder, which goes on without mutual "
            "exclusion; pass --force if that holder is gone"
        )
    if not force_release(manager, key):
        raise DBLockError(f"no lock {key!r} is held")
    return f"released {key}"
