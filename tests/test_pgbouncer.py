"""Behind a connection pooler: dblock through a private pgbouncer in
transaction mode (Debian's package) in front of the machine's PostgreSQL,
with ``pooler=True``: no server-side prepared statements, no LISTEN through
the pooler (a direct ``listen_url``, else polling), and the same contention
checks as the direct tests."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from dblock import AsyncLockManager, BackendError, LockArgumentError, LockBusy, LockManager
from tests.support import procs
from tests.support.counting import StatementCounter
from tests.support.db import DEFAULT_URLS, async_form
from tests.support.servers import PgBouncer

pytestmark = pytest.mark.databases("postgresql")

ctx = multiprocessing.get_context("spawn")


@pytest.fixture(scope="module")
def bouncer() -> Iterator[PgBouncer]:
    with LockManager(DEFAULT_URLS["postgresql"]) as m:
        m.create_schema()
    with PgBouncer(DEFAULT_URLS["postgresql"], pool_size=3) as server:
        yield server  # type: ignore[misc]


def hammer(managers: list[LockManager], key: str, rounds: int = 50) -> tuple[int, list[object]]:
    """Threads, one per manager, taking ``key`` fail-fast ``rounds`` times;
    the number of busy answers and every statement error seen."""
    errors: list[object] = []
    for m in managers:
        sa.event.listen(m.engine, "handle_error", lambda c: errors.append(c.original_exception))
    busy = 0

    def run(m: LockManager) -> None:
        nonlocal busy
        for _ in range(rounds):
            try:
                with m.lock(key, blocking=False):
                    time.sleep(0.0005)
            except LockBusy:
                busy += 1
            except Exception as exc:
                errors.append(exc)

    threads = [threading.Thread(target=run, args=(m,)) for m in managers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return busy, errors


def test_without_pooler_option_psycopg_prepares_and_fails(bouncer: PgBouncer, key: str) -> None:
    """The failure ``pooler=True`` exists for: psycopg prepares a statement
    run 5 times on a connection, and behind a transaction-mode pooler the next
    transaction's server connection has it already, or lacks it."""
    managers = [LockManager(bouncer.url, local_filter=False) for _ in range(4)]
    try:
        _, errors = hammer(managers, key)
    finally:
        for m in managers:
            m.close()
    assert any("prepared statement" in str(e) for e in errors)


POOLER_HINT = "pass pooler=True or add prepare_threshold=None"


