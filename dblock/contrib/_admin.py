"""The admin operations the integrations offer in-process: list, sweep,
force-release (the Django admin page), and a background sweeper. (Their
command lines are the shell's own: ``dblock.cli.Face``.)

Thin calls into dblock's own admin side: the store's admin operations
(``Store.rows``, ``Store.sweep``, ``Store.release``, each dialect's statements
in its own module, in bounded batches) and :mod:`dblock.sweeper`. The Django
admin page and the in-app sweepers reach the lock table only through this
module.

Times come from the database's clock, as everywhere in dblock. Statements
run on the manager's engine in autocommit, outside any application
transaction. On PostgreSQL every row deleted here is announced like a
release, so waiters wake at once instead of at their next re-check.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .._store.admin import LockRow, SweepReason
from ..config import check_ttl
from ..errors import DBLockError
from ..keys import check_key
from ..sweeper import Sweeper as _CoreSweeper

if TYPE_CHECKING:
    from ..manager import LockManager

__all__ = [
    "LockInfo",
    "Sweeper",
    "force_release",
    "list_locks",
    "sweep",
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
