"""MariaDB: fences follow the order in which a key is granted (issue 15).

InnoDB draws an ``AUTO_INCREMENT`` value before it writes the row. With a
plain ``INSERT … VALUES`` it draws under a mutex it lets go at once, so an
acquire whose server thread is held up between the two steps (on a loaded
machine: descheduled) can write a fence drawn *before* the one another
process was granted, and released, on the same key meanwhile: the fence goes
backwards and a downstream store that refuses older fences would refuse the
current holder. The torture run saw it as "fence decreased between sections
inside their leases"; ``scripts/torture.py``-free, a niced private server
under load showed it about once per thousand grants.

Here the hold-up is made on cue (tests/support/stall.py: gdb stops that one
server thread right after the draw), on a private instance, for the MariaDB
path (``INSERT … RETURNING``) and for the MySQL path the suite drives on
MariaDB (``lastrowid``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from dblock import LockManager
from tests.support.grants import Grants
from tests.support.innodb import innodb_count
from tests.support.kinds import KINDS, locked
from tests.support.servers import PrivateMariaDB, migrated
from tests.support.stall import AutoIncrementStall, unavailable

pytestmark = [pytest.mark.databases("mariadb"), pytest.mark.slow]


@pytest.fixture(scope="module")
def server() -> Iterator[PrivateMariaDB]:
    reason = unavailable()
    if reason is not None:  # like a missing database: fail, never skip
        pytest.fail(f"cannot hold a server thread: {reason} (install gdb and binutils)")
    with migrated("mariadb") as s:
        assert isinstance(s, PrivateMariaDB)
        yield s


def _lock_waits(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return innodb_count(
            conn, "SELECT count(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT'"
        )


def _until(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize("returning", [True, False], ids=["returning", "lastrowid"])
def test_fence_drawn_before_a_stall_is_never_granted_after_a_larger_one(
    db: str, server: PrivateMariaDB, key: str, returning: bool
) -> None:
    slow = LockManager(server.url, client_id="slow", renew=False)
    fast = LockManager(server.url, client_id="fast", renew=False)
    try:
        for m in (slow, fast):
            m.acquire(key + ":warm-up").release()  # capabilities read before the stall
            m.store.returning = returning  # type: ignore[attr-defined]
        # Before the fix fast is granted (a larger fence) and done; with it,
        # fast waits in the server for slow's statement to end.
        grants = _race(server, slow, fast, "exclusive", key)
        assert [name for name, _ in grants] in (["slow", "fast"], ["fast", "slow"])
        fences = [fence for _, fence in grants]
        assert fences[0] < fences[1], f"granted in this order, fences going backwards: {grants}"
    finally:
        slow.close()
        fast.close()


def _race(
    server: PrivateMariaDB, slow: LockManager, fast: LockManager, kind: str, key: str
) -> list[tuple[str, int]]:
    """Slow's grant held by gdb right after its AUTO_INCREMENT draw while
    fast takes (and lets go of) ``key`` or waits in the server for slow's
    statement; then slow goes on. The grants, in the order they returned."""
    probe = sa.create_engine(server.url, poolclass=sa.pool.NullPool)
    grants: list[tuple[str, int]] = []
    let_slow_go = threading.Event()  # slow releases its own lock: only a holder may
    record = threading.Lock()

    def take(manager: LockManager, name: str) -> None:
        with locked(manager, kind, key, 60) as held:
            with record:
                grants.append((name, held.fence))
            if name == "slow":
                let_slow_go.wait(60)

    try:
        with AutoIncrementStall(server.pid) as stall:
            first = threading.Thread(target=take, args=(slow, "slow"))
            first.start()
            stall.wait_stalled()  # slow drew its fence and has not written its row
            second = threading.Thread(target=take, args=(fast, "fast"))
            second.start()
            _until(lambda: not second.is_alive() or _lock_waits(probe) > 0, 60)
            stall.release()
            _until(lambda: "slow" in dict(grants) or not first.is_alive(), 60)
            let_slow_go.set()
            first.join(60)
            second.join(60)
    finally:
        let_slow_go.set()
        probe.dispose()
    return grants


@pytest.fixture(scope="module")
def server_mode2() -> Iterator[PrivateMariaDB]:
    """InnoDB as MySQL 8 runs it by default (and Galera must): no AUTO-INC lock."""
    reason = unavailable()
    if reason is not None:  # like a missing database: fail, never skip
        pytest.fail(f"cannot hold a server thread: {reason} (install gdb and binutils)")
    with migrated("mariadb", "--innodb-autoinc-lock-mode=2") as s:
        assert isinstance(s, PrivateMariaDB)
        yield s


@pytest.mark.parametrize("kind", KINDS)
def test_without_the_auto_inc_lock_a_fence_drawn_before_a_stall_is_drawn_again(
    db: str, server_mode2: PrivateMariaDB, key: str, kind: str
) -> None:
    """``innodb_autoinc_lock_mode=2``: nothing orders a grant's draw with
    its look at the key. The slow grant is held after its draw while the
    fast one takes and lets go of the key (or waits in the server, for the
    kinds whose grant takes gap locks); the grants' fences must grow in the
    order they were granted. Before the re-draw: the exclusive and the
    write lock's fences went backwards."""
    slow = LockManager(server_mode2.url, client_id="slow", renew=False)
    fast = LockManager(server_mode2.url, client_id="fast", renew=False)
    try:
        for m in (slow, fast):
            with locked(m, kind, key + ":warm-up", 60):  # capabilities read before the stall
                pass
        assert slow.store.redraws_fences  # type: ignore[attr-defined]
        grants = _race(server_mode2, slow, fast, kind, key)
        assert sorted(name for name, _ in grants) == ["fast", "slow"]
        fences = [fence for _, fence in grants]
        assert fences[0] < fences[1], f"granted in this order, fences going backwards: {grants}"
    finally:
        slow.close()
        fast.close()


