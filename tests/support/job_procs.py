"""Job runners for child processes (spawned, so nothing is inherited)."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

from dblock import LockManager


def run_forever(
    url: str, table: str, name: str, at_most: float, fire_time: datetime | None, report: Any
) -> None:
    """Start a run of job ``name`` that never ends (the test kills this process)."""
    manager = LockManager(url, table=table)

    def job() -> None:
        report.put("running")
        while True:
            time.sleep(60)

    manager.run_job(name, job, at_most=at_most, fire_time=fire_time)


def run_once(
    url: str,
    table: str,
    name: str,
    options: dict[str, Any],
    seconds: float,
    go: Any,
    report: Any,
    delay: float = 0.0,
) -> None:
    """Wait for ``go`` (and ``delay`` more: a scheduler firing late), then
    call job ``name`` once (it lasts ``seconds``); report ``ran`` or ``skipped``."""
    with LockManager(url, table=table) as manager:

        def job() -> str:
            time.sleep(seconds)
            return "ran"

        manager.store.rows(limit=0)  # connected: the start line is the same for all
        report.put("ready")
        go.wait()
        time.sleep(delay)
        outcome = manager.run_job(name, job, **options)
        report.put("ran" if outcome == "ran" else "skipped")
