"""``dblock run KEY -- command args…``: a cluster-wide ``flock(1)`` for cron.

The command runs as one run of the job ``KEY`` (its lock ``job:KEY``, the
same as ``@locks.once("KEY")``): on at most one host at a time, and, with
``--at-least``, not again until that long after a run began. It never
outlives the lock: a lock lost while it runs stops it (SIGTERM, then
SIGKILL), and on Linux it dies with ``dblock run`` (even by ``kill -9``).
While it runs the lease (``--at-most``) is renewed; signals sent to ``dblock run`` are
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
2           bad arguments (no ``--url`` nor ``$DBLOCK_URL``: no default
            database, ``--at-least`` over ``--at-most``, a negative
            duration, a key that is no lock key): nothing was taken
126 / 127   the command cannot be executed / is not found: nothing was taken
            (or, when ``execve`` refuses it, given back unrecorded)
1           the database failed or is unreachable (or has no lock table)
128 + N     signal N arrived before the command started; the key was given
            back (one arriving as it starts is passed on to it)
==========  ===============================================================
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime, timezone
from types import FrameType
from typing import TYPE_CHECKING, Any

from .errors import LockArgumentError

if TYPE_CHECKING:
    from .lock import HeldLock

__all__ = [
    "EX_NOEXEC",
    "EX_NOTFOUND",
    "EX_TEMPFAIL",
    "FORWARDED",
    "STOP_GRACE",
    "CommandFailed",
    "CommandLost",
    "CommandNotStarted",
    "Interrupted",
    "period_fire_time",
    "resolve_command",
    "run_here",
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
        self.after = _ran.started
        self.status = _ran.status


class _Ran:
    """Whether the command of this ``dblock run`` started, and how it ended:
    one per process."""

    started: bool = False
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


class CommandLost(CommandFailed):
    """The job's lock was lost while the command ran: the command was
    stopped (SIGTERM, then SIGKILL after :data:`STOP_GRACE` seconds) so that
    it never runs unlocked beside the next holder's, and the run is recorded
    as failed, saying so."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(status)
        self.reason = reason
        self.job_detail = f"lost its lock ({reason}); the command was stopped ({self.job_detail})"


