"""A database server that stops answering without closing anything.

A server process frozen (a paused VM, a stalled disk, SIGSTOP here) keeps
its TCP connections open: its kernel still acknowledges every byte, so a
statement sent to it waits for ever, with no error to react to. dblock must
still (1) tell a holder its lock is lost when the lease ends although the
renewal statement never came back (``lost``, ``on_lost``, ``check()``), and
(2) finish ``close()``: its releases get a bounded wait, the rows are left
to their leases, and the statements complete by themselves once the server
answers again. Private servers on free ports: the shared ones are never frozen.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

import pytest

from dblock import AsyncLockManager, LockLost, LockManager
from dblock.lock import Locker
from tests.conftest import row_of
from tests.support.servers import PrivateMariaDB, PrivateServer, migrated

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["postgresql", "mariadb"])
def server(request: pytest.FixtureRequest) -> Iterator[PrivateServer]:
    with migrated(request.param) as made:
        yield made


def _pids(server: PrivateServer) -> list[int]:
    if isinstance(server, PrivateMariaDB):
        return [server.pid]
    found = subprocess.run(
        ["pgrep", "-f", str(server.data)], capture_output=True, text=True, check=False
    ).stdout.split()
    pids = [int(p) for p in found]
    for parent in list(pids):
        children = subprocess.run(
            ["pgrep", "-P", str(parent)], capture_output=True, text=True, check=False
        ).stdout.split()
        pids += [int(c) for c in children]
    return sorted(set(pids))


@contextmanager
def _frozen(server: PrivateServer) -> Iterator[None]:
    pids = _pids(server)
    assert pids, "no server process found"
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _row_gone(server: PrivateServer, key: str) -> bool:
    with LockManager(server.url) as m:
        return row_of(m, key) is None


def test_the_lease_end_is_told_while_renewal_waits_for_a_frozen_server(
    server: PrivateServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The renewal statement goes out and never comes back: at the lease's
    end the lock is lost all the same (``lost``, ``on_lost``, an ERROR
    line), not whenever the server answers again."""
    caplog.set_level(logging.ERROR, logger="dblock")
    key = f"frozen-renewal-{time.monotonic_ns()}"
    told = threading.Event()
    with LockManager(server.url) as m:
        held = m.acquire(key, ttl=1.5, on_lost=lambda h: told.set())
        with _frozen(server):
            start = time.monotonic()
            # Renewal is due after a third of the lease; it then waits.
            assert told.wait(10), "on_lost never called while the renewal waited"
            assert time.monotonic() - start < 3.5
            assert held.lost
            with pytest.raises(LockLost):
                held.check()
            assert "lost" in caplog.text
        # Thawed: the renewal's answer, when it comes, does not revive it.
        # The renewal thread's pass stuck on the frozen server ends once that
        # answer is in (its next wake-up is set only then).
        renewer = m._locker.renewer
        deadline = time.monotonic() + 10
        while renewer._wake_at == float("inf"):
            assert time.monotonic() < deadline, "the renewal's answer never came"
            time.sleep(0.01)
        assert held.lost
        with pytest.raises(LockLost):
            held.release()
    deadline = time.monotonic() + 10
    while not _row_gone(server, key):
        assert time.monotonic() < deadline, "the row stayed"
        time.sleep(0.1)


def test_lost_is_true_once_the_lease_has_ended(server: PrivateServer) -> None:
    """``held.lost`` says what ``check()`` says: a lease past its end by the
    local clock is lost, even while the renewal thread, which would mark it,
    waits for a frozen server (here on another lock's renewal)."""
    key = f"frozen-lost-{time.monotonic_ns()}"
    with LockManager(server.url) as m:
        renewed = m.acquire(f"{key}-renewed", ttl=1.2)
        held = m.acquire(key, ttl=2.5, renew=False)
        with _frozen(server):
            time.sleep(2.8)  # the renewal thread is stuck since 0.4 s
            assert held.lost
            assert held.lost_reason == "its lease ran out (renewal is off for this lock)"
            assert renewed.lost


def test_close_finishes_while_the_server_is_frozen(
    server: PrivateServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """close() marks every held lock lost at once, gives its releases a
    bounded wait, and returns; the releases finish on their own once the
    server answers again."""
    monkeypatch.setattr(Locker, "CLOSE_RELEASES", 1.0)
    caplog.set_level(logging.ERROR, logger="dblock")
    keys = [f"frozen-close-{i}-{time.monotonic_ns()}" for i in range(4)]
    m = LockManager(server.url)
    # Every kind: two exclusive locks, a write lock, a semaphore's permit.
    held = [m.acquire(k) for k in keys[:2]]
    held.append(m.write_lock(keys[2]).__enter__())
    held.append(m.semaphore(keys[3], permits=2).__enter__())
    with _frozen(server):
        closer = threading.Thread(target=m.close, daemon=True)
        start = time.monotonic()
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "close() hung on a frozen server"
        assert time.monotonic() - start < 25
        assert all(h.lost for h in held)
        assert "did not answer" in caplog.text
    deadline = time.monotonic() + 20
    while not all(_row_gone(server, k) for k in keys):
        assert time.monotonic() - deadline < 0, "the rows stayed after the server came back"
        time.sleep(0.1)


@pytest.mark.parametrize("which", [0, 1], ids=["driver0", "driver1"])
def test_async_close_finishes_while_the_server_is_frozen(
    server: PrivateServer, monkeypatch: pytest.MonkeyPatch, which: int
) -> None:
    """The same for the asyncio face, on each asyncio driver (asyncpg's
    close waits for the server's goodbye unless told how long): its locks
    are lost, and ``await close()`` returns while the server stays frozen."""
    from tests.support.db import driver_form

    monkeypatch.setattr(Locker, "CLOSE_RELEASES", 1.0)
    key = f"frozen-aclose-{time.monotonic_ns()}"
    db = "mariadb" if isinstance(server, PrivateMariaDB) else "postgresql"
    url, _ = driver_form(db, server.url, which)

    async def main() -> None:
        manager = AsyncLockManager(url)
        held = await manager.acquire(key)
        with _frozen(server):
            start = time.monotonic()
            await asyncio.wait_for(manager.close(), 30)
            assert time.monotonic() - start < 25
            assert held.lost

    asyncio.run(main())
    deadline = time.monotonic() + 20
    while not _row_gone(server, key):
        assert time.monotonic() < deadline, "the row stayed after the server came back"
        time.sleep(0.1)
