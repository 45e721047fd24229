"""The fence tests' bookkeeping: threads that take one key and record, in the
order ``acquire()`` returned, who was granted which fence.

Each holder records before it releases, so the list's order is the order of
the grants, and fences must grow along it (tests/test_postgresql_fence.py,
tests/test_mysql_fence.py)."""

from __future__ import annotations

import threading

from dblock import LockManager


class Grants:
    """``start(manager, name)`` runs a thread that acquires ``key``, records
    ``(name, fence)`` and releases; a name in ``hold`` keeps its lock until
    :meth:`let_go`."""

    def __init__(self, key: str, *, hold: str = "") -> None:
        self.key = key
        self.hold = hold
        self.grants: list[tuple[str, int]] = []
        self._record = threading.Lock()
        self._let_go = threading.Event()
        self.threads: list[threading.Thread] = []

    def _take(self, manager: LockManager, name: str) -> None:
        held = manager.acquire(self.key, timeout=60)
        with self._record:
            self.grants.append((name, held.fence))
        if name == self.hold:
            self._let_go.wait(60)
        held.release()

    def start(self, manager: LockManager, name: str) -> None:
        thread = threading.Thread(target=self._take, args=(manager, name))
        self.threads.append(thread)
        thread.start()

    def names(self) -> list[str]:
        with self._record:
            return [name for name, _ in self.grants]

    def fences(self) -> list[int]:
        with self._record:
            return [fence for _, fence in self.grants]

    def let_go(self) -> None:
        """The held one releases."""
        self._let_go.set()

    def join(self) -> None:
        self._let_go.set()
        for thread in self.threads:
            thread.join(60)