class CommandNotStarted(Exception):
    """The command could not be executed (``execve`` refused it): nothing
    ran, so the run is undone (its record forgotten, its key given back:
    ``job_not_run``) and ``dblock run`` exits with the shell's ``status``."""

    #: Read by dblock.jobs.run_steps: the call never started what it runs.
    job_not_run = True

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class CommandError(LockArgumentError):
    """The command cannot be run (not found, not executable); ``status`` is the shell's."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def period_fire_time(per: float, now: float | None = None) -> datetime:
    """``--per``'s fire time: ``now`` (this host's clock) rounded down to a
    multiple of ``per`` seconds since the epoch, UTC.

    Rounding this host's clock is right for cron: cron starts the command
    when *this host's* clock reads the scheduled minute, so every host,
    whatever its skew, reads about the same time then, a few seconds past
    the scheduled one at most."""
    if not math.isfinite(per) or per < 1:
        raise LockArgumentError(f"--per must be at least 1s, got {per!r} s")
    clock = time.time() if now is None else now
    return datetime.fromtimestamp(math.floor(clock / per) * per, timezone.utc)


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
        return _as_executed(program, argv[1:])
    found = shutil.which(program)
    if found is None:
        raise CommandError(f"command not found on $PATH: {program!r}", EX_NOTFOUND)
    return _as_executed(found, argv[1:])


#: How the kernel's own executables begin (ELF, an interpreter line).
_EXECUTABLE_MAGIC = (b"\x7fELF", b"#!")


def _as_executed(path: str, args: Sequence[str]) -> list[str]:
    """The command line that runs ``path`` as ``sh`` (and so cron) would: an
    executable file the kernel refuses (no ``#!`` line: ``ENOEXEC``) is a
    shell script, run by ``/bin/sh`` (POSIX ``execvp``); one that is not
    text (a NUL in its first line, as bash checks) cannot be executed
    (126, before anything is taken)."""
    try:
        with open(path, "rb") as f:
            head = f.read(256)
    except OSError:  # executable but not readable: only the kernel can tell
        return [path, *args]
    if head.startswith(_EXECUTABLE_MAGIC):
        return [path, *args]
    if b"\0" in head.split(b"\n", 1)[0][:80]:
        raise CommandError(f"cannot execute binary file: {path!r}", EX_NOEXEC)
    return ["/bin/sh", path, *args]


#: The handlers :func:`interruptible` replaced (what :func:`run_here` gives back).
_BEFORE: dict[int, Any] = {}


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Until the command starts, a forwarded signal interrupts ``dblock run``
    (as Ctrl-C interrupts any Python program) instead of killing it on the
    spot, so an acquisition in flight is given back."""

    def interrupt(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = {sig: signal.signal(sig, interrupt) for sig in FORWARDED}
    _BEFORE.update(previous)
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


#: The guard between ``dblock lead`` and its command's process group.
_GUARD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_guard.py")

#: Seconds between SIGTERM and SIGKILL to a command whose lock was lost.
STOP_GRACE = 5.0
#: How often the lock is looked at while the command runs (seconds).
_WATCH = 0.1
_PR_SET_PDEATHSIG = 1


def _in_child(mask: set[int] | None, group: bool = False) -> Callable[[], None] | None:
    """What the child runs before ``exec``: it gets back the signal mask
    ``dblock run`` had before blocking the forwarded signals (a mask
    survives ``exec``); on Linux, the kernel kills it (SIGKILL) when
    ``dblock run`` dies, even by ``kill -9``, whose lock then ends with its
    lease while the command would go on unlocked; and if ``dblock run`` died
    already (between the fork and this), the child ends at once.

    (``preexec_fn`` runs Python in the forked child; what it calls here was
    looked up before the fork and takes no lock another thread may hold.)
    ``group``: the child leads a process group of its own (``dblock lead``
    stops the whole group)."""
    prctl = None
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # every Linux libc has it
            prctl = ctypes.CDLL(None, use_errno=True).prctl
    if prctl is None and mask is None and not group:  # pragma: no cover - not POSIX
        return None
    parent = os.getpid()
    kill = int(signal.SIGKILL)
    setmask = signal.pthread_sigmask
    before = mask

    setpgid = os.setpgid

    def arm() -> None:
        if group:
            setpgid(0, 0)
        if before is not None:
            setmask(signal.SIG_SETMASK, before)
        if prctl is not None and not group:  # (the guard watches us itself: see _guard)
            prctl(_PR_SET_PDEATHSIG, kill, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(128 + kill)

    return arm


def supervise(
    command: Sequence[str],
    *,
    held: HeldLock | None = None,
    env: dict[str, str] | None = None,
    group: bool = False,
    grace: float | None = None,
    name: str = "dblock run",
) -> int:
    """Run ``command`` with every forwarded signal passed on to it (but a
    terminal's Ctrl-C and Ctrl-\\, which reached it from the terminal: see
    :func:`in_terminal_foreground`); its exit status. Raises
    :class:`CommandFailed` for a non-zero one, so the job's run is recorded
    as failed; :class:`CommandLost` if the job's lock was lost while it ran
    (the command is stopped then); :class:`CommandNotStarted` if it could
    not be executed.

    From here on a signal never interrupts: one that arrives before the
    command is started says "nothing ran" only if nothing did (it is
    checked just before ``Popen``); one that arrives while ``Popen`` starts
    it is passed on to it once started.

    While the command runs, the forwarded signals are blocked and taken with
    ``sigtimedwait``, which says who sent each: the kernel for a terminal's
    keys (not passed on: the command, in the same foreground group, has it),
    a process for ``kill`` (passed on). dblock's own threads block them too
    (see dblock._threads), so none is delivered where it cannot be seen.

    ``held``: the lock watched (default: the current job run's); ``env``:
    the command's environment; ``group``: the command leads a process group
    of its own, which gets every signal passed on and, once the lock is
    lost, SIGTERM then SIGKILL after ``grace`` seconds (default
    :data:`STOP_GRACE`); ``name``: who says so on stderr."""
    if held is None:
        from .jobs import current_run

        run = current_run()
        held = None if run is None else run.held
    # (A group of its own is not the terminal's foreground group: the
    # terminal's keys reach it only through us.)
    from_terminal = _TERMINAL_KEYS if not group and in_terminal_foreground() else frozenset()
    stop = _Stop(group, STOP_GRACE if grace is None else grace, name)
    pending: list[int] = []
    started: list[subprocess.Popen[bytes]] = []

    def forward(signum: int, _frame: FrameType | None) -> None:
        # Only for a signal that arrived before they were blocked below
        # (its handler may run a moment later).
        if not started:
            pending.append(signum)  # (the command does not exist yet: nothing got it)
            return
        stop.send(started[0], signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    mask = _block(_WAITED)
    try:
        if pending:
            raise Interrupted(pending[0])  # before the command: nothing ran
        argv = list(command)
        if group:
            # The guard kills the whole group if we die (see dblock._guard);
            # run by its path, so its start imports nothing of dblock, and
            # isolated without site (-I -S: it needs only the standard
            # library), which halves its start: a successor's command waits for it.
            argv = [sys.executable, "-I", "-S", _GUARD, str(os.getpid()), *argv]
        try:
            child = subprocess.Popen(  # noqa: S603 - the operator's own command line
                argv,
                env=env,
                preexec_fn=_in_child(mask, group),  # noqa: PLW1509 - see _in_child
            )
        except OSError as exc:
            # (Not found, of a program found before: its #! interpreter is
            # missing, which the shell reports as 126 too.)
            gone = isinstance(exc, FileNotFoundError) and not os.path.exists(command[0])
            status = EX_NOTFOUND if gone else EX_NOEXEC
            raise CommandNotStarted(
                f"cannot execute {command[0]!r}: {exc.strerror or exc}", status
            ) from None
        started.append(child)
        _ran.started = True
        for signum in pending:  # arrived while Popen started it
            stop.send(child, signum)

        def relay(info: signal.struct_siginfo) -> None:
            if info.si_signo in from_terminal and info.si_code == _SI_KERNEL:
                return  # the terminal sent it to the command too
            stop.send(child, info.si_signo)

        returncode, lost = _wait(child, held, relay, stop)
        status = _ran.status = exit_status(returncode)
    finally:
        _unblock(mask)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    sys.stdout.flush()
    if lost is not None:
        raise CommandLost(status, lost)
    if status != 0:
        raise CommandFailed(status)
    return status


def run_here(command: Callable[[], int]) -> int:
    """Run ``command()`` in this process (``flask dblock run`` and ``manage.py
    dblock_run``: a command of the application's own, as ``dblock run`` runs
    a program); its exit status, raising :class:`CommandFailed` for a
    non-zero one as :func:`supervise` does. While it runs, signals are the
    ones it would get without dblock (the handlers from before
    :func:`interruptible`): SIGINT is a KeyboardInterrupt, SIGTERM ends the
    process (its run is then recorded as died once the lease ends)."""
    previous = {sig: signal.getsignal(sig) for sig in FORWARDED}
    for sig in FORWARDED:
        _restore(sig, _BEFORE.get(sig))
    _ran.started = True
    _ran.status = None
    try:
        status = _ran.status = command()
    finally:
        for sig, handler in previous.items():
            _restore(sig, handler)
        sys.stdout.flush()
    if status != 0:
        raise CommandFailed(status)
    return status


def _restore(sig: int, handler: Any) -> None:
    # (None: a handler not set from Python; the default's is the nearest.)
    signal.signal(sig, signal.SIG_DFL if handler is None else handler)


#: ``si_code`` of a signal the kernel sent (a terminal's keys); ``kill`` sends SI_USER.
_SI_KERNEL = 0x80
_CHLD = getattr(signal, "SIGCHLD", None)
#: What the wait for the command takes: the forwarded signals and the child's end.
_WAITED = frozenset(FORWARDED) | ({_CHLD} if _CHLD is not None else frozenset())
_CAN_WAIT = hasattr(signal, "sigtimedwait") and hasattr(signal, "pthread_sigmask")


def _block(signals: frozenset[int]) -> set[int] | None:
    """Block ``signals`` on this thread; the mask before (None: no masks here)."""
    if not _CAN_WAIT:  # pragma: no cover - not POSIX
        return None
    return set(signal.pthread_sigmask(signal.SIG_BLOCK, signals))


def _unblock(mask: set[int] | None) -> None:
    """Put back the mask :func:`_block` returned: a signal that arrived since
    goes to the handlers put back after it (the command has ended)."""
    if mask is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class _Stop:
    """How a supervised command is signalled and stopped: itself, or its
    whole process group (``group``), SIGKILL ``grace`` seconds after SIGTERM."""

    def __init__(self, group: bool, grace: float, name: str) -> None:
        self.group = group
        self.grace = grace
        self.name = name

    def send(self, child: subprocess.Popen[bytes], signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if self.group:
                os.killpg(child.pid, signum)
            else:
                child.send_signal(signum)

    def stop(self, child: subprocess.Popen[bytes]) -> int:
        """SIGTERM, then SIGKILL after the grace; the child's return code.
        A group gets SIGKILL even if its leader ended in time: what it
        started must not run on beside the next holder's command."""
        self.send(child, signal.SIGTERM)
        try:
            return child.wait(self.grace)
        except subprocess.TimeoutExpired:
            self.send(child, signal.SIGKILL)
            return child.wait()
        finally:
            if self.group:
                self.send(child, signal.SIGKILL)


def _wait(
    child: subprocess.Popen[bytes],
    held: HeldLock | None,
    relay: Callable[[signal.struct_siginfo], None],
    stop: _Stop,
) -> tuple[int, str | None]:
    """Wait for ``child`` to end, passing each forwarded signal to ``relay``
    and watching the job's lock: once it is lost the command is stopped
    (SIGTERM, SIGKILL after :data:`STOP_GRACE`). Its return code, and why
    the lock was lost (None: it was not)."""
    while True:
        returncode = child.poll()
        if returncode is not None:
            return returncode, None
        if held is not None and held.lost:
            break
        if not _CAN_WAIT:  # pragma: no cover - not POSIX: no signal to see
            with contextlib.suppress(subprocess.TimeoutExpired):
                return child.wait(_WATCH), None
            continue
        # SIGCHLD ends the wait as the command ends; the timeout is for the
        # lock's watch (and a SIGCHLD that a parent set to SIG_IGN removed).
        info = signal.sigtimedwait(_WAITED, _WATCH)
        if info is not None and info.si_signo != _CHLD:
            relay(info)
    reason = held.lost_reason or "lost"
    what = "the job's lock" if stop.name == "dblock run" else "leadership"
    print(f"{stop.name}: {what} was lost ({reason}); stopping the command", file=sys.stderr)
    return stop.stop(child), reason
