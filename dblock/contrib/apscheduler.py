"""APScheduler 3: N schedulers in N processes, each fire of a job runs once.

::

    from apscheduler.schedulers.background import BackgroundScheduler
    from apscheduler.triggers.interval import IntervalTrigger
    from dblock.contrib.apscheduler import OncePerClusterExecutor

    scheduler = BackgroundScheduler(
        executors={"default": OncePerClusterExecutor(locks, at_most=300)}
    )
    scheduler.add_job(report, IntervalTrigger(minutes=5, start_date=ANCHOR), id="report")

Every process of the cluster runs the same scheduler; at each fire time each
of them submits the job to this executor, which calls
:meth:`LockManager.run_job <dblock.LockManager.run_job>` keyed by the job's
id and the fire time the scheduler computed for it (``scheduled_run_time``,
in UTC). One process runs it; the others find the run taken (or done) and
skip it. A process killed in the middle of a run leaves the run to its lease:
no one repeats it within ``at_most``.

Why an executor: APScheduler calls it for every job whatever added it
(``add_job``, ``scheduled_job``, Flask-APScheduler's ``JOBS``, a job
restored from a persistent job store), it is handed the scheduled run times
(a wrapper around the job's function is not: it would only see "now"), and
it lives in the scheduler, not in the job, so a job store never has to
serialise it. Jobs that must run in *every* process (a local cache refresh)
go to a plain executor under another alias.

Two requirements, both for every scheduler of the cluster to name a fire in
the same way:

- **Explicit job ids.** The id is the job's name in the runs table; an id
  APScheduler made up (a random uuid) differs in every process, so such a
  job is refused with an error rather than silently run N times.
- **Fire times that do not depend on the host's clock.** A cron trigger's
  are whole calendar times; an interval trigger's are ``start_date + k *
  interval``, and ``start_date`` defaults to *now* in each process. Give it a
  fixed ``start_date`` (an anchor in the past, identical everywhere): then
  every host computes the same times, even with clocks apart (see "Clock
  skew" in docs/jobs.md). A trigger whose start looks computed from a clock
  is logged once as a warning.
"""

from __future__ import annotations

import functools
import logging
import re
import sys
import traceback
from collections import deque
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from typing import Any, Protocol, TypeVar

from apscheduler.events import (
    EVENT_JOB_ERROR,
    EVENT_JOB_EXECUTED,
    EVENT_JOB_MISSED,
    JobExecutionEvent,
)
from apscheduler.executors.asyncio import AsyncIOExecutor
from apscheduler.executors.base import BaseExecutor
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger
from apscheduler.util import iscoroutinefunction_partial

from .. import SKIPPED
from ..errors import LockArgumentError

__all__ = [
    "EVENT_JOB_SKIPPED",
    "JobRunner",
    "OncePerClusterAsyncIOExecutor",
    "OncePerClusterExecutor",
    "fire_time_of",
    "job_options",
    "once_per_cluster",
]

F = TypeVar("F", bound=Callable[..., Any])

#: The event dispatched when another process ran (or is running) this fire.
#: APScheduler's own events stop at 2**16; a listener that wants this one
#: asks for it (``add_listener(cb, EVENT_JOB_SKIPPED)``), so listeners of
#: ``EVENT_ALL`` do not see a skip as a run.
EVENT_JOB_SKIPPED = 2**24

_ATTR = "__dblock_job__"
# APScheduler's own ids for jobs given none: uuid4().hex.
_MADE_UP_ID = re.compile(r"[0-9a-f]{32}")

_log = logging.getLogger("dblock.contrib.apscheduler")
#: How long a thread-pool executor's start waits for the database (see
#: OncePerClusterExecutor._warm_up).
_WARM_UP = 5.0
#: At most this many coalesced fire times of a job are run after all (see
#: _OncePerCluster._with_coalesced).
_MAX_FILLED = 100


