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
from typing import Any

import pytest

from dblock import LockBusy, LockLost, LockManager
from tests.support.kinds import KINDS, locked
from tests.support.servers import PrivateGalera
from tests.support.stall import AutoIncrementStall, unavailable

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


def test_rw_writer_and_readers_on_other_nodes_never_overlap(
    node_managers: list[LockManager],
) -> None:
    """Each round, a writer on node 0 and a reader on each other node race
    for one key (fail-fast): never the writer together with a reader, and
    whenever the writer is out, both readers share the key."""
    prefix = _prefix()
    rounds = 40
    outcomes: dict[int, dict[str, object]] = {r: {} for r in range(rounds)}
    barrier = threading.Barrier(len(node_managers))
    mutex = threading.Lock()

    def racer(n: int, manager: LockManager) -> None:
        role = "writer" if n == 0 else f"reader{n}"
        for r in range(rounds):
            request = manager.write_lock if n == 0 else manager.read_lock
            barrier.wait(timeout=120)
            held = None
            try:
                held = request(f"{prefix}:{r}", blocking=False, ttl=60).__enter__()
                outcome: object = "won"
            except LockBusy:
                outcome = "busy"
            except Exception as exc:  # a BackendError here is a bug
                outcome = exc
            with mutex:
                outcomes[r][role] = outcome
            barrier.wait(timeout=120)  # everyone's outcome is in before anyone releases
            if held is not None:
                try:
                    held.release()
                except LockLost:  # a second "winner" whose row was never its own
                    with mutex:
                        outcomes[r][role] = "lost at release"

    threads = [threading.Thread(target=racer, args=(n, m)) for n, m in enumerate(node_managers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    errors = [o for rnd in outcomes.values() for o in rnd.values() if isinstance(o, Exception)]
    assert errors == []
    overlaps = {
        r: o
        for r, o in outcomes.items()
        if o["writer"] == "won" and "won" in (o["reader1"], o["reader2"])
    }
    assert overlaps == {}, f"{len(overlaps)} of {rounds} rounds let a writer in beside readers"
    lost = {r: o for r, o in outcomes.items() if "lost at release" in o.values()}
    assert lost == {}, f"{len(lost)} of {rounds} rounds told a loser it had won"
    # A reader is only refused by a write hold: readers who lost share nothing else.
    unshared = {
        r: o
        for r, o in outcomes.items()
        if o["writer"] != "won" and (o["reader1"], o["reader2"]) != ("won", "won")
    }
    assert unshared == {}, unshared


def test_rw_blocking_writer_and_readers_across_nodes(
    node_managers: list[LockManager], key: str
) -> None:
    """A writer on node 0 and readers on nodes 1 and 2 take turns (waiting):
    the writer is never inside with a reader; readers of two nodes are
    inside together at least once."""
    first, second, third = node_managers
    # Readers of two nodes share; the writer is refused meanwhile.
    a = second.read_lock(key, blocking=False).__enter__()
    b = third.read_lock(key, blocking=False).__enter__()
    with pytest.raises(LockBusy):
        first.write_lock(key, blocking=False).__enter__()
    a.release()
    b.release()

    inside = {"readers": 0, "writers": 0}
    mutex = threading.Lock()
    bad: list[dict[str, int]] = []
    grants = {"read": 0, "write": 0}
    stop = time.monotonic() + 5

    def enter(mode: str) -> None:
        with mutex:
            inside["writers" if mode == "write" else "readers"] += 1
            if inside["writers"] > 1 or (inside["writers"] and inside["readers"]):
                bad.append(dict(inside))
            grants[mode] += 1

    def leave(mode: str) -> None:
        with mutex:
            inside["writers" if mode == "write" else "readers"] -= 1

    errors: list[BaseException] = []

    def worker(manager: LockManager, mode: str) -> None:
        request = manager.write_lock if mode == "write" else manager.read_lock
        try:
            while time.monotonic() < stop:
                with request(key, timeout=60, ttl=30):
                    enter(mode)
                    leave(mode)
        except BaseException as exc:  # LockLost: a grant that was not one
            errors.append(exc)

    threads = [
        threading.Thread(target=worker, args=(first, "write")),
        threading.Thread(target=worker, args=(second, "read")),
        threading.Thread(target=worker, args=(third, "read")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert bad == []
    assert grants["write"] > 0
    assert grants["read"] > 0


def test_fair_grants_in_arrival_order_across_nodes(
    galera: PrivateGalera, node_managers: list[LockManager], key: str
) -> None:
    """While a holder on node 0 keeps the key, waiters queue through the
    three nodes one after the other (each once the previous one's queue row
    is visible); released, they are granted in exactly that order, one at a
    time, with growing fences. Twice, the nodes in another order."""
    holder_manager = LockManager(galera.urls[0], renew=False)
    try:
        for round_, order in enumerate(([1, 2, 0], [2, 0, 1])):
            _fair_round(holder_manager, node_managers, f"{key}:{round_}", order)
    finally:
        holder_manager.close()


def _fair_round(
    holder_manager: LockManager, node_managers: list[LockManager], key: str, order: list[int]
) -> None:
    granted: list[tuple[int, int]] = []
    inside = threading.Lock()
    overlaps: list[int] = []
    errors: list[BaseException] = []

    def waiter(n: int) -> None:
        try:
            with node_managers[n].lock(key, fair=True, timeout=120, ttl=60) as held:
                if not inside.acquire(blocking=False):
                    overlaps.append(n)
                    return
                try:
                    granted.append((n, held.fence))
                finally:
                    inside.release()
        except BaseException as exc:  # reported below
            errors.append(exc)

    def queued() -> int:
        return sum(1 for r in holder_manager.store.rows(key=key) if r.slot.startswith("q"))

    threads = []
    with holder_manager.lock(key, fair=True, ttl=60) as held:
        first_fence = held.fence
        for i, n in enumerate(order):
            t = threading.Thread(target=waiter, args=(n,))
            t.start()
            threads.append(t)
            deadline = time.monotonic() + 60
            while queued() < i + 1:
                assert time.monotonic() < deadline, f"waiter on node {n} never queued"
                time.sleep(0.02)
    for t in threads:
        t.join(120)
    assert errors == []
    assert overlaps == []
    assert [n for n, _ in granted] == order
    fences = [first_fence] + [f for _, f in granted]
    assert fences == sorted(fences), fences
    assert len(set(fences)) == len(fences), fences


def test_jobs_run_once_per_fire_time_across_nodes(node_managers: list[LockManager]) -> None:
    """Three "hosts", each on its own node, fire the same schedule at once:
    every fire time runs exactly once (the job lock's certification race,
    then the record's INSERT IGNORE)."""
    from datetime import datetime, timedelta, timezone

    from dblock import SKIPPED

    job = f"galera-job-{uuid.uuid4().hex[:8]}"
    first = datetime(2026, 11, 25, tzinfo=timezone.utc)
    fires = [first + timedelta(minutes=i) for i in range(15)]
    ran: list[tuple[int, datetime]] = []
    barrier = threading.Barrier(len(node_managers))

    def host(n: int, manager: LockManager) -> None:
        for fire in fires:
            barrier.wait()
            result = manager.run_job(job, ran.append, (n, fire), fire_time=fire, at_most=30)
            assert result is None or result is SKIPPED

    threads = [threading.Thread(target=host, args=(n, m)) for n, m in enumerate(node_managers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(fire for _, fire in ran) == fires


def test_batches_racing_across_nodes(node_managers: list[LockManager]) -> None:
    """Group commit on Galera: 8 threads per node, each manager batching its
    acquires over one set of 6 keys that all nodes race for. Lost
    certifications roll whole batches back (they run again, or go alone):
    never two holders of a key, every key's fences grow, and batches did form."""
    from tests.support.counting import StatementCounter

    keys = [f"{_prefix()}:{i}" for i in range(6)]
    fences: dict[str, list[int]] = {k: [] for k in keys}
    inside = dict.fromkeys(keys, 0)
    mutex = threading.Lock()
    overlaps: list[str] = []
    errors: list[BaseException] = []
    counters = [StatementCounter(m.engine).__enter__() for m in node_managers]
    stop = time.monotonic() + 5

    def worker(manager: LockManager, n: int) -> None:
        i = n
        try:
            while time.monotonic() < stop:
                k = keys[i % len(keys)]
                i += 1
                try:
                    with manager.lock(k, blocking=False, ttl=30) as held:
                        with mutex:
                            inside[k] += 1
                            if inside[k] != 1:
                                overlaps.append(k)
                            fences[k].append(held.fence)
                        time.sleep(0.0005)
                        with mutex:
                            inside[k] -= 1
                except LockBusy:
                    pass
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=worker, args=(m, n)) for m in node_managers for n in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert overlaps == []
    for k, seen in fences.items():
        assert seen, k
        assert all(a < b for a, b in itertools.pairwise(seen)), (k, seen)
    batches = sum("UNION ALL" in s and "INSERT IGNORE" in s for c in counters for s in c.statements)
    assert batches > 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_fence_drawn_before_a_stall_is_drawn_again_once_the_row_is_ours(
    galera: PrivateGalera, key: str, kind: str
) -> None:
    """Galera runs InnoDB with innodb_autoinc_lock_mode=2: an INSERT draws its
    AUTO_INCREMENT before it finds the key free, with no lock over the two.
    An acquire on node 1 is held right after its draw (gdb, as a descheduled
    server thread would be) while node 0 takes and lets go of the key; once
    it goes on, the key is free and its row is written: its grant must still
    carry a fence above node 0's (before the re-draw it carried the smaller
    one, drawn first). The fair queue's head and the write lock: their
    grants, an ``INSERT … SELECT`` and a locking read, take gap locks that
    the other node's rows, applied here, break (the stalled statement is
    aborted and tried again with a new draw)."""
    reason = unavailable()
    if reason is not None:  # like a missing database: fail, never skip
        pytest.fail(f"cannot hold a server thread: {reason} (install gdb and binutils)")
    slow = LockManager(galera.nodes[1].url, client_id="slow", renew=False)
    fast = LockManager(galera.nodes[0].url, client_id="fast", renew=False)
    got: list[int] = []
    try:
        for m in (slow, fast):
            m.acquire(key + ":warm-up").release()  # capabilities read before the stall

        def take() -> None:
            with locked(slow, kind, key, 60) as held:
                got.append(held.fence)

        with AutoIncrementStall(galera.nodes[1].pid) as stall:
            first = threading.Thread(target=take)
            first.start()
            stall.wait_stalled()  # slow drew its fence and has not looked at the key
            with locked(fast, kind, key, 30) as held:
                fast_fence = held.fence
            stall.release()
            first.join(60)
        assert got, "the stalled acquire never returned"
        assert got[0] > fast_fence, f"fence went backwards: {fast_fence} then {got[0]}"
    finally:
        slow.close()
        fast.close()


def test_a_write_grant_whose_row_was_gone_at_the_redraw_is_no_grant_and_leaves_no_row(
    galera: PrivateGalera, key: str
) -> None:
    """The write grant's fence is drawn again by an upsert of our own row; if
    the row was gone by then (its lease ran out, another took and let go of
    the key), the upsert inserts one: that is no grant, and the row is
    deleted at once (a dead read phase meanwhile, which nobody waits for)."""
    from dblock._store.rw import rw_statements

    m = LockManager(galera.nodes[0].url)
    try:
        statements: Any = rw_statements(m.store)
        assert statements._redraw
        params = {"key": key, "mode": "write", "token": "t" * 32, "owner": "me", "ttl_us": 10**7}
        row = m.store.drive(statements._redraw_steps(params))
        assert not row.granted
        assert row.expires_in == 0.0
        assert m.store.drive(statements.holder_steps(key)) is None
        # And a writer takes the key at once.
        with m.write_lock(key, blocking=False) as held:
            assert held.fence > 0
    finally:
        m.close()
