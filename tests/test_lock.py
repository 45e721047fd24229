"""The two-level lock, on every database (parametrised by the ``db`` fixture)."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

import pytest

from dblock import LockBusy, LockLost, LockManager, LockNotHeld, LockTimeout
from tests.conftest import ALSO_PG18, row_of, wait_queued

# The core lock tests also run on PostgreSQL 18 (tests/conftest.py).
pytestmark = pytest.mark.databases(*ALSO_PG18)


def test_lock_yields_held_lock_and_releases_row(manager: LockManager, key: str) -> None:
    with manager.lock(key) as held:
        assert held.key == key
        assert len(held.token) == 32
        assert held.fence > 0
        assert held.expires_at.tzinfo is not None
        row = row_of(manager, key)
        assert row is not None
        assert row.token == held.token
        assert row.fence == held.fence
    assert held.released
    assert row_of(manager, key) is None


def test_lease_comes_from_database_clock(manager: LockManager, key: str) -> None:
    with manager.lock(key, ttl=120) as held:
        row = row_of(manager, key)
        assert row is not None
        lease = (row.expires_at - row.acquired_at).total_seconds()
        assert lease == pytest.approx(120, abs=0.01)
        assert abs((held.expires_at - row.expires_at).total_seconds()) < 1.0
        # The database's clock and ours agree on this machine; a lease that
        # ended up hours off would mean a time zone mix-up.
        assert abs((row.acquired_at - datetime.now(timezone.utc)).total_seconds()) < 60
        assert 119 < held.remaining <= 120


def test_fail_fast_across_managers_is_level_2(make_manager: object, key: str) -> None:
    a, b = make_manager(), make_manager()  # type: ignore[operator]
    with a.lock(key):
        with pytest.raises(LockBusy) as info, b.lock(key, blocking=False):
            pass
        assert info.value.level == 2
        assert info.value.key == key
        assert info.value.holder is not None
        assert "MainThread" in info.value.holder
    with b.lock(key, blocking=False):
        pass


def test_fail_fast_in_same_process_is_level_1(manager: LockManager, key: str) -> None:
    errors: list[LockBusy] = []

    def other() -> None:
        try:
            with manager.lock(key, blocking=False):
                pass
        except LockBusy as exc:
            errors.append(exc)

    with manager.lock(key):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert len(errors) == 1
    assert errors[0].level == 1


def test_reentrant_per_thread(manager: LockManager, key: str) -> None:
    with manager.lock(key) as outer:
        with manager.lock(key) as inner, manager.lock(key, blocking=False) as third:
            assert inner is outer is third
        assert not outer.released
        assert row_of(manager, key) is not None
    assert outer.released
    assert row_of(manager, key) is None


def test_release_twice_is_an_error(manager: LockManager, key: str) -> None:
    held = manager.acquire(key)
    assert held.release() is True
    with pytest.raises(LockNotHeld):
        held.release()


def test_timeout_when_held_elsewhere(make_manager: object, key: str) -> None:
    a, b = make_manager(), make_manager()  # type: ignore[operator]
    with a.lock(key):
        start = time.monotonic()
        with pytest.raises(LockTimeout) as info, b.lock(key, timeout=0.3):
            pass
        waited = time.monotonic() - start
    assert info.value.level == 2
    assert info.value.timeout == 0.3
    # Honoured to within a poll interval (poll_max), plus scheduling slack.
    assert 0.3 <= waited < 0.3 + b.config.poll_max + 1.0


def test_timeout_zero_tries_once(make_manager: object, key: str) -> None:
    a, b = make_manager(), make_manager()  # type: ignore[operator]
    with a.lock(key), pytest.raises(LockTimeout), b.lock(key, timeout=0):
        pass
    with b.lock(key, timeout=0):
        pass


def test_local_waiter_times_out_at_level_1(manager: LockManager, key: str) -> None:
    errors: list[LockTimeout] = []

    def other() -> None:
        try:
            with manager.lock(key, timeout=0.2):
                pass
        except LockTimeout as exc:
            errors.append(exc)

    with manager.lock(key):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert [e.level for e in errors] == [1]
    assert len(manager._locker.registry) == 0


def test_waiter_gets_lock_when_released_in_other_manager(make_manager: object, key: str) -> None:
    a, b = make_manager(), make_manager()  # type: ignore[operator]
    got: list[int] = []
    holder = a.acquire(key)

    def waiter() -> None:
        with b.lock(key, timeout=30) as held:
            got.append(held.fence)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    assert not got
    holder.release()
    t.join(30)
    assert len(got) == 1
    assert got[0] > holder.fence


def test_expired_row_is_taken_over(make_manager: object, key: str) -> None:
    a, b = make_manager(), make_manager()  # type: ignore[operator]
    stale = a.acquire(key, ttl=0.3, renew=False)
    time.sleep(0.4)
    with b.lock(key, blocking=False) as fresh:
        assert fresh.fence > stale.fence
        # The stale holder's release must not delete the new owner's row.
        with pytest.raises(LockLost) as info:
            stale.release()
        assert info.value.key == key
        row = row_of(b, key)
        assert row is not None
        assert row.token == fresh.token
    assert row_of(b, key) is None


def test_waiter_takes_over_at_holder_expiry(make_manager: object, key: str) -> None:
    a, b = make_manager(), make_manager()  # type: ignore[operator]
    a.acquire(key, ttl=0.5, renew=False)  # never released or renewed: a "crashed" holder
    start = time.monotonic()
    with b.lock(key, timeout=10) as held:
        waited = time.monotonic() - start
        assert held.fence > 0
    assert waited < 5  # woken by the lease, not by the timeout


def test_lost_lock_raises_on_context_exit(make_manager: object, key: str) -> None:
    a, b = make_manager(), make_manager()  # type: ignore[operator]
    with pytest.raises(LockLost), a.lock(key, ttl=0.3, renew=False):
        time.sleep(0.4)
        b.acquire(key, blocking=False)


def test_error_in_body_wins_over_lost_lock(make_manager: object, key: str) -> None:
    a, b = make_manager(), make_manager()  # type: ignore[operator]
    with pytest.raises(ZeroDivisionError), a.lock(key, ttl=0.3, renew=False):
        time.sleep(0.4)
        b.acquire(key, blocking=False)
        1 / 0  # noqa: B018


def test_fence_strictly_increases(manager: LockManager, keys: object) -> None:
    fences = []
    for k in keys(5) * 3:  # type: ignore[operator]
        with manager.lock(k) as held:
            fences.append(held.fence)
    assert fences == sorted(fences)
    assert len(set(fences)) == len(fences)


def test_fence_grows_across_takeover(make_manager: object, key: str) -> None:
    a, b = make_manager(), make_manager()  # type: ignore[operator]
    first = a.acquire(key, ttl=0.2, renew=False)
    time.sleep(0.3)
    second = b.acquire(key)
    assert second.fence > first.fence
    second.release()


def test_local_waiters_are_fifo(manager: LockManager, key: str) -> None:
    order: list[int] = []
    holder = manager.acquire(key)
    threads = []
    for i in range(5):
        t = threading.Thread(target=lambda i=i: _hold_and_record(manager, key, order, i))
        t.start()
        threads.append(t)
        wait_queued(manager, key, i + 1)
    holder.release()
    for t in threads:
        t.join(30)
    assert order == [0, 1, 2, 3, 4]


def _hold_and_record(manager: LockManager, key: str, order: list[int], i: int) -> None:
    with manager.lock(key, timeout=30):
        order.append(i)


def test_handoff_gives_each_thread_a_new_fence(manager: LockManager, key: str) -> None:
    """Each local hand-off is a new acquisition: a fence greater than every
    earlier one of the key. The row keeps the token of the run's database
    acquisition (hand-offs from a fence reserve send no SQL). Its fence is
    never ahead of the holder's on PostgreSQL and SQLite; on MariaDB the
    reserve is drawn by the rows of one INSERT, each of which wrote its fence
    into the row, which so keeps the run's last one (never behind)."""
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def work() -> None:
        for _ in range(5):
            with manager.lock(key, timeout=30) as held:
                with lock:
                    seen.append((held.token, held.fence))
                row = row_of(manager, key)
                assert row is not None
                assert row.token == held.token
                if manager.engine.dialect.name == "mysql":
                    assert row.fence >= held.fence
                else:
                    assert row.fence <= held.fence
                if not manager.store.reserves_fences:
                    assert row.fence == held.fence

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(seen) == 20
    fences = [fence for _, fence in seen]
    assert fences == sorted(fences)
    assert len(set(fences)) == 20
    if not manager.store.reserves_fences:
        assert len({token for token, _ in seen}) == 20
    assert row_of(manager, key) is None
    assert len(manager._locker.registry) == 0