class JobRunner(Protocol):
    """What the executor needs of a :class:`~dblock.LockManager`."""

    def run_job(
        self,
        name: str,
        func: Callable[..., Any],
        /,
        *args: Any,
        fire_time: datetime | None = None,
        at_most: float | timedelta | None = None,
        at_least: float | timedelta = 0,
        retry_failed: bool = False,
        on_skip: str = "return",
        wait: float | timedelta = 0,
        next_fire_time: datetime | None = None,
        **kwargs: Any,
    ) -> Any: ...


def job_options(
    *,
    at_most: float | timedelta | None = None,
    at_least: float | timedelta | None = None,
    retry_failed: bool | None = None,
    wait: float | None = None,
    local: bool | None = None,
) -> Callable[[F], F]:
    """Per-job options, on the job's function (so they survive job stores,
    which store the function by reference): ``at_most``, ``at_least``,
    ``retry_failed`` and ``wait`` as for :meth:`~dblock.LockManager.run_job`,
    or ``local=True`` to run it in every process as if the executor were plain."""
    given = {
        "at_most": at_most,
        "at_least": at_least,
        "retry_failed": retry_failed,
        "wait": wait,
        "local": local,
    }

    def mark(func: F) -> F:
        setattr(func, _ATTR, {k: v for k, v in given.items() if v is not None})
        return func

    return mark


def fire_time_of(run_time: datetime) -> datetime:
    """The key of one fire: the scheduled run time, in UTC. APScheduler hands
    run times in the scheduler's time zone; two schedulers configured with
    different zones still name the same instant alike."""
    if run_time.tzinfo is None:  # APScheduler 3 never does this; a caller might
        raise LockArgumentError(f"fire time {run_time!r} has no time zone")
    return run_time.astimezone(timezone.utc)


