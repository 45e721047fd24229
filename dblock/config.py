"""The manager's configuration: one frozen, keyword-only object, checked once.

Every value is validated when the object is built, so a typo or a nonsense
lease fails at start-up with a message naming the option, not at the first lock.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, TypeVar

from .errors import LockArgumentError
from .keys import check_text

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from .telemetry import Telemetry

__all__ = [
    "MAX_SECONDS",
    "MIN_TTL",
    "UNSET",
    "Config",
    "Unset",
    "apply_options",
    "check_lease",
    "check_max_hold",
    "check_on_lost",
    "check_timeout",
    "check_ttl",
    "check_wait",
]


class Unset(enum.Enum):
    """Marks an option the caller did not give (``None`` means "no timeout")."""

    UNSET = enum.auto()

    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = Unset.UNSET


# Called with the :class:`~dblock.HeldLock` that was lost. Typed loosely here:
# the lock lives a floor above the configuration, which must not import it.
OnLost = Callable[[Any], object]
C = TypeVar("C", bound="DataclassInstance")

# Identifiers we splice into SQL must be plain names: they are quoted anyway,
# but a name that needs quoting is almost always a configuration mistake.
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,50}\Z")


#: The longest lease, wait or hold dblock accepts, in seconds: a year (366
#: days). Every database represents ``now() + a year`` (MariaDB's DATETIME
#: ends in 9999, SQLite's REAL seconds and Python's datetime too), so a bad
#: value fails here, the same way everywhere, instead of per database in SQL.
MAX_SECONDS = 366 * 86400.0


def check_ttl(value: object, name: str = "ttl") -> float:
    """A lease length in seconds: a number > 0 and at most :data:`MAX_SECONDS`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LockArgumentError(f"{name} must be a number of seconds, got {value!r}")
    ttl = float(value)
    if not math.isfinite(ttl) or ttl <= 0:
        raise LockArgumentError(f"{name} must be a finite number of seconds > 0, got {value!r}")
    if ttl > MAX_SECONDS:
        raise LockArgumentError(
            f"{name} must be at most {MAX_SECONDS:.0f} seconds (366 days), got {value!r}"
        )
    return ttl


#: The shortest lease dblock accepts, in seconds. A held lock is renewed once
#: a third of its lease has passed, and that renewal's round trip must end
#: within the two thirds left: one scheduling delay or one slow statement
#: (tens of milliseconds on a busy machine) must not cost the lock. A lease
#: shorter than a database round trip (``ttl=1e-9``) would be lost at once.
MIN_TTL = 0.1


def check_lease(value: object, name: str = "ttl") -> float:
    """A lease in seconds: a number from :data:`MIN_TTL` to :data:`MAX_SECONDS`."""
    ttl = check_ttl(value, name)
    if ttl < MIN_TTL:
        raise LockArgumentError(
            f"{name} must be at least {MIN_TTL:g} seconds (the shortest lease dblock "
            f"accepts: renewing it takes database round trips within the lease), got {value!r}"
        )
    return ttl


def check_timeout(value: object, name: str = "timeout") -> float | None:
    """A wait in seconds: None (wait forever) or a number >= 0 and at most
    :data:`MAX_SECONDS`."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LockArgumentError(f"{name} must be None or a number of seconds, got {value!r}")
    timeout = float(value)
    if math.isnan(timeout) or timeout < 0 or math.isinf(timeout):
        raise LockArgumentError(
            f"{name} must be None or a finite number of seconds >= 0, got {value!r}"
        )
    if timeout > MAX_SECONDS:
        raise LockArgumentError(
            f"{name} must be at most {MAX_SECONDS:.0f} seconds (366 days; None waits "
            f"until granted), got {value!r}"
        )
    return timeout


def check_max_hold(value: object, name: str = "max_hold") -> float | None:
    """The longest a lock may be held with renewal: None (no limit) or a
    number > 0 and at most :data:`MAX_SECONDS`."""
    return None if value is None else check_ttl(value, name)


def check_wait(blocking: object, timeout: float | None) -> None:
    """Refuse a fail-fast request given a timeout, as ``threading.Lock`` does.
    ``timeout`` is what the caller passed explicitly (``None`` if nothing): a
    manager's default timeout never counts."""
    if blocking is False and timeout is not None:
        raise LockArgumentError(
            f"timeout={timeout!r} cannot be given with blocking=False (a fail-fast "
            "request never waits); pass one or the other"
        )


