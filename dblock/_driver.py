"""The one step driver of both faces.

A lock operation (acquire, release, a job's run, ``lock_many``) is a
generator of typed ops (:mod:`dblock.steps`) without I/O. :func:`drive`
carries out each op through ``ops``, the face's own calls (a statement on
the blocking store or on the asyncio one, a wait on a thread or in a task),
sends the answer back or throws in what the op raised, and returns what the
steps return. What an op means is written here once: when a wait for a
release starts afresh and when it ends, and how an exception that lands
between two steps (a signal handler's, a task's cancellation) reaches them.

The asyncio face awaits :func:`drive`. The blocking face runs the very same
coroutine with :func:`run_blocking`: its ops block instead of suspending,
so the coroutine never yields to a loop and finishes in one ``send``.
(psycopg 3 writes its logic once too, and generates its blocking face from
the asyncio one; here not even the text is repeated.)
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, Protocol, TypeVar

from .steps import Call, Clean, Op, Release, Run, Settle, Sleep, Transfer, Try, Turn, Wait

__all__ = ["Ops", "WaitFor", "drive", "run_blocking", "thrown_in"]

T = TypeVar("T")


class WaitFor(Protocol):
    """A wait for the release of one key, by the face's means (a
    notification, a named lock's wake-up, polling with backoff)."""

    def prepare(self) -> None: ...

    async def sleep(self, limit: float) -> None: ...

    def close(self) -> None: ...


class Ops(Protocol):
    """What each op does on one face: a call each. The blocking face's
    block and return (their coroutines never suspend); the asyncio face's
    await."""

    async def try_row(self, op: Try) -> Any: ...

    async def release_row(self, op: Release) -> Any: ...

    async def transfer(self, op: Transfer) -> Any: ...

    async def run_steps(self, op: Run) -> Any: ...

    async def turn(self, op: Turn) -> Any: ...

    def wait_for(self, op: Wait) -> WaitFor: ...

    async def settle(self, op: Settle) -> Any: ...

    async def sleep(self, op: Sleep) -> None: ...

    async def call(self, op: Call) -> Any: ...

    async def clean(self, op: Clean) -> None: ...


async def drive(ops: Ops, steps: Op[T]) -> T:  # noqa: PLR0912, PLR0915 - one branch per op
    """Carry out ``steps`` through ``ops``; returns what the steps return."""
    wait: WaitFor | None = None
    waiting_for: tuple[Any, Any] = (None, None)
    # How the steps go on: sent the last step's answer, or thrown what it raised.
    resume: Any = steps.send
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
                op = thrown_in(steps, exc)
            finally:
                # (An exception kept here would hold this frame through
                # its traceback, and with it the steps' locks, until the
                # garbage collector came by.)
                value = None
            try:
                answer: Any = None
                if isinstance(op, Try):
                    if wait is not None:
                        wait.prepare()
                    answer = await ops.try_row(op)
                elif isinstance(op, Release):
                    answer = await ops.release_row(op)
                elif isinstance(op, Run):
                    if wait is not None:
                        wait.prepare()
                    answer = await ops.run_steps(op)
                elif isinstance(op, Wait):
                    if wait is None or (op.address, op.blocker) != waiting_for:
                        # (A fair-queue waiter that joined again has a new address.)
                        if wait is not None:
                            wait.close()
                        wait = ops.wait_for(op)
                        waiting_for = (op.address, op.blocker)
                    await wait.sleep(op.limit)
                elif isinstance(op, Transfer):
                    answer = await ops.transfer(op)
                elif isinstance(op, Turn):
                    answer = await ops.turn(op)
                elif isinstance(op, Settle):
                    answer = await ops.settle(op)
                elif isinstance(op, Sleep):
                    await ops.sleep(op)
                elif isinstance(op, Call):
                    if wait is not None:  # (nothing to wait for while it runs)
                        wait.close()
                        wait = None
                    answer = await ops.call(op)
                elif isinstance(op, Clean):
                    await ops.clean(op)
                else:
                    raise TypeError(f"dblock: not a step: {op!r}")
            except BaseException as exc:
                resume, value = steps.throw, exc
            else:
                resume, value = steps.send, answer
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    finally:
        if wait is not None:
            wait.close()


def run_blocking(ops: Ops, steps: Op[T]) -> T:
    """Run :func:`drive` on this thread, without an event loop: the blocking
    face's ops never suspend, so its coroutine ends in one ``send``."""
    # The coroutine is made and kept inside one C call (extend over map):
    # CPython runs a signal handler only between bytecodes, so one raising
    # here finds it either not made or in ``made``, which the ``finally``
    # closes. Made by a Python call and stored after, it could be cut off
    # in between, never started nor closed: "coroutine 'drive' was never
    # awaited", and a warnings recorder that keeps it (pytest's, say) keeps
    # the steps and the lock they release alive with it.
    made: list[Coroutine[Any, Any, T]] = []
    try:
        made.extend(map(drive, (ops,), (steps,)))
        made[0].send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    finally:
        for coro in made:
            coro.close()  # (done: nothing; one that suspended after all: never left pending)
    raise RuntimeError("dblock: a blocking op suspended its driver")


def thrown_in(steps: Op[T], exc: BaseException) -> Any:
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
