"""Making the engine dblock runs its statements on.

Given a URL, dblock makes its own small engine in AUTOCOMMIT with no reset on
return to the pool: every lock statement is a transaction of its own, so a
pooled connection never holds anything to roll back. Given an Engine, dblock
uses it as it is (through an AUTOCOMMIT view of it) and never disposes it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sqlalchemy import URL, create_engine, event, make_url
from sqlalchemy.engine import Engine
from sqlalchemy.exc import ArgumentError

from .errors import LockArgumentError

__all__ = ["DEFAULT_URL", "make_engine", "mask", "resolve_url"]

DEFAULT_URL = "sqlite:///dblock.sqlite3"
ENV_URL = "DBLOCK_URL"

_DRIVERS = {"postgresql": "psycopg", "mysql": "pymysql", "mariadb": "pymysql"}


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


def mask(url: str | URL) -> str:
    """The URL with its password replaced by ``***``, for anything printed or logged."""
    if isinstance(url, URL):
        return url.render_as_string(hide_password=True)
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return "<unparseable URL>"


def make_engine(
    url: URL, options: Mapping[str, Any] | None = None, *, pooler: bool = False
) -> Engine:
    kwargs: dict[str, Any] = {
        "isolation_level": "AUTOCOMMIT",
        "pool_reset_on_return": None,
    }
    backend = url.get_backend_name()
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
    if pooler and backend == "postgresql":
        # A transaction-mode pooler hands each transaction any server
        # connection: a statement psycopg prepared on one is missing (or
        # already there) on the next. Never prepare on the server.
        kwargs["connect_args"] = {**kwargs.get("connect_args", {}), "prepare_threshold": None}
    try:
        engine = create_engine(url, **kwargs)
    except ImportError as exc:
        extra = "postgresql" if backend == "postgresql" else "mysql"
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
