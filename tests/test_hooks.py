"""``dblock._hooks``: what the benchmark suite reads of dblock's insides is
what dblock really does (the raw driver of the benchmark sends these
statements and compares itself with dblock: they must be dblock's own)."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from dblock import AsyncLockManager, LockBusy, LockManager
from dblock._hooks import (
    async_statements_sent,
    async_url,
    listener_of,
    lock_statements,
    new_registry,
    registry_dict_bytes,
    registry_of,
)


def _run(manager: LockManager, sql: str, params: dict[str, Any], fetch: bool) -> tuple[Any, int]:
    """One statement on a DB-API connection of the manager's pool, autocommitted."""
    conn = manager.engine.raw_connection()
    try:
        cursor = conn.cursor()
        cursor.execute(sql, params)
        rows = cursor.fetchall() if fetch else ()
        rowcount = cursor.rowcount
        cursor.close()
        conn.commit()
        return rows, rowcount
    finally:
        conn.close()


def test_lock_statements_take_and_give_back_a_dblock_lock(manager: LockManager) -> None:
    """The acquire grants a free key and is refused a held one (dblock's own
    lock and the raw one alike), and the release frees it for dblock."""
    sql = lock_statements(manager)
    key = f"hooks:{uuid.uuid4().hex[:8]}"
    mine, theirs = uuid.uuid4().hex, uuid.uuid4().hex

    def acquire(token: str) -> bool:
        params = {"key": key, "owner": "test", "token": token, **sql.acquire_params(30.0)}
        return sql.granted(*_run(manager, sql.acquire, params, True), token)

    assert acquire(mine)
    assert manager.is_locked(key)
    assert not acquire(theirs)
    with pytest.raises(LockBusy):
        manager.acquire(key, blocking=False)
    params = {"key": key, "token": mine, **sql.release_params}
    _run(manager, sql.release, params, sql.release_returns)
    assert not manager.is_locked(key)
    with manager.lock(key, blocking=False):
        assert not acquire(theirs)  # dblock's lock refuses the raw acquire too
    assert acquire(theirs)
    _run(manager, sql.release, {"key": key, "token": theirs, **sql.release_params}, False)


def test_registry_hooks(manager: LockManager) -> None:
    registry = registry_of(manager)
    key = f"hooks:{uuid.uuid4().hex[:8]}"
    with manager.lock(key):
        assert len(registry) >= 1
    alone = new_registry()
    before = registry_dict_bytes(alone)
    entries = [alone.claim(f"k{i}", object()) for i in range(100)]
    assert len(alone) == 100
    assert registry_dict_bytes(alone) > before
    for e in entries:
        assert e is not None
        alone.leave(e)
    assert len(alone) == 0


def test_async_statements_and_url(db_url: str) -> None:
    assert async_url(db_url).drivername.split("+")[1] in ("psycopg", "aiomysql", "aiosqlite")

    async def main() -> tuple[int, int]:
        async with AsyncLockManager(db_url) as m:
            before = async_statements_sent(m)
            async with m.lock(f"hooks:{uuid.uuid4().hex[:8]}"):
                pass
            return before, async_statements_sent(m)

    before, after = asyncio.run(main())
    assert after - before >= 2  # an acquire and a release, at least


def test_listener_of(manager: LockManager) -> None:
    listener = listener_of(manager)
    if manager.dialect != "postgresql":
        assert listener is None
        return
    assert listener is not None
    assert listener.received >= 0
    assert listener.buckets >= 0
