"""What ``manage.py dblock_run`` and ``flask dblock run`` share: the options
of a run, the fire time from ``--fire-time`` / ``--per``, and the outcome as
an exit status.

Both run a command of their framework as one run of a job, for hosts that
each run the same command from cron: one of them runs it, the others skip.
Their options, defaults and skip status are ``dblock run``'s (plus ``--per``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from ..cli import parse_duration, shortened
from ..errors import JobSkipped, LockArgumentError
from ..manager import LockManager
from ..runner import EX_TEMPFAIL, period_fire_time

__all__ = ["HELP", "SKIP_STATUS", "RunOptions", "duration", "fire_time", "run_command"]

#: Exit status of a skipped run unless told (``--skip-status``), as ``dblock
#: run``'s: sysexits' EX_TEMPFAIL, "try again later".
SKIP_STATUS = EX_TEMPFAIL

HELP = {
    "at_most": "lease of the job's lock, renewed while the command runs: how long a host that "
    "dies mid-run keeps the job from running elsewhere (e.g. 30s, 10m; default: the lock ttl)",
    "at_least": "keep the job's key this long after the run began, however soon the command "
    "ends, so a late firing elsewhere skips (database time; default 0)",
    "fire_time": "run once per this scheduled time (ISO 8601 with its offset, e.g. "
    "2026-11-25T03:00Z): a fire time that already ran anywhere is skipped",
    "per": "run once per period of this long: the fire time is this host's clock rounded "
    "down to a multiple of it (for a cron line: its period, e.g. 1d; see docs/jobs.md)",
    "retry_failed": "with a fire time: run a fire time again whose run failed or died",
    "wait": "wait this long for the key before skipping (default: skip at once; with "
    "--fire-time or --per, wait up to --at-most for a run of another fire time)",
    "skip_status": f"exit status when skipped (default {SKIP_STATUS}, EX_TEMPFAIL, as dblock run)",
    "quiet": "say nothing when skipped (cron mails output)",
}


def duration(text: str) -> float:
    """Seconds from ``30``, ``30s``, ``500ms``, ``5m``, ``2h``, ``1d`` (as ``dblock run``)."""
    try:
        return parse_duration(text)
    except Exception as exc:  # argparse.ArgumentTypeError: a usage error for both CLIs
        raise LockArgumentError(str(exc)) from None


@dataclass(frozen=True)
class RunOptions:
    at_most: float | None = None
    at_least: float = 0
    fire_time: str | None = None
    per: float | None = None
    retry_failed: bool = False
    wait: float | None = None
    skip_status: int = SKIP_STATUS
    quiet: bool = False


def fire_time(given: str | None, per: float | None, now: float | None = None) -> datetime | None:
    """The run's fire time: ``given`` (ISO 8601, with a zone), or ``now``
    (this host's clock) rounded down to a multiple of ``per`` seconds since
    the epoch (``dblock run --per``'s :func:`~dblock.runner.period_fire_time`),
    or None (once at a time, no fire time)."""
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
    return period_fire_time(per, now)


def run_command(
    manager: LockManager,
    name: str,
    options: RunOptions,
    command: Callable[[], Any],
    say: Callable[[str], None],
) -> int:
    """Run ``command()`` as one run of job ``name``; the exit status: 0 when
    it ran, ``options.skip_status`` when it was skipped (``say`` tells why,
    unless ``quiet``). The command's own exceptions propagate (the run is
    recorded as failed)."""
    fire = fire_time(options.fire_time, options.per)
    try:
        manager.run_job(
            name,
            command,
            fire_time=fire,
            at_most=options.at_most,
            at_least=options.at_least,
            retry_failed=options.retry_failed,
            wait=options.wait,
            on_skip="raise",
        )
    except JobSkipped as exc:
        # The line `dblock run` says: the job, its fire time, why, and who
        # runs it when known (one line each face, for cron to mail).
        if not options.quiet:
            say(f"dblock run: {shortened(str(exc))}")
        return options.skip_status
    return 0
