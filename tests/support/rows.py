"""Writing lock rows directly, to set up states that take hours to reach."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import sqlalchemy as sa

from dblock import LockManager


def insert_expired(manager: LockManager, keys: list[str], *, ago: float = 3600.0) -> None:
    """Rows for ``keys`` whose lease ended ``ago`` seconds ago, written
    directly (a backlog of crashed holders, quicker than acquiring each)."""
    table = manager.store.table
    start = datetime.now(timezone.utc) - timedelta(seconds=ago + 60)
    end = start + timedelta(seconds=60)
    base = 10_000_000
    with manager.engine.connect() as conn:
        conn.execute(
            sa.insert(table),
            [
                {
                    "lock_key": key,
                    "owner": "crashed:1:MainThread",
                    "token": f"{i:032x}",
                    "fence": base + i,
                    "acquired_at": start,
                    "expires_at": end,
                }
                for i, key in enumerate(keys)
            ],
        )


def backdate(manager: LockManager, key: str, seconds: float) -> None:
    """Make ``key``'s row look acquired ``seconds`` earlier (a lock held for
    hours, without waiting hours)."""
    table = manager.store.table
    (row,) = manager.store.rows(key=key)
    with manager.engine.connect() as conn:
        conn.execute(
            sa.update(table)
            .where(table.c.lock_key == key)
            .values(acquired_at=row.acquired_at - timedelta(seconds=seconds))
        )
