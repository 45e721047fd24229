"""PostgreSQL failover: the primary dies (SIGKILL), its synchronous standby
is promoted, and managers on a multi-host URL (``target_session_attrs=
read-write``) carry on against the new primary.

A synchronous standby has every committed row, so the lock rows and the
fence sequence's committed values survive the promotion: held locks stay
held (renewal reaches the new primary), waiters get their turn, fences keep
growing, and no two holders are ever inside at once.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from dblock import HeldLock, LockManager
from tests.support.servers import PrivatePostgresPair

pytestmark = pytest.mark.cluster


@pytest.fixture
def pair(pg_pair: PrivatePostgresPair) -> Iterator[PrivatePostgresPair]:
    with LockManager(pg_pair.url) as m:
        m.create_schema()
    yield pg_pair
    pg_pair.reset()  # the next test gets a primary with a standby again


def _until(predicate: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "state not reached"
        time.sleep(0.01)


def test_failover_keeps_held_locks_waiters_and_fences(pair: PrivatePostgresPair) -> None:
    prefix = f"failover:{uuid.uuid4().hex[:10]}"
    held_key, hot_key = f"{prefix}:held", f"{prefix}:hot"
    managers = [LockManager(pair.url, ttl=6, poll_max=0.05) for _ in range(3)]
    try:
        held = managers[0].acquire(held_key)
        # A waiter for the held key, queued before the failover.
        waited: list[object] = []

        def waiter() -> None:
            try:
                waited.append(managers[1].acquire(held_key, timeout=60))
            except Exception as exc:
                waited.append(exc)

        # Workers taking turns on a hot key through the failover, each
        # recording its critical section.
        sections: list[tuple[float, float, int]] = []
        errors: list[BaseException] = []
        mutex = threading.Lock()
        inside: list[int] = []
        overlaps: list[tuple[int, int]] = []
        stop = threading.Event()

        def worker(manager: LockManager) -> None:
            while not stop.is_set():
                try:
                    with manager.lock(hot_key, timeout=30) as lock:
                        start = time.monotonic()
                        with mutex:
                            overlaps.extend((other, lock.fence) for other in inside)
                            inside.append(lock.fence)
                        time.sleep(0.005)
                        with mutex:
                            inside.remove(lock.fence)
                            sections.append((start, time.monotonic(), lock.fence))
                except Exception as exc:
                    errors.append(exc)

        threads = [threading.Thread(target=waiter)]
        threads += [threading.Thread(target=worker, args=(m,)) for m in managers[1:] for _ in "ab"]
        for t in threads:
            t.start()
        _until(lambda: len(sections) >= 20)

        killed_at = time.monotonic()
        pair.kill_primary()
        pair.promote()
        promoted_at = time.monotonic()
        # Renewal reached the new primary: the lease now ends later than it
        # could have if renewed before the kill.
        before = held.expires_at
        _until(lambda: held.expires_at > before and not held.state.renew_error)
        _until(lambda: any(s[0] > promoted_at for s in sections))
        assert not held.lost
        assert waited == []  # still waiting: the key is held
        fence = held.fence
        held.release()  # no LockLost: the row survived the failover
        _until(lambda: waited)
        stop.set()
        for t in threads:
            t.join(60)

        got = waited[0]
        assert isinstance(got, HeldLock), got
        assert got.fence > fence
        got.release(force=True)  # acquired by the waiting thread
        assert overlaps == []
        fences = [f for _, _, f in sorted(sections)]
        assert all(a < b for a, b in itertools.pairwise(fences)), "fence went back"
        # Every worker error is the one that might happen to a brand-new
        # acquire that starts while no server takes writes at all.
        assert all("read-only" in str(e) or "connect" in str(e) for e in errors), errors
        # The key's longest idle gap between two holders around the failover.
        ordered = sorted(sections)
        unavailable = max(
            b[0] - a[1] for a, b in itertools.pairwise(ordered) if a[1] >= killed_at - 1.0
        )
        print(
            f"\nfailover: key unavailable {unavailable:.2f} s "
            f"(kill to promoted {promoted_at - killed_at:.2f} s); "
            f"{len(sections)} sections, {len(errors)} acquire errors"
        )
    finally:
        for m in managers:
            m.close()
