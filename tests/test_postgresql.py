"""PostgreSQL specifics: LISTEN/NOTIFY wake-ups and a quiet server log."""

from __future__ import annotations

import logging
import threading
import time
import uuid

import pytest
import sqlalchemy as sa

from dblock import LockBusy, LockManager
from tests.support.counting import StatementCounter
from tests.support.notify import until

pytestmark = pytest.mark.databases("postgresql")


def test_contention_raises_no_server_errors(make_manager: object, key: str) -> None:
    """Duplicate keys are settled by ON CONFLICT, never by an error: a failed
    statement is what the server would log, and none fails."""
    managers = [make_manager(local_filter=False) for _ in range(4)]  # type: ignore[operator]
    errors: list[object] = []
    counters = [StatementCounter(m.engine).__enter__() for m in managers]
    for m in managers:
        sa.event.listen(m.engine, "handle_error", lambda ctx: errors.append(ctx.original_exception))
    busy = 0

    def hammer(m: LockManager) -> None:
        nonlocal busy
        for _ in range(50):
            try:
                with m.lock(key, blocking=False):
                    time.sleep(0.0005)
            except LockBusy:
                busy += 1

    threads = [threading.Thread(target=hammer, args=(m,)) for m in managers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert busy > 0  # there was contention
    assert sum(c.count for c in counters) >= 200
    assert errors == []


def test_waiter_is_woken_by_notify_not_polling(make_manager: object, key: str) -> None:
    holder = make_manager()  # type: ignore[operator]
    waiter = make_manager(notify_recheck=30.0)  # type: ignore[operator]
    held = holder.acquire(key)
    done = threading.Event()
    with StatementCounter(waiter.engine) as c:

        def wait() -> None:
            with waiter.lock(key, timeout=30):
                done.set()

        t = threading.Thread(target=wait)
        t.start()
        # Two attempts: this manager's first wait started its listener after
        # the first attempt, so the attempt is repeated once LISTEN is active
        # (a release in between would otherwise go unseen) ...
        _until(lambda: _subscribed(waiter, key) and c.count == 2 and c.in_flight == 0)
        attempts = c.count
        time.sleep(1.0)
        assert c.count == attempts  # ... then silence until notified
        released = time.monotonic()
        held.release()
        assert done.wait(10)
        woke_after = time.monotonic() - released
        t.join(10)
    assert c.count == attempts + 2  # the winning attempt and the release
    assert woke_after < 1.0


def test_listener_is_one_connection_per_manager_and_stops_on_close(
    db_url: str, keys: object
) -> None:
    # Listeners of earlier tests' managers may still be on their way out
    # (a loaded run saw one starting): count only these two managers'.
    before = set(threading.enumerate())
    holder = LockManager(db_url)
    waiter = LockManager(db_url)
    names = keys(4)  # type: ignore[operator]
    held = [holder.acquire(k) for k in names]
    threads = [
        threading.Thread(target=lambda k=k: waiter.acquire(k, timeout=30).release()) for k in names
    ]
    for t in threads:
        t.start()
    _until(lambda: all(_subscribed(waiter, k) for k in names))
    listeners = [
        t for t in threading.enumerate() if t.name == "dblock-listener" and t not in before
    ]
    ours = {getattr(m.store.listener(), "_thread", None) for m in (holder, waiter)} - {None}
    assert len(ours) == 1, "one listener, the waiter's"
    assert len(ours & set(listeners)) == 1, listeners
    (mine,) = ours
    for h in held:
        h.release()
    for t in threads:
        t.join(30)
    waiter.close()
    holder.close()
    mine.join(5)
    assert not mine.is_alive()


def test_listener_survives_its_connection_being_killed(
    db_url: str, make_manager: object, key: str
) -> None:
    holder = make_manager()  # type: ignore[operator]
    # A name of its own, so we kill our listener and nobody else's on the shared server.
    app = f"dblock-test-{uuid.uuid4().hex[:12]}"
    waiter = make_manager(  # type: ignore[operator]
        engine_options={"connect_args": {"application_name": app}}
    )
    held = holder.acquire(key)
    got = threading.Event()

    def wait() -> None:
        with waiter.lock(key, timeout=30):
            got.set()

    t = threading.Thread(target=wait)
    t.start()
    _until(lambda: _subscribed(waiter, key))
    admin = sa.create_engine(db_url)
    listening = sa.text(
        "SELECT pid FROM pg_stat_activity WHERE application_name = :app "
        "AND (query LIKE 'LISTEN %' OR query LIKE '%pg_advisory_%lock_shared%')"
    )  # the listener's last statement: its LISTEN, or a registration of waited-for keys

    def listeners() -> list[int]:
        # A connection per look: pg_stat_activity is a snapshot per transaction.
        with admin.connect() as conn:
            return list(conn.execute(listening, {"app": app}).scalars())

    (first,) = listeners()
    with admin.connect() as conn:
        assert conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": first}).scalar()
    # The listener notices, reconnects and listens again on a new backend ...
    _until(lambda: listeners() not in ([], [first]))
    admin.dispose()
    _until(lambda: waiter.store._listener.listening)
    # ... and the release notification reaches the waiter through it.
    released = time.monotonic()
    held.release()
    assert got.wait(10)
    assert time.monotonic() - released < waiter.config.notify_recheck
    t.join(10)


def _subscribed(manager: LockManager, key: str) -> bool:
    listener = manager.store._listener  # type: ignore[attr-defined]
    return listener is not None and listener.listening and key in listener._subs


def _until(condition: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_listener_connects_when_the_pool_has_no_room(
    make_manager: object, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A pool of one connection and no overflow: the connection the waiter's
    first attempt used stays idle with the statements, yet the LISTEN
    connection gets in at once instead of waiting out the pool's timeout."""
    holder = make_manager()  # type: ignore[operator]
    waiter = make_manager(  # type: ignore[operator]
        engine_options={"pool_size": 1, "max_overflow": 0, "pool_timeout": 2}
    )
    held = holder.acquire(key)
    got = threading.Event()

    def wait() -> None:
        with waiter.lock(key, timeout=30):
            got.set()

    t = threading.Thread(target=wait)
    t.start()
    with caplog.at_level(logging.WARNING, logger="dblock"):
        _until(lambda: _subscribed(waiter, key), seconds=6)
        held.release()
        assert got.wait(10)
        t.join(10)
    assert not [r for r in caplog.records if "LISTEN connection failed" in r.getMessage()]


def test_a_deadlock_victim_is_run_again_not_raised(make_manager: object, key: str) -> None:
    """PostgreSQL rolls a deadlock victim's transaction back whole, and each
    of dblock's statements is its own: it is run again, not raised as a
    ``BackendError`` (a contender in the signal storm met one). Here the
    renewal of two rows locks the first, then waits for the second, held by
    another session's transaction, which then wants the first: the renewal's
    server process finds the cycle after its ``deadlock_timeout`` (1 s, the
    other session's is 10 s) and cancels its own statement."""
    m = make_manager(renew=False)  # type: ignore[operator]
    a, b = m.acquire(f"{key}:a", ttl=60), m.acquire(f"{key}:b", ttl=60)
    table = m.store.quoted(m.store.names.table)
    other = sa.create_engine(m.engine.url, poolclass=sa.pool.NullPool)
    count = sa.text("SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
    leases: dict[str, object] = {}
    try:
        with other.connect() as conn:
            before = conn.execute(count).scalar()
            conn.execute(sa.text("SET deadlock_timeout = '10s'"))
            conn.execute(
                sa.text(f"UPDATE {table} SET owner = owner WHERE lock_key = :k"), {"k": f"{key}:b"}
            )
            locks = [(f"{key}:a", a.token, 60.0), (f"{key}:b", b.token, 60.0)]
            renewal = threading.Thread(
                target=lambda: leases.update(m.store.drive(m.store.renew_steps(locks)))
            )
            renewal.start()
            time.sleep(0.3)  # the renewal holds a's row and waits for b's
            conn.execute(
                sa.text(f"UPDATE {table} SET owner = owner WHERE lock_key = :k"), {"k": f"{key}:a"}
            )
            conn.commit()
        renewal.join(10)
        assert not renewal.is_alive()
        assert set(leases) == {a.token, b.token}
        with other.connect() as conn:
            # There was a victim, and it was the renewal (the statistics
            # collector reports within a second or so).
            until(lambda: conn.execute(count).scalar() > before, "the deadlock to be counted")
    finally:
        other.dispose()
        a.release()
        b.release()
