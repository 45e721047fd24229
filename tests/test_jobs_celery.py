"""Celery across processes: two real workers and two real beats on the
machine's RabbitMQ (never eager mode).

- A doubled beat: both beats send the periodic task every PERIOD seconds;
  with ``once_at_least`` under the period, it runs once per period.
- Once per arguments (as celery-once): many copies of one call in flight on
  both workers run once; another argument runs on its own.

Sizes: 14 s of beats in the suite, on PostgreSQL; 60 s on all three databases
with ``DBLOCK_FULL=1``.
"""

from __future__ import annotations

import itertools
import re
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import jobs_app
from tests.support.jobs_check import LONG, running, start, wait_until

PERIOD = 2.0
AT_LEAST = PERIOD * 0.6  # tests/support/celery_app.py's tick
SECONDS = 60.0 if LONG else 14.0
# The beats and workers are the same on every database; the suite runs the
# two long scenarios on PostgreSQL, the long run on all three.
EVERY_DB = ("sqlite", "postgresql", "mariadb") if LONG else ("postgresql",)


def _env(db_url: str, ledger: str, **more: str) -> dict[str, str]:
    return {
        "DBLOCK_JOBS_URL": db_url,
        "DBLOCK_JOBS_LEDGER": ledger,
        "DBLOCK_JOBS_INTERVAL": str(PERIOD),
        "PYTHONUNBUFFERED": "1",
        **more,
    }


def _celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "tests.support.celery_app", *args]


def _worker(n: int, db_url: str, ledger: str, tmp_path: Path) -> Any:
    argv = _celery("worker", "-c", "2", "-n", f"w{n}-{ledger}@%h", "--without-gossip",
                   "--without-mingle", "--without-heartbeat", "-l", "info")  # fmt: skip
    return start(argv, env=_env(db_url, ledger), log=tmp_path / f"worker{n}.log")


def _beat(n: int, db_url: str, ledger: str, tmp_path: Path, **env: str) -> Any:
    argv = _celery("beat", "-s", str(tmp_path / f"beat{n}-schedule"),
                   "--pidfile", str(tmp_path / f"beat{n}.pid"), "-l", "info")  # fmt: skip
    return start(argv, env=_env(db_url, ledger, **env), log=tmp_path / f"beat{n}.log")


def _ready(log: Path) -> bool:
    return log.exists() and "ready." in log.read_text()


def _started(log: Path) -> bool:
    return log.exists() and "beat: Starting..." in log.read_text()


def _sent(log: Path, task: str = "tick") -> int:
    return log.read_text().count(f"Sending due task {task}")


def _received(tmp_path: Path, task: str = "dblock_test.tick") -> int:
    """Messages of ``task`` the workers took. A beat logs "Sending" before it
    publishes, so one stopped (or killed) at that instant may log a send
    that never reached the broker: at most one per beat."""
    return sum(
        len(re.findall(rf"Task {re.escape(task)}\[[^\]]+\] received", p.read_text()))
        for p in tmp_path.glob("worker*.log")
    )


@pytest.fixture
def ledger(db_url: str) -> Iterator[str]:
    """A ledger name, and the queue named after it deleted after the test.
    An unreachable broker is a failure, as an unreachable database is."""
    from kombu import Connection

    from tests.support.celery_app import BROKER

    try:
        with Connection(BROKER, connect_timeout=5) as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:
        pytest.fail(f"RabbitMQ ({BROKER}) is required by the Celery tests and unreachable: {exc}")
    name = uuid.uuid4().hex[:12]
    jobs_app.reset_ledger(db_url, name)
    yield name
    with Connection(BROKER) as conn:
        conn.default_channel.queue_delete(f"dblock-test-{name}")


def _logs(tmp_path: Path) -> str:
    logs = sorted(tmp_path.glob("*.log"))
    return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in logs)


@pytest.mark.slow
@pytest.mark.databases(*EVERY_DB)
def test_doubled_beat_runs_each_period_once(
    db_url: str, db: str, ledger: str, tmp_path: Path
) -> None:
    workers = [_worker(n, db_url, ledger, tmp_path) for n in (1, 2)]
    with running(workers):
        for n in (1, 2):
            wait_until(lambda n=n: _ready(tmp_path / f"worker{n}.log"), timeout=60)
        beats = [_beat(n, db_url, ledger, tmp_path) for n in (1, 2)]
        with running(beats):
            for n in (1, 2):
                wait_until(lambda n=n: _started(tmp_path / f"beat{n}.log"), timeout=60)
            time.sleep(SECONDS)
        time.sleep(PERIOD)  # the last messages sent are taken and run
    rows = jobs_app.read_ledger(db_url, ledger)
    runs = sorted(r["started"] for r in rows if r["kind"] == "run")
    skips = sum(1 for r in rows if r["kind"] == "skip")
    sent = [_sent(tmp_path / f"beat{n}.log") for n in (1, 2)]
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(runs)]
    print(f"\n[celery beat {db}] seconds={SECONDS} sent={sent} runs={len(runs)} skips={skips} "
          f"closest={min(gaps, default=None)} widest={max(gaps, default=None)}")  # fmt: skip
    logs = _logs(tmp_path)
    # Every message taken either ran or was skipped; both beats sent every
    # period (all but one per beat, cut off as it stopped, reached a worker).
    received = _received(tmp_path)
    assert len(runs) + skips == received, logs
    assert sum(sent) - len(sent) <= received <= sum(sent), logs
    assert min(sent) >= SECONDS / PERIOD - 2, logs
    # One run per period: as many runs as one beat sent, a period apart,
    # never two within at_least.
    assert abs(len(runs) - max(sent)) <= 1, logs
    assert all(g >= AT_LEAST - 0.1 for g in gaps), (gaps, logs)


