"""Semaphores: at most N holders of a key across threads and processes."""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import threading
import time
from typing import Any

import pytest

from dblock import KindMismatch, LockArgumentError, LockBusy, LockLost, LockManager, LockTimeout
from dblock.kinds.semaphore import HeldPermit
from dblock.sweeper import Sweeper
from tests.support import sem_procs

ctx = multiprocessing.get_context("spawn")


def test_n_permits_then_busy(manager: LockManager, make_manager: Any, key: str) -> None:
    other: LockManager = make_manager()
    with manager.semaphore(key, permits=2) as a, manager.semaphore(key, permits=2) as b:
        assert isinstance(a, HeldPermit)
        assert {a.slot, b.slot} == {"p0", "p1"}
        assert (a.permits, b.permits) == (2, 2)
        assert b.fence > a.fence
        assert a.key == b.key == key
        # Level 1: this process already has N requests out; no SQL.
        with pytest.raises(LockBusy) as local:
            manager.semaphore(key, permits=2, blocking=False).__enter__()
        assert local.value.level == 1
        assert local.value.key == key
        # Level 2: another process finds every permit held.
        with pytest.raises(LockBusy) as remote:
            other.semaphore(key, permits=2, blocking=False).__enter__()
        assert remote.value.level == 2
        rows = manager.store.rows(key=key)
        assert sorted((r.slot, r.kind, r.mode, r.permits) for r in rows) == [
            ("p0", "semaphore", "permit", 2),
            ("p1", "semaphore", "permit", 2),
        ]
    with other.semaphore(key, permits=2, blocking=False) as c:
        assert c.fence > b.fence
    assert manager.store.rows(key=key) == []


def test_fail_fast_sends_no_statement_when_local_permits_are_out(
    manager: LockManager, key: str, count_statements: Any
) -> None:
    with manager.semaphore(key, permits=1):
        with count_statements(manager.engine) as counter, pytest.raises(LockBusy):
            manager.semaphore(key, permits=1, blocking=False).__enter__()
        assert counter.count == 0


def test_uncontended_grant_and_release_are_one_statement_each(
    manager: LockManager, key: str, count_statements: Any
) -> None:
    with manager.semaphore(key, permits=3):  # warm: capabilities, first connection
        pass
    with count_statements(manager.engine) as counter:
        permit = manager.semaphore(key, permits=3).__enter__()
        assert counter.count == 1
        permit.release()
        assert counter.count == 2


def test_another_n_or_kind_is_refused(manager: LockManager, make_manager: Any, key: str) -> None:
    other: LockManager = make_manager()
    with manager.semaphore(key, permits=2):
        with pytest.raises(KindMismatch, match=r"semaphore\(2\).*semaphore\(3\)"):
            manager.semaphore(key, permits=3).__enter__()
        with pytest.raises(KindMismatch, match=r"semaphore\(2\).*semaphore\(3\)"):
            other.semaphore(key, permits=3, blocking=False).__enter__()
        with pytest.raises(KindMismatch, match="exclusive"):
            manager.lock(key, blocking=False).__enter__()
    with manager.lock(key):
        with pytest.raises(KindMismatch, match=r"exclusive.*semaphore\(2\)"):
            manager.semaphore(key, permits=2).__enter__()
        with pytest.raises(KindMismatch, match=r"exclusive.*semaphore\(2\)"):
            other.semaphore(key, permits=2, blocking=False).__enter__()
    # Nobody uses it any more: another N is fine now.
    with manager.semaphore(key, permits=5) as p:
        assert p.permits == 5


@pytest.mark.databases("sqlite", "postgresql")
def test_an_exclusive_request_sees_permits_in_the_table(
    manager: LockManager, make_manager: Any, key: str
) -> None:
    other: LockManager = make_manager()
    with manager.semaphore(key, permits=2), pytest.raises(KindMismatch, match="semaphore"):
        other.lock(key, blocking=False).__enter__()


@pytest.mark.parametrize("permits", [0, -1, 1.5, True, "2", 10_001])
def test_bad_permits_are_refused_before_any_sql(manager: LockManager, permits: Any) -> None:
    with pytest.raises(LockArgumentError, match="permits"):
        manager.semaphore("k", permits=permits)


