"""dblock's background threads never take the process's signals.

A signal sent to a process (``kill PID``, a terminal's Ctrl-C) goes to one
of its threads that does not block it. Python runs its handlers on the
main thread whatever thread took the signal, but only the thread that took
it sees a blocking call interrupted, and only a thread that blocks a
signal lets ``sigwaitinfo`` on another see where it came from. So every
thread dblock starts (renewal, batch senders, listeners, release queues)
blocks the asynchronous signals, and they all reach the application's own
threads: ``dblock run`` relies on it to tell ``kill -INT`` from another
process (passed on to its command) from a terminal's Ctrl-C (which the
command got from the terminal already).

A new thread inherits its creator's signal mask: :func:`start` blocks the
signals on the calling thread just long enough to start the new one.

A thread that runs the application's code (``on_lost`` callbacks) calls
:func:`unblock` first: a process started from it would otherwise inherit
the blocked signals through ``exec`` and ignore ``kill``.
"""

from __future__ import annotations

import signal
import threading

from ._signals import shielded

__all__ = ["BLOCKED", "start", "unblock"]

#: Asynchronous signals a process is sent; the synchronous ones (SIGSEGV,
#: SIGFPE, ...) go to the thread that caused them and must never be blocked.
BLOCKED: frozenset[signal.Signals] = frozenset(
    getattr(signal, name)
    for name in (
        "SIGINT",
        "SIGTERM",
        "SIGHUP",
        "SIGQUIT",
        "SIGUSR1",
        "SIGUSR2",
        "SIGCHLD",
        "SIGALRM",
        "SIGWINCH",
        "SIGTSTP",
        "SIGCONT",
    )
    if hasattr(signal, name)
)

_CAN_MASK = hasattr(signal, "pthread_sigmask")


def start(thread: threading.Thread) -> None:
    """``thread.start()``, the new thread blocking :data:`BLOCKED`. Raises
    what ``Thread.start`` raises (RuntimeError at interpreter exit)."""
    if not _CAN_MASK:  # pragma: no cover - Windows: no signal masks
        thread.start()
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, BLOCKED)
    try:
        # Shielded: CPython's Thread.start is not written for a handler's
        # exception inside it (one as its new thread left ``_limbo`` raised
        # KeyError in place of the application's exception: the signal
        # storm). It waits only for the new thread to run.
        shielded(thread.start)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock() -> None:
    """Unblock :data:`BLOCKED` on the calling thread (one that runs the
    application's code, though a dblock thread may have started it)."""
    if _CAN_MASK:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, BLOCKED)
