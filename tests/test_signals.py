"""A signal handler's exception landing inside SQLAlchemy's pool (dblock._signals).

A real SIGALRM is sent (``signal.raise_signal``) at each point in turn where
the main thread runs the pool's code during a lock's acquire and release
(a checkout from the pool, the connection's return, the queue's
``Condition``), and the handler raises. Before the shield, the walk found a
point within a few dozen where the queue's mutex stayed held for good (as
``Condition.__enter__`` returns): every later checkout hung. Now each step
ends with the pool whole (nothing checked out, the mutex free), the key
free for another manager, and the handler's exception raised to the caller
(never swallowed, never wrapped).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from dblock import LockManager

from .support.interrupts import next_point

#: The pool's books: where a handler's exception did harm.
POOL_FILES = ("sqlalchemy/pool/base.py", "sqlalchemy/pool/impl.py", "sqlalchemy/util/queue.py")


class Alarm(Exception):
    pass


@contextmanager
def signal_at(n: int) -> Iterator[list[int]]:
    """Send SIGALRM to this process as the ``n``-th line of the pool's code
    (see POOL_FILES) starts on this thread; yields [lines seen]."""
    seen = [0]

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            seen[0] += 1
            if seen[0] == n:
                signal.raise_signal(signal.SIGALRM)
        return local

    def start(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename.replace("\\", "/").endswith(POOL_FILES):
            return local
        return None

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise Alarm(f"at line {n} of the pool's code")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    sys.settrace(start)
    try:
        yield seen
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGALRM, previous)


def _mutex_free(pool: Any) -> bool:
    mutex = pool._pool.mutex  # (the queue's RLock: what the storm found held)
    if not mutex.acquire(timeout=2):
        return False
    mutex.release()
    return True


def test_a_handler_raising_anywhere_in_the_pool_leaves_it_whole(db_url: str, key: str) -> None:
    manager = LockManager(db_url)
    other = LockManager(db_url)
    pool = manager.engine.pool
    executor = manager.store.executor
    try:
        n, steps, raised = 1, 0, 0
        while True:
            # Every statement from the pool: nothing idle in dblock's stack.
            executor.release_idle()
            with signal_at(n) as seen:
                try:
                    manager.acquire(key, timeout=5).release()
                except Alarm:
                    raised += 1
            steps += 1
            assert threading.current_thread() is threading.main_thread()
            assert _mutex_free(pool), f"the pool's queue mutex stays held after point {n}"
            executor.release_idle()
            deadline = time.monotonic() + 5
            while manager.store.has_orphans and time.monotonic() < deadline:
                time.sleep(0.01)
            # (The renewal thread may be using one a moment: deleting an orphan.)
            while pool.checkedout() and time.monotonic() < deadline:
                time.sleep(0.01)
                executor.release_idle()
            assert pool.checkedout() == 0, (n, pool.status())
            other.acquire(key, timeout=3).release()  # the key is free
            if seen[0] < n:
                break  # walked past the last point
            n = next_point(n)
        assert steps > 10, steps
        assert raised > 5, raised
    finally:
        manager.close(timeout=1)
        other.close(timeout=1)
