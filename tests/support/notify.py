"""What the LISTEN/NOTIFY tests share (PostgreSQL): a LISTEN connection of
the test's own, waiting threads, and a look at a manager's listener."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import sqlalchemy as sa

from dblock import LockManager
from dblock._store.sqlparts import BUCKETS, waiters_class

__all__ = [
    "Heard",
    "bucket_of",
    "conninfo",
    "registered",
    "registered_on_server",
    "start_waiter",
    "until",
]


def conninfo(url: str) -> str:
    u = sa.make_url(url)
    return f"host={u.host} port={u.port or 5432} user={u.username} dbname={u.database}"


class Heard:
    """A LISTEN connection of the test's own on every channel of a manager's
    table: each bucket's, and the one channel of earlier versions."""

    def __init__(self, url: str, manager: LockManager) -> None:
        self.conn = psycopg.connect(conninfo(url), autocommit=True)
        names = manager.store.names
        channels = [names.channel, *(f"{names.channel_prefix}{b}" for b in range(BUCKETS))]
        self.conn.execute("; ".join(f'LISTEN "{c}"' for c in channels))

    def notes(self, wait: float = 0.3) -> list[tuple[str, str]]:
        """(channel, payload) of each notification heard."""
        return [(n.channel, n.payload) for n in self.conn.notifies(timeout=wait, stop_after=100)]

    def payloads(self, wait: float = 0.3) -> list[str]:
        return [payload for _, payload in self.notes(wait)]

    def close(self) -> None:
        self.conn.close()


def bucket_of(url: str, key: str) -> int:
    """The bucket the server puts ``key`` in (what the releases compute)."""
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        row = conn.execute("SELECT hashtext(%s) & %s", (key, BUCKETS - 1)).fetchone()
    assert row is not None
    return int(row[0])


def until(check: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def listener_of(manager: LockManager) -> Any:
    return manager.store._listener  # type: ignore[attr-defined]


def registered(manager: LockManager, key: str) -> bool:
    listener = listener_of(manager)
    return listener is not None and key in listener._registered


def registered_on_server(url: str, manager: LockManager, key: str) -> bool:
    """Whether some session holds ``key``'s waiter registration (the shared
    advisory lock a release tries). The listener forgets a key before its
    unlock is sent, so a waiter arriving meanwhile registers again: only the
    server says when a release stops finding it."""
    classid = waiters_class(manager.store.names.table)
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
            " AND classid::bigint = (%s::bigint & 4294967295)"
            " AND objid::bigint = (hashtext(%s)::bigint & 4294967295)",
            (classid, key),
        ).fetchone()
    assert row is not None
    return bool(row[0])


def start_waiter(
    manager: LockManager, key: str, *, hold: float = 0.0
) -> tuple[threading.Thread, list[float]]:
    """A thread waiting for ``key``; the time of its grant lands in the list."""
    got: list[float] = []

    def wait() -> None:
        with manager.lock(key, timeout=60):
            got.append(time.monotonic())
            time.sleep(hold)

    t = threading.Thread(target=wait, daemon=True)
    t.start()
    return t, got
