"""dblock: distributed locks in the relational database a service already has.

Two filters: a per-process registry lets one thread per key through, and that
thread inserts a unique lock row (key, owner token, lease, fence) in
PostgreSQL, MySQL/MariaDB or SQLite. See ``DESIGN.md`` and the README.
"""

from __future__ import annotations

from .config import Config
from .decorators import returns
from .errors import (
    BackendError,
    DBLockError,
    LockArgumentError,
    LockBusy,
    LockLost,
    LockNotAcquired,
    LockNotHeld,
    LockTimeout,
    ManagerClosed,
    SchemaMissing,
)
from .lock import HeldLock
from .manager import LockManager, LockRequest
from .multi import HeldLocks

__all__ = [
    "BackendError",
    "Config",
    "DBLockError",
    "HeldLock",
    "HeldLocks",
    "LockArgumentError",
    "LockBusy",
    "LockLost",
    "LockManager",
    "LockNotAcquired",
    "LockNotHeld",
    "LockRequest",
    "LockTimeout",
    "ManagerClosed",
    "SchemaMissing",
    "returns",
]

__version__ = "0.1.0"
