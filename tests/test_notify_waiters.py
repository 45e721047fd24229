"""A release notifies only when some process waits for the key (PostgreSQL).

A waiting process registers the key on the server (its listener connection
holds a shared advisory lock on it); the release tries that lock after its
DELETE and notifies only if it cannot have it. These tests check that a
release nobody waits for sends no NOTIFY, and drive both orders of the race
between a waiter registering and a holder releasing on purpose, directly and
through a transaction-mode pooler: the waiter is never left asleep.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from dblock import LockManager
from dblock._store.postgresql import Listener
from dblock._store.sqlparts import waiters_class
from tests.support.notify import (
    Heard,
    bucket_of,
    conninfo,
    registered,
    registered_on_server,
    start_waiter,
    until,
)
from tests.support.servers import PgBouncer

pytestmark = pytest.mark.databases("postgresql")

# Long enough that a waiter woken by its periodic re-check, or polling
# (poll_max, its cap while its registration is not in), fails the test.
RECHECK = 30.0


@pytest.fixture
def heard(db_url: str, make_manager: Callable[..., LockManager]) -> Iterator[Any]:
    made: list[Heard] = []

    def make(manager: LockManager) -> Heard:
        h = Heard(db_url, manager)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


def test_a_release_nobody_waits_for_sends_no_notify(
    make_manager: Callable[..., LockManager], heard: Any, keys: Any
) -> None:
    m = make_manager()
    ear = heard(m)
    names = keys(20)
    for k in names[:3]:
        with m.lock(k, blocking=False):
            pass

    # Many threads at once: batched releases too.
    def cycle(k: str) -> None:
        for _ in range(5):
            with m.lock(k, blocking=False):
                pass

    threads = [threading.Thread(target=cycle, args=(k,)) for k in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert ear.payloads() == []


def test_a_waiter_registered_before_the_release_is_notified(
    db_url: str, make_manager: Callable[..., LockManager], heard: Any, key: str
) -> None:
    holder = make_manager()
    waiter = make_manager(notify_recheck=RECHECK, poll_max=RECHECK)
    ear = heard(holder)
    held = holder.acquire(key)
    t, got = start_waiter(waiter, key)
    until(lambda: registered(waiter, key), "the waiter's registration")
    assert registered_on_server(db_url, waiter, key)
    time.sleep(0.1)  # its attempt after the registration is made and found the key held
    released = time.monotonic()
    assert held.release() is True
    until(lambda: got, "the waiter's grant", timeout=RECHECK / 2)
    assert got[0] - released < 1.0
    # On the channel of the key's bucket, the only one the waiter listens to.
    channel = f"{holder.store.names.channel_prefix}{bucket_of(db_url, key)}"
    assert (channel, key) in ear.notes()
    assert waiter.store._listener._listened == {bucket_of(db_url, key)}
    t.join(10)
    # Its wait over, the waiter's listener drops the registration: the next
    # release of the key notifies nobody.
    until(
        lambda: not registered(waiter, key) and not registered_on_server(db_url, waiter, key),
        "the registration dropped",
    )
    with holder.lock(key, blocking=False):
        pass
    assert key not in ear.payloads()


@pytest.mark.parametrize("via", ["direct", "pooler"])
def test_a_release_before_the_registration_is_not_missed(
    db_url: str,
    make_manager: Callable[..., LockManager],
    key: str,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    via: str,
) -> None:
    """The other order: the release's DELETE and its look for waiters come
    before the waiter's registration (so it does not notify). The
    registration waits for the release's commit, and the waiter, woken by its
    registration, tries again and finds the key free. ``pooler``: the release
    runs through a transaction-mode pgbouncer (its transaction, and so its
    look, on whatever server connection the pooler lends it)."""
    release_url = db_url
    if via == "pooler":
        release_url = request.getfixturevalue("bouncer").url
    holder = make_manager()
    waiter = make_manager(notify_recheck=RECHECK, poll_max=RECHECK)
    held = holder.acquire(key)
    gate = threading.Event()
    real = Listener._sync_registrations

    def held_up(self: Listener, conn: Any) -> None:
        gate.wait(30)
        real(self, conn)

    monkeypatch.setattr(Listener, "_sync_registrations", held_up)
    t, got = start_waiter(waiter, key)
    until(
        lambda: waiter.store._listener is not None and key in waiter.store._listener._subs,
        "the waiter's subscription",
    )
    time.sleep(0.1)
    # The holder's release, by hand and left open: the row deleted, no waiter found.
    table = holder.store.names.table
    release = psycopg.connect(conninfo(release_url), prepare_threshold=None)
    release.execute(f"DELETE FROM {table} WHERE lock_key = %s AND token = %s", (key, held.token))
    waiters = waiters_class(table)
    (free,) = release.execute(
        "SELECT pg_try_advisory_xact_lock(%s, hashtext(%s))", (waiters, key)
    ).fetchone()  # type: ignore[misc]
    assert free is True  # nobody registered: the release would not notify
    gate.set()  # the registration goes ahead, and waits for the release's commit
    admin = psycopg.connect(conninfo(db_url), autocommit=True)
    # (Through the pooler the backend is the pooler's, not the one psycopg reports.)
    (server_pid,) = release.execute("SELECT pg_backend_pid()").fetchone()  # type: ignore[misc]
    until(
        lambda: admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
            (server_pid,),
        ).fetchone()[0],  # type: ignore[index]
        "the registration waiting for the release",
    )
    admin.close()
    assert not got
    committed = time.monotonic()
    release.commit()
    release.close()
    held.state.released = True  # released by hand above
    until(lambda: got, "the waiter's grant", timeout=RECHECK / 2)
    assert got[0] - committed < 1.0
    t.join(10)


@pytest.mark.parametrize("via", ["direct", "pooler"])
def test_a_release_between_the_registration_and_the_listen_is_not_missed(
    db_url: str,
    make_manager: Callable[..., LockManager],
    key: str,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    via: str,
) -> None:
    """The race on a bucket the process does not LISTEN to yet: the key's
    registration is in (so the release notifies), but the LISTEN on its
    bucket is not, so the notification reaches nobody. The waiter, woken
    only once the LISTEN is active, tries again and finds the key free.
    ``pooler``: both managers' statements go through a transaction-mode
    pgbouncer, the waiter's LISTEN straight to the server (``listen_url``)."""
    options: dict[str, Any] = {}
    url = db_url
    if via == "pooler":
        url = request.getfixturevalue("bouncer").url
        options = {"pooler": True}
    holder = LockManager(url, **options)
    waiter = LockManager(
        url, **options, listen_url=db_url if via == "pooler" else None,
        notify_recheck=RECHECK, poll_max=RECHECK,
    )  # fmt: skip
    try:
        held = holder.acquire(key)
        entered, gate = threading.Event(), threading.Event()
        real = Listener._listen

        def held_up(self: Listener, conn: Any, wanted: set[int]) -> None:
            if wanted - self._listened:  # a LISTEN on a new bucket
                entered.set()
                gate.wait(30)
            real(self, conn, wanted)

        monkeypatch.setattr(Listener, "_listen", held_up)
        t, got = start_waiter(waiter, key)
        assert entered.wait(10)
        listener = waiter.store._listener
        assert key in listener._bucket  # registered: the release notifies ...
        assert bucket_of(db_url, key) not in listener._listened  # ... nobody listening
        assert held.release() is True
        time.sleep(0.2)
        assert not got  # asleep: not woken (its registration is not complete)
        opened = time.monotonic()
        gate.set()
        until(lambda: got, "the waiter's grant", timeout=RECHECK / 2)
        assert got[0] - opened < 1.0
        assert listener._listened == {bucket_of(db_url, key)}
        t.join(10)
    finally:
        holder.close()
        waiter.close()


