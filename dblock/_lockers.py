"""The lockers of the kinds a manager makes on first use.

A :class:`~dblock.LockManager` always has the exclusive lock's
:class:`~dblock.lock.Locker`; the read-write lock's and the semaphores'
lockers cost a registry and a store each, so they are made when a request
first asks for that kind, and closed and reset with the manager. Both faces
take them from here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._store import Store
    from .config import Config
    from .kinds.rw import RwLocker
    from .kinds.semaphore import Semaphores
    from .lock import Locker

__all__ = ["KindLockers"]

# Made under one lock for the process: two first requests at once make one.
_kinds_lock = threading.Lock()


class KindLockers:
    """The read-write and semaphore lockers beside one exclusive locker
    (``rw`` and ``semaphores``: None until made)."""

    __slots__ = ("_config", "_locker", "_store", "rw", "semaphores")

    def __init__(self, store: Store, config: Config, locker: Locker) -> None:
        self._store = store
        self._config = config
        self._locker = locker
        self.rw: RwLocker | None = None
        self.semaphores: Semaphores | None = None

    def open_rw(self) -> RwLocker:
        """The read-write locker, made on first use."""
        rw = self.rw
        if rw is None:
            from .kinds.rw import RwLocker

            with _kinds_lock:
                if self.rw is None:
                    self.rw = RwLocker(self._store, self._config, self._locker)
                rw = self.rw
        return rw

    def open_semaphores(self) -> Semaphores:
        """The semaphores' locker, made on first use."""
        if self.semaphores is None:
            from .kinds.semaphore import Semaphores

            with _kinds_lock:
                if self.semaphores is None:
                    self.semaphores = Semaphores(self._store, self._config, self._locker)
        return self.semaphores

    def closers(self, limit: float) -> list[Callable[[], object]]:
        """What closes the lockers made, each waiting up to ``limit`` seconds
        for its holders (the manager runs each whatever the others raise)."""
        parts: list[Callable[[], object]] = []
        if self.semaphores is not None:
            parts.append(partial(self.semaphores.close, limit))
        if self.rw is not None:
            parts.append(partial(self.rw.close, limit))
        return parts

    def after_fork(self) -> None:
        """In a forked child: forget the parent's holders and connections."""
        if self.semaphores is not None:
            self.semaphores.after_fork()
        if self.rw is not None:
            self.rw.after_fork()
