"""Semaphores: at most N holders of a key across all processes.

``locks.semaphore(key, permits=N)``. Each permit is a row of its own (slots
``p0`` … ``p{N-1}``, ``kind = 'semaphore'``, ``permits = N``) with its own
owner, token, fence and lease; so crash takeover, renewal, ``LockLost``,
``on_lost``, the sweeper and the admin tools treat a permit exactly like an
exclusive lock's row.

How it reuses the exclusive lock's machinery. A semaphore is run by a
second :class:`~dblock.lock.Locker` of the manager (made on first use) whose
keys are *local permit keys*, ``key`` NUL ``N`` NUL ``i`` for ``i < N``: level 1 is
the locker's registry, so one process has at most N requests of a key
past level 1 at once (each local permit key lets one thread through; the
others queue on it or, fail-fast, are refused without SQL), and everything
else (waiting, deadlines, interruption clean-up, ambiguous outcomes, orphans,
renewal, owner liveness) is the locker's own code. Its store,
:class:`PermitStore`, maps a local permit key back to the key and takes *any*
free permit row of the database, trying the local index's slot first: on the
uncontended path that slot is free and the grant is one statement (an
``INSERT`` guarded against rows of another kind or another N, taking over an
expired permit in place where the dialect can). Otherwise one read of the
key's rows finds a free or expired slot (tried next) or the holder whose
lease ends first (the waiter sleeps until then at most, or until a release
is announced: ``NOTIFY`` on PostgreSQL, polling elsewhere).

Fences come from the table's counter, drawn (on PostgreSQL under the key's
advisory lock, on MySQL under the AUTO-INC lock of ``INSERT … SELECT``, on
SQLite under the file's write lock) as each permit row is written, so they
grow strictly per key whatever slot is taken.

A local waiter queues on one local permit key (one another thread of this
process holds), so it may wait for that holder although another local
permit came free first: never more than N local requests, at some cost in
local fairness.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from .._store.base import Grant, Store
from .._store.permits import PermitStore, local_key, real_key, size_index
from ..errors import (
    KindMismatch,
    LockArgumentError,
    LockBusy,
    LockNotAcquired,
    LockTimeout,
    ManagerClosed,
)
from ..lock import HeldLock, Locker, LockOptions
from ..registry import current_owner
from . import SEMAPHORE, describe

if TYPE_CHECKING:
    from ..config import Config

__all__ = ["MAX_PERMITS", "HeldPermit", "PermitStore", "Semaphores"]

#: The largest N a semaphore may have (each permit is a row).
MAX_PERMITS = 10_000


def check_permits(permits: object) -> int:
    """N, checked before any SQL."""
    if isinstance(permits, bool) or not isinstance(permits, int) or not 1 <= permits <= MAX_PERMITS:
        raise LockArgumentError(f"permits must be an int from 1 to {MAX_PERMITS}, got {permits!r}")
    return permits


class HeldPermit(HeldLock):
    """One permit of a semaphore, as ``locks.semaphore()`` yields it: a
    :class:`~dblock.HeldLock` (fence, expires_at, lost, extend(), release())
    whose ``slot`` names its row and ``permits`` the semaphore's N."""

    __slots__ = ("permits", "slot")

    def __init__(  # noqa: PLR0917 - as HeldLock's
        self,
        locker: Locker,
        entry: Any,
        token: str,
        owner: str,
        ttl: float,
        grant: Grant,
        sent_at: float,
        options: LockOptions,
    ) -> None:
        super().__init__(locker, entry, token, owner, ttl, grant, sent_at, options)
        self.key = self.state.key = real_key(entry.key)
        self.slot = grant.slot
        self.permits = size_index(entry.key)[0]

    def __repr__(self) -> str:
        state = "released" if self.state.released else f"expires_at={self.expires_at.isoformat()}"
        return f"<HeldPermit {self.key!r} {self.slot}/{self.permits} fence={self.fence} {state}>"


