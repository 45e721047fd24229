"""Running user callbacks (``on_lost``) away from dblock's own threads.

A callback may be slow, raise, or even call ``sys.exit()``. Run on the renewal
thread it would delay or stop the renewal of every other lock of the manager,
and other processes would then take those locks while their holders still
believe them valid. So callbacks go to one thread of their own, in order; an
exception (any ``BaseException``) is logged and changes nothing else.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from . import _threads

__all__ = ["Callbacks"]

log = logging.getLogger("dblock")

_Job = tuple[str, Callable[..., object], tuple[Any, ...]]


class Callbacks:
    """One daemon thread running submitted callbacks, started on first use."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def submit(self, what: str, callback: Callable[..., object], *args: Any) -> None:
        """Call ``callback(*args)`` on the callback thread; ``what`` names it in logs."""
        self._queue.put((what, callback, args))
        if self._thread is None:
            with self._start:
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="dblock-callbacks", daemon=True
                    )
                    # Its signals unblocked (see _run): this thread runs the
                    # application's callbacks, and a process one of them
                    # starts would inherit blocked signals (SIGTERM, SIGINT)
                    # and ignore them.
                    self._thread.start()

    def close(self, timeout: float) -> None:
        """Let the callbacks already submitted run (up to ``timeout`` seconds)."""
        with self._start:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if thread is not threading.current_thread():
                thread.join(timeout)

    def after_fork(self) -> None:
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._start = threading.Lock()

    def _run(self) -> None:
        _threads.unblock()  # (started from a dblock thread, it inherited their mask)
        while True:
            job = self._queue.get()
            if job is None:
                return
            what, callback, args = job
            try:
                callback(*args)
            except BaseException:  # SystemExit too: it must not end anything but itself
                log.exception("dblock: %s failed", what)
            del job, callback, args
