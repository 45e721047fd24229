"""The one step driver (``dblock._driver.drive``) under both faces: the same
step sequences, run by the blocking face (its ops block; the driver's
coroutine never suspends) and by the asyncio face, end alike and send the
same number of statements: a plain grant and release, a refusal, steps
that catch an op's failure and finish (the exception thrown into steps
that are done), steps that raise, and, at every point of the driver where
a signal handler can raise, steps whose clean-up still runs. The asyncio
face is also cancelled at each of its awaits."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import uuid
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from dblock import AsyncLockManager, LockManager
from dblock._store import Grant, Holder
from dblock.aio import _drive as drive_async
from dblock.steps import Call, Op, Release, Run, Sleep, Step, Try
from tests.support.interrupts import Interrupt, interrupt_at, next_point

Seq = Callable[[str, list[str]], Op[Any]]


def _plain(key: str, log: list[str]) -> Op[Any]:
    token = uuid.uuid4().hex
    got = yield Try(key, token, "test", 30.0, None)
    deleted = yield Release(key, token)
    return type(got).__name__, deleted


def _refused(key: str, log: list[str]) -> Op[Any]:
    got = yield Try(f"{key}:held", uuid.uuid4().hex, "test", 30.0, None)
    return type(got).__name__, isinstance(got, Holder)


def _failing_steps() -> Generator[Any, Any, Any]:
    raise ValueError("a store operation that fails")
    yield  # (a generator)


def _catches_and_finishes(key: str, log: list[str]) -> Op[Any]:
    try:
        yield Run(_failing_steps())
    except ValueError as exc:
        return f"caught {exc}"  # done: what the driver threw in ends them
    return "not raised"


def _raises(key: str, log: list[str]) -> Op[Any]:
    yield Sleep(0)
    raise KeyError("the steps' own")


def _cleans_up(key: str, log: list[str]) -> Op[Any]:
    try:
        for _ in range(3):
            yield Sleep(0.001)
        return "slept"
    finally:
        log.append("cleaned up")


SEQUENCES: dict[str, Seq] = {
    "plain": _plain,
    "refused": _refused,
    "catches and finishes": _catches_and_finishes,
    "raises": _raises,
    "cleans up": _cleans_up,
}


def _outcome(run: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "returned", run()
    except Exception as exc:
        return "raised", f"{type(exc).__name__}: {exc}"


def _counter(engine: sa.Engine) -> Iterator[list[str]]:
    sent: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        yield sent
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)


@pytest.fixture
def faces(db_url: str, key: str) -> Iterator[tuple[LockManager, AsyncLockManager]]:
    blocking = LockManager(db_url)
    alocks = AsyncLockManager(db_url)
    other = LockManager(db_url)
    held = other.acquire(f"{key}:held")  # what _refused finds held
    try:
        yield blocking, alocks
    finally:
        held.release()
        other.close()
        blocking.close()
        asyncio.run(alocks.close())


def test_both_faces_end_alike_and_send_the_same_statements(
    faces: tuple[LockManager, AsyncLockManager], key: str
) -> None:
    blocking, alocks = faces
    locker = blocking.locker
    outcomes: dict[str, dict[str, Any]] = {"blocking": {}, "asyncio": {}}
    sent: dict[str, dict[str, int]] = {"blocking": {}, "asyncio": {}}
    for name, seq in SEQUENCES.items():
        log: list[str] = []
        counter = _counter(blocking.engine)
        statements = next(counter)
        steps = seq(key, log)
        outcomes["blocking"][name] = (_outcome(lambda: locker.run(steps)), log)  # noqa: B023
        sent["blocking"][name] = len(statements)
        next(counter, None)

    async def run_all() -> None:
        engine = alocks.astore.engine.sync_engine
        for name, seq in SEQUENCES.items():
            log: list[str] = []
            counter = _counter(engine)
            statements = next(counter)
            try:
                result: Any = ("returned", await drive_async(alocks, seq(key, log)))
            except Exception as exc:
                result = ("raised", f"{type(exc).__name__}: {exc}")
            outcomes["asyncio"][name] = (result, log)
            sent["asyncio"][name] = len(statements)
            next(counter, None)

    asyncio.run(run_all())
    assert outcomes["blocking"] == outcomes["asyncio"]
    assert outcomes["blocking"]["plain"][0] == ("returned", ("Grant", True))
    assert outcomes["blocking"]["refused"][0] == ("returned", ("Holder", True))
    assert outcomes["blocking"]["catches and finishes"][0] == (
        "returned",
        "caught a store operation that fails",
    )
    assert outcomes["blocking"]["raises"][0] == ("raised", 'KeyError: "the steps\' own"')
    assert outcomes["blocking"]["cleans up"] == (("returned", "slept"), ["cleaned up"])
    assert sent["blocking"] == sent["asyncio"]
    # (PostgreSQL and SQLite: the INSERT and the DELETE; MariaDB adds its
    # named-lock wake-ups' statements, on both faces alike.)
    assert sent["blocking"]["plain"] >= 2


def _walk(run: Callable[[Op[Any]], Any], files: tuple[str, ...], key: str) -> int:
    """Interrupt the driver at each of its points: the exception reaches the
    caller, and the steps are never left suspended (their clean-up ran)."""
    n = 0
    while True:
        n = next_point(n)
        log: list[str] = []
        steps = _cleans_up(key, log)
        with interrupt_at(n, *files) as armed, contextlib.suppress(Interrupt):
            run(steps)
        if armed.where is not None:
            # Never started (nothing to clean up) or done: not suspended.
            assert inspect.getgeneratorstate(steps) != inspect.GEN_SUSPENDED, (
                f"interrupted in {armed.where}: the steps were left suspended"
            )
            assert log in ([], ["cleaned up"])
        if armed.points < n:
            return n


@pytest.mark.databases("sqlite")
def test_an_interruption_anywhere_in_the_driver_reaches_the_steps(
    faces: tuple[LockManager, AsyncLockManager], key: str
) -> None:
    blocking, alocks = faces
    points = _walk(blocking.locker.run, ("dblock/_driver.py", "dblock/_drive.py"), key)
    assert points > 10
    loop = asyncio.new_event_loop()
    try:
        points = _walk(
            lambda steps: loop.run_until_complete(drive_async(alocks, steps)),
            ("dblock/_driver.py",),
            key,
        )
        assert points > 10
    finally:
        loop.run_until_complete(alocks.close())
        loop.close()


@pytest.mark.databases("sqlite")
def test_the_asyncio_face_cancelled_at_each_await_cleans_the_steps_up(
    faces: tuple[LockManager, AsyncLockManager], key: str
) -> None:
    _, alocks = faces

    async def cancelled_after(turns: int) -> tuple[bool, list[str]]:
        log: list[str] = []
        steps = _cleans_up(key, log)
        task = asyncio.ensure_future(drive_async(alocks, steps))
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            cancelled = True
        else:
            cancelled = False
        # Cancelled before the steps started (nothing to clean up), or
        # their clean-up ran: never left suspended.
        assert inspect.getgeneratorstate(steps) != inspect.GEN_SUSPENDED, turns
        return cancelled, log

    async def every() -> None:
        for turns in range(12):
            cancelled, log = await cancelled_after(turns)
            assert log == (["cleaned up"] if turns else []), (turns, cancelled)

    asyncio.run(every())


def test_a_step_that_is_not_an_op_is_refused(faces: tuple[LockManager, AsyncLockManager]) -> None:
    blocking, _ = faces

    def wrong() -> Generator[Any, Any, None]:
        yield ("try", "k")  # a tuple: the old form

    with pytest.raises(TypeError, match="not a step"):
        blocking.locker.run(wrong())  # type: ignore[arg-type]
    assert Step is not None
    assert Call is not None
    assert Grant is not None
