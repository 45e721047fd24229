"""``dblock run KEY -- command args…``: a cluster-wide ``flock(1)`` for cron.

The command runs as one run of the job ``KEY`` (its lock ``job:KEY``, the
same as ``@locks.once("KEY")``): on at most one host at a time, and, with
``--at-least``, not again until that long after a run began. While it runs
the lease (``--at-most``) is renewed; signals sent to ``dblock run`` are
passed on to the command (but Ctrl-C and Ctrl-\\ in a terminal, which the
command gets from the terminal itself); when the command ends, its run is recorded, the
key released (or kept until ``--at-least``) and its exit status returned.

Exit statuses (``flock -n -E`` has one for "not run"; so does this):

==========  ===============================================================
status      meaning
==========  ===============================================================
the child   the command ran: its own status (128 + N if signal N ended it)
75          skipped: another host runs the job, or ran it less than
            ``--at-least`` ago, or its ``--fire-time`` ran (``EX_TEMPFAIL``;
            ``--skip-status N`` chooses another)
2           bad arguments (``--at-least`` over ``--at-most``, a negative
            duration, a key that is no lock key): nothing was taken
126 / 127   the command is not executable / not found: nothing was taken
1           the database failed or is unreachable (or has no lock table)
128 + N     signal N arrived before the command started; the key was given back
==========  ===============================================================
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from types import FrameType

from .errors import LockArgumentError

__all__ = [
    "EX_NOEXEC",
    "EX_NOTFOUND",
    "EX_TEMPFAIL",
    "FORWARDED",
    "CommandFailed",
    "Interrupted",
    "resolve_command",
    "supervise",
]

#: The default exit status of a skipped ``dblock run`` (sysexits.h ``EX_TEMPFAIL``:
#: "try again later", which is what the other host's run means).
EX_TEMPFAIL = 75
#: The shell's statuses for a command it cannot run.
EX_NOEXEC = 126
EX_NOTFOUND = 127

_SIGNALS = frozenset(int(s) for s in signal.Signals)

#: Signals passed on to the command while it runs.
FORWARDED = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)


class Interrupted(BaseException):
    """A signal arrived while the command was not running (before it started,
    or as its run was being recorded): what the lock was doing is unwound
    (the lock's clean-up owns that) and ``dblock run`` exits with 128 + the
    signal's number. A BaseException, as KeyboardInterrupt is. ``after``:
    the command had run already (its status is ``status``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.after = _ran.status is not None
        self.status = _ran.status


class _Ran:
    """Whether (and how) the command of this ``dblock run`` ended: one per process."""

    status: int | None = None


_ran = _Ran()


class CommandFailed(Exception):
    """The command ran and ended with a non-zero status: the run is recorded
    as failed, and ``dblock run`` exits with ``status``."""

    def __init__(self, status: int) -> None:
        super().__init__(f"exit status {status}")
        self.status = status
        #: What the record of runs says (see dblock.jobs.describe).
        self.job_detail = (
            f"exit status {status} ({signal.Signals(status - 128).name})"
            if 128 < status < 128 + signal.NSIG and status - 128 in _SIGNALS
            else f"exit status {status}"
        )


class CommandError(LockArgumentError):
    """The command cannot be run (not found, not executable); ``status`` is the shell's."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def resolve_command(argv: Sequence[str]) -> list[str]:
    """The command line with its program found on ``$PATH`` (as the shell
    would), or :class:`CommandError` before anything is taken."""
    if not argv:
        raise LockArgumentError("dblock run needs a command after --: dblock run KEY -- command …")
    program = argv[0]
    if os.sep in program:
        if not os.path.exists(program):
            raise CommandError(f"command not found: {program!r}", EX_NOTFOUND)
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            raise CommandError(f"command is not executable: {program!r}", EX_NOEXEC)
        return list(argv)
    found = shutil.which(program)
    if found is None:
        raise CommandError(f"command not found on $PATH: {program!r}", EX_NOTFOUND)
    return [found, *argv[1:]]


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Until the command starts, a forwarded signal interrupts ``dblock run``
    (as Ctrl-C interrupts any Python program) instead of killing it on the
    spot, so an acquisition in flight is given back."""

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in FORWARDED}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def exit_status(returncode: int) -> int:
    """A child's ``returncode`` as a shell reports it (killed by N: 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


#: What a terminal's keys (Ctrl-C, Ctrl-\\) send to its whole foreground process group.
_TERMINAL_KEYS = frozenset(
    getattr(signal, name) for name in ("SIGINT", "SIGQUIT") if hasattr(signal, name)
)


def in_terminal_foreground() -> bool:
    """Whether this process is in the foreground process group of its
    controlling terminal: then Ctrl-C and Ctrl-\\ reach the command (in the
    same group) from the terminal itself, and passing them on too would
    deliver them twice."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal (cron, a service)
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def supervise(command: Sequence[str]) -> int:
    """Run ``command`` with every forwarded signal passed on to it (but
    those a terminal already sent it: see :func:`in_terminal_foreground`);
    its exit status. Raises :class:`CommandFailed` for a non-zero one, so the
    job's run is recorded as failed."""
    from_terminal = _TERMINAL_KEYS if in_terminal_foreground() else frozenset()
    child = subprocess.Popen(list(command))  # noqa: S603 - the operator's own command line

    def forward(signum: int, _frame: FrameType | None) -> None:
        if signum in from_terminal:
            return  # the terminal sent it to the command too
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        while True:
            try:
                returncode = child.wait()
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries for us
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    status = _ran.status = exit_status(returncode)
    sys.stdout.flush()
    if status != 0:
        raise CommandFailed(status)
    return status
