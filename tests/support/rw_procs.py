"""Read-write lock workers for child processes (spawned), and the ledger
that checks exclusion: a file every holder updates under ``flock`` on
entering and leaving its critical section."""

from __future__ import annotations

import fcntl
import json
import os
import random
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dblock import LockManager


class Ledger:
    """Who is inside, across processes: ``{"readers": n, "writers": n,
    "max_readers": n, "violations": [...], "reads": n, "writes": n}`` in a
    JSON file, read-modified-written under an exclusive ``flock``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def reset(self) -> None:
        with open(self.path, "w") as f:
            json.dump(_empty(), f)

    @contextmanager
    def _state(self) -> Iterator[dict[str, Any]]:
        with open(self.path, "r+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                state = json.loads(f.read() or "{}") or _empty()
                yield state
                f.seek(0)
                f.truncate()
                f.write(json.dumps(state))
                f.flush()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def read(self) -> dict[str, Any]:
        with self._state() as state:
            return dict(state)

    def enter(self, mode: str, who: str, fence: int) -> None:
        with self._state() as state:
            if state["writers"] or (mode == "write" and state["readers"]):
                state["violations"].append(
                    f"{who} entered as {mode} with {state['readers']} reader(s) and "
                    f"{state['writers']} writer(s) inside"
                )
            if mode == "write":
                if fence <= state["last_fence"]:
                    state["violations"].append(
                        f"{who}: write fence {fence} not above {state['last_fence']}"
                    )
                state["writers"] += 1
                state["writes"] += 1
            else:
                if fence <= state["last_write_fence"]:
                    state["violations"].append(
                        f"{who}: read fence {fence} not above the last writer's "
                        f"{state['last_write_fence']}"
                    )
                state["readers"] += 1
                state["reads"] += 1
                state["max_readers"] = max(state["max_readers"], state["readers"])
            state["last_fence"] = max(state["last_fence"], fence)
            if mode == "write":
                state["last_write_fence"] = fence

    def leave(self, mode: str) -> None:
        with self._state() as state:
            state["writers" if mode == "write" else "readers"] -= 1


def _empty() -> dict[str, Any]:
    return {
        "readers": 0,
        "writers": 0,
        "max_readers": 0,
        "reads": 0,
        "writes": 0,
        "last_fence": 0,
        "last_write_fence": 0,
        "violations": [],
    }


def hammer(
    url: str,
    key: str,
    ledger_path: str,
    threads: int,
    rounds: int,
    write_share: float,
    go: Any,
    ttl: float = 30.0,
) -> None:
    """Threads taking ``key``'s read or write lock at random, checking the
    ledger inside; the critical section lasts a few milliseconds."""
    ledger = Ledger(ledger_path)
    manager = LockManager(url, ttl=ttl)
    go.wait(60)
    errors: list[BaseException] = []

    def work() -> None:
        rnd = random.Random()
        try:
            for _ in range(rounds):
                mode = "write" if rnd.random() < write_share else "read"
                request = manager.write_lock if mode == "write" else manager.read_lock
                with request(key, timeout=120) as held:
                    ledger.enter(mode, f"pid {os.getpid()}", held.fence)
                    time.sleep(rnd.uniform(0.0005, 0.004))
                    ledger.leave(mode)
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    manager.close()
    if errors:
        raise errors[0]


def reader_loop(url: str, key: str, ledger_path: str, stop: Any, started: Any) -> None:
    """Take the read lock over and over, each hold overlapping the next
    process's (20 ms), until ``stop`` is set; count reads in the ledger."""
    ledger = Ledger(ledger_path)
    manager = LockManager(url)
    first = True
    while not stop.is_set():
        with manager.read_lock(key, timeout=120) as held:
            ledger.enter("read", f"pid {os.getpid()}", held.fence)
            if first:
                started.release()
                first = False
            time.sleep(0.02)
            ledger.leave("read")
    manager.close()


def hold_rw(url: str, key: str, mode: str, ttl: float, report: Any) -> None:
    """Take ``mode`` of ``key``, report the fence, then hang until killed."""
    manager = LockManager(url, renew=False)
    request = manager.write_lock if mode == "write" else manager.read_lock
    held = request(key, ttl=ttl).__enter__()
    report.put(held.fence)
    while True:
        time.sleep(60)


def read_then_report(url: str, key: str, hold: float, report: Any, ledger_path: str) -> None:
    """Hold the read lock until the other reader is in too (bounded by
    ``hold`` seconds after that), reporting the fence once in."""
    ledger = Ledger(ledger_path)
    with LockManager(url) as manager, manager.read_lock(key, timeout=60) as held:
        ledger.enter("read", f"pid {os.getpid()}", held.fence)
        report.put(("in", os.getpid(), held.fence))
        deadline = time.monotonic() + 120
        while ledger.read()["max_readers"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(hold)
        ledger.leave("read")
