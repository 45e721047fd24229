"""Group-commit batches of many processes against one PostgreSQL server, to
count the deadlocks it reports (issue 32, defect 2).

``python -m tests.support.batch_deadlocks fresh|analysed SECONDS`` starts a
private PostgreSQL server, makes the lock table (ANALYZEd over 5,000 rows,
or never), runs the load below and prints the ``deadlock detected`` lines
of the server's log (:func:`measure`); ``python -m
tests.support.batch_deadlocks URL SECONDS [PROCESSES THREADS KEYS]``
runs PROCESSES processes of THREADS threads each for SECONDS seconds. Each
thread takes a key of a small shared pool (without waiting: a busy key is
skipped), holds it a moment and releases it, so the acquire and release
lanes of every process batch, and batches of both processes share keys. The
lease is short (:data:`TTL`) and some locks are held past a third of it, so the
renewal thread's batched UPDATE runs among them. Each process prints one
line ``done GRANTS ERRORS`` (errors: mostly leases lost on an overloaded
machine, not deadlocks).
"""

from __future__ import annotations

import multiprocessing
import random
import sys
import threading
import time

from dblock import LockBusy, LockManager

#: The lease: short, so that the renewal thread's batch runs among the others
#: (renewal is due at a third of it), long enough for an overloaded two-core
#: machine to renew in time.
TTL = 1.5


def _thread(manager: LockManager, keys: list[str], stop: float, counts: list[int]) -> None:
    rng = random.Random()
    while time.monotonic() < stop:
        key = rng.choice(keys)
        try:
            with manager.lock(key, blocking=False, ttl=TTL):
                counts[0] += 1
                # Mostly short holds; one in twenty outlives a renewal interval.
                time.sleep(TTL / 2 if rng.random() < 0.05 else rng.random() * 0.002)
        except LockBusy:
            pass
        except Exception:  # counted (a lease lost on a loaded machine), and the run goes on
            counts[1] += 1


def _process(url: str, seconds: float, threads: int, keys: int) -> None:
    names = [f"dl:{i:04d}" for i in range(keys)]
    manager = LockManager(url)
    stop = time.monotonic() + seconds
    counts = [0, 0]
    workers = [
        threading.Thread(target=_thread, args=(manager, names, stop, counts))
        for _ in range(threads)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    manager.close()
    print(f"done {counts[0]} {counts[1]}", flush=True)


def run(url: str, seconds: float, processes: int = 2, threads: int = 32, keys: int = 48) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_process, args=(url, seconds, threads, keys)) for _ in range(processes)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(seconds + 120)
        if p.exitcode != 0:
            raise RuntimeError(f"a load process ended with {p.exitcode}")


def measure(seconds: float, *, analysed: bool, processes: int = 2, threads: int = 32) -> int:
    """The ``deadlock detected`` lines a private server logs over a run of
    ``seconds`` on a fresh lock table, ANALYZEd first or never."""
    import sqlalchemy as sa

    from tests.support.servers import PrivatePostgres

    with PrivatePostgres(deadlock_timeout="1s", autovacuum="off") as pg:
        with LockManager(pg.url) as manager:
            manager.create_schema()
        if analysed:
            engine = sa.create_engine(pg.url, poolclass=sa.pool.NullPool)
            with engine.begin() as conn:
                # Planned as a table of thousands of keys, as a busy one is.
                conn.exec_driver_sql(
                    "INSERT INTO dblock_locks (lock_key, owner, token, fence, acquired_at, "
                    "expires_at) SELECT 'filler:' || i, 'x', 't' || i, i, now(), "
                    "now() - interval '1 hour' FROM generate_series(1, 5000) i"
                )
                conn.exec_driver_sql("ANALYZE dblock_locks")
            engine.dispose()
        run(pg.url, seconds, processes, threads)
        log = (pg.dir / "log").read_text(errors="replace")
    return log.count("deadlock detected")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[0] in ("fresh", "analysed"):
        print(args[0], measure(float(args[1]), analysed=args[0] == "analysed"), "deadlocks")
    else:
        run(args[0], float(args[1]), *(int(a) for a in args[2:]))
