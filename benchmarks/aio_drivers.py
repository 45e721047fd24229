"""The asyncio face on each asyncio driver of one database, side by side.

P processes x T tasks, each task looping: lock a key drawn at random from a
large space (so two requests rarely meet), fail-fast or waiting, and unlock
it at once. The same workload runs in *windows* of a few seconds, one
driver form at a time (``postgresql+psycopg_async`` against
``postgresql+asyncpg``, ``mysql+aiomysql`` against ``mysql+asyncmy``), in
a shuffled order each round, so drift on a shared machine lands on every
form alike. The worker processes are spawned once; each window's manager is
made before it (connections opened and warmed) and closed after, every
process waiting at a barrier in between.

Per form: grants per second (median and range over rounds), acquire
latency p50/p99 (request to granted), and the client CPU per grant (the
whole process's, dblock's threads included).

    python -m benchmarks.aio_drivers --url postgresql+psycopg://postgres@127.0.0.1/bench \\
        --forms psycopg_async,asyncpg --processes 4 --tasks 50 --seconds 5 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing
import random
import statistics
import sys
import time
import uuid
from typing import Any

import sqlalchemy as sa

from dblock import LockBusy, LockManager

from .stats import percentile

_perf = time.perf_counter
#: A barrier's wait for the slowest process (set-up, a window, a close).
_BARRIER_SECONDS = 180.0
#: Keys drawn from.
KEYS = 1_000_000


@dataclasses.dataclass(frozen=True)
class Spec:
    url: str  # the blocking form; each window's form is made from it
    table: str
    forms: tuple[str, ...]  # asyncio drivers, SQLAlchemy's names
    processes: int
    tasks: int  # per process
    seconds: float
    rounds: int
    blocking: bool
    pool_size: int  # the asyncio pool of each process
    seed: int

    def plan(self) -> list[tuple[int, str]]:
        """(round, form) of every window, in order."""
        rng = random.Random(self.seed)
        windows = []
        for r in range(self.rounds):
            order = list(self.forms)
            rng.shuffle(order)
            windows += [(r, form) for form in order]
        return windows


def form_url(url: str, driver: str) -> str:
    parsed = sa.make_url(url)
    return parsed.set(drivername=f"{parsed.get_backend_name()}+{driver}").render_as_string(
        hide_password=False
    )


async def _window(spec: Spec, form: str, barrier: Any, rng: random.Random) -> dict[str, Any]:
    from dblock import AsyncLockManager

    alocks = AsyncLockManager(
        form_url(spec.url, form),
        table=spec.table,
        engine_options={"pool_size": 1, "max_overflow": 0},
        async_engine_options={"pool_size": spec.pool_size, "max_overflow": 0},
    )
    lock = alocks.lock
    prefix = f"bench:{uuid.uuid4().hex[:8]}:"

    async def cycle(key: str) -> float:
        t0 = _perf()
        if spec.blocking:
            async with lock(key, timeout=30):
                t1 = _perf()
        else:
            async with lock(key, blocking=False):
                t1 = _perf()
        return t1 - t0

    # Warm: every pooled connection opened, every statement seen once.
    await asyncio.gather(*(cycle(f"{prefix}warm:{i}") for i in range(spec.tasks)))
    await asyncio.to_thread(barrier.wait, _BARRIER_SECONDS)
    latencies: list[float] = []
    refused = errors = 0
    deadline = time.monotonic() + spec.seconds

    async def loop() -> None:
        nonlocal refused, errors
        while time.monotonic() < deadline:
            key = f"{prefix}{rng.randrange(KEYS)}"
            try:
                latencies.append(await cycle(key))
            except LockBusy:
                refused += 1
            except Exception:
                errors += 1

    cpu0, wall0 = time.process_time(), time.monotonic()
    await asyncio.gather(*(loop() for _ in range(spec.tasks)))
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    await alocks.close()
    return {
        "form": form,
        "grants": len(latencies),
        "wall": wall,
        "cpu": cpu,
        "refused": refused,
        "errors": errors,
        "latencies": latencies,
    }


def _worker(spec: Spec, me: int, barrier: Any, results: Any) -> None:
    rng = random.Random(spec.seed * 1000 + me)
    out = []
    for _, form in spec.plan():
        barrier.wait(_BARRIER_SECONDS)  # the previous window closed everywhere
        out.append(asyncio.run(_window(spec, form, barrier, rng)))
    results.put((me, out))


def run(spec: Spec) -> dict[str, dict[str, Any]]:
    with LockManager(spec.url, table=spec.table) as m:
        m.create_schema()
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(spec.processes)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(spec, i, barrier, results)) for i in range(spec.processes)
    ]
    for p in procs:
        p.start()
    per_process = [results.get(timeout=_BARRIER_SECONDS * 2) for _ in procs]
    for p in procs:
        p.join(30)
    plan = spec.plan()
    summary: dict[str, dict[str, Any]] = {}
    for w, (_, form) in enumerate(plan):
        windows = [out[w] for _, out in per_process]
        grants = sum(x["grants"] for x in windows)
        wall = max(x["wall"] for x in windows)
        entry = summary.setdefault(
            form, {"rates": [], "latencies": [], "cpu": 0.0, "grants": 0, "errors": 0}
        )
        entry["rates"].append(grants / wall)
        entry["latencies"] += [lat for x in windows for lat in x["latencies"]]
        entry["cpu"] += sum(x["cpu"] for x in windows)
        entry["grants"] += grants
        entry["errors"] += sum(x["errors"] for x in windows)
    return summary


def render(spec: Spec, summary: dict[str, dict[str, Any]]) -> str:
    mode = "waiting" if spec.blocking else "fail-fast"
    lines = [
        f"asyncio, {spec.processes} processes x {spec.tasks} tasks, distinct keys, {mode}, "
        f"{spec.rounds} rounds of {spec.seconds:g} s per driver (interleaved), "
        f"asyncio pool {spec.pool_size} per process",
        "",
        "| driver | grants/s (median) | min–max over rounds | p50 ms | p99 ms "
        "| client CPU µs/grant | errors |",
        "|---|---|---|---|---|---|---|",
    ]
    for form in spec.forms:
        e = summary[form]
        lat = sorted(e["latencies"])
        lines.append(
            f"| {form} | {statistics.median(e['rates']):,.0f} "
            f"| {min(e['rates']):,.0f}–{max(e['rates']):,.0f} "
            f"| {percentile(lat, 50) * 1000:.2f} | {percentile(lat, 99) * 1000:.2f} "
            f"| {e['cpu'] / max(1, e['grants']) * 1e6:.0f} | {e['errors']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the database (a blocking URL form)")
    parser.add_argument(
        "--forms", required=True, help="asyncio drivers, comma-separated (psycopg_async,asyncpg)"
    )
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=50, help="per process")
    parser.add_argument("--seconds", type=float, default=5.0, help="per window")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--waiting", action="store_true", help="waiting requests, not fail-fast")
    parser.add_argument("--pool-size", type=int, default=12, help="asyncio pool per process")
    parser.add_argument("--table", default="dblock_bench_drivers")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    spec = Spec(
        url=args.url,
        table=args.table,
        forms=tuple(f.strip() for f in args.forms.split(",") if f.strip()),
        processes=args.processes,
        tasks=args.tasks,
        seconds=args.seconds,
        rounds=args.rounds,
        blocking=args.waiting,
        pool_size=args.pool_size,
        seed=args.seed,
    )
    print(render(spec, run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