class Semaphores:
    """A manager's semaphores: their locker (local permit keys) and store."""

    def __init__(self, store: Store, config: Config, exclusive: Locker) -> None:
        self.store = PermitStore(store)
        self.locker = Locker(self.store, config)
        self.locker.held_type = HeldPermit
        self.locker.kind = SEMAPHORE
        self._exclusive = exclusive
        self._lock = threading.Lock()
        self._turn = 0
        # An exclusive request for a key this process uses as a semaphore is refused.
        exclusive.kind_guard = self._guard_exclusive

    def _in_use(self, key: str, n: int) -> bool:
        registry = self.locker.registry
        return any(registry.get(local_key(key, n, i)) is not None for i in range(n))

    def _guard_exclusive(self, key: str) -> None:
        n = self.store.permits_of.get(key)
        if n is not None and self._in_use(key, n):
            raise KindMismatch(
                key, requested="exclusive", existing=describe(SEMAPHORE, n), where="in this process"
            )

    def _size(self, key: str, n: int) -> None:
        """Fix N for ``key`` in this process, or refuse another N (or an
        exclusive lock of it held here)."""
        if self._exclusive.registry.get(key) is not None:
            raise KindMismatch(
                key, requested=describe(SEMAPHORE, n), existing="exclusive", where="in this process"
            )
        sizes = self.store.permits_of
        with self._lock:
            old = sizes.get(key)
            if old is not None and old != n and self._in_use(key, old):
                raise KindMismatch(
                    key,
                    requested=describe(SEMAPHORE, n),
                    existing=describe(SEMAPHORE, old),
                    where="in this process",
                )
            sizes[key] = n
            if len(sizes) > 1024:  # forget the keys nobody here uses any more
                for k, m in list(sizes.items()):
                    if k != key and not self._in_use(k, m):
                        del sizes[k]

    def acquire(
        self,
        key: str,
        n: int,
        *,
        blocking: bool,
        timeout: float | None,
        ttl: float,
        options: LockOptions | None,
    ) -> HeldPermit:
        self._size(key, n)
        try:
            for sub in self.plan(key, n, blocking=blocking):
                try:
                    held = self.locker.acquire(
                        sub, blocking=blocking, timeout=timeout, ttl=ttl, options=options
                    )
                except LockBusy as exc:
                    if exc.level == 2:
                        raise
                    continue  # another thread claimed it an instant ago: the next
                assert isinstance(held, HeldPermit)
                return held
            raise LockBusy(key, level=1)
        except (LockNotAcquired, KindMismatch, ManagerClosed) as exc:
            raise self.renamed(exc, key, n) from None

    def plan(self, key: str, n: int, *, blocking: bool) -> list[str]:
        """The local permit keys to ask for, in turn, until one is granted.

        A local permit key nobody here holds or waits for passes level 1 at
        once: fail-fast, each such key in turn (none left: refused, no
        SQL); waiting, the first (queueing behind whoever took it an instant
        ago). When all N are in use here, a waiting request queues on one
        held by another thread (taking turns among them)."""
        registry = self.locker.registry
        free = [
            local_key(key, n, i) for i in range(n) if registry.get(local_key(key, n, i)) is None
        ]
        if not blocking or free:
            return free[:1] if blocking else free
        me = current_owner()
        others = [
            i
            for i in range(n)
            if (entry := registry.get(local_key(key, n, i))) is None or entry.owner is not me
        ]
        if not others:
            return []  # this thread holds all N: waiting would never end
        with self._lock:
            self._turn += 1
            return [local_key(key, n, others[self._turn % len(others)])]

    @staticmethod
    def renamed(exc: LockNotAcquired | KindMismatch | ManagerClosed, key: str, n: int) -> Exception:
        """The locker's error about a local permit key, about ``key`` instead."""
        if isinstance(exc, KindMismatch):
            if exc.key == key:
                return exc
            return KindMismatch(
                key, requested=describe(SEMAPHORE, n), existing=exc.existing, where="in the table"
            )
        if isinstance(exc, LockTimeout):
            return LockTimeout(key, timeout=exc.timeout, level=exc.level, holder=exc.holder)
        if isinstance(exc, LockBusy):
            return LockBusy(key, level=exc.level, holder=exc.holder)
        if isinstance(exc, ManagerClosed):
            return ManagerClosed(f"the LockManager was closed while waiting for {key!r}")
        return exc

    def close(self, timeout: float) -> None:
        self.locker.close(timeout)
        self.store.close()

    def after_fork(self) -> None:
        self.locker.after_fork()
        self.store.after_fork()