@pytest.mark.parametrize("mode", [1, 2])
def test_a_hand_off_never_draws_a_fence_past_an_acquire_about_to_insert(
    db: str, server: PrivateMariaDB, server_mode2: PrivateMariaDB, key: str, mode: int
) -> None:
    """The hand-off draws fences too (an ``INSERT`` meeting the held row:
    the next local thread's fence and the run's reserve). Slow's acquire is
    held after its draw while fast's holder hands the key to its next thread,
    which lets it go; then slow goes on. PostgreSQL's hand-off drew past such
    an acquire (tests/test_postgresql_fence.py); on MariaDB the hand-off
    waits for slow's ``AUTO-INC`` lock in mode 1 (slow's grant is an
    ``INSERT … SELECT``), and in mode 2 slow's grant is drawn again."""
    target = server if mode == 1 else server_mode2
    slow = LockManager(target.url, client_id="slow", renew=False)
    fast = LockManager(target.url, client_id="fast", renew=False)
    probe = sa.create_engine(target.url, poolclass=sa.pool.NullPool)
    grants = Grants(key, hold="first")
    try:
        for m in (slow, fast):
            m.acquire(key + ":warm-up").release()  # capabilities read before the stall
        assert fast.store.can_transfer  # type: ignore[attr-defined]
        grants.start(fast, "first")
        _until(lambda: grants.names() == ["first"], 60)
        with AutoIncrementStall(target.pid) as stall:
            grants.start(slow, "slow")
            stall.wait_stalled()  # slow drew its fence and has not met the row
            grants.start(fast, "second")  # queued behind "first" in fast's process
            _until(lambda: bool(fast._locker.registry.get(key).queue), 60)  # type: ignore[union-attr]
            grants.let_go()  # its release hands the key to "second"
            second = grants.threads[-1]
            # "second" granted and gone again (it let go of the key), or the
            # hand-off waiting in the server for slow's statement.
            _until(lambda: not second.is_alive() or _lock_waits(probe) > 0, 60)
            stall.release()
            grants.join()
        assert sorted(grants.names()) == ["first", "second", "slow"]
        fences = grants.fences()
        assert fences == sorted(fences), (
            f"granted in this order, fences going backwards: {grants.grants}"
        )
    finally:
        grants.join()
        slow.close()
        fast.close()
        probe.dispose()
