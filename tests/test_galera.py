"""dblock on a 3-node MariaDB Galera cluster: managers on different nodes.

Galera certifies each transaction against the others cluster-wide at commit;
the loser of a race is rolled back. With the server default
``wsrep_retry_autocommit=1`` the loser's autocommit statement is silently run
again after its (rolled back) ``INSERT … RETURNING`` rows already reached the
client, so both racers were told they won. These tests race managers on
different nodes for the same keys.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from dblock import LockBusy, LockLost, LockManager
from tests.support.servers import PrivateGalera

pytestmark = pytest.mark.cluster


@pytest.fixture
def node_managers(galera: PrivateGalera) -> Iterator[list[LockManager]]:
    """One manager per node, each in its own process's place: no level 1 shared."""
    managers = [LockManager(url, renew=False) for url in galera.urls]
    yield managers
    for m in managers:
        m.close()


def _prefix() -> str:
    return f"galera:{uuid.uuid4().hex[:10]}"


def test_galera_is_detected(node_managers: list[LockManager], key: str) -> None:
    with node_managers[0].lock(key, blocking=False):
        pass
    assert getattr(node_managers[0].store, "galera", None) is True


def test_racing_nodes_have_one_winner_and_losers_are_busy(
    node_managers: list[LockManager],
) -> None:
    prefix = _prefix()
    rounds = 60
    outcomes: dict[int, list[object]] = {i: [] for i in range(rounds)}
    barrier = threading.Barrier(len(node_managers))
    mutex = threading.Lock()
    lost_at_release = 0

    def racer(manager: LockManager) -> None:
        nonlocal lost_at_release
        held = []
        for r in range(rounds):
            barrier.wait()
            try:
                lock = manager.acquire(f"{prefix}:{r}", blocking=False, ttl=60)
            except LockBusy:
                outcome: object = "busy"
            except Exception as exc:  # a BackendError here is the bug being tested
                outcome = exc
            else:
                outcome = "won"
                held.append(lock)
            with mutex:
                outcomes[r].append(outcome)
        for lock in held:  # each by the thread that holds it
            try:
                lock.release()
            except LockLost:  # a second "winner" whose row was never its own
                with mutex:
                    lost_at_release += 1

    threads = [threading.Thread(target=racer, args=(m,)) for m in node_managers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    errors = [o for os_ in outcomes.values() for o in os_ if isinstance(o, Exception)]
    assert errors == []
    doubles = {r: os_ for r, os_ in outcomes.items() if os_.count("won") != 1}
    assert doubles == {}, f"{len(doubles)} of {rounds} keys had not exactly one winner"
    assert lost_at_release == 0


def test_fence_grows_per_key_when_holders_alternate_nodes(
    node_managers: list[LockManager],
) -> None:
    """Successive holders of one key, each acquiring through another node
    than the last, and contending: every holder's fence is greater than the
    previous holder's."""
    key = f"{_prefix()}:hot"
    fences: list[int] = []
    inside = threading.Lock()
    overlaps = []
    stop = time.monotonic() + 5

    def worker(manager: LockManager) -> None:
        while time.monotonic() < stop:
            with manager.lock(key, timeout=30, ttl=30) as held:
                if not inside.acquire(blocking=False):
                    overlaps.append(held.fence)
                    continue
                try:
                    fences.append(held.fence)
                finally:
                    inside.release()

    threads = [threading.Thread(target=worker, args=(m,)) for m in node_managers for _ in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps == []
    assert len(fences) > 10
    assert all(a < b for a, b in itertools.pairwise(fences)), fences


def test_fence_grows_across_keys_and_nodes(node_managers: list[LockManager]) -> None:
    """Any acquisition that starts after another one was granted, on any key
    and any node, gets a larger fence (docs/internals.md, Fencing). Galera hands out
    AUTO_INCREMENT per node (offset n, increment 3); without a causality wait
    a node that has not yet applied another node's insert can hand out a
    smaller value."""
    prefix = _prefix()
    granted_max = 0
    mutex = threading.Lock()
    violations = []
    stop = time.monotonic() + 5

    def worker(n: int, manager: LockManager) -> None:
        nonlocal granted_max
        i = 0
        while time.monotonic() < stop:
            with mutex:
                floor = granted_max
            held = manager.acquire(f"{prefix}:{n}:{i}", blocking=False, ttl=30)
            with mutex:
                if held.fence <= floor:
                    violations.append((floor, held.fence))
                granted_max = max(granted_max, held.fence)
            held.release()
            i += 1

    threads = [threading.Thread(target=worker, args=(n, m)) for n, m in enumerate(node_managers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert violations == []


def test_sweep_through_another_node(galera: PrivateGalera) -> None:
    """The sweeper's DELETE … RETURNING runs on Galera (with the same
    no-silent-retry setting as the INSERT) and removes an expired row that
    another node wrote (as a crashed holder leaves it)."""
    import sqlalchemy as sa

    from dblock._store.admin import SweepReason

    table = f"dblock_sweep_{uuid.uuid4().hex[:8]}"
    sweeper = LockManager(galera.urls[1], table=table)
    writer = sa.create_engine(galera.urls[0], isolation_level="AUTOCOMMIT")
    try:
        sweeper.create_schema()
        key = f"{_prefix()}:expired"
        with writer.connect() as conn:
            conn.exec_driver_sql(
                f"INSERT INTO {table} (lock_key, owner, token, acquired_at, expires_at) "
                "VALUES (%s, 'crashed', 'tok', UTC_TIMESTAMP(6) - INTERVAL 2 SECOND, "
                "UTC_TIMESTAMP(6) - INTERVAL 1 SECOND)",
                (key,),
            )
        swept = sweeper.store.sweep(SweepReason.EXPIRED, older_than=0.0, limit=10)
        assert [row.key for row in swept] == [key]
    finally:
        writer.dispose()
        sweeper.drop_schema()
        sweeper.close()


def test_semaphore_across_nodes(node_managers: list[LockManager], key: str) -> None:
    """N = 2 permits, asked for through all three nodes: two granted, the
    third busy; fences grow per key whichever node writes the row."""
    first, second, third = node_managers
    a = first.semaphore(key, permits=2).__enter__()
    b = second.semaphore(key, permits=2).__enter__()
    assert {a.slot, b.slot} == {"p0", "p1"}
    assert b.fence > a.fence
    with pytest.raises(LockBusy):
        third.semaphore(key, permits=2, blocking=False).__enter__()
    a.release()
    with third.semaphore(key, permits=2, timeout=30) as c:
        assert c.fence > b.fence
    b.release()
