"""What the blocking and the asyncio faces decide alike, written once, without I/O.

:class:`~dblock.LockManager` and :class:`~dblock.AsyncLockManager` take the
same requests with the same options and refuse the same mistakes with the
same words, before any SQL. That part is here, once, the way psycopg 3 and
httpx keep a core without I/O under their two faces: checking a request's
key and options against the manager's defaults (:class:`Requests`), the
acquire loop a ``fair`` flag picks (:func:`level2_loop`), the hook an
``until`` names (:func:`until_hook`). Each face keeps only its blocking or
awaiting calls.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from .config import (
    Config,
    check_lease,
    check_max_hold,
    check_on_lost,
    check_timeout,
    check_wait,
)
from .errors import LockArgumentError, ManagerClosed
from .keys import check_key
from .kinds.fair import queued_loop
from .lock import UNSET, Level2, Locker, LockOptions
from .multi import order_keys
from .options import lock_args

if TYPE_CHECKING:
    from .deferral import DeferHook

__all__ = ["Checked", "Requests", "level2_loop", "until_hook"]


class Checked(NamedTuple):
    """One request, checked: what the acquire takes (``options`` None: the
    locker's defaults)."""

    key: str
    blocking: bool
    timeout: float | None
    ttl: float
    options: LockOptions | None


class Requests:
    """A manager's checks of the requests both its faces take, before any
    SQL; and whether it still takes any (``closed``, set once by ``close()``)."""

    __slots__ = ("_config", "_locker", "closed")

    def __init__(self, config: Config, locker: Locker) -> None:
        self._config = config
        self._locker = locker
        self.closed = False

    def open(self) -> Locker:
        """The locker, for a call about to take a lock: refused once closed."""
        if self.closed:
            raise ManagerClosed("this LockManager is closed")
        return self._locker

    def check(self, key: object, given: Mapping[str, Any]) -> Checked:
        """Validate one request's key and options (:class:`~dblock.options.LockArgs`)
        before any SQL; an option not given, or ``None``, means the default."""
        if self.closed:
            raise ManagerClosed("this LockManager is closed")
        lock_args(given)
        blocking = given.get("blocking", True)
        timeout = given.get("timeout", UNSET)
        ttl = given.get("ttl")
        renew = given.get("renew")
        max_hold = given.get("max_hold")
        on_lost = given.get("on_lost")
        if not isinstance(blocking, bool):
            raise LockArgumentError(f"blocking must be True or False, got {blocking!r}")
        options = None
        if renew is not None or max_hold is not None or on_lost is not None:
            if renew is not None and not isinstance(renew, bool):
                raise LockArgumentError(f"renew must be True or False, got {renew!r}")
            defaults = self._locker.defaults
            options = LockOptions(
                renew=defaults.renew if renew is None else renew,
                max_hold=defaults.max_hold if max_hold is None else check_max_hold(max_hold),
                on_lost=defaults.on_lost if on_lost is None else check_on_lost(on_lost),
            )
        if timeout is UNSET:
            wait = self._config.timeout
        else:
            wait = check_timeout(timeout)
            if not blocking:
                check_wait(blocking, wait)
        return Checked(
            check_key(key),
            blocking,
            wait,
            self._config.ttl if ttl is None else check_lease(ttl),
            options,
        )

    def check_many(
        self, keys: Iterable[str], given: Mapping[str, Any]
    ) -> tuple[tuple[str, ...], Checked]:
        """A ``lock_many`` request: its keys in the order they are taken,
        and its options (checked first, as for one key)."""
        checked = self.check("-", given)
        return order_keys(keys), checked

    def check_key(self, key: object) -> str:
        """A key asked about (``is_locked``, ``owns``): normalised, or refused."""
        if self.closed:
            raise ManagerClosed("this LockManager is closed")
        return check_key(key)


def level2_loop(fair: object) -> Level2 | None:
    """The acquire loop of the row for a request: the fair queue's, or the
    exclusive lock's (None)."""
    if fair is False:
        return None
    if fair is not True:
        raise LockArgumentError(f"fair must be True or False, got {fair!r}")
    return queued_loop


def until_hook(until: object) -> DeferHook | None:
    """The deferred release an ``until=`` names (None: none)."""
    if until is None:
        return None
    from .sessions import session_hook  # SQLAlchemy's ORM, only for those who use it

    return session_hook(until)
