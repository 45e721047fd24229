"""The store's contract, and what its dialects share: the lock rows' values
(:class:`Grant`, :class:`Holder`, :class:`Lease`), waiting by backoff, and
:class:`Store`, one dialect's lock statements. Running a statement is
:mod:`dblock._store.executor`'s (a store is a :class:`~.executor.Driver`),
the admin side :mod:`dblock._store.admin`'s (a :class:`~.admin.TableAdmin`),
the orphaned rows :mod:`dblock._store.orphans`'.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, ClassVar, TypeVar, cast

from sqlalchemy import Table
from sqlalchemy.engine import Engine

from .._engine import Dialect, dialect_of
from ..config import Config
from ..errors import PoolerMismatch, PoolExhausted
from ..schema import TableNames, lock_table
from .admin import TableAdmin
from .executor import (
    IDLE_SECONDS,
    Executor,
    Interrupted,
    Params,
    Result,
    Statement,
    Steps,
    Unreachable,
    _mark_unsent,
    never_sent,
    not_writable,
    sqlstate,
    what_failed,
)
from .orphans import ORPHAN_ATTEMPTS, Orphans

# What the rest of the package imports from here, wherever it is defined
# (``_mark_unsent``: dblock._store.batch's).
__all__ = [
    "IDLE_SECONDS",
    "ORPHAN_ATTEMPTS",
    "RECHECKS_PER_SECOND",
    "Backoff",
    "ExclusiveSQL",
    "Executor",
    "Grant",
    "Holder",
    "Interrupted",
    "Lease",
    "Params",
    "PoolExhausted",
    "PoolerMismatch",
    "Result",
    "Statement",
    "Steps",
    "Store",
    "Unreachable",
    "Wait",
    "_mark_unsent",
    "never_sent",
    "not_writable",
    "recheck_every",
    "sqlstate",
    "what_failed",
]

log = logging.getLogger("dblock")

T = TypeVar("T")
K = TypeVar("K")  # the statements of one kind (Store.kind_sql)


@dataclasses.dataclass(slots=True)
class Grant:
    """We hold the row: its fencing number and lease (database time)."""

    fence: int
    expires_at: datetime
    # Seconds from the database's "now" to expires_at, measured by the same
    # statement, so the caller can turn it into a local deadline without
    # trusting the client clock.
    expires_in: float
    #: Which row of the key we hold (``''``: the head row; ``p3``: a semaphore permit).
    slot: str = ""
    #: Fences drawn after ``fence`` while the row was ours (a transfer asked
    #: for them), ascending: the next local hand-offs use them without SQL.
    reserve: tuple[int, ...] = ()
    #: When the statement that granted it was sent (time.monotonic()), if
    #: not when the caller asked: a grouped statement (dblock._store.batch)
    #: goes out after its requests queued, and the lease counts from then.
    sent_at: float | None = None


@dataclasses.dataclass(slots=True)
class Lease:
    """A renewed lease: its end (database time) and seconds from the database's now."""

    expires_at: datetime
    expires_in: float


@dataclasses.dataclass(slots=True)
class Holder:
    """Someone else holds the row (as far as the statement could see)."""

    owner: str | None
    token: str | None
    expires_in: float | None
    #: The kind of lock the key's head row is (``"exclusive"``, ``"rw"``, …),
    #: when the statement read it; another kind than requested means the key
    #: is used as another kind of lock (``KindMismatch``).
    kind: str | None = None


@dataclasses.dataclass(frozen=True)
class ExclusiveSQL:
    """The exclusive lock's acquire and release as a store sends them
    (:meth:`Store.exclusive_sql`, read by ``dblock._hooks`` for the
    benchmark), in the driver's paramstyle."""

    acquire: str
    release: str
    #: What the release takes beyond ``key`` and ``token``.
    release_params: dict[str, Any]
    #: The acquire answers with rows (else its row count says).
    returning: bool
    #: The release answers with rows to be fetched.
    release_returns: bool
    #: The acquire's rows name the holder, granted or not (else a row is a grant).
    names_holder: bool = False


