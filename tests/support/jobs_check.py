"""What the jobs integration tests share: the ledger's verdict, and
processes started and stopped by PID within a bound."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

from tests.support.sizes import FULL

ROOT = Path(__file__).resolve().parent.parent.parent

#: The full-length runs (60 s, ±20 s clocks): DBLOCK_FULL=1 (or, for these
#: alone, DBLOCK_JOBS_LONG=1).
LONG = FULL or os.environ.get("DBLOCK_JOBS_LONG") == "1"


@dataclass
class Verdict:
    """Per fire time of one job, as the ledger shows it."""

    runs: dict[str, int] = field(default_factory=dict)  # fire time -> runs
    skips: dict[str, int] = field(default_factory=dict)  # fire time -> skips
    duplicates: list[str] = field(default_factory=list)  # fire times run more than once
    gaps: list[str] = field(default_factory=list)  # grid points with no run

    @property
    def fires(self) -> int:
        return len(self.runs)

    def contested(self, at_least: int) -> int:
        """Fires that ``at_least`` schedulers tried (one ran, the rest skipped)."""
        return sum(1 for f, n in self.runs.items() if n + self.skips.get(f, 0) >= at_least)


def verdict(
    rows: Iterable[Mapping[str, Any]], *, interval: float, excused: Iterable[str] = ()
) -> Verdict:
    """Count runs and skips per fire time; a fire time with more than one run
    is a duplicate; a grid point between the first and the last fire with no
    run is a gap, unless ``excused`` (fires a dead runner's lock may block)."""
    runs: Counter[str] = Counter()
    skips: Counter[str] = Counter()
    for row in rows:
        (runs if row["kind"] == "run" else skips)[row["fire_time"]] += 1
    result = Verdict(runs=dict(runs), skips=dict(skips))
    result.duplicates = sorted(f for f, n in runs.items() if n > 1)
    if runs:
        times = sorted(datetime.fromisoformat(f) for f in runs)
        step = timedelta(seconds=interval)
        point, excuse = times[0], set(excused)
        while point < times[-1]:
            name = point.isoformat()
            if name not in runs and name not in excuse:
                result.gaps.append(name)
            point += step
    return result


def start(
    argv: list[str], *, env: Mapping[str, str], log: Path, cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    """A process in a session of its own (so that its children can be ended
    with it), its output to ``log``."""
    out: TextIO = log.open("w")
    try:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    finally:
        out.close()


def stop(proc: subprocess.Popen[bytes], *, grace: float = 20.0) -> int:
    """SIGTERM to ``proc`` (by PID), SIGKILL to its process group if it has
    not ended within ``grace`` seconds. Its exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    # Workers a killed master left behind: their group is the master's PID.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode


@contextlib.contextmanager
def running(procs: list[subprocess.Popen[bytes]]) -> Iterator[list[subprocess.Popen[bytes]]]:
    try:
        yield procs
    finally:
        for p in procs:
            stop(p)


def wait_until(check: Any, *, timeout: float, every: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(every)
    raise AssertionError(f"not within {timeout} s: {check}")