def test_without_pooler_option_the_error_says_what_it_means(
    bouncer: PgBouncer, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Behind the pooler without ``pooler=True``, the failures (a prepared
    statement missing, already there, or bound with another's parameters)
    say what they mean; waiting requests fail at once rather than ride them
    out, and no log line calls the (reachable) server unreachable."""
    caplog.set_level(logging.INFO, logger="dblock")
    managers = [LockManager(bouncer.url, local_filter=False) for _ in range(4)]
    raised: list[BackendError] = []

    def run(m: LockManager) -> None:
        for _ in range(60):
            try:
                with m.lock(key, timeout=10):
                    time.sleep(0.01)  # long enough that others wait
            except BackendError as exc:
                raised.append(exc)

    threads = [threading.Thread(target=run, args=(m,)) for m in managers]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        for m in managers:
            m.close()
    assert raised
    for exc in raised:
        assert "looks like a transaction-mode pooler" in str(exc), exc
        assert POOLER_HINT in str(exc)
    assert not [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]


def test_without_pooler_option_async_tasks_are_told_too(bouncer: PgBouncer, key: str) -> None:
    """Two managers take turns, so their client connections share the
    pooler's server connections (pgbouncer hands out the one used last):
    the second to prepare a statement finds the first's name there. One
    client alone could keep one server connection and never show it, which
    is why this test once passed only after the file's earlier tests had
    left prepared statements behind."""

    async def main() -> list[BackendError]:
        managers = [AsyncLockManager(bouncer.url, local_filter=False) for _ in range(2)]
        raised: list[BackendError] = []
        try:
            for i in range(20):
                for j, alocks in enumerate(managers):
                    try:
                        # A key per try: a release that failed the same way
                        # (logged, with the hint) leaves its row for its
                        # lease, and a later try on that key would only be
                        # refused (LockBusy), not told.
                        async with alocks.lock(f"{key}:{i}:{j}", blocking=False):
                            pass
                    except BackendError as exc:
                        raised.append(exc)
        finally:
            for alocks in managers:
                await alocks.close()
        return raised

    raised = asyncio.run(main())
    assert raised
    assert all(POOLER_HINT in str(exc) for exc in raised), raised


def test_contention_behind_the_pooler_raises_no_errors(bouncer: PgBouncer, key: str) -> None:
    managers = [LockManager(bouncer.url, local_filter=False, pooler=True) for _ in range(4)]
    counters = [StatementCounter(m.engine).__enter__() for m in managers]
    try:
        busy, errors = hammer(managers, key)
    finally:
        for m in managers:
            m.close()
    assert busy > 0  # there was contention
    assert sum(c.count for c in counters) >= 200
    assert errors == []


def test_cross_process_read_modify_write_is_exact_behind_the_pooler(
    bouncer: PgBouncer, key: str
) -> None:
    """Processes x threads incrementing a counter row (on the direct URL)
    under locks taken through the pooler: no update is lost."""
    url = DEFAULT_URLS["postgresql"]
    processes, threads, rounds = 3, 4, 8
    procs.reset_counter(url, key)
    go = ctx.Event()
    workers = [
        ctx.Process(
            target=procs.increment_worker,
            args=(url, key, key, threads, rounds, True, go, bouncer.url, {"pooler": True}),
        )
        for _ in range(processes)
    ]
    for w in workers:
        w.start()
    go.set()
    for w in workers:
        w.join(300)
        assert w.exitcode == 0
    assert procs.read_counter(url, key) == processes * threads * rounds


def _nothing(*args: object) -> None:
    pass


def _listeners() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "dblock-listener"]


def _wait_behind(holder: LockManager, waiter: LockManager, key: str) -> float:
    """``waiter`` waits for ``key`` held by ``holder``, which releases once
    the waiter has tried twice; seconds from the release to the grant."""
    held = holder.acquire(key)
    granted = threading.Event()
    with StatementCounter(waiter.engine) as c:

        def wait() -> None:
            with waiter.lock(key, timeout=60):
                granted.set()

        t = threading.Thread(target=wait)
        t.start()
        deadline = time.monotonic() + 30
        while c.count < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        released = time.monotonic()
        held.release()
        assert granted.wait(60)
        t.join(10)
    return time.monotonic() - released


def test_waiters_behind_the_pooler_poll_without_listen(bouncer: PgBouncer, key: str) -> None:
    before = len(_listeners())
    with (
        LockManager(bouncer.url, pooler=True) as holder,
        LockManager(bouncer.url, pooler=True) as waiter,
    ):
        _wait_behind(holder, waiter, key)
        assert len(_listeners()) == before  # nobody LISTENs through the pooler


def test_waiters_behind_the_pooler_listen_on_the_direct_url(bouncer: PgBouncer, key: str) -> None:
    direct = DEFAULT_URLS["postgresql"]
    with (
        LockManager(bouncer.url, pooler=True) as holder,
        LockManager(
            bouncer.url, pooler=True, listen_url=direct, notify_recheck=30.0, poll_max=30.0
        ) as waiter,
    ):
        _wait_behind(holder, waiter, key)
        listener = waiter.store._listener  # type: ignore[attr-defined]
        assert listener is not None
        assert listener._engine.url.port == sa.make_url(direct).port  # not the pooler's


def test_listen_url_is_for_postgresql(tmp_path: object) -> None:
    with pytest.raises(LockArgumentError, match="listen_url is for PostgreSQL"):
        LockManager(f"sqlite:///{tmp_path}/x.sqlite3", listen_url=DEFAULT_URLS["postgresql"])
    with pytest.raises(LockArgumentError, match="listen_url must be"):
        LockManager(DEFAULT_URLS["postgresql"], listen_url=5)


@pytest.mark.parametrize("driver", ["psycopg_async", "asyncpg"])
@pytest.mark.parametrize("observed", [False, True], ids=["direct", "observed"])
def test_async_tasks_behind_the_pooler_raise_no_errors(
    bouncer: PgBouncer, key: str, driver: str, observed: bool
) -> None:
    """The asyncio face sends its statements straight to psycopg's
    AsyncConnection or asyncpg's (which prepares every statement, named, by
    default): with ``pooler=True`` neither may prepare one. ``observed``:
    through SQLAlchemy's Connection (an execution listener), whose asyncpg
    adapter prepares statements of its own."""

    async def main() -> tuple[int, list[object]]:
        url = async_form(bouncer.url, driver)
        managers = [AsyncLockManager(url, local_filter=False, pooler=True) for _ in range(4)]
        if observed:
            for m in managers:
                sa.event.listen(m.astore.engine.sync_engine, "before_cursor_execute", _nothing)
        errors: list[object] = []
        busy = 0

        async def run(m: AsyncLockManager) -> None:
            nonlocal busy
            for _ in range(50):
                try:
                    async with m.lock(key, blocking=False):
                        await asyncio.sleep(0.0005)
                except LockBusy:
                    busy += 1
                except Exception as exc:
                    errors.append(exc)

        try:
            await asyncio.gather(*(run(m) for m in managers))
        finally:
            for m in managers:
                await m.close()
        return busy, errors

    busy, errors = asyncio.run(main())
    assert busy > 0  # there was contention
    assert errors == []