def test_a_waiter_gets_the_permit_released(
    manager: LockManager, make_manager: Any, key: str
) -> None:
    other: LockManager = make_manager()
    first = other.semaphore(key, permits=1).__enter__()
    got: queue.Queue[object] = queue.Queue()

    def wait() -> None:
        try:
            with manager.semaphore(key, permits=1, timeout=60) as permit:
                got.put(permit.fence)
        except Exception as exc:  # reported to the test thread
            got.put(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    first.release()
    fence = got.get(timeout=60)
    waiter.join(60)
    assert isinstance(fence, int)
    assert fence > first.fence


def test_local_waiters_queue_and_never_exceed_n(manager: LockManager, key: str) -> None:
    n, threads, rounds = 2, 6, 5
    inside = 0
    most = 0
    mutex = threading.Lock()
    errors: list[BaseException] = []

    def work() -> None:
        nonlocal inside, most
        try:
            for _ in range(rounds):
                with manager.semaphore(key, permits=n, timeout=60):
                    with mutex:
                        inside += 1
                        most = max(most, inside)
                    time.sleep(0.001)
                    with mutex:
                        inside -= 1
        except BaseException as exc:
            errors.append(exc)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(120)
    assert errors == []
    assert 1 <= most <= n


def test_timeout_names_the_key(manager: LockManager, make_manager: Any, key: str) -> None:
    other: LockManager = make_manager()
    with other.semaphore(key, permits=1):
        with pytest.raises(LockTimeout) as waited:
            manager.semaphore(key, permits=1, timeout=0.2).__enter__()
        assert waited.value.key == key


def test_decorator(manager: LockManager, key: str) -> None:
    @manager.semaphore(key, permits=2)
    def work(x: int) -> list[str]:
        return [r.slot for r in manager.store.rows(key=key)] + [str(x)]

    assert work(7) == ["p0", "7"]
    assert work(8) == ["p0", "8"]
    assert manager.store.rows(key=key) == []


def test_lost_permit_is_reported_and_taken_over(private: LockManager, make_manager: Any) -> None:
    key = "sem:lost"
    lost = threading.Event()
    permit = private.semaphore(key, permits=1, ttl=0.3, renew=False, on_lost=lambda h: lost.set())
    held = permit.__enter__()
    assert lost.wait(30)  # the lease ran out unrenewed: on_lost is told
    assert held.lost
    other: LockManager = make_manager(table=private.names.table)
    with other.semaphore(key, permits=1, timeout=30) as taker:
        assert taker.fence > held.fence
        assert taker.slot == held.slot
        with pytest.raises(LockLost):
            held.release()


def test_extend_renews_one_permit(manager: LockManager, key: str) -> None:
    with manager.semaphore(key, permits=2, renew=False, ttl=5) as permit:
        before = permit.expires_at
        permit.extend(60)
        assert permit.expires_at > before
        (row,) = manager.store.rows(key=key)
        assert row.expires_at == permit.expires_at or abs(row.lease_left - 60) < 30


def test_sweeper_removes_expired_permits(private: LockManager) -> None:
    key = "sem:swept"
    held = private.semaphore(key, permits=2, ttl=0.2).__enter__()
    deadline = time.monotonic() + 30
    while private.store.stats().expired == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    result = Sweeper(private, grace=0).run_once()
    assert result.expired == 1
    assert private.store.rows() == []
    with pytest.raises(LockLost):
        held.release()


# -- across processes -----------------------------------------------------------


def test_processes_never_exceed_n(db_url: str, key: str) -> None:
    permits, processes, threads, rounds = 2, 4, 3, 6
    sem_procs.reset_inside(db_url)
    go, out = ctx.Event(), ctx.Queue()
    workers = [
        ctx.Process(
            target=sem_procs.occupancy_worker,
            args=(db_url, key, key, permits, threads, rounds, go, out),
        )
        for _ in range(processes)
    ]
    for w in workers:
        w.start()
    go.set()
    results = [out.get(timeout=300) for _ in workers]
    for w in workers:
        w.join(60)
        assert w.exitcode == 0
    most = max(m for m, _ in results)
    fences = [f for _, fs in results for f in fs]
    assert 1 <= most <= permits
    assert len(fences) == processes * threads * rounds
    assert len(set(fences)) == len(fences)


def test_killed_holders_permits_are_taken_over(db_url: str, key: str) -> None:
    permits = 3
    report = ctx.Queue()
    holders = [
        ctx.Process(target=sem_procs.hold_permit, args=(db_url, key, permits, 1.5, report))
        for _ in range(permits)
    ]
    for h in holders:
        h.start()
    try:
        granted = [report.get(timeout=60) for _ in holders]
        assert sorted(s for s, _ in granted) == ["p0", "p1", "p2"]
        with LockManager(db_url) as m:
            with pytest.raises(LockBusy):
                m.semaphore(key, permits=permits, blocking=False).__enter__()
            victim = holders[0]
            os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
            victim.join(10)
            with m.semaphore(key, permits=permits, timeout=30) as taker:
                assert taker.fence > max(f for _, f in granted)
                # Still exactly N: the two live holders and us.
                assert len(m.store.rows(key=key)) == permits
                with LockManager(db_url) as other, pytest.raises(LockBusy):
                    other.semaphore(key, permits=permits, blocking=False).__enter__()
    finally:
        for h in holders:
            if h.is_alive():
                h.kill()
                h.join(10)


def test_a_paused_holder_loses_its_permit(db_url: str, key: str) -> None:
    permits = 2
    report = ctx.Queue()
    holders = [
        ctx.Process(target=sem_procs.hold_permit, args=(db_url, key, permits, 1.0, report))
        for _ in range(permits)
    ]
    for h in holders:
        h.start()
    paused = holders[0]
    try:
        granted = dict(report.get(timeout=60) for _ in holders)
        os.kill(paused.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        # The paused holder cannot renew: its permit is taken after the lease.
        with LockManager(db_url) as m, m.semaphore(key, permits=permits, timeout=30) as taker:
            assert taker.fence > max(granted.values())
            os.kill(paused.pid, signal.SIGCONT)  # type: ignore[arg-type]
            # It learns that it lost the permit (its renewal finds the row gone).
            what, fence = report.get(timeout=60)
            assert what == "lost"
            assert fence in granted.values()
            assert len(m.store.rows(key=key)) == permits
    finally:
        for h in holders:
            with_signal = h.is_alive()
            if with_signal:
                os.kill(h.pid, signal.SIGCONT)  # type: ignore[arg-type]
                h.kill()
                h.join(10)


@pytest.fixture(autouse=True)
def _quiet_children(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")


# -- asyncio ----------------------------------------------------------------------


def test_async_semaphore(db_url: str, make_manager: Any, key: str) -> None:
    import asyncio

    from dblock import AsyncLockManager

    other: LockManager = make_manager()

    async def main() -> None:
        alocks = AsyncLockManager(db_url)
        try:
            async with alocks.semaphore(key, permits=2) as a, alocks.semaphore(key, permits=2) as b:
                assert {a.slot, b.slot} == {"p0", "p1"}
                assert b.fence > a.fence
                with pytest.raises(LockBusy) as busy:
                    await alocks.semaphore(key, permits=2, blocking=False).__aenter__()
                assert busy.value.level == 1
                with pytest.raises(KindMismatch):
                    await alocks.semaphore(key, permits=3).__aenter__()
            # Waiting: a permit held by another process comes free.
            held = other.semaphore(key, permits=1).__enter__()

            async def wait() -> int:
                async with alocks.semaphore(key, permits=1, timeout=60) as permit:
                    return int(permit.fence)

            waiter = asyncio.ensure_future(wait())
            await asyncio.sleep(0)
            held.release()
            assert await asyncio.wait_for(waiter, 60) > held.fence
            assert other.store.rows(key=key) == []
        finally:
            await alocks.close()

    asyncio.run(main())


def test_close_sends_a_permit_waiter_away_naming_the_key(make_manager: Any, key: str) -> None:
    """close() reaches a thread queued for a permit; its error names the
    semaphore's key (never the internal per-permit key) and no row stays."""
    from dblock import ManagerClosed
    from dblock.kinds.semaphore import local_key

    m = make_manager()
    held = m.semaphore(key, permits=1).__enter__()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            with m.semaphore(key, permits=1, timeout=60):
                pass
        except BaseException as exc:
            errors.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    registry = m._semaphores_().locker.registry
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        entry = registry.get(local_key(key, 1, 0))
        if entry is not None and entry.queue:
            break
        time.sleep(0.005)
    m.close()
    waiter.join(30)
    assert len(errors) == 1
    assert isinstance(errors[0], ManagerClosed)
    assert repr(key) in str(errors[0])
    assert "\x00" not in str(errors[0])
    assert held.lost
    with make_manager() as other, other.semaphore(key, permits=1, blocking=False) as again:
        assert again.slot == "p0"
