"""The blocking driver of the step protocol (:mod:`dblock.steps`): carries
out each op a lock operation yields, on the calling thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from ._lockbase import LockerBase
from ._store import Wait
from .errors import LockTimeout
from .registry import Waiter
from .steps import (
    CALL,
    RELEASE,
    SETTLE,
    SLEEP,
    STEPS,
    TRANSFER,
    TRY,
    TURN,
    WAIT,
    Op,
    refuse_on_event_loop,
)

T = TypeVar("T")


class BlockingDriver(LockerBase):
    """Runs steps on the calling thread (see :meth:`run`)."""

    def run(self, steps: Op[T]) -> T:  # noqa: PLR0912, PLR0915 - one branch per op
        """Carry out ``steps`` on this thread, blocking."""
        store = self.store
        rows = self._rows
        batcher = self.batcher
        wait: Wait | None = None
        waiting_for: tuple[Any, ...] = ()
        # How the steps go on: sent the last step's answer, or thrown what it raised.
        resume: Callable[[Any], Any] = steps.send
        value: Any = None
        try:
            while True:
                try:
                    op = resume(value)
                except StopIteration:
                    raise
                except BaseException as exc:
                    if getattr(steps, "gi_frame", None) is None:
                        raise  # theirs: they are done
                    op = _thrown_in(steps, exc)
                finally:
                    # (An exception kept here would hold this frame through
                    # its traceback, and with it the steps' locks, until the
                    # garbage collector came by.)
                    value = None
                try:
                    tag = op[0]
                    if tag is TRY:
                        if wait is not None:
                            wait.prepare()
                        answer: object = (
                            rows.try_acquire(op[1], op[2], op[3], op[4])
                            if batcher is None
                            else batcher.try_acquire(op[1], op[2], op[3], op[4], op[5])
                        )
                    elif tag is RELEASE:
                        answer = rows.release(op[1], op[2])
                    elif tag is TRANSFER:
                        answer = store.transfer(op[1], op[2], op[3], op[4], op[5], extra=op[6])
                    elif tag is STEPS:
                        if wait is not None:
                            wait.prepare()
                        answer = store.drive(op[1])
                    elif tag is TURN:
                        answer = self._wait_turn(op[1], op[2])
                    elif tag is WAIT:
                        if wait is None or op[4:] != waiting_for:
                            # (A fair-queue waiter that joined again has a new address.)
                            if wait is not None:
                                wait.close()
                            refuse_on_event_loop(op[1])
                            wait = store.waiter(op[1], op[3], *op[4:5])
                            waiting_for = op[4:]
                        wait.sleep(op[2])
                        answer = None
                    elif tag is SETTLE:
                        answer = op[1].settle()
                    elif tag is SLEEP:
                        time.sleep(op[1])
                        answer = None
                    elif tag is CALL:
                        if wait is not None:  # (nothing to wait for while it runs)
                            wait.close()
                            wait = None
                        answer = op[1]()
                    else:  # CLEAN
                        store.clean_orphans()
                        answer = None
                except BaseException as exc:
                    resume, value = steps.throw, exc
                else:
                    resume, value = steps.send, answer
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        finally:
            if wait is not None:
                wait.close()

    def _wait_turn(self, waiter: Waiter, timeout: float | None) -> object:
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


def _thrown_in(steps: Op[T], exc: BaseException) -> Any:
    """``exc`` came out of resuming ``steps``: raised by them (they are done),
    or a signal handler's, landing as they yielded their next step. That one
    is thrown in at that step, as if the step had raised it: else the steps
    stayed suspended, their clean-up for an interrupted statement (a waiter
    to wake, a row to delete) waiting for the garbage collector."""
    while getattr(steps, "gi_frame", None) is not None:  # suspended at a yield: not done
        try:
            return steps.throw(exc)
        except StopIteration:
            raise
        except BaseException as again:
            exc = again
    try:
        raise exc
    finally:
        del exc  # (the traceback holds this frame: no cycle keeping the locks alive)
