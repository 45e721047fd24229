"""dblock's Django settings: the ``DBLOCK`` dict, and the database URL built
from ``DATABASES`` when it gives none.

dblock keeps an engine of its own on that database, with a pool of its own
shaped by ``DBLOCK["ENGINE_OPTIONS"]``: lock statements must commit at once
and must never join the request's transaction, so they cannot run on
Django's connection; and a request holding Django's connection (or one of
its pool's) must never wait for another of those to take a lock. This is the
rule of the Flask integration too.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from sqlalchemy import URL

from ..._engine import check_engine_options, make_engine, resolve_url
from ...errors import LockArgumentError
from ...schema import TableNames
from .._beside import beside
from .._settings import Settings, read_settings

__all__ = [
    "check_engine",
    "database_alias",
    "engine_args",
    "read",
    "table_names",
    "url_for",
    "url_from",
]

ENGINE_OPTIONS = "DBLOCK['ENGINE_OPTIONS']"

_DJANGO_ONLY = {"DATABASE": "default"}

# Django vendor -> SQLAlchemy driver dblock speaks.
_DRIVERS = {"postgresql": "postgresql+psycopg", "mysql": "mysql+pymysql", "sqlite": "sqlite"}
# Connection OPTIONS that mean the same to the driver dblock uses; Django-only
# ones (pool, isolation_level, init_command, ...) are left out.
_PASSED_OPTIONS = {
    "postgresql": {
        "sslmode",
        "sslrootcert",
        "sslcert",
        "sslkey",
        "connect_timeout",
        "application_name",
        "options",
        "target_session_attrs",
        "service",
        "passfile",
    },
    "mysql": {"charset", "connect_timeout"},
    "sqlite": set(),
}


def read() -> Settings:
    from django.conf import settings

    values = getattr(settings, "DBLOCK", None) or {}
    if not isinstance(values, dict):
        raise LockArgumentError(f"settings.DBLOCK must be a dict, got {values!r}")
    result = read_settings(values, name=lambda k: f"DBLOCK[{k!r}]", extra=_DJANGO_ONLY)
    alias = result.extra["DATABASE"]
    if alias not in settings.DATABASES:
        raise LockArgumentError(
            f"DBLOCK['DATABASE'] is {alias!r}, which is not in DATABASES "
            f"({', '.join(map(repr, settings.DATABASES))})"
        )
    return result


def engine_args(settings: Settings) -> tuple[URL, dict[str, Any]]:
    """The URL and engine options of dblock's engine (options checked)."""
    # The app's SQLite file has one writer: dblock's rows go in a file beside it.
    url = resolve_url(settings.url or beside(url_for(str(settings.extra["DATABASE"]))))
    return url, check_engine_options(settings.engine_options, name=ENGINE_OPTIONS)


def check_engine(settings: Settings) -> None:
    """Make dblock's engine once and drop it, without connecting: a bad URL
    or engine option fails at start-up rather than at the first lock."""
    url, options = engine_args(settings)
    if not options and not settings.url:
        return  # nothing of the user's to check beyond what read() did
    make_engine(url, options).dispose()


def database_alias() -> str:
    return str(read().extra["DATABASE"])


def table_names() -> TableNames:
    return TableNames.of(read().config)


def url_for(alias: str) -> URL:
    """A SQLAlchemy URL for Django's database ``alias``, read from the live
    connection settings (so under the test runner it is the test database)."""
    from django.db import connections

    connection = connections[alias]
    return url_from(connection.vendor, connection.settings_dict, alias)


def _driver(vendor: str) -> str:
    """The SQLAlchemy driver for ``vendor``: on PostgreSQL the one Django
    itself runs on (psycopg 3 when it is installed, else psycopg2), so an
    application on psycopg2 needs no second driver."""
    if (
        vendor == "postgresql"
        and importlib.util.find_spec("psycopg") is None
        and importlib.util.find_spec("psycopg2") is not None
    ):
        return "postgresql+psycopg2"
    return _DRIVERS[vendor]


def url_from(vendor: str, s: dict[str, Any], alias: str = "default") -> URL:
    """A SQLAlchemy URL for a Django connection's ``vendor`` and settings."""
    if vendor not in _DRIVERS:
        raise LockArgumentError(
            f"DATABASES[{alias!r}] uses {vendor!r}; dblock supports PostgreSQL, MySQL/MariaDB "
            "and SQLite. Set DBLOCK['URL'] to a database it supports."
        )
    query = {k: str(v) for k, v in (s.get("OPTIONS") or {}).items() if k in _PASSED_OPTIONS[vendor]}
    if vendor == "sqlite":
        return URL.create("sqlite", database=str(s["NAME"]))
    return URL.create(
        _driver(vendor),
        username=s.get("USER") or None,
        password=s.get("PASSWORD") or None,
        host=s.get("HOST") or None,
        port=int(s["PORT"]) if s.get("PORT") else None,
        database=str(s["NAME"]),
        query=query,
    )
