"""dblock's pool: however small, lock statements queue for its connections
and never starve on them (the sizing rule: docs/operations.md, "Connections
per process"). And a pool that is used up (issue 9, item 11), say a borrowed
engine the application holds every connection of: acquire says so with a
``BackendError`` naming the pool, within the request's own timeout, without
the "may have committed" warning (nothing was sent); release logs and
returns False, like any other unreachable database."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Iterator
from types import FrameType

import pytest
import sqlalchemy as sa

from dblock import BackendError, LockManager
from tests.conftest import row_of

POOL_TIMEOUT = 30.0


@pytest.fixture
def small_engine(db_url: str) -> Iterator[sa.Engine]:
    engine = sa.create_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=POOL_TIMEOUT)
    yield engine
    engine.dispose()


@pytest.mark.parametrize("pool_size", [1, 2])
def test_threads_share_a_pool_without_overflow(db_url: str, keys: object, pool_size: int) -> None:
    """More threads than connections, each taking and releasing keys of its
    own: every statement gets a connection, none waits out the pool's
    timeout (a connection kept idle by one thread while another waits for
    the pool would make it)."""
    threads, rounds = 4, 25
    names = keys(threads)  # type: ignore[operator]
    errors: list[BaseException] = []
    start = threading.Barrier(threads)
    options = {"pool_size": pool_size, "max_overflow": 0, "pool_timeout": 3}
    with LockManager(db_url, engine_options=options) as manager:

        def work(key: str) -> None:
            try:
                start.wait(10)
                for _ in range(rounds):
                    with manager.lock(key, timeout=10):
                        pass
            except BaseException as exc:  # reported below
                errors.append(exc)

        pool = [threading.Thread(target=work, args=(k,)) for k in names]
        for t in pool:
            t.start()
        for t in pool:
            t.join(120)
        assert manager.engine.pool.checkedout() <= pool_size  # type: ignore[attr-defined]
    assert errors == []


def test_a_pool_sized_to_the_threads_keeps_its_connections(db_url: str, key: str) -> None:
    """A pool without overflow (``max_overflow=0``, the size the threads
    need) is all checked out the moment dblock keeps its connection: it
    used to hand it back to the pool and check it out again for every
    statement (a third more client CPU per lock). Now it is kept, and
    whoever waits for the pool gets it (the next tests)."""
    options = {"pool_size": 1, "max_overflow": 0, "pool_timeout": 3}
    # notify=False: on MariaDB a hold past 5 ms (a loaded machine) starts the
    # waker, which takes a connection of its own out of the pool (once); this
    # counts the executor's own check-outs.
    with LockManager(db_url, engine_options=options, notify=False) as manager:
        checkouts: list[object] = []
        sa.event.listen(manager.engine.pool, "checkout", lambda *_: checkouts.append(1))
        for _ in range(50):
            with manager.lock(key, blocking=False):
                pass
        assert len(checkouts) <= 2


def test_the_engine_is_served_beside_the_kept_connections(db_url: str, keys: object) -> None:
    """Someone else using the manager's engine (a migration, the
    application's own query) while dblock's threads keep every connection
    of a pool without overflow busy or idle in its stack: served at once,
    never left to the pool's timeout."""
    names = keys(4)  # type: ignore[operator]
    options = {"pool_size": 2, "max_overflow": 0, "pool_timeout": 3}
    stop = threading.Event()
    errors: list[BaseException] = []
    with LockManager(db_url, engine_options=options) as manager:
        with manager.lock(names[0], blocking=False):
            pass  # its connection is idle in dblock's stack now
        started = time.monotonic()
        with manager.engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
        assert time.monotonic() - started < 1.0

        def work(key: str) -> None:
            try:
                while not stop.is_set():
                    with manager.lock(key, timeout=10):
                        pass
            except BaseException as exc:  # reported below
                errors.append(exc)

        pool = [threading.Thread(target=work, args=(k,)) for k in names]
        for t in pool:
            t.start()
        try:
            for _ in range(10):
                started = time.monotonic()
                with manager.engine.connect() as conn:
                    conn.exec_driver_sql("SELECT 1")
                assert time.monotonic() - started < 2.0
                time.sleep(0.02)
        finally:
            stop.set()
            for t in pool:
                t.join(60)
    assert errors == []


