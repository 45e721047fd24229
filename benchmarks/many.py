"""Many users at once: P processes x T threads (or tasks), each on random keys.

Every thread (or asyncio task) loops: pick a key at random from a large space
(1,000,000 keys, so two requests rarely meet), lock it (fail-fast, or
waiting with a timeout), unlock it at once (an empty critical section).
What it measures is what a lock costs when many users each want their own:
the database's round trips and commits, and the client's CPU.

Contenders, interleaved as the uncontended row is: the worker processes are
spawned once per (database, face, P) and run every configuration (T, mode)
in *windows* of a few seconds, one contender at a time, in a shuffled order
each round, so drift on a shared machine lands on all of them alike:

* dblock (``LockManager`` / ``AsyncLockManager``);
* the raw driver (psycopg / PyMySQL / sqlite3; psycopg async / aiomysql /
  aiosqlite) sending **the statements dblock sends** for one lock today,
  read from the store, one connection per thread or task;
* sqlalchemy-dlock: PostgreSQL advisory locks, MariaDB ``GET_LOCK``;
* redis-py ``Lock`` (``redis.asyncio`` for tasks), measured beside the
  first database only (it is the same Redis whichever database is compared).

Connections. Only the contender of the current window has connections open
(each opens them before its window, warms them with one cycle per thread,
and closes them after; every process waits at a barrier in between), so a
contender may use the whole budget: ``connections`` server connections in
all, ``connections // P`` per process, everything included (dblock's LISTEN
connection on PostgreSQL, the asyncio manager's blocking engine). A
contender with more threads than that shares its connections (dblock and
sqlalchemy-dlock through their SQLAlchemy pools, the raw driver through a
first-come first-served hand-off, statement by statement as dblock does);
with fewer, each thread has its own. The default budget, 80, keeps a run under PostgreSQL's default
``max_connections`` of 100 with room for the admin and other clients.

Per window and contender: grants, refusals, timeouts, errors; the acquire
latency of every grant (request to granted); statements and commits, counted
in every process at the driver (:mod:`benchmarks.dbapi`); client CPU of the
whole process (``time.process_time``: every thread, dblock's renewal and
listener threads included).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import multiprocessing
import os
import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

import sqlalchemy as sa

from dblock import LockBusy, LockTimeout

from .stats import percentile
from .uncontended import TTL, Bench, _Driver, _owner, _reason, raw_driver

__all__ = ["Group", "ManyResult", "ManySpec", "make_specs", "run_many", "summarise"]

_perf = time.perf_counter
_monotonic = time.monotonic
_urandom = os.urandom

CONTENDERS = ("dblock", "raw", "sadlock", "redis")
# How long a barrier waits for the slowest process (set-up, a window, a close).
_BARRIER_SECONDS = 180.0


class _Refused(Exception):
    """A fail-fast request found the key held."""


class _TimedOut(Exception):
    """A waiting request ran out of time."""


_REFUSED = (_Refused, LockBusy)
_TIMED_OUT = (_TimedOut, LockTimeout)


@dataclasses.dataclass(frozen=True)
class Group:
    """One configuration: T threads (tasks) per process, fail-fast or waiting."""

    threads: int
    blocking: bool

    @property
    def mode(self) -> str:
        return "waiting" if self.blocking else "fail-fast"


@dataclasses.dataclass(frozen=True)
class Window:
    group: int  # index into ManySpec.groups
    round: int
    contender: str  # one of CONTENDERS


@dataclasses.dataclass(frozen=True, kw_only=True)
class ManySpec:
    """One set of worker processes and everything they run, in order."""

    database: str
    url: str
    table: str
    redis_url: str
    face: str  # "threads" or "asyncio"
    processes: int
    groups: tuple[Group, ...]
    windows: tuple[Window, ...]
    seconds: float  # per window
    keys: int
    connections: int  # server connections in all, for the contender of a window
    timeout: float  # a waiting request's
    run: str

    @property
    def per_process(self) -> int:
        return max(1, self.connections // self.processes)


@dataclasses.dataclass
class ManyResult:
    """One contender at one configuration, over all its rounds."""

    database: str
    face: str
    processes: int
    threads: int
    mode: str
    contender: str  # dblock, raw, sadlock, redis
    name: str  # as shown
    connections: int  # per process
    rounds: int
    seconds: float
    grants: int
    grants_per_s: float
    p50_ms: float
    p99_ms: float
    statements_per_grant: float | None
    commits_per_grant: float | None
    cpu_us_per_grant: float
    refused: int
    timeouts: int
    errors: int
    error: str = ""
    # Per round, dblock's grants/s over the raw driver's (same configuration,
    # adjacent windows): (min, median, max) over rounds; and p99 over the raw driver's p99.
    ratio: tuple[float, float, float] | None = None
    p99_ratio: float | None = None
    round_grants_per_s: list[float] = dataclasses.field(default_factory=list)


# -- the plan --------------------------------------------------------------


def make_specs(
    bench: Bench,
    *,
    redis_url: str,
    with_redis: bool,
    processes: tuple[int, ...],
    threads: tuple[int, ...],
    tasks: tuple[tuple[int, int], ...],
    rounds: int,
    seconds: float,
    keys: int,
    connections: int,
    timeout: float,
    rng: random.Random,
) -> list[ManySpec]:
    """The worker sets for one database: threads for each P, asyncio for
    each P of ``tasks``; in each, every (T, mode) x round x shuffled contenders."""
    contenders = ["dblock", "raw"]
    if bench.database in ("postgresql", "mariadb"):
        contenders.append("sadlock")
    if with_redis:
        contenders.append("redis")
    shapes: list[tuple[str, int, tuple[int, ...]]] = [("threads", p, threads) for p in processes]
    by_p: dict[int, list[int]] = {}
    for p, n in tasks:
        by_p.setdefault(p, []).append(n)
    shapes += [("asyncio", p, tuple(ns)) for p, ns in by_p.items()]
    specs = []
    for face, p, ts in shapes:
        groups = tuple(Group(t, blocking) for t in ts for blocking in (False, True))
        windows = []
        for g in range(len(groups)):
            for r in range(rounds):
                order = list(contenders)
                rng.shuffle(order)
                windows += [Window(g, r, c) for c in order]
        specs.append(
            ManySpec(
                database=bench.database,
                url=bench.url,
                table=bench.table,
                redis_url=redis_url,
                face=face,
                processes=p,
                groups=groups,
                windows=tuple(windows),
                seconds=seconds,
                keys=keys,
                connections=connections,
                timeout=timeout,
                run=uuid.uuid4().hex[:6],
            )
        )
    return specs


def run_many(spec: ManySpec, tick: Callable[[], None]) -> list[dict[str, Any]]:
    """Run ``spec``'s windows in its worker processes; every window's
    outcome in every process (a list of dicts, one per window and process)."""
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(spec.processes + 1)
    results = ctx.Queue()
    target = _thread_worker if spec.face == "threads" else _async_worker
    workers = [
        ctx.Process(target=target, args=(spec, barrier, results), daemon=True)
        for _ in range(spec.processes)
    ]
    for w in workers:
        w.start()
    try:
        barrier.wait(_BARRIER_SECONDS)  # every process set up
        for _ in spec.windows:
            barrier.wait(_BARRIER_SECONDS)  # the contender's connections open, warm
            barrier.wait(_BARRIER_SECONDS + spec.seconds)  # measured, and closed
            tick()
        parts: list[dict[str, Any]] = []
        for _ in workers:
            parts += results.get(timeout=_BARRIER_SECONDS)
        return parts
    finally:
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()


# -- one body for both faces --------------------------------------------------
#
# A worker process, a window and the raw driver's cycle are each written once,
# as a generator of steps: it yields what is to be done (an operation below,
# a statement, a pause) and is sent the outcome (or has the failure thrown
# in). The threads face drives the steps with blocking calls (:func:`_drive`,
# :class:`_Threads`), the asyncio face awaits them (:func:`_adrive`,
# :class:`_Tasks`); only the doing differs.


@dataclasses.dataclass
class _Tally:
    latencies: list[float] = dataclasses.field(default_factory=list)
    refused: int = 0
    timeouts: int = 0
    errors: int = 0
    error: str = ""

    def failed(self, exc: Exception) -> bool:
        """Count a cycle that raised ``exc``; true when it was an error
        (the loop pauses a little before the next cycle)."""
        if isinstance(exc, _REFUSED):
            self.refused += 1
            return False
        if isinstance(exc, _TIMED_OUT):
            self.timeouts += 1
            return False
        self.errors += 1
        self.error = self.error or _reason(exc)
        return True


@dataclasses.dataclass
class _Window:
    """What every thread (task) of one process's window shares."""

    prefix: str  # of this contender's keys
    keys: int
    deadline: float = 0.0

    def key(self, randrange: Callable[[int], int]) -> str:
        return self.prefix + str(randrange(self.keys))

    def warm_key(self) -> str:
        return f"{self.prefix}warm:{uuid.uuid4().hex}"


