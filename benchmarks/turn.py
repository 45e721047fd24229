"""Does another process get its turn on a key hammered by local threads?

One process runs ``threads`` threads that take one key again and again (each
holds it only to note the time); its releases hand the key on to the next
local thread until the run has had ``handoff_limit`` local grants, then
release the row for real. A second process (spawned) asks for the same key ``runs`` times,
waiting each time, and notes when it asked and when it got the key.
``time.monotonic`` is one system-wide clock on Linux, so the local grants
that came between the two are counted directly: with fair turns, at most
``handoff_limit`` of them (the rest of the run under way when it asked).

    python -m benchmarks.turn URL [--runs 100] [--threads 11]
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import threading
import time
import uuid
from collections.abc import Sequence

from dblock import LockManager

__all__ = ["measure"]


def _remote(url: str, key: str, runs: int, out: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    with LockManager(url) as manager:
        manager.acquire(key + "-warm").release()  # connect before the first run
        out.put("ready")
        times = []
        for _ in range(runs):
            time.sleep(random.uniform(0.02, 0.05))
            asked = time.monotonic()
            held = manager.acquire(key, timeout=60)
            got = time.monotonic()
            held.release()
            times.append((asked, got))
        out.put(times)


def measure(url: str, runs: int, threads: int = 11, **options: object) -> list[int]:
    """Local grants between each remote request and its grant, one per run."""
    key = f"turn-{uuid.uuid4().hex[:8]}"
    grants: list[float] = []
    stop = threading.Event()
    with LockManager(url, **options) as manager:  # type: ignore[arg-type]

        def hammer() -> None:
            while not stop.is_set():
                with manager.lock(key, timeout=60):
                    grants.append(time.monotonic())

        ctx = multiprocessing.get_context("spawn")
        out = ctx.Queue()
        remote = ctx.Process(target=_remote, args=(url, key, runs, out))
        remote.start()
        assert out.get(timeout=60) == "ready"
        workers = [threading.Thread(target=hammer, daemon=True) for _ in range(threads)]
        for w in workers:
            w.start()
        times = out.get(timeout=60 + runs * 5)
        stop.set()
        for w in workers:
            w.join(60)
        remote.join(30)
    grants.sort()
    return [sum(1 for g in grants if asked < g < got) for asked, got in times]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--threads", type=int, default=11)
    parser.add_argument("--handoff-limit", type=int, default=8)
    args = parser.parse_args(argv)
    counts = measure(args.url, args.runs, args.threads, handoff_limit=args.handoff_limit)
    limit = args.handoff_limit
    # A run is handoff_limit local grants (the row's own acquisition and its
    # hand-offs): a request waits at most the run under way as it asked.
    within = sum(1 for c in counts if c <= limit)
    two = sum(1 for c in counts if c <= 2 * limit)
    print(
        f"{within}/{len(counts)} runs within {limit} local grants (one run), {two} within "
        f"{2 * limit} (two runs); counts sorted: {sorted(counts)}"
    )


if __name__ == "__main__":
    main()
