"""Release notifications per key bucket (PostgreSQL).

A release notifies the channel of its key's bucket (``<table>:<n>``, ``n``
computed by the statement), and a process LISTENs only to the buckets of
the keys its waiters wait for. These tests count what a process's listener
hears (``Listener.received``): nothing of a bucket it has no waiter in,
including once its last waiter of a bucket left (UNLISTEN), and the release
again once a new waiter comes (LISTEN). A LISTEN connection killed while
waiters wait LISTENs again to every bucket with waiters, and no release is
missed, even one made while it was gone. With one channel per table, every
process heard every release: the counting tests fail. A process of an
earlier version, notifying the table's one channel, still wakes a waiter.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from dblock import LockLost, LockManager
from dblock._store.postgresql import Listener
from tests.support.notify import (
    Heard,
    bucket_of,
    conninfo,
    listener_of,
    registered,
    start_waiter,
    until,
)

pytestmark = pytest.mark.databases("postgresql")

# Long enough that a waiter woken by its periodic re-check, or polling,
# fails the test: wake-ups must come from notifications.
RECHECK = 30.0


def old_channel_notify(url: str, manager: LockManager, payload: str) -> None:
    """What a process of an earlier version sends on release."""
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, %s)", (manager.store.names.channel, payload))


def in_distinct_buckets(url: str, candidates: list[str], n: int) -> list[str]:
    chosen: dict[int, str] = {}
    for key in candidates:
        chosen.setdefault(bucket_of(url, key), key)
        if len(chosen) == n:
            return list(chosen.values())
    raise AssertionError("not enough distinct buckets")


def test_a_process_hears_nothing_of_a_bucket_it_does_not_wait_in(
    db_url: str, make_manager: Callable[..., LockManager], keys: Any
) -> None:
    mine, theirs = in_distinct_buckets(db_url, keys(10), 2)
    holder = make_manager()
    a = make_manager(notify_recheck=RECHECK, poll_max=RECHECK)
    b = make_manager(notify_recheck=RECHECK, poll_max=RECHECK)
    held_mine = holder.acquire(mine)
    ta, got_a = start_waiter(a, mine)
    until(lambda: registered(a, mine), "a's registration")
    heard_by_a = listener_of(a).received
    for _ in range(5):  # releases of a key b waits for: each one notifies
        held = holder.acquire(theirs)
        tb, got_b = start_waiter(b, theirs)
        until(lambda: registered(b, theirs), "b's registration")
        time.sleep(0.05)
        held.release()
        until(lambda: got_b, "b's grant", timeout=RECHECK / 2)  # noqa: B023
        tb.join(10)
    assert listener_of(b).received >= 5
    assert listener_of(a).received == heard_by_a  # not one of the other bucket's
    assert listener_of(a)._listened == {bucket_of(db_url, mine)}
    released = time.monotonic()
    held_mine.release()
    until(lambda: got_a, "a's grant", timeout=RECHECK / 2)
    assert got_a[0] - released < 1.0
    ta.join(10)


def test_a_bucket_is_unlistened_when_its_last_waiter_leaves_and_listened_again(
    db_url: str, make_manager: Callable[..., LockManager], key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Listener, "KEY_LINGER", 0.2)
    holder = make_manager()
    waiter = make_manager(notify_recheck=RECHECK, poll_max=RECHECK)
    other = make_manager(notify_recheck=RECHECK, poll_max=RECHECK)
    bucket = bucket_of(db_url, key)
    held = holder.acquire(key)
    t, got = start_waiter(waiter, key)
    until(lambda: registered(waiter, key), "the registration")
    listener = listener_of(waiter)
    assert bucket in listener._listened
    held.release()
    until(lambda: got, "the grant", timeout=RECHECK / 2)
    t.join(10)
    # Its last waiter gone, the key is dropped after KEY_LINGER and its bucket with it.
    until(lambda: bucket not in listener._listened, "the UNLISTEN")
    assert not registered(waiter, key)
    # On the server too: a release another process waits for reaches us no more.
    heard = listener.received
    held = holder.acquire(key)
    t, got = start_waiter(other, key)
    until(lambda: registered(other, key), "the other process's registration")
    time.sleep(0.05)
    held.release()
    until(lambda: got, "the other process's grant", timeout=RECHECK / 2)
    t.join(10)
    # Nor the old channel of earlier versions: the session LISTENs to
    # nothing, so the server no longer signals it at every notifying commit.
    old_channel_notify(db_url, waiter, key)
    time.sleep(0.2)
    assert listener.received == heard
    # A new waiter: its bucket is listened to again, and the release wakes it.
    held = holder.acquire(key)
    t, got = start_waiter(waiter, key)
    until(lambda: registered(waiter, key), "the registration again")
    assert bucket in listener._listened
    before = listener.received
    old_channel_notify(db_url, waiter, f"{key}:nobody's")  # listened to again, with the bucket
    until(lambda: listener.received > before, "the old channel's notification")
    time.sleep(0.1)
    released = time.monotonic()
    held.release()
    until(lambda: got, "the grant", timeout=RECHECK / 2)
    assert got[0] - released < 1.0
    assert listener.received > heard
    t.join(10)


def test_a_killed_listen_connection_listens_again_to_every_bucket(
    db_url: str,
    make_manager: Callable[..., LockManager],
    keys: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The listener's backend terminated while three waiters (three buckets)
    wait; it stays away while one key is released (its notification is
    lost), then comes back: it LISTENs again to the buckets of every key
    still waited for, the key released meanwhile is found, and the others'
    releases are heard, by waiters polling no longer."""
    app = f"dblock-test-{uuid.uuid4().hex[:12]}"  # so we kill our listener only
    names = in_distinct_buckets(db_url, keys(20), 3)
    holder = make_manager()
    waiter = make_manager(
        notify_recheck=RECHECK,
        poll_max=RECHECK,
        engine_options={"connect_args": {"application_name": app}},
    )
    held = {k: holder.acquire(k) for k in names}
    waiting = {k: start_waiter(waiter, k) for k in names}
    until(lambda: all(registered(waiter, k) for k in names), "the registrations")
    listener = listener_of(waiter)
    assert listener._listened == {bucket_of(db_url, k) for k in names}
    gate = threading.Event()
    real = Listener._connect

    def held_back(self: Listener) -> Any:
        gate.wait(30)
        return real(self)

    monkeypatch.setattr(Listener, "_connect", held_back)
    admin = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        killed = conn.execute(
            sa.text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = :app "
                "AND (query LIKE 'LISTEN %' OR query LIKE '%lock_shared%')"
            ),
            {"app": app},
        ).scalars()
        assert list(killed) == [True]
    admin.dispose()
    until(lambda: not listener.listening, "the listener to notice")
    first, *rest = names
    held.pop(first).release()  # heard by nobody: the listener is away
    # A long outage: the waiters poll meanwhile, their backoff grown past a
    # second by its end; the listener back wakes them all the same.
    time.sleep(2.0)
    gate.set()
    until(lambda: waiting[first][1], "the first grant", timeout=RECHECK / 2)
    # (Listening again only once the new session's registrations were cleared.)
    until(
        lambda: listener.listening and all(registered(waiter, k) for k in rest),
        "the registrations again",
    )
    assert {bucket_of(db_url, k) for k in rest} <= listener._listened
    time.sleep(0.1)
    released = time.monotonic()
    for key in rest:
        held.pop(key).release()
    for key in rest:
        until(lambda: waiting[key][1], "the grants", timeout=RECHECK / 2)  # noqa: B023
        assert waiting[key][1][0] - released < 1.0
    for t, _ in waiting.values():
        t.join(10)


