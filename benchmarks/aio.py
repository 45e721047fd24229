"""The asyncio rows: :class:`~dblock.AsyncLockManager` beside its baselines.

* uncontended lock+unlock on distinct keys, against the raw asyncio driver
  (psycopg's ``AsyncConnection``, aiomysql, aiosqlite) sending the statements
  dblock sends, interleaved block by block with the same shuffle as the
  blocking comparison (:func:`~benchmarks.uncontended.measure_interleaved`):
  each contender runs a whole block in one turn of a shared event loop;
* level 1 for tasks: a second task of the loop asking fail-fast for a key a
  first task holds, per operation, and the statements that sent (none);
* hot key: P processes x T tasks waiting for one key, dblock against the same
  lock with level 1 off (every task goes to the database);
* event-loop lag: tasks contending on a few keys while a ticker task sleeps
  1 ms at a time; its overshoot is how long something kept the loop from it.

Statements are counted by the async store (every statement it sends) and by
an engine listener on the manager's blocking engine (renewals, orphans).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import sqlalchemy as sa

from dblock import AsyncLockManager, BackendError, LockBusy, LockTimeout
from dblock._hooks import async_statements_sent

from .counting import Counter, count_statements
from .hotkey import HotKeyResult, HotKeySpec, _combine
from .procs import Start, run_together
from .stats import percentile
from .uncontended import (
    Bench,
    Contender,
    Unavailable,
    _owner,
    _reason,
    raw_driver,
)

__all__ = [
    "AsyncBench",
    "AsyncLevel1Result",
    "LagResult",
    "LagSpec",
    "hot_spec",
    "make_async_contenders",
    "measure_async_level1",
    "run_async_hot_key",
    "run_lag",
]

_perf = time.perf_counter
_monotonic = time.monotonic
_urandom = os.urandom

#: The ticker's sleep: its overshoot is the lag.
TICK = 0.001


class AsyncBench:
    """One event loop for the in-process async rows, closed with them."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()


class _Statements:
    """Statements a manager sent: the lock statements, as counted by its
    async store (a listener on the async engine would switch it to its
    slower observed path), and what its blocking engine sent (renewals,
    orphans), counted by a listener there."""

    __slots__ = ("_base", "_manager", "_other")

    def __init__(self, manager: AsyncLockManager, other: Counter) -> None:
        self._manager = manager
        self._other = other
        self._base = async_statements_sent(manager)

    @property
    def count(self) -> int:
        return async_statements_sent(self._manager) - self._base + self._other.count

    def reset(self) -> None:
        self._base = async_statements_sent(self._manager)
        self._other.reset()


@contextlib.contextmanager
def _counting(alocks: AsyncLockManager) -> Iterator[_Statements]:
    with count_statements(alocks.sync.engine) as other:
        yield _Statements(alocks, other)


# -- uncontended -------------------------------------------------------------


@dataclasses.dataclass
class _AsyncDriver:
    name: str
    connect: Callable[[], Awaitable[Any]]
    execute: Callable[[Any, str, Any, bool], Awaitable[None]]
    close: Callable[[Any], Awaitable[None]]


async def _execute_on_connection(conn: Any, sql: str, params: Any, fetch: bool) -> None:
    cursor = await conn.execute(sql, params)
    if fetch:
        await cursor.fetchall()


async def _execute_on_cursor(conn: Any, sql: str, params: Any, fetch: bool) -> None:
    async with conn.cursor() as cursor:
        await cursor.execute(sql, params)
        if fetch:
            await cursor.fetchall()


async def _execute_aiosqlite(conn: Any, sql: str, params: Any, fetch: bool) -> None:
    cursor = await conn.execute(sql, params)
    if fetch:
        await cursor.fetchall()
    await cursor.close()


async def _close(conn: Any) -> None:
    await conn.close()


async def _close_aiomysql(conn: Any) -> None:
    conn.close()


def _async_postgresql(url: str) -> _AsyncDriver:
    import psycopg

    conninfo = sa.make_url(url).set(drivername="postgresql").render_as_string(False)

    async def connect() -> Any:
        return await psycopg.AsyncConnection.connect(conninfo, autocommit=True)

    return _AsyncDriver("psycopg async", connect, _execute_on_connection, _close)


def _async_mariadb(url: str) -> _AsyncDriver:
    import aiomysql

    u = sa.make_url(url)

    async def connect() -> Any:
        return await aiomysql.connect(
            host=u.host or "127.0.0.1",
            port=u.port or 3306,
            user=u.username or "",
            password=u.password or "",
            db=u.database,
            autocommit=True,
            charset="utf8mb4",
        )

    return _AsyncDriver("aiomysql", connect, _execute_on_cursor, _close_aiomysql)


