"""PostgreSQL: local hand-offs from a fence reserve.

When a holder releases a key other threads of its process are queued for,
the first hand-off of a run is one UPDATE that gives the row a new token,
fence and lease and draws, under the row's lock, fences for the hand-offs
that may follow (a run is ``handoff_limit`` grants, the row's own among
them); those follow without SQL. The row and
its token stay the run's; each holder still gets a fence of its own, greater
than every fence the key had before, and smaller than the fence of anyone
who takes the key after the run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from dblock import LockLost, LockManager
from dblock.lock import HeldLock
from tests.conftest import row_of, wait_queued

pytestmark = pytest.mark.databases("postgresql")


def _queue(
    manager: LockManager, key: str, n: int, body: Callable[[int, HeldLock], None], **kw: object
) -> list[threading.Thread]:
    """``n`` threads queued behind the current holder, in order; each runs ``body``."""
    threads = []
    for i in range(n):

        def work(i: int = i) -> None:
            with manager.lock(key, timeout=30, **kw) as held:  # type: ignore[arg-type]
                body(i, held)

        t = threading.Thread(target=work, name=f"waiter-{i}")
        t.start()
        threads.append(t)
        wait_queued(manager, key, i + 1)
    return threads


def test_a_run_of_handoffs_costs_one_statement(
    manager: LockManager, key: str, count_statements: type
) -> None:
    seen: list[tuple[str, int]] = []
    with count_statements(manager.engine) as counter:
        holder = manager.acquire(key, ttl=60)
        threads = _queue(
            manager, key, 5, lambda i, held: seen.append((held.token, held.fence)), ttl=60
        )
        counter.reset()
        holder.release()
        for t in threads:
            t.join(30)
        # The transfer to the first waiter, then the last one's DELETE.
        assert counter.count == 2
    fences = [fence for _, fence in seen]
    assert len(seen) == 5
    assert fences == sorted(fences)
    assert len(set(fences)) == 5
    assert fences[0] > holder.fence
    # One database acquisition (the transfer): one token for the run.
    assert {token for token, _ in seen} == {seen[0][0]}
    assert seen[0][0] != holder.token
    assert row_of(manager, key) is None


def test_a_waiter_asking_for_another_lease_gets_its_own_transfer(
    manager: LockManager, key: str
) -> None:
    seen: list[HeldLock] = []
    holder = manager.acquire(key, ttl=60)
    first = _queue(manager, key, 1, lambda i, held: seen.append(held), ttl=60)
    second = _queue(manager, key, 1, lambda i, held: seen.append(held), ttl=45)
    wait_queued(manager, key, 2)
    holder.release()
    for t in first + second:
        t.join(30)
    assert [h.ttl for h in seen] == [60, 45]
    # A new lease length is a statement: a token (and lease) of its own.
    assert seen[0].token != seen[1].token
    assert holder.fence < seen[0].fence < seen[1].fence


def test_a_takeover_fences_above_the_whole_reserve(
    manager: LockManager, make_manager: Callable[[], LockManager], key: str
) -> None:
    """The row expires under a run (a clock step on the server, a forced
    release): whoever takes the key gets a fence above every fence the run
    drew, so downstream systems reject the run's holders from then on, and
    the run's next release to the database finds the row gone and says so."""
    other = make_manager()
    got: dict[str, HeldLock] = {}
    outcome: dict[str, object] = {}
    taken_over = threading.Event()

    def first() -> None:
        held = manager.acquire(key, timeout=30, ttl=60)
        got["first"] = held
        assert taken_over.wait(30)
        held.release()  # to the second thread, from the reserve: its lease looks whole

    def second() -> None:
        held = manager.acquire(key, timeout=30, ttl=60)
        got["second"] = held
        try:
            outcome["release"] = held.release()
        except LockLost as exc:
            outcome["release"] = exc

    holder = manager.acquire(key, ttl=60)
    a = threading.Thread(target=first)
    a.start()
    wait_queued(manager, key, 1)
    holder.release()
    deadline = time.monotonic() + 30
    while "first" not in got and time.monotonic() < deadline:
        time.sleep(0.001)
    reserve = got["first"].state.reserve
    # A run is handoff_limit grants: the row's own, this hand-off, and the
    # rest, whose fences this hand-off drew.
    assert len(reserve) == manager.config.handoff_limit - 2
    assert min(reserve) > got["first"].fence
    table = manager.store.table
    with manager.engine.begin() as conn:
        conn.execute(
            table.update()
            .where(table.c.lock_key == key)
            .values(expires_at=sa.func.now() - sa.text("interval '1 second'"))
        )
    taken = other.acquire(key, blocking=False)
    assert taken.fence > max(reserve)
    b = threading.Thread(target=second)
    b.start()
    wait_queued(manager, key, 1)
    taken_over.set()
    a.join(30)
    b.join(30)
    assert got["second"].fence == reserve[0] < taken.fence
    assert isinstance(outcome["release"], LockLost)
    row = row_of(other, key)
    assert row is not None
    assert row.token == taken.token
    taken.release()
