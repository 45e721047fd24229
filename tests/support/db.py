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
#: names, as a URL form spells them).
ASYNC_DRIVERS = {
    "sqlite": ("aiosqlite",),
    "postgresql": ("psycopg_async", "asyncpg"),
    "mariadb": ("aiomysql", "asyncmy"),
}

#: Per server, the two forms a test parametrized over the asyncio drivers
#: (``driver0``, ``driver1``: see :func:`driver_form`) runs on: (the URL's
#: driver, or None for the blocking form; the driver dblock's async engine
#: then speaks, SQLAlchemy's name for it). SQLite has one asyncio driver:
#: its asyncio form, and its blocking form (which picks it).
ASYNC_FORMS: dict[str, tuple[tuple[str | None, str], ...]] = {
    "sqlite": (("aiosqlite", "aiosqlite"), (None, "aiosqlite")),
    "postgresql": (("psycopg_async", "psycopg"), ("asyncpg", "asyncpg")),
    "mariadb": (("aiomysql", "aiomysql"), ("asyncmy", "asyncmy")),
}


def async_form(url: str, driver: str) -> str:
    """``url`` (a blocking form) in the asyncio driver ``driver``'s form."""
    parsed = sa.make_url(url)
    form = parsed.set(drivername=f"{parsed.get_backend_name()}+{driver}")
    return form.render_as_string(hide_password=False)


def driver_form(db: str, url: str, which: int) -> tuple[str, str]:
    """(``url`` in the ``which``-th asyncio form of :data:`ASYNC_FORMS`, the
    driver it speaks). The driver is imported here: a test on a driver that
    is not installed fails, never skips (the dev extra installs each)."""
    import importlib

    url_driver, spoken = ASYNC_FORMS[db][which]
    importlib.import_module(spoken)
    return (async_form(url, url_driver) if url_driver else url), spoken
