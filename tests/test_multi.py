"""Several keys at once: one deterministic order, all or nothing, one timeout,
and no deadlock between (A, B) and (B, A), with real threads and processes."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import pytest

from dblock import HeldLocks, LockArgumentError, LockBusy, LockManager, LockNotHeld, LockTimeout
from tests.conftest import row_of
from tests.support import procs
from tests.support.counting import StatementCounter

ctx = multiprocessing.get_context("spawn")


def test_keys_are_sorted_deduplicated_and_normalised(manager: LockManager, key: str) -> None:
    cafe_nfd = f"{key}:cafe\u0301"
    with manager.lock_many([f"{key}:b", f"{key}:a", f"{key}:b", cafe_nfd]) as held:
        assert isinstance(held, HeldLocks)
        assert list(held) == sorted([f"{key}:a", f"{key}:b", f"{key}:caf\u00e9"])
        assert held[cafe_nfd].key == f"{key}:caf\u00e9"  # looked up normalised
        fences = [lock.fence for lock in held.values()]
        assert fences == sorted(fences)  # taken one by one, in that order
        for k in held:
            assert row_of(manager, k).token == held[k].token  # type: ignore[union-attr]
    for k in held:
        assert row_of(manager, k) is None
    assert held.released


def test_acquire_many_and_release(manager: LockManager, keys: Any) -> None:
    a, b = keys(2)
    held = manager.acquire_many([b, a])
    assert len(held) == 2
    assert held.release() is True
    assert row_of(manager, a) is None
    assert row_of(manager, b) is None


def test_all_released_when_one_is_busy(make_manager: Any, keys: Any) -> None:
    a, b, c = keys(3)
    holder, m = make_manager(), make_manager()
    with holder.lock(c), pytest.raises(LockBusy) as info:
        m.acquire_many([a, b, c], blocking=False)
    assert info.value.key == c
    assert row_of(m, a) is None
    assert row_of(m, b) is None
    assert m._locker.registry._entries == {}


def test_one_overall_timeout(make_manager: Any, keys: Any) -> None:
    a, b = keys(2)
    holder, m = make_manager(), make_manager()
    with holder.lock(b):
        start = time.monotonic()
        with pytest.raises(LockTimeout) as info:
            m.acquire_many([a, b], timeout=0.5)
        waited = time.monotonic() - start
    assert info.value.key == b
    assert info.value.timeout == 0.5  # the caller's, not the remainder
    assert "0.5 s" in str(info.value)
    assert waited >= 0.45
    assert row_of(m, a) is None


def test_reentrant_with_held_key(manager: LockManager, keys: Any) -> None:
    a, b = keys(2)
    with manager.lock(a) as outer, manager.lock_many([a, b]) as both:
        assert both[a] is outer
    assert row_of(manager, a) is None
    assert row_of(manager, b) is None


@pytest.mark.parametrize(
    ("given", "message"),
    [
        pytest.param("user:1", "not a single str", id="str"),
        pytest.param([], "at least one key", id="empty"),
        pytest.param(["ok", ""], "must not be empty", id="bad-key"),
        pytest.param(["ok", 3], "must be a str", id="not-str"),
        pytest.param(5, "iterable of keys", id="int"),
    ],
)
def test_bad_input_refused_before_sql(manager: LockManager, given: Any, message: str) -> None:
    with StatementCounter(manager.engine) as counter:
        with pytest.raises(LockArgumentError, match=message):
            manager.lock_many(given)
        with pytest.raises(LockArgumentError, match=message):
            manager.acquire_many(given)
    assert counter.count == 0


def _opposite_orders(
    first: LockManager, second: LockManager, a: str, b: str, rounds: int
) -> tuple[list[BaseException], int]:
    errors: list[BaseException] = []
    inside: dict[str, int] = {a: 0, b: 0}
    overlaps = 0
    guard = threading.Lock()
    go = threading.Barrier(4)

    def work(manager: LockManager, order: list[str]) -> None:
        nonlocal overlaps
        go.wait()
        try:
            for _ in range(rounds):
                with manager.lock_many(order, timeout=60):
                    with guard:
                        for k in order:
                            inside[k] += 1
                            overlaps += inside[k] > 1
                    time.sleep(0.001)
                    with guard:
                        for k in order:
                            inside[k] -= 1
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=work, args=(first, [a, b])),
        threading.Thread(target=work, args=(first, [b, a])),
        threading.Thread(target=work, args=(second, [a, b])),
        threading.Thread(target=work, args=(second, [b, a])),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return errors, overlaps


def test_opposite_orders_do_not_deadlock_threads(make_manager: Any, keys: Any) -> None:
    """Threads of two managers (level 1 within each, level 2 between them)
    ask for (A, B) and (B, A) over and over."""
    a, b = keys(2)
    errors, overlaps = _opposite_orders(make_manager(), make_manager(), a, b, rounds=15)
    assert errors == []
    assert overlaps == 0


@pytest.mark.databases("postgresql")
def test_control_naive_order_does_deadlock(make_manager: Any, keys: Any) -> None:
    """The same two requests taking their keys in the order given, each
    holding its first key while asking for the second: they wait for each
    other until both time out. This is what lock_many's order prevents."""
    a, b = keys(2)
    m1, m2 = make_manager(), make_manager()
    both_hold_one = threading.Barrier(2)
    both_decided = threading.Barrier(2)
    outcome: list[str] = []

    def naive(manager: LockManager, first: str, second: str) -> None:
        with manager.lock(first):
            both_hold_one.wait()
            try:
                with manager.lock(second, timeout=1.0):
                    outcome.append("got both")
            except LockTimeout:
                outcome.append("timeout")
            both_decided.wait(30)  # keep the first key until both gave up

    threads = [
        threading.Thread(target=naive, args=(m1, a, b)),
        threading.Thread(target=naive, args=(m2, b, a)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcome == ["timeout", "timeout"]


@pytest.mark.slow
def test_opposite_orders_do_not_deadlock_processes(db_url: str, keys: Any) -> None:
    """Spawned processes with several threads each take (A, B, C) in
    opposite orders; every counter comes out exact and nobody times out."""
    names = keys(3)
    prefix = names[0].rsplit(":", 1)[0]
    for k in names:
        procs.reset_counter(db_url, f"{prefix}:{k}")
    go = ctx.Event()
    workers = [
        ctx.Process(target=procs.many_worker, args=(db_url, names, prefix, 2, 6, reverse, go))
        for reverse in (False, True, False, True)
    ]
    for w in workers:
        w.start()
    go.set()
    for w in workers:
        w.join(300)
    assert [w.exitcode for w in workers] == [0, 0, 0, 0]
    for k in names:
        assert procs.read_counter(db_url, f"{prefix}:{k}") == 4 * 2 * 6


def test_lease_options_reach_every_key(manager: LockManager, keys: Any) -> None:
    a, b = keys(2)
    with manager.lock_many([a, b], renew=False, max_hold=5) as held:
        assert [(lock.renew, lock.max_hold) for lock in held.values()] == [(False, 5.0)] * 2
    with pytest.raises(LockArgumentError, match="max_hold"):
        manager.lock_many([a], max_hold=-1)
    with pytest.raises(LockArgumentError, match="renew"):
        manager.acquire_many([a], renew="yes")  # type: ignore[arg-type]


def test_a_release_refused_to_another_thread_releases_none_of_them(
    manager: LockManager, keys: Any
) -> None:
    """Another thread's ``release()`` of the locks is refused for the first
    one it tries, and must not hand the others to the renewal thread either
    (an interrupted release does that; a refused one is no release at all)."""
    names = keys(3)
    held = manager.acquire_many(names)
    errors: list[BaseException] = []

    def other() -> None:
        try:
            held.release()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=other)
    t.start()
    t.join(10)
    assert len(errors) == 1
    assert isinstance(errors[0], LockNotHeld)
    manager._locker.renewer.run_jobs()  # any release posted to the renewal thread: done now
    assert all(row_of(manager, k) is not None for k in names)
    assert all(h.owned() for h in held.values())
    held.release()
    assert all(row_of(manager, k) is None for k in names)
