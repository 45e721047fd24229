"""Two checkouts of dblock side by side, in one interleaved run: the lone
request's lock+unlock and a hot key shared by a process's threads, on each
URL given. What issue 44 asks of a rebuild ("within 5 % of before") is
read from here:

    git worktree add /tmp/before <commit>
    .venv/bin/python -m benchmarks.versus --before /tmp/before --after . \\
        sqlite:////tmp/versus.db postgresql+psycopg://postgres@127.0.0.1/postgres

Each checkout runs in a process of its own (its ``dblock`` imported from
there); the rounds alternate between them in a shuffled order, so drift on
a shared machine lands on both alike. Per round and contender we keep the
block's client CPU per cycle (``time.thread_time``, steadier than wall
time) and wall time, and report medians and the after/before ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid

__all__ = ["main"]


def _worker(checkout: str, url: str) -> None:
    """Serve ``<kind> <n>`` requests on stdin with this checkout's dblock."""
    here = os.path.abspath(os.getcwd())
    sys.path[:] = [p for p in sys.path if p not in ("", here)]
    sys.path.insert(0, os.path.abspath(checkout))
    from dblock import LockManager

    manager = LockManager(url, ttl=30)
    manager.create_schema()  # (nothing if it is there: the other side may have made it)
    prefix = f"versus:{uuid.uuid4().hex[:8]}"
    hot = f"{prefix}:hot"
    counter = 0
    for _ in range(20):  # warm up: the connection, the table, the code paths
        counter += 1
        manager.acquire(f"{prefix}:{counter}").release()
    print(json.dumps({"ready": __import__("dblock").__file__}), flush=True)
    for line in sys.stdin:
        kind, n = line.split()
        count = int(n)
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        if kind == "lone":
            for _ in range(count):
                counter += 1
                manager.acquire(f"{prefix}:{counter}").release()
            cpu = time.thread_time() - cpu0
        else:  # hot: 4 threads of this process on one key

            def run(share: int) -> None:
                for _ in range(share):
                    manager.acquire(hot, timeout=60).release()

            threads = [threading.Thread(target=run, args=(count // 4,)) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            cpu = float("nan")  # (other threads' CPU: not this thread's to count)
        wall = time.perf_counter() - wall0
        print(json.dumps({"wall": wall / count, "cpu": cpu / count}), flush=True)
    manager.close()


def _start(checkout: str, url: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.versus", "--worker", checkout, url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    ready = json.loads(proc.stdout.readline())
    print(f"  {checkout}: dblock from {ready['ready']}")
    return proc


def _ask(proc: subprocess.Popen[str], kind: str, n: int) -> dict[str, float]:
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write(f"{kind} {n}\n")
    proc.stdin.flush()
    got: dict[str, float] = json.loads(proc.stdout.readline())
    return got


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.versus", description=__doc__)
    parser.add_argument("urls", nargs="*", help="database URLs (SQLAlchemy form)")
    parser.add_argument("--before", help="the checkout measured against")
    parser.add_argument("--after", default=".", help="the checkout measured (default: .)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--block", type=int, default=200, help="cycles per round and contender")
    parser.add_argument("--worker", nargs=2, metavar=("CHECKOUT", "URL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(*args.worker)
        return
    if not args.before or not args.urls:
        parser.error("--before and at least one URL are required")
    for url in args.urls:
        print(url.split("://")[0])
        procs = {"before": _start(args.before, url), "after": _start(args.after, url)}
        seen: dict[tuple[str, str, str], list[float]] = {}
        try:
            for _ in range(args.rounds):
                order = [(side, kind) for side in procs for kind in ("lone", "hot")]
                random.shuffle(order)
                for side, kind in order:
                    got = _ask(procs[side], kind, args.block)
                    for what, value in got.items():
                        seen.setdefault((kind, what, side), []).append(value)
        finally:
            for proc in procs.values():
                assert proc.stdin is not None
                proc.stdin.close()
                proc.wait(60)
        for kind, what in (("lone", "cpu"), ("lone", "wall"), ("hot", "wall")):
            before = statistics.median(seen[(kind, what, "before")])
            after = statistics.median(seen[(kind, what, "after")])
            print(
                f"  {kind:4} {what:4} per cycle: before {before * 1e6:8.1f} µs  "
                f"after {after * 1e6:8.1f} µs  after/before {after / before:.3f}"
            )


if __name__ == "__main__":
    main()
