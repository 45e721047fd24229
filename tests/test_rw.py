"""The read-write lock on every database, within one process: two managers
stand for two processes (each has its own level 1, so they meet only in the
table)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from dblock import (
    HeldLock,
    KindMismatch,
    LockBusy,
    LockLost,
    LockManager,
    LockTimeout,
    UpgradeRefused,
)
from dblock.kinds.rw import RwHeld


def head(manager: LockManager, key: str) -> Any:
    table = manager.store.table
    with manager.engine.connect() as conn:
        return conn.execute(
            sa.select(table).where(table.c.lock_key == key, table.c.slot == "")
        ).first()


def rows(manager: LockManager, key: str) -> list[Any]:
    table = manager.store.table
    with manager.engine.connect() as conn:
        return list(conn.execute(sa.select(table).where(table.c.lock_key == key)))


def wait_for(condition: Any, what: str, bound: float = 30.0) -> None:
    deadline = time.monotonic() + bound
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_readers_share_across_managers_and_exclude_writers(make_manager: Any, key: str) -> None:
    a, b, c = make_manager(), make_manager(), make_manager()
    with a.read_lock(key) as r1, b.read_lock(key) as r2:
        assert isinstance(r1, HeldLock)
        assert isinstance(r1, RwHeld)
        assert r1.mode == r2.mode == "read"
        assert r2.fence > r1.fence
        row = head(a, key)
        assert (row.kind, row.mode, row.holders) == ("rw", "read", 2)
        with pytest.raises(LockBusy) as info, c.write_lock(key, blocking=False):
            pass
        assert info.value.level == 2
    assert head(a, key) is None
    with c.write_lock(key, blocking=False) as w:
        assert w.mode == "write"
        assert w.fence > r2.fence
        with pytest.raises(LockBusy), a.read_lock(key, blocking=False):
            pass
        with pytest.raises(LockTimeout), b.write_lock(key, timeout=0.2):
            pass
    assert rows(a, key) == []


def test_local_readers_share_one_database_hold(manager: LockManager, key: str) -> None:
    inside = threading.Barrier(4, timeout=30)
    fences: list[int] = []

    def read() -> None:
        with manager.read_lock(key) as held:
            fences.append(held.fence)
            inside.wait()  # all four hold the read lock at once
            inside.wait()

    pool = [threading.Thread(target=read) for _ in range(3)]
    for t in pool:
        t.start()
    with manager.read_lock(key) as mine:
        inside.wait()
        row = head(manager, key)
        assert row.holders == 1  # one shared hold for the whole process
        inside.wait()
    for t in pool:
        t.join()
    assert set(fences) == {mine.fence}
    assert head(manager, key) is None


def test_reentrant_per_owner(manager: LockManager, key: str) -> None:
    with manager.read_lock(key) as r:
        with manager.read_lock(key) as again:
            assert again is r
        assert not r.released
    assert r.released
    with manager.write_lock(key) as w:
        with manager.write_lock(key) as again_w:
            assert again_w is w
        assert not w.released
    assert w.released
    assert head(manager, key) is None


def test_upgrade_is_refused_without_sql(
    manager: LockManager, key: str, count_statements: Any
) -> None:
    with manager.read_lock(key), count_statements(manager.engine) as counter:
        with pytest.raises(UpgradeRefused) as info, manager.write_lock(key):
            pass
        assert counter.count == 0
        assert key in str(info.value)
        assert "read lock" in str(info.value)
    # Refusal left nothing behind: the write lock is free now.
    with manager.write_lock(key, blocking=False):
        pass


def test_writer_reads_its_key_and_downgrades(make_manager: Any, key: str) -> None:
    a, b, c = make_manager(), make_manager(), make_manager()
    w = a.write_lock(key).__enter__()
    r = a.read_lock(key).__enter__()  # a writer may read its own key
    assert r.fence == w.fence
    with pytest.raises(LockBusy), b.read_lock(key, blocking=False):
        pass
    w.release()  # the downgrade: still reading, and other readers may join now
    row = head(a, key)
    assert (row.mode, row.holders) == ("read", 1)
    with b.read_lock(key, blocking=False) as other:
        assert other.fence > r.fence
        with pytest.raises(LockBusy), c.write_lock(key, blocking=False):
            pass
    assert not r.lost
    r.release()
    assert head(a, key) is None
    with b.write_lock(key, blocking=False):
        pass


def test_waiting_writer_holds_new_readers_back(make_manager: Any, key: str) -> None:
    a, b, c = make_manager(), make_manager(), make_manager()
    r = a.read_lock(key).__enter__()
    got: list[RwHeld] = []

    def write() -> None:
        with b.write_lock(key, timeout=60) as w:
            got.append(w)

    writer = threading.Thread(target=write)
    writer.start()
    # Once the writer's intent row is there, new readers wait behind it.
    wait_for(lambda: any(row.mode == "waiting" for row in rows(a, key)), "the intent row")
    with pytest.raises(LockBusy), c.read_lock(key, blocking=False):
        pass
    r.release()
    writer.join(60)
    assert got
    assert got[0].fence > r.fence
    assert rows(a, key) == []  # the intent row went with the grant


def test_local_writer_holds_local_readers_back(manager: LockManager, key: str) -> None:
    r = manager.read_lock(key).__enter__()
    events: list[str] = []
    queued = threading.Event()

    def write() -> None:
        queued.set()
        with manager.write_lock(key, timeout=60):
            events.append("write")

    def read() -> None:
        with manager.read_lock(key, timeout=60):
            events.append("read")

    writer = threading.Thread(target=write)
    writer.start()
    queued.wait(30)
    wait_for(lambda: manager._rw is not None and manager._rw._entries[key].queue, "the writer")
    reader = threading.Thread(target=read)
    reader.start()
    wait_for(lambda: len(manager._rw._entries[key].queue) == 2, "the reader")  # type: ignore[union-attr]
    r.release()
    writer.join(60)
    reader.join(60)
    assert events == ["write", "read"]


def test_lease_loss_is_reported(make_manager: Any, key: str) -> None:
    a, b = make_manager(renew=False), make_manager()
    lost: list[HeldLock] = []
    r = a.read_lock(key, ttl=0.5, on_lost=lost.append).__enter__()
    with b.write_lock(key, timeout=30) as w:  # granted once the reader's lease ran out
        assert w.fence > r.fence
    wait_for(lambda: r.lost, "the reader to learn it lost the lock")
    with pytest.raises(LockLost):
        r.release()
    wait_for(lambda: lost == [r], "on_lost")
    w2 = a.write_lock(key, ttl=0.5).__enter__()
    with b.read_lock(key, timeout=30):
        pass
    with pytest.raises(LockLost):
        w2.release()


def test_renewal_keeps_a_read_lock(make_manager: Any, key: str) -> None:
    a, b = make_manager(), make_manager()
    with a.read_lock(key, ttl=0.6) as r:
        first = r.expires_at
        wait_for(lambda: r.expires_at > first, "a renewal")
        with pytest.raises(LockBusy), b.write_lock(key, blocking=False):
            pass
        r.extend(5)
        assert head(a, key).expires_at >= r.expires_at.replace(microsecond=0)
    assert not r.lost


def test_kind_mismatch(make_manager: Any, key: str) -> None:
    a, b = make_manager(), make_manager()
    with a.lock(key):
        with pytest.raises(KindMismatch) as info, b.read_lock(key, blocking=False):
            pass
        assert info.value.requested == "rw"
    with a.read_lock(key), pytest.raises(KindMismatch), b.lock(key, blocking=False):
        pass


def test_decorator(manager: LockManager, key: str) -> None:
    seen: list[Any] = []

    @manager.read_lock(key)
    def read(x: int) -> int:
        seen.append(head(manager, key).mode)
        return x + 1

    @manager.write_lock(key)
    def write() -> None:
        seen.append(head(manager, key).mode)

    assert read(1) == 2
    write()
    assert seen == ["read", "write"]


def test_uncontended_cycle_is_one_statement_each_way(
    manager: LockManager, key: str, count_statements: Any
) -> None:
    with manager.read_lock(key):  # the first use reads the server's capabilities
        pass
    with count_statements(manager.engine) as counter:
        held = manager.read_lock(key).__enter__()
        assert counter.count == 1
        held.release()
        assert counter.count == 2
        held = manager.write_lock(key).__enter__()
        held.release()
        assert counter.count == 4


def test_fences_grow_with_every_grant(make_manager: Any, key: str) -> None:
    a, b = make_manager(), make_manager()
    fences = []
    for _ in range(3):
        with a.read_lock(key) as r1, b.read_lock(key) as r2:
            fences += [r1.fence, r2.fence]
        with b.write_lock(key) as w:
            fences.append(w.fence)
    assert fences == sorted(fences)
    assert len(set(fences)) == len(fences)


def test_sweeper_deletes_a_dead_read_phase_and_intent(private: LockManager, key: str) -> None:
    """Rows of a read phase whose holders are gone (lease over) and a waiting
    writer's intent row are expired rows like any other: swept."""
    from dblock.sweeper import Sweeper

    r = private.read_lock(key, ttl=0.3).__enter__()  # `private` does not renew
    statements = private._rw_locker().statements
    private.store.drive(statements.intent_steps(key, "f" * 32, "a writer", 0.3))
    wait_for(lambda: r.lost, "the lease to run out")
    sweeper, swept = Sweeper(private, grace=0), []
    # Our clock's view of the lease ends a little before the database's.
    wait_for(lambda: swept.append(sweeper.run_once().expired) or sum(swept) == 2, "the sweep")
    assert rows(private, key) == []
    with pytest.raises(LockLost):
        r.release()
    listed = {(row.slot, row.kind, row.mode) for row in private.store.rows(prefix=key)}
    assert listed == set()
    with private.read_lock(key), private.read_lock(key):
        listed = {
            (row.slot, row.kind, row.mode, row.holders) for row in private.store.rows(key=key)
        }
        assert listed == {("", "rw", "read", 1)}


