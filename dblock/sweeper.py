"""The sweeper: deletes lock rows that nobody is going to release.

A holder that crashed, or whose release could not reach the database, leaves
its row behind. The next acquirer of that key takes an expired row over
anyway; the sweeper keeps the table from filling up with keys nobody asks
for again, and, as a safety net, deletes rows held longer than a configured
maximum (``max_hold``), each such deletion logged as a WARNING with the key,
the owner and the age. A live row is never deleted for any other reason.

It deletes in bounded batches (``batch_size`` rows per statement, in each
database's idiom, see the store), so a huge backlog never holds a long lock
on the table. Several sweepers may run on many machines: each run is a run
of the job ``dblock:sweeper:<table>`` (:mod:`dblock.jobs`, the mechanism
``LockManager.once`` gives applications: lock ``job:dblock:sweeper:<table>``,
fail-fast, ``at_most=lock_ttl``); whoever does not get it skips the run. A
sweeper that dies mid-run blocks the others for at most that lease. A run
ends once half of ``lock_ttl`` has passed, so a run stays short; the next run
goes on where it stopped.

It also prunes the record of job runs (``<table>_runs``): runs started more
than ``runs_retention`` ago (default 30 days) go, in the same bounded batches.

On PostgreSQL it then VACUUMs the lock table once it holds ``vacuum_dead``
dead rows (default 1000). Every grant is an INSERT and every release a
DELETE, so a busy service makes thousands of dead rows a second, and
autovacuum visits a database at most once per ``autovacuum_naptime`` (a
minute by default; never, where it is turned off): the soak run
(benchmarks/soak.py, docs/operations.md "Vacuum and bloat") measured the
table growing between visits. VACUUM blocks no lock statement.

Runs are scheduled with APScheduler (3.x, a ``BackgroundScheduler``):
in an application through ``LockManager.start_sweeper()``, alone through
``dblock sweep --every 10s``. :meth:`Sweeper.stop` (called by
``LockManager.close()``, and at interpreter exit) lets the batch in hand
finish, releases the sweeper's lock and returns.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Protocol

from ._store.admin import LockRow, SweepReason
from ._store.jobs import statements as job_statements
from .config import MAX_SECONDS, apply_options, check_lease, check_ttl
from .errors import DBLockError, JobSkipped, LockArgumentError, LockLost, SchemaMissing
from .jobs import job_key

if TYPE_CHECKING:
    from ._store import Store
    from .config import Config
    from .telemetry import Recorder

__all__ = ["SweepHost", "SweepResult", "Sweeper", "SweeperConfig"]


class SweepHost(Protocol):
    """What a sweeper needs of the manager it sweeps for (``LockManager``, a
    floor above: the manager starts sweepers, so this module names the
    contract instead of importing it)."""

    @property
    def config(self) -> Config: ...

    @property
    def url(self) -> str: ...

    @property
    def store(self) -> Store: ...

    @property
    def telemetry(self) -> Recorder | None: ...

    @property
    def run_job(self) -> Callable[..., Any]: ...


log = logging.getLogger("dblock.sweeper")

_MAX_BATCH = 100_000


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SweeperConfig:
    """How a :class:`Sweeper` works. All times are seconds.

    interval
        Time between two runs when scheduled.
    grace
        A row is deleted only once its lease ended more than this long ago,
        so an acquirer about to take it over, or a renewal in flight, wins.
    max_hold
        Safety net: also delete rows acquired more than this long ago, lease
        or not, each logged as a WARNING. Default: the manager's ``max_hold``
        (which also caps renewal); ``None``: never delete a live row. Must
        exceed ``lock_ttl``.
    batch_size
        Rows per DELETE: the most any one statement locks.
    lock_ttl
        Lease of the sweeper's own job lock (its ``at_most``). A run stops
        once half of it has passed; a sweeper that dies mid-run holds the
        others off this long at most.
    runs_retention
        Delete job runs (``dblock jobs``) started longer ago than this;
        ``None`` keeps them all.
    vacuum_dead
        PostgreSQL: VACUUM the lock table after a run when it has at least
        this many dead rows (the statistics' ``n_dead_tup``); ``None`` leaves
        it to autovacuum.
    """

    # 10 s, not 30: between two runs a table granting thousands of locks a
    # second piles up one interval's dead rows before the VACUUM below, and
    # the table's file keeps its peak (the soak run: about 26 MB at 5,800
    # grants/s with 30 s). A run where nothing is due costs a few statements.
    interval: float = 10.0
    grace: float = 5.0
    max_hold: float | None = None
    batch_size: int = 500
    lock_ttl: float = 10.0
    runs_retention: float | None = 30 * 86400.0
    vacuum_dead: int | None = 1000

    def __post_init__(self) -> None:
        object.__setattr__(self, "interval", check_ttl(self.interval, "interval"))
        object.__setattr__(self, "lock_ttl", check_lease(self.lock_ttl, "lock_ttl"))
        grace = self.grace
        if (
            isinstance(grace, bool)
            or not isinstance(grace, (int, float))
            or not 0 <= grace <= MAX_SECONDS
        ):
            raise LockArgumentError(
                f"grace must be a number of seconds from 0 to {MAX_SECONDS:.0f} (366 days), "
                f"got {grace!r}"
            )
        object.__setattr__(self, "grace", float(grace))
        if self.max_hold is not None:
            max_hold = check_ttl(self.max_hold, "max_hold")
            if max_hold <= self.lock_ttl:
                raise LockArgumentError(
                    f"max_hold ({max_hold:g} s) must exceed lock_ttl ({self.lock_ttl:g} s), "
                    "or the sweeper would sweep its own lock"
                )
            object.__setattr__(self, "max_hold", max_hold)
        if self.runs_retention is not None:
            object.__setattr__(
                self, "runs_retention", check_ttl(self.runs_retention, "runs_retention")
            )
        dead = self.vacuum_dead
        if dead is not None and (isinstance(dead, bool) or not isinstance(dead, int) or dead < 0):
            raise LockArgumentError(
                f"vacuum_dead must be a whole number of rows (or None), got {dead!r}"
            )
        size = self.batch_size
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= _MAX_BATCH:
            raise LockArgumentError(
                f"batch_size must be a whole number from 1 to {_MAX_BATCH}, got {size!r}"
            )

    @classmethod
    def from_options(cls, base: SweeperConfig | None, options: Mapping[str, Any]) -> SweeperConfig:
        """``base`` with ``options`` applied; unknown option names are refused."""
        return apply_options(cls, base, options, "sweeper ")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class SweepResult:
    """What one run did."""

    expired: int = 0
    """Rows deleted because their lease had ended."""
    max_hold: int = 0
    """Live rows deleted because they were held longer than ``max_hold``."""
    batches: int = 0
    seconds: float = 0.0
    busy: str | None = None
    """Set (to the other sweeper's owner string) when another sweeper held
    the sweeper lock, so this run did nothing."""
    complete: bool = True
    """False when the run stopped with rows possibly left (stop requested, or
    half its lease used up); the next run goes on."""
    runs: int = 0
    """Job runs deleted from the record of runs (older than ``runs_retention``)."""
    vacuumed: bool = False
    """The run VACUUMed the lock table (PostgreSQL, ``vacuum_dead`` dead rows or more)."""

    @property
    def swept(self) -> int:
        return self.expired + self.max_hold

    def describe(self) -> str:
        if self.busy is not None:
            return f"another sweeper ({self.busy}) is at work; nothing done"
        text = (
            f"swept {self.expired} expired row{'s' if self.expired != 1 else ''}"
            f" and {self.max_hold} held past max_hold in {self.batches} "
            f"batch{'es' if self.batches != 1 else ''}, {self.seconds:.2f} s"
        )
        if self.runs:
            text += f"; pruned {self.runs} old job run{'s' if self.runs != 1 else ''}"
        if self.vacuumed:
            text += "; vacuumed the table"
        return text if self.complete else text + " (stopped early; the next run goes on)"


class Sweeper:
    """Sweeps the lock table of ``manager``: once (:meth:`run_once`) or on a
    schedule (:meth:`start` / :meth:`stop`). Options are the fields of
    :class:`SweeperConfig`, as keywords or as ``config=``."""

    def __init__(
        self, manager: SweepHost, *, config: SweeperConfig | None = None, **options: Any
    ) -> None:
        self.manager = manager
        if config is None and "max_hold" not in options and manager.config.max_hold is not None:
            # The manager's max_hold caps renewal; the sweeper enforces the same limit.
            options = {**options, "max_hold": manager.config.max_hold}
        self.config = SweeperConfig.from_options(config, options)
        self.table = manager.config.table
        #: The sweeper's job (see dblock.jobs), and its lock key.
        self.job = f"dblock:sweeper:{self.table}"
        self.key = job_key(self.job)
        self._stopping = threading.Event()
        self._state_lock = threading.Lock()
        self._scheduler: Any = None
        #: Runs that held the sweeper lock, and the rows they deleted, so far.
        self.runs = 0
        self._last = SweepResult()  # the latest run's, for one whose lock was lost
        self.swept = 0

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<Sweeper {self.table!r} on {self.manager.url} {state}>"

    # -- one run -------------------------------------------------------------

    def run_once(self) -> SweepResult:
        """Sweep expired rows (then rows past ``max_hold``, if set) in batches,
        then prune old job runs, unless another sweeper runs the sweeper's job
        now. Database errors raise :class:`~dblock.BackendError`."""
        config = self.config
        start = time.monotonic()
        try:
            result = self.manager.run_job(
                self.job,
                self._sweep,
                start,
                at_most=config.lock_ttl,
                on_skip="raise",
                record=False,  # one run every interval: not history worth keeping
            )
        except JobSkipped as exc:
            log.info("dblock sweeper: %s holds %r; skipping this run", exc.holder, self.key)
            return SweepResult(busy=exc.holder or "another process")
        except LockLost:
            log.warning(
                "dblock sweeper: the sweeper lock %r ran out during the run; another "
                "sweeper may have swept at the same time (harmless: every deletion "
                "checks its condition again)",
                self.key,
            )
            result = self._last
        assert isinstance(result, SweepResult)
        with self._state_lock:
            self.runs += 1
            self.swept += result.swept
        log.log(
            logging.INFO
            if result.swept or result.runs or result.vacuumed or not result.complete
            else logging.DEBUG,
            "dblock sweeper: %s: %s",
            self.table,
            result.describe(),
        )
        return result

    def _sweep(self, start: float) -> SweepResult:
        """One run, under the sweeper's job lock."""
        config = self.config
        passes = [(SweepReason.EXPIRED, config.grace)]
        if config.max_hold is not None:
            passes.append((SweepReason.MAX_HOLD, config.max_hold))
        swept = dict.fromkeys(SweepReason, 0)
        batches = 0
        complete = True

        def time_is_up() -> bool:
            # Half the lease: renewal keeps the lock, but a run stays short.
            return self._stopping.is_set() or time.monotonic() - start >= config.lock_ttl / 2

        for reason, older_than in passes:
            while True:
                if time_is_up():
                    complete = False
                    break
                rows = self.manager.store.sweep(
                    reason, older_than=older_than, limit=config.batch_size
                )
                batches += 1
                swept[reason] += len(rows)
                self._report(reason, rows)
                if len(rows) < config.batch_size:
                    break
            if not complete:
                break
        pruned = 0
        if complete and config.runs_retention is not None:
            pruned, complete = self._prune_runs(config.runs_retention, time_is_up)
        vacuumed = False
        if complete and config.vacuum_dead is not None and not time_is_up():
            try:
                vacuumed = self.manager.store.vacuum(config.vacuum_dead)
            except DBLockError as exc:
                # The sweep stands; autovacuum remains (a VACUUM by a user who
                # does not own the table is only a server warning, not this).
                log.warning("dblock sweeper: VACUUM of %s failed: %s", self.table, exc)
        self._last = result = SweepResult(
            expired=swept[SweepReason.EXPIRED],
            max_hold=swept[SweepReason.MAX_HOLD],
            batches=batches,
            seconds=time.monotonic() - start,
            complete=complete,
            runs=pruned,
            vacuumed=vacuumed,
        )
        return result

    def _prune_runs(self, retention: float, time_is_up: Callable[[], bool]) -> tuple[int, bool]:
        """Delete job runs older than ``retention``, in batches; (how many, done)."""
        sql = job_statements(self.manager.store)
        pruned = 0
        while True:
            if time_is_up():
                return pruned, False
            try:
                gone = sql.prune(retention, self.config.batch_size)
            except SchemaMissing:
                # A schema from before revision 0003: nothing to prune.
                log.debug("dblock sweeper: no record of job runs %r", sql.runs_name)
                return pruned, True
            pruned += gone
            if gone < self.config.batch_size:
                return pruned, True

    def _report(self, reason: SweepReason, rows: list[LockRow]) -> None:
        telemetry = self.manager.telemetry
        if telemetry is not None:
            telemetry.swept(reason.value, len(rows))
        for row in rows:
            if reason is SweepReason.MAX_HOLD:
                log.warning(
                    "dblock sweeper: deleted %r held by %s for %.1f s, longer than max_hold "
                    "(%g s), with %.1f s of lease left; its holder will get LockLost",
                    row.key,
                    row.owner,
                    row.age,
                    self.config.max_hold,
                    row.lease_left,
                )
            else:
                log.debug(
                    "dblock sweeper: deleted %r held by %s (age %.1f s, expired %.1f s ago)",
                    row.key,
                    row.owner,
                    row.age,
                    -row.lease_left,
                )

    # -- on a schedule ---------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._scheduler is not None

    def start(self) -> None:
        """Run every ``interval`` seconds, the first run now, on a background
        thread (an APScheduler ``BackgroundScheduler``)."""
        from apscheduler.executors.debug import DebugExecutor
        from apscheduler.schedulers.background import BackgroundScheduler

        with self._state_lock:
            if self._scheduler is not None:
                raise DBLockError(f"{self!r} is already running")
            # The job runs on the scheduler's own (daemon) thread, not in a
            # worker pool: a pool's workers would hold interpreter exit until
            # the run ended, before our exit hook could ask it to stop.
            scheduler = BackgroundScheduler(
                executors={"default": DebugExecutor()}, timezone=timezone.utc
            )
            scheduler.add_job(
                self._scheduled_run,
                "interval",
                seconds=self.config.interval,
                id=self.key,
                name=f"dblock sweeper for {self.table}",
                next_run_time=datetime.now(timezone.utc),
                coalesce=True,
                max_instances=1,
                misfire_grace_time=None,
            )
            self._stopping.clear()
            log.info(
                "dblock sweeper: sweeping %s on %s every %g s",
                self.table,
                self.manager.url,
                self.config.interval,
            )
            scheduler.start()
            self._scheduler = scheduler
            _running.add(self)

    def stop(self) -> None:
        """Stop the schedule: the batch in hand finishes, the sweeper lock is
        released, then this returns. Does nothing if not running."""
        with self._state_lock:
            scheduler, self._scheduler = self._scheduler, None
            _running.discard(self)
        if scheduler is None:
            return
        self._stopping.set()
        # Blocks until a run in progress returns (the job holds the scheduler's
        # job store lock while it runs), then joins the scheduler thread.
        scheduler.shutdown(wait=True)
        self._stopping.clear()  # a later run_once() or start() sweeps again
        log.info("dblock sweeper: stopped sweeping %s", self.table)

    def _scheduled_run(self) -> None:
        try:
            self.run_once()
        except DBLockError as exc:
            # The next run tries again; a database blip must not end the schedule.
            log.error("dblock sweeper: run on %s failed: %s", self.table, exc)
        except Exception:
            log.exception("dblock sweeper: run on %s failed", self.table)


_running: weakref.WeakSet[Sweeper] = weakref.WeakSet()


@atexit.register
def _stop_at_exit() -> None:
    for sweeper in list(_running):
        sweeper.stop()
