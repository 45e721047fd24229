"""Code that runs in child processes (spawned, so nothing is inherited)."""

from __future__ import annotations

import threading
import time
from typing import Any

import sqlalchemy as sa

from dblock import LockManager

COUNTER = sa.Table(
    "dblock_test_counter",
    sa.MetaData(),
    sa.Column("name", sa.String(200), primary_key=True),
    sa.Column("value", sa.Integer, nullable=False),
)


def counter_engine(url: str) -> sa.Engine:
    return sa.create_engine(url, isolation_level="AUTOCOMMIT")


def reset_counter(url: str, name: str) -> None:
    engine = counter_engine(url)
    COUNTER.create(engine, checkfirst=True)
    with engine.begin() as conn:
        conn.execute(COUNTER.delete().where(COUNTER.c.name == name))
        conn.execute(COUNTER.insert().values(name=name, value=0))
    engine.dispose()


def read_counter(url: str, name: str) -> int:
    engine = counter_engine(url)
    with engine.connect() as conn:
        value = conn.execute(sa.select(COUNTER.c.value).where(COUNTER.c.name == name)).scalar_one()
    engine.dispose()
    return int(value)


def increment_worker(
    url: str, key: str, name: str, threads: int, rounds: int, use_lock: bool, go: Any
) -> None:
    """Threads doing a deliberately non-atomic read-modify-write of one counter
    row, each inside the lock (or not, for the control run)."""
    manager = LockManager(url)
    engine = counter_engine(url)
    select = sa.select(COUNTER.c.value).where(COUNTER.c.name == name)

    def work() -> None:
        for _ in range(rounds):
            if use_lock:
                with manager.lock(key, timeout=120):
                    _bump(engine, select, name)
            else:
                _bump(engine, select, name)

    go.wait()
    _run_threads(work, threads)
    manager.close()
    engine.dispose()


def _run_threads(work: Any, threads: int) -> None:
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()


def _bump(engine: sa.Engine, select: Any, name: str) -> None:
    with engine.connect() as conn:
        value = conn.execute(select).scalar_one()
    time.sleep(0.001)  # widen the window a lost update needs
    with engine.connect() as conn:
        conn.execute(COUNTER.update().where(COUNTER.c.name == name).values(value=value + 1))


def hold_forever(url: str, key: str, ttl: float, report: Any) -> None:
    """Acquire ``key``, report the fence, then hang until killed."""
    manager = LockManager(url)
    held = manager.acquire(key, ttl=ttl)
    report.put(held.fence)
    while True:
        time.sleep(60)


def hold_for(url: str, key: str, ttl: float, seconds: float, report: Any) -> None:
    """Hold ``key`` for ``seconds``, reporting when acquired and when released."""
    with LockManager(url) as manager, manager.lock(key, ttl=ttl) as held:
        report.put(("acquired", held.fence, time.time()))
        time.sleep(seconds)
        report.put(("releasing", held.fence, time.time()))


def many_worker(
    url: str, keys: list[str], name: str, threads: int, rounds: int, reverse: bool, go: Any
) -> None:
    """Threads taking all of ``keys`` with ``lock_many`` (listed in the given
    or reversed order), then doing a non-atomic read-modify-write of one
    counter row per key: a deadlock ends in LockTimeout (a non-zero exit), a
    broken exclusion in lost updates."""
    manager = LockManager(url)
    engine = counter_engine(url)
    order = list(reversed(keys)) if reverse else list(keys)
    failures: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(rounds):
                with manager.lock_many(order, timeout=120):
                    for key in order:
                        counter = f"{name}:{key}"
                        _bump(
                            engine,
                            sa.select(COUNTER.c.value).where(COUNTER.c.name == counter),
                            counter,
                        )
        except BaseException as exc:
            failures.append(exc)

    go.wait()
    _run_threads(work, threads)
    manager.close()
    engine.dispose()
    if failures:
        raise failures[0]
