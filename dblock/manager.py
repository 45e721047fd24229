"""``LockManager``: the one object an application keeps.

It owns the engine (or borrows yours), the level-1 registry of this process
and the store, and hands out locks::

    locks = LockManager("postgresql+psycopg://app@db/app")
    with locks.lock("user:42", timeout=2.0) as held:
        ...

    @locks.locked("user:{user_id}")
    def transfer(user_id: int, amount: int) -> None: ...
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from functools import partial, wraps
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, ParamSpec, Protocol, TypeVar

from sqlalchemy import URL
from sqlalchemy.engine import Engine

from . import decorators, migrations
from ._engine import SUPPORTED, dialect_of, is_async_engine, make_engine, mask, resolve_url
from ._faces import Requests, level2_loop, until_hook
from ._lockers import KindLockers
from ._store import Store, open_store
from .config import Config, check_timeout
from .decorators import KeySpec, OnBusy
from .deferral import DeferHook, exit_deferring
from .errors import DBLockError, LockArgumentError
from .leader import Leader, LeaderArgs
from .lock import HeldLock, Locker, live_lockers
from .multi import HeldLocks, acquire_many
from .options import LockArgs
from .schema import TableNames

if TYPE_CHECKING:
    from typing_extensions import Self, Unpack

    from .jobs import JobArgs, Skipped
    from .kinds.rw import RwHeld, RwLocker
    from .kinds.semaphore import HeldPermit, Semaphores  # noqa: F401 - HeldPermit: a string below
    from .sweeper import Sweeper
    from .telemetry import Recorder

__all__ = ["LockManager", "LockRequest", "SemaphoreRequest", "level2_loop", "until_hook"]

P = ParamSpec("P")
R = TypeVar("R")

log = logging.getLogger("dblock")

# The managers of this process not closed yet, held weakly: the fork and
# exit hooks below must not keep a manager alive.
_managers: weakref.WeakSet[LockManager] = weakref.WeakSet()


class _Exits(Protocol):
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None: ...


H = TypeVar("H", bound=_Exits)


class LockRequest(Generic[H]):
    """What ``LockManager.lock()`` and ``lock_many()`` return: checked before
    any SQL, acquired on ``with`` entry, released on exit (or, with a
    ``defer`` hook, when the ends it names are reached: see
    :mod:`dblock.deferral`). It yields a :class:`~dblock.HeldLock` (``lock``)
    or :class:`~dblock.HeldLocks` (``lock_many``).

    One request may be entered again inside its own ``with`` (like an RLock):
    each exit releases what the matching entry acquired, innermost first."""

    __slots__ = ("_acquire", "_defer", "_held", "_outer")

    def __init__(self, acquire: Callable[[], H], defer: DeferHook | None = None) -> None:
        self._acquire = acquire
        self._defer = defer
        self._held: H | None = None
        # Entries still open around the innermost one (nested use only).
        self._outer: list[H] | None = None

    def deferred_by(self, defer: DeferHook) -> LockRequest[H]:
        """The same request, its release waiting for what ``defer`` installs
        (for integrations; see :mod:`dblock.deferral`)."""
        return LockRequest(self._acquire, defer)

    def __enter__(self) -> H:
        held = self._acquire()
        if self._held is not None:
            if self._outer is None:
                self._outer = []
            self._outer.append(self._held)
        self._held = held
        return held

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        held = self._held
        self._held = self._outer.pop() if self._outer else None
        if held is None:
            return
        if self._defer is None:
            held.__exit__(exc_type, exc, tb)
        else:
            exit_deferring(held, self._defer, None, exc_type)  # type: ignore[arg-type]


class SemaphoreRequest(LockRequest["HeldPermit"]):
    """What ``LockManager.semaphore()`` returns: a context manager yielding a
    :class:`~dblock.kinds.semaphore.HeldPermit`, and a decorator holding a
    permit for each call of the function."""

    __slots__ = ()

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        acquire = self._acquire

        @wraps(func)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with LockRequest(acquire):
                return func(*args, **kwargs)

        return wrapper


class DecoratingRequest(LockRequest[H]):
    """A :class:`LockRequest` that also decorates a function: each call of the
    decorated function holds a fresh request's lock (``@locks.read_lock("cfg")``)."""

    __slots__ = ()

    def __call__(self, func: Callable[P, R]) -> Callable[P, R]:
        acquire, defer = self._acquire, self._defer

        @wraps(func)
        def locked_call(*args: P.args, **kwargs: P.kwargs) -> R:
            with LockRequest(acquire, defer):
                return func(*args, **kwargs)

        return locked_call


