"""Making the engine dblock runs its statements on.

Given a URL, dblock makes its own small engine in AUTOCOMMIT with no reset on
return to the pool: every lock statement is a transaction of its own, so a
pooled connection never holds anything to roll back. Given an Engine, dblock
uses it as it is (through an AUTOCOMMIT view of it) and never disposes it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import URL, create_engine, event, make_url
from sqlalchemy.engine import Engine
from sqlalchemy.exc import ArgumentError

from .errors import LockArgumentError

__all__ = ["DEFAULT_URL", "check_url", "make_engine", "mask", "mask_text", "resolve_url"]

DEFAULT_URL = "sqlite:///dblock.sqlite3"
ENV_URL = "DBLOCK_URL"

_DRIVERS = {"postgresql": "psycopg", "mysql": "pymysql", "mariadb": "pymysql"}

#: The databases dblock speaks, and the DBAPI drivers it speaks them through.
SUPPORTED: dict[str, tuple[str, ...]] = {
    "postgresql": ("psycopg",),
    "mysql": ("pymysql",),
    "mariadb": ("pymysql",),
    "sqlite": ("pysqlite",),
}
_EXTRAS = {"postgresql": "postgresql", "mysql": "mysql", "mariadb": "mysql"}


def check_dialect(dialect: str, driver: str) -> None:
    """Refuse, before any engine is made, a database or driver dblock does not speak."""
    if dialect not in SUPPORTED:
        raise LockArgumentError(
            f"dblock does not support the {dialect!r} database; it supports PostgreSQL "
            "(postgresql://), MySQL/MariaDB (mysql://, mariadb://) and SQLite (sqlite://)"
        )
    drivers = SUPPORTED[dialect]
    if driver not in drivers:
        raise LockArgumentError(
            f"dblock speaks {dialect} through {' or '.join(drivers)}, not {driver!r}; "
            f"use a URL like {dialect}+{drivers[0]}://..."
        )


def resolve_url(url: str | URL | None) -> URL:
    """``url``, else ``$DBLOCK_URL``, else the SQLite file ``./dblock.sqlite3``;
    bare ``postgresql://`` and ``mysql://`` get the drivers dblock speaks."""
    raw = url if url is not None else os.environ.get(ENV_URL) or DEFAULT_URL
    try:
        parsed = make_url(raw)
    except (ArgumentError, ValueError) as exc:
        raise LockArgumentError(f"not a database URL: {mask(str(raw))!r} ({exc})") from exc
    if "+" not in parsed.drivername and parsed.drivername in _DRIVERS:
        parsed = parsed.set(drivername=f"{parsed.drivername}+{_DRIVERS[parsed.drivername]}")
    return parsed


# Query parameters whose value is a secret: libpq's password/sslpassword,
# PyMySQL's passwd, ODBC-style pwd, and tokens or keys of any kind.
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token|credential|api_?key", re.IGNORECASE)


def check_url(url: URL) -> None:
    """Refuse a URL naming a database or driver dblock does not speak."""
    backend = url.get_backend_name()
    # Only a known dialect's default driver can be looked up without loading it.
    check_dialect(backend, url.get_driver_name() if backend in SUPPORTED else "")


def mask(url: str | URL) -> str:
    """The URL with its password replaced by ``***``, for anything printed or
    logged: the user-info password and any query parameter that carries one
    (``?password=``, ``?passwd=``, ``?pwd=``, ``?sslpassword=``, ...)."""
    if not isinstance(url, URL):
        try:
            url = make_url(url)
        except (ArgumentError, ValueError):
            return "<unparseable URL>"
    secret = [name for name in url.query if _SECRET_PARAM.search(name)]
    if not secret:
        return url.render_as_string(hide_password=True)
    url = url.update_query_dict(dict.fromkeys(secret, "***"))
    return url.render_as_string(hide_password=True).replace("=%2A%2A%2A", "=***")


def mask_text(text: str) -> str:
    """``text`` with every URL in it (``scheme://...``) masked as by :func:`mask`."""
    return _URL_IN_TEXT.sub(lambda m: mask(m.group(0)), text)


_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]*")


def make_engine(url: URL, options: Mapping[str, Any] | None = None) -> Engine:
    kwargs: dict[str, Any] = {
        "isolation_level": "AUTOCOMMIT",
        "pool_reset_on_return": None,
    }
    backend = url.get_backend_name()
    check_url(url)
    if backend == "sqlite":
        database = url.database or ""
        if database in ("", ":memory:") or "mode=memory" in str(url):
            raise LockArgumentError(
                "an in-memory SQLite database is private to one connection and cannot hold "
                "locks; use a file, e.g. sqlite:///dblock.sqlite3"
            )
        if not database.startswith("file:"):
            Path(database).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
        kwargs["connect_args"] = {"timeout": 30.0, "check_same_thread": False}
    elif backend in ("mysql", "mariadb") and "charset" not in url.query:
        url = url.update_query_dict({"charset": "utf8mb4"})
    kwargs.update(options or {})
    try:
        engine = create_engine(url, **kwargs)
    except ImportError as exc:
        extra = _EXTRAS.get(backend, backend)
        raise LockArgumentError(
            f"the driver for {mask(url)} is not installed: pip install 'dblock[{extra}]' ({exc})"
        ) from exc
    except (ArgumentError, TypeError) as exc:
        raise LockArgumentError(f"cannot make an engine for {mask(url)}: {exc}") from exc
    if backend == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers (dblock list, stats) run beside the writer; NORMAL
    # sync is durable against a crash of the process, which is what a
    # single-machine lock file needs.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
    finally:
        cursor.close()
