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

from .._engine import check_dialect
from ..config import Config
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
# dialect name -> the module that registers it (the drivers: _engine.SUPPORTED)
_MODULES: dict[str, str] = {
    "postgresql": "postgresql",
    "mysql": "mysql",
    "mariadb": "mysql",
    "sqlite": "sqlite",
}


def register(*dialects: str) -> Callable[[type[Store]], type[Store]]:
    def decorate(cls: type[Store]) -> type[Store]:
        for name in dialects:
            _STORES[name] = cls
        return cls

    return decorate


def open_store(engine: Engine, *, config: Config, owns_engine: bool) -> Store:
    dialect, driver = engine.dialect.name, engine.dialect.driver
    check_dialect(dialect, driver)
    importlib.import_module(f"{__name__}.{_MODULES[dialect]}")
    return _STORES[dialect](engine, config=config, owns_engine=owns_engine)
