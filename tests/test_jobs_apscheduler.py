"""APScheduler 3 across processes: each fire of a job runs once.

Real processes and real schedulers: gunicorn workers that each start an
APScheduler, and standalone schedulers on clocks skewed with ``faketime``.
Every run writes a ledger row (tests/support/jobs_app.py), every skip too;
the ledger and dblock's runs table must both show exactly one run per fire
time. The ledger's verdict is tested first on hand-made ledgers, and on a
control run with APScheduler's own executor, where it must see duplicates.

Sizes: the suite's runs are short (14 s of gunicorn, ±6 s clocks for 20 s);
``DBLOCK_FULL=1`` runs the full ones (60 s, ±20 s clocks for 60 s).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import signal
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from apscheduler.events import EVENT_JOB_ERROR, EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED
from apscheduler.executors.base import MaxInstancesReachedError
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from dblock import LockArgumentError, LockManager
from dblock.contrib.apscheduler import (
    EVENT_JOB_SKIPPED,
    OncePerClusterExecutor,
    job_options,
    once_per_cluster,
)
from dblock.schema import to_utc
from tests.support import jobs_app, servers
from tests.support.jobs_check import LONG, running, start, verdict, wait_until

ANCHOR = "2020-01-01T00:00:00+00:00"  # every scheduler's interval starts here
INTERVAL = 2.0
WORK = 0.8  # seconds a run takes: the window kill -9 aims at
# Under skewed clocks the three schedulers try three different fires at each
# instant, all behind the job's one lock; while the slow clocks still fire
# times nobody ran (their first SKEW seconds), those are three runs per
# interval. Runs of 0.3 s keep that within the interval (3 x 0.8 s would not,
# and fires would wait out their grace and be missed).
SKEW_WORK = 0.3
AT_MOST = 4.0
GUNICORN_SECONDS = 60.0 if LONG else 14.0
SKEW = 20 if LONG else 6
SKEW_SECONDS = 60.0 if LONG else 20.0


def _env(db_url: str, ledger: str, **more: str) -> dict[str, str]:
    return {
        "DBLOCK_JOBS_URL": db_url,
        "DBLOCK_JOBS_LEDGER": ledger,
        "DBLOCK_JOBS_ANCHOR": ANCHOR,
        "DBLOCK_JOBS_INTERVAL": str(INTERVAL),
        "DBLOCK_JOBS_WORK": str(WORK),
        "DBLOCK_JOBS_AT_MOST": str(AT_MOST),
        "PYTHONUNBUFFERED": "1",
        **more,
    }


def _runs_of(db_url: str, job: str) -> list[dict[str, Any]]:
    """dblock's record of runs for ``job``: one row per fire time that ran."""
    with LockManager(db_url) as m:
        runs = sa.Table(m.names.runs_table, sa.MetaData(), autoload_with=m.engine)
        with m.engine.connect() as conn:
            rows = conn.execute(sa.select(runs).where(runs.c.job == job)).all()
    return [dict(r._mapping) for r in rows]


def _iso(value: object) -> str:
    """A runs-table time (a datetime, or SQLite's epoch seconds) as the
    ledger writes fire times."""
    found = to_utc(value)
    assert found is not None
    return found.isoformat()


def _report(name: str, **facts: object) -> None:
    print(f"\n[{name}] " + " ".join(f"{k}={v}" for k, v in facts.items()))


def _kill_a_run(db_url: str, ledger: str, spare: set[int]) -> dict[str, Any]:
    """kill -9 a process in the middle of a run (a ledger row not yet ended)."""

    def in_a_run() -> dict[str, Any] | None:
        for row in jobs_app.read_ledger(db_url, ledger):
            if row["kind"] == "run" and row["ended"] is None and row["pid"] not in spare:
                return row
        return None

    row = wait_until(in_a_run, timeout=30, every=0.05)
    os.kill(row["pid"], signal.SIGKILL)
    return row


# -- the ledger's verdict, on hand-made ledgers ----------------------------------


