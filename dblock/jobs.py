"""Jobs that run once across the cluster: ShedLock's semantics on the database's clock.

::

    @locks.once("nightly-report", at_most=timedelta(minutes=30), at_least=timedelta(minutes=5))
    def nightly_report() -> None: ...

Every process may call ``nightly_report()`` at its scheduled time; one runs
it, the others skip (``SKIPPED`` back, or :class:`~dblock.JobSkipped` with
``on_skip="raise"``; an INFO line and the ``dblock.job.runs`` metric either
way). The job holds the exclusive lock ``job:<name>`` while it runs:

* ``at_most`` is the lock's lease: what a run whose process died blocks the
  job for at most. A live run is renewed like any lock (a long run goes on;
  if renewal fails, ``current_run().held`` turns ``lost`` as any lock does).
* ``at_least``: after a run that ended sooner than ``at_least`` after it
  started, the row stays with its lease ending at ``acquired_at +
  at_least``, both computed by the database, so a scheduler that fires a
  little later elsewhere skips. ShedLock "assumes synchronized clocks"
  for this; here no host's clock is ever read.
* ``per="fire_time"`` (or ``run_job(..., fire_time=t)``): one run per
  scheduled fire time, whenever the firings arrive. The record of runs
  (``<table>_runs``) has one row per ``(job, fire_time)``, inserted while
  the lock is held: a fire time whose run succeeded is skipped, one whose
  run failed (or whose runner died: its row still says ``running`` and the
  lock is free) is skipped too unless ``retry_failed=True``.

The decision is written once, without I/O (:func:`begin_steps`,
:func:`finish_steps`), and driven by the blocking locker
(:func:`run_job`) or the asyncio one (``AsyncLockManager.run_job``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import logging
import math
import os
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Final, TypedDict, TypeVar

from ._store.base import Steps
from ._store.jobs import KEPT, JobSQL, statements
from .config import MAX_SECONDS, MIN_TTL
from .errors import (
    BackendError,
    JobSkipped,
    LockArgumentError,
    LockBusy,
    LockLost,
    LockTimeout,
    ManagerClosed,
    SchemaMissing,
)
from .keys import check_key, db_text
from .lock import _STEPS, HeldLock, Locker, LockOptions, Op
from .registry import Waiter, current_owner
from .schema import FAILED, SUCCESS

if TYPE_CHECKING:
    from .manager import LockManager

__all__ = [
    "JOB_PREFIX",
    "SKIPPED",
    "JobOptions",
    "JobRun",
    "Skipped",
    "begin_steps",
    "current_run",
    "finish_steps",
    "job_key",
    "run_job",
]

log = logging.getLogger("dblock.jobs")

R = TypeVar("R")

#: A job's lock key is this prefix and its name (``job:nightly-report``).
JOB_PREFIX: Final = "job:"
_ON_SKIP = ("return", "raise")
_PER = (None, "fire_time")
_DETAIL_MAX = 255
_UTC = timezone.utc


class Skipped:
    """The type of :data:`SKIPPED`: false in a boolean test, one instance."""

    __slots__ = ()
    _instance: Skipped | None = None

    def __new__(cls) -> Skipped:
        if cls._instance is None:
            cls._instance = object.__new__(cls)
        return cls._instance

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "dblock.SKIPPED"

    def __reduce__(self) -> str:
        return "SKIPPED"  # unpickles as the module's own singleton


#: What a skipped job run returns (``on_skip="return"``): falsy, with a clear repr.
SKIPPED: Final = Skipped()


def check_duration(value: object, name: str, *, zero: bool) -> float:
    """Seconds from a number or a :class:`~datetime.timedelta`: finite, at
    most 366 days, > 0 (or >= 0 with ``zero``)."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LockArgumentError(f"{name} must be a number of seconds or a timedelta, got {value!r}")
    else:
        seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not zero):
        bound = ">= 0" if zero else "> 0"
        raise LockArgumentError(f"{name} must be a duration {bound}, got {value!r}")
    if seconds > MAX_SECONDS:
        raise LockArgumentError(f"{name} must be at most 366 days, got {value!r}")
    return seconds


