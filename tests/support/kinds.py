"""One lock of each kind, by name, for tests parametrized over the kinds."""

from __future__ import annotations

from typing import Any

from dblock import LockManager

KINDS = ["exclusive", "fair", "write", "read", "semaphore"]


def locked(m: LockManager, kind: str, key: str, timeout: float) -> Any:
    """A context manager holding ``key`` as ``kind`` (a semaphore of one permit)."""
    if kind == "write":
        return m.write_lock(key, timeout=timeout)
    if kind == "read":
        return m.read_lock(key, timeout=timeout)
    if kind == "semaphore":
        return m.semaphore(key, permits=1, timeout=timeout)
    return m.lock(key, timeout=timeout, fair=kind == "fair")
