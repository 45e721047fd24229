"""Group commit (dblock._store.batch): requests that meet go out as one statement.

Each test makes a batch on purpose: a lone acquire of a ``gate`` key is held
up by a transaction of the test's own that locks the gate's (expired) row,
the requests under test queue behind it in the batcher, and when the test
commits, the gate's statement returns and the queue goes out as one
multi-row statement. Then every failure mode of a batch is checked per
request: its own answer, fences, a connection cut, an interruption.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import threading
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from dblock import LockBusy, LockManager
from dblock._store.base import Store
from dblock.errors import BackendError
from tests.conftest import row_of
from tests.support.counting import StatementCounter
from tests.support.innodb import innodb_count
from tests.support.interrupts import Interrupt as Interrupted
from tests.support.interrupts import interrupt_at
from tests.support.proxy import Proxy

# (SQLite has one write lock for the whole file: a test cannot hold one
# statement up without holding up all, so the tests that keep a sent batch
# in flight run on the servers only.)
SERVERS = pytest.mark.databases("postgresql", "mariadb")


def is_batch(statement: str) -> bool:
    """A multi-row acquire: PostgreSQL's unnest, MariaDB's INSERT … UNION ALL."""
    return (
        "unnest" in statement
        or ("INSERT IGNORE" in statement and "UNION ALL" in statement)
        or "v.column5" in statement  # SQLite's
    )


def one_at_a_time(manager: LockManager) -> None:
    """One statement per lane in flight, so that a held-up one makes the
    next requests queue (the tests' way of making a batch): however long it
    is held up, it is not taken as stuck."""
    batcher = manager._locker.batcher
    assert batcher is not None
    batcher._acquires.depth = batcher._releases.depth = 1
    batcher._acquires.stall = batcher._releases.stall = float("inf")
    if manager.dialect == "sqlite":
        # An acquire waits for the file's write lock as long as the test
        # holds it, not the 40 ms after which it would answer "held".
        manager.store.acquire_busy = 30.0  # type: ignore[attr-defined]


def wait_until(
    check: Callable[[], object], what: str, timeout: float = 10.0, step: float = 0.002
) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(step)


class Gate:
    """An expired row of ``key`` locked by an open transaction of ours: an
    acquire of ``key`` (a takeover) waits until :meth:`open` (any thread).
    On SQLite the transaction holds the file's write lock (``hold``): every
    write waits."""

    def __init__(self, db_url: str, manager: LockManager, key: str, *, hold: bool = True) -> None:
        table = manager.store.table
        self.engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
        self.dialect = self.engine.dialect.name
        long_ago = datetime.now(timezone.utc) - timedelta(hours=1)
        with self.engine.begin() as conn:
            conn.execute(sa.delete(table).where(table.c.lock_key == key))
            conn.execute(
                table.insert().values(
                    lock_key=key,
                    owner="gate",
                    token="gate",
                    fence=None if self.dialect in ("mysql", "mariadb") else -1,
                    acquired_at=long_ago,
                    expires_at=long_ago,
                )
            )
        self._open = False
        self.conn = self.engine.connect()
        if self.dialect == "sqlite":
            self._open = not hold
            if hold:
                self.conn.exec_driver_sql("BEGIN IMMEDIATE")
            return
        # The whole primary key: InnoDB then locks the row alone, not the gap
        # before it (where another gate's row may go).
        self.conn.execute(
            sa.select(table.c.token)
            .where(table.c.lock_key == key, table.c.slot == "")
            .with_for_update()
        )
        self._open = False

    def blocking(self) -> int:
        """How many statements wait on our row lock."""
        if self.dialect == "sqlite":  # no way to ask: give the statement time to start
            time.sleep(0.3)
            return 1
        if self.dialect == "postgresql":
            # Activity is a snapshot per transaction, and ours stays open.
            self.conn.execute(sa.text("SELECT pg_stat_clear_snapshot()"))
            sql = (
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE pg_backend_pid() = ANY(pg_blocking_pids(pid))"
            )
            return int(self.conn.execute(sa.text(sql)).scalar_one())
        return innodb_count(
            self.conn,
            "SELECT count(*) FROM information_schema.INNODB_LOCK_WAITS w "
            "JOIN information_schema.INNODB_TRX t ON t.trx_id = w.blocking_trx_id "
            "WHERE t.trx_mysql_thread_id = CONNECTION_ID()",
        )

    def open(self) -> None:
        if not self._open:
            self._open = True
            if self.dialect == "sqlite":
                self.conn.exec_driver_sql("ROLLBACK")
            else:
                self.conn.rollback()
        with contextlib.suppress(Exception):
            self.conn.close()
            self.engine.dispose()


@contextlib.contextmanager
def gate_row(db_url: str, manager: LockManager, key: str, *, hold: bool = True) -> Iterator[Gate]:
    gate = Gate(db_url, manager, key, hold=hold)
    try:
        yield gate
    finally:
        gate.open()


class Runner:
    """Runs calls on threads and keeps what each returned or raised. Each
    thread stays alive (its locks held, not collected as its owner's) until
    :meth:`finish`."""

    def __init__(self) -> None:
        self.results: dict[str, Any] = {}
        self.threads: list[threading.Thread] = []
        self._done = threading.Event()

    def start(self, name: str, call: Callable[[], Any]) -> None:
        def run() -> None:
            try:
                self.results[name] = call()
            except BaseException as exc:
                self.results[name] = exc
            # Alive until finish() (60 s at most, for a test that failed
            # before it): a thread that ended would be its locks' dead
            # owner, and dblock releases those itself (5 s was once too
            # short for a test's wait on a loaded machine: finish() then
            # found the lock released by dblock).
            self._done.wait(60)

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        """Until every call has returned or raised."""
        names = [t.name for t in self.threads]
        wait_until(lambda: all(n in self.results for n in names), "the calls", 30)

    def finish(self) -> None:
        for result in self.results.values():
            if hasattr(result, "release") and not result.released:
                result.release(force=True)
        self._done.set()
        for t in self.threads:
            t.join(30)
            assert not t.is_alive()


def batched(
    db_url: str, manager: LockManager, gate: str, calls: dict[str, Callable[[], Any]]
) -> tuple[Runner, StatementCounter]:
    """Run ``calls`` so that they queue behind a lone acquire of ``gate`` and
    go out together; returns their results and the statements sent after the gate."""
    batcher = manager._locker.batcher
    assert batcher is not None
    one_at_a_time(manager)
    lane = batcher._acquires
    runner = Runner()
    counter = StatementCounter(manager.engine)
    with gate_row(db_url, manager, gate) as row:
        runner.start("gate", lambda: manager.acquire(gate, blocking=False))
        wait_until(row.blocking, "the gate's statement waiting", step=0.15)
        for name, call in calls.items():
            runner.start(name, call)
        wait_until(
            lambda: len(lane.queue) + len(batcher._releases.queue) >= len(calls), "the queue"
        )
        counter.__enter__()
    runner.join()
    counter.__exit__(None, None, None)
    return runner, counter


@pytest.fixture
def batching(make_manager: Callable[..., LockManager]) -> LockManager:
    # Every statement through SQLAlchemy, so StatementCounter sees them.
    m = make_manager()
    sa.event.listen(m.engine, "before_cursor_execute", lambda *a: None)
    return m


def test_lone_request_is_one_statement_sent_at_once(batching: LockManager, key: str) -> None:
    with batching.lock(f"{key}:warm", blocking=False):
        pass  # MariaDB reads the server's capabilities on first use
    with StatementCounter(batching.engine) as c, batching.lock(key, blocking=False):
        pass
    assert c.count == 2
    assert not any(is_batch(s) for s in c.statements)  # the single statements


def test_one_batch_answers_each_key_on_its_own(
    db: str, db_url: str, batching: LockManager, make_manager: Callable[..., LockManager], key: str
) -> None:
    """A batch where one key is held by another process, one key's row has
    expired (taken over), and the rest are free: each gets its own answer,
    from one statement."""
    other = make_manager()
    held_elsewhere = other.acquire(f"{key}:held")
    expired = make_manager(renew=False)
    old = expired.acquire(f"{key}:expired", ttl=0.1)
    time.sleep(0.2)
    keys = [f"{key}:held", f"{key}:expired", *(f"{key}:free{i}" for i in range(4))]
    calls = {k: (lambda k=k: batching.acquire(k, blocking=False)) for k in keys}
    runner, counter = batched(db_url, batching, f"{key}:gate", calls)
    assert isinstance(runner.results[f"{key}:held"], LockBusy)
    taken = runner.results[f"{key}:expired"]
    assert taken.fence > old.fence
    for i in range(4):
        got = runner.results[f"{key}:free{i}"]
        assert row_of(batching, got.key).token == got.token  # type: ignore[union-attr]
    # (On MariaDB the gate's own takeover statements come after its wait too.)
    assert sum(map(is_batch, counter.statements)) == 1, counter.statements
    if db == "postgresql":  # one statement answers all; MariaDB goes on alone for the held
        assert counter.count == 1, counter.statements
    runner.finish()
    held_elsewhere.release()


def test_the_same_key_twice_waits_for_the_next_batch(
    db_url: str, make_manager: Callable[..., LockManager], key: str
) -> None:
    """Without level 1 two threads of a process may ask for one key at once:
    never in one statement (the second waits for the next), one of them wins."""
    m = make_manager(local_filter=False)
    sa.event.listen(m.engine, "before_cursor_execute", lambda *a: None)
    calls = {
        "a": lambda: m.acquire(f"{key}:same", blocking=False),
        "b": lambda: m.acquire(f"{key}:same", blocking=False),
        "c": lambda: m.acquire(f"{key}:other", blocking=False),
    }
    runner, counter = batched(db_url, m, f"{key}:gate", calls)
    outcomes = [runner.results["a"], runner.results["b"]]
    assert sum(isinstance(o, LockBusy) for o in outcomes) == 1, outcomes
    # The repeated key goes in a statement of its own, after the batch.
    assert sum(map(is_batch, counter.statements)) == 1, counter.statements
    assert not isinstance(runner.results["c"], BaseException)
    runner.finish()


def test_releases_go_out_together(
    batching: LockManager, make_manager: Callable[..., LockManager], key: str
) -> None:
    """Releases queued behind one in flight go out as one statement; one
    lock lost meanwhile (its row taken by another process) is told so, and
    only it."""
    held = [batching.acquire(f"{key}:{i}") for i in range(5)]
    lost = held[4]
    with batching.engine.begin() as conn:
        t = batching.store.table
        conn.execute(sa.delete(t).where(t.c.lock_key == lost.key))
    thief = make_manager().acquire(lost.key)
    batcher = batching._locker.batcher
    assert batcher is not None
    lane = batcher._releases
    runner = Runner()
    with batcher._mutex:
        lane.in_flight = lane.depth  # as if releases were in flight
    try:
        for h in held:
            runner.start(h.key, lambda h=h: h.release(force=True))
        wait_until(lambda: len(lane.queue) == 5, "the releases queued")
    finally:
        with StatementCounter(batching.engine) as c:
            for _ in range(lane.depth):
                batcher._landed(lane, 0.0)  # the releases in flight returned
            runner.join()
    assert c.count == 1, c.statements
    for h in held[:4]:
        assert runner.results[h.key] is True
        assert row_of(batching, h.key) is None
    assert type(runner.results[lost.key]).__name__ == "LockLost"
    assert row_of(batching, lost.key).token == thief.token  # type: ignore[union-attr]
    assert not lane.busy
    runner.finish()
    thief.release()


def test_fences_grow_per_key_across_concurrent_batches(
    make_manager: Callable[..., LockManager], key: str
) -> None:
    """Two processes (managers), 12 threads each, batching over one set of 6
    keys: every key's fences strictly grow, and no two holders overlap."""
    managers = [make_manager(), make_manager()]
    keys = [f"{key}:{i}" for i in range(6)]
    fences: dict[str, list[int]] = {k: [] for k in keys}
    inside: dict[str, int] = dict.fromkeys(keys, 0)
    overlaps = []
    counters = [StatementCounter(m.engine).__enter__() for m in managers]
    stop = time.monotonic() + 3.0
    errors: list[BaseException] = []

    def hammer(m: LockManager, n: int) -> None:
        i = n
        try:
            while time.monotonic() < stop:
                k = keys[i % len(keys)]
                i += 1
                try:
                    with m.lock(k, blocking=False) as held:
                        inside[k] += 1
                        if inside[k] != 1:
                            overlaps.append(k)
                        fences[k].append(held.fence)
                        time.sleep(0.0002)
                        inside[k] -= 1
                except LockBusy:
                    pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(m, n)) for m in managers for n in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert not overlaps
    for k, seen in fences.items():
        assert seen, k
        assert all(a < b for a, b in itertools.pairwise(seen)), (k, seen)
    batches = sum(is_batch(s) for c in counters for s in c.statements)
    assert batches > 0  # there were batches


@pytest.fixture
def proxied(db_url: str) -> Iterator[tuple[LockManager, Proxy]]:
    url = sa.make_url(db_url)
    p = Proxy(url.host or "127.0.0.1", url.port or (5432 if "postgresql" in db_url else 3306))
    m = LockManager(p.url_for(db_url))
    sa.event.listen(m.engine, "before_cursor_execute", lambda *a: None)
    yield m, p
    m.close()
    p.close()


@SERVERS
@pytest.mark.parametrize("when", ["after", "before"])
def test_connection_cut_mid_batch_settles_each_token(
    db_url: str, proxied: tuple[LockManager, Proxy], key: str, when: str
) -> None:
    """The batch's connection breaks with its statement in flight (committed
    or not): every request settles its own outcome by its token, as a lone
    acquire in doubt does, and none is left as an orphan."""
    m, proxy = proxied
    keys = [f"{key}:{i}" for i in range(4)]
    cut = proxy.cut_after if when == "after" else proxy.cut_before
    fired = cut(keys[-1].encode())
    calls = {k: (lambda k=k: m.acquire(k, blocking=False)) for k in keys}
    runner, _ = batched(db_url, m, f"{key}:gate", calls)
    assert fired.is_set()
    for k in keys:
        held = runner.results[k]
        assert not isinstance(held, BaseException), held
        row = row_of(m, k)
        assert row is not None
        assert (row.token, row.fence) == (held.token, held.fence)
        assert held.release(force=True) is True
    runner.finish()
    assert not m.store.has_orphans


def test_a_release_cut_off_as_its_statement_returns_holds_up_nobody(
    batching: LockManager, key: str
) -> None:
    """A signal handler's exception raised in the thread whose lone
    statement returned, anywhere between its return and a sender thread
    taking the requests queued behind it (``Batcher._landed``,
    ``_dispatch``, the lane's count), once left a batch taken from the queue
    with nobody to send it: its requesters waited for good (a contender of
    the signal storm hung there, in ``_await``). Walked over every point
    where CPython runs a handler in the batcher's code: the releases queued
    behind always end, and the lane has room after (a statement whose end
    went uncounted is stuck after STALL: a ghost, forgotten after GHOST)."""
    batcher = batching._locker.batcher
    assert batcher is not None
    lane = batcher._releases
    n, interrupted = 0, 0
    while True:
        n += 1
        held = [batching.acquire(f"{key}:{n}:{i}") for i in range(2)]
        runner = Runner()
        sent = time.monotonic()
        with batcher._mutex:
            lane.in_flight += 1  # as if a release had gone out alone
            lane.flights[sent] = True
        for h in held:
            runner.start(h.key, lambda h=h: h.release(force=True))
        wait_until(lambda: len(lane.queue) == 2, "the releases queued")
        with interrupt_at(n, "dblock/_store/batch.py") as armed:
            try:
                batcher._landed(lane, sent)  # it returned
            except Interrupted:
                interrupted += 1
        results, keys = runner.results, [h.key for h in held]
        wait_until(
            lambda: all(k in results for k in keys),  # noqa: B023 - waited for here
            f"the releases, interrupted at {armed.where}",
            10,  # far above STALL
        )
        for h in held:
            assert runner.results[h.key] is True, (armed.where, runner.results[h.key])
            assert row_of(batching, h.key) is None, armed.where
        wait_until(
            lambda: not lane.queue and lane.in_flight == len(lane.flights) <= 1,
            f"the lane idle ({armed.where})",
        )
        # (A ghost is "moving" for STALL after it was counted: room then.)
        wait_until(lambda: lane.room(time.monotonic()), f"room ({armed.where})", 5)
        with batcher._mutex:  # (the ghost, if any, forgotten)
            lane.in_flight -= len(lane.flights)
            lane.flights.clear()
        runner.finish()
        if armed.where is None:
            break
    assert interrupted == n - 1 > 3


def test_a_lane_full_of_ghosts_forgets_them() -> None:
    """Statements whose end went uncounted (see above) hold their places
    until GHOST: then a lane they had filled up has room again."""
    from dblock._store.batch import GHOST, MAX_FLIGHTS, Lane

    lane: Lane[tuple[str], bool] = Lane(1)
    for i in range(MAX_FLIGHTS):
        lane.in_flight += 1
        lane.flights[100.0 + i] = True
    assert not lane.room(100.0 + GHOST - 1)
    assert lane.stall_at() == 100.0 + GHOST
    assert lane.room(100.0 + GHOST + 0.5)  # the first forgotten
    assert lane.in_flight == MAX_FLIGHTS - 1


def test_a_batch_that_fails_cleanly_goes_again_one_by_one(
    db: str,
    db_url: str,
    batching: LockManager,
    key: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An error answer (nothing committed) to a batch: each request is sent
    again alone and gets its own answer."""

    def refuse(self: Store, requests: object) -> Any:
        raise BackendError("statement failed: simulated")
        yield  # a generator, as the real one

    monkeypatch.setattr(type(batching.store), "acquire_many_steps", refuse)
    keys = [f"{key}:{i}" for i in range(3)]
    calls = {k: (lambda k=k: batching.acquire(k, blocking=False)) for k in keys}
    runner, counter = batched(db_url, batching, f"{key}:gate", calls)
    for k in keys:
        assert runner.results[k].key == k
    runner.finish()
    # One each (the batch never reached the engine); MariaDB's gate adds its takeover.
    assert not any(map(is_batch, counter.statements)), counter.statements
    assert counter.count == 3 if db == "postgresql" else counter.count >= 3, counter.statements


class Interrupt(Exception):
    pass


def test_an_interrupted_queued_request_is_as_if_never_made(
    db: str, db_url: str, batching: LockManager, key: str
) -> None:
    """A signal handler's exception in a thread waiting for its batch, still
    queued: its request is withdrawn (nothing sent); the others go on."""
    _interrupted(db, db_url, batching, key, sent=False)


# SQLite: a sent batch cannot be held up alone (one write lock per file).
@pytest.mark.databases("postgresql", "mariadb")
def test_an_interrupted_sent_request_is_as_if_never_made(
    db: str, db_url: str, batching: LockManager, key: str
) -> None:
    """Once its batch was sent, its row is deleted as an orphan as soon as
    the batch commits; the other requests of the batch are granted."""
    _interrupted(db, db_url, batching, key, sent=True)


def _interrupted(db: str, db_url: str, batching: LockManager, key: str, *, sent: bool) -> None:
    """A signal handler's exception in a thread waiting for its batch: its
    request is withdrawn (still queued: nothing sent) or, once its batch was
    sent, its row is deleted as an orphan as soon as the batch commits; the
    other requests of the batch go on and are granted."""
    batcher = batching._locker.batcher
    assert batcher is not None
    one_at_a_time(batching)
    lane = batcher._acquires
    mine = f"{key}:mine"
    others = [f"{key}:block", *(f"{key}:{i}" for i in range(3))]
    runner = Runner()

    def on_alarm(signum: int, frame: object) -> None:
        raise Interrupt

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        with (
            # (On SQLite the block holds nothing: the gate holds every write.)
            gate_row(db_url, batching, f"{key}:block", hold=db != "sqlite") as block,
            gate_row(db_url, batching, f"{key}:gate") as gate,
        ):
            runner.start("gate", lambda: batching.acquire(f"{key}:gate", blocking=False))
            wait_until(lambda: lane.busy, "the gate's statement in flight")
            for k in others:
                runner.start(k, lambda k=k: batching.acquire(k, blocking=False))
                wait_until(lambda k=k: any(r.key == k for r in lane.queue), "queued")
            if sent:
                # The gate's statement returns while we wait: our batch (the
                # others and us) is sent and waits on the block's row lock.
                threading.Timer(0.1, gate.open).start()
            signal.setitimer(signal.ITIMER_REAL, 0.4)
            with pytest.raises(Interrupt):
                batching.acquire(mine, blocking=False)
            assert batching.store.has_orphans is sent
            gate.open()
            block.open()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    runner.join()
    for k in others:
        assert runner.results[k].key == k
    runner.finish()
    assert batching._locker.registry.get(mine) is None  # level 1 as if never asked
    wait_until(lambda: not batching.store.has_orphans, "the orphans cleaned")
    assert row_of(batching, mine) is None
    assert not lane.busy


def test_many_threads_need_few_connections(batching: LockManager, keys: Any) -> None:
    """32 threads locking keys of their own: with group commit the lock's
    statements never need more connections at once than its two lanes have
    room for (two each), plus the renewal thread's."""
    batcher = batching._locker.batcher
    assert batcher is not None
    room = batcher._acquires.depth + batcher._releases.depth + 1
    names = keys(32)
    errors: list[BaseException] = []

    def cycle(k: str) -> None:
        try:
            for _ in range(20):
                with batching.lock(k, blocking=False):
                    pass
        except BaseException as exc:
            errors.append(exc)

    with StatementCounter(batching.engine) as c:
        threads = [threading.Thread(target=cycle, args=(k,)) for k in names]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors
    assert c.max_in_flight <= room, c.max_in_flight
    assert c.count < 32 * 20 * 2  # some requests went out together


@SERVERS
def test_async_tasks_batch_and_a_cancelled_request_is_as_if_never_made(
    db_url: str, make_manager: Callable[..., LockManager], key: str
) -> None:
    """The asyncio face: tasks queued behind a statement in flight go out as
    one batch (each key its own answer); a task cancelled while queued was
    never sent, one cancelled once its batch was sent leaves no row (deleted
    as an orphan once the batch returns), and the batch goes on for the others."""
    from dblock import AsyncLockManager

    m = make_manager()
    am = AsyncLockManager(m)
    other = make_manager()
    held_elsewhere = other.acquire(f"{key}:held")
    free = [f"{key}:free{i}" for i in range(3)]

    async def main() -> dict[str, Any]:
        assert am._abatcher is not None
        lane = am._abatcher._lanes_here()[0]
        lane.depth = 1
        lane.stall = float("inf")
        results: dict[str, Any] = {}

        async def take(k: str) -> None:
            try:
                results[k] = await am.acquire(k, blocking=False)
            except BaseException as exc:
                results[k] = exc
                if isinstance(exc, asyncio.CancelledError):
                    raise

        async def until(check: Callable[[], object], what: str, step: float = 0.005) -> None:
            deadline = time.monotonic() + 10
            while not check():
                assert time.monotonic() < deadline, what
                await asyncio.sleep(step)

        gate = Gate(db_url, m, f"{key}:gate")
        block = Gate(db_url, m, f"{key}:block")
        try:
            tasks = {f"{key}:gate": asyncio.create_task(take(f"{key}:gate"))}
            await until(gate.blocking, "the gate's statement waiting", 0.15)
            for k in [f"{key}:block", f"{key}:held", *free, f"{key}:queued", f"{key}:sent"]:
                tasks[k] = asyncio.create_task(take(k))
                await until(lambda k=k: any(r.key == k for r in lane.queue), "queued")
            tasks[f"{key}:queued"].cancel()
            await asyncio.sleep(0.01)
            assert not any(r.key == f"{key}:queued" for r in lane.queue)
            gate.open()  # the gate's statement returns; the batch goes out and waits
            await until(block.blocking, "the batch waiting on the block", 0.15)
            tasks[f"{key}:sent"].cancel()
            await asyncio.sleep(0.01)
        finally:
            gate.open()
            block.open()
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await am.close()  # its async connections, before the loop ends
        return results  # (their tasks ended: dblock releases what they hold)

    results = asyncio.run(main())
    assert isinstance(results[f"{key}:held"], LockBusy)
    for k in [f"{key}:block", *free]:
        assert results[k].key == k
    assert isinstance(results[f"{key}:queued"], asyncio.CancelledError)
    assert isinstance(results[f"{key}:sent"], asyncio.CancelledError)
    assert row_of(m, f"{key}:queued") is None
    wait_until(lambda: not m.store.has_orphans, "the orphans cleaned")
    assert row_of(m, f"{key}:sent") is None
    held_elsewhere.release()


@pytest.mark.databases("postgresql")
def test_batch_statements_keep_one_generic_plan(batching: LockManager, key: str) -> None:
    """A batch's statements are planned once per connection, not at every
    run: with its arrays in plain sight PostgreSQL preferred a fresh custom
    plan at every run (it counts an array parameter's rows exactly), which
    cost as much as the round trip. Checked on the executor's own connection
    (one thread: the same pooled connection every time)."""
    store = batching.store
    for i in range(12):
        keys = [(f"{key}:{i}:{j}", f"t{i}.{j}", "me", 30.0) for j in range(3)]
        store.drive(store.acquire_many_steps(keys))
        store.renew([(k, t, ttl) for k, t, _, ttl in keys])
        store.drive(store.release_many_steps([(k, t) for k, t, _, _ in keys]))
    rows = store.executor.run(
        "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements "
        "WHERE statement LIKE '%%unnest%%'",
        {},
        True,
    ).rows
    assert len(rows) >= 3, rows  # acquire, renew, release
    for statement, generic, custom in rows:
        assert generic > 0, (statement, generic, custom)
        assert custom <= 5, (statement, generic, custom)