def job_key(name: object) -> str:
    """The lock key of the job ``name`` (``job:<name>``); a clear error if
    ``name`` is not a str or makes no valid lock key."""
    if not isinstance(name, str) or not name:
        raise LockArgumentError(f"a job name must be a non-empty str, got {name!r}")
    try:
        return check_key(JOB_PREFIX + name)
    except LockArgumentError as exc:
        raise LockArgumentError(
            f"job name {name!r} makes no valid lock key ({JOB_PREFIX}<name>): {exc}"
        ) from None


def check_fire_time(value: object) -> datetime:
    """A scheduled fire time: an aware datetime, as UTC."""
    if not isinstance(value, datetime):
        raise LockArgumentError(f"fire_time must be a datetime, got {value!r}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise LockArgumentError(
            f"fire_time must be timezone-aware (schedulers give aware times), got {value!r}"
        )
    return value.astimezone(_UTC)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class JobOptions:
    """How a job runs; checked when made, before any SQL. Durations in seconds.

    at_most
        The job lock's lease (renewed while the run lives): how long a run
        whose process died keeps the job from running elsewhere.
    at_least
        The key stays taken until this long after the run started, however
        soon it ended (database time). At most ``at_most``.
    retry_failed
        With a fire time: run a fire time again whose run failed or died.
    on_skip
        ``"return"`` (:data:`SKIPPED`) or ``"raise"`` (:class:`~dblock.JobSkipped`).
    wait
        Seconds to wait for the job's key before skipping (0: skip at once).
    record
        Record unkeyed runs in the runs table too (``dblock jobs`` shows
        them); runs with a fire time are always recorded.
    """

    at_most: float
    at_least: float = 0.0
    retry_failed: bool = False
    on_skip: str = "return"
    wait: float = 0.0
    record: bool = True

    def __post_init__(self) -> None:
        at_most = check_duration(self.at_most, "at_most", zero=False)
        if at_most < MIN_TTL:  # the lease's minimum (see dblock.config.check_lease)
            raise LockArgumentError(
                f"at_most (the job lock's lease) must be at least {MIN_TTL:g} s, "
                f"got {self.at_most!r}"
            )
        at_least = check_duration(self.at_least, "at_least", zero=True)
        if at_least > at_most:
            raise LockArgumentError(
                f"at_least ({at_least:g} s) must not exceed at_most ({at_most:g} s): "
                "the key would be kept longer than the lease that bounds it"
            )
        object.__setattr__(self, "at_most", at_most)
        object.__setattr__(self, "at_least", at_least)
        object.__setattr__(self, "wait", check_duration(self.wait, "wait", zero=True))
        for name in ("retry_failed", "record"):
            if not isinstance(getattr(self, name), bool):
                value = getattr(self, name)
                raise LockArgumentError(f"{name} must be True or False, got {value!r}")
        if self.on_skip not in _ON_SKIP:
            raise LockArgumentError(f"on_skip must be 'return' or 'raise', got {self.on_skip!r}")

    @classmethod
    def make(cls, manager: LockManager, given: Mapping[str, Any]) -> JobOptions:
        """The options of one job (:class:`JobArgs`, names checked);
        ``at_most`` not given, or ``None``, is the manager's ``ttl``."""
        unknown = sorted(set(given) - JOB_ARGS)
        if unknown:
            raise LockArgumentError(
                f"unknown job option{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(map(repr, unknown))}; the options are: {', '.join(sorted(JOB_ARGS))}"
            )
        at_most = given.get("at_most")
        return cls(
            at_most=manager.config.ttl if at_most is None else at_most,
            at_least=given.get("at_least", 0.0),
            retry_failed=given.get("retry_failed", False),
            on_skip=given.get("on_skip", "return"),
            wait=given.get("wait", 0.0),
            record=given.get("record", True),
        )


