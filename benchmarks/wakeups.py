"""How soon a waiter of another process gets a key after its release, with
many keys awaited at once (MariaDB's named-lock wake-ups; any database).

A holder process takes ``keys`` keys; a waiter process then waits for each
of them on a thread of its own (``acquire(timeout=...)``). Once every
waiter has waited ``settle`` seconds, the statements sent while they all
wait are counted for ``idle`` seconds: the waiter process's at its driver
(:mod:`benchmarks.dbapi`) and, on MySQL/MariaDB, the server's ``Questions``
(every client of the server: on a shared server others count too). Then the
holder releases the keys one by one, ``gap`` seconds apart, noting when each
release began; each waiter notes when its grant came (``time.monotonic`` is
one clock for all processes on Linux).

    python -m benchmarks.wakeups URL [--keys 1000] [--gap 0.005] [--idle 3]

Prints the grant's delay after its release (p50, p99, max), and the
statements per second while the waiters wait.
"""

from __future__ import annotations

import argparse
import multiprocessing
import threading
import time
import uuid
from typing import Any, NamedTuple

import sqlalchemy as sa

from dblock import LockManager

__all__ = ["Wakeups", "measure"]


class Wakeups(NamedTuple):
    delays: list[float]  # a grant's time after its release began, in key order
    missing: int  # waiters without a grant
    waiter_statements: float  # per second, while every waiter waits
    server_questions: float | None  # per second, the server's (MySQL/MariaDB)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.delays)
        return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def _holder(url: str, keys: list[str], gap: float, ready: Any, go: Any, out: Any) -> None:
    manager = LockManager(url)
    held = [manager.acquire(k, ttl=600) for k in keys]
    ready.set()
    go.wait()
    released: list[float] = []
    for lock in held:
        released.append(time.monotonic())
        lock.release()
        time.sleep(gap)
    out.put(released)
    manager.close()


def _waiter(
    url: str,
    keys: list[str],
    timeout: float,
    idle: float,
    settle: float,
    go: Any,
    out: Any,
    options: dict[str, Any],
) -> None:
    from benchmarks import dbapi

    counter = dbapi.install()
    manager = LockManager(url, **options)
    # Its pool, and its names thread's connection, opened before the run: a
    # first grant opening a connection (PyMySQL's TLS context alone takes
    # 100-300 ms) measures the connection, not the wake-up.
    warm = manager.acquire(f"{keys[0]}:warm")
    time.sleep(0.1)
    warm.release()
    grants: dict[str, float] = {}

    def wait(key: str) -> None:
        try:
            with manager.lock(key, timeout=timeout):
                grants[key] = time.monotonic()
        except Exception:  # counted as missing
            pass

    threads = [threading.Thread(target=wait, args=(k,), daemon=True) for k in keys]
    for t in threads:
        t.start()
    # Every waiter's first attempts over (1,000 threads' take seconds), then
    # ``settle`` more: what is counted is the cost of waiting.
    last, rate = 0, float("inf")
    for _ in range(60):  # (30 s at most)
        time.sleep(0.5)
        sent, _ = counter.read()
        # No longer falling, and at least one statement per waiter sent: the
        # first attempts are over. (On a loaded machine they come at a flat,
        # CPU-bound rate, which alone looked like "no longer falling" at once:
        # the count then took in first attempts, ~490/s for 600 waiters.)
        if sent >= len(keys) and sent - last > 0.9 * rate:
            break
        last, rate = sent, sent - last
    time.sleep(settle)
    counter.reset()
    started = time.monotonic()
    time.sleep(idle)
    sent, _ = counter.read()
    rate = sent / (time.monotonic() - started)
    out.put(("idle", rate))
    go.wait()
    for t in threads:
        t.join(timeout + 5)
    out.put(("grants", grants))
    manager.close()


def _questions(url: str) -> int | None:
    engine = sa.create_engine(url)
    try:
        if engine.dialect.name != "mysql":
            return None
        with engine.connect() as conn:
            row = conn.exec_driver_sql("SHOW GLOBAL STATUS LIKE 'Questions'").one()
        return int(row[1])
    finally:
        engine.dispose()


def measure(
    url: str,
    *,
    keys: int = 1000,
    gap: float = 0.005,
    idle: float = 3.0,
    settle: float = 3.0,
    timeout: float = 120.0,
    options: dict[str, Any] | None = None,
) -> Wakeups:
    """``options``: the waiter's LockManager options."""
    ctx = multiprocessing.get_context("spawn")
    prefix = f"bench:wake:{uuid.uuid4().hex[:8]}"
    names = [f"{prefix}:{i}" for i in range(keys)]
    ready, go, idle_done = ctx.Event(), ctx.Event(), ctx.Event()
    hout: Any = ctx.Queue()
    wout: Any = ctx.Queue()
    holder = ctx.Process(target=_holder, args=(url, names, gap, ready, go, hout), daemon=True)
    holder.start()
    if not ready.wait(300):
        raise RuntimeError("the holder did not take its keys")
    waiter = ctx.Process(
        target=_waiter,
        args=(url, names, timeout, idle, settle, idle_done, wout, options or {}),
        daemon=True,
    )
    waiter.start()
    time.sleep(settle)
    before = _questions(url)
    at = time.monotonic()
    kind, rate = wout.get(timeout=settle + idle + 300)
    assert kind == "idle"
    after = _questions(url)
    questions = (
        None if before is None or after is None else (after - before) / (time.monotonic() - at)
    )
    idle_done.set()
    go.set()
    released: list[float] = hout.get(timeout=timeout + 60)
    kind, grants = wout.get(timeout=timeout + 60)
    assert kind == "grants"
    holder.join(30)
    waiter.join(30)
    delays = [grants[k] - r for k, r in zip(names, released, strict=True) if k in grants]
    return Wakeups(delays, keys - len(delays), rate, questions)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url")
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--gap", type=float, default=0.005)
    parser.add_argument("--idle", type=float, default=3.0)
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument(
        "--recheck", type=float, default=None, help="the waiter's notify_recheck (default 2 s)"
    )
    args = parser.parse_args(argv)
    options = {} if args.recheck is None else {"notify_recheck": args.recheck}
    got = measure(
        args.url,
        keys=args.keys,
        gap=args.gap,
        idle=args.idle,
        settle=args.settle,
        options=options,
    )
    ms = [1000 * got.quantile(q) for q in (0.5, 0.99, 1.0)]
    print(
        f"{args.keys} keys: grant after release p50 {ms[0]:.1f} ms, p99 {ms[1]:.1f} ms, "
        f"max {ms[2]:.1f} ms; {got.missing} without a grant"
    )
    questions = "n/a" if got.server_questions is None else f"{got.server_questions:.0f}"
    print(
        f"while waiting: waiter process {got.waiter_statements:.0f} statements/s, "
        f"server Questions {questions}/s"
    )


if __name__ == "__main__":
    main()
