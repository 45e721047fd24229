"""Wake-ups without NOTIFY (MySQL/MariaDB: named locks; SQLite: a byte lock
per waited-for key and a datagram per release): a waiter of another
process learns of the release of its key at once, without polling.

Two managers stand for two processes (each has its own store, waker,
connections, descriptors and socket); ``tests/test_processes.py`` and the
benchmark's hand-off run real processes. Every waiter here polls at most
every ``RECHECK`` seconds, so a wake-up that did not come fails the test.
The race between a release and a waiter's registration is driven in both
orders on purpose.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from dblock import AsyncLockManager, LockManager, LockTimeout
from dblock._store.wake import NamedLockWaker, SocketWaker
from tests.support.notify import start_waiter, until

pytestmark = pytest.mark.databases("sqlite", "mariadb")

# Long enough that a waiter woken by its periodic re-check, or polling,
# fails the test.
RECHECK = 30.0
SLOW = {"notify_recheck": RECHECK, "poll_initial": RECHECK, "poll_max": RECHECK}
# A wake-up's bound here: the release's and the grant's statements on a
# loaded shared server (seconds each at worst), well under RECHECK.
FAST = 8.0


def waker_of(manager: LockManager) -> Any:
    return manager.store._waker  # type: ignore[attr-defined]


def test_a_waiter_of_another_process_is_woken_by_the_release(
    make_manager: Callable[..., LockManager], key: str
) -> None:
    holder = make_manager()
    waiter = make_manager(**SLOW)
    held = holder.acquire(key)
    _until_named(holder, key)
    t, got = start_waiter(waiter, key)
    until(lambda: waker_of(waiter) is not None and waker_of(waiter).waiting(key), "the waiter")
    until(lambda: waker_of(waiter).covers(key), "the waiter's watch")
    time.sleep(0.2)  # its attempts are over: it sleeps
    released = time.monotonic()
    assert held.release() is True
    until(lambda: got, "the waiter's grant", timeout=RECHECK / 2)
    assert got[0] - released < FAST
    t.join(10)


def test_a_release_of_another_key_wakes_no_waiter(
    make_manager: Callable[..., LockManager], keys: Any
) -> None:
    """Waiters are woken for their own key only: a waiter's attempts are
    counted while other keys are taken and released many times."""
    mine, other = keys(2)
    holder = make_manager()
    waiter = make_manager(**SLOW)
    held = holder.acquire(mine)
    _until_named(holder, mine)
    attempts: list[str] = []
    real = type(waiter.store).acquire_steps

    def counted(self: Any, key: str, *args: Any) -> Any:
        if self is waiter.store:
            attempts.append(key)
        return real(self, key, *args)

    t, got = start_waiter(waiter, mine)
    until(lambda: waker_of(waiter) is not None and waker_of(waiter).covers(mine), "the waiter")
    time.sleep(0.2)
    pytest.MonkeyPatch().setattr(type(waiter.store), "acquire_steps", counted)
    try:
        for _ in range(20):
            with holder.lock(other, blocking=False):
                pass
        time.sleep(0.2)
        assert attempts == []
        released = time.monotonic()
        held.release()
        until(lambda: got, "the waiter's grant", timeout=RECHECK / 2)
        assert got[0] - released < FAST
    finally:
        pytest.MonkeyPatch().setattr(type(waiter.store), "acquire_steps", real)
    t.join(10)


@pytest.mark.databases("sqlite")
def test_sqlite_a_release_before_the_registration_is_not_missed(
    make_manager: Callable[..., LockManager], key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release's look for registrations comes before the waiter's
    registration (so it sends nothing): the waiter, registered, looks again
    and finds the key free."""
    holder = make_manager()
    waiter = make_manager(**SLOW)
    held = holder.acquire(key)
    entered, gate = threading.Event(), threading.Event()
    real = SocketWaker._watch

    def held_up(self: SocketWaker, k: str) -> bool:
        entered.set()
        gate.wait(30)
        return real(self, k)

    monkeypatch.setattr(SocketWaker, "_watch", held_up)
    t, got = start_waiter(waiter, key)
    assert entered.wait(10)
    released = time.monotonic()
    assert held.release() is True  # nobody registered yet: no datagram
    gate.set()
    until(lambda: got, "the waiter's grant", timeout=RECHECK / 2)
    assert got[0] - released < FAST
    t.join(10)


