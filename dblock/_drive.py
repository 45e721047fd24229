"""The blocking face's ops (:class:`BlockingOps`): what each step of a lock
operation does on the calling thread. The loop that carries the steps out
is the one both faces share (:func:`dblock._driver.drive`); here its ops
block instead of suspending."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, TypeVar

from ._driver import run_blocking
from ._lockbase import LockerBase
from .errors import LockTimeout
from .registry import Waiter
from .steps import (
    Call,
    Clean,
    Op,
    Release,
    Run,
    Settle,
    Sleep,
    Transfer,
    Try,
    Turn,
    Wait,
    refuse_on_event_loop,
)

if TYPE_CHECKING:
    from ._store import Wait as StoreWait

T = TypeVar("T")


class _BlockingWait:
    """The store's wait for a release, as the driver awaits it (it blocks)."""

    __slots__ = ("_sleep", "close", "prepare")

    def __init__(self, wait: StoreWait) -> None:
        self.prepare = wait.prepare
        self.close = wait.close
        self._sleep = wait.sleep

    async def sleep(self, limit: float) -> None:
        self._sleep(limit)


class BlockingOps:
    """Each op on the calling thread, blocking (see :class:`dblock._driver.Ops`)."""

    __slots__ = ("locker",)

    def __init__(self, locker: BlockingDriver) -> None:
        self.locker = locker

    async def try_row(self, op: Try) -> Any:
        locker = self.locker
        batcher = locker.batcher
        if batcher is None:
            return locker.store.try_acquire(op.key, op.token, op.owner, op.ttl)
        return batcher.try_acquire(op.key, op.token, op.owner, op.ttl, op.until)

    async def release_row(self, op: Release) -> Any:
        return self.locker.rows.release(op.key, op.token)

    async def transfer(self, op: Transfer) -> Any:
        return self.locker.store.transfer(
            op.key, op.token, op.new_token, op.owner, op.ttl, extra=op.extra
        )

    async def run_steps(self, op: Run) -> Any:
        return self.locker.store.drive(op.steps)

    async def turn(self, op: Turn) -> Any:
        return self.locker.wait_turn(op.waiter, op.timeout)

    def wait_for(self, op: Wait) -> _BlockingWait:
        refuse_on_event_loop(op.key)
        return _BlockingWait(self.locker.store.waiter(op.key, op.since, op.address))

    async def settle(self, op: Settle) -> Any:
        return op.waiter.settle()

    async def sleep(self, op: Sleep) -> None:
        time.sleep(op.seconds)  # (looked up each time: a test may patch it)

    async def call(self, op: Call) -> Any:
        return op.func()

    async def clean(self, op: Clean) -> None:
        self.locker.store.clean_orphans()


class BlockingDriver(LockerBase):
    """Runs steps on the calling thread (see :meth:`run`)."""

    def run(self, steps: Op[T]) -> T:
        """Carry out ``steps`` on this thread, blocking."""
        return run_blocking(self.ops, steps)

    def wait_turn(self, waiter: Waiter, timeout: float | None) -> object:
        """Wait in the queue of ``key`` until the key is handed to us; returns
        what came with it (see :meth:`acquire_steps`)."""
        key = waiter.entry.key
        if timeout != 0:
            refuse_on_event_loop(key)
        if not waiter.wait(timeout):
            if self.registry.abandon(key, waiter):
                raise LockTimeout(key, timeout=timeout or 0.0, level=1)
            # The key was handed to us as we gave up; the wake-up follows the
            # hand-off statement. Take what we were given.
            pending = waiter.settle()
            if pending is not None:
                raise pending
        return waiter.grant