def check_on_lost(value: object, name: str = "on_lost") -> OnLost | None:
    if value is not None and not callable(value):
        raise LockArgumentError(f"{name} must be a callable taking the lost lock, got {value!r}")
    return value


def _check_identifier(value: object, name: str) -> str:
    if not isinstance(value, str) or not _IDENTIFIER.match(value):
        raise LockArgumentError(
            f"{name} must be a plain SQL identifier (letters, digits, _; at most 51 "
            f"characters, not starting with a digit), got {value!r}"
        )
    return value


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """How a :class:`~dblock.LockManager` behaves. All times are seconds.

    table
        Name of the lock table. The sequence, index, trigger and migration
        version table are named after it unless given.
    index
        Name of the index on ``expires_at`` (default ``<table>_expires_at_idx``).
    ttl
        Default lease of a lock. A holder that dies blocks its key at most this long.
        At least :data:`MIN_TTL` (0.1 s), as every lease.
    timeout
        Default wait of a blocking request; ``None`` waits until granted.
    handoff_limit
        How many local grants in a row a key may have in one process while
        others wait (the row's own, then hand-offs straight to the next local
        waiter: one UPDATE, or none, instead of DELETE + INSERT) before the
        process releases the row and lets other processes take their turn.
        0 turns hand-off off (and 1 leaves it nothing to do).
    poll_initial, poll_max
        Capped exponential backoff (with jitter) between attempts when
        waiters are not woken (``notify=False``, the other kinds of lock on
        MySQL/MariaDB and SQLite, Galera, an in-memory SQLite database).
    notify
        Wake waiters of other processes when the key is released instead of
        polling: LISTEN/NOTIFY on PostgreSQL, named locks (``GET_LOCK``) on
        MySQL/MariaDB (not on Galera, nor with ``pooler``), a byte lock and
        a datagram socket beside the database file on SQLite (Linux).
    notify_recheck
        A waiter re-checks at least this often even without a wake-up: a
        safety net for a listener connection that died silently.
    local_filter
        Level 1. Turning it off sends every request to the database and drops
        re-entrancy; it exists to measure what level 1 buys.
    batch
        Group commit: statements of this process's threads that meet at the
        same moment (acquires of different keys; releases) go to the database
        as one statement and one commit (PostgreSQL, MariaDB, SQLite). A lone request is still
        sent at once, alone. Off: one statement per request.
    client_id
        How this process names itself in the ``owner`` column (default ``host:pid``).
    renew
        Extend held locks automatically (one renewal thread per manager renews
        every held lock when a third of its lease has passed). Off: a lock is
        lost when its lease runs out.
    max_hold
        Renewal never extends a lock past this many seconds after it was
        acquired (``None``: no limit). The sweeper uses the same safety net.
    on_lost
        Called (from the renewal thread) with the :class:`~dblock.HeldLock` when a
        held lock is found lost, unless the lock has a callback of its own.
    pooler
        The URL reaches PostgreSQL through a transaction-mode connection pooler
        (pgbouncer, ...): dblock prepares no statements on the server, and its
        waiters never LISTEN through the pooler (they use ``listen_url``, else poll).
    listen_url
        PostgreSQL: a URL straight to the server (bypassing the pooler) for the
        one LISTEN connection per process that wakes waiters.
    telemetry
        Metrics and traces through OpenTelemetry's API (see :mod:`dblock.telemetry`):
        ``None`` (default) reports when ``opentelemetry-api`` is installed,
        ``False`` never, ``True`` always (an error without the API), or a
        :class:`~dblock.telemetry.Telemetry` naming providers and how keys appear.
    """

    table: str = "dblock_locks"
    index: str | None = None
    ttl: float = 30.0
    timeout: float | None = None
    handoff_limit: int = 8
    poll_initial: float = 0.005
    poll_max: float = 0.5
    notify: bool = True
    notify_recheck: float = 2.0
    local_filter: bool = True
    batch: bool = True
    client_id: str | None = None
    renew: bool = True
    max_hold: float | None = None
    on_lost: OnLost | None = None
    pooler: bool = False
    listen_url: str | None = None
    telemetry: bool | Telemetry | None = None

    def __post_init__(self) -> None:
        _check_identifier(self.table, "table")
        if self.index is not None:
            _check_identifier(self.index, "index")
        object.__setattr__(self, "ttl", check_lease(self.ttl))
        object.__setattr__(self, "timeout", check_timeout(self.timeout))
        for name in ("poll_initial", "poll_max", "notify_recheck"):
            object.__setattr__(self, name, check_ttl(getattr(self, name), name))
        if self.poll_initial > self.poll_max:
            raise LockArgumentError(
                f"poll_initial ({self.poll_initial:g}) must not exceed poll_max ({self.poll_max:g})"
            )
        if (
            isinstance(self.handoff_limit, bool)
            or not isinstance(self.handoff_limit, int)
            or self.handoff_limit < 0
        ):
            raise LockArgumentError(
                f"handoff_limit must be an integer >= 0, got {self.handoff_limit!r}"
            )
        object.__setattr__(self, "max_hold", check_max_hold(self.max_hold))
        check_on_lost(self.on_lost)
        if self.listen_url is not None and (
            not isinstance(self.listen_url, str) or not self.listen_url
        ):
            raise LockArgumentError(
                f"listen_url must be a PostgreSQL URL string, got {type(self.listen_url).__name__}"
            )
        if self.telemetry is not None and not isinstance(self.telemetry, bool):
            from .telemetry import Telemetry

            if not isinstance(self.telemetry, Telemetry):
                raise LockArgumentError(
                    f"telemetry must be True, False, None or a dblock.telemetry.Telemetry, "
                    f"got {self.telemetry!r}"
                )
        for name in ("notify", "local_filter", "batch", "renew", "pooler"):
            if not isinstance(getattr(self, name), bool):
                value = getattr(self, name)
                raise LockArgumentError(f"{name} must be True or False, got {value!r}")
        if self.client_id is not None and (
            not isinstance(self.client_id, str) or not self.client_id or len(self.client_id) > 200
        ):
            raise LockArgumentError(
                f"client_id must be a non-empty string of at most 200 characters, "
                f"got {self.client_id!r}"
            )
        if self.client_id is not None:
            check_text(self.client_id, "client_id")

    @classmethod
    def from_options(cls, base: Config | None, options: Mapping[str, Any]) -> Config:
        """``base`` with ``options`` applied; unknown option names are refused."""
        return apply_options(cls, base, options)