@dataclasses.dataclass
class _Wait:
    """Wait at the barrier shared with the parent and the other workers."""

    seconds: float


@dataclasses.dataclass
class _Open:
    """Open (and connect) a contender; the answer is the contender."""

    contender: str
    group: Group


@dataclasses.dataclass
class _Warm:
    """One cycle per thread (task) to warm its connection, each ready to
    run its loop with its own seed once measuring starts."""

    contender: Any  # _SyncContender or _AsyncContender, None if it failed to open
    tallies: list[_Tally]
    win: _Window
    seeds: list[float]


@dataclasses.dataclass
class _Measure:
    """Run every thread's (task's) loop until the window's deadline."""


@dataclasses.dataclass
class _Close:
    contender: Any


_Op = _Wait | _Open | _Warm | _Measure | _Close


def _worker_steps(spec: ManySpec, counter: Any) -> Generator[_Op, Any, list[dict[str, Any]]]:
    """A worker process: set up, then every window, in step with the others."""
    rng = random.Random()
    out: list[dict[str, Any]] = []
    yield _Wait(_BARRIER_SECONDS)  # every process set up
    for w in spec.windows:
        out.append((yield from _window_steps(spec, w, counter, rng)))
        yield _Wait(_BARRIER_SECONDS + spec.seconds)  # measured, and closed
    return out


