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

A run is written once, without I/O (:func:`run_steps`: the key, the
record, the call, the finish, under one ``try``), and driven by the
blocking locker (:func:`run_job`) or the asyncio one
(``AsyncLockManager.run_job``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import logging
import math
import os
import weakref
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Final, Protocol, TypedDict, TypeVar

from ._store.base import Steps
from ._store.jobs import KEPT, JobSQL, RunRow, statements
from .config import MAX_SECONDS, MIN_TTL
from .errors import (
    BackendError,
    ConnectionLost,
    DatabaseUnreachable,
    JobSkipped,
    LockArgumentError,
    LockBusy,
    LockLost,
    LockTimeout,
    SchemaMissing,
)
from .keys import check_key, db_text
from .lock import HeldLock, Locker, LockOptions
from .registry import Waiter, current_owner
from .schema import FAILED, RUNNING, SUCCESS
from .steps import Call, Op, Run, Sleep

if TYPE_CHECKING:
    from .config import Config


class Configured(Protocol):
    """What a job's options read of their manager: its configuration (the
    manager is a floor above jobs; both faces pass themselves)."""

    @property
    def config(self) -> Config: ...


__all__ = [
    "JOB_PREFIX",
    "SKIPPED",
    "JobOptions",
    "JobRun",
    "Skipped",
    "current_run",
    "finish_steps",
    "job_key",
    "run_job",
    "run_steps",
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
        None (the default): skip at once without a fire time; with one, wait
        up to ``at_most`` for the run in progress (of another fire time) to
        end, so that no fire time is lost because another was running.
    record
        Record unkeyed runs in the runs table too (``dblock jobs`` shows
        them); runs with a fire time are always recorded.
    """

    at_most: float
    at_least: float = 0.0
    retry_failed: bool = False
    on_skip: str = "return"
    wait: float | None = None
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
        if self.wait is not None:
            object.__setattr__(self, "wait", check_duration(self.wait, "wait", zero=True))
        for name in ("retry_failed", "record"):
            if not isinstance(getattr(self, name), bool):
                value = getattr(self, name)
                raise LockArgumentError(f"{name} must be True or False, got {value!r}")
        if self.on_skip not in _ON_SKIP:
            raise LockArgumentError(f"on_skip must be 'return' or 'raise', got {self.on_skip!r}")

    @classmethod
    def make(cls, manager: Configured, given: Mapping[str, Any]) -> JobOptions:
        """The options of one job (:class:`JobArgs`, names checked);
        ``at_most`` not given, or ``None``, is the manager's ``ttl``, or
        ``at_least`` if that is longer (see :func:`default_at_most`)."""
        unknown = sorted(set(given) - JOB_ARGS)
        if unknown:
            raise LockArgumentError(
                f"unknown job option{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(map(repr, unknown))}; the options are: {', '.join(sorted(JOB_ARGS))}"
            )
        at_most = given.get("at_most")
        at_least = given.get("at_least", 0.0)
        return cls(
            at_most=default_at_most(manager.config.ttl, at_least) if at_most is None else at_most,
            at_least=at_least,
            retry_failed=given.get("retry_failed", False),
            on_skip=given.get("on_skip", "return"),
            wait=given.get("wait"),
            record=given.get("record", True),
        )


def default_at_most(ttl: float, at_least: object) -> float:
    """``at_most`` when only ``at_least`` is given: the lock's ``ttl``, or
    ``at_least`` if that is longer. ``--at-least 5m`` alone means "keep the
    key 5 minutes"; a lease shorter than that would refuse it, and a cron
    line that fails every night is no default."""
    try:
        keep = check_duration(at_least, "at_least", zero=True)
    except LockArgumentError:
        return ttl  # (JobOptions names the mistake)
    return max(ttl, keep)


def prepare_run(
    manager: Configured, name: str, func: object, given: Mapping[str, Any]
) -> tuple[Job, datetime | None, datetime | None]:
    """What ``run_job`` checks before any SQL, on both faces: the job (its
    key, its options), its fire times; a clear error for anything wrong.
    ``given`` is the call's keywords: the :class:`JobArgs` and
    ``fire_time``, ``next_fire_time`` (each face passes its ``locals()``, so
    the names are listed once, in :class:`JobArgs`)."""
    key = job_key(name)
    options = JobOptions.make(manager, {k: v for k, v in given.items() if k in JOB_ARGS})
    fire_time, next_fire_time = given.get("fire_time"), given.get("next_fire_time")
    fire = None if fire_time is None else check_fire_time(fire_time)
    nxt = None if next_fire_time is None else check_fire_time(next_fire_time)
    if not callable(func):
        raise LockArgumentError(f"run_job needs a callable to run, got {func!r}")
    return Job(name, key, options), fire, nxt


@dataclasses.dataclass(frozen=True, slots=True)
class Job:
    """A job as both faces run it, checked before any SQL: the steps of one
    of its calls (:func:`run_steps`) and what their outcome means. A face
    only drives the steps: the blocking locker, or the asyncio driver."""

    name: str
    key: str
    options: JobOptions

    def steps(  # noqa: PLR0917 - the call, as both faces hold it
        self,
        locker: Locker,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        fire_time: datetime | None,
        next_fire: datetime | None,
        waiter_type: type[Waiter],
    ) -> Op[Any]:
        """The steps of the call ``func(*args, **kwargs)`` by the calling
        thread (or task)."""
        return run_steps(
            locker,
            self.name,
            self.key,
            self.options,
            lambda: func(*args, **kwargs),
            fire_time=fire_time,
            next_fire=next_fire,
            me=current_owner(),
            waiter_type=waiter_type,
        )

    def outcome(self, locker: Locker, got: Any) -> Any:
        """What the call returns: the function's result, or a skip reported
        (and raised with ``on_skip="raise"``)."""
        if isinstance(got, Skip):
            return skipped(locker.telemetry, self.name, self.key, got, self.options.on_skip)
        return got


class Once:
    """What ``once`` checks on both faces: the job and ``per`` when it is
    made, the function when it decorates, the fire times at each call."""

    __slots__ = ("job", "per")

    def __init__(
        self, manager: Configured, name: str, per: object, options: Mapping[str, Any]
    ) -> None:
        key = job_key(name)
        self.per = check_per(per)
        self.job = Job(name, key, JobOptions.make(manager, options))

    def passes_fire(self, func: Callable[..., Any], *, coroutine: bool) -> bool:
        """Refuse a function of the other face; whether it takes ``fire_time``."""
        if coroutine and not inspect.iscoroutinefunction(func):
            raise LockArgumentError(
                f"{getattr(func, '__qualname__', func)!r} is not a coroutine function: "
                "use LockManager.once"
            )
        if not coroutine and inspect.iscoroutinefunction(func):
            raise LockArgumentError(
                f"{func.__qualname__} is a coroutine function: use AsyncLockManager.once"
            )
        return takes_keyword(func, "fire_time")

    def fire_times(
        self, passes_fire: bool, kwargs: dict[str, Any]
    ) -> tuple[datetime | None, datetime | None]:
        return fire_times(self.per, passes_fire, kwargs)


class JobArgs(TypedDict, total=False):
    """The options of a job, written once for ``once`` and ``run_job`` on
    both faces (see :class:`JobOptions` for their meaning and defaults)."""

    at_most: float | timedelta | None
    at_least: float | timedelta
    retry_failed: bool
    on_skip: str
    wait: float | timedelta | None
    record: bool


#: The names of :class:`JobArgs`.
JOB_ARGS: frozenset[str] = JobArgs.__optional_keys__ | JobArgs.__required_keys__


@dataclasses.dataclass(frozen=True)  # (no slots: weakly referenced, see current_run)
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
class Skip:
    """Why a run must not run: what :func:`run_steps` returns instead of
    the function's result (each face turns it into :data:`SKIPPED` or
    :class:`~dblock.JobSkipped` through :meth:`Job.outcome`)."""

    reason: str
    detail: str
    level: int
    holder: str | None = None


_Skip = Skip  # the former name


_current: contextvars.ContextVar[weakref.ref[JobRun] | None] = contextvars.ContextVar(
    "dblock_job_run", default=None
)


def current_run() -> JobRun | None:
    """The job run this code runs in (thread or task), or None."""
    ref = _current.get()
    return None if ref is None else ref()


# Tables whose missing record of runs was reported already (once per process).
_warned_missing: set[str] = set()


def run_steps(
    locker: Locker,
    name: str,
    key: str,
    options: JobOptions,
    call: Callable[[], Any],
    *,
    fire_time: datetime | None,
    next_fire: datetime | None,
    me: object,
    waiter_type: type[Waiter],
) -> Op[Any]:
    """One run, written once for both faces: take the job's key, then (with
    a fire time, or ``record``) its row in the record of runs; run ``call``
    (the driver's ``CALL``: called, or awaited, on the caller's thread or
    task); record how it ended and release the key. Returns what ``call``
    returned, or a :class:`Skip` when the job must not run.

    From the moment the key is ours, one ``try`` owns it: whatever is raised
    wherever (the job's exception, a signal handler's, a cancellation), the
    record is settled and the key given back before it propagates, by this
    generator, not by whoever drives it."""
    if fire_time is not None:
        # A fire time that ran already is skipped without taking the job's
        # key: a look that held it would turn away, at that very instant,
        # another host firing a fire time that never ran (clocks a multiple
        # of the period apart fire different fire times at once), and that
        # one would be lost.
        done = yield from _ran_already(locker, name, options, fire_time)
        if done is not None:
            return done
    held = yield from _take_steps(locker, key, options, me, waiter_type, fire_time)
    if isinstance(held, Skip):
        return held
    # (Interrupted before the next frame's ``try``, the lock is released
    # when collected, as any dropped HeldLock is.)
    return (
        yield from _held_run(
            locker, held, name, options, call, fire_time=fire_time, next_fire=next_fire, me=me
        )
    )


def _held_run(  # noqa: PLR0912 - one frame owns the run from key to finish (see below)
    locker: Locker,
    held: HeldLock,
    name: str,
    options: JobOptions,
    call: Callable[[], Any],
    *,
    fire_time: datetime | None,
    next_fire: datetime | None,
    me: object,
) -> Op[Any]:
    """:func:`run_steps` once the job's key is ours: from here one ``try``
    owns it (see there)."""
    run: JobRun | Skip | None = None
    detail: str | None = None  # how the run failed (None: it did not, or not yet)
    closing = False
    began = True  # False: the call says it never started what it runs
    try:
        if fire_time is None and not options.record:
            run = JobRun(name, held.key, None, None, held)
        else:
            run = yield from _record_steps(locker, held, name, options, fire_time, next_fire, me)
            if isinstance(run, Skip):
                return run  # (its key given back already)
        # Weakly: a reset missed (an interruption in the instant between
        # set() and the assignment) must not keep the run, and its lock,
        # alive in the thread's context for as long as the thread lives.
        published = _current.set(weakref.ref(run))
        try:
            return (yield Call(call))
        finally:
            _current.reset(published)
    except GeneratorExit:
        # Being closed, it cannot yield: the lock, dropped with it, is
        # released when collected.
        closing = True
        raise
    except BaseException as exc:
        # (The text, not the exception: a local holding it would make a
        # cycle through its traceback and this frame, keeping the run alive.)
        detail = describe(exc)
        began = not getattr(exc, "job_not_run", False)
        raise
    finally:
        if not closing:
            try:
                if isinstance(run, JobRun) and not began:
                    yield from _unrun(locker, run)
                elif isinstance(run, JobRun):
                    yield from _finish_run(locker, run, detail, options.at_least)
                elif run is None and detail is not None:  # it never began: give the key back
                    yield from _let_go(locker, held)
            except LockLost:
                raise  # (the finish's own outcome: lost during a run that succeeded)
            except BaseException:
                # Cut short between the finish's statements (a signal
                # handler's exception lands after any call): what it had not
                # done yet goes on the renewal thread.
                _finish_later(locker, run if isinstance(run, JobRun) else None, held, detail)
                raise


def _ran_already(
    locker: Locker, name: str, options: JobOptions, fire_time: datetime
) -> Op[Skip | None]:
    """The skip of a fire time whose run is settled (it succeeded, or failed
    and is not to be retried), read without the job's key; None if it must
    be decided under the key (never recorded, still ``running``: alive or
    died, only the key tells; or to be retried)."""
    sql = statements(locker.store)
    try:
        found = yield Run(sql.read_steps(name, fire_time))
    except SchemaMissing:
        names = locker.store.names
        raise SchemaMissing(
            names.table,
            locker.store.executor._url,
            missing=f"the record of job runs {names.runs_table!r} (schema revision 0003)",
        ) from None
    if found is None or found.outcome == RUNNING:
        return None
    if found.outcome == SUCCESS or not options.retry_failed:
        return _settled(found, fire_time)
    return None


def _settled(found: RunRow, fire_time: datetime) -> Skip:
    """The skip of a fire time whose run ``found`` succeeded, failed or died."""
    when = fire_time.isoformat()
    if found.outcome == SUCCESS:
        return Skip(
            "done", f"its run for {when} succeeded on {found.runner} (attempt {found.attempt})", 0
        )
    how = "failed" if found.outcome == FAILED else "died (its runner lost the key)"
    return Skip(
        "failed",
        f"its run for {when} on {found.runner} {how}; retry_failed=True runs it again",
        0,
    )


def _unrun(locker: Locker, run: JobRun) -> Op[None]:
    """Undo a run whose call raised an exception marked ``job_not_run``
    (``dblock run``'s command could not be executed): nothing ran, so its
    record goes (its fire time is not done, nor failed) and its key is
    given back at once, ``at_least`` or not."""
    if run.run_id is not None:
        try:
            yield Run(statements(locker.store).forget_steps(run.run_id))
        except BackendError as exc:
            log.error("dblock: job %r did not start, but its record stays: %s", run.name, exc)
        except BaseException:
            yield from _let_go(locker, run.held)
            raise
    yield from _let_go(locker, run.held)


def _take_steps(  # noqa: PLR0917 - internal, one caller
    locker: Locker,
    key: str,
    options: JobOptions,
    me: object,
    waiter_type: type[Waiter],
    fire_time: datetime | None,
) -> Op[HeldLock | Skip]:
    """The job's key, or the skip that says who has it. Without a ``wait``
    of its own, a run of a fire time (one that has not run: see
    :func:`_ran_already`) waits up to ``at_most`` for the run that holds
    the key: the job runs one fire time at a time, and skipping this one
    would lose it, as nobody fires it again."""
    wait = options.wait
    if wait is None:
        wait = options.at_most if fire_time is not None else 0.0
    if locker.kind_guard is not None:
        locker.kind_guard(key)  # as Locker.acquire: a key is used with one kind of lock
    if locker.local:
        entry = locker.registry.get(key)
        if entry is not None and entry.owner is me:
            # Waiting for our own key would wait for ourselves.
            return Skip("running", "this thread (or task) is running it already", 1)
    blocking = wait > 0
    defaults = locker.defaults
    lock_options = LockOptions(renew=True, max_hold=defaults.max_hold, on_lost=defaults.on_lost)
    if blocking and options.wait is None:
        # The wait a fire time gets by default is for a run in progress: a
        # key kept for ``at_least`` after a run ended says the job ran less
        # than that ago, and is a skip at once, as without a fire time.
        try:
            return (
                yield from locker.acquire_steps(
                    key,
                    me,
                    blocking=False,
                    timeout=0.0,
                    ttl=options.at_most,
                    opts=lock_options,
                    waiter_type=waiter_type,
                )
            )
        except (LockBusy, LockTimeout) as exc:
            if exc.holder is not None and exc.holder.endswith(KEPT):
                return _busy(key, exc)
    try:
        return (
            yield from locker.acquire_steps(
                key,
                me,
                blocking=blocking,
                timeout=wait if blocking else 0.0,
                ttl=options.at_most,
                opts=lock_options,
                waiter_type=waiter_type,
            )
        )
    except (LockBusy, LockTimeout) as exc:
        return _busy(key, exc)


def _finish_later(locker: Locker, run: JobRun | None, held: HeldLock, detail: str | None) -> None:
    """On the renewal thread, what an interrupted finish had not done: the
    record (its statement changes only a run still recorded as running), then
    the key (as soon as it can: ``at_least`` is not kept then). Either is a
    no-op if the finish had done it already."""
    if run is not None and run.run_id is not None:
        _record_later(locker, run, run.run_id, SUCCESS if detail is None else FAILED, detail)
    locker.release_later(held)


def _record_later(
    locker: Locker, run: JobRun, run_id: str, outcome: str, detail: str | None
) -> None:
    """Write the run's outcome on the renewal thread (its statement changes
    only a run still recorded as running: a no-op if it was written)."""

    def record() -> None:
        try:
            locker.store.drive(statements(locker.store).finish_steps(run_id, outcome, detail))
        except Exception as exc:  # (the renewal thread must go on)
            log.error(
                "dblock: job %r ended (%s) but its record could not be written: %s",
                run.name,
                outcome,
                exc,
            )

    locker.renewer.post(record)


def _finish_run(locker: Locker, run: JobRun, detail: str | None, keep: float) -> Op[None]:
    """Record how ``run`` ended (``detail``: how it failed, None if it did
    not) and release its key (:func:`finish_steps`). A key lost during a run
    that succeeded raises :class:`~dblock.LockLost`, as a lock's release
    does; during one that failed it is logged, and the job's own exception
    goes on."""
    outcome = SUCCESS if detail is None else FAILED
    ended(locker.telemetry, run, outcome)
    try:
        yield from finish_steps(locker, run, outcome, detail, keep)
    except LockLost as exc:
        if detail is None:
            raise
        log.error("dblock: job %r lost its key while it ran and failed: %s", run.name, exc)


def _busy(key: str, exc: LockBusy | LockTimeout) -> Skip:
    """The skip for a key another runner holds (or keeps, ``at_least``)."""
    holder = exc.holder
    if holder is not None and holder.endswith(KEPT):
        return Skip(
            "kept",
            f"its last run, on {holder[: -len(KEPT)]}, ended less than at_least "
            f"after it began: its key {key!r} is kept until then",
            exc.level,
            holder,
        )
    who = holder or ("another thread of this process" if exc.level == 1 else None)
    where = f"held by {who}" if who else "held"
    return Skip("running", f"its key {key!r} is {where}: a run is in progress", exc.level, holder)


def _record_steps(  # noqa: PLR0917 - internal, one caller
    locker: Locker,
    held: HeldLock,
    name: str,
    options: JobOptions,
    fire_time: datetime | None,
    next_fire: datetime | None,
    me: object,
) -> Op[JobRun | Skip]:
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
            yield Run(sql.forget_steps(run_id))
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
) -> Op[JobRun | Skip]:
    try:
        inserted = yield Run(insert())
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
    found = yield Run(sql.read_steps(name, fire_time))
    if found is None:  # pruned between the two statements: one more try
        inserted = yield Run(insert())
        if inserted:
            return JobRun(name, held.key, fire_time, run_id, held)
        skip = Skip("done", f"its run for {when} was recorded by another runner", 0)
    elif found.outcome == SUCCESS or not options.retry_failed:
        skip = _settled(found, fire_time)
    else:
        retaken = yield Run(
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
        skip = Skip("done", f"another runner took its run for {when} meanwhile", 0)
    yield from _let_go(locker, held)
    return skip


def _let_go(locker: Locker, held: HeldLock, keep: float = 0.0) -> Op[None]:
    """Release a key the job will not run under, or whose run is being cut
    short (a lost key needs no release)."""
    with contextlib.suppress(LockLost):
        yield from locker.release_steps(held, False, keep=keep)


def finish_steps(
    locker: Locker, run: JobRun, outcome: str, detail: str | None, keep: float
) -> Op[bool]:
    """Record how the run ended, then release its key (kept ``keep`` seconds
    after the run began). The record first: a runner that gets the key next
    must find the fire time done. Raises :class:`~dblock.LockLost` as a
    lock's release does when the key was lost during the run."""
    if run.run_id is not None:
        try:
            yield from _record_steps_outcome(locker, run, run.run_id, outcome, detail)
        except BaseException:
            # Interrupted while writing it: the key goes all the same.
            yield from _let_go(locker, run.held, keep)
            raise
    return (yield from locker.release_steps(run.held, False, keep=keep))