def test_threads_exclude_each_other(manager: LockManager, key: str) -> None:
    inside = 0
    most = 0
    guard = threading.Lock()

    def work() -> None:
        nonlocal inside, most
        for _ in range(10):
            with manager.lock(key, timeout=60):
                with guard:
                    inside += 1
                    most = max(most, inside)
                time.sleep(0.0005)
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert most == 1


def test_level1_off_sends_everything_to_the_database(
    make_manager: object, key: str, count_statements: object
) -> None:
    m = make_manager(local_filter=False)  # type: ignore[operator]
    with m.lock(key), pytest.raises(LockBusy) as info:
        # Same thread, no level 1: the database refuses (no re-entrancy).
        m.acquire(key, blocking=False)
    assert info.value.level == 2


def test_decorator_builds_key_from_arguments(manager: LockManager, key: str) -> None:
    seen: list[str] = []

    class Order:
        def __init__(self, id: int) -> None:
            self.id = id

    @manager.locked(key + ":{user_id}:{order.id}")
    def pay(user_id: int, order: Order, amount: int = 0) -> str:
        entry_keys = list(manager._locker.registry._entries)
        seen.extend(entry_keys)
        return f"paid {amount}"

    assert pay(42, Order(9001), amount=5) == "paid 5"
    assert seen == [f"{key}:42:9001"]
    assert pay.__name__ == "pay"


def test_decorator_with_callable_key(manager: LockManager, key: str) -> None:
    @manager.locked(lambda user_id, **_: f"{key}:{user_id}")
    def work(user_id: int) -> list[str]:
        return list(manager._locker.registry._entries)

    assert work(7) == [f"{key}:7"]


def test_decorator_fail_fast(make_manager: object, key: str) -> None:
    a, b = make_manager(), make_manager()  # type: ignore[operator]

    @b.locked(key + ":{n}", blocking=False)
    def work(n: int) -> None:
        pass

    with a.lock(f"{key}:1"), pytest.raises(LockBusy):
        work(1)
    work(2)