def test_local_sharing_drains_only_for_a_waiting_writer(make_manager: Any, key: str) -> None:
    """A long local reader does not hold other local readers back once the
    hold was shared ``handoff_limit`` times, unless a writer of another
    process waits: then the hold drains and the writer gets in."""
    a, b = make_manager(handoff_limit=2), make_manager()
    long_reader = a.read_lock(key).__enter__()

    def short_read() -> BaseException | None:
        box: list[BaseException | None] = [None]

        def run() -> None:
            try:
                with a.read_lock(key, blocking=False):
                    pass
            except BaseException as exc:
                box[0] = exc

        t = threading.Thread(target=run)
        t.start()
        t.join(30)
        return box[0]

    assert [short_read() for _ in range(6)] == [None] * 6  # nobody else wants to write
    got: list[RwHeld] = []

    def write() -> None:
        with b.write_lock(key, timeout=60) as w:
            got.append(w)

    writer = threading.Thread(target=write)
    writer.start()
    wait_for(lambda: any(row.mode == "waiting" for row in rows(a, key)), "the intent row")
    refused = [short_read() for _ in range(4)]
    assert isinstance(refused[-1], LockBusy)  # draining for the writer
    long_reader.release()
    writer.join(60)
    assert got
    assert got[0].fence > long_reader.fence