def _window_steps(
    spec: ManySpec, w: Window, counter: Any, rng: random.Random
) -> Generator[_Op, Any, dict[str, Any]]:
    """One window in this process: open, warm, (barrier), measure, close."""
    group = spec.groups[w.group]
    tallies = [_Tally() for _ in range(group.threads)]
    win = _Window(f"bench:many:{spec.run}:{w.contender}:", spec.keys)
    contender, error = None, ""
    try:
        contender = yield _Open(w.contender, group)
    except Exception as exc:
        error = _reason(exc)
    yield _Warm(contender, tallies, win, [rng.random() for _ in tallies])
    yield _Wait(_BARRIER_SECONDS)  # every process's contender open, warm
    counter.reset()
    cpu0, began = time.process_time(), _monotonic()
    win.deadline = began + spec.seconds
    yield _Measure()
    elapsed, cpu = _monotonic() - began, time.process_time() - cpu0
    statements, commits = counter.read()
    if contender is not None:
        try:
            yield _Close(contender)
        except Exception as exc:
            error = error or _reason(exc)
    return {
        "group": w.group,
        "round": w.round,
        "contender": w.contender,
        "name": contender.name if contender is not None else w.contender,
        "latencies": [x for t in tallies for x in t.latencies],
        "refused": sum(t.refused for t in tallies),
        "timeouts": sum(t.timeouts for t in tallies),
        "errors": sum(t.errors for t in tallies),
        "error": error or next((t.error for t in tallies if t.error), ""),
        "elapsed": elapsed,
        "cpu": cpu,
        "statements": statements,
        "commits": commits,
    }


#: A statement of the raw driver's cycle: (SQL, parameters, fetch the rows);
#: answered with (rows, row count). A float is a pause, in seconds.
_Statement = tuple[str, dict[str, Any], bool]


def _raw_steps(
    d: _Driver, owner: str, blocking: bool, timeout: float, key: str
) -> Generator[_Statement | float, Any, float]:
    """The raw driver's lock+unlock of ``key``: dblock's acquire statement,
    then its release; a refused waiting request tries again after a capped,
    doubling pause. Returns the acquire latency; raises a refusal or a timeout."""
    t0 = _perf()
    token = _urandom(16).hex()
    params = {"key": key, "owner": owner, "token": token, **d.acquire_params}
    pause = 0.001
    while True:
        rows, rowcount = yield d.acquire, params, True
        if d.granted(rows, rowcount, token):
            break
        if not blocking:
            raise _Refused(key)
        left = t0 + timeout - _perf()
        if left <= 0:
            raise _TimedOut(key)
        yield min(pause, left)
        pause = min(pause * 2, 0.05)
    t1 = _perf()
    yield d.release, {"key": key, "token": token, **d.release_params}, d.release_returns
    return t1 - t0


_T = TypeVar("_T")


def _drive(steps: Generator[Any, Any, _T], do: Callable[[Any], Any]) -> _T:
    """Run ``steps`` to its end: each step done by ``do``, its answer sent
    back, its failure thrown in."""
    answer: Any = None
    failure: Exception | None = None
    while True:
        try:
            step = steps.send(answer) if failure is None else steps.throw(failure)
        except StopIteration as done:
            result: _T = done.value
            return result
        answer, failure = None, None
        try:
            answer = do(step)
        except Exception as exc:
            failure = exc


async def _adrive(steps: Generator[Any, Any, _T], do: Callable[[Any], Awaitable[Any]]) -> _T:
    """:func:`_drive`, each step awaited."""
    answer: Any = None
    failure: Exception | None = None
    while True:
        try:
            step = steps.send(answer) if failure is None else steps.throw(failure)
        except StopIteration as done:
            result: _T = done.value
            return result
        answer, failure = None, None
        try:
            answer = await do(step)
        except Exception as exc:
            failure = exc