@pytest.mark.slow
@pytest.mark.databases("postgresql", "mariadb")
def test_once_per_arguments_on_two_workers(db_url: str, ledger: str, tmp_path: Path) -> None:
    workers = [_worker(n, db_url, ledger, tmp_path) for n in (1, 2)]
    with running(workers):
        for n in (1, 2):
            wait_until(lambda n=n: _ready(tmp_path / f"worker{n}.log"), timeout=60)
        from tests.support.celery_app import per_args

        for _ in range(6):
            per_args.apply_async((ledger, 1, 2.0), queue=f"dblock-test-{ledger}")
        per_args.apply_async((ledger, 2, 0.1), queue=f"dblock-test-{ledger}")

        def settled() -> list[dict[str, Any]] | None:
            rows = jobs_app.read_ledger(db_url, ledger)
            return rows if len(rows) == 7 and all(r["ended"] for r in rows) else None

        rows = wait_until(settled, timeout=60, every=0.2)
    by_item = {
        item: sorted(r["kind"] for r in rows if r["fire_time"] == item)
        for item in ("item:1", "item:2")
    }
    assert by_item == {"item:1": ["run"] + ["skip"] * 5, "item:2": ["run"]}, _logs(tmp_path)


@pytest.mark.slow
@pytest.mark.databases(*EVERY_DB)
def test_leader_beat_sends_alone_and_a_standby_takes_over(
    db_url: str, db: str, ledger: str, tmp_path: Path
) -> None:
    """Two beats with LeaderScheduler and a task with no dblock of its own:
    only the leader sends, so each period runs once; the leader killed with
    kill -9, the standby takes the lead once its lease (4 s) ends and the
    periods go on."""
    workers = [_worker(n, db_url, ledger, tmp_path) for n in (1, 2)]
    with running(workers):
        for n in (1, 2):
            wait_until(lambda n=n: _ready(tmp_path / f"worker{n}.log"), timeout=60)
        beats = [_beat(n, db_url, ledger, tmp_path, DBLOCK_JOBS_BEAT="leader") for n in (1, 2)]
        with running(beats):
            leader = wait_until(lambda: _leader(tmp_path), timeout=60)
            time.sleep(SECONDS / 2)
            before = [_sent(tmp_path / f"beat{n}.log", "plain") for n in (1, 2)]
            beats[leader - 1].send_signal(signal.SIGKILL)
            killed_at = time.time()
            time.sleep(SECONDS / 2 + 4)
        time.sleep(PERIOD)
    rows = jobs_app.read_ledger(db_url, ledger)
    runs = sorted(r["started"] for r in rows if r["kind"] == "run")
    sent = [_sent(tmp_path / f"beat{n}.log", "plain") for n in (1, 2)]
    standby = 2 if leader == 1 else 1
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(runs)]
    after = [r for r in runs if r > killed_at]
    print(f"\n[celery leader {db}] sent_before_kill={before} sent={sent} runs={len(runs)} "
          f"after_kill={len(after)} widest={max(gaps, default=None)}")  # fmt: skip
    logs = _logs(tmp_path)
    assert before[standby - 1] == 0, logs  # the standby sent nothing while the leader led
    assert before[leader - 1] >= SECONDS / PERIOD / 2 - 2, logs
    assert "leading" in (tmp_path / f"beat{standby}.log").read_text(), logs
    assert len(after) >= SECONDS / PERIOD / 2 - 3, logs  # the periods went on
    # Every send taken ran once (a beat stopped or killed as it sent may
    # have logged one that never reached the broker).
    received = _received(tmp_path, "dblock_test.plain_tick")
    assert len(runs) == received, logs
    assert sum(sent) - len(sent) <= received <= sum(sent), logs
    # Never two runs in one period, but for the takeover's first send.
    assert sum(1 for g in gaps if g < PERIOD / 2) <= 1, (gaps, logs)


def _leader(tmp_path: Path) -> int | None:
    for n in (1, 2):
        log = tmp_path / f"beat{n}.log"
        if log.exists() and "beat: leading" in log.read_text():
            return n
    return None
