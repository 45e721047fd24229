"""Leadership on the asyncio face: :class:`AsyncLeader` (see :mod:`dblock.leader`).

The same election, awaited. A term lost while its ``async with`` block
runs cancels the task running the block, and the block's exit raises
:class:`~dblock.LeadershipLost` in place of that cancellation (as
``asyncio.timeout`` turns its cancellation into ``TimeoutError``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, Protocol

from .errors import LeadershipLost, LockArgumentError, LockTimeout, ManagerClosed
from .leader import Guarded, Leader, LeaderBase, Term

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._held import HeldLock
    from .options import LockArgs

__all__ = ["AsyncElector", "AsyncLeader"]


class AsyncElector(Protocol):
    """What an asyncio leader needs of its manager (``AsyncLockManager`` is one)."""

    def acquire(
        self, key: str, *, fair: bool = ..., **options: Unpack[LockArgs]
    ) -> Awaitable[Any]: ...

    @property
    def store(self) -> Guarded: ...


class AsyncLeader(LeaderBase):
    """:class:`Leader` on the asyncio face: ``async with`` waits until
    elected; a term lost while the block runs cancels the task running it,
    and the block's exit raises :class:`~dblock.LeadershipLost` in place of
    that cancellation. Made by :meth:`dblock.AsyncLockManager.leader`."""

    _elector: AsyncElector
    _aheld: Any = None
    _task: asyncio.Task[Any] | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _cancelled_by_us = False

    async def elect(self, timeout: float | None = None) -> Term:
        if self.leading:
            raise LockArgumentError(f"already leading {self.role!r}: step down first")
        stood = time.monotonic()
        aheld = await self._elector.acquire(self.key, **self._options(timeout))
        self._aheld = aheld
        return self._begin(aheld.held, self._elector.store, stood)

    async def step_down(self) -> None:
        aheld = self._aheld
        held = self._held
        if aheld is None or held is None or held.released:
            return
        self._end(held, "stepped down")
        with contextlib.suppress(Exception):
            await aheld.release(force=True)

    def _on_lost(self, held: HeldLock) -> None:
        super()._on_lost(held)
        task, loop = self._task, self._loop
        if task is not None and loop is not None and not task.done():
            self._cancelled_by_us = True
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(task.cancel)

    async def __aenter__(self) -> Term:
        term = await self.elect()
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._cancelled_by_us = False
        if not self.leading:  # lost before the task could be told: not begun
            await self.step_down()
            raise LeadershipLost(self.role, term.fence, self._reason or "lost")
        return term

    async def __aexit__(self, kind: type[BaseException] | None, exc: Any, tb: object) -> None:
        task, self._task = self._task, None
        cancelled_by_us, self._cancelled_by_us = self._cancelled_by_us, False
        term = self._term
        await self.step_down()
        if cancelled_by_us and task is not None:
            uncancel = getattr(task, "uncancel", None)  # (3.11: else nothing counts)
            if uncancel is not None:
                uncancel()
            if kind is asyncio.CancelledError or kind is None:
                raise LeadershipLost(
                    self.role, None if term is None else term.fence, self._reason or "lost"
                ) from exc

    async def campaign(self) -> None:
        """Stand for election until cancelled: ``on_elected``/``on_revoked``
        as :meth:`Leader.campaign`'s. Run it as a task; cancel it to stop
        (the term, if any, is stepped down)."""
        try:
            while True:
                try:
                    await self.elect(timeout=Leader.STANDBY)
                except LockTimeout:
                    continue
                try:
                    while self.leading:
                        await asyncio.sleep(0.2)
                finally:
                    await self.step_down()
        except ManagerClosed:
            return
