"""What tools in dblock's own source tree may read of its insides.

The benchmark suite (``benchmarks/``, run by ``scripts/bench`` and
``scripts/bench-listeners``) measures dblock against the raw driver sending
*the statements dblock sends*, counts the statements the asyncio face sent,
weighs the level-1 registry and watches PostgreSQL's listener thread. None
of that is for applications, and none of it is in ``dblock.__all__``: this
module is the one door through which such tools reach past the public API,
so a change inside dblock that moves what they read breaks here, in one
place, and the tools never import ``dblock._store``, ``dblock.registry`` or
a manager's private attributes themselves.

Exactly what a tool may use:

* :func:`lock_statements`: the exclusive lock's acquire and release SQL a
  manager's store sends, with their parameters;
* :func:`async_statements_sent`: how many statements an
  :class:`~dblock.AsyncLockManager` sent on its async engine;
* :func:`async_url`: a blocking URL with its dialect's asyncio driver;
* :func:`registry_of` and :func:`new_registry`: a manager's level-1
  registry, or one on its own (:class:`Registry`: ``claim(key, owner)``,
  ``leave(entry)``, ``len()``), and :func:`registry_dict_bytes`, the size of
  its table;
* :func:`listener_of`: PostgreSQL's listener, as a :class:`ListenerView`.

No compatibility is promised beyond the tree these tools ship in: they are
changed together with dblock.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import sqlalchemy as sa

from ._engine import Dialect
from ._store.aio import async_url as _async_url
from .aio import AsyncLockManager
from .manager import LockManager
from .registry import Registry

__all__ = [
    "ListenerView",
    "LockStatements",
    "Registry",
    "async_statements_sent",
    "async_url",
    "listener_of",
    "lock_statements",
    "new_registry",
    "registry_dict_bytes",
    "registry_of",
]


@dataclasses.dataclass(frozen=True)
class LockStatements:
    """The exclusive lock's two statements as dblock sends them on one
    database, in the driver's ``%(name)s`` paramstyle (``:name`` on SQLite).

    The acquire takes ``key``, ``owner``, ``token`` and the lease
    (:meth:`acquire_params`); the release takes ``key``, ``token`` and
    :attr:`release_params`. Whether the acquire granted the lock is read
    from its answer by :meth:`granted`."""

    dialect: str
    acquire: str
    release: str
    release_params: dict[str, Any]
    #: The acquire answers with rows (PostgreSQL, SQLite, MariaDB with
    #: RETURNING); otherwise its row count says.
    returning: bool
    #: The release answers with rows to be fetched (PostgreSQL's NOTIFY SELECT).
    release_returns: bool
    #: The acquire's rows name the holder, granted or not (PostgreSQL's).
    names_holder: bool = False
    #: The store's dialect, whose flags say the lease's unit.
    facts: Dialect | None = dataclasses.field(default=None, repr=False, compare=False)

    def acquire_params(self, ttl: float) -> dict[str, Any]:
        """The lease parameter, in the unit this database's statement takes."""
        assert self.facts is not None
        return self.facts.lease_params(ttl)

    def granted(self, rows: Any, rowcount: int, token: str) -> bool:
        """Whether the acquire's answer (its fetched rows, its row count)
        granted the lock to ``token``: PostgreSQL's answers with the holder
        either way."""
        if self.names_holder:
            return bool(rows) and rows[0][0] == token
        if self.returning:
            return bool(rows)
        return rowcount == 1


def lock_statements(manager: LockManager) -> LockStatements:
    """What ``manager`` sends to take and give back an exclusive lock.

    On MySQL and MariaDB (``mysql://`` or ``mariadb://`` alike) this asks
    the server once which INSERT dblock sends (with RETURNING from MariaDB
    10.5), as the store itself does on its first lock."""
    store = manager.store
    sql = store.exclusive_sql()
    return LockStatements(
        store.dialect.name,
        sql.acquire,
        sql.release,
        sql.release_params,
        sql.returning,
        sql.release_returns,
        sql.names_holder,
        store.dialect,
    )


def async_statements_sent(manager: AsyncLockManager) -> int:
    """Statements ``manager`` sent on its async engine so far (counted by its
    async store: exact on every path, and free, where an execution listener
    on the engine would switch it to a slower path). What its blocking
    engine sends (renewals) is not included: count that at
    ``manager.sync.engine``."""
    return int(manager.astore.statements)


def async_url(url: str | sa.URL) -> sa.URL:
    """``url`` with its dialect's asyncio driver, as
    :class:`~dblock.AsyncLockManager` makes its async engine."""
    return _async_url(sa.make_url(url))


def registry_of(manager: LockManager) -> Registry:
    """``manager``'s level-1 registry (one entry per key held or asked for
    in this process)."""
    return manager.locker.registry


def new_registry() -> Registry:
    """A level-1 registry of its own, with no manager behind it."""
    return Registry()


def registry_dict_bytes(registry: Registry) -> int:
    """The size of the registry's table itself (``sys.getsizeof`` of the
    dict, not of its entries)."""
    return registry.table_bytes()


@dataclasses.dataclass(frozen=True)
class ListenerView:
    """PostgreSQL's listener, read-only."""

    _listener: Any

    @property
    def received(self) -> int:
        """Notifications this process heard so far."""
        return int(self._listener.received)

    @property
    def thread(self) -> threading.Thread | None:
        """The thread that listens (``None`` until a first waiter)."""
        thread: threading.Thread | None = self._listener.thread
        return thread

    @property
    def buckets(self) -> int:
        """The channels (buckets of keys) it listens to now."""
        return len(self._listener.listened)


def listener_of(manager: LockManager) -> ListenerView | None:
    """``manager``'s listener on PostgreSQL; ``None`` on other databases."""
    store: Any = manager.store
    listener = getattr(store, "listener", None)
    found = listener() if listener is not None else None
    return None if found is None else ListenerView(found)
