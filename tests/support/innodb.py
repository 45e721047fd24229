"""Reading InnoDB's lock tables (``information_schema.INNODB_TRX``,
``INNODB_LOCK_WAITS``) without starving them.

InnoDB answers those tables from a cache that it refreshes only when nobody
has read it for 0.1 s (``can_cache_be_updated`` in ``trx0i_s.cc``). Three test
workers polling the shared server every 0.15 s each read it every 0.05 s on
average, so the cache can stay stale for as long as they poll: a CI run saw
three workers time out together, each waiting for a lock wait the cache never
showed. Every read here takes a lock shared by the workers (a file per server)
and starts at least 0.12 s after the last one ended, so each read refreshes.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from typing import Any

import sqlalchemy as sa

# InnoDB's idle time before a refresh is 0.1 s; a margin for the clocks.
_IDLE = 0.12


def _lock_path(conn: sa.Connection) -> str:
    url = conn.engine.url
    return os.path.join(
        tempfile.gettempdir(), f"dblock-tests-innodb-{url.host}-{url.port or 3306}.lock"
    )


def innodb_count(conn: sa.Connection, sql: str, params: dict[str, Any] | None = None) -> int:
    """``sql`` (a count over InnoDB's lock tables) on a fresh cache."""
    with open(_lock_path(conn), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0)
            text = f.read().strip()
            last = float(text) if text else 0.0
            wait = last + _IDLE - time.time()
            if wait > 0:
                time.sleep(wait)
            count = int(conn.execute(sa.text(sql), params or {}).scalar_one())
            f.seek(0)
            f.truncate()
            f.write(repr(time.time()))
            f.flush()
            return count
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
