"""The fair queue on the polling dialects (SQLite, MariaDB/MySQL): a waiter's
poll is one read that tells it its place in the queue and the holder's age,
and its sleep between polls is bounded by both (so it notices moving up)."""

from __future__ import annotations

import os

import pytest

from dblock import LockManager
from dblock._store.base import Grant
from dblock._store.fair import Queued, fair_sql, poll_cap

TTL = 30.0


def test_poll_cap_by_place_and_holder_age() -> None:
    first = Queued(1, "h", 1.0, first=True, ahead=0, held=0.0)
    assert poll_cap(first, 0.008, 0.5) == pytest.approx(0.002)
    # Each place further back looks half as often.
    assert poll_cap(Queued(1, "w", 1.0, ahead=1, held=0.0), 0.008, 0.5) == pytest.approx(0.004)
    assert poll_cap(Queued(1, "w", 1.0, ahead=3, held=0.0), 0.008, 0.5) == pytest.approx(0.016)
    # A long hold is not polled for at the fast rate: a quarter of its age.
    assert poll_cap(Queued(1, "h", 1.0, first=True, held=0.4), 0.008, 0.5) == pytest.approx(0.1)
    # Never above poll_max, however far back or however old the hold.
    assert poll_cap(Queued(1, "w", 1.0, ahead=100, held=0.0), 0.008, 0.5) == 0.5
    assert poll_cap(Queued(1, "h", 1.0, first=True, held=60.0), 0.008, 0.5) == 0.5
    # No holder (the head is free): the place alone.
    assert poll_cap(Queued(1, None, 0.0, first=True), 0.008, 0.5) == pytest.approx(0.002)


@pytest.fixture
def polling_url(db_url: str) -> str:
    """The databases whose fair waiters poll (PostgreSQL's are woken by
    notifications: the tests using this are marked for the other two)."""
    assert not db_url.startswith("postgresql")
    return db_url


@pytest.mark.databases("sqlite", "mariadb")
def test_a_waiter_sees_its_place_and_the_holder(
    polling_url: str, key: str, count_statements: type
) -> None:
    with LockManager(polling_url) as m:
        store = m.store
        sql = fair_sql(store)
        first, second = os.urandom(16).hex(), os.urandom(16).hex()
        held = m.acquire(key)  # the holder
        try:
            a = store.drive(sql.enter_steps(key, first, "first-owner", TTL, enqueue=True))
            b = store.drive(sql.enter_steps(key, second, "second-owner", TTL, enqueue=True))
            assert isinstance(a, Queued)
            assert isinstance(b, Queued)
            assert a.ticket < b.ticket
            assert (a.first, a.ahead, a.owner) == (True, 0, held.owner)
            assert a.held is not None
            assert a.held >= 0
            assert (b.first, b.ahead, b.owner) == (False, 1, "first-owner")

            # A poll that does not take the head (nor needs to renew) is one read.
            with count_statements(m.engine) as c:
                again = store.drive(sql.turn_steps(key, second, b.ticket, "second-owner", TTL))
            assert isinstance(again, Queued)
            assert (again.ahead, again.first) == (1, False)
            assert c.count == 1
            assert c.statements[0].lstrip().upper().startswith("SELECT")

            held.release()
            got = store.drive(sql.turn_steps(key, first, a.ticket, "first-owner", TTL))
            assert isinstance(got, Grant)
            # The second waiter moved up: first now, behind the new holder.
            moved = store.drive(sql.turn_steps(key, second, b.ticket, "second-owner", TTL))
            assert isinstance(moved, Queued)
            assert (moved.first, moved.ahead, moved.owner) == (True, 0, "first-owner")
            # One waiter's queue row remains, beside (on MariaDB, which keeps
            # it to the release) the new holder's own.
            queued = [r.token for r in store.rows(key=key) if r.slot.startswith("q")]
            assert [t for t in queued if t != first] == [second]
            lingers = getattr(store, "returning", False) and not getattr(store, "galera", False)
            assert len(queued) == (2 if lingers else 1)
        finally:
            if not held.released:
                held.release()
            store.drive(sql.leave_steps(key, first))
            store.drive(sql.leave_steps(key, second))
        assert store.rows(key=key) == []