#: How often a run's outcome is tried again while the database does not
#: answer (doubling from the first, up to the second), in seconds.
_RECORD_PAUSES = (0.05, 1.0)


def _record_steps_outcome(
    locker: Locker, run: JobRun, run_id: str, outcome: str, detail: str | None
) -> Op[None]:
    """Write how the run ended. While the database does not answer (a
    restart, a failover), try again for as long as the run's key is ours:
    renewal keeps it meanwhile, and the key is given back (or kept for
    ``at_least``) only once the outcome is written, so that whoever takes it
    next finds the fire time done, not a run that died and, with
    ``retry_failed``, runs it a second time. Once the lease is over the key
    may be another runner's: the record is left to the renewal thread."""
    sql = statements(locker.store)
    pause, most = _RECORD_PAUSES
    said = False
    while True:
        try:
            yield Run(sql.finish_steps(run_id, outcome, detail))
        except (DatabaseUnreachable, ConnectionLost) as exc:
            held = run.held
            if held.lost or held.remaining <= pause:
                log.error(
                    "dblock: job %r ended (%s) but its record could not be written before "
                    "its key's lease ran out; the record is tried once more later: %s",
                    run.name,
                    outcome,
                    exc,
                )
                _record_later(locker, run, run_id, outcome, detail)
                return
            if not said:
                said = True
                log.warning(
                    "dblock: job %r ended (%s); the database does not answer, its outcome is "
                    "written when it does (the key is held meanwhile): %s",
                    run.name,
                    outcome,
                    exc,
                )
            yield Sleep(pause)
            pause = min(pause * 2, most)
        except BackendError as exc:
            log.error(
                "dblock: job %r ended (%s) but its record could not be written: %s",
                run.name,
                outcome,
                exc,
            )
            return
        else:
            if said:
                log.warning("dblock: job %r: its outcome (%s) is recorded", run.name, outcome)
            return