class LockManager:
    """Distributed locks on a relational database, filtered per process.

    ``url`` is a SQLAlchemy URL (``postgresql+psycopg://…``,
    ``mysql+pymysql://…``, ``sqlite:///path``) or an existing
    :class:`~sqlalchemy.engine.Engine` to borrow; by default ``$DBLOCK_URL``,
    else the SQLite file ``./dblock.sqlite3``. Options are the fields of
    :class:`~dblock.config.Config` (``ttl``, ``timeout``, ``table``, …), given
    as keywords or as ``config=``. ``engine_options`` go to ``create_engine``
    when dblock makes the engine.
    """

    def __init__(
        self,
        url: str | URL | Engine | None = None,
        *,
        config: Config | None = None,
        engine_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        self.config = Config.from_options(config, options)
        if is_async_engine(url):
            raise LockArgumentError(
                "an AsyncEngine is for AsyncLockManager(engine); LockManager takes a URL or a "
                "blocking Engine"
            )
        if isinstance(url, Engine):
            if engine_options:
                raise LockArgumentError(
                    "engine_options apply only when dblock makes the engine from a URL"
                )
            engine, owns = url, False
        else:
            engine = make_engine(resolve_url(url), engine_options, pooler=self.config.pooler)
            owns = True
        if self.config.listen_url is not None and not _notifies(engine):
            if owns:
                engine.dispose()
            raise LockArgumentError(
                f"listen_url is for PostgreSQL; this manager's database is {engine.dialect.name}"
            )
        try:
            self._store: Store = open_store(engine, config=self.config, owns_engine=owns)
        except BaseException:
            if owns:
                engine.dispose()
            raise
        #: The exclusive lock's locker (for the asyncio face and the kinds).
        self.locker = self._locker = Locker(self._store, self.config)
        #: Requests checked before any SQL, for both faces (and closed or not).
        self.checks = Requests(self.config, self._locker)
        #: The read-write and semaphore lockers, made on first use.
        self.kinds = KindLockers(self._store, self.config, self._locker)
        # The former names of what moved to those two (kept for callers in
        # the package and the tests).
        self._check = self.checks.check
        self._check_key = self.checks.check_key
        self._rw_locker = self.kinds.open_rw
        self._semaphores_ = self.kinds.open_semaphores
        self._sweeper: Sweeper | None = None
        self._leaders: weakref.WeakSet[Leader] = weakref.WeakSet()  # stopped by close()
        _managers.add(self)

    # -- what it is --------------------------------------------------------

    @property
    def engine(self) -> Engine:
        return self._store.engine

    @property
    def url(self) -> str:
        """The database URL with the password masked."""
        return mask(self._store.engine.url)

    @property
    def dialect(self) -> str:
        return self._store.engine.dialect.name

    @property
    def names(self) -> TableNames:
        return self._store.names

    @property
    def telemetry(self) -> Recorder | None:
        """What this manager reports through (OpenTelemetry; ``None``: nothing)."""
        return self._locker.telemetry

    @property
    def store(self) -> Store:
        return self._store

    @property
    def _closed(self) -> bool:  # (the former attribute: see checks.closed)
        return self.checks.closed

    @property
    def _rw(self) -> RwLocker | None:  # (the former attribute: see kinds.rw)
        return self.kinds.rw

    @property
    def _semaphores(self) -> Semaphores | None:  # (the former attribute: see kinds.semaphores)
        return self.kinds.semaphores

    def __repr__(self) -> str:
        return f"<LockManager {self.url} table={self.config.table!r}>"

    # -- locks -------------------------------------------------------------

    def lock(
        self,
        key: str,
        *,
        until: object = None,
        fair: bool = False,
        **options: Unpack[LockArgs],
    ) -> LockRequest[HeldLock]:
        """A context manager holding ``key`` for the ``with`` block.

        ``blocking=False`` fails fast with :class:`~dblock.LockBusy`; a blocking
        request waits up to ``timeout`` seconds (default: the manager's
        ``timeout``; ``None`` waits until granted) then raises
        :class:`~dblock.LockTimeout`. ``ttl`` is the lease in seconds, renewed
        while held unless ``renew=False``, never past ``max_hold`` seconds;
        ``on_lost(held)`` is called if the lock is lost while held.
        Re-entrant per thread: an inner ``lock()`` of a held key costs no SQL.
        ``until=session`` (a SQLAlchemy ``Session`` or ``scoped_session``)
        holds the lock past the block until that session's open transaction
        ends, so the lock covers the commit (see :mod:`dblock.sessions`).
        ``fair=True`` queues the request in the key's fair queue: waiters
        across processes are granted in the order they arrived (see
        :mod:`dblock.kinds.fair`).
        """
        defer = None if until is None else until_hook(until)
        key, blocking, wait, lease, opts = self.checks.check(key, options)
        # Positional: a partial with keywords copies them into a dict per call.
        return LockRequest(
            partial(
                self._locker.acquire,
                key,
                blocking,
                wait,
                lease,
                opts,
                None if fair is False else level2_loop(fair),
            ),
            defer,
        )

    def acquire(
        self,
        key: str,
        *,
        fair: bool = False,
        **options: Unpack[LockArgs],
    ) -> HeldLock:
        """Like :meth:`lock` without ``with``: returns the held lock; call its
        ``release()`` (or use it as a context manager) when done."""
        key, blocking, wait, lease, opts = self.checks.check(key, options)
        return self._locker.acquire(
            key, blocking=blocking, timeout=wait, ttl=lease, options=opts, level2=level2_loop(fair)
        )

    def semaphore(
        self,
        key: str,
        *,
        permits: int,
        **options: Unpack[LockArgs],
    ) -> SemaphoreRequest:
        """A permit of the semaphore ``key``: at most ``permits`` holders at
        once across every process. Each permit is its own row with its own
        lease, token and fence (strictly growing per key); N is fixed per key
        (a request with another N while the key is in use raises
        :class:`~dblock.KindMismatch`, as does a key used as an exclusive
        lock). The options are those of :meth:`lock`; use it in ``with``
        (yielding a :class:`~dblock.kinds.semaphore.HeldPermit`) or as a
        decorator. Not re-entrant: each request takes another permit."""
        from .kinds.semaphore import check_permits

        check_permits(permits)
        key, blocking, wait, lease, opts = self.checks.check(key, options)
        return SemaphoreRequest(
            partial(
                self.kinds.open_semaphores().acquire,
                key,
                permits,
                blocking=blocking,
                timeout=wait,
                ttl=lease,
                options=opts,
            )
        )

    def read_lock(
        self,
        key: str,
        *,
        until: object = None,
        **options: Unpack[LockArgs],
    ) -> DecoratingRequest[RwHeld]:
        """The shared side of ``key``'s read-write lock, for a ``with`` block
        (or as a decorator): any number of readers in any processes at once,
        never together with a writer; a waiting writer holds new readers back.
        Re-entrant per thread (or task). Options as for :meth:`lock`; the
        :class:`~dblock.kinds.rw.RwHeld` it yields is a :class:`~dblock.HeldLock`.
        See docs/kinds/read-write.md."""
        return _rw_request(self, "read", key, until, options)

    def write_lock(
        self,
        key: str,
        *,
        until: object = None,
        **options: Unpack[LockArgs],
    ) -> DecoratingRequest[RwHeld]:
        """The exclusive side of ``key``'s read-write lock: one writer, no
        readers. The writer may take the read lock of its key too (and keeps
        it after releasing the write lock: a downgrade); a reader asking for
        the write lock gets :class:`~dblock.UpgradeRefused`. Options as for
        :meth:`lock`."""
        return _rw_request(self, "write", key, until, options)

    def locked(
        self,
        template: KeySpec,
        *,
        on_busy: OnBusy = "raise",
        until: object = None,
        fair: bool = False,
        **options: Unpack[LockArgs],
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """Decorate a function (or method) so each call holds the lock named by
        ``template``: a format string over the call's arguments
        (``"user:{user_id}"``, ``"order:{order.id}"``, ``"{self.id}"``), a list
        of them (all taken at once, as by :meth:`lock_many`), or a callable
        taking the function's arguments and returning a key or keys. Names are
        checked against the signature now. When the lock is not granted,
        ``on_busy`` decides: ``"raise"`` (default), or a handler called as
        ``handler(error, *args, **kwargs)`` whose result is returned
        (``dblock.returns(value)`` returns a fixed value). The other options
        are those of :meth:`lock` (``until=session`` and ``fair`` included)."""
        return decorators.locked(
            lambda: self,
            template,
            on_busy=on_busy,
            defer=until_hook(until),
            fair=fair,
            **options,
        )

    # -- jobs ----------------------------------------------------------------

    def leader(self, role: str, **options: Unpack[LeaderArgs]) -> Leader:
        """This process's candidacy for ``role``: one leader per role across
        every process using the lock table (see :mod:`dblock.leader`).
        ``with manager.leader("outbox-relay") as term:`` waits until elected
        and leads for the block; ``.campaign()`` stands in a thread of its
        own, calling ``on_elected(term)`` and ``on_revoked(term)``, until
        ``.stop()`` or this manager's ``close()``. ``ttl``: the term's lease
        (default: the manager's), renewed while this process lives."""
        self.checks.open()
        made = Leader(self, role, options, self.locker.telemetry)
        self._leaders.add(made)
        return made

    def once(
        self,
        name: str,
        *,
        per: str | None = None,
        **options: Unpack[JobArgs],
    ) -> Callable[[Callable[P, R]], Callable[..., R | Skipped]]:
        """Decorate a job so each call runs it only if no other process runs
        it now (else it is skipped: :data:`~dblock.SKIPPED`, or
        :class:`~dblock.JobSkipped` with ``on_skip="raise"``). ``at_most`` is
        the job lock's lease (renewed while the run lives; default: the
        manager's ``ttl``), ``at_least`` how long after its start the key
        stays taken however soon the run ends, both on the database's clock.
        ``per="fire_time"``: one run per scheduled fire time, given as the
        call's keyword ``fire_time=`` (passed on to the function if it takes
        it); a fire time whose run failed or died runs again only with
        ``retry_failed=True``. ``wait`` seconds to wait for the key before
        skipping. See :mod:`dblock.jobs` and docs/jobs.md."""
        from . import jobs

        once = jobs.Once(self, name, per, options)

        def decorate(func: Callable[P, R]) -> Callable[..., R | Skipped]:
            passes_fire = once.passes_fire(func, coroutine=False)

            @wraps(func)
            def run_once(*args: Any, **kwargs: Any) -> R | Skipped:
                fire_time, next_fire = once.fire_times(passes_fire, kwargs)
                locker = self.checks.open()
                return jobs.run_job(locker, once.job, func, args, kwargs, fire_time, next_fire)

            return run_once

        return decorate

    def run_job(
        self,
        name: str,
        func: Callable[..., R],
        /,
        *args: Any,
        fire_time: datetime | None = None,
        at_most: float | timedelta | None = None,
        at_least: float | timedelta = 0,
        retry_failed: bool = False,
        on_skip: str = "return",
        wait: float | timedelta | None = None,
        record: bool = True,
        next_fire_time: datetime | None = None,
        **kwargs: Any,
    ) -> R | Skipped:
        """Run ``func(*args, **kwargs)`` as one run of the job ``name``
        unless another process runs it (the entry point of the scheduler
        integrations; :meth:`once` is built on it). With ``fire_time`` (an
        aware datetime) the run is once per that fire time. ``next_fire_time``
        is recorded for ``dblock jobs`` to show. Options as for :meth:`once`."""
        from . import jobs

        # The keywords above reach the shared check by name (JobArgs lists them).
        job, fire, nxt = jobs.prepare_run(self, name, func, locals())
        return jobs.run_job(self.checks.open(), job, func, args, kwargs, fire, nxt)

    # -- introspection -----------------------------------------------------

    def is_locked(self, key: str) -> bool:
        """Whether anyone (this process or another) holds ``key`` now, without
        taking it: one statement; a lease that has run out counts as free.
        The answer may be stale the moment it arrives: to act on a free key,
        acquire it (``blocking=False``) instead."""
        key = self.checks.check_key(key)
        return self._store.drive(self._store.is_locked_steps(key))

    def owns(self, key: str) -> bool:
        """Whether the calling thread (or asyncio task) holds the exclusive
        lock of ``key`` now. No SQL: from this process's registry (for a
        read-write lock or a permit, ask its handle: ``held.owned()``)."""
        return self._locker.owns(self.checks.check_key(key))

    # -- schema --------------------------------------------------------------

    def create_schema(self) -> None:
        """Create the lock table if it is not there (runs the shipped alembic
        migrations to head, exactly as ``dblock migrate`` does)."""
        migrations.upgrade(self.engine, self.names)

    def drop_schema(self) -> None:
        """Remove the lock table and everything dblock created with it."""
        migrations.downgrade(self.engine, self.names)

    # -- life cycle ----------------------------------------------------------

    def close(self, timeout: float = 0.0) -> None:
        """Stop background work and release the engine if dblock made it.

        From the moment it starts, new requests and every thread still
        waiting for a lock of this manager get :class:`~dblock.ManagerClosed`.
        Locks still held are renewed for up to ``timeout`` seconds while their
        holders finish; then they are released and marked lost (their
        ``on_lost`` is called, ``check()`` and ``release()`` raise
        :class:`~dblock.LockLost`): no lock is ever left held without renewal.
        ``timeout=None`` waits for every holder."""
        wait = check_timeout(timeout)
        if self.checks.closed:
            return
        self.checks.closed = True
        _managers.discard(self)
        limit = float("inf") if wait is None else wait
        # Each part is closed whatever the others raised (each reports its
        # own failures); the first error, if any, is raised at the end.
        parts: list[Callable[[], object]] = [leader.stop for leader in list(self._leaders)]
        if self._sweeper is not None:
            parts.append(self._sweeper.stop)  # first: its last run may still take its own lock
        parts += self.kinds.closers(limit)
        parts += [partial(self._locker.close, limit), self._store.close]
        first: BaseException | None = None
        for close in parts:
            try:
                close()
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start_sweeper(self, *, interval: float = 10.0, **options: Any) -> Sweeper:
        """Delete expired rows of this manager's table every ``interval`` seconds
        on a background thread (APScheduler), until :meth:`close` or interpreter
        exit. Options: the fields of :class:`~dblock.sweeper.SweeperConfig`
        (``grace``, ``max_hold``, ``batch_size``, ``lock_ttl``). Several
        processes may each start one: they take turns through a lock."""
        from .sweeper import Sweeper

        self.checks.open()
        if self._sweeper is not None and self._sweeper.running:
            raise DBLockError(f"{self._sweeper!r} already runs for this manager")
        sweeper = Sweeper(self, interval=interval, **options)
        sweeper.start()
        self._sweeper = sweeper
        return sweeper

    # -- several keys at once ----------------------------------------------

    def lock_many(
        self,
        keys: Iterable[str],
        *,
        until: object = None,
        **options: Unpack[LockArgs],
    ) -> LockRequest[HeldLocks]:
        """A context manager holding every key in ``keys`` for the ``with``
        block, yielding :class:`~dblock.HeldLocks`. The keys are taken in one
        deterministic order (sorted, duplicates removed) so two callers asking
        for (A, B) and (B, A) cannot deadlock; ``timeout`` bounds the whole
        acquisition, and if one key cannot be had the others are released.
        The other options are those of :meth:`lock`, for every key."""
        defer = until_hook(until)
        ordered, (_, blocking, wait, lease, opts) = self.checks.check_many(keys, options)
        return LockRequest(
            partial(
                acquire_many,
                self._locker,
                ordered,
                blocking=blocking,
                timeout=wait,
                ttl=lease,
                options=opts,
            ),
            defer,
        )

    def acquire_many(
        self,
        keys: Iterable[str],
        **options: Unpack[LockArgs],
    ) -> HeldLocks:
        """Like :meth:`lock_many` without ``with``: call ``release()`` on the result."""
        ordered, (_, blocking, wait, lease, opts) = self.checks.check_many(keys, options)
        return acquire_many(
            self._locker, ordered, blocking=blocking, timeout=wait, ttl=lease, options=opts
        )


def _notifies(engine: Engine) -> bool:
    """Whether ``engine``'s database has LISTEN/NOTIFY, for which ``listen_url``
    is (a database dblock does not speak is refused by ``open_store``)."""
    name = engine.dialect.name
    return name in SUPPORTED and dialect_of(name).notifies


def _rw_request(
    manager: LockManager, mode: str, key: str, until: object, options: Mapping[str, Any]
) -> DecoratingRequest[RwHeld]:
    """``read_lock`` and ``write_lock``: checked now, the locker made on first use."""
    defer = until_hook(until)
    key, blocking, wait, lease, opts = manager.checks.check(key, options)
    rw = manager.kinds.open_rw()
    acquire = partial(
        rw.acquire, key, mode, blocking=blocking, timeout=wait, ttl=lease, options=opts
    )
    return DecoratingRequest(acquire, defer)


def _after_fork_in_child() -> None:
    # Each manager's parts forget the parent's threads, holders and connections.
    for manager in list(_managers):
        manager.kinds.after_fork()
        manager.locker.after_fork()
        manager.store.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _release_at_exit() -> None:
    """Interpreter exit: release the rows of the locks nobody can release
    any more (the main thread's, those of threads and tasks that ended, those
    collected unreleased whose release the renewal thread had not sent yet),
    as a collected handle's are, instead of keeping their keys from every
    other process for the rest of their leases. An ``atexit`` handler: it
    runs after the non-daemon threads were joined (their locks are theirs to
    release until then) and while the renewal threads (daemons) still run,
    which send the DELETEs. Bounded: a database that does not answer within
    ``Locker.EXIT_RELEASES`` seconds leaves the rows to their leases, and
    says so. (``kill -9`` runs nothing: the lease ends those.)"""
    pending = []
    # A signal handler's exception (a second Ctrl-C, SIGTERM's SystemExit)
    # cutting a manager's claims short: the locks claimed so far are still
    # released, the other managers' too, and it is raised at the end.
    cut: list[BaseException] = []
    try:
        for locker in live_lockers():
            try:
                done = locker.release_at_exit(locker.EXIT_RELEASES, cut)
            except Exception:  # never let one manager keep the others' rows
                log.exception("dblock: releasing locks at interpreter exit failed")
                continue
            except BaseException as exc:  # (a signal handler's: as above)
                cut.append(exc)
                continue
            if done is not None:
                pending.append((locker, done))
        _wait_at_exit(pending)
    finally:
        if cut:
            raise cut[0]


def _wait_at_exit(pending: list[tuple[Locker, threading.Event]]) -> None:
    if not pending:
        return
    deadline = time.monotonic() + max(locker.EXIT_RELEASES for locker, _ in pending)
    for locker, done in pending:
        if not done.wait(max(deadline - time.monotonic(), 0.0)):
            log.warning(
                "dblock: the database (%s) did not answer within %g s at interpreter exit; "
                "the locks it was releasing are left to their leases or the sweeper",
                mask(locker.store.engine.url),
                locker.EXIT_RELEASES,
            )


atexit.register(_release_at_exit)
# Once more, after the first (atexit runs its hooks last registered first):
# a signal handler's exception landing as the first started (a frame's first
# instruction, before any ``try`` of ours) would leave every row to its
# lease. The second finds nothing to do when the first did its work.
atexit.register(_release_at_exit)
