"""The service-layer decorator: keys from arguments, busy behaviour, methods,
introspection, and mistakes refused when the decorator is applied."""

from __future__ import annotations

import inspect
import threading
from typing import Any

import pytest

from dblock import (
    LockArgumentError,
    LockBusy,
    LockManager,
    LockNotAcquired,
    LockTimeout,
    returns,
)
from tests.conftest import row_of
from tests.support.counting import StatementCounter


class Account:
    def __init__(self, id: int) -> None:
        self.id = id


def held_keys(manager: LockManager) -> list[str]:
    return sorted(manager._locker.registry._entries)


def test_busy_raises_by_default(make_manager: Any, key: str) -> None:
    a, b = make_manager(), make_manager()

    @b.locked(key + ":{user_id}", blocking=False)
    def work(user_id: int) -> str:
        return "done"

    with a.lock(f"{key}:1"), pytest.raises(LockBusy) as info:
        work(1)
    assert info.value.key == f"{key}:1"
    assert work(2) == "done"


def test_busy_returns_a_given_value(make_manager: Any, key: str) -> None:
    a, b = make_manager(), make_manager()
    calls: list[int] = []

    @b.locked(key + ":{user_id}", blocking=False, on_busy=returns("busy"))
    def work(user_id: int) -> str:
        calls.append(user_id)
        return "done"

    with a.lock(f"{key}:1"):
        assert work(1) == "busy"
    assert work(1) == "done"
    assert calls == [1]


def test_busy_calls_a_handler_with_the_error_and_arguments(make_manager: Any, key: str) -> None:
    a, b = make_manager(), make_manager()
    seen: list[tuple[str, int, int]] = []

    def handler(error: LockNotAcquired, user_id: int, amount: int = 0) -> str:
        seen.append((type(error).__name__, user_id, amount))
        return f"retry {user_id} later"

    @b.locked(key + ":{user_id}", timeout=0.2, on_busy=handler)
    def pay(user_id: int, amount: int = 0) -> str:
        return "paid"

    with a.lock(f"{key}:5"):
        assert pay(5, amount=3) == "retry 5 later"
    assert seen == [("LockTimeout", 5, 3)]
    assert pay(5) == "paid"


def test_handler_is_not_used_for_errors_inside_the_body(make_manager: Any, key: str) -> None:
    """on_busy is about the decorator's own lock; a LockBusy raised by the
    function's body (another lock it takes) propagates."""
    a, b = make_manager(), make_manager()

    @b.locked(key + ":outer:{n}", on_busy=returns("handled"))
    def work(n: int) -> None:
        with b.lock(f"{key}:inner", blocking=False):
            pass

    with a.lock(f"{key}:inner"), pytest.raises(LockBusy):
        work(1)


def test_handler_that_cannot_take_the_arguments_is_refused_at_decoration(
    manager: LockManager, key: str
) -> None:
    with pytest.raises(LockArgumentError, match="on_busy handler"):

        @manager.locked(key + ":{user_id}", on_busy=lambda error: None)
        def work(user_id: int) -> None: ...

    with pytest.raises(LockArgumentError, match="on_busy must be"):
        manager.locked(key + ":{user_id}", on_busy="return")  # type: ignore[arg-type]


def test_unknown_template_field_is_an_error_at_decoration_time(
    manager: LockManager, key: str
) -> None:
    with StatementCounter(manager.engine) as counter:
        with pytest.raises(LockArgumentError, match="'usr_id', which is not a parameter"):

            @manager.locked(key + ":{usr_id}")
            def work(user_id: int) -> None: ...

        with pytest.raises(LockArgumentError, match="'dst'"):

            @manager.locked([key + ":{src.id}", key + ":{dst.id}"])
            def transfer(src: Account, destination: Account) -> None: ...

        class Service:
            with pytest.raises(LockArgumentError, match="'account'"):

                @manager.locked(key + ":{account.id}")
                def work(self, account_id: int) -> None: ...

    assert counter.count == 0


def test_signature_and_docstring_are_kept(manager: LockManager, key: str) -> None:
    def transfer(src: Account, dst: Account, amount: int, *, note: str = "") -> int:
        """Move money."""
        return amount

    wrapped = manager.locked(key + ":{src.id}:{dst.id}")(transfer)
    assert wrapped.__name__ == "transfer"
    assert wrapped.__doc__ == "Move money."
    assert wrapped.__wrapped__ is transfer  # type: ignore[attr-defined]
    assert inspect.signature(wrapped) == inspect.signature(transfer)
    assert wrapped(Account(1), Account(2), 7, note="x") == 7