def did_you_mean(unknown: Iterable[str], known: Iterable[str]) -> str:
    """`` (did you mean 'ttl'?)`` for a misspelt option name (`` (did you
    mean 'ttl' for 'tll', ...?)`` for several), or ``""``."""
    import difflib

    unknown, names = list(unknown), sorted(known)
    close = {
        name: found[0]
        for name in unknown
        if (found := difflib.get_close_matches(name, names, n=1, cutoff=0.6))
    }
    if not close:
        return ""
    if len(unknown) == 1:
        return f" (did you mean {next(iter(close.values()))!r}?)"
    return " (did you mean " + ", ".join(f"{v!r} for {k!r}" for k, v in close.items()) + "?)"


def apply_options(cls: type[C], base: C | None, options: Mapping[str, Any], what: str = "") -> C:
    """The frozen dataclass ``cls``: ``base`` with ``options`` applied, or
    built from them; names that are not fields of ``cls`` are refused."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise LockArgumentError(
            f"unknown {what}option{'s' if len(unknown) > 1 else ''} "
            f"{', '.join(map(repr, unknown))}{did_you_mean(unknown, known)}; "
            f"known options: {', '.join(sorted(known))}"
        )
    if base is None:
        return cls(**options)
    return dataclasses.replace(base, **options)