class _OncePerCluster:
    """What dblock's executors share: options, names, and one fire's run
    told as APScheduler's events. The executors differ only in how a run is
    driven (a thread of a pool, or the event loop)."""

    _logger: logging.Logger
    # (APScheduler's BaseExecutor's: its lock, made at start, and its count
    # of each job's submissions under way.)
    _lock: Any
    _instances: Any

    def _setup(
        self,
        locks: Any,
        *,
        at_most: float | timedelta,
        at_least: float | timedelta,
        retry_failed: bool,
        wait: float | None,
        prefix: str,
    ) -> None:
        if isinstance(at_most, timedelta):
            at_most = at_most.total_seconds()
        if isinstance(at_most, bool) or not isinstance(at_most, (int, float)) or at_most <= 0:
            raise LockArgumentError(f"at_most must be positive seconds, got {at_most!r}")
        self._locks = locks
        self._runner: Any = None
        self.defaults = {
            "at_most": at_most,
            "at_least": at_least,
            "retry_failed": retry_failed,
            "wait": wait,
            "local": False,
        }
        self.prefix = prefix
        self._warned: set[str] = set()
        # The fires of each cluster job still to run in this scheduler, in
        # the order they came (see submit_job); a job id is here while its
        # drainer works.
        self._queued: dict[str, deque[tuple[Any, list[datetime]]]] = {}
        # The last fire time of each cluster job this scheduler submitted.
        self._last_fire: dict[str, datetime] = {}

    def _resolve(self) -> Any:
        if self._runner is None:
            locks = self._locks
            self._runner = locks if hasattr(locks, "run_job") else locks()
        return self._runner

    def options_for(self, job: Any) -> dict[str, Any]:
        """The defaults, overridden by the job function's :func:`job_options`."""
        options = dict(self.defaults)
        options.update(getattr(job.func, _ATTR, {}))
        return options

    def name_of(self, job: Any) -> str:
        """The job's name in the runs table: ``prefix + job.id``."""
        if _MADE_UP_ID.fullmatch(job.id):
            raise LockArgumentError(
                f"job {job.name!r} has no id of its own ({job.id!r} was made up by this "
                "scheduler and differs in every process): give it one, add_job(..., id=...)"
            )
        return f"{self.prefix}{job.id}"

    def _run_options(self, job: Any, run_time: datetime) -> tuple[bool, dict[str, Any]]:
        """(local, the keywords of ``run_job`` for this fire)."""
        options = self.options_for(job)
        local = bool(options.pop("local"))
        if options["wait"] is None:
            options["wait"] = _grace_left(job, run_time, options["at_most"])
        nxt = job.next_run_time
        options.update(
            fire_time=fire_time_of(run_time),
            next_fire_time=None if nxt is None else fire_time_of(nxt),
            on_skip="return",
        )
        return local, options

    def submit_job(self, job: Any, run_times: list[datetime]) -> None:
        """Take a job's fires. A ``local`` job's go to APScheduler's own rule
        (``max_instances``). A cluster job's are never turned away: they
        queue behind the fires of the same job this scheduler is still
        waiting on or running, and are taken one at a time in the order they
        came, each within its ``misfire_grace_time``.

        APScheduler would refuse a fire while ``max_instances`` earlier ones
        are under way, but here an earlier fire is mostly *waiting* for the
        job's lock, which another scheduler's run holds (under clock skew
        the schedulers try different fires at the same instant), and a fire
        refused is lost when no other scheduler fires it: a clock behind the
        others is the only one to fire the times before theirs. The lock
        already keeps the job's runs from overlapping, in this process and
        across the cluster; one fire at a time per job also keeps one thread
        per job, however many fires wait."""
        if self.options_for(job)["local"]:
            BaseExecutor.submit_job(self, job, run_times)
            return
        assert self._lock is not None, "This executor has not been started yet"
        self._warn_clock_bound(job)
        with self._lock:
            run_times = self._with_coalesced(job, list(run_times))
            queue = self._queued.get(job.id)
            if queue is not None:  # its drainer takes them in turn
                queue.append((job, run_times))
            else:
                self._queued[job.id] = deque([(job, run_times)])
                try:
                    self._start_drain(job.id)
                except BaseException:
                    del self._queued[job.id]
                    raise
            self._instances[job.id] += 1

    def _with_coalesced(self, job: Any, run_times: list[datetime]) -> list[datetime]:
        """``run_times``, after the fire times APScheduler coalesced into them
        (``coalesce=True``, its default: a scheduler that woke later than
        the next fire hands over only the last one due) that are still
        within their grace. Each fire time of a cluster job is a run of its
        own, and the one that coalesced here may be fired by no other
        scheduler (a clock behind the others is the only one to fire the
        times before theirs): a scheduler that woke 1.2 s late after its
        first fire lost the fire time between. Not for a job without a
        grace (it would run every fire time of a pause), nor for fire
        times older than the grace (they would only be missed)."""
        last = self._last_fire.get(job.id)
        self._last_fire[job.id] = run_times[-1]
        if last is None or not job.coalesce or job.misfire_grace_time is None:
            return run_times
        now = datetime.now(timezone.utc)
        grace = timedelta(seconds=job.misfire_grace_time)
        between: list[datetime] = []
        fire = job.trigger.get_next_fire_time(last, now)
        while fire is not None and last < fire < run_times[0] and len(between) < _MAX_FILLED:
            if now - fire <= grace:
                between.append(fire)
            last, fire = fire, job.trigger.get_next_fire_time(fire, now)
        return between + run_times

    def _start_drain(self, job_id: str) -> None:
        raise NotImplementedError

    def _next_fires(self, job_id: str) -> tuple[Any, list[datetime]] | None:
        """The next fires of ``job_id`` for its drainer, or None: then the
        drainer ends, and the next fires start another."""
        with self._lock:
            queue = self._queued.get(job_id)
            if not queue:
                self._queued.pop(job_id, None)
                return None
            return queue.popleft()

    def _abandon(self, job_id: str) -> None:
        """A drainer cut short (its executor shut down, a cancellation):
        the fires it had not taken are dropped, and said to be."""
        with self._lock:
            queue = self._queued.pop(job_id, None) or deque()
            for job, run_times in queue:
                self._instances[job_id] -= 1
                if self._instances[job_id] <= 0:
                    del self._instances[job_id]
                _log.warning(
                    "job %r: its fires at %s were not run (the executor stopped first)",
                    job.id,
                    ", ".join(t.isoformat() for t in run_times),
                )

    def _warn_clock_bound(self, job: Any) -> None:
        # A start taken from this host's clock (now + interval, to the
        # microsecond) gives fire times no other host shares.
        trigger = job.trigger
        start = None
        if isinstance(trigger, IntervalTrigger):
            start = trigger.start_date
        elif isinstance(trigger, DateTrigger):
            start = trigger.run_date
        if start is not None and start.microsecond and job.id not in self._warned:
            self._warned.add(job.id)
            _log.warning(
                "job %r: its trigger starts at %s, which looks taken from this host's clock; "
                "other schedulers will compute other fire times and each run its own. Give "
                "the trigger a fixed start_date (see docs/jobs.md, Clock skew)",
                job.id,
                start.isoformat(),
            )


