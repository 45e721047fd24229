"""Where a lone grant's time goes: one lock+unlock cycle entered at each
floor of dblock, from the driver up, measured interleaved on one database.

Each contender runs the same cycle (a key nobody else uses, taken and given
back at once) entered one floor higher than the one before it, so the
difference between two neighbours is what that floor costs a lone request:

* **driver**: the raw driver sending dblock's own two statements on one
  autocommit connection (``raw, same SQL`` of :mod:`benchmarks.uncontended`);
* **executor**: the same statements through the store's executor
  (``Executor.run``: a pooled connection, error translation, the answer read);
* **store**: the store's ``try_acquire`` / ``release`` (the dialect's steps
  driven, its retry rule, the answer made a ``Grant``);
* **group commit**: the batcher's (a lone request goes at once, its lane counted);
* **lock**: ``Locker.acquire`` and ``HeldLock.release`` (level 1, the token,
  the held lock, renewal and telemetry bookkeeping, the wake-up after release);
* **API**: ``with manager.lock(key, blocking=False)`` (the options checked,
  the request object, the context manager).

Run it with ``python -m benchmarks.layers URL ...`` (each database in turn,
``--rounds`` interleaved rounds of ``--block`` cycles per contender); it
prints a Markdown table of the median wall time and client CPU per cycle,
each floor's share, and the API's ratio to the driver.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import uuid
from collections.abc import Callable

import sqlalchemy as sa

from dblock import LockManager
from dblock._hooks import lock_statements

from .uncontended import Bench, Contender, CycleResult, measure_interleaved, raw_driver

__all__ = ["FLOORS", "layer_contenders", "main", "measure_layers"]

_urandom = os.urandom
TTL = 30.0

#: The floors, bottom up (the contenders' names).
FLOORS = ("driver", "executor", "store", "group commit", "lock", "API")


def layer_contenders(bench: Bench) -> list[Contender]:
    """One contender per floor (see the module), on ``bench``'s database."""
    db = bench.database
    run = uuid.uuid4().hex[:6]
    manager = LockManager(bench.url, table=bench.table)
    locker = manager.locker
    store = manager.store
    batcher = locker.batcher
    statements = lock_statements(manager)
    owner = f"bench:{os.getpid()}"

    driver = raw_driver(bench, manager)
    conn = driver.connect()
    execute = driver.execute

    def raw(i: int) -> None:
        key = f"bench:{run}:driver:{i}"
        token = _urandom(16).hex()
        params = {"key": key, "owner": owner, "token": token, **driver.acquire_params}
        execute(conn, driver.acquire, params, True)
        release = {"key": key, "token": token, **driver.release_params}
        execute(conn, driver.release, release, driver.release_returns)

    executor = store.executor
    acquire_params = statements.acquire_params(TTL)

    def on_executor(i: int) -> None:
        key = f"bench:{run}:executor:{i}"
        token = _urandom(16).hex()
        params = {"key": key, "owner": owner, "token": token, **acquire_params}
        executor.run(statements.acquire, params, statements.returning)
        release = {"key": key, "token": token, **statements.release_params}
        executor.run(statements.release, release, statements.release_returns)

    def on_store(i: int) -> None:
        key = f"bench:{run}:store:{i}"
        token = _urandom(16).hex()
        store.try_acquire(key, token, owner, TTL)
        store.release(key, token)

    def on_batcher(i: int) -> None:
        key = f"bench:{run}:batch:{i}"
        token = _urandom(16).hex()
        assert batcher is not None
        batcher.try_acquire(key, token, owner, TTL, None)
        batcher.release(key, token)

    acquire = locker.acquire

    def on_lock(i: int) -> None:
        acquire(f"bench:{run}:lock:{i}", False, None, TTL).release()

    lock = manager.lock

    def on_api(i: int) -> None:
        with lock(f"bench:{run}:api:{i}", blocking=False):
            pass

    cycles: list[tuple[str, Callable[[int], None], str]] = [
        ("driver", raw, "raw"),
        ("executor", on_executor, "dblock"),
        ("store", on_store, "dblock"),
        ("lock", on_lock, "dblock"),
        ("API", on_api, "dblock"),
    ]
    if batcher is not None:
        cycles.insert(3, ("group commit", on_batcher, "dblock"))

    def close() -> None:
        conn.close()
        manager.close()

    made = [Contender(db, name, cycle, lambda: None, kind) for name, cycle, kind in cycles]
    made[-1].close = close  # (once, for all of them)
    return made


def measure_layers(url: str, *, rounds: int, block: int, seed: int) -> list[CycleResult]:
    database = _database(url)
    bench = Bench(database, url)
    contenders = layer_contenders(bench)
    try:
        return measure_interleaved(
            contenders, rounds=rounds, block=block, rng=random.Random(seed), tick=lambda: None
        )
    finally:
        for c in contenders:
            c.close()
        bench.close()


def _database(url: str) -> str:
    name = sa.make_url(url).get_backend_name()
    return {"postgresql": "postgresql", "sqlite": "sqlite"}.get(name, "mariadb")


def table(results: list[CycleResult]) -> str:
    """Markdown: per floor, the median wall and CPU per cycle and what it adds."""
    rows = [
        "| database | floor | wall µs | adds | client CPU µs | adds | wall / driver |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    by_db: dict[str, list[CycleResult]] = {}
    for r in results:
        by_db.setdefault(r.database, []).append(r)
    for db, found in by_db.items():
        order = {name: i for i, name in enumerate(FLOORS)}
        found.sort(key=lambda r: order[r.name])
        below: CycleResult | None = None
        for r in found:
            if r.error:
                rows.append(f"| {db} | {r.name} | error: {r.error} | | | | |")
                continue
            wall, cpu = r.wall_us[1], r.cpu_us[1]
            add_wall = "" if below is None else f"{wall - below.wall_us[1]:+.1f}"
            add_cpu = "" if below is None else f"{cpu - below.cpu_us[1]:+.1f}"
            ratio = "" if r.ratio is None else f"{r.ratio[1]:.2f}×"
            rows.append(
                f"| {db} | {r.name} | {wall:.1f} | {add_wall} | {cpu:.1f} | {add_cpu} | {ratio} |"
            )
            below = r
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.layers", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("urls", nargs="+", metavar="URL", help="a database URL (several: each)")
    parser.add_argument("--rounds", type=int, default=60, help="interleaved rounds (60)")
    parser.add_argument("--block", type=int, default=100, help="cycles per block (100)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    results: list[CycleResult] = []
    for url in args.urls:
        results += measure_layers(url, rounds=args.rounds, block=args.block, seed=args.seed)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