@pytest.fixture
def bouncer(db_url: str) -> Iterator[PgBouncer]:
    """A transaction-mode pgbouncer in front of this test's server."""
    with PgBouncer(db_url, pool_size=3) as server:
        yield server  # type: ignore[misc]


def test_behind_the_pooler_a_release_notifies_only_a_waiter(
    db_url: str, bouncer: PgBouncer, heard: Any, key: str
) -> None:
    """Statements through a transaction-mode pooler, the waiter's listener
    straight to the server (listen_url): releases nobody waits for are
    silent, and a registered waiter is notified."""
    direct = db_url
    holder = LockManager(bouncer.url, pooler=True)
    waiter = LockManager(
        bouncer.url, pooler=True, listen_url=direct, notify_recheck=RECHECK, poll_max=RECHECK
    )
    try:
        ear = heard(holder)
        for _ in range(3):
            with holder.lock(key, blocking=False):
                pass
        assert ear.payloads() == []
        held = holder.acquire(key)
        t, got = start_waiter(waiter, key)
        until(lambda: registered(waiter, key), "the waiter's registration")
        time.sleep(0.1)
        released = time.monotonic()
        assert held.release() is True
        until(lambda: got, "the waiter's grant", timeout=RECHECK / 2)
        assert got[0] - released < 1.0
        assert key in ear.payloads()
        t.join(10)
    finally:
        holder.close()
        waiter.close()


def test_an_asyncio_waiter_is_woken_by_the_release(
    make_manager: Callable[..., LockManager], key: str
) -> None:
    """The asyncio side registers through the same listener: woken by the
    notification, not by its periodic re-check."""
    import asyncio

    from dblock import AsyncLockManager

    holder = make_manager()
    held = holder.acquire(key)

    async def main() -> float:
        waiter = AsyncLockManager(make_manager(notify_recheck=RECHECK, poll_max=RECHECK))
        task = asyncio.create_task(waiter.acquire(key, timeout=60))
        deadline = time.monotonic() + 10
        while not registered(waiter.sync, key):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        released = time.monotonic()
        await asyncio.to_thread(held.release, force=True)
        got = await asyncio.wait_for(task, RECHECK / 2)
        woke = time.monotonic() - released
        await got.release(force=True)
        await waiter.close()
        return woke

    assert asyncio.run(main()) < 1.0