def _missed(
    job: Any, alias: str, run_time: datetime, logger: logging.Logger
) -> JobExecutionEvent | None:
    """APScheduler's misfire rule, on this host's clock: the event of a fire
    past its grace, else None."""
    if job.misfire_grace_time is None:
        return None
    late = datetime.now(timezone.utc) - run_time
    if late <= timedelta(seconds=job.misfire_grace_time):
        return None
    logger.warning('Run time of job "%s" was missed by %s', job, late)
    return JobExecutionEvent(EVENT_JOB_MISSED, job.id, alias, run_time)


def _failed(job: Any, alias: str, run_time: datetime, logger: logging.Logger) -> JobExecutionEvent:
    """The event of a run that raised (called in its ``except``)."""
    exc, tb = sys.exc_info()[1:]
    event = JobExecutionEvent(
        EVENT_JOB_ERROR,
        job.id,
        alias,
        run_time,
        exception=exc,
        traceback="".join(traceback.format_tb(tb)),
    )
    logger.exception('Job "%s" raised an exception', job)
    traceback.clear_frames(tb)
    return event


def _ended(
    job: Any, alias: str, run_time: datetime, retval: Any, logger: logging.Logger
) -> JobExecutionEvent:
    """The event of a run that returned: executed here, or skipped."""
    if retval is SKIPPED:
        logger.info('Job "%s" (scheduled at %s) ran elsewhere: skipped', job, run_time)
        return JobExecutionEvent(EVENT_JOB_SKIPPED, job.id, alias, run_time)
    logger.info('Job "%s" executed successfully', job)
    return JobExecutionEvent(EVENT_JOB_EXECUTED, job.id, alias, run_time, retval=retval)