def _row(fire: str, kind: str = "run") -> dict[str, str]:
    return {"fire_time": f"2020-01-01T00:00:{fire}+00:00", "kind": kind}


def test_verdict_sees_a_duplicate_and_a_gap() -> None:
    rows = [_row("00"), _row("00", "skip"), _row("02"), _row("02"), _row("06")]
    v = verdict(rows, interval=2)
    assert v.duplicates == ["2020-01-01T00:00:02+00:00"]
    assert v.gaps == ["2020-01-01T00:00:04+00:00"]
    assert v.contested(2) == 2  # 00 (a run and a skip) and 02 (two runs)
    assert verdict(rows, interval=2, excused=["2020-01-01T00:00:04+00:00"]).gaps == []


def test_verdict_of_a_clean_ledger() -> None:
    rows = [_row("00"), _row("00", "skip"), _row("02"), _row("02", "skip"), _row("04")]
    v = verdict(rows, interval=2)
    assert (v.duplicates, v.gaps, v.fires) == ([], [], 3)


# -- gunicorn workers, each with a scheduler ------------------------------------


def _gunicorn(db_url: str, ledger: str, log: Path, *, workers: int, mode: str) -> Any:
    argv = [sys.executable, "-m", "gunicorn", "-w", str(workers), "-b", "127.0.0.1:0",
            "--graceful-timeout", "10", "tests.support.jobs_app:app"]  # fmt: skip
    env = _env(db_url, ledger, DBLOCK_JOBS_GUNICORN="1", DBLOCK_JOBS_MODE=mode)
    return start(argv, env=env, log=log)


@pytest.mark.databases("sqlite")
def test_control_plain_executor_runs_each_fire_in_every_worker(db_url: str, tmp_path: Path) -> None:
    """Without dblock, two workers run every fire twice: the ledger sees it."""
    ledger = uuid.uuid4().hex[:12]
    jobs_app.reset_ledger(db_url, ledger)
    with running([_gunicorn(db_url, ledger, tmp_path / "g.log", workers=2, mode="plain")]):
        wait_until(
            lambda: verdict(jobs_app.read_ledger(db_url, ledger), interval=INTERVAL).duplicates,
            timeout=20,
        )
    v = verdict(jobs_app.read_ledger(db_url, ledger), interval=INTERVAL)
    assert v.duplicates


@pytest.mark.slow
def test_gunicorn_workers_run_each_fire_once(db_url: str, db: str, tmp_path: Path) -> None:
    """4 gunicorn workers, each with a scheduler firing every 2 s; one worker
    is killed with kill -9 in the middle of a run. Exactly one run per fire
    time in the ledger and the runs table; the killed run is not run again,
    and the fires after it go on (a dead runner's lock blocks the job for at
    most ``at_most``)."""
    ledger = uuid.uuid4().hex[:12]
    jobs_app.reset_ledger(db_url, ledger)
    log = tmp_path / "gunicorn.log"
    master = _gunicorn(db_url, ledger, log, workers=4, mode="once")
    with running([master]):
        wait_until(lambda: jobs_app.read_ledger(db_url, ledger), timeout=30)
        began = time.monotonic()
        time.sleep(GUNICORN_SECONDS * 0.4)
        killed = _kill_a_run(db_url, ledger, spare={master.pid})
        killed_at = time.monotonic()
        time.sleep(max(GUNICORN_SECONDS - (killed_at - began), AT_MOST + 4 * INTERVAL))
    rows = jobs_app.read_ledger(db_url, ledger)
    fire = datetime.fromisoformat(killed["fire_time"])
    blocked = [(fire + timedelta(seconds=INTERVAL * k)).isoformat()
               for k in range(1, int(AT_MOST / INTERVAL) + 2)]  # fmt: skip
    v = verdict(rows, interval=INTERVAL, excused=blocked)
    runs = _runs_of(db_url, f"tick-{ledger}")
    after = [f for f in v.runs if datetime.fromisoformat(f) > fire + timedelta(seconds=AT_MOST)]
    _report(
        f"gunicorn {db}",
        seconds=GUNICORN_SECONDS,
        fires=v.fires,
        duplicates=len(v.duplicates),
        gaps=len(v.gaps),
        contested_by_4=v.contested(4),
        runs_table=len(runs),
        pids=len({r["pid"] for r in rows if r["kind"] == "run"}),
        fires_after_kill=len(after),
    )
    assert v.duplicates == [], log.read_text()[-3000:]
    assert v.gaps == [], log.read_text()[-3000:]
    assert v.fires >= GUNICORN_SECONDS / INTERVAL * 0.6
    assert v.contested(3) >= v.fires // 2  # the workers did compete for the fires
    # The killed run: one ledger row, never ended, and no second run of it.
    assert v.runs[killed["fire_time"]] == 1
    assert len(after) >= 2  # the next fires went on
    # The runs table agrees: one row per fire time that ran, none other.
    by_fire: dict[str, int] = {}
    for run in runs:
        by_fire[_iso(run["fire_time"])] = by_fire.get(_iso(run["fire_time"]), 0) + 1
    assert set(by_fire) == set(v.runs)
    assert all(n == 1 for n in by_fire.values())
    assert [r["outcome"] for r in runs if _iso(r["fire_time"]) == killed["fire_time"]] == [
        "running"
    ]


