"""The guard between ``dblock lead`` and its command (``python -m dblock._guard``).

``dblock lead`` starts this process as the leader of a process group of its
own; it starts the command in that group and waits for it. The kernel's
parent-death signal reaches only a direct child, so a command that starts
processes of its own (a shell script, a server's workers) would leave them
running if ``dblock lead`` were killed with ``kill -9``, beside the next
leader's command. The guard watches its parent instead: the moment it is
gone, the guard kills the whole group (itself included) with SIGKILL.

The signals ``dblock lead`` passes on are sent to the whole group: the
command gets them directly, and the guard ignores them, so it outlives the
command and reports its status as a shell does (128 + N for signal N).

Usage: ``python -m dblock._guard PARENT_PID COMMAND [ARG ...]``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

#: How often the guard looks at its parent (seconds): the longest an orphaned
#: command outlives ``dblock lead``, far below any lease.
WATCH = 0.05

_IGNORED = tuple(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
    if hasattr(signal, name)
)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m dblock._guard PARENT_PID COMMAND [ARG ...]", file=sys.stderr)
        return 2
    parent = int(argv[0])
    for signum in _IGNORED:
        signal.signal(signum, signal.SIG_IGN)
    if os.getppid() != parent:  # dblock lead died before we got here
        return 128 + int(signal.SIGKILL)
    try:
        child = subprocess.Popen(  # noqa: S603 - the operator's own command line
            argv[1:],
            # The command gets the signals back (a mask and SIG_IGN survive exec).
            preexec_fn=_restore,  # noqa: PLW1509 - signal dispositions only
        )
    except OSError as exc:
        print(f"dblock lead: cannot execute {argv[1]!r}: {exc.strerror or exc}", file=sys.stderr)
        return 126
    while True:
        try:
            returncode = child.wait(WATCH)
        except subprocess.TimeoutExpired:
            if os.getppid() != parent:
                with contextlib.suppress(OSError):
                    os.killpg(0, signal.SIGKILL)
            continue
        return 128 - returncode if returncode < 0 else returncode


def _restore() -> None:
    for signum in _IGNORED:
        signal.signal(signum, signal.SIG_DFL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