class OncePerClusterExecutor(_OncePerCluster, ThreadPoolExecutor):  # type: ignore[misc]
    """A thread-pool executor whose every fire of a job runs once across all
    the schedulers that use one lock table.

    ``locks`` is a :class:`~dblock.LockManager`, or a function returning one
    (called when the scheduler starts: for extensions that make their manager
    late, like Flask's). ``at_most`` (seconds) is the lease of a run: a
    process that dies in a run blocks the job for this long.
    ``at_least``, ``retry_failed`` as for :meth:`~dblock.LockManager.run_job`;
    ``prefix`` goes before each job id in the runs table (for two apps that
    share a table and job ids). :func:`job_options` on a function overrides
    these for its jobs.

    A job's runs hold one lock (``job:<id>``), whatever their fire time: a
    fire that finds it held by the run of *another* fire (a long run, or a
    scheduler whose clock is ahead running a later fire) waits for it, by
    default as long as the job's ``misfire_grace_time`` leaves (APScheduler's
    own rule: a fire starts within its grace or not at all; ``at_most`` for a
    job with no grace), then skips; ``wait=`` sets a fixed time instead.
    Fires of a job that come while an earlier one of this scheduler waits
    or runs queue behind it, whatever the job's ``max_instances`` (see
    :meth:`submit_job`): none is turned away; nor coalesced while within
    their grace.
    """

    def __init__(
        self,
        locks: JobRunner | Callable[[], JobRunner],
        *,
        at_most: float | timedelta,
        at_least: float | timedelta = 0,
        retry_failed: bool = False,
        wait: float | None = None,
        prefix: str = "",
        max_workers: int = 10,
        pool_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._setup(
            locks,
            at_most=at_most,
            at_least=at_least,
            retry_failed=retry_failed,
            wait=wait,
            prefix=prefix,
        )
        ThreadPoolExecutor.__init__(self, max_workers, dict(pool_kwargs or {}))

    def start(self, scheduler: Any, alias: str) -> None:
        super().start(scheduler, alias)
        self._resolve()
        self._warm_up()

    def _warm_up(self) -> None:
        """Reach the database once before the scheduler fires anything: a
        manager's first statement connects, asks the server what it is and
        imports its driver, which on a busy host took 1.4 s and more, and a
        scheduler's first fires waited for it (past a short
        ``misfire_grace_time``, missed). Bounded: a database that does not
        answer within :data:`_WARM_UP` seconds is left to the first fire."""
        probe = getattr(self._runner, "is_locked", None)
        if probe is None:  # (a runner that is not a manager)
            return
        future = self._pool.submit(probe, f"job:{self.prefix}warm-up")
        try:
            future.result(_WARM_UP)
        except Exception as exc:  # (a timeout included: the probe goes on meanwhile)
            _log.warning(
                "dblock: the executor's first look at the database, as the scheduler "
                "started, failed or took longer than %g s (%s); its first fire tries again",
                _WARM_UP,
                exc or type(exc).__name__,
            )

    def _start_drain(self, job_id: str) -> None:
        self._pool.submit(self._drain, job_id)

    def _drain(self, job_id: str) -> None:
        """Run a cluster job's fires as they were submitted, one after another
        (on one thread of the pool), each submission's events dispatched as
        APScheduler's run_job does when it ends."""
        finished = False
        try:
            while (fires := self._next_fires(job_id)) is not None:
                job, run_times = fires
                try:
                    events = self._run(job, job._jobstore_alias, run_times, self._logger.name)
                except BaseException as exc:
                    self._run_job_error(job.id, exc, exc.__traceback__)
                else:
                    self._run_job_success(job.id, events)
            finished = True
        finally:
            if not finished:
                self._abandon(job_id)

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:
        # BasePoolExecutor's, with our run function instead of APScheduler's
        # (a local job's fires: submit_job drains a cluster job's itself).
        self._warn_clock_bound(job)

        def done(f: Any) -> None:
            exc = f.exception()
            if exc is not None:
                self._run_job_error(job.id, exc, exc.__traceback__)
            else:
                self._run_job_success(job.id, f.result())

        f = self._pool.submit(self._run, job, job._jobstore_alias, run_times, self._logger.name)
        f.add_done_callback(done)

    def _run(
        self, job: Any, alias: str, run_times: list[datetime], logger_name: str
    ) -> list[JobExecutionEvent]:
        """APScheduler's ``run_job``, each run through ``locks.run_job``."""
        events: list[JobExecutionEvent] = []
        logger = logging.getLogger(logger_name)
        for run_time in run_times:
            missed = _missed(job, alias, run_time, logger)
            if missed is not None:
                events.append(missed)
                continue
            logger.info('Running job "%s" (scheduled at %s)', job, run_time)
            try:
                retval = self._call(job, run_time)
            except BaseException:
                events.append(_failed(job, alias, run_time, logger))
                continue
            events.append(_ended(job, alias, run_time, retval, logger))
        return events

    def _call(self, job: Any, run_time: datetime) -> Any:
        # The job's own arguments are bound in the partial: a job kwarg
        # named like one of run_job's options cannot collide with it.
        call = functools.partial(job.func, *job.args, **job.kwargs)
        local, options = self._run_options(job, run_time)
        if local:
            return call()
        return self._resolve().run_job(self.name_of(job), call, **options)


class OncePerClusterAsyncIOExecutor(_OncePerCluster, AsyncIOExecutor):  # type: ignore[misc]
    """The same for an ``AsyncIOScheduler``: ``locks`` is an
    :class:`~dblock.AsyncLockManager` (or a function returning one). A
    coroutine job runs on the event loop through ``await locks.run_job``;
    a plain function, as APScheduler's asyncio executor runs it, in the
    loop's default thread pool, through the blocking ``locks.sync.run_job``.
    Options as for :class:`OncePerClusterExecutor`."""

    def __init__(
        self,
        locks: Any,
        *,
        at_most: float | timedelta,
        at_least: float | timedelta = 0,
        retry_failed: bool = False,
        wait: float | None = None,
        prefix: str = "",
    ) -> None:
        self._setup(
            locks,
            at_most=at_most,
            at_least=at_least,
            retry_failed=retry_failed,
            wait=wait,
            prefix=prefix,
        )
        AsyncIOExecutor.__init__(self)

    def start(self, scheduler: Any, alias: str) -> None:
        super().start(scheduler, alias)
        self._resolve()

    def _start_drain(self, job_id: str) -> None:
        f = self._eventloop.create_task(self._drain(job_id))
        f.add_done_callback(self._pending_futures.discard)
        self._pending_futures.add(f)

    async def _drain(self, job_id: str) -> None:
        """As :meth:`OncePerClusterExecutor._drain`, on the event loop: a
        coroutine job awaited on it, a plain one in its thread pool."""
        finished = False
        try:
            while (fires := self._next_fires(job_id)) is not None:
                job, run_times = fires
                alias, name = job._jobstore_alias, self._logger.name
                try:
                    if iscoroutinefunction_partial(job.func):
                        events = await self._run_async(job, alias, run_times, name)
                    else:
                        events = await self._eventloop.run_in_executor(
                            None, self._run_sync, job, alias, run_times, name
                        )
                except Exception:
                    self._run_job_error(job.id, *sys.exc_info()[1:])
                else:
                    self._run_job_success(job.id, events)
            finished = True
        finally:
            if not finished:
                self._abandon(job_id)

    def _do_submit_job(self, job: Any, run_times: list[datetime]) -> None:
        # AsyncIOExecutor's, with our run functions instead of APScheduler's
        # (a local job's fires: submit_job drains a cluster job's itself).
        self._warn_clock_bound(job)

        def done(f: Any) -> None:
            self._pending_futures.discard(f)
            try:
                events = f.result()
            except BaseException:
                self._run_job_error(job.id, *sys.exc_info()[1:])
            else:
                self._run_job_success(job.id, events)

        alias, name = job._jobstore_alias, self._logger.name
        if iscoroutinefunction_partial(job.func):
            f = self._eventloop.create_task(self._run_async(job, alias, run_times, name))
        else:
            f = self._eventloop.run_in_executor(None, self._run_sync, job, alias, run_times, name)
        f.add_done_callback(done)
        self._pending_futures.add(f)

    async def _run_async(
        self, job: Any, alias: str, run_times: list[datetime], logger_name: str
    ) -> list[JobExecutionEvent]:
        events: list[JobExecutionEvent] = []
        logger = logging.getLogger(logger_name)
        for run_time in run_times:
            missed = _missed(job, alias, run_time, logger)
            if missed is not None:
                events.append(missed)
                continue
            logger.info('Running job "%s" (scheduled at %s)', job, run_time)
            call = functools.partial(job.func, *job.args, **job.kwargs)
            try:
                local, options = self._run_options(job, run_time)
                if local:
                    retval = await call()
                else:
                    retval = await self._resolve().run_job(self.name_of(job), call, **options)
            except BaseException:
                events.append(_failed(job, alias, run_time, logger))
                continue
            events.append(_ended(job, alias, run_time, retval, logger))
        return events

    def _run_sync(
        self, job: Any, alias: str, run_times: list[datetime], logger_name: str
    ) -> list[JobExecutionEvent]:
        events: list[JobExecutionEvent] = []
        logger = logging.getLogger(logger_name)
        for run_time in run_times:
            missed = _missed(job, alias, run_time, logger)
            if missed is not None:
                events.append(missed)
                continue
            logger.info('Running job "%s" (scheduled at %s)', job, run_time)
            call = functools.partial(job.func, *job.args, **job.kwargs)
            try:
                local, options = self._run_options(job, run_time)
                if local:
                    retval = call()
                else:
                    retval = self._resolve().sync.run_job(self.name_of(job), call, **options)
            except BaseException:
                events.append(_failed(job, alias, run_time, logger))
                continue
            events.append(_ended(job, alias, run_time, retval, logger))
        return events


def _grace_left(job: Any, run_time: datetime, at_most: float | timedelta) -> float:
    """How long this fire may still wait for its start: what is left of the
    job's misfire grace time on this host's clock (``at_most`` without one)."""
    if job.misfire_grace_time is None:
        return at_most.total_seconds() if isinstance(at_most, timedelta) else float(at_most)
    late = (datetime.now(timezone.utc) - run_time).total_seconds()
    return max(0.0, float(job.misfire_grace_time) - late)


def once_per_cluster(
    scheduler: Any,
    locks: Any,
    *,
    at_most: float | timedelta,
    alias: str = "default",
    **options: Any,
) -> OncePerClusterExecutor | OncePerClusterAsyncIOExecutor:
    """Make ``scheduler``'s executor ``alias`` (its default one unless told)
    dblock's, before the scheduler starts: an :class:`OncePerClusterExecutor`
    with a :class:`~dblock.LockManager`, or for an ``AsyncIOScheduler`` an
    :class:`OncePerClusterAsyncIOExecutor` with an
    :class:`~dblock.AsyncLockManager` (either, or a function returning one).

    ``scheduler`` is an APScheduler 3 scheduler, or Flask-APScheduler's
    ``APScheduler`` (its ``.scheduler`` is used). Returns the executor."""
    from apscheduler.schedulers.asyncio import AsyncIOScheduler

    inner = getattr(scheduler, "scheduler", scheduler)
    if inner.running:
        raise LockArgumentError(
            "once_per_cluster: the scheduler is running already; call it before start() "
            "(jobs already submitted to the old executor would run in every process)"
        )
    executor: OncePerClusterExecutor | OncePerClusterAsyncIOExecutor
    if isinstance(inner, AsyncIOScheduler):
        executor = OncePerClusterAsyncIOExecutor(locks, at_most=at_most, **options)
    else:
        executor = OncePerClusterExecutor(locks, at_most=at_most, **options)
    if alias in inner._executors:
        inner.remove_executor(alias)
    inner.add_executor(executor, alias)
    return executor


class Pausable(Protocol):
    """What :func:`run_on_leader` needs of a scheduler (APScheduler 3's have it)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


def run_on_leader(scheduler: Pausable, locks: Any, role: str, *, ttl: float | None = None) -> Any:
    """Run ``scheduler`` only while this process leads ``role``: the other
    way to run a scheduler in every process, one lock per cluster instead
    of one per job (see docs/leadership.md). Start the scheduler paused
    (``scheduler.start(paused=True)``), then call this: a campaign for the
    role resumes the scheduler at each election and pauses it as each term
    ends. Returns the :class:`~dblock.Leader` (``stop()`` it at shutdown; the
    manager's ``close()`` does too).

    For a blocking scheduler (``BackgroundScheduler``); jobs that must run
    once per fire time even across a change of leader keep
    :class:`OncePerClusterExecutor` as well (a new leader may fire at once
    what the old one had just run)."""
    leader = locks.leader(
        role,
        ttl=ttl,
        on_elected=lambda term: scheduler.resume(),
        on_revoked=lambda term: scheduler.pause(),
    )
    return leader.campaign()