def _raw_cycle(
    d: _Driver, owner: str, group: Group, timeout: float, statement: Callable[..., Any]
) -> Callable[[str], float]:
    """:func:`_raw_steps` on blocking connections (``statement(sql, params, fetch)``)."""
    blocking = group.blocking

    def do(step: _Statement | float) -> Any:
        if isinstance(step, float):
            return time.sleep(step)
        return statement(*step)

    def cycle(key: str) -> float:
        return _drive(_raw_steps(d, owner, blocking, timeout, key), do)

    return cycle


def _raw_acycle(
    d: _Driver, owner: str, group: Group, timeout: float, statement: Callable[..., Awaitable[Any]]
) -> Callable[[str], Awaitable[float]]:
    """:func:`_raw_steps` on asyncio connections."""
    blocking = group.blocking

    async def do(step: _Statement | float) -> Any:
        if isinstance(step, float):
            return await asyncio.sleep(step)
        return await statement(*step)

    async def cycle(key: str) -> float:
        return await _adrive(_raw_steps(d, owner, blocking, timeout, key), do)

    return cycle


# -- the contenders, blocking ------------------------------------------------


class _SyncContender:
    """What a window needs of a contender: a cycle per thread, and a close."""

    name = ""

    def cycle_for(self, i: int) -> Callable[[str], float]:
        """Thread ``i``'s lock+unlock of a key: returns the acquire latency,
        raises a refusal or a timeout."""
        raise NotImplementedError

    def close(self) -> None:
        pass


def _budget(spec: ManySpec, threads: int, reserved: int = 0) -> int:
    """Connections this contender may pool in each process."""
    return max(1, min(threads, spec.per_process - reserved))


class _DblockSync(_SyncContender):
    name = "dblock"

    def __init__(self, spec: ManySpec, group: Group) -> None:
        from dblock import LockManager

        # PostgreSQL: one more connection for LISTEN (waiters).
        size = _budget(spec, group.threads, 1 if spec.database == "postgresql" else 0)
        self.manager = LockManager(
            spec.url,
            table=spec.table,
            engine_options={"pool_size": size, "max_overflow": 0},
        )
        lock, timeout = self.manager.lock, spec.timeout

        if group.blocking:

            def cycle(key: str) -> float:
                t0 = _perf()
                with lock(key, timeout=timeout):
                    t1 = _perf()
                return t1 - t0

        else:

            def cycle(key: str) -> float:
                t0 = _perf()
                with lock(key, blocking=False):
                    t1 = _perf()
                return t1 - t0

        self._cycle = cycle

    def cycle_for(self, i: int) -> Callable[[str], float]:
        return self._cycle

    def close(self) -> None:
        self.manager.close()


_raw_cache: dict[tuple[str, str, str], _Driver] = {}


def _raw_sql(spec: ManySpec) -> _Driver:
    """dblock's statements for this database (from its store, read once per
    process), on the raw driver."""
    key = (spec.database, spec.url, spec.table)
    if key not in _raw_cache:
        _raw_cache[key] = _read_raw_sql(spec)
    return _raw_cache[key]


def _read_raw_sql(spec: ManySpec) -> _Driver:
    from dblock import LockManager

    manager = LockManager(spec.url, table=spec.table)
    try:
        bench = Bench.__new__(Bench)  # only .database and .url are read by the driver makers
        bench.database, bench.url = spec.database, spec.url
        return raw_driver(bench, manager)
    finally:
        manager.close()


def _run_cursor(conn: Any, sql: str, params: Any, fetch: bool) -> tuple[Any, int]:
    with conn.cursor() as cursor:
        cursor.execute(sql, params)
        return (cursor.fetchall() if fetch else ()), cursor.rowcount


def _run_connection(conn: Any, sql: str, params: Any, fetch: bool) -> tuple[Any, int]:
    cursor = conn.execute(sql, params)
    return (cursor.fetchall() if fetch else ()), cursor.rowcount


class _FairPool:
    """The raw driver's connections when there are more threads than them:
    one coming back goes straight to the longest-waiting thread. (A
    ``queue.Queue`` lets the thread that puts one back take it again before
    the waiter it woke runs, and that waiter queues again at the back: some
    threads starved for a whole window.)"""

    def __init__(self, conns: list[Any]) -> None:
        self._idle = collections.deque(conns)
        self._waiters: collections.deque[tuple[Any, list[Any]]] = collections.deque()
        self._lock = threading.Lock()

    def get(self) -> Any:
        with self._lock:
            if self._idle:  # then nobody waits
                return self._idle.pop()
            signal = threading.Lock()
            box: list[Any] = []
            signal.acquire()
            self._waiters.append((signal, box))
        signal.acquire()  # released by put(), with the connection in the box
        return box[0]

    def put(self, conn: Any) -> None:
        with self._lock:
            if not self._waiters:
                self._idle.append(conn)
                return
            signal, box = self._waiters.popleft()
        box.append(conn)
        signal.release()


