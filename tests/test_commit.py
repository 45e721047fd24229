"""The lock must cover the commit: ``until=session`` holds a lock until a
SQLAlchemy session's transaction ends, and :mod:`dblock.deferral`'s triggers
(fired, dropped, collected) release exactly once."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from dblock import HeldLock, LockArgumentError, LockBusy, LockManager
from dblock.deferral import Deferred, exit_deferring
from tests.conftest import row_of
from tests.support.db import private_database


@pytest.fixture
def bank(db: str, tmp_path: Path) -> Iterator[sa.Engine]:
    """An application database with one account holding 100."""
    with private_database(db, tmp_path) as url:
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE account (id INTEGER PRIMARY KEY, balance INTEGER)"))
            conn.execute(sa.text("INSERT INTO account VALUES (1, 100)"))
        yield engine
        engine.dispose()


def withdraw_all(engine: sa.Engine, manager: LockManager, key: str, *, until: bool) -> int:
    """20 threads each withdraw 1 under the lock and commit after the locked
    block, as a request commits its session at the end; the final balance."""

    def withdraw() -> None:
        with Session(engine) as session:
            with manager.lock(key, timeout=60, until=session if until else None):
                balance = session.execute(sa.text("SELECT balance FROM account")).scalar_one()
                session.execute(sa.text("UPDATE account SET balance = :b"), {"b": balance - 1})
            time.sleep(0.02)  # the rest of the request, before its session commits
            session.commit()

    threads = [threading.Thread(target=withdraw) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    with engine.connect() as conn:
        return int(conn.execute(sa.text("SELECT balance FROM account")).scalar_one())


@pytest.mark.databases("postgresql", "mariadb")
def test_a_lock_released_before_the_commit_loses_updates(
    bank: sa.Engine, manager: LockManager, key: str
) -> None:
    assert withdraw_all(bank, manager, key, until=False) > 80


@pytest.mark.databases("postgresql", "mariadb")
def test_until_session_loses_no_update(bank: sa.Engine, manager: LockManager, key: str) -> None:
    assert withdraw_all(bank, manager, key, until=True) == 80


def test_until_session_releases_at_commit_rollback_and_close(
    manager: LockManager, make_manager: object, keys: object, tmp_path: Path
) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'app.sqlite3'}")
    other: LockManager = make_manager()  # type: ignore[operator]
    k = keys(4)  # type: ignore[operator]

    def busy(key: str) -> bool:
        try:
            with other.lock(key, blocking=False):
                return False
        except LockBusy:
            return True

    with Session(engine) as session:
        # No transaction open at the end of the block: released at once.
        with manager.lock(k[0], until=session):
            pass
        assert not busy(k[0])
        for end, key in ((session.commit, k[1]), (session.rollback, k[2]), (session.close, k[3])):
            session.execute(sa.text("SELECT 1"))
            with manager.lock(key, until=session):
                pass
            assert busy(key)
            with session.begin_nested():  # a savepoint ending is not the end
                pass
            assert busy(key)
            end()
            assert not busy(key)
    engine.dispose()


def test_until_scoped_session_and_decorator(manager: LockManager, key: str, tmp_path: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'app.sqlite3'}")
    scoped = scoped_session(sessionmaker(engine))

    @manager.locked(lambda: key, until=scoped)
    def work() -> int:
        return int(scoped.execute(sa.text("SELECT 7")).scalar_one())

    assert work() == 7
    assert row_of(manager, key) is not None  # held: the session's transaction is open
    assert work() == 7  # the same thread re-enters in the same transaction
    scoped.commit()
    assert row_of(manager, key) is None
    scoped.remove()
    engine.dispose()


def test_until_must_be_a_session(manager: LockManager, key: str) -> None:
    with pytest.raises(LockArgumentError, match="until must be a SQLAlchemy Session"):
        manager.lock(key, until="session")
    with pytest.raises(LockArgumentError, match="until must be a SQLAlchemy Session"):
        manager.locked(lambda: key, until=object())


def test_a_session_collected_with_its_transaction_open_releases_with_a_warning(
    manager: LockManager, key: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'app.sqlite3'}")
    session = Session(engine)
    session.execute(sa.text("SELECT 1"))
    with manager.lock(key, until=session):
        pass
    assert row_of(manager, key) is not None
    with caplog.at_level(logging.WARNING, logger="dblock"), pytest.warns(ResourceWarning):  # noqa: PT031
        del session
        gc.collect()
        deadline = time.monotonic() + 30
        while row_of(manager, key) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert row_of(manager, key) is None
    assert "garbage-collected with its transaction still open" in caplog.text
    engine.dispose()


def test_triggers_fire_once_and_release_after_the_last(manager: LockManager, key: str) -> None:
    triggers = []

    def hook(deferred: Deferred, result: object) -> object:
        triggers.extend([deferred.trigger(), deferred.trigger()])
        return result

    held = manager.acquire(key)
    exit_deferring(held, hook, None, None)
    assert not held.released
    triggers[0]()
    triggers[0]()  # a second call of the same trigger counts nothing
    assert not held.released
    closer = threading.Thread(target=triggers[1])  # another thread, as a server's may be
    closer.start()
    closer.join(30)
    assert held.released
    assert row_of(manager, key) is None


def test_a_dropped_trigger_releases(manager: LockManager, key: str) -> None:
    """A trigger collected uncalled (a rollback discarding an on_commit
    callback) fires then, quietly when it was created without a warning."""
    kept: list[object] = []

    def hook(deferred: Deferred, result: object) -> object:
        kept.append(deferred.trigger())
        return result

    held = manager.acquire(key)
    exit_deferring(held, hook, None, None)
    assert not held.released
    kept.clear()
    deadline = time.monotonic() + 30
    while row_of(manager, key) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held.released
    assert row_of(manager, key) is None


def test_renewal_keeps_a_deferred_lock(manager: LockManager, key: str) -> None:
    kept: list[object] = []
    # A lease of 1 s, renewed about every third of it: 0.3 s was lost now and
    # then on a loaded machine (the renewal thread late past the lease's end).
    held = manager.acquire(key, ttl=1.0)
    exit_deferring(held, lambda d, r: kept.append(d.trigger()), None, None)
    first = held.expires_at
    deadline = time.monotonic() + 30
    while held.expires_at == first and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held.expires_at > first  # renewed while waiting for its trigger
    assert not held.lost
    kept.pop()()  # type: ignore[operator]
    assert held.released


def test_a_deferred_lock_outlives_the_thread_that_took_it(
    manager: LockManager, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The thread that took a lock ends before the commit or response its
    release waits for (a worker thread handing a streamed body to the server):
    the deferral owns the lock now, so renewal keeps it, no dead-owner release."""
    kept: list[object] = []
    taken: list[HeldLock] = []

    def worker() -> None:
        held = manager.acquire(key, ttl=1.0)
        exit_deferring(held, lambda d, r: kept.append(d.trigger()), None, None)
        taken.append(held)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    assert taken
    held = taken[0]
    # Three renewal passes after its thread ended (each pass also looks at owners).
    for _ in range(3):
        before = held.expires_at
        deadline = time.monotonic() + 30
        while held.expires_at == before and not held.released and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not held.released, "released before its trigger fired"
    assert not held.lost
    with pytest.raises(LockBusy), manager.lock(key, blocking=False):
        pass
    kept.pop()()  # type: ignore[operator]
    assert held.released
    assert row_of(manager, key) is None
    assert "ended without releasing" not in caplog.text


def test_no_trigger_releases_at_exit_and_a_failing_hook_still_releases(
    manager: LockManager, key: str
) -> None:
    held = manager.acquire(key)
    exit_deferring(held, lambda d, r: r, None, None)
    assert held.released

    def broken(deferred: Deferred, result: object) -> object:
        raise RuntimeError("hook bug")

    held = manager.acquire(key)
    with pytest.raises(RuntimeError, match="hook bug"):
        exit_deferring(held, broken, None, None)
    assert held.released
