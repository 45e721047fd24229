"""Where the test databases are, and whether they answer."""

from __future__ import annotations

import os

import sqlalchemy as sa

DEFAULT_URLS = {
    "postgresql": os.environ.get(
        "DBLOCK_TEST_POSTGRESQL_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    ),
    "mariadb": os.environ.get("DBLOCK_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"),
}


def reachable(url: str) -> str | None:
    """None if a connection and a trivial query work, else why not."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT 1"))
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"
    finally:
        engine.dispose()
    return None