class _AsyncFairPool:
    """:class:`_FairPool` for tasks of one event loop."""

    def __init__(self) -> None:
        self._idle: collections.deque[Any] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[Any]] = collections.deque()

    async def get(self) -> Any:
        if self._idle:  # then nobody waits
            return self._idle.pop()
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        return await waiter

    def put(self, conn: Any) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return
        self._idle.append(conn)


class _RawSync(_SyncContender):
    """The driver alone (:func:`_raw_steps`), one connection per thread or
    a fair share of them."""

    def __init__(self, spec: ManySpec, group: Group) -> None:
        driver = _raw_sql(spec)
        self.name = f"raw {driver.name}, same SQL"
        n = _budget(spec, group.threads)
        self.conns = [driver.connect() for _ in range(n)]
        self.shared = n < group.threads
        self.pool = _FairPool(self.conns)
        self.run = _run_cursor if spec.database in ("mariadb", "galera") else _run_connection
        self.driver, self.group, self.spec = driver, group, spec
        self.owner = _owner()

    def cycle_for(self, i: int) -> Callable[[str], float]:
        run = self.run
        statement: Callable[[str, Any, bool], tuple[Any, int]]
        if self.shared:
            get, put = self.pool.get, self.pool.put

            def statement(sql: str, params: Any, fetch: bool) -> tuple[Any, int]:
                conn = get()
                try:
                    return run(conn, sql, params, fetch)
                finally:
                    put(conn)

        else:
            mine = self.conns[i]

            def statement(sql: str, params: Any, fetch: bool) -> tuple[Any, int]:
                return run(mine, sql, params, fetch)

        return _raw_cycle(self.driver, self.owner, self.group, self.spec.timeout, statement)

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.close()


def _sadlock_kind(database: str) -> str:
    return "advisory lock" if database == "postgresql" else "GET_LOCK"


class _SadlockSync(_SyncContender):
    """sqlalchemy-dlock: a pooled connection per cycle (its lock lives in the
    connection's session, so the connection is held from acquire to release)."""

    def __init__(self, spec: ManySpec, group: Group) -> None:
        from sqlalchemy_dlock.factory import create_sadlock

        self.name = f"sqlalchemy-dlock ({_sadlock_kind(spec.database)})"
        n = _budget(spec, group.threads)
        self.engine = engine = sa.create_engine(
            spec.url, isolation_level="AUTOCOMMIT", pool_size=n, max_overflow=0
        )
        blocking, timeout = group.blocking, spec.timeout
        # PostgreSQL waits in the server (pg_advisory_lock: sqlalchemy-dlock
        # simulates a timeout by polling once a second); MySQL's GET_LOCK
        # takes the timeout itself.
        wait: dict[str, Any] = {"block": False}
        if blocking:
            wait = {"block": True} if spec.database == "postgresql" else {"timeout": timeout}

        def cycle(key: str) -> float:
            t0 = _perf()
            with engine.connect() as conn:
                lock: Any = create_sadlock(conn, key)
                if not lock.acquire(**wait):
                    raise _TimedOut(key) if blocking else _Refused(key)
                t1 = _perf()
                lock.release()
            return t1 - t0

        self._cycle = cycle

    def cycle_for(self, i: int) -> Callable[[str], float]:
        return self._cycle

    def close(self) -> None:
        self.engine.dispose()


class _RedisSync(_SyncContender):
    name = "redis-py Lock"

    def __init__(self, spec: ManySpec, group: Group) -> None:
        import redis

        pool = redis.BlockingConnectionPool.from_url(
            spec.redis_url, max_connections=_budget(spec, group.threads), timeout=None
        )
        self.client = client = redis.Redis(connection_pool=pool)
        client.ping()
        blocking, timeout = group.blocking, spec.timeout

        def cycle(key: str) -> float:
            t0 = _perf()
            lock = client.lock(key, timeout=TTL, sleep=0.001)
            if not lock.acquire(blocking=blocking, blocking_timeout=timeout if blocking else None):
                raise _TimedOut(key) if blocking else _Refused(key)
            t1 = _perf()
            lock.release()
            return t1 - t0

        self._cycle = cycle

    def cycle_for(self, i: int) -> Callable[[str], float]:
        return self._cycle

    def close(self) -> None:
        self.client.close()
        self.client.connection_pool.disconnect()


_SYNC: dict[str, Callable[[ManySpec, Group], _SyncContender]] = {
    "dblock": _DblockSync,
    "raw": _RawSync,
    "sadlock": _SadlockSync,
    "redis": _RedisSync,
}