def test_unreachable_database_leaves_no_level_1_state(key: str) -> None:
    """A clear BackendError, and nothing left behind in level 1 (the key is
    not blocked for the next request)."""
    from dblock import BackendError

    m = LockManager("postgresql+psycopg://postgres@127.0.0.1:1/none", timeout=1)
    try:
        for request in (m.read_lock, m.write_lock, m.read_lock):
            with pytest.raises(BackendError), request(key):
                pass
        assert m._rw is not None
        assert m._rw._entries == {}
    finally:
        m.close()


def test_read_grant_whose_answer_was_lost_is_counted_once(make_manager: Any, key: str) -> None:
    """A read grant that committed but whose answer the driver could not
    decode (seen on Galera: a brute-force aborted statement, replayed and
    committed, answered with a row of empty fields) is a grant, counted once:
    released, the key is free for a writer at once (no count left to the
    lease)."""
    reader, writer = make_manager(), make_manager()
    with reader.read_lock(key):  # the first use reads the server's capabilities
        pass
    garbled: list[str] = []

    def garble(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if not garbled and "holders" in statement and "INSERT" in statement.upper():
            garbled.append(statement)
            raise ValueError("invalid literal for int() with base 10: ''")

    sa.event.listen(reader.engine, "after_cursor_execute", garble)
    try:
        held = reader.read_lock(key, blocking=False).__enter__()
    finally:
        sa.event.remove(reader.engine, "after_cursor_execute", garble)
    assert garbled
    row = head(reader, key)
    assert row is not None
    assert (row.mode, row.holders) == ("read", 1)
    with pytest.raises(LockBusy):
        writer.write_lock(key, blocking=False).__enter__()
    held.release()
    with writer.write_lock(key, blocking=False):
        pass


def test_close_sends_waiting_readers_and_writers_away(make_manager: Any, key: str) -> None:
    from dblock import ManagerClosed

    a = make_manager()
    held = a.write_lock(key).__enter__()
    errors: list[BaseException] = []

    def wait(request: Any) -> None:
        try:
            with request(key, timeout=60):
                pass
        except BaseException as exc:
            errors.append(exc)

    waiters = [threading.Thread(target=wait, args=(r,)) for r in (a.read_lock, a.write_lock)]
    for t in waiters:
        t.start()
    wait_for(lambda: len(a._rw._entries[key].queue) == 2, "both to queue")
    a.close()
    for t in waiters:
        t.join(30)
    assert len(errors) == 2
    assert all(isinstance(e, ManagerClosed) for e in errors)
    assert held.lost


@pytest.mark.databases("postgresql", "mariadb")
@pytest.mark.parametrize("fault", ["outage", "cut-after-intent", "outage-from-the-intent"])
def test_waiting_writer_rides_out_an_outage(
    db_url: str, key: str, make_manager: Any, fault: str
) -> None:
    """A writer waiting for readers keeps trying while its database
    connections fail (cut, then refused at its proxy), and is granted the key
    once they work again and the readers are gone. ``cut-after-intent``: the
    connection cut as the write intent's answer comes back (the row written,
    the writer told nothing), ridden out the same way. Before:
    ``ConnectionLost`` went out of ``write_lock`` (seen in a full run, the
    outage's cut racing the intent statement's answer).
    ``outage-from-the-intent``: that cut begins an outage, so the writer has
    not made its waiter yet when the next grant cannot connect. Before:
    ``DatabaseUnreachable`` went out of ``write_lock`` (seen in CI: the
    outage's cut came as the intent's answer was on its way)."""
    from tests.support.proxy import Proxy

    url = sa.make_url(db_url)
    proxy = Proxy(url.host or "127.0.0.1", url.port or 0)
    reader_side = make_manager()
    writer_side = LockManager(proxy.url_for(db_url), poll_max=0.1)
    try:
        r = reader_side.read_lock(key).__enter__()
        cut = None
        if fault != "outage":
            cut = proxy.cut_after(b"'rw', 'waiting', 0,", refuse=fault == "outage-from-the-intent")
        got: list[Any] = []

        def write() -> None:
            try:
                with writer_side.write_lock(key, timeout=60) as w:
                    got.append(w.fence)
            except BaseException as exc:
                got.append(exc)

        writer = threading.Thread(target=write)
        writer.start()
        if cut is not None:
            assert cut.wait(10), "the intent statement was not sent"
            if fault == "outage-from-the-intent":
                tried = proxy.accepted
                wait_for(lambda: proxy.accepted >= tried + 3 or got, "attempts through the outage")
            else:
                time.sleep(0.3)
        else:
            wait_for(lambda: any(row.mode == "waiting" for row in rows(reader_side, key)), "intent")
            proxy.refuse(True)
            proxy.cut_all()
            tried = proxy.accepted
            wait_for(lambda: proxy.accepted >= tried + 3 or got, "attempts through the outage")
        assert got == []  # still waiting, not failed
        proxy.refuse(False)
        r.release()
        writer.join(60)
        assert len(got) == 1
        assert isinstance(got[0], int), got[0]
        assert got[0] > r.fence
    finally:
        writer_side.close()
        proxy.close()