def test_methods_use_self_attributes(manager: LockManager, key: str) -> None:
    class Wallet:
        def __init__(self, id: int) -> None:
            self.id = id

        @manager.locked(key + ":wallet:{self.id}")
        def spend(self, amount: int) -> list[str]:
            """Spend from this wallet."""
            return held_keys(manager)

        @manager.locked(key + ":cls:{tag}")
        @classmethod
        def audit(cls, tag: str) -> list[str]:
            return held_keys(manager)

        @classmethod
        @manager.locked(key + ":cls2:{tag}")
        def audit2(cls, tag: str) -> tuple[type, list[str]]:
            return cls, held_keys(manager)

        @manager.locked(key + ":static:{n}")
        @staticmethod
        def helper(n: int) -> list[str]:
            return held_keys(manager)

    w = Wallet(3)
    assert w.spend(5) == [f"{key}:wallet:3"]
    assert Wallet.spend(w, 5) == [f"{key}:wallet:3"]
    assert Wallet.spend.__doc__ == "Spend from this wallet."
    assert list(inspect.signature(w.spend).parameters) == ["amount"]
    assert Wallet.audit("t") == [f"{key}:cls:t"]
    assert Wallet.audit2("u") == (Wallet, [f"{key}:cls2:u"])
    assert w.helper(9) == [f"{key}:static:9"]
    assert held_keys(manager) == []


def test_bound_method_can_be_decorated(manager: LockManager, key: str) -> None:
    class Job:
        def run(self, n: int) -> list[str]:
            return held_keys(manager)

    run = manager.locked(key + ":{n}")(Job().run)
    assert run(4) == [f"{key}:4"]


def test_template_list_takes_every_key(make_manager: Any, key: str) -> None:
    a, b = make_manager(), make_manager()

    @b.locked([key + ":{dst.id}", key + ":{src.id}"], blocking=False)
    def transfer(src: Account, dst: Account) -> list[str]:
        return held_keys(b)

    assert transfer(Account(2), Account(1)) == [f"{key}:1", f"{key}:2"]
    assert transfer(Account(1), Account(1)) == [f"{key}:1"]  # one key, taken once
    with a.lock(f"{key}:2"), pytest.raises(LockBusy):
        transfer(Account(1), Account(2))
    assert row_of(b, f"{key}:1") is None  # released again when :2 was busy


def test_callable_may_return_several_keys(manager: LockManager, key: str) -> None:
    @manager.locked(lambda order: [f"{key}:sku:{sku}" for sku in order])
    def reserve(order: list[str]) -> list[str]:
        return held_keys(manager)

    assert reserve(["b", "a", "b"]) == [f"{key}:sku:a", f"{key}:sku:b"]

    @manager.locked(lambda order: [])
    def nothing(order: list[str]) -> None: ...

    with pytest.raises(LockArgumentError, match="at least one key"):
        nothing([])


def test_generators_and_coroutines_are_refused(manager: LockManager, key: str) -> None:
    with pytest.raises(LockArgumentError, match="generator"):

        @manager.locked(key + ":{n}")
        def gen(n: int) -> Any:
            yield n

    with pytest.raises(LockArgumentError, match="coroutine"):

        @manager.locked(key + ":{n}")
        async def coro(n: int) -> None: ...


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"blocking": "no"}, "blocking"),
        ({"timeout": -1}, "timeout"),
        ({"ttl": 0}, "ttl"),
    ],
)
def test_bad_options_are_refused_at_decoration(
    manager: LockManager, key: str, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(LockArgumentError, match=message):
        manager.locked(key + ":{n}", **options)


def test_bad_spec_is_refused(manager: LockManager) -> None:
    with pytest.raises(LockArgumentError, match="format string"):
        manager.locked(42)(lambda n: n)  # type: ignore[arg-type]
    with pytest.raises(LockArgumentError, match="format string"):
        manager.locked([])(lambda n: n)


def test_decorated_calls_exclude_each_other(manager: LockManager, key: str) -> None:
    inside: list[int] = []
    overlaps = 0
    guard = threading.Lock()

    @manager.locked(key + ":{user_id}", timeout=60)
    def work(user_id: int) -> None:
        nonlocal overlaps
        with guard:
            inside.append(user_id)
            if inside.count(user_id) > 1:
                overlaps += 1
        threading.Event().wait(0.002)
        with guard:
            inside.remove(user_id)

    threads = [threading.Thread(target=lambda: [work(1) for _ in range(10)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == 0


def test_fixed_key_needs_a_callable(make_manager: Any, key: str) -> None:
    a, b = make_manager(), make_manager()
    with pytest.raises(LockArgumentError, match="names no argument"):
        b.locked(key)(lambda: None)

    @b.locked(lambda: key, timeout=0.1)
    def fixed() -> None: ...

    with a.lock(key), pytest.raises(LockTimeout):
        fixed()


def test_lease_options_pass_through(manager: LockManager, key: str) -> None:
    seen: list[tuple[bool, float | None]] = []

    @manager.locked(key + ":{n}", renew=False, max_hold=7)
    def one(n: int) -> None:
        held = manager._locker.registry._entries[f"{key}:{n}"].held()
        seen.append((held.renew, held.max_hold))

    @manager.locked([key + ":a{n}", key + ":b{n}"], renew=False)
    def two(n: int) -> None:
        for k in (f"{key}:a{n}", f"{key}:b{n}"):
            seen.append((manager._locker.registry._entries[k].held().renew, None))

    one(1)
    two(1)
    assert seen == [(False, 7.0), (False, None), (False, None)]
    with pytest.raises(LockArgumentError, match="max_hold"):
        manager.locked(key + ":{n}", max_hold=0)
    with pytest.raises(LockArgumentError, match="on_lost"):
        manager.locked(key + ":{n}", on_lost=3)  # type: ignore[arg-type]
