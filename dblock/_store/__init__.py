"""Level 2: the lock row. One module per dialect, registered by name.

A dialect module subclasses :class:`~dblock._store.base.Store` and registers
it with :func:`register` under the SQLAlchemy dialect name(s) it serves; the
module is imported only when an engine of that dialect shows up, so dblock
imports without psycopg or PyMySQL installed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from sqlalchemy.engine import Engine

from ..config import Config
from ..errors import LockArgumentError
from .base import Backoff, Grant, Holder, Interrupted, Lease, Store, Wait

__all__ = [
    "Backoff",
    "Grant",
    "Holder",
    "Interrupted",
    "Lease",
    "Store",
    "Wait",
    "open_store",
    "register",
]

_STORES: dict[str, type[Store]] = {}
# dialect name -> (module that registers it, the DBAPI drivers it speaks)
_MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "postgresql": ("postgresql", ("psycopg",)),
    "mysql": ("mysql", ("pymysql",)),
    "mariadb": ("mysql", ("pymysql",)),
    "sqlite": ("sqlite", ("pysqlite",)),
}


def register(*dialects: str) -> Callable[[type[Store]], type[Store]]:
    def decorate(cls: type[Store]) -> type[Store]:
        for name in dialects:
            _STORES[name] = cls
        return cls

    return decorate


def open_store(engine: Engine, *, config: Config, owns_engine: bool) -> Store:
    dialect, driver = engine.dialect.name, engine.dialect.driver
    if dialect not in _MODULES:
        raise LockArgumentError(
            f"dblock does not support the {dialect!r} dialect; "
            "use PostgreSQL, MySQL/MariaDB or SQLite"
        )
    module, drivers = _MODULES[dialect]
    if driver not in drivers:
        raise LockArgumentError(
            f"dblock speaks {dialect} through {' or '.join(drivers)}, not {driver!r}; "
            f"use a URL like {dialect}+{drivers[0]}://..."
        )
    importlib.import_module(f"{__name__}.{module}")
    return _STORES[dialect](engine, config=config, owns_engine=owns_engine)