def _loop(cycle: Callable[[str], float], tally: _Tally, win: _Window, rng: random.Random) -> None:
    latencies, randrange, key = tally.latencies, rng.randrange, win.key
    deadline = win.deadline
    while _monotonic() < deadline:
        try:
            latencies.append(cycle(key(randrange)))
        except Exception as exc:
            if tally.failed(exc):
                time.sleep(0.01)


class _Threads:
    """The steps of :func:`_worker_steps`, done with threads: a window's
    threads warm up and wait; measuring lets them go and joins them."""

    def __init__(self, spec: ManySpec, barrier: Any) -> None:
        self.spec, self.barrier = spec, barrier
        self.go = threading.Event()
        self.threads: list[threading.Thread] = []

    def do(self, op: _Op) -> Any:
        if isinstance(op, _Wait):
            return self.barrier.wait(op.seconds)
        if isinstance(op, _Open):
            return _SYNC[op.contender](self.spec, op.group)
        if isinstance(op, _Warm):
            return self._warm(op)
        if isinstance(op, _Measure):
            self.go.set()
            for t in self.threads:
                t.join()
            return None
        return op.contender.close()

    def _warm(self, op: _Warm) -> None:
        self.go = go = threading.Event()
        self.threads = []
        if op.contender is None:
            return
        ready = threading.Barrier(len(op.tallies) + 1)
        win = op.win

        def body(tally: _Tally, cycle: Callable[[str], float], seed: float) -> None:
            try:  # warm: this thread's connection (or the pool's next one)
                cycle(win.warm_key())
            except Exception as exc:  # shown; the window counts its own errors
                tally.error = f"warm-up: {_reason(exc)}"
            ready.wait()
            go.wait()
            _loop(cycle, tally, win, random.Random(seed))

        self.threads = [
            threading.Thread(
                target=body,
                args=(t, op.contender.cycle_for(i), seed),
                name=f"many-{i}",
                daemon=True,
            )
            for i, (t, seed) in enumerate(zip(op.tallies, op.seeds, strict=True))
        ]
        for t in self.threads:
            t.start()
        ready.wait()


def _thread_worker(spec: ManySpec, barrier: Any, results: Any) -> None:
    from .dbapi import install

    counter = install()
    results.put(_drive(_worker_steps(spec, counter), _Threads(spec, barrier).do))


# -- the contenders, asyncio -------------------------------------------------


class _AsyncContender:
    name = ""

    def cycle_for(self, i: int) -> Callable[[str], Awaitable[float]]:
        raise NotImplementedError

    async def close(self) -> None:
        pass


class _DblockAsync(_AsyncContender):
    name = "dblock asyncio"

    def __init__(self, spec: ManySpec, group: Group) -> None:
        from dblock import AsyncLockManager

        # Reserved: the blocking engine's connection (renewal), and LISTEN on PostgreSQL.
        size = _budget(spec, group.threads, 2 if spec.database == "postgresql" else 1)
        self.manager = AsyncLockManager(
            spec.url,
            table=spec.table,
            engine_options={"pool_size": 1, "max_overflow": 0},
            async_engine_options={"pool_size": size, "max_overflow": 0},
        )
        lock, timeout = self.manager.lock, spec.timeout

        if group.blocking:

            async def cycle(key: str) -> float:
                t0 = _perf()
                async with lock(key, timeout=timeout):
                    t1 = _perf()
                return t1 - t0

        else:

            async def cycle(key: str) -> float:
                t0 = _perf()
                async with lock(key, blocking=False):
                    t1 = _perf()
                return t1 - t0

        self._cycle = cycle

    def cycle_for(self, i: int) -> Callable[[str], Awaitable[float]]:
        return self._cycle

    async def close(self) -> None:
        await self.manager.close()


class _RawAsync(_AsyncContender):
    """The asyncio driver alone, as :class:`_RawSync`."""

    def __init__(self, spec: ManySpec, group: Group) -> None:
        from .aio import _ASYNC_DRIVERS

        self.sql = _raw_sql(spec)
        self.driver = _ASYNC_DRIVERS[spec.database](spec.url)
        self.name = f"raw {self.driver.name}, same SQL"
        self.size = _budget(spec, group.threads)
        self.conns: list[Any] = []
        self.shared = self.size < group.threads
        self.pool = _AsyncFairPool()
        self.group, self.spec, self.owner = group, spec, _owner()

    async def connect(self) -> None:
        for _ in range(self.size):
            conn = await self.driver.connect()
            self.conns.append(conn)
            self.pool.put(conn)

    def cycle_for(self, i: int) -> Callable[[str], Awaitable[float]]:
        run = _arun_cursor if self.spec.database in ("mariadb", "galera") else _arun_connection
        pool, shared = self.pool, self.shared
        mine = None if shared else self.conns[i]

        async def statement(sql: str, params: Any, fetch: bool) -> tuple[Any, int]:
            if not shared:
                return await run(mine, sql, params, fetch)
            conn = await pool.get()
            try:
                return await run(conn, sql, params, fetch)
            finally:
                pool.put(conn)

        return _raw_acycle(self.sql, self.owner, self.group, self.spec.timeout, statement)

    async def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                await self.driver.close(conn)


