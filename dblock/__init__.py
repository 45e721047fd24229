"""dblock: distributed locks in the relational database a service already has.

Two filters: a per-process registry lets one thread per key through, and that
thread inserts a unique lock row (key, owner token, lease, fence) in
PostgreSQL, MySQL/MariaDB or SQLite. See the README, and docs/internals.md for
the design (the two levels, the lock row, failure semantics).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import _version
from .config import Config
from .decorators import returns
from .errors import (
    AuthenticationFailed,
    BackendError,
    ConnectionLost,
    DatabaseUnreachable,
    DBLockError,
    DowngradeRefused,
    JobSkipped,
    KindMismatch,
    LeadershipLost,
    LockArgumentError,
    LockBusy,
    LockLost,
    LockNotAcquired,
    LockNotHeld,
    LockTimeout,
    ManagerClosed,
    PoolerMismatch,
    PoolExhausted,
    SchemaMissing,
    UpgradeRefused,
)
from .jobs import SKIPPED, current_run
from .leader import Leader, Term
from .lock import HeldLock
from .manager import LockManager, LockRequest
from .multi import HeldLocks

if TYPE_CHECKING:
    from .aio import AsyncLockManager

__all__ = [
    "SKIPPED",
    "AsyncLockManager",
    "AuthenticationFailed",
    "BackendError",
    "Config",
    "ConnectionLost",
    "DBLockError",
    "DatabaseUnreachable",
    "DowngradeRefused",
    "HeldLock",
    "HeldLocks",
    "JobSkipped",
    "KindMismatch",
    "Leader",
    "LeadershipLost",
    "LockArgumentError",
    "LockBusy",
    "LockLost",
    "LockManager",
    "LockNotAcquired",
    "LockNotHeld",
    "LockRequest",
    "LockTimeout",
    "ManagerClosed",
    "PoolExhausted",
    "PoolerMismatch",
    "SchemaMissing",
    "Term",
    "UpgradeRefused",
    "current_run",
    "returns",
]

#: The version (written once, in dblock/_version.py, where pyproject.toml reads it).
__version__ = _version.__version__


def __getattr__(name: str) -> Any:
    # The asyncio face is imported on first use: a synchronous application
    # never loads asyncio or SQLAlchemy's async engine.
    if name == "AsyncLockManager":
        from .aio import AsyncLockManager

        return AsyncLockManager
    raise AttributeError(f"module 'dblock' has no attribute {name!r}")