# How long close() waits for statements given up on to end (Orphans.unsettled).
SETTLE_AT_CLOSE = 5.0

# Locks renewed per statement: well under every driver's parameter limit.
RENEW_CHUNK = 500


def _nothing() -> None:
    pass


class Wait:
    """How a level-1 winner waits between attempts on the database."""

    def prepare(self) -> None:
        """Called before every attempt, so a wake-up after it is not missed."""

    def sleep(self, limit: float) -> None:
        """Sleep until woken, or ``limit`` seconds at most."""
        raise NotImplementedError

    def close(self) -> None:
        pass


#: The most periodic re-checks a second the woken waiters of one process
#: send between them. A waiter woken by a release (NOTIFY, a named lock, a
#: datagram) still looks again every ``notify_recheck`` (2 s) in case a
#: wake-up was lost; with many keys awaited at once that insurance crowded
#: out the wake-ups it insures: 1,000 keys awaited on MariaDB sent 835
#: statements a second while waiting and a grant came 297 ms after its
#: release at p99, against 43 a second and 123 ms with the re-check at 10 s
#: (python -m benchmarks.wakeups). So the interval grows with the waiters:
#: 1,000 of them look again every 10 s, up to 200 every 2 s as before.
RECHECKS_PER_SECOND = 100.0


def recheck_every(every: float, waiting: int) -> float:
    """How long a woken waiter sleeps before it looks again unwoken, when
    ``waiting`` keys of its process are awaited (``every``: notify_recheck)."""
    return max(every, waiting / RECHECKS_PER_SECOND)


class Backoff(Wait):
    """Capped exponential backoff with jitter. The caller caps each sleep by
    the holder's remaining lease and its own deadline."""

    __slots__ = ("_cap", "_next")

    def __init__(self, initial: float, cap: float) -> None:
        self._next = initial
        self._cap = cap

    def step(self, limit: float) -> float:
        """How long the next sleep lasts (at most ``limit``)."""
        step = min(self._next, limit)
        self._next = min(self._next * 2, self._cap)
        if step <= 0:
            return 0.0
        # "Equal jitter": half the step is fixed so waiters keep making
        # progress, half is random so they do not retry in lockstep.
        return step / 2 + random.random() * step / 2

    def sleep(self, limit: float) -> None:
        step = self.step(limit)
        if step > 0:
            time.sleep(step)


