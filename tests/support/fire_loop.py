"""A host that fires one job every PERIOD seconds of its own wall clock, as
a scheduler does, through ``run_job(..., fire_time=F)`` with its default
options, for the skewed-clock test of tests/test_jobs.py.

``python -m tests.support.fire_loop URL TABLE JOB PERIOD WORK GO OUT``:
writes ``ready`` to OUT, waits for the file GO (``START END``, both
CLOCK_MONOTONIC, shared by every process of the machine whatever
``faketime`` does to the wall clock when run with
FAKETIME_DONT_FAKE_MONOTONIC=1), then fires from START to END, each fire on
a thread of its own as a scheduler's pool runs it, and writes to OUT a line
per fire (``fired F``), per run (``ran F``) and per skip (``skip F reason``).
"""

from __future__ import annotations

import math
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from dblock import JobSkipped, LockManager
from tests.support.jobs_app import _sleep_for_libfaketime


def main(argv: list[str]) -> int:
    _sleep_for_libfaketime()
    url, table, job = argv[0], argv[1], argv[2]
    period, work = float(argv[3]), float(argv[4])
    go = Path(argv[5])
    out = open(argv[6], "a", buffering=1)  # noqa: SIM115 - open for the process's life
    write = threading.Lock()

    def say(line: str) -> None:
        with write:
            out.write(line + "\n")

    with LockManager(url, table=table) as locks:

        def fire(at: datetime) -> None:
            def run() -> None:
                say(f"ran {at.isoformat()}")
                time.sleep(work)

            try:
                locks.run_job(job, run, fire_time=at, at_most=4, on_skip="raise")
            except JobSkipped as exc:
                say(f"skip {at.isoformat()} {exc.reason}")

        locks.store.rows(limit=0)  # connected
        say("ready")
        while not go.exists() or len(go.read_text().split()) < 2:
            time.sleep(0.05)
        start, end = (float(a) for a in go.read_text().split())
        while time.monotonic() < start:
            time.sleep(0.01)
        threads = []
        while True:
            boundary = math.ceil(time.time() / period) * period
            time.sleep(max(0.0, boundary - time.time()))
            if time.monotonic() >= end:
                break
            at = datetime.fromtimestamp(boundary, timezone.utc)
            say(f"fired {at.isoformat()}")
            thread = threading.Thread(target=fire, args=(at,))
            thread.start()
            threads.append(thread)
            time.sleep(period / 4)  # past the boundary, whatever the sleep's rounding
        for thread in threads:
            thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