async def _arun_cursor(conn: Any, sql: str, params: Any, fetch: bool) -> tuple[Any, int]:
    async with conn.cursor() as cursor:
        await cursor.execute(sql, params)
        return (await cursor.fetchall() if fetch else ()), cursor.rowcount


async def _arun_connection(conn: Any, sql: str, params: Any, fetch: bool) -> tuple[Any, int]:
    cursor = await conn.execute(sql, params)
    rows = await cursor.fetchall() if fetch else ()
    rowcount = cursor.rowcount
    close = getattr(cursor, "close", None)
    if close is not None and asyncio.iscoroutinefunction(close):  # aiosqlite's
        await close()
    return rows, rowcount


class _SadlockAsync(_AsyncContender):
    def __init__(self, spec: ManySpec, group: Group) -> None:
        from sqlalchemy.ext.asyncio import create_async_engine
        from sqlalchemy_dlock.factory import create_async_sadlock

        from dblock._hooks import async_url

        self.name = f"sqlalchemy-dlock async ({_sadlock_kind(spec.database)})"
        n = _budget(spec, group.threads)
        self.engine = engine = create_async_engine(
            async_url(spec.url),
            isolation_level="AUTOCOMMIT",
            pool_size=n,
            max_overflow=0,
        )
        blocking, timeout = group.blocking, spec.timeout
        wait: dict[str, Any] = {"block": False}
        if blocking:
            wait = {"block": True} if spec.database == "postgresql" else {"timeout": timeout}

        async def cycle(key: str) -> float:
            t0 = _perf()
            async with engine.connect() as conn:
                lock: Any = create_async_sadlock(conn, key)
                if not await lock.acquire(**wait):
                    raise _TimedOut(key) if blocking else _Refused(key)
                t1 = _perf()
                await lock.release()
            return t1 - t0

        self._cycle = cycle

    def cycle_for(self, i: int) -> Callable[[str], Awaitable[float]]:
        return self._cycle

    async def close(self) -> None:
        await self.engine.dispose()


class _RedisAsync(_AsyncContender):
    name = "redis-py asyncio Lock"

    def __init__(self, spec: ManySpec, group: Group) -> None:
        import redis.asyncio

        pool = redis.asyncio.BlockingConnectionPool.from_url(
            spec.redis_url, max_connections=_budget(spec, group.threads), timeout=None
        )
        self.client = client = redis.asyncio.Redis(connection_pool=pool)
        blocking, timeout = group.blocking, spec.timeout

        async def cycle(key: str) -> float:
            t0 = _perf()
            lock = client.lock(key, timeout=TTL, sleep=0.001)
            if not await lock.acquire(
                blocking=blocking, blocking_timeout=timeout if blocking else None
            ):
                raise _TimedOut(key) if blocking else _Refused(key)
            t1 = _perf()
            await lock.release()
            return t1 - t0

        self._cycle = cycle

    def cycle_for(self, i: int) -> Callable[[str], Awaitable[float]]:
        return self._cycle

    async def close(self) -> None:
        await self.client.aclose()
        await self.client.connection_pool.disconnect()


async def _open_async(name: str, spec: ManySpec, group: Group) -> _AsyncContender:
    if name == "dblock":
        return _DblockAsync(spec, group)
    if name == "raw":
        raw = _RawAsync(spec, group)
        try:
            await raw.connect()
        except BaseException:
            await raw.close()
            raise
        return raw
    if name == "sadlock":
        return _SadlockAsync(spec, group)
    redis = _RedisAsync(spec, group)
    await redis.client.ping()
    return redis


async def _aloop(
    cycle: Callable[[str], Awaitable[float]], tally: _Tally, win: _Window, rng: random.Random
) -> None:
    latencies, randrange, key = tally.latencies, rng.randrange, win.key
    deadline = win.deadline
    while _monotonic() < deadline:
        try:
            latencies.append(await cycle(key(randrange)))
        except Exception as exc:
            if tally.failed(exc):
                await asyncio.sleep(0.01)


async def _warm(cycle: Callable[[str], Awaitable[float]], tally: _Tally, win: _Window) -> None:
    try:
        await cycle(win.warm_key())
    except Exception as exc:  # shown; the window counts its own errors
        tally.error = f"warm-up: {_reason(exc)}"


