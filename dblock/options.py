"""The options every lock request takes, written once for both faces.

``LockManager.lock``, ``acquire``, ``semaphore``, ``read_lock``,
``write_lock``, ``lock_many``, ``acquire_many`` and ``locked``, their
:class:`~dblock.AsyncLockManager` twins and the decorators take these as
``**options: Unpack[LockArgs]``: one definition, so the blocking and the
asyncio signatures cannot drift apart, and a type checker still knows each
name and its type. A ``TypedDict`` checks nothing at run time, so
:func:`lock_args` refuses a name that is not one of them, before any SQL,
as a mistyped keyword argument would be.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, TypedDict

from .config import OnLost, Unset, did_you_mean
from .errors import LockArgumentError

__all__ = ["LOCK_ARGS", "LockArgs", "lock_args"]


class LockArgs(TypedDict, total=False):
    """What a lock request may say; a name left out takes the manager's default.

    ``blocking``: ``False`` fails fast with :class:`~dblock.LockBusy`.
    ``timeout``: seconds a blocking request waits before
    :class:`~dblock.LockTimeout` (``None``: until granted; ``UNSET``, as
    when it is not given: the manager's default).
    ``ttl``: the lease in seconds. ``renew``: renew it while held.
    ``max_hold``: never renew past this many seconds.
    ``on_lost``: called with the lock if it is lost while held.
    """

    blocking: bool
    timeout: float | Unset | None
    ttl: float | None
    renew: bool | None
    max_hold: float | None
    on_lost: OnLost | None


#: The names of :class:`LockArgs`.
LOCK_ARGS: frozenset[str] = LockArgs.__optional_keys__ | LockArgs.__required_keys__


def lock_args(options: Mapping[str, Any], *, also: Iterable[str] = ()) -> Mapping[str, Any]:
    """``options`` if every name in it is a lock option (or in ``also``);
    otherwise a :class:`~dblock.LockArgumentError` naming the stranger."""
    if options.keys() <= LOCK_ARGS:  # the common case, on every lock's path
        return options
    unknown = sorted(set(options) - LOCK_ARGS - set(also))
    if unknown:
        known = ", ".join(sorted(LOCK_ARGS | set(also)))
        raise LockArgumentError(
            f"unknown option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}{did_you_mean(unknown, LOCK_ARGS | set(also))}; "
            f"the options are: {known}"
        )
    return options
