"""MariaDB's fair release hands the head to the first live waiter in one
statement (``MySQLFair._hand_over``): the waiter's next look finds the head
carrying its token, with a fence above every earlier one of the key, and no
row is left behind by either side, whatever the waiter does meanwhile."""

from __future__ import annotations

import os
import queue
import threading
import time

import pytest
import sqlalchemy as sa

from dblock import LockManager
from dblock._store.base import Grant
from dblock._store.fair import DROPPED, Queued, fair_sql
from tests.support.proxy import Proxy

pytestmark = pytest.mark.databases("mariadb")

TTL = 30.0


def _rows(m: LockManager, key: str) -> list[tuple[str, str, bool]]:
    """(slot, token, live) of each row of ``key``."""
    return [(r.slot, r.token, r.expires_at > r.now) for r in m.store.rows(key=key)]


def _hold(m: LockManager, key: str) -> tuple[str, int]:
    """Take the head as a fair request would (its token, its fence)."""
    token = os.urandom(16).hex()
    got = m.store.drive(fair_sql(m.store).enter_steps(key, token, "holder", TTL, enqueue=False))
    assert isinstance(got, Grant)
    return token, got.fence


def _queue_behind(m: LockManager, key: str, *tokens: str) -> list[int]:
    sql = fair_sql(m.store)
    tickets = []
    for token in tokens:
        got = m.store.drive(sql.enter_steps(key, token, f"owner-{token[:4]}", TTL, enqueue=True))
        assert isinstance(got, Queued)
        tickets.append(got.ticket)
    return tickets


def test_a_release_hands_the_head_to_the_first_waiter(
    db_url: str, key: str, count_statements: type
) -> None:
    with LockManager(db_url) as m:
        sql, store = fair_sql(m.store), m.store
        first, second = os.urandom(16).hex(), os.urandom(16).hex()
        holder, fence = _hold(m, key)
        a, b = _queue_behind(m, key, first, second)
        # Taken from the queue: the release hands it on (queued=True).
        assert store.drive(sql.release_steps(key, holder, queued=True))
        # The first waiter's next look is its grant: one read, no write.
        with count_statements(m.engine) as c:
            got = store.drive(sql.turn_steps(key, first, a, "owner", TTL))
        assert isinstance(got, Grant)
        assert got.fence > fence
        assert got.expires_in > 0
        assert c.count == 1
        # The second waiter now waits behind it, not behind its queue row.
        behind = store.drive(sql.turn_steps(key, second, b, "owner", TTL))
        assert isinstance(behind, Queued)
        assert (behind.first, behind.ahead) == (True, 0)
        # Its release hands on again, and leaves nothing of its own.
        assert store.drive(sql.release_steps(key, first, queued=True))
        assert not [r for r in _rows(m, key) if r[1] == first]
        again = store.drive(sql.turn_steps(key, second, b, "owner", TTL))
        assert isinstance(again, Grant)
        assert again.fence > got.fence
        # The last, with nobody to hand it to, is released.
        assert store.drive(sql.release_steps(key, second, queued=True))
        assert _rows(m, key) == []


def test_a_release_seats_the_next_local_thread_at_the_tail(db_url: str, key: str) -> None:
    with LockManager(db_url) as m:
        sql, store = fair_sql(m.store), m.store
        waiter, seat = os.urandom(16).hex(), os.urandom(16).hex()
        holder, _ = _hold(m, key)
        assert sql.seats_on_release  # (known once the server was asked)
        (ticket,) = _queue_behind(m, key, waiter)
        released, lease = store.drive(
            sql.release_seating_steps(key, holder, seat, "seat-owner", TTL, queued=False)
        )
        assert released
        assert lease is not None
        assert lease.fence > ticket  # at the tail
        rows = _rows(m, key)
        assert ("", waiter, True) in rows
        assert (f"q~{seat}", seat, True) in rows
        assert not [r for r in rows if r[1] == holder]
        store.drive(sql.leave_steps(key, waiter))
        got = store.drive(sql.turn_steps(key, seat, lease.fence, "seat-owner", TTL))
        assert isinstance(got, Grant)
        store.drive(sql.leave_steps(key, seat))
        assert _rows(m, key) == []


