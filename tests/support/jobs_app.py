"""A scheduler in a process, for the jobs integration tests.

Each process runs an APScheduler 3 ``BackgroundScheduler`` with one job,
``tick``, every ``DBLOCK_JOBS_INTERVAL`` seconds on an interval trigger
anchored at a fixed ``start_date`` (``DBLOCK_JOBS_ANCHOR``), so that every
process, whatever its clock, computes the same fire times. Each run writes a
ledger row when it starts and completes it when it ends; the test reads the
ledger and dblock's runs table.

Two ways in:

- ``gunicorn tests.support.jobs_app:app``: each worker imports this module
  (no ``--preload``) and starts its own scheduler, as an app that starts a
  scheduler at import does.
- ``python -m tests.support.jobs_app SECONDS``: one scheduler for SECONDS,
  with its jobs in a SQLAlchemy job store of its own (``DBLOCK_JOBS_STORE``,
  a SQLite file): the job comes back from the store by reference, and the
  executor still keys its runs. Used under ``faketime`` for skewed clocks.

``DBLOCK_JOBS_MODE=plain`` uses APScheduler's own executor instead of
dblock's: the control run, where every process runs every fire.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import sqlalchemy as sa

LEDGER = sa.Table(
    "dblock_test_jobs_ledger",
    sa.MetaData(),
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("ledger", sa.String(64), nullable=False, index=True),
    sa.Column("fire_time", sa.String(40), nullable=False),
    # "run": the job ran here; "skip": dblock found this fire taken elsewhere
    sa.Column("kind", sa.String(8), nullable=False),
    sa.Column("pid", sa.Integer, nullable=False),
    sa.Column("host", sa.String(100), nullable=False),
    # time.time() of the process: a skewed host's clock, as it saw it
    sa.Column("started", sa.Float(precision=53), nullable=False),
    sa.Column("ended", sa.Float(precision=53), nullable=True),
)

_engine: sa.Engine | None = None


def ledger_engine(url: str) -> sa.Engine:
    # SQLite: the ledger shares the lock file with dblock; wait for the lock
    # rather than fail under four writers.
    args = {"timeout": 30} if url.startswith("sqlite") else {}
    return sa.create_engine(url, isolation_level="AUTOCOMMIT", connect_args=args)


def reset_ledger(url: str, ledger: str) -> None:
    engine = ledger_engine(url)
    LEDGER.create(engine, checkfirst=True)
    with engine.begin() as conn:
        conn.execute(LEDGER.delete().where(LEDGER.c.ledger == ledger))
    engine.dispose()


def read_ledger(url: str, ledger: str) -> list[dict[str, Any]]:
    engine = ledger_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(LEDGER).where(LEDGER.c.ledger == ledger).order_by(LEDGER.c.id)
        ).all()
    engine.dispose()
    return [dict(r._mapping) for r in rows]


def tick(ledger: str, work: float) -> str:
    """The job: a ledger row at the start, completed at the end, ``work``
    seconds apart (the window a ``kill -9`` aims at)."""
    global _engine
    if _engine is None:
        _engine = ledger_engine(os.environ["DBLOCK_JOBS_URL"])
    fire = getattr(_this_run, "fire", None) or _nearest_fire()
    with _engine.connect() as conn:
        row_id = conn.execute(
            LEDGER.insert().values(
                ledger=ledger,
                fire_time=fire,
                kind="run",
                pid=os.getpid(),
                host=socket.gethostname(),
                started=time.time(),
            )
        ).inserted_primary_key[0]
    time.sleep(work)
    with _engine.connect() as conn:
        conn.execute(LEDGER.update().where(LEDGER.c.id == row_id).values(ended=time.time()))
    return fire


# APScheduler does not tell a job its fire time: under dblock's executor the
# fire time dblock keyed the run by is handed over in this thread-local (see
# _Recording); under the plain one (the control run) it is the grid point
# nearest this host's clock.
_this_run = threading.local()


def _nearest_fire() -> str:
    anchor = datetime.fromisoformat(os.environ["DBLOCK_JOBS_ANCHOR"])
    interval = float(os.environ.get("DBLOCK_JOBS_INTERVAL", "2"))
    k = round((time.time() - anchor.timestamp()) / interval)
    return (anchor + timedelta(seconds=k * interval)).astimezone(timezone.utc).isoformat()


def build_scheduler(*, store: str | None = None) -> Any:
    from apscheduler.jobstores.memory import MemoryJobStore
    from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
    from apscheduler.schedulers.background import BackgroundScheduler
    from apscheduler.triggers.interval import IntervalTrigger

    url = os.environ["DBLOCK_JOBS_URL"]
    ledger = os.environ["DBLOCK_JOBS_LEDGER"]
    interval = float(os.environ.get("DBLOCK_JOBS_INTERVAL", "2"))
    work = float(os.environ.get("DBLOCK_JOBS_WORK", "0.3"))
    anchor = datetime.fromisoformat(os.environ["DBLOCK_JOBS_ANCHOR"])
    jobstore = SQLAlchemyJobStore(url=store) if store else MemoryJobStore()
    scheduler = BackgroundScheduler(jobstores={"default": jobstore}, timezone="UTC")
    if os.environ.get("DBLOCK_JOBS_MODE", "once") == "once":
        from dblock import LockManager
        from dblock.contrib.apscheduler import EVENT_JOB_SKIPPED, once_per_cluster

        locks = LockManager(url)
        at_most = float(os.environ.get("DBLOCK_JOBS_AT_MOST", "30"))
        once_per_cluster(scheduler, _Recording(locks), at_most=at_most)
        scheduler.add_listener(_record_skip(ledger), EVENT_JOB_SKIPPED)
    scheduler.add_job(
        tick,
        IntervalTrigger(seconds=interval, start_date=anchor, timezone="UTC"),
        args=[ledger, work],
        id=f"tick-{ledger}",
        replace_existing=True,
        # A fire may wait this long for the job lock (dblock's executor waits
        # for what is left of the grace): under skewed clocks three fires are
        # tried at once, and one runs while the others wait their turn.
        # (DBLOCK_JOBS_GRACE: a test's own grace, see test_skewed_clocks_...)
        misfire_grace_time=int(os.environ.get("DBLOCK_JOBS_GRACE", max(1, int(2 * interval)))),
        # dblock's job lock keeps runs from overlapping, across processes and
        # in this one; max_instances only bounds how many fires of this
        # scheduler may wait for it at once (a fire that waits for another
        # fire's run, as under skewed clocks, must not turn the next away).
        max_instances=3,
    )
    return scheduler


class _Recording:
    """The manager, with each run's fire time handed to the job (which
    APScheduler does not tell it) so that the ledger can record it."""

    def __init__(self, locks: Any) -> None:
        self.locks = locks

    def run_job(self, name: str, func: Any, /, *args: Any, fire_time: datetime, **kw: Any) -> Any:
        def with_fire() -> Any:
            _this_run.fire = fire_time.isoformat()
            try:
                return func()
            finally:
                _this_run.fire = None

        return self.locks.run_job(name, with_fire, *args, fire_time=fire_time, **kw)


def _record_skip(ledger: str) -> Any:
    def record(event: Any) -> None:
        if event.job_id != f"tick-{ledger}":
            return
        engine = _engine or ledger_engine(os.environ["DBLOCK_JOBS_URL"])
        fire = event.scheduled_run_time.astimezone(timezone.utc).isoformat()
        now = time.time()
        with engine.connect() as conn:
            conn.execute(
                LEDGER.insert().values(
                    ledger=ledger,
                    fire_time=fire,
                    kind="skip",
                    pid=os.getpid(),
                    host=socket.gethostname(),
                    started=now,
                    ended=now,
                )
            )

    return record


def _start_in_worker() -> None:
    scheduler = build_scheduler()
    scheduler.start()
    atexit.register(scheduler.shutdown)


def app(environ: Any, start_response: Any) -> list[bytes]:
    """The WSGI app gunicorn serves: the pid, to tell workers apart."""
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [str(os.getpid()).encode()]


if os.environ.get("DBLOCK_JOBS_GUNICORN") == "1":
    _start_in_worker()


def _sleep_for_libfaketime() -> None:
    """Under ``faketime`` (libfaketime 0.9.10, run with
    FAKETIME_DONT_FAKE_MONOTONIC=1 so that only the wall clock is skewed, as
    on a host whose clock is off): Python's time.sleep sleeps until an
    absolute CLOCK_MONOTONIC deadline with clock_nanosleep, which that
    libfaketime answers with EINVAL. Condition waits work, so time.sleep
    (dblock's backoff, the job's work) waits on one instead. Without
    FAKETIME_DONT_FAKE_MONOTONIC the condition waits hang instead."""
    if "FAKETIME" not in os.environ:
        return
    idle = threading.Event()

    def sleep(seconds: float) -> None:
        idle.wait(seconds)

    time.sleep = sleep


def main(argv: list[str]) -> int:
    _sleep_for_libfaketime()
    # Why each skip was a skip (dblock.jobs logs it at INFO), in the log.
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("dblock.jobs").setLevel(logging.INFO)
    seconds = float(argv[0])
    scheduler = build_scheduler(store=os.environ.get("DBLOCK_JOBS_STORE"))
    scheduler.start()
    print(f"ready {os.getpid()} {time.time():.3f}", flush=True)
    time.sleep(seconds)
    scheduler.shutdown(wait=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