def describe(exc: BaseException) -> str:
    """A failed run's ``detail``: the exception, one line, storable (an
    exception may say it itself, as ``job_detail``: ``exit status 3``)."""
    own = getattr(exc, "job_detail", None)
    if isinstance(own, str):
        return db_text(own)[:_DETAIL_MAX]
    text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    return db_text(text)[:_DETAIL_MAX]


def skipped(manager_telemetry: Any, name: str, key: str, skip: Skip, on_skip: str) -> Skipped:
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
    locker: Locker,
    job: Job,
    func: Callable[..., R],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    fire_time: datetime | None,
    next_fire: datetime | None,
) -> R | Skipped:
    """Run ``func(*args, **kwargs)`` as a run of the job, on this thread
    (the manager has checked that it is open)."""
    got = locker.run(job.steps(locker, func, args, kwargs, fire_time, next_fire, Waiter))
    return job.outcome(locker, got)  # type: ignore[no-any-return]


def fire_times(
    per: str | None, passes_fire: bool, kwargs: dict[str, Any]
) -> tuple[datetime | None, datetime | None]:
    """The fire time (and next fire time) of a call of a ``once`` job, taken
    from its keywords: ``fire_time`` stays for a function that takes it,
    ``next_fire_time`` is dblock's alone."""
    given = kwargs.get("fire_time") if passes_fire else kwargs.pop("fire_time", None)
    nxt = kwargs.pop("next_fire_time", None)
    if per is None:
        return None, None if nxt is None else check_fire_time(nxt)
    if given is None:
        raise LockArgumentError(
            "this job runs once per fire time (per='fire_time'): call it with fire_time=<the "
            "scheduled time, an aware datetime>"
        )
    return check_fire_time(given), None if nxt is None else check_fire_time(nxt)
