"""The step protocol: how dblock's lock operations speak to their drivers.

A lock operation (acquire, release, a job's run, ``lock_many``) is written
once, as a generator without I/O: it yields *ops* (typed: :class:`Try`,
:class:`Release`, :class:`Wait`, ...), receives their answers (or has their
exceptions thrown in), and returns its result. One driver
(:func:`dblock._driver.drive`) runs every operation for both faces, each
with its own ops (the blocking face's in :mod:`dblock._drive`, the asyncio
face's in :mod:`dblock.aio`). The ops and the timings both faces share
live here, a floor below both, so neither reaches into the other.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator
from typing import Any, Final, TypeVar

from .errors import LockArgumentError

__all__ = [
    "CLEAN_UP",
    "EXPIRY_MARGIN",
    "OUTAGE_INITIAL",
    "OUTAGE_MAX",
    "Call",
    "Clean",
    "Op",
    "Release",
    "Run",
    "Settle",
    "Sleep",
    "Step",
    "Transfer",
    "Try",
    "Turn",
    "Wait",
    "noop",
    "refuse_on_event_loop",
]

T = TypeVar("T")


# -- the ops, typed ------------------------------------------------------------
# One class per op: what the steps ask their driver to do (its fields) and,
# in its docstring, what the driver answers. The one driver of both faces
# (dblock._driver) dispatches on the class.


class Try:
    """The store's attempt at the row -> ``Grant | Holder``. ``until``: how
    long it may wait for a grouped statement (see dblock._store.batch.until_for)."""

    __slots__ = ("key", "owner", "token", "ttl", "until")

    def __init__(self, key: str, token: str, owner: str, ttl: float, until: float | None) -> None:
        self.key, self.token, self.owner, self.ttl, self.until = key, token, owner, ttl, until


class Release:
    """Delete our row -> whether it was ours."""

    __slots__ = ("key", "token")

    def __init__(self, key: str, token: str) -> None:
        self.key, self.token = key, token


class Transfer:
    """Hand the row to a local waiter (a new token, fence and lease; ``extra``
    fences drawn for the next hand-offs) -> ``Grant | None``."""

    __slots__ = ("extra", "key", "new_token", "owner", "token", "ttl")

    def __init__(  # noqa: PLR0917 - as the store's transfer
        self, key: str, token: str, new_token: str, owner: str, ttl: float, extra: int
    ) -> None:
        self.key, self.token, self.new_token = key, token, new_token
        self.owner, self.ttl, self.extra = owner, ttl, extra


class Turn:
    """Wait in the key's local queue -> what came with the key (see
    ``Locker.acquire_steps``)."""

    __slots__ = ("timeout", "waiter")

    def __init__(self, waiter: Any, timeout: float | None) -> None:
        self.waiter, self.timeout = waiter, timeout


class Settle:
    """Wait until the waiter's grant is filled in, whatever happens -> nothing."""

    __slots__ = ("waiter",)

    def __init__(self, waiter: Any) -> None:
        self.waiter = waiter


class Wait:
    """Wait for a release of ``key``, at most ``limit`` seconds (``since``:
    when the refused try was sent). A new ``address`` or ``blocker`` is a
    fresh wait, so polling restarts at poll_initial -> nothing."""

    __slots__ = ("address", "blocker", "key", "limit", "since")

    def __init__(
        self, key: str, limit: float, since: float, address: Any = None, blocker: Any = None
    ) -> None:
        self.key, self.limit, self.since = key, limit, since
        self.address, self.blocker = address, blocker


class Sleep:
    """Sleep ``seconds`` -> nothing."""

    __slots__ = ("seconds",)

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds


class Clean:
    """Delete the rows of unconfirmed acquisitions (orphans) -> nothing."""

    __slots__ = ()


class Run:
    """Run a store operation (its ``Steps``) -> its answer."""

    __slots__ = ("steps",)

    def __init__(self, steps: Any) -> None:
        self.steps = steps


class Call:
    """The caller's own code (a job, one key of ``lock_many``) on its thread or
    task: call ``func`` (the asyncio face awaits what it returns) -> its result."""

    __slots__ = ("func",)

    def __init__(self, func: Callable[[], Any]) -> None:
        self.func = func


#: Clean carries nothing: one instance serves every step.
CLEAN_UP: Final = Clean()

#: What a lock operation's steps yield.
Step = Try | Release | Transfer | Turn | Settle | Wait | Sleep | Clean | Run | Call

#: A lock operation without I/O: yields ops, receives their answers (or has
#: their exceptions thrown in), returns its result.
Op = Generator[Step, Any, T]

# A waiting acquire that loses the database retries after 50 ms, doubling up
# to 1 s, until its own deadline (a failover takes seconds).
OUTAGE_INITIAL = 0.05
OUTAGE_MAX = 1.0
# Wake this long after the holder's lease ends, so the takeover finds it expired.
EXPIRY_MARGIN = 0.002


def refuse_on_event_loop(key: str) -> None:
    """A blocking wait on a thread that runs an event loop would freeze the
    loop (and every task on it) silently: refuse it instead."""
    aio = sys.modules.get("asyncio")
    if aio is not None and aio._get_running_loop() is not None:
        raise LockArgumentError(
            f"a blocking wait for lock {key!r} on a thread that runs an asyncio event loop "
            "would freeze the loop; use dblock's asyncio API (`async with`), or "
            "blocking=False / timeout=0"
        )


def noop() -> None:
    """A job that only wakes the renewal thread (which cleans orphans on its pass)."""