class Store(TableAdmin):
    """One dialect's lock statements. Subclasses register with
    :func:`dblock._store.register` under the SQLAlchemy dialect name."""

    #: The dialect can hand a held row to a new token and fence in one statement.
    #: (Read at each release: a dialect may know it only once it met its server.)
    can_transfer: bool = False
    #: Its transfer can also draw fences for the hand-offs after it
    #: (``transfer_steps(extra=n)``), all under the row's lock.
    reserves_fences: bool = False
    #: The dialect can wake waiters when a key is released.
    can_notify: ClassVar[bool] = False

    def __init__(self, engine: Engine, *, config: Config, owns_engine: bool) -> None:
        self.config = config
        self.names = TableNames.of(config)
        self.table: Table = lock_table(self.names)
        self.engine = engine
        self.owns_engine = owns_engine
        self.executor = Executor(
            engine,
            owns_engine=owns_engine,
            table=self.names.table,
            is_missing_table=self.is_missing_table,
        )
        self.quoted = engine.dialect.identifier_preparer.quote
        #: What this store's database is and can do: from the dialect's name
        #: now, with the server's own facts once :meth:`server_steps` ran.
        self.dialect: Dialect = dialect_of(engine.dialect.name)
        #: Rows of acquisitions whose outcome we never learned (see
        #: dblock._store.orphans), deleted as soon as the database answers.
        self.orphans = Orphans(self)
        self._orphans_lock = self.orphans.lock  # (the tests' name for it)
        #: Wakes whoever deletes the orphans (the lock facade's renewal thread).
        self.wake_cleaner: Callable[[], None] = _nothing
        if self.alive_sql is not None:
            self.executor.on_interrupted = self.orphans.settle_later
        self._kind_sql: dict[Callable[[Any], Any], Any] = {}

    #: SQL finding the server's thread (or process) of a connection by its
    #: id, while it exists (see :meth:`Orphans.settle_later`); None: nothing to watch.
    alive_sql: ClassVar[str | None] = None

    @staticmethod
    def server_thread(dbapi_connection: Any) -> int:
        """The id :attr:`alive_sql` looks for, of a DBAPI connection."""
        raise NotImplementedError

    def kind_sql(self, make: Callable[[Store], K]) -> K:
        """The statements of one kind of lock (the fair queue, jobs, ...) in
        this store's dialect, built once per store by ``make``, which the
        kind's own module in this package offers (it picks the dialect's
        class with :meth:`Dialect.pick <dblock._engine.Dialect.pick>`):
        the one way a kind speaks a dialect."""
        found = self._kind_sql.get(make)
        if found is None:
            found = self._kind_sql[make] = make(self)
        return cast("K", found)

    def server_steps(self) -> Steps[Dialect]:
        """Read what only the server can say of the dialect (once: the
        dialect's store sets :attr:`dialect` the first time); nothing to
        read where the name says it all."""
        yield from ()  # nothing to send
        return self.dialect

    def known_dialect(self) -> Dialect:
        """:attr:`dialect`, the server's facts read first if need be (one
        blocking statement or three, once per store)."""
        if not self.dialect.known:
            self.drive(self.server_steps())
        return self.dialect

    # -- the contract ------------------------------------------------------

    # Each operation is written once, as :data:`Steps`; the methods without
    # ``_steps`` drive it here, on a blocking connection.

    def acquire_steps(self, key: str, token: str, owner: str, ttl: float) -> Steps[Grant | Holder]:
        """One attempt. :class:`Grant` if we hold the row now (new, taken over
        from an expired holder, or already ours with this token)."""
        raise NotImplementedError

    def release_steps(self, key: str, token: str) -> Steps[bool]:
        """Delete our row; False if it was not ours any more."""
        raise NotImplementedError

    def transfer_steps(
        self, key: str, token: str, new_token: str, owner: str, ttl: float, *, extra: int = 0
    ) -> Steps[Grant | None]:
        """Give our row to ``new_token`` with a new fence and lease; None if it
        was not ours any more. Only when :attr:`can_transfer`. With ``extra``
        (only when :attr:`reserves_fences`) the grant's ``reserve`` carries up
        to that many more fences, each greater than its ``fence`` and smaller
        than any fence drawn for this key after the row leaves us."""
        raise NotImplementedError

    def acquire_many_steps(
        self, requests: Sequence[tuple[str, str, str, float]]
    ) -> Steps[list[Grant | Holder]]:
        """Group commit (:mod:`dblock._store.batch`): one attempt for each
        ``(key, token, owner, ttl)`` of distinct keys, in one statement and
        one commit where the dialect allows, each answered as
        :meth:`acquire_steps` would answer it alone, in order. Dialects that
        cannot leave it out, and their requests go one by one."""
        raise NotImplementedError

    def release_many_steps(self, requests: Sequence[tuple[str, str]]) -> Steps[list[bool]]:
        """Group commit: :meth:`release_steps` for each ``(key, token)`` of
        distinct keys, answered in order."""
        raise NotImplementedError

    def exclusive_sql(self) -> ExclusiveSQL:
        """The exclusive lock's two statements as this store sends them (on
        the MySQL family, once the server said whether it has RETURNING)."""
        raise NotImplementedError

    def try_acquire(self, key: str, token: str, owner: str, ttl: float) -> Grant | Holder:
        return self.drive(self.acquire_steps(key, token, owner, ttl))

    def release(self, key: str, token: str) -> bool:
        return self.drive(self.release_steps(key, token))

    def transfer(
        self, key: str, token: str, new_token: str, owner: str, ttl: float, *, extra: int = 0
    ) -> Grant | None:
        return self.drive(self.transfer_steps(key, token, new_token, owner, ttl, extra=extra))

    def renew(self, locks: Sequence[tuple[str, str, float]]) -> dict[str, Lease]:
        """Extend each ``(key, token, ttl)`` whose row is still ours, in as few
        statements as the dialect allows; returns the new lease per token.
        A token missing from the result was not ours any more."""
        return self.drive(self.renew_steps(locks))

    def renew_steps(self, locks: Sequence[tuple[str, str, float]]) -> Steps[dict[str, Lease]]:
        """:meth:`renew`, written once for blocking and async connections."""
        leases: dict[str, Lease] = {}
        for start in range(0, len(locks), RENEW_CHUNK):
            leases.update((yield from self._renew_chunk(locks[start : start + RENEW_CHUNK])))
        return leases

    def _renew_chunk(self, locks: Sequence[tuple[str, str, float]]) -> Steps[dict[str, Lease]]:
        raise NotImplementedError

    def waiter(self, key: str, since: float, address: str | None = None) -> Wait:
        """How to wait for ``key`` after an attempt that started at ``since``
        (``time.monotonic()``) found it held; a fair-queue waiter is also
        woken by wake-ups sent to its ``address``."""
        return Backoff(self.config.poll_initial, self.config.poll_max)

    def hot(self, key: str, ends_run: bool = False) -> None:
        """``key`` is released while local threads wait for it (dblock.lock):
        other processes likely wait for it too. A store whose wake-ups cost a
        statement per held key (MySQL's named locks) keeps the key named for
        the next local grant, which follows at once, unless the release
        ``ends_run`` (gives way to other processes: they are woken)."""

    def others_wait(self, key: str) -> bool:
        """Whether waiters of other processes were seen waiting for ``key``
        lately. Asked by a store without hand-off (:attr:`can_transfer`
        false), whose threads end a long run of local grants only when
        somebody else waits; False where nobody can tell."""
        return False

    def others_wait_steps(self, key: str) -> Steps[bool] | None:
        """A statement asking whether a waiter of another process waits for
        ``key`` now, for a run's end that :meth:`others_wait` knows nothing
        of; None where nobody can tell."""
        return None

    def is_missing_table(self, exc: BaseException) -> bool:
        raise NotImplementedError

    def notify_key(self, key: str) -> str:
        """The key a release of ``key`` is announced under (see the semaphore's store)."""
        return key

    def close(self) -> None:
        # A statement given up on may still be running (see Orphans.unsettled):
        # its orphans are deleted once it ended, if that is soon.
        deadline = time.monotonic() + SETTLE_AT_CLOSE
        while self.orphans.running and time.monotonic() < deadline:
            time.sleep(0.01)
        self.clean_orphans()
        self.executor.close()
        if self.owns_engine:
            self.engine.dispose()

    def after_fork(self) -> None:
        """In a forked child: never reuse the parent's connections."""
        self.engine.dispose(close=False)
        self.executor.forget_idle()
        self.orphans.after_fork()
        self._orphans_lock = self.orphans.lock

    # -- orphans (see dblock._store.orphans) ---------------------------------

    def add_orphan(
        self,
        key: str,
        token: str,
        *,
        released: bool = False,
        unreachable: bool = False,
        settle: Callable[[], Steps[bool]] | None = None,
    ) -> None:
        """:meth:`Orphans.add`: delete the row of ``(key, token)`` once the
        database answers (``settle``: what to send instead)."""
        self.orphans.add(key, token, released=released, unreachable=unreachable, settle=settle)

    def is_orphan(self, key: str, token: str) -> bool:
        return self.orphans.is_orphan(key, token)

    @property
    def has_orphans(self) -> bool:
        return bool(self.orphans.queue)

    def clean_orphans(self) -> None:
        """:meth:`Orphans.clean`: delete them now, if the database answers."""
        self.orphans.clean()


def first(rows: Sequence[tuple[Any, ...]]) -> tuple[Any, ...] | None:
    return rows[0] if rows else None
