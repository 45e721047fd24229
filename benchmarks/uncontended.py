"""Uncontended lock+unlock on distinct keys, and level 1's in-process costs.

Every contender runs one lock+unlock cycle per call, on a key nobody else
uses. They are measured *interleaved*: each round runs a small block of
cycles of every contender, in a shuffled order, so drift on a shared machine
(fsync latency, other processes) lands on all of them alike. Per contender
we keep the per-block mean wall time and client CPU (``time.thread_time``,
far steadier than wall time), and per round the ratio of dblock's block to
the raw driver's block of the same round.

The raw baselines are the driver alone on one autocommit connection:

* "raw, same SQL" sends exactly the statements dblock sends (read from the
  store), so the ratio shows what dblock's Python costs;
* "raw, plain" sends the plainest ``INSERT`` / ``DELETE`` on a two-column
  table, so the difference shows what the arbitration SQL itself costs
  (fence sequence, lease, holder read, notification).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from dblock import LockBusy, LockManager
from dblock._hooks import LockStatements, lock_statements

from .counting import count_statements
from .options import BenchOptions
from .stats import percentile, spread

__all__ = [
    "READ_LOCK",
    "Contender",
    "CycleResult",
    "Level1Result",
    "Unavailable",
    "make_contenders",
    "measure_interleaved",
    "measure_level1",
]

_urandom = os.urandom
_perf = time.perf_counter
_cpu = time.thread_time
TTL = 30.0


@dataclasses.dataclass
class Contender:
    database: str
    name: str
    cycle: Callable[[int], None]
    close: Callable[[], None]
    # "dblock" (and its variants), "raw" (same SQL), "plain", or "other"
    kind: str
    baseline_of: str = ""  # for "other": which database's raw driver it is compared with
    # Runs cycles ``start`` .. ``start + n - 1`` at once (an asyncio contender
    # runs a whole block in one turn of its event loop); default: ``cycle`` each.
    run_block: Callable[[int, int], None] | None = None


@dataclasses.dataclass
class Unavailable:
    database: str
    name: str
    reason: str


@dataclasses.dataclass
class CycleResult:
    database: str
    name: str
    kind: str
    cycles: int
    wall_us: tuple[float, float, float]  # p10, median, p90 of block means
    cpu_us: tuple[float, float, float]
    ratio: tuple[float, float, float] | None  # to the raw driver, paired per round
    ratio_plain: float | None  # median wall over the plain INSERT/DELETE's median
    cpu_ratio: float | None  # median client CPU over the raw driver's
    error: str = ""
    # The read lock only: to the exclusive dblock lock of the same database,
    # paired per round like ``ratio`` (wall; and median client CPU).
    ratio_exclusive: tuple[float, float, float] | None = None
    cpu_ratio_exclusive: float | None = None


def _owner() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.current_thread().name}"


def _plain_ddl(dialect: str, table: str) -> str:
    key = "VARCHAR(255) COLLATE utf8mb4_bin" if dialect == "mysql" else "VARCHAR(255)"
    return f"CREATE TABLE {table} (lock_key {key} PRIMARY KEY, token VARCHAR(64) NOT NULL)"


class Bench:
    """The private tables of one database, created now and dropped on close."""

    def __init__(self, database: str, url: str) -> None:
        self.database = database
        # A cluster is given by its nodes' URLs, comma-separated: the
        # single-threaded sections use the first, the hot key spreads its
        # processes over all of them.
        self.urls = tuple(u.strip() for u in url.split(",") if u.strip())
        self.url = url = self.urls[0]
        suffix = uuid.uuid4().hex[:8]
        self.table = f"dblock_bench_{suffix}"
        self.plain = f"dblock_bench_{suffix}_plain"
        self.manager = LockManager(url, table=self.table)
        self.manager.create_schema()
        self.engine = sa.create_engine(url, isolation_level="AUTOCOMMIT")
        with self.engine.connect() as conn:
            conn.exec_driver_sql(_plain_ddl(self.engine.dialect.name, self.plain))

    def vacuum(self) -> None:
        """PostgreSQL: ``VACUUM (ANALYZE)`` both tables, so that the next
        section starts with none of the dead rows the earlier ones left (a
        shared server may run with autovacuum off, and autovacuum visits once
        a minute at most) and with current statistics: a number must not
        depend on what ran before it. Plain SQL on this engine (autocommit:
        VACUUM cannot run in a transaction). MariaDB's purge and SQLite's free
        pages take no such step."""
        if self.engine.dialect.name != "postgresql":
            return
        with self.engine.connect() as conn:
            conn.exec_driver_sql(f"VACUUM (ANALYZE) {self.table}, {self.plain}")

    def close(self) -> None:
        try:
            with self.engine.connect() as conn:
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {self.plain}")
            self.manager.drop_schema()
        finally:
            self.manager.close()
            self.engine.dispose()


def make_contenders(
    bench: Bench, options: BenchOptions, redis_url: str
) -> tuple[list[Contender], list[Unavailable]]:
    """dblock, its variants, the raw driver (same SQL and plain) and the
    third-party locks that exist for this database."""
    db = bench.database
    run = uuid.uuid4().hex[:6]
    made: list[Contender] = []
    missing: list[Unavailable] = []

    def dblock_contender(name: str, manager: LockManager) -> Contender:
        prefix = f"bench:{run}:{name}:"
        lock = manager.lock

        def cycle(i: int) -> None:
            with lock(prefix + str(i)):
                pass

        return Contender(db, name, cycle, manager.close, "dblock")

    made.append(dblock_contender("dblock", LockManager(bench.url, table=bench.table)))
    made.append(_read_lock_contender(db, run, LockManager(bench.url, table=bench.table)))
    for variant in options.variants:
        manager = LockManager(bench.url, table=bench.table, **variant.manager_options())
        made.append(dblock_contender(f"dblock {variant.name}", manager))
    raw, plain = _raw_contenders(bench, run)
    made += [raw, plain]
    for build in _OTHERS.get(db, ()):
        try:
            made.append(build(bench, run, redis_url))
        except Exception as exc:
            name = build.__doc__ or build.__name__
            missing.append(Unavailable(db, name.strip(), _reason(exc)))
    return made, missing


#: The read-write lock's shared side, measured beside the exclusive lock.
READ_LOCK = "dblock read_lock"


def _read_lock_contender(db: str, run: str, manager: LockManager) -> Contender:
    prefix = f"bench:{run}:read:"
    read_lock = manager.read_lock

    def cycle(i: int) -> None:
        with read_lock(prefix + str(i)):
            pass

    return Contender(db, READ_LOCK, cycle, manager.close, "dblock")


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"[:160]


@dataclasses.dataclass
class _Driver:
    """One database's raw driver, and dblock's own statements for it."""

    name: str
    connect: Callable[[], Any]
    execute: Callable[[Any, str, Any, bool], None]
    acquire: str
    release: str
    acquire_params: dict[str, Any]
    release_params: dict[str, Any]
    placeholder: str
    release_returns: bool
    #: Whether an acquire's answer (rows, row count, token) granted the lock.
    granted: Callable[[Any, int, str], bool]


def _execute_on_connection(conn: Any, sql: str, params: Any, fetch: bool) -> None:
    cursor = conn.execute(sql, params)
    if fetch:
        cursor.fetchall()


def _execute_on_cursor(conn: Any, sql: str, params: Any, fetch: bool) -> None:
    with conn.cursor() as cursor:
        cursor.execute(sql, params)
        if fetch:
            cursor.fetchall()


def _postgresql_driver(bench: Bench, sql: LockStatements) -> _Driver:
    import psycopg

    conninfo = sa.make_url(bench.url).set(drivername="postgresql").render_as_string(False)
    return _Driver(
        name="psycopg",
        connect=lambda: psycopg.connect(conninfo, autocommit=True),
        execute=_execute_on_connection,
        acquire=sql.acquire,
        release=sql.release,
        acquire_params=sql.acquire_params(TTL),
        release_params=sql.release_params,
        placeholder="%s",
        release_returns=sql.release_returns,
        granted=sql.granted,
    )


def _mariadb_driver(bench: Bench, sql: LockStatements) -> _Driver:
    """The URL's own driver: PyMySQL (``mysql+pymysql://``, the default) or
    mysqlclient (``mysql+mysqldb://``), so dblock is compared with the
    driver it runs on."""
    url = sa.make_url(bench.url)
    options: dict[str, Any] = {
        "host": url.host,
        "port": url.port or 3306,
        "user": url.username or "",
        "password": url.password or "",
        "database": url.database,
        "autocommit": True,
        "charset": "utf8mb4",
    }
    if url.get_driver_name() == "mysqldb":
        import MySQLdb

        name, module = "mysqlclient", MySQLdb
    else:
        import pymysql

        name, module = "PyMySQL", pymysql
    return _Driver(
        name=name,
        connect=lambda: module.connect(**options),
        execute=_execute_on_cursor,
        acquire=sql.acquire,
        release=sql.release,
        acquire_params=sql.acquire_params(TTL),
        release_params=sql.release_params,
        placeholder="%s",
        release_returns=sql.release_returns,
        granted=sql.granted,
    )


def _sqlite_driver(bench: Bench, sql: LockStatements) -> _Driver:
    import sqlite3

    path = sa.make_url(bench.url).database or ""

    def connect() -> Any:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=30)
        conn.execute("PRAGMA journal_mode=WAL")  # as dblock's engine does
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    return _Driver(
        name="sqlite3",
        connect=connect,
        execute=_execute_on_connection,
        acquire=sql.acquire,
        release=sql.release,
        acquire_params=sql.acquire_params(TTL),
        release_params=sql.release_params,
        placeholder="?",
        release_returns=sql.release_returns,
        granted=sql.granted,
    )


_DRIVERS = {
    "postgresql": _postgresql_driver,
    "mariadb": _mariadb_driver,
    "galera": _mariadb_driver,
    "sqlite": _sqlite_driver,
}


def raw_driver(bench: Bench, manager: LockManager | None = None) -> _Driver:
    """The raw driver for ``bench``'s database, with the statements
    ``manager`` (default: the bench's own) sends for one lock."""
    return _DRIVERS[bench.database](bench, lock_statements(manager or bench.manager))


def _raw_contenders(bench: Bench, run: str) -> tuple[Contender, Contender]:
    driver = raw_driver(bench)
    owner = _owner()
    execute = driver.execute
    conn, plain_conn = driver.connect(), driver.connect()
    acquire, release = driver.acquire, driver.release
    acquire_params, release_params = driver.acquire_params, driver.release_params
    fetch_release = driver.release_returns
    same_prefix = f"bench:{run}:raw:"

    def same_sql(i: int) -> None:
        key = same_prefix + str(i)
        token = _urandom(16).hex()
        execute(conn, acquire, {"key": key, "owner": owner, "token": token, **acquire_params}, True)
        execute(conn, release, {"key": key, "token": token, **release_params}, fetch_release)

    ph = driver.placeholder
    insert = f"INSERT INTO {bench.plain} (lock_key, token) VALUES ({ph}, {ph})"
    delete = f"DELETE FROM {bench.plain} WHERE lock_key = {ph}"
    plain_prefix = f"bench:{run}:plain:"

    def plain(i: int) -> None:
        key = plain_prefix + str(i)
        execute(plain_conn, insert, (key, _urandom(16).hex()), False)
        execute(plain_conn, delete, (key,), False)

    db = bench.database
    return (
        Contender(db, f"raw {driver.name}, same SQL", same_sql, conn.close, "raw"),
        Contender(db, f"raw {driver.name}, plain INSERT/DELETE", plain, plain_conn.close, "plain"),
    )


def _sadlock(bench: Bench, run: str, redis_url: str) -> Contender:
    """sqlalchemy-dlock"""
    from sqlalchemy_dlock.factory import create_sadlock

    engine = sa.create_engine(bench.url, isolation_level="AUTOCOMMIT")
    conn = engine.connect()
    prefix = f"bench:{run}:sadlock:"
    kind = "advisory lock" if bench.database == "postgresql" else "GET_LOCK"

    def cycle(i: int) -> None:
        lock: Any = create_sadlock(conn, prefix + str(i))
        if not lock.acquire(block=False):
            raise LockBusy(prefix + str(i), level=2)
        lock.release()

    def close() -> None:
        conn.close()
        engine.dispose()

    return Contender(
        bench.database, f"sqlalchemy-dlock ({kind})", cycle, close, "other", bench.database
    )


def _redis(bench: Bench, run: str, redis_url: str) -> Contender:
    """redis-py Lock"""
    import redis

    client = redis.Redis.from_url(redis_url)
    client.ping()
    prefix = f"dblock-bench:{run}:"

    def cycle(i: int) -> None:
        lock = client.lock(prefix + str(i), timeout=TTL)
        if not lock.acquire(blocking=False):
            raise LockBusy(prefix + str(i), level=2)
        lock.release()

    return Contender("redis", "redis-py Lock", cycle, client.close, "other", "postgresql")


_OTHERS: dict[str, tuple[Callable[[Bench, str, str], Contender], ...]] = {
    "postgresql": (_sadlock, _redis),
    "mariadb": (_sadlock,),
}


def measure_interleaved(
    contenders: list[Contender],
    *,
    rounds: int,
    block: int,
    rng: random.Random,
    tick: Callable[[], None],
) -> list[CycleResult]:
    """Run every contender in interleaved blocks; see the module docstring."""
    walls: dict[str, list[float]] = {c.name: [] for c in contenders}
    cpus: dict[str, list[float]] = {c.name: [] for c in contenders}
    errors: dict[str, str] = {}
    next_i = dict.fromkeys(walls, 0)
    order = list(contenders)
    for warm_up in (True,) + (False,) * rounds:
        rng.shuffle(order)
        for c in order:
            if c.name in errors:
                continue
            start = next_i[c.name]
            cycle, run_block = c.cycle, c.run_block
            try:
                t0, c0 = _perf(), _cpu()
                if run_block is not None:
                    run_block(start, block)
                else:
                    for i in range(start, start + block):
                        cycle(i)
                wall, cpu = _perf() - t0, _cpu() - c0
            except Exception as exc:
                errors[c.name] = _reason(exc)
                continue
            next_i[c.name] = start + block
            if not warm_up:
                walls[c.name].append(wall / block * 1e6)
                cpus[c.name].append(cpu / block * 1e6)
        if not warm_up:
            tick()
    return _summarise(contenders, walls, cpus, errors, block)


def _summarise(
    contenders: list[Contender],
    walls: dict[str, list[float]],
    cpus: dict[str, list[float]],
    errors: dict[str, str],
    block: int,
) -> list[CycleResult]:
    by_kind: dict[tuple[str, str], Contender] = {(c.database, c.kind): c for c in contenders}
    by_name: dict[tuple[str, str], Contender] = {(c.database, c.name): c for c in contenders}
    results = []
    for c in contenders:
        base_db = c.baseline_of or c.database
        raw = by_kind.get((base_db, "raw"))
        plain = by_kind.get((base_db, "plain"))
        ratio = ratio_plain = cpu_ratio = None
        mine = walls[c.name]
        if raw is not None and raw is not c and mine and walls[raw.name]:
            paired = [a / b for a, b in zip(mine, walls[raw.name], strict=False)]
            ratio = spread(paired)
            cpu_ratio = percentile(cpus[c.name], 50) / percentile(cpus[raw.name], 50)
        if plain is not None and plain is not c and mine and walls[plain.name]:
            ratio_plain = percentile(mine, 50) / percentile(walls[plain.name], 50)
        ratio_ex = cpu_ex = None
        exclusive = by_name.get((c.database, "dblock"))
        if c.name == READ_LOCK and exclusive is not None and mine and walls[exclusive.name]:
            ratio_ex = spread([a / b for a, b in zip(mine, walls[exclusive.name], strict=False)])
            cpu_ex = percentile(cpus[c.name], 50) / percentile(cpus[exclusive.name], 50)
        results.append(
            CycleResult(
                database=c.database,
                name=c.name,
                kind=c.kind,
                cycles=len(mine) * block,
                wall_us=spread(mine),
                cpu_us=spread(cpus[c.name]),
                ratio=ratio,
                ratio_plain=ratio_plain,
                ratio_exclusive=ratio_ex,
                cpu_ratio_exclusive=cpu_ex,
                cpu_ratio=cpu_ratio,
                error=errors.get(c.name, ""),
            )
        )
    return results


# -- level 1: no SQL at all ------------------------------------------------


@dataclasses.dataclass
class Level1Result:
    database: str
    refusal_us: float  # acquire(blocking=False) refused at level 1
    refusal_with_us: float  # `with lock(key, blocking=False)` refused at level 1
    reentrant_acquire_us: float
    reentrant_release_us: float
    reentrant_with_us: float  # `with lock(key)` on a key this thread holds
    statements: int  # SQL sent during all of the above (must be 0)


def measure_level1(manager: LockManager, database: str, ops: int) -> Level1Result:
    """Per-operation cost of level 1's answers, timed over many iterations
    (median of five runs), and the statements they sent (none, we check)."""
    key = f"bench:level1:{uuid.uuid4().hex[:8]}"
    refusal, refusal_with, refused_sql = _refusals(manager, key, ops)
    acquire_us, release_us, with_us, reentrant_sql = _reentrant(manager, f"{key}:mine", ops)
    return Level1Result(
        database=database,
        refusal_us=refusal,
        refusal_with_us=refusal_with,
        reentrant_acquire_us=acquire_us,
        reentrant_release_us=release_us,
        reentrant_with_us=with_us,
        statements=refused_sql + reentrant_sql,
    )


def _refusals(manager: LockManager, key: str, ops: int) -> tuple[float, float, int]:
    """Another thread holds ``key``: fail-fast requests are refused at level 1."""
    held_elsewhere = threading.Event()
    done = threading.Event()

    def hold() -> None:
        with manager.lock(key):
            held_elsewhere.set()
            done.wait()

    holder = threading.Thread(target=hold, name="bench-holder")
    holder.start()
    held_elsewhere.wait()
    acquire, lock = manager.acquire, manager.lock

    # try/except rather than contextlib.suppress: a context manager per
    # iteration would be timed too.
    def refuse(n: int) -> float:
        t0 = _perf()
        for _ in range(n):
            try:  # noqa: SIM105
                acquire(key, blocking=False)
            except LockBusy:
                pass
        return _perf() - t0

    def refuse_with(n: int) -> float:
        t0 = _perf()
        for _ in range(n):
            try:
                with lock(key, blocking=False):
                    pass
            except LockBusy:
                pass
        return _perf() - t0

    try:
        with count_statements(manager.engine) as counted:
            refuse(1000)
            refuse_with(1000)
        return _per_op(refuse, ops), _per_op(refuse_with, ops), counted.count
    finally:
        done.set()
        holder.join()


def _reentrant(manager: LockManager, key: str, ops: int) -> tuple[float, float, float, int]:
    """This thread holds ``key`` and asks again: acquire, release, and both."""
    acquire, lock = manager.acquire, manager.lock
    outer = manager.acquire(key)
    depth: list[Any] = []

    def enter(n: int) -> float:
        t0 = _perf()
        for _ in range(n):
            depth.append(acquire(key))
        return _perf() - t0

    def leave(n: int) -> float:
        t0 = _perf()
        for held in depth[-n:]:
            held.release()
        del depth[-n:]
        return _perf() - t0

    def reenter_with(n: int) -> float:
        t0 = _perf()
        for _ in range(n):
            with lock(key):
                pass
        return _perf() - t0

    try:
        with count_statements(manager.engine) as counted:
            enter(1000)
            leave(1000)
            reenter_with(1000)
        n = max(ops // 5, 1)
        acquire_times, release_times = [], []
        for _ in range(5):
            acquire_times.append(enter(n) / n)
            release_times.append(leave(n) / n)
        with_us = _per_op(reenter_with, ops)
    finally:
        outer.release()
    return (
        percentile(acquire_times, 50) * 1e6,
        percentile(release_times, 50) * 1e6,
        with_us,
        counted.count,
    )


def _per_op(run: Callable[[int], float], ops: int) -> float:
    """Microseconds per operation: the median of five timed runs."""
    n = max(ops // 5, 1)
    return percentile([run(n) / n for _ in range(5)], 50) * 1e6


def close_all(contenders: list[Contender]) -> None:
    for c in contenders:
        with contextlib.suppress(Exception):  # after the run: nothing left to save
            c.close()