def _async_sqlite(url: str) -> _AsyncDriver:
    import aiosqlite

    path = sa.make_url(url).database or ""

    async def connect() -> Any:
        conn = await aiosqlite.connect(path, isolation_level=None, timeout=30)
        await conn.execute("PRAGMA journal_mode=WAL")  # as dblock's engine does
        await conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    return _AsyncDriver("aiosqlite", connect, _execute_aiosqlite, _close)


_ASYNC_DRIVERS = {
    "postgresql": _async_postgresql,
    "mariadb": _async_mariadb,
    "sqlite": _async_sqlite,
}


def make_async_contenders(
    bench: Bench, loop: AsyncBench
) -> tuple[list[Contender], list[Unavailable]]:
    """``AsyncLockManager`` and the raw asyncio driver sending the same
    statements, both on ``loop`` (a block of cycles per turn of it)."""
    db = bench.database
    run = uuid.uuid4().hex[:6]
    try:
        alocks = AsyncLockManager(bench.url, table=bench.table)
        driver = _ASYNC_DRIVERS[db](bench.url)
        conn = loop.run(driver.connect())
    except Exception as exc:
        return [], [Unavailable(db, "dblock asyncio", _reason(exc))]
    lock = alocks.lock
    prefix = f"bench:{run}:async:"

    async def dblock_block(start: int, n: int) -> None:
        for i in range(start, start + n):
            async with lock(prefix + str(i)):
                pass

    sql = raw_driver(bench)
    owner = _owner()
    execute = driver.execute
    acquire, release = sql.acquire, sql.release
    acquire_params, release_params = sql.acquire_params, sql.release_params
    fetch_release = sql.release_returns
    raw_prefix = f"bench:{run}:raw-async:"

    async def raw_block(start: int, n: int) -> None:
        for i in range(start, start + n):
            key = raw_prefix + str(i)
            token = _urandom(16).hex()
            params = {"key": key, "owner": owner, "token": token, **acquire_params}
            await execute(conn, acquire, params, True)
            await execute(conn, release, {"key": key, "token": token, **release_params},
                          fetch_release)  # fmt: skip

    def unused(i: int) -> None:
        raise NotImplementedError  # run_block runs the cycles

    return [
        Contender(
            db,
            "dblock asyncio",
            unused,
            lambda: loop.run(alocks.close()),
            "dblock",
            run_block=lambda start, n: loop.run(dblock_block(start, n)),
        ),
        Contender(
            db,
            f"raw {driver.name}, same SQL",
            unused,
            lambda: loop.run(driver.close(conn)),
            "raw",
            run_block=lambda start, n: loop.run(raw_block(start, n)),
        ),
    ], []


# -- level 1 -----------------------------------------------------------------


@dataclasses.dataclass
class AsyncLevel1Result:
    database: str
    refusal_us: float  # await acquire(key, blocking=False), refused at level 1
    refusal_with_us: float  # async with lock(key, blocking=False), refused at level 1
    reentrant_with_us: float  # async with lock(key) on a key this task holds
    statements: int  # SQL sent during all of the above (must be 0)


