"""A database that goes away and comes back while an acquire waits.

A restart (or a failover) takes seconds; a waiting ``lock(timeout=…)`` longer
than that must come out of it holding the lock, not with the first
connection error. A fail-fast acquire still fails fast.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from dblock import BackendError, HeldLock, LockManager
from tests.support.counting import StatementCounter
from tests.support.proxy import Proxy
from tests.support.servers import PrivateServer, migrated

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["postgresql", "mariadb"])
def server(request: pytest.FixtureRequest) -> Iterator[PrivateServer]:
    with migrated(request.param) as made:
        yield made


def _wait_for(predicate: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "state not reached"
        time.sleep(0.01)


def test_waiting_acquire_rides_out_a_restart(server: PrivateServer, key: str) -> None:
    """The waiter keeps trying while the server is down (seen at its proxy),
    and is granted the key once the server is back and the holder's row is gone."""
    proxy = Proxy("127.0.0.1", server.port)
    holder = LockManager(server.url, renew=False)
    waiter = LockManager(proxy.url_for(server.url), poll_max=0.1)
    try:
        first = holder.acquire(key, ttl=60)  # held throughout: the waiter must wait
        outcome: list[object] = []

        def wait() -> None:
            try:
                outcome.append(waiter.acquire(key, timeout=60))
            except Exception as exc:
                outcome.append(exc)

        with waiter.lock(key + ":warm-up"):  # capabilities read, a pooled connection
            pass
        # The waiter is waiting: its first attempt found the key held (one
        # statement on PostgreSQL, INSERT then the holder's SELECT on MariaDB)
        # and its second has begun. (A statement seen done is not yet an
        # attempt done: the connection is still in use for a moment after.)
        attempt = 1 if server.name == "postgresql" else 2
        with StatementCounter(waiter.engine) as seen:
            thread = threading.Thread(target=wait)
            thread.start()
            _wait_for(lambda: seen.count > attempt)
        server.crash()
        tried = proxy.accepted
        # Down for longer than an attempt's own retries of a cut statement
        # (four connections): until the waiter tried six times, or gave up.
        _wait_for(lambda: proxy.accepted >= tried + 6 or outcome)
        server.start()
        assert outcome == []  # still waiting: the row survived the restart
        # The holder's row goes (its own pooled connection died with the
        # server, so through a fresh manager, as `dblock release --force` would).
        with LockManager(server.url) as admin:
            assert admin.store.release(key, first.token)
        thread.join(60)
        assert len(outcome) == 1
        got = outcome[0]
        assert isinstance(got, HeldLock), got
        assert got.fence > first.fence
        got.release(force=True)  # acquired by the waiting thread
    finally:
        holder.close()
        waiter.close()
        proxy.close()


def test_fail_fast_acquire_still_fails_fast(server: PrivateServer, key: str) -> None:
    with LockManager(server.url) as m:
        with m.lock(key + ":warm-up"):
            pass
        server.crash()
        try:
            with pytest.raises(BackendError):
                m.acquire(key, blocking=False)
            # A blocking acquire that never reached the database fails at once too.
            with pytest.raises(BackendError):
                m.acquire(key, timeout=60)
            assert len(m._locker.registry) == 0
        finally:
            server.start()