def test_a_release_by_an_earlier_version_still_wakes_a_waiter(
    db_url: str, make_manager: Callable[..., LockManager], key: str
) -> None:
    """A rolling upgrade: a process of an earlier version releases the way
    it did, on the table's one channel; the listener still LISTENs to it."""
    holder = make_manager()
    waiter = make_manager(notify_recheck=RECHECK, poll_max=RECHECK)
    held = holder.acquire(key)
    t, got = start_waiter(waiter, key)
    until(lambda: registered(waiter, key), "the registration")
    time.sleep(0.1)
    names = holder.store.names
    with psycopg.connect(conninfo(db_url), autocommit=True) as old:
        released = time.monotonic()
        old.execute(
            f"WITH gone AS (DELETE FROM {names.table} WHERE lock_key = %s AND token = %s "
            f"RETURNING lock_key) SELECT pg_notify(%s, lock_key) FROM gone",
            (key, held.token, names.channel),
        )
    held.state.released = True  # released by hand above
    until(lambda: got, "the grant", timeout=RECHECK / 2)
    assert got[0] - released < 1.0
    t.join(10)


def test_every_announcement_goes_to_the_bucket_of_its_key(
    db_url: str, private: LockManager, make_manager: Callable[..., LockManager], keys: Any
) -> None:
    """Each statement that announces a key computes its bucket itself: the
    exclusive lock's release (when waited for), ``dblock release --force``,
    the sweeper's DELETE, a semaphore permit's release, the read-write
    lock's releases, the fair queue's release."""
    from dblock.contrib._admin import force_release, sweep

    ear = Heard(db_url, private)
    prefix = private.store.names.channel_prefix

    def announced(key: str) -> bool:
        return (f"{prefix}{bucket_of(db_url, key)}", key) in ear.notes()

    try:
        waited, forced, swept, permit, written, read, fair = keys(7)
        # Released while another process waits for it (registered).
        waiter = make_manager(table=private.store.names.table, notify_recheck=RECHECK)
        held = private.acquire(waited)
        t, got = start_waiter(waiter, waited)
        until(lambda: registered(waiter, waited), "the registration")
        held.release()
        until(lambda: got, "the grant", timeout=RECHECK / 2)
        t.join(10)
        assert announced(waited)
        held = private.acquire(forced)
        assert force_release(private, forced)
        assert announced(forced)
        with contextlib.suppress(LockLost):
            held.release()
        held = private.acquire(swept, ttl=0.2)  # kept: a dropped handle is released
        time.sleep(0.4)
        assert sweep(private) >= 1
        assert announced(swept)
        with contextlib.suppress(LockLost):
            held.release()
        with private.semaphore(permit, permits=2):
            pass
        assert announced(permit)
        with private.write_lock(written):
            pass
        assert announced(written)
        with private.read_lock(read):
            pass
        assert announced(read)
        with private.lock(fair, fair=True):
            pass
        assert announced(fair)
    finally:
        ear.close()
