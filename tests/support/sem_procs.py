"""Child-process code for the semaphore tests (spawned: nothing inherited)."""

from __future__ import annotations

import threading
import time
from typing import Any

import sqlalchemy as sa

from dblock import LockManager

INSIDE = sa.Table(
    "dblock_test_inside",
    sa.MetaData(),
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("who", sa.String(100), primary_key=True),
)


def reset_inside(url: str) -> None:
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    INSIDE.create(engine, checkfirst=True)
    engine.dispose()


def hold_permit(url: str, key: str, permits: int, ttl: float, report: Any) -> None:
    """Take a permit, report (slot, fence), keep it (renewed) until killed;
    report "lost" if it is lost meanwhile (after a pause, say)."""
    manager = LockManager(url)
    lost = threading.Event()
    held = manager.semaphore(key, permits=permits, ttl=ttl, on_lost=lambda h: lost.set())
    permit = held.__enter__()
    report.put((permit.slot, permit.fence))
    lost.wait()
    report.put(("lost", permit.fence))
    while True:
        time.sleep(60)


def occupancy_worker(
    url: str, key: str, name: str, permits: int, threads: int, rounds: int, go: Any, out: Any
) -> None:
    """Threads taking a permit, each marking itself inside (a row of its
    own) and counting who is inside, then leaving: report the most seen
    at once and the fences granted."""
    manager = LockManager(url)
    engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    most = 0
    fences: list[int] = []
    mutex = threading.Lock()
    count = sa.select(sa.func.count()).select_from(INSIDE).where(INSIDE.c.name == name)

    def work(n: int) -> None:
        nonlocal most
        who = f"{threading.get_ident()}:{n}:{time.time_ns()}"
        for _ in range(rounds):
            with manager.semaphore(key, permits=permits, timeout=120, ttl=30) as permit:
                with engine.connect() as conn:
                    conn.execute(INSIDE.insert().values(name=name, who=who))
                    seen = int(conn.execute(count).scalar_one())
                time.sleep(0.002)  # widen the window an extra holder needs
                with engine.connect() as conn:
                    conn.execute(INSIDE.delete().where(INSIDE.c.who == who))
                with mutex:
                    most = max(most, seen)
                    fences.append(permit.fence)

    go.wait()
    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    out.put((most, fences))
    manager.close()
    engine.dispose()
