"""A Celery app for the jobs integration tests: real workers and beats on
the machine's RabbitMQ, never eager mode.

Everything is named after the test's ledger (``DBLOCK_JOBS_LEDGER``): the
queue, so that runs of other tests (or leftovers) never reach these workers.
Each run and each skip writes a ledger row (tests/support/jobs_app.py's table).
"""

from __future__ import annotations

import os
import socket
import time
from datetime import datetime, timezone
from typing import Any

from celery import Celery

from dblock.contrib.celery import OnceTask, use_locks
from tests.support.jobs_app import LEDGER, ledger_engine

BROKER = os.environ.get("DBLOCK_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
LEDGER_NAME = os.environ.get("DBLOCK_JOBS_LEDGER", "none")
PERIOD = float(os.environ.get("DBLOCK_JOBS_INTERVAL", "2"))
QUEUE = f"dblock-test-{LEDGER_NAME}"

app = Celery("dblock_test_jobs", broker=BROKER)
app.conf.update(
    task_default_queue=QUEUE,
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    beat_schedule={
        "tick": {"task": "dblock_test.tick", "schedule": PERIOD, "args": [LEDGER_NAME]},
    },
)
if os.environ.get("DBLOCK_JOBS_BEAT") == "leader":
    # Beats that send only while they hold the lead; a plain task, so that
    # any doubled send would show as a second run.
    app.conf.update(
        beat_scheduler="dblock.contrib.celery:LeaderScheduler",
        dblock_beat_key=f"celery-beat:{LEDGER_NAME}",
        dblock_beat_lease=4.0,
        beat_schedule={
            "plain": {"task": "dblock_test.plain_tick", "schedule": PERIOD, "args": [LEDGER_NAME]},
        },
    )
if "DBLOCK_JOBS_URL" in os.environ:
    use_locks(app, os.environ["DBLOCK_JOBS_URL"])

_engine: Any = None


def _record(kind: str, started: float, ended: float | None = None, label: str = "") -> int:
    """A ledger row; its fire time is ``label`` (per_args: the item), else
    the start on this worker's clock."""
    global _engine
    if _engine is None:
        _engine = ledger_engine(os.environ["DBLOCK_JOBS_URL"])
    with _engine.connect() as conn:
        return int(
            conn.execute(
                LEDGER.insert().values(
                    ledger=LEDGER_NAME,
                    fire_time=label or datetime.fromtimestamp(started, timezone.utc).isoformat(),
                    kind=kind,
                    pid=os.getpid(),
                    host=socket.gethostname(),
                    started=started,
                    ended=ended,
                )
            ).inserted_primary_key[0]
        )


def _run(work: float, label: str = "") -> None:
    row_id = _record("run", time.time(), label=label)
    time.sleep(work)
    with _engine.connect() as conn:
        conn.execute(LEDGER.update().where(LEDGER.c.id == row_id).values(ended=time.time()))


class Recording(OnceTask):  # type: ignore[misc]
    def on_once_skipped(self, name: str, args: Any, kwargs: Any) -> None:
        super().on_once_skipped(name, args, kwargs)
        now = time.time()
        _record("skip", now, now, label=f"item:{args[1]}" if self.once_key else "")


@app.task(base=Recording, name="dblock_test.tick", once_at_most=10, once_at_least=PERIOD * 0.6)
def tick(ledger: str) -> None:
    """The periodic task both beats send every PERIOD seconds."""
    _run(0.2)


@app.task(base=Recording, name="dblock_test.per_args", once_at_most=10, once_key="args")
def per_args(ledger: str, item: int, work: float) -> None:
    """One run per ``item`` at a time, however many copies are sent."""
    _run(work, f"item:{item}")


@app.task(name="dblock_test.plain_tick")
def plain_tick(ledger: str) -> None:
    """A periodic task with no dblock of its own (the leader beat's test)."""
    _run(0.2)
