"""The step protocol: how dblock's lock operations speak to their drivers.

A lock operation (acquire, release, a job's run, ``lock_many``) is written
once, as a generator without I/O: it yields *ops* (a tuple whose first item
names what to do, the rest its arguments), receives their answers (or has
their exceptions thrown in), and returns its result. Two drivers run every
operation: the blocking one in :mod:`dblock.lock` (``Locker.run``) and the
asyncio one in :mod:`dblock.aio`. The ops and the timings both sides share
live here, a floor below both, so neither reaches into the other.
"""

from __future__ import annotations

import sys
from collections.abc import Generator
from typing import Any, Final, TypeVar

from .errors import LockArgumentError

__all__ = [
    "CALL",
    "CLEAN",
    "CLEAN_OP",
    "EXPIRY_MARGIN",
    "GIVE_BACK",
    "OUTAGE_INITIAL",
    "OUTAGE_MAX",
    "RELEASE",
    "SETTLE",
    "SLEEP",
    "STEPS",
    "TAKE",
    "TRANSFER",
    "TRY",
    "TURN",
    "WAIT",
    "Op",
    "noop",
    "refuse_on_event_loop",
]

T = TypeVar("T")

# What acquire_steps and release_steps ask their driver to do (the first item
# of each yielded tuple; the rest are its arguments), and what it answers:
TRY: Final = "try"  # (key, token, owner, ttl, until): the store's attempt -> Grant | Holder
# (until: how long it may wait for a grouped statement, see dblock._store.batch.until_for)
RELEASE: Final = "release"  # (key, token): delete our row -> bool
TRANSFER: Final = "transfer"  # (key, token, new_token, owner, ttl, extra) -> Grant | None
TURN: Final = "turn"  # (waiter, timeout): wait in the local queue -> the grant
SETTLE: Final = "settle"  # (waiter,): wait until its grant is filled in, whatever happens
WAIT: Final = "wait"  # (key, limit, since[, address, blocker]): wait for a release (a new
# address or blocker: a fresh wait, so polling restarts at poll_initial), at most limit seconds
SLEEP: Final = "sleep"  # (seconds,)
CLEAN: Final = "clean"  # (): delete the rows of unconfirmed acquisitions
STEPS: Final = "steps"  # (steps,): run a store operation (Steps) -> its answer
CALL: Final = "call"  # (func,): the caller's own code (a job) on its thread or task:
# call it (the asyncio driver awaits what it returns) -> its result
CLEAN_OP: Final = (CLEAN,)
# lock_many's own (dblock.multi), driven by the same two drivers:
TAKE: Final = "take"  # (key, timeout): acquire one key -> its held lock
GIVE_BACK: Final = "give back"  # (held,): release these, newest first -> ignored

#: A lock operation without I/O: yields ops, receives their answers (or has
#: their exceptions thrown in), returns its result.
Op = Generator[tuple[Any, ...], Any, T]

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