def prepare_run(
    manager: LockManager,
    name: str,
    func: object,
    given: Mapping[str, Any],
    *,
    fire_time: datetime | None,
    next_fire_time: datetime | None,
) -> tuple[str, JobOptions, datetime | None, datetime | None]:
    """What ``run_job`` checks before any SQL, on both faces: the job's key,
    its options, its fire times; a clear error for anything wrong."""
    key = job_key(name)
    options = JobOptions.make(manager, given)
    fire = None if fire_time is None else check_fire_time(fire_time)
    nxt = None if next_fire_time is None else check_fire_time(next_fire_time)
    if not callable(func):
        raise LockArgumentError(f"run_job needs a callable to run, got {func!r}")
    return key, options, fire, nxt


class JobArgs(TypedDict, total=False):
    """The options of a job, written once for ``once`` and ``run_job`` on
    both faces (see :class:`JobOptions` for their meaning and defaults)."""

    at_most: float | timedelta | None
    at_least: float | timedelta
    retry_failed: bool
    on_skip: str
    wait: float | timedelta
    record: bool


#: The names of :class:`JobArgs`.
JOB_ARGS: frozenset[str] = JobArgs.__optional_keys__ | JobArgs.__required_keys__


@dataclasses.dataclass(frozen=True, slots=True)
class JobRun:
    """The run in progress, as :func:`current_run` gives it to the job."""

    name: str
    key: str
    fire_time: datetime | None
    #: Its row in the record of runs (None: not recorded).
    run_id: str | None
    #: The job's lock: ``held.lost``, ``held.check()``, ``held.fence``.
    held: HeldLock
    #: 1, or more for a fire time run again (``retry_failed``).
    attempt: int = 1


@dataclasses.dataclass(frozen=True, slots=True)
class _Skip:
    reason: str
    detail: str
    level: int
    holder: str | None = None


_current: contextvars.ContextVar[JobRun | None] = contextvars.ContextVar(
    "dblock_job_run", default=None
)


def current_run() -> JobRun | None:
    """The job run this code runs in (thread or task), or None."""
    return _current.get()


# Tables whose missing record of runs was reported already (once per process).
_warned_missing: set[str] = set()


def begin_steps(
    locker: Locker,
    name: str,
    key: str,
    options: JobOptions,
    *,
    fire_time: datetime | None,
    next_fire: datetime | None,
    me: object,
    waiter_type: type[Waiter],
) -> Op[JobRun | _Skip]:
    """Take the job's key, then (with a fire time, or ``record``) its row in
    the record of runs; a :class:`_Skip` when it must not run. On any
    exception the key is given back."""
    if locker.kind_guard is not None:
        locker.kind_guard(key)  # as Locker.acquire: a key is used with one kind of lock
    if locker._local:
        entry = locker.registry.get(key)
        if entry is not None and entry.owner is me:
            # Waiting for our own key would wait for ourselves.
            return _Skip("running", "this thread (or task) is running it already", 1)
    blocking = options.wait > 0
    defaults = locker.defaults
    lock_options = LockOptions(renew=True, max_hold=defaults.max_hold, on_lost=defaults.on_lost)
    try:
        held = yield from locker.acquire_steps(
            key,
            me,
            blocking=blocking,
            timeout=options.wait if blocking else 0.0,
            ttl=options.at_most,
            opts=lock_options,
            waiter_type=waiter_type,
        )
    except (LockBusy, LockTimeout) as exc:
        holder = exc.holder
        if holder is not None and holder.endswith(KEPT):
            return _Skip(
                "kept",
                f"its last run, on {holder[: -len(KEPT)]}, ended less than at_least "
                f"after it began: its key {key!r} is kept until then",
                exc.level,
                holder,
            )
        who = holder or ("another thread of this process" if exc.level == 1 else None)
        where = f"held by {who}" if who else "held"
        return _Skip(
            "running", f"its key {key!r} is {where}: a run is in progress", exc.level, holder
        )
    if fire_time is None and not options.record:
        return JobRun(name, key, None, None, held)
    try:
        return (yield from _record_steps(locker, held, name, options, fire_time, next_fire, me))
    except BaseException:
        yield from _let_go(locker, held)
        raise