def _no_commit_warning(caplog: pytest.LogCaptureFixture) -> None:
    assert not [r for r in caplog.records if "may have committed" in r.getMessage()]


def test_exhausted_pool_fails_within_the_request_timeout(
    small_engine: sa.Engine, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    with LockManager(small_engine, renew=False) as m:
        # A borrowed engine's pool is the application's: dblock never gates it.
        assert "_do_get" not in vars(small_engine.pool)
        with small_engine.connect():  # the application holds the pool's only connection
            started = time.monotonic()
            with (
                caplog.at_level(logging.DEBUG, logger="dblock"),
                pytest.raises(BackendError) as info,
            ):
                m.acquire(key, timeout=0.3)
            # The request's 0.3 s bounds the wait, not the pool's 30 s.
            assert time.monotonic() - started < POOL_TIMEOUT / 2
        message = str(info.value)
        assert "pool" in message
        assert "exhausted" in message
        assert "pool_size 1" in message
        assert "max_overflow 0" in message
        assert "pool_timeout 30 s" in message
        assert "nothing was sent" in message
        _no_commit_warning(caplog)
        assert not m.store.has_orphans
        assert len(m._locker.registry) == 0
        # Once a connection is free again, the key is there to take.
        with m.lock(key, blocking=False):
            assert row_of(m, key) is not None


def test_pool_timeout_shorter_than_the_request_keeps_waiting_for_a_connection(
    db_url: str, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A waiting request outlasts the pool's timeout: it waits for a
    connection until its own timeout, then says the pool is exhausted."""
    engine = sa.create_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=0.05)
    try:
        with LockManager(engine, renew=False) as m:
            with (
                engine.connect(),
                caplog.at_level(logging.DEBUG, logger="dblock"),
                pytest.raises(BackendError, match="exhausted"),
            ):
                m.acquire(key, timeout=0.3)
            _no_commit_warning(caplog)
            assert not m.store.has_orphans
    finally:
        engine.dispose()


def test_fail_fast_and_release_on_an_exhausted_pool(
    db_url: str, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    engine = sa.create_engine(db_url, pool_size=1, max_overflow=0, pool_timeout=0.2)
    try:
        with LockManager(engine, renew=False) as m:
            held = m.acquire(key)
            with engine.connect(), caplog.at_level(logging.DEBUG, logger="dblock"):
                # No timeout of its own: the pool's timeout bounds it.
                with pytest.raises(BackendError, match=r"pool_timeout 0\.2 s"):
                    m.acquire(key + ":other", blocking=False)
                assert held.release() is False  # logged, never raised
            _no_commit_warning(caplog)
            assert any(
                r.levelno == logging.ERROR and repr(key) in r.getMessage() for r in caplog.records
            )
            assert len(m._locker.registry) == 0
            # The row is left to its lease, as for any unreachable database.
            assert row_of(m, key) is not None
            m.store.release(key, held.token)
    finally:
        engine.dispose()


class _Stop(Exception):
    """What a signal handler raises (a timeout, say) in the middle of an acquire."""


@pytest.mark.parametrize("timeout", [5.0, None], ids=["own-timeout", "pool-timeout"])
def test_interrupted_while_waiting_for_the_pool_leaves_nothing(
    small_engine: sa.Engine, key: str, caplog: pytest.LogCaptureFixture, timeout: float | None
) -> None:
    """A signal handler's exception while the request waits for a pooled
    connection: no statement was sent, so there is nothing that "may have
    committed": no warning, no orphan, nothing in the registry."""
    in_pool_wait = threading.Event()
    done = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        names = {f.name for f in traceback.extract_stack(frame)}
        if "try_acquire" in names and names & {"_wait_for_pool", "_do_get"}:
            in_pool_wait.set()
            raise _Stop

    def interrupt() -> None:
        main = threading.main_thread().ident
        assert main is not None
        while not done.is_set():
            signal.pthread_kill(main, signal.SIGUSR1)
            done.wait(0.02)

    previous = signal.signal(signal.SIGUSR1, handler)
    sender = threading.Thread(target=interrupt)
    try:
        with LockManager(small_engine, renew=False) as m:
            with small_engine.connect(), caplog.at_level(logging.DEBUG, logger="dblock"):
                sender.start()
                try:
                    with pytest.raises(_Stop):
                        m.acquire(key, timeout=timeout)
                finally:
                    done.set()
                    sender.join()
            assert in_pool_wait.is_set()
            _no_commit_warning(caplog)
            assert not m.store.has_orphans
            assert len(m._locker.registry) == 0
            with m.lock(key, blocking=False):
                pass
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork")
def test_a_forked_child_gates_its_own_pool(db_url: str, keys: object) -> None:
    """A forked child gets a pool of its own (``engine.dispose()``): the
    executor gates that one, not its parent's, so the child keeps its
    connection and serves the engine beside it; the parent goes on."""
    k_parent, k_child = keys(2)  # type: ignore[operator]
    options = {"pool_size": 1, "max_overflow": 0, "pool_timeout": 3}
    with LockManager(db_url, engine_options=options) as manager:
        with manager.lock(k_parent, blocking=False):
            pass
        pid = os.fork()
        if pid == 0:  # the child: nothing of pytest's may run here
            code = 1
            try:
                executor = manager.store.executor
                assert executor._bounded is manager.engine.pool
                for _ in range(20):
                    with manager.lock(k_child, timeout=10):
                        pass
                with manager.engine.connect() as conn:
                    conn.exec_driver_sql("SELECT 1")
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise AssertionError("the forked child hung")
            time.sleep(0.01)
        assert os.waitstatus_to_exitcode(status) == 0
        with manager.lock(k_parent, blocking=False):
            assert row_of(manager, k_parent) is not None


_SESSION = {
    "postgresql": ("SELECT pg_backend_pid(), pg_sleep(0.5)", "SELECT pid FROM pg_stat_activity"),
    "mariadb": (
        "SELECT CONNECTION_ID(), SLEEP(0.5)",
        "SELECT id FROM information_schema.processlist",
    ),
}


@pytest.mark.databases("postgresql", "mariadb")
def test_a_statement_running_as_the_manager_closes_leaves_no_connection(
    db: str, db_url: str
) -> None:
    """A thread's statement (a deferred release on dblock's worker thread,
    say) still running when the manager closes: its connection is closed
    when it returns. Before, it went back to the closed executor's stack and
    stayed open until collected, and Django's test runner could not drop
    the test database after a TestCase that took a lock."""
    slow, sessions = _SESSION[db]
    m = LockManager(db_url)
    ran: list[int] = []

    def statement() -> None:
        ran.append(int(m.store.executor.run(slow, {}, fetch=True).rows[0][0]))

    thread = threading.Thread(target=statement)
    thread.start()
    until = time.monotonic() + 5
    while m.store.engine.pool.checkedout() < 1 and time.monotonic() < until:
        time.sleep(0.005)  # until the thread has its connection (its statement takes 0.5 s)
    m.close()
    thread.join(5)
    assert ran, "the statement did not return"
    probe = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        deadline = time.monotonic() + 5
        while True:
            with probe.connect() as conn:
                alive = {row[0] for row in conn.exec_driver_sql(sessions)}
            if ran[0] not in alive or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        probe.dispose()
    assert ran[0] not in alive, "the connection of a statement that ran across close() is open"
