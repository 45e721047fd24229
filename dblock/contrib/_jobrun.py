"""What ``manage.py dblock_run`` and ``flask dblock run`` share: the options
of a run, the fire time from ``--fire-time`` / ``--per``, and the outcome as
an exit status.

Both run a command of their framework as one run of a job, for hosts that
each run the same command from cron: one of them runs it, the others skip.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .. import SKIPPED
from ..errors import LockArgumentError
from ..manager import LockManager

__all__ = ["RunOptions", "fire_time", "run_command"]

#: Exit status of a skipped run unless told (``--skipped-status``): cron
#: on the other hosts should not mail about a run that happened elsewhere.
SKIPPED_STATUS = 0

HELP = {
    "at_most": "the run's lease in seconds: a host that dies in a run blocks the job this long",
    "at_least": "keep the job taken this long after a run starts, however soon it ends (s)",
    "fire_time": "run once per this scheduled time (ISO 8601 with a zone, e.g. 2026-01-01T03:00Z)",
    "per": "run once per period of this many seconds: the fire time is this host's clock "
    "rounded down to a multiple of it (for cron lines: the cron period; see docs/jobs.md)",
    "retry_failed": "with a fire time: run it again if its run failed or died",
    "wait": "seconds to wait for a run elsewhere to end before skipping (default 0)",
    "skipped_status": f"exit status when the run is skipped (default {SKIPPED_STATUS})",
}


@dataclass(frozen=True)
class RunOptions:
    at_most: float
    at_least: float = 0
    fire_time: str | None = None
    per: float | None = None
    retry_failed: bool = False
    wait: float = 0
    skipped_status: int = SKIPPED_STATUS


def fire_time(given: str | None, per: float | None, now: float | None = None) -> datetime | None:
    """The run's fire time: ``given`` (ISO 8601, with a zone), or ``now``
    (this host's clock) rounded down to a multiple of ``per`` seconds since
    the epoch, or None (once at a time, no fire time).

    Rounding this host's clock is right for cron: cron starts the command
    when *this host's* clock reads the scheduled minute, so every host,
    whatever its skew, reads about the same time then, a few seconds past
    the scheduled one at most."""
    if given is not None and per is not None:
        raise LockArgumentError("give --fire-time or --per, not both")
    if given is not None:
        try:
            value = datetime.fromisoformat(given.replace("Z", "+00:00"))
        except ValueError:
            raise LockArgumentError(f"--fire-time: not an ISO 8601 time: {given!r}") from None
        if value.tzinfo is None:
            raise LockArgumentError(f"--fire-time needs a time zone (Z or +hh:mm): {given!r}")
        return value.astimezone(timezone.utc)
    if per is None:
        return None
    if not math.isfinite(per) or per < 1:
        raise LockArgumentError(f"--per must be at least 1 second, got {per!r}")
    clock = time.time() if now is None else now
    return datetime.fromtimestamp(math.floor(clock / per) * per, timezone.utc)


def run_command(
    manager: LockManager,
    name: str,
    options: RunOptions,
    command: Callable[[], Any],
    say: Callable[[str], None],
) -> int:
    """Run ``command()`` as one run of job ``name``; the exit status: 0 when
    it ran, ``options.skipped_status`` when it was skipped (``say`` tells
    why). The command's own exceptions propagate (the run is recorded as
    failed)."""
    fire = fire_time(options.fire_time, options.per)
    result = manager.run_job(
        name,
        command,
        fire_time=fire,
        at_most=options.at_most,
        at_least=options.at_least,
        retry_failed=options.retry_failed,
        wait=options.wait,
        on_skip="return",
    )
    if result is SKIPPED:
        at = f" (fire time {fire.isoformat()})" if fire is not None else ""
        say(f"dblock: job {name!r}{at} skipped: it runs or ran elsewhere")
        return options.skipped_status
    return 0