@pytest.mark.databases("sqlite")
def test_sqlite_a_registration_made_before_the_release_is_rung(
    make_manager: Callable[..., LockManager], key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other order, held at its worst point: the waiter is registered
    but its datagram socket has not read anything yet; the release, which
    finds the registration, rings it, and the datagram waits in the socket."""
    holder = make_manager()
    waiter = make_manager(**SLOW)
    held = holder.acquire(key)
    t, got = start_waiter(waiter, key)
    until(lambda: waker_of(waiter) is not None and waker_of(waiter).covers(key), "registered")
    time.sleep(0.2)
    released = time.monotonic()
    assert held.release() is True
    until(lambda: got, "the waiter's grant", timeout=RECHECK / 2)
    assert got[0] - released < FAST
    t.join(10)


@pytest.mark.databases("mariadb")
def test_mysql_a_release_before_the_probe_is_not_missed(
    make_manager: Callable[..., LockManager], key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release (its DELETE, then its named lock let go) comes after the
    waiter's attempt found the key held but before the waiter blocks on the
    name: the probe finds the name free and tells the waiter to look again."""
    holder = make_manager()
    waiter = make_manager(**SLOW)
    held = holder.acquire(key)
    until(lambda: waker_of(holder) is not None and _named(holder, key), "the holder's name")
    entered, gate = threading.Event(), threading.Event()
    real = waiter.store._wake_connection  # type: ignore[attr-defined]

    def held_up() -> Any:
        entered.set()
        gate.wait(30)
        return real()

    waiter.store._wake_connection = held_up  # type: ignore[attr-defined]
    t, got = start_waiter(waiter, key)
    assert entered.wait(10)
    released = time.monotonic()
    assert held.release() is True
    until(lambda: not _named(holder, key), "the name let go")
    gate.set()
    until(lambda: got, "the waiter's grant", timeout=RECHECK / 2)
    assert got[0] - released < FAST
    t.join(10)


@pytest.mark.databases("mariadb")
def test_mysql_a_waiter_before_the_holder_names_the_key_is_not_missed(
    make_manager: Callable[..., LockManager], key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder has not taken the key's name yet when the waiter probes
    it (the window right after a grant): the waiter polls with backoff until
    the name is held, then sleeps until its release."""
    holder = make_manager()
    waiter = make_manager(notify_recheck=RECHECK, poll_initial=0.005, poll_max=RECHECK)
    gate = threading.Event()
    real = NamedLockWaker.took

    def late(self: NamedLockWaker, k: str) -> None:
        threading.Thread(target=lambda: (gate.wait(30), real(self, k))).start()

    monkeypatch.setattr(NamedLockWaker, "took", late)
    held = holder.acquire(key)
    t, got = start_waiter(waiter, key)
    until(lambda: waker_of(waiter) is not None and waker_of(waiter).covers(key), "the probe")
    time.sleep(0.3)
    assert not got
    gate.set()
    until(lambda: _named(holder, key), "the holder's name")
    time.sleep(0.3)
    released = time.monotonic()
    assert held.release() is True
    until(lambda: got, "the waiter's grant", timeout=RECHECK / 2)
    assert got[0] - released < FAST
    t.join(10)


@pytest.mark.databases("mariadb")
def test_mysql_a_release_tells_its_process_whether_another_waits(
    make_manager: Callable[..., LockManager], key: str
) -> None:
    """The name let go is asked for its new owner in the same statement: a
    waiter of another process blocked on it has it by then. That is what
    lets a run of local grants end for another process (dblock.lock's
    give-way on MySQL), and only when one waits."""
    holder = make_manager()
    waiter = make_manager(**SLOW)
    alone = f"{key}:alone"
    held = holder.acquire(alone)
    _until_named(holder, alone)
    # What the release saw stays "lately" for HOT (1 s): a check of this
    # thread starved for that long by the rest of a loaded run (CI's soak
    # and torture tests beside it) must not miss it.
    waker_of(holder).HOT = 120.0
    held.release()
    until(lambda: not _named(holder, alone), "the name let go")
    assert not holder.store.others_wait(alone)

    held = holder.acquire(key)
    _until_named(holder, key)
    t, got = start_waiter(waiter, key)
    until(lambda: waker_of(waiter) is not None and waker_of(waiter).covers(key), "the probe")
    until(lambda: _blocked_on_a_name(waiter), "the probe blocked on the name")
    assert not holder.store.others_wait(key)
    held.release()
    until(lambda: holder.store.others_wait(key), "the waiter seen at the release")
    until(lambda: got, "the waiter's grant", timeout=RECHECK / 2)
    t.join(10)


@pytest.mark.databases("mariadb")
def test_mysql_a_hot_keys_name_stays_named_across_local_grants(
    make_manager: Callable[..., LockManager], key: str
) -> None:
    """A release while local threads wait for the key keeps its name for the
    next local grant, so a waiter of another process finds the name held
    (and blocks on it) at any moment of a run, and a run's end can ask
    whether it waits. Before: the name was let go at each release and taken
    at each grant; the names thread, starved of the GIL by the local
    threads, held it at few of the moments a waiter looked, and the waiter
    polled with a growing step through runs of hundreds of local grants
    (the turn benchmark: 93 to 99 of 100 runs within 8 local grants, the
    worst 794; after: 99 or 100 in each of 16 batches, the worst 24)."""
    holder = make_manager()
    held = holder.acquire(key)
    _until_named(holder, key)
    waker = waker_of(holder)
    waker.KEEP = 60.0  # (not let go after all while the test looks)
    holder.store.hot(key)  # what a release with local threads queued says first
    held.release()
    time.sleep(0.2)
    assert _named(holder, key), "the name was let go although a local grant follows"
    holder.acquire(key).release()  # the next local grant, then a plain release
    until(lambda: not _named(holder, key), "the name let go once nobody local waits")

    # A run's end asks, on the store's connection, whether another process
    # waits: true while a session holds the key's waiter name.
    name = waker.name(key)
    asking = holder.store.others_wait_steps(key)
    assert asking is not None
    assert holder.store.drive(asking) is False
    with make_manager().engine.connect() as other:
        other.exec_driver_sql(f"SELECT GET_LOCK('{waker.waiter_name(name)}', 0)")
        asking = holder.store.others_wait_steps(key)
        assert asking is not None
        assert holder.store.drive(asking) is True
        assert holder.store.others_wait(key)
        other.exec_driver_sql(f"SELECT RELEASE_LOCK('{waker.waiter_name(name)}')")

    # Kept, but no local grant comes (its waiter gave up): let go after KEEP.
    held = holder.acquire(key)
    _until_named(holder, key)
    waker.KEEP = 0.05
    holder.store.hot(key)
    held.release()
    until(lambda: not _named(holder, key), "the kept name let go after KEEP")


def _blocked_on_a_name(manager: LockManager) -> bool:
    """Whether one of ``manager``'s probe connections waits in GET_LOCK
    right now (the server's own word, not a sleep: MariaDB's state "User
    lock")."""
    ids = [s.thread_id for s in waker_of(manager)._slots if s.thread_id is not None]
    if not ids:
        return False
    with manager.engine.connect() as conn:
        found = conn.exec_driver_sql(
            "SELECT count(*) FROM information_schema.PROCESSLIST "
            f"WHERE STATE = 'User lock' AND ID IN ({', '.join(str(int(i)) for i in ids)})"
        ).scalar_one()
    return bool(found)


def _until_named(manager: LockManager, key: str) -> None:
    """MySQL: until the holder's process holds the key's name (a waiter
    arriving before that polls with backoff, see the test above)."""
    if manager.store.engine.dialect.name != "sqlite":
        until(lambda: waker_of(manager) is not None and _named(manager, key), "the name")


def _named(manager: LockManager, key: str) -> bool:
    waker = waker_of(manager)
    with waker._hmutex:
        return key in waker._have


def test_an_asyncio_waiter_is_woken_by_the_release(db_url: str, key: str) -> None:
    async def main() -> float:
        async with AsyncLockManager(db_url, **SLOW) as waiter, AsyncLockManager(db_url) as holder:
            held = await holder.acquire(key)
            if db_url.startswith("mysql"):
                hsync = holder._locker.store  # type: ignore[attr-defined]
                while not (hsync._waker is not None and key in hsync._waker._have):
                    await asyncio.sleep(0.01)
            task = asyncio.ensure_future(waiter.acquire(key, timeout=60))
            sync = waiter._locker.store  # type: ignore[attr-defined]
            while not (sync._waker is not None and sync._waker.covers(key)):
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)
            released = time.monotonic()
            await held.release()
            got = await asyncio.wait_for(task, RECHECK / 2)
            took = time.monotonic() - released
            await got.release()
            return took

    assert asyncio.run(main()) < FAST


def test_polling_without_notify(make_manager: Callable[..., LockManager], key: str) -> None:
    """``notify=False``: no waker, no side files, no named locks."""
    m = make_manager(notify=False)
    other = make_manager(notify=False)
    with m.lock(key), pytest.raises(LockTimeout):
        other.acquire(key, timeout=0.05)
    assert waker_of(m) is None
    assert waker_of(other) is None