def test_a_waiter_leaving_as_the_head_is_handed_to_it_frees_the_key(db_url: str, key: str) -> None:
    """The waiter gave up (its leave deletes every row of its token) just as
    the release handed it the head: nothing stays taken."""
    with LockManager(db_url) as m, LockManager(db_url) as other:
        sql, store = fair_sql(m.store), m.store
        waiter = os.urandom(16).hex()
        holder, _ = _hold(m, key)
        _queue_behind(m, key, waiter)
        assert store.drive(sql.release_steps(key, holder, queued=True))
        assert [r[1] for r in _rows(m, key) if r[0] == ""] == [waiter]
        assert store.drive(sql.leave_steps(key, waiter))  # the head was among them
        assert _rows(m, key) == []
        with other.lock(key, fair=True, blocking=False):
            pass


def test_a_handed_head_is_ours_for_the_queue_row_lease_then_taken_over(
    db_url: str, key: str
) -> None:
    """A waiter paused past its queue row's lease gets a head with that
    lease: it runs out, the waiter's look drops it, and the next waiter
    takes the key over."""
    with LockManager(db_url) as m:
        sql, store = fair_sql(m.store), m.store
        slow, next_one = os.urandom(16).hex(), os.urandom(16).hex()
        holder, _ = _hold(m, key)
        got = store.drive(sql.enter_steps(key, slow, "slow", 0.3, enqueue=True))
        assert isinstance(got, Queued)
        (b,) = _queue_behind(m, key, next_one)
        assert store.drive(sql.release_steps(key, holder, queued=True))
        time.sleep(0.5)  # the slow waiter's lease (and so its head's) runs out
        # Its queue row (and the head, which took that row's lease) ran out:
        # it has lost its place, whatever it was handed.
        assert store.drive(sql.turn_steps(key, slow, got.ticket, "slow", 0.3)) is DROPPED
        taken = store.drive(sql.turn_steps(key, next_one, b, "next", TTL))
        if isinstance(taken, Queued):  # the expired head was deleted: look again
            taken = store.drive(sql.turn_steps(key, next_one, b, "next", TTL))
        assert isinstance(taken, Grant)
        store.drive(sql.leave_steps(key, slow))
        store.drive(sql.leave_steps(key, next_one))
        assert _rows(m, key) == []


def test_a_failed_hand_over_leaves_no_queue_row_behind(db_url: str, key: str) -> None:
    """The holder (granted from the queue, so its queue row is still there)
    loses its connection as it sends the hand-over: the clean-up deletes
    both its rows once the database answers, so the next fair request is
    not held up by a live queue row for the rest of its lease."""
    url = sa.make_url(db_url)
    proxy = Proxy(url.host or "127.0.0.1", url.port or 0)
    try:
        with (
            LockManager(db_url) as first,
            LockManager(proxy.url_for(db_url), poll_max=0.05) as cut,
            LockManager(db_url) as last,
        ):
            held = first.acquire(key, fair=True)
            granted: queue.Queue[str] = queue.Queue()
            go: queue.Queue[None] = queue.Queue()
            released: queue.Queue[object] = queue.Queue()

            def hold() -> None:
                mine = cut.acquire(key, fair=True, timeout=10)
                granted.put(mine.token)
                go.get(timeout=10)
                try:
                    released.put(mine.release())
                except BaseException as exc:
                    released.put(exc)

            t = threading.Thread(target=hold)
            t.start()
            deadline = time.monotonic() + 10
            while not [r for r in _rows(first, key) if r[0].startswith("q")]:
                assert time.monotonic() < deadline, "the waiter never queued"
                time.sleep(0.01)
            held.release()
            token = granted.get(timeout=10)
            # Granted from the queue: its head and its queue row.
            assert len([r for r in _rows(first, key) if r[1] == token]) == 2
            proxy.cut_before(b"ON DUPLICATE KEY UPDATE")
            go.put(None)
            assert released.get(timeout=10) is False  # the release failed (logged)
            t.join(10)
            with cut.lock(f"{key}:other"):  # its next statement settles the orphan
                pass
            with last.lock(key, fair=True, timeout=5):
                pass
            assert _rows(first, key) == []
    finally:
        proxy.close()
