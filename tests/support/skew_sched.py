"""One APScheduler process for the skewed-clock stress (tests/support/skew_stress.py).

``python -m tests.support.skew_sched SECONDS``: as ``python -m
tests.support.jobs_app`` (the same job, ledger and environment), with the
job's ``max_instances`` and ``coalesce`` from ``DBLOCK_JOBS_MAX_INSTANCES``
(default 1, APScheduler's own default) and ``DBLOCK_JOBS_COALESCE`` (default
1), and a ledger row for each fire APScheduler turned away (``maxinst``:
``max_instances`` reached) or that missed its grace (``missed``), so that a
lost fire time can be told from one that was never fired.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from tests.support import jobs_app


def _note(ledger: str, kind: str) -> Any:
    def record(event: Any) -> None:
        if event.job_id != f"tick-{ledger}":
            return
        times = getattr(event, "scheduled_run_times", None) or [event.scheduled_run_time]
        engine = jobs_app._engine or jobs_app.ledger_engine(os.environ["DBLOCK_JOBS_URL"])
        now = time.time()
        with engine.connect() as conn:
            for when in times:
                conn.execute(
                    jobs_app.LEDGER.insert().values(
                        ledger=ledger,
                        fire_time=when.astimezone(timezone.utc).isoformat(),
                        kind=kind,
                        pid=os.getpid(),
                        host=socket.gethostname(),
                        started=now,
                        ended=now,
                    )
                )

    return record


class _Runner(jobs_app._Recording):
    """jobs_app's runner, with the manager's ``is_locked`` (what the
    executor's start reaches the database with)."""

    def is_locked(self, key: str) -> bool:
        return bool(self.locks.is_locked(key))


def build(store: str | None) -> Any:
    from apscheduler.events import EVENT_JOB_MAX_INSTANCES, EVENT_JOB_MISSED
    from apscheduler.jobstores.memory import MemoryJobStore
    from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
    from apscheduler.schedulers.background import BackgroundScheduler
    from apscheduler.triggers.interval import IntervalTrigger

    from dblock import LockManager
    from dblock.contrib.apscheduler import EVENT_JOB_SKIPPED, once_per_cluster

    url = os.environ["DBLOCK_JOBS_URL"]
    ledger = os.environ["DBLOCK_JOBS_LEDGER"]
    interval = float(os.environ.get("DBLOCK_JOBS_INTERVAL", "1"))
    work = float(os.environ.get("DBLOCK_JOBS_WORK", "0.1"))
    anchor = datetime.fromisoformat(os.environ["DBLOCK_JOBS_ANCHOR"])
    grace = int(os.environ.get("DBLOCK_JOBS_GRACE", str(max(1, int(2 * interval)))))
    jobstore = SQLAlchemyJobStore(url=store) if store else MemoryJobStore()
    scheduler = BackgroundScheduler(jobstores={"default": jobstore}, timezone="UTC")
    # DBLOCK_JOBS_RECHECK: the manager's notify_recheck (how often a waiter
    # looks again without a wake-up), to tell a late wake-up from a busy lock.
    recheck = os.environ.get("DBLOCK_JOBS_RECHECK")
    locks = LockManager(url) if recheck is None else LockManager(url, notify_recheck=float(recheck))
    at_most = float(os.environ.get("DBLOCK_JOBS_AT_MOST", "30"))
    once_per_cluster(scheduler, _Runner(locks), at_most=at_most)
    scheduler.add_listener(jobs_app._record_skip(ledger), EVENT_JOB_SKIPPED)
    scheduler.add_listener(_note(ledger, "maxinst"), EVENT_JOB_MAX_INSTANCES)
    scheduler.add_listener(_note(ledger, "missed"), EVENT_JOB_MISSED)
    scheduler.add_job(
        jobs_app.tick,
        IntervalTrigger(seconds=interval, start_date=anchor, timezone="UTC"),
        args=[ledger, work],
        id=f"tick-{ledger}",
        replace_existing=True,
        misfire_grace_time=grace,
        max_instances=int(os.environ.get("DBLOCK_JOBS_MAX_INSTANCES", "1")),
        coalesce=os.environ.get("DBLOCK_JOBS_COALESCE", "1") == "1",
    )
    return scheduler


def main(argv: list[str]) -> int:
    jobs_app._sleep_for_libfaketime()
    logging.basicConfig(format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("dblock.jobs").setLevel(logging.INFO)
    seconds = float(argv[0])
    scheduler = build(os.environ.get("DBLOCK_JOBS_STORE"))
    # The job's own ledger connection, made now: made by the first run, it
    # held the job's lock for seconds on a loaded machine while the fires
    # of the other schedulers waited out their grace (the job's cold start,
    # not dblock's).
    jobs_app._engine = jobs_app.ledger_engine(os.environ["DBLOCK_JOBS_URL"])
    with jobs_app._engine.connect():
        pass
    # Started together: each waits for the same CLOCK_MONOTONIC instant
    # (DBLOCK_JOBS_GO), which faketime leaves alone.
    go = float(os.environ.get("DBLOCK_JOBS_GO", "0"))
    while time.monotonic() < go:
        time.sleep(0.01)
    scheduler.start()
    print(f"ready {os.getpid()} {time.time():.3f} {datetime.now(timezone.utc)}", flush=True)
    time.sleep(seconds)
    scheduler.shutdown(wait=True)
    print(f"done {os.getpid()} {timedelta(seconds=seconds)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