class _Tasks:
    """The steps of :func:`_worker_steps`, done with tasks of this process's
    event loop (the barrier waited for in a thread)."""

    def __init__(self, spec: ManySpec, barrier: Any) -> None:
        self.spec, self.barrier = spec, barrier
        self.loops: list[tuple[Callable[[str], Awaitable[float]], _Tally, float]] = []
        self.win: _Window | None = None

    async def do(self, op: _Op) -> Any:
        if isinstance(op, _Wait):
            return await asyncio.to_thread(self.barrier.wait, op.seconds)
        if isinstance(op, _Open):
            return await _open_async(op.contender, self.spec, op.group)
        if isinstance(op, _Warm):
            return await self._warm(op)
        if isinstance(op, _Measure):
            loops, win, self.loops = self.loops, self.win, []
            if win is None:
                return None
            return await asyncio.gather(
                *(_aloop(c, t, win, random.Random(seed)) for c, t, seed in loops)
            )
        return await op.contender.close()

    async def _warm(self, op: _Warm) -> None:
        self.loops, self.win = [], op.win
        if op.contender is None:
            return
        cycles = [op.contender.cycle_for(i) for i in range(len(op.tallies))]
        await asyncio.gather(
            *(_warm(c, t, op.win) for c, t in zip(cycles, op.tallies, strict=True))
        )
        self.loops = list(zip(cycles, op.tallies, op.seeds, strict=True))


def _async_worker(spec: ManySpec, barrier: Any, results: Any) -> None:
    from .dbapi import install

    counter = install()
    results.put(asyncio.run(_adrive(_worker_steps(spec, counter), _Tasks(spec, barrier).do)))


# -- summary ---------------------------------------------------------------


def summarise(spec: ManySpec, parts: list[dict[str, Any]]) -> list[ManyResult]:
    """Every (configuration, contender) of ``spec``, over its rounds."""
    rounds = 1 + max((w.round for w in spec.windows), default=0)
    out: list[ManyResult] = []
    for g, group in enumerate(spec.groups):
        per_round: dict[str, dict[int, float]] = {}
        made: dict[str, ManyResult] = {}
        present = {w.contender for w in spec.windows if w.group == g}
        for contender in (c for c in CONTENDERS if c in present):
            mine = [p for p in parts if p["group"] == g and p["contender"] == contender]
            by_round: dict[int, list[dict[str, Any]]] = {}
            for p in mine:
                by_round.setdefault(p["round"], []).append(p)
            grants = sum(len(p["latencies"]) for p in mine)
            # The processes of one window ran together: its length is the longest.
            seconds = sum(max(p["elapsed"] for p in ps) for ps in by_round.values())
            rates = {
                r: sum(len(p["latencies"]) for p in ps) / max(p["elapsed"] for p in ps)
                for r, ps in by_round.items()
            }
            per_round[contender] = rates
            latencies = [x for p in mine for x in p["latencies"]]
            statements = sum(p["statements"] for p in mine)
            commits = sum(p["commits"] for p in mine)
            counted = contender != "redis"
            made[contender] = ManyResult(
                database="redis" if contender == "redis" else spec.database,
                face=spec.face,
                processes=spec.processes,
                threads=group.threads,
                mode=group.mode,
                contender=contender,
                name=mine[0]["name"] if mine else contender,
                connections=_connections(spec, contender, group),
                rounds=rounds,
                seconds=seconds,
                grants=grants,
                grants_per_s=grants / seconds if seconds else 0.0,
                p50_ms=percentile(latencies, 50) * 1e3,
                p99_ms=percentile(latencies, 99) * 1e3,
                statements_per_grant=statements / grants if counted and grants else None,
                commits_per_grant=commits / grants if counted and grants else None,
                cpu_us_per_grant=sum(p["cpu"] for p in mine) / grants * 1e6
                if grants
                else float("nan"),
                refused=sum(p["refused"] for p in mine),
                timeouts=sum(p["timeouts"] for p in mine),
                errors=sum(p["errors"] for p in mine),
                error=next((p["error"] for p in mine if p["error"]), ""),
                round_grants_per_s=[rates[r] for r in sorted(rates)],
            )
        raw = per_round.get("raw", {})
        for contender, result in made.items():
            if contender == "raw" or not raw:
                continue
            paired = [rate / raw[r] for r, rate in per_round[contender].items() if raw.get(r)]
            if paired:
                result.ratio = (min(paired), percentile(paired, 50), max(paired))
            if made["raw"].p99_ms and result.grants:
                result.p99_ratio = result.p99_ms / made["raw"].p99_ms
        out += made.values()
    return out


def _connections(spec: ManySpec, contender: str, group: Group) -> int:
    """Server connections per process the contender could use (see the module docstring)."""
    if contender == "redis":
        return _budget(spec, group.threads)
    reserved = 0
    if contender == "dblock":
        reserved = 1 if spec.database == "postgresql" else 0
        if spec.face == "asyncio":
            reserved += 1
    return _budget(spec, group.threads, reserved) + reserved
