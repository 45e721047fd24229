"""The admin operations the integrations offer: list, sweep, force-release,
and a background sweeper.

Thin calls into dblock's own admin side: the store's admin operations
(``Store.rows``, ``Store.sweep``, ``Store.release``, each dialect's statements
in its own module, in bounded batches) and :mod:`dblock.sweeper`. The Flask
command group, the Django management commands and admin page reach the lock
table only through this module.

Times come from the database's clock, as everywhere in dblock. Statements
run on the manager's engine in autocommit, outside any application
transaction. On PostgreSQL every row deleted here is announced like a
release, so waiters wake at once instead of at their next re-check.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .._store.admin import LockRow, SweepReason, filter_phrase, rows_json
from ..config import check_ttl
from ..errors import DBLockError, LockArgumentError
from ..keys import check_filter, check_key
from ..sweeper import Sweeper as _CoreSweeper

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

_BATCH = 500
_RELEASE_ATTEMPTS = 3


#: One row of the lock table, as an admin sees it (the rows ``dblock list`` shows).
LockInfo = LockRow


def list_locks(manager: LockManager, *, prefix: str | None = None) -> list[LockInfo]:
    """Every row of the lock table (keys starting with ``prefix``), by key."""
    return sorted(manager.store.rows(prefix=prefix), key=lambda row: row.key)


def sweep(manager: LockManager, *, max_age: float | None = None) -> int:
    """Delete rows whose lease ended and, with ``max_age``, rows held longer
    than that many seconds. Returns how many rows were deleted."""
    older = None if max_age is None else check_ttl(max_age, "max_age")
    count = _drain(manager, SweepReason.EXPIRED, 0.0)
    if older is not None:
        count += _drain(manager, SweepReason.MAX_HOLD, older)
    return count


def _drain(manager: LockManager, reason: SweepReason, older_than: float) -> int:
    total = 0
    while True:
        swept = len(manager.store.sweep(reason, older_than=older_than, limit=_BATCH))
        total += swept
        if swept < _BATCH:
            return total


def force_release(manager: LockManager, key: str) -> bool:
    """Delete every row of ``key`` (the exclusive holder's, every semaphore
    permit, read-write rows) whoever holds them. True if there was one.

    The holder is not told: its work goes on without mutual exclusion until
    it finds out on release (:class:`~dblock.LockLost`). Meant for locks whose
    holder is known to be gone.
    """
    key = check_key(key)
    for _ in range(_RELEASE_ATTEMPTS):
        found = manager.store.rows(key=key)
        if not found:
            return False
        # By the token read: a row that changed hands meanwhile is read again.
        if manager.store.release_key(key):
            return True
    return False


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
            "expired" if info.expired else f"{info.lease_left:.1f} s left",
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
    """dblock's sweeper (:class:`dblock.sweeper.Sweeper`) as the integrations
    use it: rows are swept as soon as their lease ends (no grace), ``max_age``
    is the max-hold safety net, and :meth:`run_once` returns the count.

    Several sweepers (one per application process) may run: each round is a
    run of the job ``dblock:sweeper:<table>`` (its lock taken fail-fast, as
    ``LockManager.once`` does), so one sweeps at a time and the others skip
    that round.
    """

    def __init__(
        self, manager: LockManager, *, interval: float = 60.0, max_age: float | None = None
    ) -> None:
        self.manager = manager
        self.interval = check_ttl(interval, "sweeper interval")
        self.max_age = None if max_age is None else check_ttl(max_age, "max_age")
        # The sweeper's own lock must be shorter than max_age, or it could be swept.
        lock_ttl = 10.0 if self.max_age is None else min(10.0, self.max_age / 2)
        self._sweeper = _CoreSweeper(
            manager, interval=self.interval, grace=0.0, max_hold=self.max_age, lock_ttl=lock_ttl
        )
        self.key = self._sweeper.key

    @property
    def running(self) -> bool:
        return self._sweeper.running

    @property
    def swept(self) -> int:
        """Rows deleted so far."""
        return self._sweeper.swept

    @property
    def rounds(self) -> int:
        """Rounds this sweeper had (not skipped for another one)."""
        return self._sweeper.runs

    def start(self) -> Sweeper:
        if not self._sweeper.running:
            self._sweeper.start()
        return self

    def stop(self) -> None:
        self._sweeper.stop()

    def run_once(self) -> int | None:
        """One round; None if another sweeper had the round or it failed."""
        try:
            result = self._sweeper.run_once()
        except DBLockError as exc:
            # A sweeper that dies would leave expired rows for good; log and go on.
            log.error("dblock: sweeping %s failed: %s", self.manager.names.table, exc)
            return None
        return None if result.busy is not None else result.swept


# -- what the integrations' commands print --------------------------------------


def list_report(manager: LockManager, *, prefix: str | None, as_json: bool) -> str:
    if as_json:
        # The shape and order of `dblock list --json` (oldest first), so one
        # script reads the output of every command.
        return rows_json(manager.store.rows(prefix=prefix))
    return render_table(list_locks(manager, prefix=prefix))


def sweep_report(manager: LockManager, *, max_age: float | None) -> str:
    count = sweep(manager, max_age=max_age)
    return f"swept {count} row(s) from {manager.names.table}"


def release_report(
    manager: LockManager,
    key: str | None = None,
    *,
    force: bool,
    prefix: str | None = None,
    owner: str | None = None,
) -> str:
    """The release commands of Flask and Django: one key, or every row
    matching ``prefix`` and/or ``owner`` (as ``dblock release``), checked
    before any statement runs."""
    if key is not None and (prefix is not None or owner is not None):
        raise LockArgumentError("give KEY, or --prefix and/or --owner, not both")
    if key is None and prefix is None and owner is None:
        raise LockArgumentError("name what to release: KEY, --prefix PREFIX or --owner OWNER")
    if key is not None:
        key = check_key(key)  # as the API and `dblock release` check it, before anything else
        what = repr(key)
    else:
        prefix = None if prefix is None else check_filter("--prefix", prefix)
        owner = None if owner is None else check_filter("--owner", owner)
        what = filter_phrase(prefix, owner)
    if not force:
        raise LockArgumentError(
            f"releasing {what} takes it from its holder, which goes on without mutual "
            "exclusion; pass --force if that holder is gone"
        )
    if key is not None:
        if not force_release(manager, key):
            raise DBLockError(f"no lock {key!r} is held")
        log.warning("dblock: force-released %r in %s", key, manager.names.table)
        return f"released {key}"
    found = manager.store.rows(prefix=prefix, owner=owner)
    if not found:
        raise DBLockError(f"no lock rows with {what} in {manager.names.table}")
    # Each row by the token read: one that changed hands meanwhile stays.
    gone = len(manager.store.release_rows(found))
    kept = len(found) - gone
    log.warning("dblock: force-released %d row(s) with %s in %s", gone, what, manager.names.table)
    moved = f" ({kept} changed hands meanwhile; kept)" if kept else ""
    return f"released {gone} row{'s' if gone != 1 else ''} with {what}{moved}"
