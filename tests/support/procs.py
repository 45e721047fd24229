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
    url: str,
    key: str,
    name: str,
    threads: int,
    rounds: int,
    use_lock: bool,
    go: Any,
    lock_url: str | None = None,
    options: dict[str, Any] | None = None,
) -> None:
    """Threads doing a deliberately non-atomic read-modify-write of one counter
    row, each inside the lock (or not, for the control run). The locks are on
    ``lock_url`` (default: ``url``) with ``options``."""
    manager = LockManager(lock_url or url, **(options or {}))
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
    with LockManager(url) as manager, manager.lock(key, ttl=ttl, renew=False) as held:
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


ACCOUNTS = sa.Table(
    "dblock_test_accounts",
    sa.MetaData(),
    sa.Column("id", sa.String(200), primary_key=True),
    sa.Column("value", sa.String(50), nullable=False),
    sa.Column("last_fence", sa.BigInteger, nullable=False),
)


def reset_account(url: str, account: str) -> None:
    engine = counter_engine(url)
    ACCOUNTS.create(engine, checkfirst=True)
    with engine.begin() as conn:
        conn.execute(ACCOUNTS.delete().where(ACCOUNTS.c.id == account))
        conn.execute(ACCOUNTS.insert().values(id=account, value="initial", last_fence=0))
    engine.dispose()


def fenced_write(url: str, account: str, fence: int, value: str) -> int:
    """The README's guarded write: refused (0 rows) unless our fence is newer."""
    engine = counter_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(
            ACCOUNTS.update()
            .where(ACCOUNTS.c.id == account, ACCOUNTS.c.last_fence < fence)
            .values(value=value, last_fence=fence)
        ).rowcount
    engine.dispose()
    return int(rows)


def read_account(url: str, account: str) -> tuple[str, int]:
    engine = counter_engine(url)
    with engine.connect() as conn:
        row = conn.execute(
            sa.select(ACCOUNTS.c.value, ACCOUNTS.c.last_fence).where(ACCOUNTS.c.id == account)
        ).one()
    engine.dispose()
    return str(row.value), int(row.last_fence)


def paused_holder(url: str, key: str, account: str, ttl: float, resume: Any, report: Any) -> None:
    """Hold ``key`` with renewal on; the parent freezes us (SIGSTOP) past the
    lease. After SIGCONT we report what we learned and try our fenced write."""
    from dblock import LockLost

    lost = threading.Event()

    def on_lost(held: Any) -> None:
        report.put(("on_lost", held.key, held.lost_reason))
        lost.set()

    with LockManager(url) as manager:
        held = manager.acquire(key, ttl=ttl, on_lost=on_lost)
        report.put(("acquired", held.fence))
        resume.wait()
        lost.wait(30)
        report.put(("lost", held.lost))
        report.put(("write", fenced_write(url, account, held.fence, "stale")))
        try:
            held.release()
            report.put(("release", "ok"))
        except LockLost as exc:
            report.put(("release", f"LockLost: {exc}"))


def long_holder(url: str, key: str, ttl: float, seconds: float, report: Any) -> None:
    """Hold ``key`` (renewed) for several lease lengths, then release."""
    with LockManager(url) as manager:
        held = manager.acquire(key, ttl=ttl)
        report.put(("acquired", held.fence))
        time.sleep(seconds)
        report.put(("lost", held.lost))
        held.release()
        report.put(("released", True))


def async_increment_worker(
    url: str, keys: list[str], names: list[str], tasks: int, rounds: int, go: Any
) -> None:
    """``tasks`` asyncio tasks of one event loop, task ``i`` on ``keys[i % len]``,
    each doing ``rounds`` non-atomic read-modify-writes of its key's counter
    row (on an async engine) inside the async lock."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    from dblock import AsyncLockManager
    from dblock._store.aio import async_url

    async def main() -> None:
        alocks = AsyncLockManager(url)
        engine = create_async_engine(async_url(sa.make_url(url)), isolation_level="AUTOCOMMIT")

        async def bump(name: str) -> None:
            select = sa.select(COUNTER.c.value).where(COUNTER.c.name == name)
            async with engine.connect() as conn:
                value = (await conn.execute(select)).scalar_one()
            await asyncio.sleep(0.001)  # widen the window a lost update needs
            async with engine.connect() as conn:
                await conn.execute(
                    COUNTER.update().where(COUNTER.c.name == name).values(value=value + 1)
                )

        async def work(i: int) -> None:
            key, name = keys[i % len(keys)], names[i % len(names)]
            for _ in range(rounds):
                async with alocks.lock(key, timeout=120):
                    await bump(name)

        await asyncio.to_thread(go.wait)
        await asyncio.gather(*(work(i) for i in range(tasks)))
        await engine.dispose()
        await alocks.close()

    asyncio.run(main())


def late_renewal_holder(url: str, key: str, ttl: float, resumed: Any, report: Any) -> None:
    """Hold ``key`` (renewed, metrics to an in-memory reader); the parent
    freezes us (SIGSTOP) across the renewal's due time, as a starved CPU
    would. Report what the renewal saw: the lateness metric, the WARNINGs,
    and whether the lock survived."""
    import logging

    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from dblock.telemetry import Telemetry

    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("dblock").addHandler(Keep(logging.WARNING))
    reader = InMemoryMetricReader()
    telemetry = Telemetry(meter_provider=MeterProvider(metric_readers=[reader]))
    with LockManager(url, telemetry=telemetry) as manager:
        held = manager.acquire(key, ttl=ttl)
        first_expiry = held.expires_at
        report.put(("acquired", held.fence))
        resumed.wait(60)
        deadline = time.monotonic() + 10
        while held.expires_at == first_expiry and not held.lost and time.monotonic() < deadline:
            time.sleep(0.01)
        points = [
            point
            for resource in reader.get_metrics_data().resource_metrics
            for scope in resource.scope_metrics
            for metric in scope.metrics
            if metric.name == "dblock.lock.renewal.lateness"
            for point in metric.data.data_points
        ]
        report.put(
            (
                "seen",
                max((p.max for p in points), default=None),
                sum(p.count for p in points),
                warnings,
                held.expires_at > first_expiry,
                held.lost,
            )
        )
        held.release()