def _record_steps(  # noqa: PLR0917 - internal, one caller
    locker: Locker,
    held: HeldLock,
    name: str,
    options: JobOptions,
    fire_time: datetime | None,
    next_fire: datetime | None,
    me: object,
) -> Op[JobRun | _Skip]:
    sql = statements(locker.store)
    run_id = os.urandom(16).hex()
    runner = locker.owner_label(me)

    def insert() -> Steps[bool]:
        return sql.insert_steps(
            run_id=run_id,
            job=name,
            fire_time=fire_time,
            runner=runner,
            token=held.token,
            next_fire=next_fire,
        )

    try:
        return (
            yield from _decide_steps(
                locker, held, sql, insert, name, options, fire_time, next_fire, run_id, runner
            )
        )
    except BaseException:
        # Interrupted (a signal, a cancellation) or failed after our row may
        # have been written: a fire time must not look like a run that died.
        with contextlib.suppress(Exception):
            yield (_STEPS, sql.forget_steps(run_id))
        raise


def _decide_steps(  # noqa: PLR0917 - internal, one caller
    locker: Locker,
    held: HeldLock,
    sql: JobSQL,
    insert: Callable[[], Steps[bool]],
    name: str,
    options: JobOptions,
    fire_time: datetime | None,
    next_fire: datetime | None,
    run_id: str,
    runner: str,
) -> Op[JobRun | _Skip]:
    try:
        inserted = yield (_STEPS, insert())
    except SchemaMissing:
        if fire_time is not None:
            names = locker.store.names
            raise SchemaMissing(
                names.table,
                locker.store.executor._url,
                missing=f"the record of job runs {names.runs_table!r} (schema revision 0003)",
            ) from None
        if sql.runs_name not in _warned_missing:
            _warned_missing.add(sql.runs_name)
            log.warning(
                "dblock: the record of job runs %r does not exist (run `dblock migrate`); "
                "jobs run without it, and `dblock jobs` shows nothing",
                sql.runs_name,
            )
        return JobRun(name, held.key, None, None, held)
    if inserted:
        return JobRun(name, held.key, fire_time, run_id, held)
    assert fire_time is not None  # an unkeyed run never collides
    when = fire_time.isoformat()
    found = yield (_STEPS, sql.read_steps(name, fire_time))
    if found is None:  # pruned between the two statements: one more try
        inserted = yield (_STEPS, insert())
        if inserted:
            return JobRun(name, held.key, fire_time, run_id, held)
        skip = _Skip("done", f"its run for {when} was recorded by another runner", 0)
    elif found.outcome == SUCCESS:
        skip = _Skip(
            "done", f"its run for {when} succeeded on {found.runner} (attempt {found.attempt})", 0
        )
    elif not options.retry_failed:
        how = "failed" if found.outcome == FAILED else "died (its runner lost the key)"
        skip = _Skip(
            "failed",
            f"its run for {when} on {found.runner} {how}; retry_failed=True runs it again",
            0,
        )
    else:
        retaken = yield (
            _STEPS,
            sql.retake_steps(
                old=found.run_id,
                run_id=run_id,
                job=name,
                fire_time=fire_time,
                runner=runner,
                token=held.token,
                next_fire=next_fire,
            ),
        )
        if retaken:
            log.info(
                "dblock: job %r runs its fire time %s again (attempt %d; the last %s on %s)",
                name,
                when,
                found.attempt + 1,
                found.outcome,
                found.runner,
            )
            return JobRun(name, held.key, fire_time, run_id, held, found.attempt + 1)
        skip = _Skip("done", f"another runner took its run for {when} meanwhile", 0)
    yield from _let_go(locker, held)
    return skip


