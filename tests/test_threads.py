"""dblock's own threads block the process's asynchronous signals, so they
reach the application's threads (where a blocking call is interrupted and
``sigwaitinfo`` sees them: dblock run tells ``kill`` from a terminal's keys
that way)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from dblock import LockManager

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/task (Linux)"
)


def _blocked(native_id: int) -> set[int]:
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    mask = int(
        next(line for line in status.splitlines() if line.startswith("SigBlk:")).split()[1], 16
    )
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def test_dblocks_threads_block_the_signals_and_the_caller_keeps_its_mask(
    manager: LockManager, key: str
) -> None:
    before = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    with manager.lock(key, ttl=3):  # the renewal thread (and, by dialect, listeners)
        ours = [
            t
            for t in threading.enumerate()
            if t.name.startswith("dblock-") and t.name != "dblock-callbacks"  # (below)
        ]
        assert ours, [t.name for t in threading.enumerate()]
        for thread in ours:
            # One may be in the middle of starting (its id comes as it runs).
            deadline = time.monotonic() + 10
            while thread.native_id is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert thread.native_id is not None, f"{thread!r} never started"
            blocked = _blocked(thread.native_id)
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGCHLD):
                assert int(sig) in blocked, (thread.name, sig)
            assert int(signal.SIGSEGV) not in blocked, thread.name
    assert signal.pthread_sigmask(signal.SIG_BLOCK, ()) == before


def test_on_lost_callbacks_run_on_a_thread_that_blocks_nothing(
    manager: LockManager, key: str
) -> None:
    """The callbacks thread runs the application's code: a process it starts
    must not inherit blocked signals (it would ignore SIGTERM)."""
    seen: list[set[int]] = []
    done = threading.Event()

    def on_lost(_held: object) -> None:
        seen.append(_blocked(threading.get_native_id()))
        done.set()

    held = manager.acquire(key, ttl=0.3, renew=False, on_lost=on_lost)
    assert done.wait(10)
    assert held.lost
    blocked = seen[0]
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        assert int(sig) not in blocked, sig
