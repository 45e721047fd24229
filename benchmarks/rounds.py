"""Which process gets a hot key at each run's end?

``processes`` processes (spawned) of ``threads`` threads each take one key
again and again for ``seconds``, as the hot-key benchmark's waiting mode
does, and note when each grant came and to which process. A *run* is a
stretch of grants of one process (a row's acquisition and its local
hand-offs, ``handoff_limit`` of them at most). With turns taken in order,
every process has each of the others' runs between two of its own
(``processes - 1``); the wait tail of the hot key is a process passed over
for many runs in a row. ``time.monotonic`` is one system-wide clock on
Linux, so the grants of all processes are put in one order directly.

    python -m benchmarks.rounds URL [--processes 4] [--threads 8] [--seconds 5]

Prints the runs' lengths, how many runs of other processes came between two
runs of one process (a histogram), and each process's wait p50/p99/max.
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import threading
import time
import uuid
from collections.abc import Sequence
from typing import NamedTuple

from dblock import LockManager

__all__ = ["Rounds", "measure"]

#: A grant: when (time.monotonic), which process, how long its request waited.
Grant = tuple[float, int, float]


class Rounds(NamedTuple):
    grants: list[Grant]  # in time order
    runs: list[tuple[int, int]]  # (process, grants) in time order

    def gaps(self) -> collections.Counter[int]:
        """Runs of other processes between two runs of one process."""
        last: dict[int, int] = {}
        gaps: collections.Counter[int] = collections.Counter()
        for i, (process, _) in enumerate(self.runs):
            if process in last:
                gaps[i - last[process] - 1] += 1
            last[process] = i
        return gaps


def _worker(
    url: str,
    key: str,
    index: int,
    threads: int,
    start: float,
    stop: float,
    out: multiprocessing.Queue,  # type: ignore[type-arg]
) -> None:
    grants: list[Grant] = []
    with LockManager(url) as manager:
        manager.acquire(key + "-warm").release()  # connected before the start

        def hammer() -> None:
            while time.monotonic() < stop:
                asked = time.monotonic()
                with manager.lock(key, timeout=60):
                    now = time.monotonic()
                    grants.append((now, index, now - asked))

        time.sleep(max(0.0, start - time.monotonic()))
        workers = [threading.Thread(target=hammer) for _ in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    out.put(grants)


def measure(url: str, processes: int = 4, threads: int = 8, seconds: float = 5.0) -> Rounds:
    """Run the processes on one new key; their grants and runs in time order."""
    key = f"rounds-{uuid.uuid4().hex[:8]}"
    with LockManager(url) as manager:
        manager.create_schema()  # (if missing) before the processes start
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start = time.monotonic() + 3.0  # spawning and connecting take a while
    workers = [
        ctx.Process(target=_worker, args=(url, key, i, threads, start, start + seconds, out))
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    grants: list[Grant] = []
    for _ in workers:
        grants += out.get(timeout=seconds + 120)
    for worker in workers:
        worker.join()
    grants.sort()
    runs: list[tuple[int, int]] = []
    for _, process, _ in grants:
        if runs and runs[-1][0] == process:
            runs[-1] = (process, runs[-1][1] + 1)
        else:
            runs.append((process, 1))
    return Rounds(grants, runs)


def _ms(values: Sequence[float], q: float) -> float:
    return values[min(len(values) - 1, int(len(values) * q))] * 1e3


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    rounds = measure(args.url, args.processes, args.threads, args.seconds)
    waits = sorted(w for _, _, w in rounds.grants)
    print(
        f"{len(waits)} grants, {len(waits) / args.seconds:,.0f}/s; wait p50 "
        f"{_ms(waits, 0.5):.1f} ms, p99 {_ms(waits, 0.99):.1f} ms, max {waits[-1] * 1e3:.1f} ms"
    )
    lengths = collections.Counter(n for _, n in rounds.runs)
    print(f"{len(rounds.runs)} runs; lengths (grants: runs): {dict(sorted(lengths.items()))}")
    print(
        f"runs of others between two runs of one process (in order: {args.processes - 1}): "
        f"{dict(sorted(rounds.gaps().items()))}"
    )
    for process in range(args.processes):
        mine = sorted(w for _, p, w in rounds.grants if p == process)
        if mine:
            print(
                f"process {process}: {len(mine)} grants, wait p50 {_ms(mine, 0.5):.1f} ms, "
                f"p99 {_ms(mine, 0.99):.1f} ms, max {mine[-1] * 1e3:.1f} ms"
            )


if __name__ == "__main__":
    main()