def _let_go(locker: Locker, held: HeldLock) -> Op[None]:
    """Release a key the job will not run under (a lost key needs no release)."""
    with contextlib.suppress(LockLost):
        yield from locker.release_steps(held, False)


def finish_steps(
    locker: Locker, run: JobRun, outcome: str, detail: str | None, keep: float
) -> Op[bool]:
    """Record how the run ended, then release its key (kept ``keep`` seconds
    after the run began). The record first: a runner that gets the key next
    must find the fire time done. Raises :class:`~dblock.LockLost` as a
    lock's release does when the key was lost during the run."""
    if run.run_id is not None:
        try:
            yield (_STEPS, statements(locker.store).finish_steps(run.run_id, outcome, detail))
        except BackendError as exc:
            log.error(
                "dblock: job %r ended (%s) but its record could not be written: %s",
                run.name,
                outcome,
                exc,
            )
    return (yield from locker.release_steps(run.held, False, keep=keep))


def describe(exc: BaseException) -> str:
    """A failed run's ``detail``: the exception, one line, storable (an
    exception may say it itself, as ``job_detail``: ``exit status 3``)."""
    own = getattr(exc, "job_detail", None)
    if isinstance(own, str):
        return db_text(own)[:_DETAIL_MAX]
    text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    return db_text(text)[:_DETAIL_MAX]


def skipped(manager_telemetry: Any, name: str, key: str, skip: _Skip, on_skip: str) -> Skipped:
    """Report a skip (INFO, the metric); raise it or return :data:`SKIPPED`."""
    log.info("dblock: job %r skipped: %s", name, skip.detail)
    if manager_telemetry is not None:
        manager_telemetry.job_run("skipped", skip.reason)
    if on_skip == "raise":
        raise JobSkipped(
            name,
            key=key,
            reason=skip.reason,
            detail=skip.detail,
            level=skip.level,
            holder=skip.holder,
        )
    return SKIPPED


def ended(manager_telemetry: Any, run: JobRun, outcome: str) -> None:
    log.debug("dblock: job %r ran (%s)", run.name, outcome)
    if manager_telemetry is not None:
        manager_telemetry.job_run(outcome, None)


def takes_keyword(func: Callable[..., Any], name: str) -> bool:
    """Whether ``func`` accepts the keyword argument ``name``."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    param = params.get(name)
    if param is not None:
        return param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
    return any(p.kind is p.VAR_KEYWORD for p in params.values())


def check_per(per: object) -> str | None:
    if per not in _PER:
        raise LockArgumentError(f"per must be None or 'fire_time', got {per!r}")
    return per


def run_job(  # noqa: PLR0917 - internal: the manager's run_job and once call it
    manager: LockManager,
    name: str,
    key: str,
    options: JobOptions,
    func: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    fire_time: datetime | None,
    next_fire: datetime | None,
) -> R | Skipped:
    """Run ``func(*args, **kwargs)`` as a run of the job, on this thread."""
    locker = manager._locker
    telemetry = locker.telemetry
    if manager._closed:
        raise ManagerClosed("this LockManager is closed")
    got = locker.run(
        begin_steps(
            locker,
            name,
            key,
            options,
            fire_time=fire_time,
            next_fire=next_fire,
            me=current_owner(),
            waiter_type=Waiter,
        )
    )
    if isinstance(got, _Skip):
        return skipped(telemetry, name, key, got, options.on_skip)
    token = _current.set(got)
    try:
        result = func(*args, **kwargs)
    except BaseException as exc:
        _current.reset(token)
        ended(telemetry, got, FAILED)
        try:
            locker.run(finish_steps(locker, got, FAILED, describe(exc), options.at_least))
        except LockLost:
            log.exception("dblock: job %r lost its key while it ran and failed", name)
        raise
    _current.reset(token)
    ended(telemetry, got, SUCCESS)
    locker.run(finish_steps(locker, got, SUCCESS, None, options.at_least))
    return result
