"""Asking about a lock without taking it: ``is_locked(key)`` (anyone, one
statement), ``owns(key)`` and ``held.owned()`` (this thread or task, no SQL),
on SQLite, PostgreSQL and MariaDB, sync and async."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

import pytest

from dblock import AsyncLockManager, LockArgumentError, LockLost, LockManager, ManagerClosed
from tests.support.counting import StatementCounter
from tests.support.rows import insert_expired


def _in_thread(func: Any) -> Any:
    box: list[Any] = []
    thread = threading.Thread(target=lambda: box.append(func()))
    thread.start()
    thread.join(30)
    return box[0]


def test_is_locked_is_one_statement_and_sees_other_holders(
    manager: LockManager, make_manager: Any, key: str
) -> None:
    other: LockManager = make_manager()  # its own registry: another process, for level 1
    with StatementCounter(manager.engine) as counted:
        assert manager.is_locked(key) is False
    assert counted.count == 1
    with other.lock(key):
        assert manager.is_locked(key) is True
        assert other.is_locked(key) is True  # its own lock too: the row answers
    assert manager.is_locked(key) is False


def test_a_lease_that_ran_out_counts_as_free(private: LockManager, key: str) -> None:
    insert_expired(private, [key], ago=5)
    assert [r.key for r in private.store.rows()] == [key]  # the row is still there
    assert private.is_locked(key) is False


def test_is_locked_sees_every_kind(manager: LockManager, make_manager: Any, key: str) -> None:
    other: LockManager = make_manager()
    with other.read_lock(f"{key}:rw"):
        assert manager.is_locked(f"{key}:rw") is True
    assert manager.is_locked(f"{key}:rw") is False
    with other.semaphore(f"{key}:sem", permits=3):
        assert manager.is_locked(f"{key}:sem") is True
    assert manager.is_locked(f"{key}:sem") is False


@pytest.mark.parametrize("bad", ["", "x" * 256, None, "a\x00b"])
def test_bad_keys_refused_before_sql(manager: LockManager, bad: Any) -> None:
    with StatementCounter(manager.engine) as counted:
        with pytest.raises(LockArgumentError):
            manager.is_locked(bad)
        with pytest.raises(LockArgumentError):
            manager.owns(bad)
    assert counted.count == 0


def test_owns_and_owned_answer_for_this_thread_without_sql(manager: LockManager, key: str) -> None:
    assert manager.owns(key) is False
    with manager.lock(key) as held:
        with StatementCounter(manager.engine) as counted:
            assert manager.owns(key) is True
            assert held.owned() is True
            assert _in_thread(lambda: manager.owns(key)) is False
            assert _in_thread(held.owned) is False
        assert counted.count == 0
    assert manager.owns(key) is False
    assert held.owned() is False  # released


def test_a_lost_lock_is_not_owned(private: LockManager, key: str) -> None:
    held = private.acquire(key, ttl=0.2)  # `private` does not renew
    assert held.owned() is True
    threading.Event().wait(0.3)
    assert held.owned() is False  # its lease ran out: someone else may hold it now
    assert private.owns(key) is False
    assert private.is_locked(key) is False
    with contextlib.suppress(LockLost):
        held.release()


def test_closed_manager_refuses_introspection(manager: LockManager, key: str) -> None:
    manager.close()
    with pytest.raises(ManagerClosed):
        manager.is_locked(key)
    with pytest.raises(ManagerClosed):
        manager.owns(key)


def test_async_is_locked_and_owns(manager: LockManager, key: str) -> None:
    async def main() -> None:
        async with AsyncLockManager(manager) as alocks:
            assert await alocks.is_locked(key) is False
            async with alocks.lock(key) as held:
                assert await alocks.is_locked(key) is True
                assert alocks.owns(key) is True
                assert held.owned() is True

                async def another_task() -> tuple[bool, bool]:
                    return alocks.owns(key), held.owned()

                assert await asyncio.create_task(another_task()) == (False, False)
            assert alocks.owns(key) is False
            assert await alocks.is_locked(key) is False
            with pytest.raises(LockArgumentError):
                await alocks.is_locked("")

    asyncio.run(main())
