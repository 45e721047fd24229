"""The blocking and the asyncio faces decide alike because they share one
core without I/O (``dblock._faces``, ``dblock.jobs.Once``/``Job``,
``dblock.multi.acquire_many_steps``): the same request is refused with the
same words on both, and the multi-key rule runs the same on both drivers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from dblock import (
    AsyncLockManager,
    KindMismatch,
    LockArgumentError,
    LockManager,
    LockTimeout,
    ManagerClosed,
)
from dblock._faces import Checked
from dblock.multi import acquire_many_steps
from dblock.steps import Call

T = TypeVar("T")


def _run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def _refusal(call: Callable[[], object]) -> str:
    with pytest.raises(LockArgumentError) as caught:
        call()
    return str(caught.value)


@pytest.mark.parametrize(
    "options",
    [
        {"blocking": "yes"},
        {"timeout": -1},
        {"blocking": False, "timeout": 3.0},
        {"ttl": 0},
        {"renew": "no"},
        {"max_hold": -5},
        {"on_lost": 3},
        {"tmeout": 1},
    ],
)
def test_both_faces_refuse_a_request_with_the_same_words(
    manager: LockManager, key: str, options: dict[str, Any]
) -> None:
    alocks = AsyncLockManager(manager)
    try:
        blocking = _refusal(lambda: manager.lock(key, **options))
        assert _refusal(lambda: alocks.lock(key, **options)) == blocking
        assert _refusal(lambda: manager.lock_many([key], **options)) == blocking
        assert _refusal(lambda: alocks.lock_many([key], **options)) == blocking
    finally:
        _run(alocks.close())


def test_a_checked_request_is_the_tuple_it_was(manager: LockManager, key: str) -> None:
    checked = manager.checks.check(key, {"timeout": 2, "ttl": 7})
    assert isinstance(checked, Checked)
    assert checked == (key, True, 2.0, 7.0, None)
    assert manager._check(key, {"timeout": 2, "ttl": 7}) == checked  # the former name
    ordered, many = manager.checks.check_many([f"{key}:b", f"{key}:a"], {})
    assert ordered == (f"{key}:a", f"{key}:b")
    assert many.timeout == manager.config.timeout


def test_a_closed_manager_refuses_on_both_faces(make_manager: Any, key: str) -> None:
    manager: LockManager = make_manager()
    alocks = AsyncLockManager(manager)
    manager.close()
    assert manager._closed
    assert manager.checks.closed
    for call in (
        lambda: manager.lock(key),
        lambda: alocks.lock(key),
        lambda: manager.owns(key),
        lambda: alocks.owns(key),
        manager.start_sweeper,
    ):
        with pytest.raises(ManagerClosed):
            call()
    with pytest.raises(ManagerClosed):
        _run(alocks.is_locked(key))
    _run(alocks.close())


def test_the_kinds_lockers_are_made_on_first_use(private: LockManager, key: str) -> None:
    assert private._rw is None
    assert private._semaphores is None
    with private.read_lock(key):
        pass
    assert private._rw is private.kinds.rw is private._rw_locker()
    with private.semaphore(f"{key}:s", permits=2):
        pass
    assert private._semaphores is private.kinds.semaphores is private._semaphores_()


def test_once_refuses_a_function_of_the_other_face(manager: LockManager, key: str) -> None:
    alocks = AsyncLockManager(manager)

    async def coro() -> None: ...

    def plain() -> None: ...

    try:
        with pytest.raises(LockArgumentError, match="coroutine function: use AsyncLockManager"):
            manager.once(key)(coro)
        with pytest.raises(LockArgumentError, match="is not a coroutine function: use LockManager"):
            alocks.once(key)(plain)  # type: ignore[arg-type]
    finally:
        _run(alocks.close())


def _drive(steps: Any) -> Any:
    """A bare blocking driver of Call ops (what each face's driver does with them)."""
    try:
        op = next(steps)
        while True:
            assert isinstance(op, Call)
            try:
                answer = op.func()
            except BaseException as exc:
                op = steps.throw(exc)
            else:
                op = steps.send(answer)
    except StopIteration as stop:
        return stop.value


def test_the_multi_key_rule_takes_in_order_and_gives_back_on_failure() -> None:
    taken: list[tuple[str, float | None]] = []
    given_back: list[list[str]] = []

    def take(key: str, wait: float | None) -> str:
        if key == "c":
            raise LockTimeout(key, timeout=0.5, level=2)
        taken.append((key, wait))
        return key

    assert _drive(acquire_many_steps(("a", "b"), None, take, given_back.append)) == ["a", "b"]
    assert taken == [("a", None), ("b", None)]
    assert given_back == []
    with pytest.raises(LockTimeout) as caught:
        _drive(acquire_many_steps(("a", "b", "c"), 9.0, take, given_back.append))
    assert caught.value.timeout == 9.0  # the caller's, not the part left for "c"
    assert given_back == [["a", "b"]]


def test_lock_many_runs_the_same_rule_on_both_faces(manager: LockManager, keys: Any) -> None:
    a, b = keys(2)
    alocks = AsyncLockManager(manager)

    async def both() -> None:
        async with alocks.lock_many([b, a]) as held:
            assert list(held) == sorted([a, b])
            assert all(manager.owns(k) for k in held)
        assert not manager.owns(a)

    try:
        with manager.lock_many([b, a]) as held:
            assert list(held) == sorted([a, b])
        _run(both())
    finally:
        _run(alocks.close())


def test_a_key_held_as_another_kind_is_refused_alike_before_any_sql(db_url: str, key: str) -> None:
    """A key this process holds as a semaphore, asked for as an exclusive
    lock: both faces refuse it at once, in the same words, without SQL
    (the asyncio face asked the table first, and said "in the table")."""
    blocking = LockManager(db_url)
    try:
        with blocking.semaphore(key, permits=2), pytest.raises(KindMismatch) as sync_refusal:
            blocking.acquire(key, blocking=False)
    finally:
        blocking.close()

    async def asyncio_face() -> str:
        alocks = AsyncLockManager(db_url)
        try:
            async with alocks.semaphore(key, permits=2):
                with pytest.raises(KindMismatch) as refusal:
                    await alocks.acquire(key, blocking=False)
                return str(refusal.value)
        finally:
            await alocks.close()

    assert _run(asyncio_face()) == str(sync_refusal.value)
    assert "in this process" in str(sync_refusal.value)