def measure_async_level1(bench: Bench, loop: AsyncBench, ops: int) -> AsyncLevel1Result:
    """A task holds a key; another task of the same loop asks for it
    fail-fast (refused, no SQL), and the holder re-enters it (no SQL)."""

    async def main() -> AsyncLevel1Result:
        alocks = AsyncLockManager(bench.url, table=bench.table)
        key = f"bench:async-level1:{uuid.uuid4().hex[:8]}"
        acquire, lock = alocks.acquire, alocks.lock
        n = max(ops // 5, 1)

        async def refuse(n: int) -> float:
            t0 = _perf()
            for _ in range(n):
                try:  # noqa: SIM105 - a context manager per iteration would be timed too
                    await acquire(key, blocking=False)
                except LockBusy:
                    pass
            return _perf() - t0

        async def refuse_with(n: int) -> float:
            t0 = _perf()
            for _ in range(n):
                try:
                    async with lock(key, blocking=False):
                        pass
                except LockBusy:
                    pass
            return _perf() - t0

        async def reenter(n: int) -> float:
            t0 = _perf()
            for _ in range(n):
                async with lock(key):
                    pass
            return _perf() - t0

        async def per_op(run: Callable[[int], Awaitable[float]]) -> float:
            await run(min(n, 1000))  # warm
            return percentile([await run(n) / n for _ in range(5)], 50) * 1e6

        async def other_task() -> tuple[float, float]:
            return await per_op(refuse), await per_op(refuse_with)

        try:
            held = await acquire(key)  # this task holds it; another task asks
            with _counting(alocks) as counted:
                refusal, refusal_with = await asyncio.create_task(other_task())
                reentrant = await per_op(reenter)
                statements = counted.count
            await held.release()
            return AsyncLevel1Result(
                database=bench.database,
                refusal_us=refusal,
                refusal_with_us=refusal_with,
                reentrant_with_us=reentrant,
                statements=statements,
            )
        finally:
            await alocks.close()

    result: AsyncLevel1Result = loop.run(main())
    return result


# -- hot key -----------------------------------------------------------------


def run_async_hot_key(spec: HotKeySpec) -> HotKeyResult:
    """P processes x T tasks (``spec.threads``) on one key, each process one loop."""
    key = f"bench:async-hot:{uuid.uuid4().hex[:10]}"
    parts = run_together(
        _hot_worker, (spec, key), processes=spec.processes, timeout=spec.seconds + 180
    )
    return _combine(spec, parts)


def _hot_worker(spec: HotKeySpec, key: str, start: Start) -> None:
    asyncio.run(_hot_main(spec, key, start))


async def _hot_main(spec: HotKeySpec, key: str, start: Start) -> None:
    alocks = AsyncLockManager(spec.url, table=spec.table, **dict(spec.options))
    inside = 0
    most_inside = 0
    waits: list[float] = []
    tally = {"refused_level1": 0, "refused_level2": 0, "timeouts": 0, "errors": 0}
    lock, hold = alocks.lock, spec.hold

    async def run(deadline: float) -> None:
        nonlocal inside, most_inside
        while _monotonic() < deadline:
            t0 = _monotonic()
            try:
                async with lock(key, timeout=60.0):
                    waits.append(_monotonic() - t0)
                    inside += 1
                    most_inside = max(most_inside, inside)
                    if hold:
                        await asyncio.sleep(hold)
                    inside -= 1
            except LockTimeout:
                tally["timeouts"] += 1
            except BackendError:
                tally["errors"] += 1
                await asyncio.sleep(0.01)

    with _counting(alocks) as counter:
        async with alocks.lock(f"{key}:warm-up:{uuid.uuid4().hex[:6]}"):
            pass
        start.ready.put(True)
        await asyncio.to_thread(start.go.wait)
        counter.reset()
        began = _monotonic()
        deadline = began + spec.seconds
        await asyncio.gather(*(run(deadline) for _ in range(spec.threads)))
        elapsed = _monotonic() - began
        statements = counter.count
    await alocks.close()
    start.results.put(
        {
            **tally,
            "grants": len(waits),
            "waits": waits,
            "statements": statements,
            "elapsed": elapsed,
            "max_concurrent": most_inside,
        }
    )


# -- event-loop lag ----------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class LagSpec:
    database: str
    url: str
    table: str
    processes: int
    tasks: int  # in all, spread over the processes
    keys: int
    seconds: float
    hold: float


@dataclasses.dataclass
class LagResult:
    database: str
    processes: int
    tasks: int
    keys: int
    seconds: float
    grants: int
    grants_per_s: float
    statements_per_grant: float
    ticks: int
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    # The lag less the time the loop's thread spent runnable but waiting for
    # a CPU (Linux's schedstat): what the process itself kept the loop from.
    rest_p99_ms: float
    rest_max_ms: float
    gc_max_ms: float  # the longest garbage collection in any process
    loop_cpu: float  # share of one core the loop's thread used, mean over processes
    max_concurrent: int  # most tasks inside one key at once in one process (must be 1)
    errors: int


def run_lag(spec: LagSpec) -> LagResult:
    run = uuid.uuid4().hex[:8]
    keys = tuple(f"bench:lag:{run}:{i}" for i in range(spec.keys))
    parts = run_together(
        _lag_worker, (spec, keys), processes=spec.processes, timeout=spec.seconds + 180
    )
    lags = [x for p in parts for x in p["lags"]]
    rest = [x for p in parts for x in p["unexplained"]]
    grants = sum(p["grants"] for p in parts)
    statements = sum(p["statements"] for p in parts)
    elapsed = max(p["elapsed"] for p in parts)
    return LagResult(
        database=spec.database,
        processes=spec.processes,
        tasks=spec.tasks,
        keys=spec.keys,
        seconds=elapsed,
        grants=grants,
        grants_per_s=grants / elapsed if elapsed else 0.0,
        statements_per_grant=statements / grants if grants else float("inf"),
        ticks=len(lags),
        lag_p50_ms=percentile(lags, 50) * 1e3,
        lag_p99_ms=percentile(lags, 99) * 1e3,
        lag_max_ms=max(lags, default=float("nan")) * 1e3,
        rest_p99_ms=percentile(rest, 99) * 1e3,
        rest_max_ms=max(rest, default=float("nan")) * 1e3,
        gc_max_ms=max(p["gc_max"] for p in parts) * 1e3,
        loop_cpu=sum(p["cpu"] for p in parts) / len(parts),
        max_concurrent=max(p["max_concurrent"] for p in parts),
        errors=sum(p["errors"] for p in parts),
    )


def _run_queue_clock() -> Callable[[], float]:
    """Seconds this thread has spent runnable but waiting for a CPU (Linux);
    elsewhere a clock that never moves."""
    try:
        # Opened once and re-read: cheap enough for a 1 ms ticker.
        f = open("/proc/thread-self/schedstat", "rb", buffering=0)  # noqa: SIM115
    except OSError:
        return lambda: 0.0

    def read() -> float:
        f.seek(0)
        return int(f.read().split()[1]) / 1e9

    return read


async def _warm(alocks: AsyncLockManager, keys: tuple[str, ...]) -> None:
    """The pool's connections and the statements, before the measurement."""
    for key in keys:
        async with alocks.lock(key):
            pass


class _GcPauses:
    """A ``gc.callbacks`` entry: the longest collection seen."""

    __slots__ = ("_began", "longest")

    def __init__(self) -> None:
        self._began = 0.0
        self.longest = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = _perf()
        else:
            self.longest = max(self.longest, _perf() - self._began)


def _my_share(spec: LagSpec, start: Start) -> int:
    """This process's part of the tasks."""
    with start.counter.get_lock():
        me = int(start.counter.value)
        start.counter.value += 1
    return spec.tasks // spec.processes + (me < spec.tasks % spec.processes)


def _lag_worker(spec: LagSpec, keys: tuple[str, ...], start: Start) -> None:
    asyncio.run(_lag_main(spec, keys, start))


async def _lag_main(spec: LagSpec, keys: tuple[str, ...], start: Start) -> None:
    alocks = AsyncLockManager(spec.url, table=spec.table)
    tasks = _my_share(spec, start)
    inside = dict.fromkeys(keys, 0)
    most_inside = 0
    grants = errors = 0
    stop = False
    lags: list[float] = []
    unexplained: list[float] = []
    lock, hold = alocks.lock, spec.hold

    async def ticker() -> None:
        sleep = asyncio.sleep
        queued = _run_queue_clock()
        while not stop:
            t0, q0 = _perf(), queued()
            await sleep(TICK)
            lag = _perf() - t0 - TICK
            lags.append(lag)
            unexplained.append(lag - (queued() - q0))

    async def contend(key: str) -> None:
        nonlocal grants, errors, most_inside
        while not stop:
            try:
                async with lock(key, timeout=60.0):
                    grants += 1
                    inside[key] += 1
                    most_inside = max(most_inside, inside[key])
                    await asyncio.sleep(hold)
                    inside[key] -= 1
            except (BackendError, LockTimeout):
                errors += 1
                await asyncio.sleep(0.01)

    pauses = _GcPauses()
    with _counting(alocks) as counter:
        await _warm(alocks, keys)
        start.ready.put(True)
        await asyncio.to_thread(start.go.wait)
        counter.reset()
        tick = asyncio.create_task(ticker())
        gc.callbacks.append(pauses)
        began, cpu0 = _perf(), time.thread_time()
        workers = [asyncio.create_task(contend(keys[i % len(keys)])) for i in range(tasks)]
        await asyncio.sleep(spec.seconds)
        stop = True
        await asyncio.gather(*workers)
        elapsed, cpu = _perf() - began, time.thread_time() - cpu0
        gc.callbacks.remove(pauses)
        await tick
        statements = counter.count
    await alocks.close()
    start.results.put(
        {
            "lags": lags,
            "unexplained": unexplained,
            "gc_max": pauses.longest,
            "grants": grants,
            "errors": errors,
            "statements": statements,
            "elapsed": elapsed,
            "cpu": cpu / elapsed if elapsed else 0.0,
            "max_concurrent": most_inside,
        }
    )


def hot_spec(
    database: str, url: str, table: str, label: str, options: tuple[tuple[str, Any], ...], **kw: Any
) -> HotKeySpec:
    return HotKeySpec(
        database=database,
        url=url,
        table=table,
        label=label,
        options=options,
        blocking=True,
        retry_after=0.0,
        **kw,
    )
