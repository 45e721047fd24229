"""Where the test databases are, and whether they answer."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

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


@contextlib.contextmanager
def private_database(db: str, directory: Path) -> Iterator[str]:
    """A database of its own on the shared server (a file for SQLite), for
    tests whose application creates tables or works table-wide; dropped after."""
    name = f"dblock_x_{uuid.uuid4().hex[:12]}"
    if db == "sqlite":
        yield f"sqlite:///{directory / name}.sqlite3"
        return
    base = DEFAULT_URLS[db]
    problem = reachable(base)
    if problem:
        raise RuntimeError(f"{db} is required by the test suite and unreachable: {problem}")
    admin = sa.create_engine(base, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    charset = " CHARACTER SET utf8mb4" if db == "mariadb" else ""
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}{charset}"))
    try:
        yield sa.make_url(base).set(database=name).render_as_string(hide_password=False)
    finally:
        force = " WITH (FORCE)" if db == "postgresql" else ""
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}{force}"))
        admin.dispose()


#: The asyncio drivers AsyncLockManager speaks, per test server (SQLAlchemy's
#: names, as a URL form spells them): each test of tests/test_aio_drivers.py
#: runs on every one of its server's.
ASYNC_DRIVERS = {
    "sqlite": ("aiosqlite",),
    "postgresql": ("psycopg_async", "asyncpg"),
    "mariadb": ("aiomysql", "asyncmy"),
}


def async_form(url: str, driver: str) -> str:
    """``url`` (a blocking form) in the asyncio driver ``driver``'s form."""
    parsed = sa.make_url(url)
    form = parsed.set(drivername=f"{parsed.get_backend_name()}+{driver}")
    return form.render_as_string(hide_password=False)