# -- clocks apart: schedulers under faketime -------------------------------------


def _ready_pid(log: Path) -> int | None:
    for line in log.read_text().splitlines():
        if line.startswith("ready "):
            return int(line.split()[1])
    return None


def _faketime() -> str:
    found = shutil.which("faketime")
    if found is None:
        pytest.fail("faketime is required (Debian's faketime package: apt-get install faketime)")
    return found


@pytest.mark.slow
@pytest.mark.databases("postgresql", "mariadb")
def test_skewed_clocks_run_each_fire_once(db_url: str, db: str, tmp_path: Path) -> None:
    """Three schedulers whose clocks are -SKEW, 0 and +SKEW seconds off, each
    with its job in a persistent job store of its own, on an interval
    trigger anchored at a fixed start_date: they compute the same fire times
    at different real times, and each fire runs once. The +SKEW scheduler is
    killed with kill -9 in a run: the two later ones find that fire taken
    (SKEW and 2*SKEW seconds later) and do not run it again.

    Not on SQLite: there the "database clock" of each lease is the clock of
    the process that reads it, so skewed processes disagree about leases (a
    clock SKEW ahead takes over a lease of ``at_most`` < SKEW while its run
    goes on). A SQLite file is shared by the processes of one host only,
    which share one clock: skew between them does not arise."""
    faketime = _faketime()
    ledger = uuid.uuid4().hex[:12]
    jobs_app.reset_ledger(db_url, ledger)
    procs = []
    for i, offset in enumerate((-SKEW, 0, SKEW)):
        argv = [sys.executable, "-m", "tests.support.jobs_app", str(SKEW_SECONDS)]
        if offset:
            argv = [faketime, "-f", f"{offset:+d}s", *argv]
        store = f"sqlite:///{tmp_path / f'store{i}.sqlite'}"
        # A grace of 5 intervals: on a loaded machine (CI: 4 workers on 2
        # cores, clusters running beside) a scheduler that has just started
        # was seen to reach a fire 4.4 s late, past a 2-interval grace, and
        # APScheduler dropped it before dblock saw it (a gap no lock made).
        env = _env(
            db_url, ledger, DBLOCK_JOBS_STORE=store, DBLOCK_JOBS_WORK=str(SKEW_WORK),
            DBLOCK_JOBS_GRACE=str(int(5 * INTERVAL)),
        )  # fmt: skip
        # Only the wall clock is skewed, as on a host whose clock is off
        # (tests/support/jobs_app.py says why libfaketime needs this).
        env["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
        procs.append(start(argv, env=env, log=tmp_path / f"sched{i}.log"))
    with running(procs):
        # faketime runs the scheduler as its child: the PIDs the ledger sees
        # are the ones each scheduler prints when ready.
        pids = [wait_until(lambda i=i: _ready_pid(tmp_path / f"sched{i}.log"), timeout=30)
                for i in range(3)]  # fmt: skip
        time.sleep(SKEW_SECONDS * 0.4)
        spare = set(pids[:2])
        # Only the fast clock's runs: its fires are the ones the others reach later.
        killed = _kill_a_run(db_url, ledger, spare=spare)
        for p in procs[:2]:
            p.wait(SKEW_SECONDS + 30)
    logs = "\n".join((tmp_path / f"sched{i}.log").read_text()[-1500:] for i in range(3))
    assert [p.returncode for p in procs[:2]] == [0, 0], logs
    rows = jobs_app.read_ledger(db_url, ledger)
    fire = datetime.fromisoformat(killed["fire_time"])
    blocked = [(fire + timedelta(seconds=INTERVAL * k)).isoformat()
               for k in range(1, int((AT_MOST + 2 * SKEW) / INTERVAL) + 2)]  # fmt: skip
    v = verdict(rows, interval=INTERVAL, excused=blocked)
    runs = _runs_of(db_url, f"tick-{ledger}")
    _report(
        f"skew {db}",
        skew=SKEW,
        seconds=SKEW_SECONDS,
        fires=v.fires,
        duplicates=len(v.duplicates),
        gaps=len(v.gaps),
        contested_by_3=v.contested(3),
        contested_by_2=v.contested(2),
        runs_table=len(runs),
        killed_fire_skips=v.skips.get(killed["fire_time"], 0),
        killed=killed["fire_time"][11:19],
        gap_fires=[g[11:19] for g in v.gaps],
    )
    assert v.duplicates == [], logs
    assert v.gaps == [], logs
    assert v.contested(2) >= 3, logs  # clocks apart, still the same fire times
    assert v.runs[killed["fire_time"]] == 1
    assert v.skips.get(killed["fire_time"], 0) >= 1  # a later clock came, and skipped it
    by_fire: dict[str, int] = {}
    for run in runs:
        by_fire[_iso(run["fire_time"])] = by_fire.get(_iso(run["fire_time"]), 0) + 1
    assert set(by_fire) == set(v.runs)
    assert all(n == 1 for n in by_fire.values())


# -- the executor in one process --------------------------------------------------

_ANCHOR = datetime(2020, 1, 1, tzinfo=timezone.utc)
_calls: list[str] = []


def _noted(label: str) -> None:
    _calls.append(label)


@job_options(local=True)
def _everywhere(label: str) -> None:
    _calls.append(label)


def _scheduler(locks: Any, **options: Any) -> BackgroundScheduler:
    executor = OncePerClusterExecutor(locks, at_most=30, **options)
    return BackgroundScheduler(executors={"default": executor}, timezone="UTC")


def _events(scheduler: BackgroundScheduler, mask: int) -> list[Any]:
    seen: list[Any] = []
    scheduler.add_listener(seen.append, mask)
    return seen


@pytest.mark.databases("sqlite")
def test_two_schedulers_local_and_shared_jobs(manager: LockManager, key: str) -> None:
    """Two schedulers of one job: each fire runs once, a skip is an event of
    its own; a ``local`` job runs in both."""
    _calls.clear()
    schedulers, skips = [], []
    began = time.monotonic()
    for _ in range(2):
        s = _scheduler(manager)
        trigger = IntervalTrigger(seconds=1, start_date=_ANCHOR)
        s.add_job(_noted, trigger, args=["shared"], id=f"{key}-shared", max_instances=3)
        s.add_job(_everywhere, trigger, args=["local"], id=f"{key}-local")
        skips.append(_events(s, EVENT_JOB_SKIPPED))
        s.start()
        schedulers.append(s)
    time.sleep(2.6)
    for s in schedulers:
        s.shutdown()
    shared, local = _calls.count("shared"), _calls.count("local")
    # One run per fire time of the window: 2.6 s of it, longer when the
    # second scheduler is slow to start (its executor reaches the database
    # first) while the first already fires.
    assert 2 <= shared <= int(time.monotonic() - began) + 1
    assert local >= 2 * shared - 1  # in both
    assert sum(len(s) for s in skips) >= shared - 1


@pytest.mark.databases("sqlite")
def test_a_made_up_id_is_refused(manager: LockManager) -> None:
    s = _scheduler(manager)
    errors = _events(s, EVENT_JOB_ERROR)
    s.start()
    try:
        s.add_job(_noted, "date", args=["never"], run_date=datetime.now(timezone.utc))
        wait_until(lambda: errors, timeout=10)
    finally:
        s.shutdown()
    assert "give it one, add_job(..., id=...)" in str(errors[0].exception)
    assert "never" not in _calls


@pytest.mark.databases("sqlite")
def test_a_fire_past_its_grace_is_missed_not_run(manager: LockManager, key: str) -> None:
    s = _scheduler(manager)
    missed = _events(s, EVENT_JOB_MISSED)
    s.start()
    try:
        # Added paused (never fired by the scheduler), then handed straight
        # to the executor as the scheduler hands it a fire 5 s late.
        job = s.add_job(_noted, "interval", seconds=60, start_date=_ANCHOR, args=["late"],
                        id=key, misfire_grace_time=1, next_run_time=None)  # fmt: skip
        s._lookup_executor("default").submit_job(
            job, [datetime.now(timezone.utc) - timedelta(seconds=5)]
        )
        wait_until(lambda: missed, timeout=10)
    finally:
        s.shutdown()
    assert "late" not in _calls


def _fire_times(db_url: str, job: str) -> list[datetime]:
    return sorted(to_utc(r["fire_time"]) for r in _runs_of(db_url, job))  # type: ignore[misc]


def test_fires_that_come_while_one_waits_for_the_lock_are_not_turned_away(
    db_url: str, manager: LockManager, make_manager: Any, key: str
) -> None:
    """Issue 43: a fire that finds the job's lock held by another scheduler's
    run (under clock skew they try different fires at once) waits for it;
    the fires that come meanwhile used to be turned away by APScheduler's
    ``max_instances`` (1 by default), and a fire time that no other
    scheduler fires (a clock behind the others fires the times before
    theirs) was lost. Staged: another manager holds ``job:<id>`` for 2.5 s
    while a scheduler fires every second; every fire time from the first
    one on runs, once, in order."""
    _calls.clear()
    other = make_manager()
    s = _scheduler(manager)
    turned_away = _events(s, EVENT_JOB_MAX_INSTANCES)
    with other.lock(f"job:{key}", ttl=30):
        s.start()
        try:
            s.add_job(_noted, IntervalTrigger(seconds=1, start_date=_ANCHOR), args=["fire"],
                      id=key, misfire_grace_time=10)  # fmt: skip
            time.sleep(2.5)  # fires come while the first waits for the lock
        except BaseException:
            s.shutdown()
            raise
    try:
        time.sleep(1.2)  # the waiting fires run, and one more after them
    finally:
        s.shutdown()
    fired = _fire_times(db_url, key)
    assert turned_away == []
    assert len(fired) >= 3, fired
    steps = [(b - a).total_seconds() for a, b in itertools.pairwise(fired)]
    assert steps == [1.0] * len(steps), fired  # no fire time lost, none twice
    assert _calls.count("fire") == len(fired)


def test_fire_times_a_late_scheduler_coalesced_run_too(
    db_url: str, manager: LockManager, key: str
) -> None:
    """A scheduler that wakes later than its next fire hands the executor
    only the last fire due (``coalesce=True``, APScheduler's default); the
    ones between may be fired by no other scheduler (under clock skew, the
    times before the others' clocks), so the executor runs those still
    within their grace. Staged: fires handed over as such a scheduler does,
    one, then (three seconds on) only the third after it."""
    _calls.clear()
    s = _scheduler(manager)
    s.start()
    try:
        job = s.add_job(_noted, IntervalTrigger(seconds=1, start_date=_ANCHOR), args=["fire"],
                        id=key, misfire_grace_time=30, next_run_time=None)  # fmt: skip
        assert job.coalesce
        now = datetime.now(timezone.utc).replace(microsecond=0)
        executor = s._lookup_executor("default")
        executor.submit_job(job, [now - timedelta(seconds=4)])
        executor.submit_job(job, [now - timedelta(seconds=1)])  # 3 s and 2 s ago coalesced
        wait_until(lambda: _calls.count("fire") >= 4, timeout=20)
    finally:
        s.shutdown()
    fired = _fire_times(db_url, key)
    assert fired == [now - timedelta(seconds=k) for k in (4, 3, 2, 1)]


def test_the_executor_reaches_the_database_as_the_scheduler_starts(make_manager: Any) -> None:
    """A manager's first statement connects and learns its server (1.4 s on
    a loaded machine); paid by the first fire, it made a scheduler started
    beside others miss its first fires (past a grace of 2 s) under skewed
    clocks. The executor's start pays it instead, before any fire."""
    m = make_manager()
    connects: list[object] = []
    sa.event.listen(m.engine, "connect", lambda *_: connects.append(1))
    s = _scheduler(m)
    s.start()
    try:
        assert connects
    finally:
        s.shutdown()


def test_a_database_that_does_not_answer_does_not_stop_the_scheduler_starting(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The start's look at the database is best effort: refused, the
    scheduler starts all the same and says so."""
    port = servers.free_port()  # nothing listens there
    with LockManager(f"postgresql+psycopg://postgres@127.0.0.1:{port}/x") as m:
        s = _scheduler(m)
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, "dblock.contrib.apscheduler"):
            s.start()
        try:
            assert s.running
            assert time.monotonic() - began < 10
            assert "first look at the database" in caplog.text
        finally:
            s.shutdown()


@pytest.mark.databases("sqlite")
def test_a_local_job_keeps_apschedulers_max_instances(manager: LockManager, key: str) -> None:
    """Only a cluster job's fires queue; a ``local`` job runs in every
    process as under APScheduler's own executor, max_instances included."""
    s = _scheduler(manager)
    s.start()
    try:
        job = s.add_job(_slow_local, "interval", seconds=60, start_date=_ANCHOR, id=key,
                        next_run_time=None)  # fmt: skip
        executor = s._lookup_executor("default")
        now = datetime.now(timezone.utc)
        executor.submit_job(job, [now])
        with pytest.raises(MaxInstancesReachedError):
            executor.submit_job(job, [now + timedelta(seconds=1)])
    finally:
        s.shutdown()


@job_options(local=True)
def _slow_local() -> None:
    time.sleep(0.5)


@pytest.mark.databases("sqlite")
def test_a_trigger_on_this_hosts_clock_is_warned_of(
    manager: LockManager, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    s = _scheduler(manager)
    s.start()
    try:
        with caplog.at_level(logging.WARNING, "dblock.contrib.apscheduler"):
            s.add_job(_noted, "interval", seconds=0.3, args=["clock"], id=key)
            wait_until(lambda: "looks taken from this host's clock" in caplog.text, timeout=10)
    finally:
        s.shutdown()


def test_once_per_cluster_refuses_a_running_scheduler(tmp_path: Path) -> None:
    s = BackgroundScheduler()
    s.start()
    try:
        with pytest.raises(LockArgumentError, match="call it before start"):
            once_per_cluster(s, lambda: None, at_most=10)  # type: ignore[arg-type,return-value]
    finally:
        s.shutdown()
    with pytest.raises(LockArgumentError, match="at_most"):
        OncePerClusterExecutor(lambda: None, at_most=0)  # type: ignore[arg-type,return-value]


def test_options_on_the_function_override_the_executors() -> None:
    executor = OncePerClusterExecutor(lambda: None, at_most=30, at_least=5)  # type: ignore[arg-type,return-value]

    @job_options(at_most=timedelta(minutes=2), retry_failed=True)
    def job() -> None: ...

    options = executor.options_for(type("J", (), {"func": job})())
    assert options == {"at_most": timedelta(minutes=2), "at_least": 5, "retry_failed": True,
                       "wait": None, "local": False}  # fmt: skip


@pytest.mark.databases("sqlite", "postgresql")
def test_flask_apscheduler_apps_run_each_fire_once(db_url: str, key: str) -> None:
    """Two Flask apps (two processes in real life), each with Flask-APScheduler
    configured from JOBS and the DBLock extension: each fire runs once."""
    from flask import Flask
    from flask_apscheduler import APScheduler

    from dblock import current_run
    from dblock.contrib.flask import DBLock

    _calls.clear()
    schedulers = []
    began = time.monotonic()
    for _ in range(2):
        app = Flask(__name__)
        app.config.update(
            DBLOCK_URL=db_url,
            SCHEDULER_TIMEZONE="UTC",
            JOBS=[
                {
                    "id": key,
                    "func": "tests.test_jobs_apscheduler:_noted",
                    "args": ["flask"],
                    "trigger": "interval",
                    "seconds": 1,
                    "start_date": _ANCHOR.isoformat(),
                    "max_instances": 3,
                }
            ],
        )
        ext = DBLock(app)
        scheduler = APScheduler()
        scheduler.init_app(app)
        once_per_cluster(scheduler, ext.manager, at_most=30)
        scheduler.start()
        schedulers.append((scheduler, ext))
    time.sleep(2.6)
    for scheduler, ext in schedulers:
        scheduler.shutdown()
        ext.manager.close()
    # One run per fire time of the window: about 2.6 s of it, longer when
    # a loaded machine is slow to start and stop the schedulers (a
    # fresh-clone run saw 4 fire times, each run once).
    window = time.monotonic() - began
    assert 2 <= _calls.count("flask") <= int(window) + 1
    assert current_run() is None
    runs = _runs_of(db_url, key)
    assert len(runs) == _calls.count("flask")
    assert all(r["outcome"] == "success" for r in runs)


async def _anoted(label: str) -> None:
    _calls.append(label)


def test_asyncio_schedulers_run_each_fire_once(db_url: str, make_manager: Any, key: str) -> None:
    """Two AsyncIOSchedulers (two processes in real life) with dblock's
    asyncio executor: a coroutine job (on the loop, ``await run_job``) and a
    plain one (in the loop's thread pool) each run every fire once."""
    import asyncio

    from apscheduler.schedulers.asyncio import AsyncIOScheduler

    from dblock import AsyncLockManager
    from dblock.contrib.apscheduler import OncePerClusterAsyncIOExecutor

    _calls.clear()

    async def main() -> None:
        schedulers, managers = [], []
        for _ in range(2):
            alocks = AsyncLockManager(make_manager())
            s = AsyncIOScheduler(timezone="UTC")
            executor = once_per_cluster(s, alocks, at_most=30)
            assert isinstance(executor, OncePerClusterAsyncIOExecutor)
            trigger = IntervalTrigger(seconds=1, start_date=_ANCHOR)
            s.add_job(_anoted, trigger, args=["async"], id=f"{key}-a", max_instances=3)
            s.add_job(_noted, trigger, args=["sync"], id=f"{key}-s", max_instances=3)
            s.start()
            schedulers.append(s)
            managers.append(alocks)
        await asyncio.sleep(2.6)
        for s in schedulers:
            s.shutdown(wait=False)
        await asyncio.sleep(0.5)  # let the runs under way end
        for alocks in managers:
            await alocks.close()

    asyncio.run(main())
    for label in ("async", "sync"):
        assert 2 <= _calls.count(label) <= 3, _calls
    for suffix, label in (("a", "async"), ("s", "sync")):
        runs = _runs_of(db_url, f"{key}-{suffix}")
        assert len(runs) == _calls.count(label)
        assert all(r["outcome"] == "success" for r in runs)
