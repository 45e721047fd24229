"""A connection that reaches a server taking no writes (a standby: a demoted
primary behind a route that still points at it) is dropped at its first
"read-only" answer, with the pool's older connections, so the next statement
connects afresh instead of writing to the standby forever.

Here the server is the shared one and the read-only connection is made so
by hand (``default_transaction_read_only`` / ``SET SESSION TRANSACTION READ
ONLY`` on the connection dblock keeps idle): a fresh connection is writable,
as a fresh connection through a balancer or a multi-host URL reaches the new
primary. tests/test_patroni.py shows the same with a real standby.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import sqlalchemy as sa

from dblock import BackendError, LockManager
from dblock.aio import AsyncLockManager
from tests.support.db import private_database

pytestmark = pytest.mark.databases("postgresql", "mariadb")

READ_ONLY = {
    "postgresql": "SET SESSION default_transaction_read_only = on",
    "mariadb": "SET SESSION TRANSACTION READ ONLY",
}


def test_a_read_only_connection_is_not_used_again(db: str, db_url: str, key: str) -> None:
    # notify=False: on MariaDB a hold past 5 ms (a loaded machine) starts the
    # waker, whose connection of its own first hands the executor's idle
    # connections back to the pool (room in a pool without overflow); this
    # test is about the executor's stack.
    with LockManager(db_url, notify=False) as m:
        with m.lock(key):  # leaves a connection idle in the executor
            pass
        idle = m.store.executor._idle
        assert idle, "no idle connection to make read-only"
        for conn, _, _ in idle:
            cursor = conn.dbapi_connection.cursor()  # type: ignore[union-attr]
            cursor.execute(READ_ONLY[db])
            cursor.close()
        with pytest.raises(BackendError, match=r"read-only|READ ONLY"):
            m.acquire(key, blocking=False)
        # Without dropping it, every later statement failed the same way.
        with m.lock(key, blocking=False) as held:
            assert held.fence > 0


@pytest.mark.databases("postgresql")
def test_a_read_only_connection_is_not_used_again_async(db: str, tmp_path: Path) -> None:
    """The asyncio side: connections made while the database defaulted to
    read-only stay read-only after it stops; the one that answered
    "read-only" must not serve the next statement."""
    with private_database(db, tmp_path) as url:
        with LockManager(url) as m:
            m.create_schema()
        name = sa.make_url(url).database
        other = sa.make_url(url).set(database="postgres")  # not read-only itself
        admin = sa.create_engine(other, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)

        def default_read_only(on: bool) -> None:
            with admin.connect() as conn:
                value = "SET default_transaction_read_only = on" if on else "RESET ALL"
                conn.exec_driver_sql(f"ALTER DATABASE {name} {value}")

        async def main() -> None:
            async with AsyncLockManager(url) as m:
                default_read_only(True)
                with pytest.raises(BackendError, match="read-only"):
                    await m.acquire("k", blocking=False)
                default_read_only(False)  # a new connection is writable again
                held = await m.acquire("k", blocking=False)
                assert held.fence > 0
                await held.release()

        try:
            asyncio.run(main())
        finally:
            admin.dispose()
