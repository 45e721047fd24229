"""The asyncio face: :class:`AsyncLockManager`.

One registry per process serves threads and tasks: an ``AsyncLockManager``
wraps a :class:`~dblock.LockManager` (made from a URL, or one you already
have) and shares its registry, its renewal thread and its store. A task is
an owner as a thread is, so a second task (or thread) of this process asking
for a held key is refused or queued locally, without SQL, and a task
re-enters its own key for free.

Nothing here decides anything: the acquire and release logic is the
blocking manager's own (:meth:`dblock.lock.Locker.acquire_steps` and
``release_steps``, generators that yield what to wait for and which
statement to send). :func:`_drive` carries those out with asyncio: the
statements on an async engine (:class:`~dblock._store.aio.AsyncStore`),
waiting in the local queue on a future woken thread-safely, waiting for the
holder with ``asyncio.sleep`` backoff capped at its expiry. Nothing blocks
the loop.

Cancellation (``task.cancel()``, ``asyncio.timeout``) is an interruption like
any other: thrown into the generator, whose one ``except`` gives back what
the request held; an INSERT cut off in flight is settled by its token on the
renewal thread, as on the blocking side.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from datetime import datetime, timedelta
from types import CodeType, TracebackType
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast

from sqlalchemy import URL
from sqlalchemy.engine import Engine

from . import decorators, jobs
from ._driver import drive
from ._engine import async_driver, blocking_url, is_async_engine, resolve_url
from ._faces import Checked, level2_loop, until_hook
from ._store import Store
from ._store.aio import AsyncStore
from ._store.base import Backoff
from ._store.batch import AsyncBatcher
from .adeferral import aexit_deferring, release_on_exit
from .aleader import AsyncLeader
from .config import Config, check_lease
from .decorators import KeySpec, OnBusy
from .deferral import DeferHook
from .errors import (
    KindMismatch,
    LockArgumentError,
    LockBusy,
    LockLost,
    LockNotAcquired,
    LockTimeout,
    ManagerClosed,
)
from .leader import LeaderArgs
from .lock import HeldLock, Level2, Locker
from .manager import LockManager
from .multi import ManySteps, acquire_many_steps, release_later
from .options import LockArgs
from .registry import Waiter, current_owner
from .steps import Call, Clean, Op, Release, Run, Settle, Sleep, Transfer, Try, Turn, Wait, noop

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine
    from typing_extensions import Self, Unpack

    from ._store.postgresql import Listener
    from .jobs import JobArgs, Skipped

__all__ = ["AsyncHeldLock", "AsyncHeldLocks", "AsyncLockManager", "AsyncLockRequest"]

log = logging.getLogger("dblock")
# asyncio's own None-or-loop look-up (what get_running_loop() wraps): a hand-off
# from a thread without a loop asks it on every wake-up, where get_running_loop()
# would raise and catch a RuntimeError each time. Read here only.
_running_loop = asyncio._get_running_loop

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class AsyncWaiter(Waiter):
    """A task queued for a key: woken through its event loop, from whichever
    thread (or task) hands the key over."""

    __slots__ = ("_future", "_loop")

    def arm(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._future: asyncio.Future[None] = self._loop.create_future()

    def alive(self) -> bool:
        return not self._loop.is_closed()

    def wake(self, grant: Any) -> None:
        self.grant = grant
        self.ready = True
        if self.entry.heir is self:
            self.entry.heir = None
        if _running_loop() is self._loop:
            # Handed over by a task of the same loop (the usual case): no
            # self-pipe write and extra turn of the loop per hand-off.
            self._resolve()
            return
        # RuntimeError: the loop is closed, nobody waits any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._resolve)

    def _resolve(self) -> None:
        if not self._future.done():
            self._future.set_result(None)

    async def turn(self, locker: Locker, timeout: float | None) -> object:
        """Wait until the key is handed to us (see ``BlockingDriver.wait_turn``)."""
        if not self.ready:
            await asyncio.wait((self._future,), timeout=timeout)
        if not self.ready:
            if locker.registry.abandon(self.entry.key, self):
                raise LockTimeout(self.entry.key, timeout=timeout or 0.0, level=1)
            pending = await self.settle_async()
            if pending is not None:
                raise pending
        return self.grant

    async def settle_async(self) -> BaseException | None:
        """Wait until ``grant`` is filled in, whatever interrupts us."""
        pending: BaseException | None = None
        while not self._future.done():
            try:
                await asyncio.shield(self._future)
            except asyncio.CancelledError as exc:
                pending = pending or exc
        return pending


class _Backoff:
    """Waiting for a holder by polling: capped exponential backoff with
    jitter (the blocking side's rule), slept with ``asyncio.sleep``."""

    __slots__ = ("_backoff",)

    def __init__(self, initial: float, cap: float) -> None:
        self._backoff = Backoff(initial, cap)

    def prepare(self) -> None:
        pass

    def close(self) -> None:
        pass

    async def sleep(self, limit: float) -> None:
        step = self._backoff.step(limit)
        await asyncio.sleep(step)


class _LoopEvent:
    """An event the listener thread sets for a task: the wake-up reaches
    the task's loop through ``call_soon_threadsafe``."""

    __slots__ = ("_flag", "_future", "_loop")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._flag = False
        self._future: asyncio.Future[None] | None = None

    def set(self) -> None:  # any thread
        self._flag = True
        with contextlib.suppress(RuntimeError):  # the loop is closed
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    def clear(self) -> None:
        self._flag = False

    async def wait(self, timeout: float) -> None:
        if self._flag:
            return
        self._future = self._loop.create_future()
        try:
            if not self._flag:  # set between the check and the future
                await asyncio.wait((self._future,), timeout=timeout)
        finally:
            self._future = None


class _Notified:
    """Waiting for a holder on PostgreSQL: woken by the release's NOTIFY
    through the process's one LISTEN connection (the one its threads use),
    with the blocking side's safety nets (``NotifyWait``, which decides how
    long each sleep is); here the sleep is awaited on a loop-bound event."""

    __slots__ = ("_event", "_wait")

    def __init__(
        self, listener: Listener, key: str, since: float, config: Config, address: str | None = None
    ) -> None:
        # (Imported here: the PostgreSQL store's module is loaded only once an
        # engine of that dialect shows up, and only a PostgreSQL store listens.)
        from ._store.postgresql import NotifyWait

        self._event = _LoopEvent()
        self._wait = NotifyWait(listener, key, since, config, address, event=self._event)

    def prepare(self) -> None:
        self._wait.prepare()

    async def sleep(self, limit: float) -> None:
        await self._event.wait(self._wait.timeout(limit))

    def close(self) -> None:
        self._wait.close()


def _waiter(
    store: Store, key: str, since: float, address: str | None = None
) -> _Backoff | _Notified:
    config = store.config
    key = store.notify_key(key)
    listener = getattr(store, "listener", None)
    found = listener() if listener is not None else None
    if found is None:
        return _Backoff(config.poll_initial, config.poll_max)
    return _Notified(found, key, since, config, address)


class _Alone:
    """The row statements one by one, for a locker without group commit."""

    __slots__ = ("_astore", "_store")

    def __init__(self, astore: AsyncStore, store: Store) -> None:
        self._astore = astore
        self._store = store

    async def try_acquire(
        self, key: str, token: str, owner: str, ttl: float, until: float | None = None
    ) -> object:
        return await self._astore.drive(self._store.acquire_steps(key, token, owner, ttl))

    async def release(self, key: str, token: str) -> bool:
        return await self._astore.drive(self._store.release_steps(key, token))


class AsyncOps:
    """Each op of a lock operation with asyncio (see :class:`dblock._driver.Ops`;
    the blocking face's are :class:`dblock._drive.BlockingOps`), for one
    locker: the exclusive lock's (its row statements grouped by the
    manager's batcher) or a semaphore's (a store of its own)."""

    __slots__ = ("astore", "locker", "rows", "store")

    def __init__(self, manager: AsyncLockManager, locker: Locker | None = None) -> None:
        store = manager._astore
        self.astore = store
        # The exclusive lock's row statements go through the batcher (group commit).
        self.rows: AsyncBatcher | _Alone = (
            manager._abatcher
            if manager._abatcher is not None and locker in (None, manager._locker)
            else _Alone(store, (locker or manager._locker).store)
        )
        self.locker = locker = locker or manager._locker
        self.store = locker.store

    async def try_row(self, op: Try) -> Any:
        return await self.rows.try_acquire(op.key, op.token, op.owner, op.ttl, op.until)

    async def release_row(self, op: Release) -> Any:
        return await self.rows.release(op.key, op.token)

    async def transfer(self, op: Transfer) -> Any:
        return await self.astore.drive(
            self.store.transfer_steps(
                op.key, op.token, op.new_token, op.owner, op.ttl, extra=op.extra
            )
        )

    async def run_steps(self, op: Run) -> Any:
        return await self.astore.drive(op.steps)

    async def turn(self, op: Turn) -> Any:
        return await op.waiter.turn(self.locker, op.timeout)

    def wait_for(self, op: Wait) -> _Backoff | _Notified:
        return _waiter(self.store, op.key, op.since, op.address)

    async def settle(self, op: Settle) -> Any:
        return await op.waiter.settle_async()

    async def sleep(self, op: Sleep) -> None:
        await asyncio.sleep(op.seconds)

    async def call(self, op: Call) -> Any:
        return await op.func()

    async def clean(self, op: Clean) -> None:
        self.locker.renewer.post(noop)  # the renewal thread deletes orphans
        await asyncio.sleep(0)


def _drive(
    manager: AsyncLockManager, steps: Op[T], locker: Locker | None = None
) -> Coroutine[Any, Any, T]:
    """Carry out a lock operation's ops with asyncio: the one driver of both
    faces (:func:`dblock._driver.drive`), with this face's ops, for ``locker``
    (default: the exclusive lock's; a semaphore's has a store of its own).
    (The driver's own coroutine, not one more around it.)"""
    return drive(AsyncOps(manager, locker), steps)


class AsyncHeldLock:
    """A lock held by an asyncio task, as ``await alocks.acquire()`` returns
    it and ``async with alocks.lock()`` yields it: the blocking
    :class:`~dblock.HeldLock`'s state (``key``, ``fence``, ``expires_at``,
    ``lost``, ``check()``, …) with an awaitable ``release()`` and ``extend()``."""

    __slots__ = ("_manager", "held")

    def __init__(self, manager: AsyncLockManager, held: HeldLock) -> None:
        self._manager = manager
        self.held = held

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.held, name)

    def check(self) -> None:
        """Raise :class:`~dblock.LockLost` if the lock is known to be lost (no SQL)."""
        self.held.check()

    async def release(self, *, force: bool = False) -> bool:
        # The exclusive lock's locker, or a semaphore's: a Locker either way.
        locker = cast("Locker", self.held._locker)
        return await _drive(self._manager, locker.release_steps(self.held, force), locker)

    async def extend(self, ttl: float | None = None) -> None:
        """Push the lease end to ``ttl`` seconds from now (database time):
        the renewal thread's statement, awaited on the async engine."""
        lease = self.held.ttl if ttl is None else check_lease(ttl)
        manager, held = self._manager, self.held
        locker = held._locker  # the exclusive lock's, or a semaphore's
        locker.check_extend(held)
        sent_at = time.monotonic()
        store = manager.astore
        # Renewal matches (key, token) whatever the slot: the base store's statement.
        leases = await store.drive(store.store.renew_steps([(held.key, held.token, lease)]))
        locker.extended(held, leases, sent_at)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await release_on_exit(self.release, exc_type, self.key)

    def __repr__(self) -> str:
        return f"<AsyncHeldLock {self.held!r}>"


class AsyncHeldLocks(Mapping[str, AsyncHeldLock]):
    """Several locks held at once by a task (``lock_many``), by key."""

    __slots__ = ("_held",)

    def __init__(self, held: Iterable[AsyncHeldLock]) -> None:
        self._held = {h.key: h for h in held}

    def __getitem__(self, key: str) -> AsyncHeldLock:
        return self._held[key]

    def __iter__(self) -> Any:
        return iter(self._held)

    def __len__(self) -> int:
        return len(self._held)

    async def release(self, *, force: bool = False) -> bool:
        return await _release_all(list(self._held.values()), force=force)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await release_on_exit(self.release, exc_type, tuple(self._held))


async def _release_all(held: list[AsyncHeldLock], *, force: bool = False) -> bool:
    """Release ``held`` newest first, all of them even if some fail; if
    cancelled, the ones not yet released go on the renewal thread."""
    ok = True
    lost: LockLost | None = None
    for i in range(len(held) - 1, -1, -1):
        try:
            ok = await held[i].release(force=force) and ok
        except LockLost as exc:
            lost = lost or exc
        except BaseException:
            if held[i].held.released:  # cancelled in its release, not refused (not ours, ...)
                release_later(lock.held for lock in held[:i])
            raise
    if lost is not None:
        raise lost
    return ok


H = TypeVar("H", AsyncHeldLock, AsyncHeldLocks)


def _own_task(code: CodeType) -> bool:
    """Is the running task there only to run the coroutine of ``code``
    (``asyncio.wait_for`` before Python 3.12, ``create_task``, ``gather``)?
    Then it ends as soon as that returns, and what it acquired belongs to
    whoever awaits it (see ``Locker.handed_on``)."""
    task = asyncio.current_task()
    return task is not None and getattr(task.get_coro(), "cr_code", None) is code


class AsyncLockRequest:
    """What ``AsyncLockManager.lock()`` and ``lock_many()`` return: checked
    before any SQL, acquired on ``async with`` entry, released on exit (or,
    with a ``defer`` hook such as ``until=session``, when the ends it names
    are reached: see :mod:`dblock.adeferral`)."""

    __slots__ = ("_acquire", "_defer", "_held")

    def __init__(
        self, acquire: Callable[[], Awaitable[Any]], defer: DeferHook | None = None
    ) -> None:
        self._acquire = acquire
        self._defer = defer
        self._held: list[Any] = []

    def deferred_by(self, defer: DeferHook) -> AsyncLockRequest:
        """The same request, its release waiting for what ``defer`` installs
        (for integrations; see :mod:`dblock.deferral`)."""
        return AsyncLockRequest(self._acquire, defer)

    async def __aenter__(self) -> Any:
        held = await self._acquire()
        self._held.append(held)
        return held

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        held = self._held.pop()
        if self._defer is None:
            await held.__aexit__(exc_type, exc, tb)
        else:
            await aexit_deferring(held, self._defer, None, exc_type)


class AsyncLockManager:
    """Distributed locks for asyncio tasks.

    ``AsyncLockManager(url)`` makes its own :class:`~dblock.LockManager`
    (same URL forms and options); ``AsyncLockManager(locks)`` serves the
    tasks of an application that already has one, sharing its level 1 with
    its threads. Statements go through the dialect's asyncio driver on
    SQLAlchemy's async engine: the one an asyncio URL form (or
    ``AsyncEngine``) names (psycopg 3 or asyncpg, aiomysql or asyncmy,
    aiosqlite), else the dialect's default (psycopg 3, aiomysql, aiosqlite).
    """

    def __init__(
        self,
        url: str | URL | AsyncEngine | Engine | LockManager | None = None,
        *,
        engine_options: Mapping[str, Any] | None = None,
        async_engine_options: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> None:
        self.sync: LockManager
        driver: str | None = None  # the asyncio driver named, if any
        if isinstance(url, LockManager):
            if options or engine_options:
                raise LockArgumentError(
                    "options belong to the LockManager this AsyncLockManager wraps"
                )
            self.sync, self._owns = url, False
        else:
            # A blocking Engine is the blocking side's, shared (an application
            # on psycopg2, say); its tasks' statements go through the asyncio
            # driver of the same database.
            target: URL | Engine
            if is_async_engine(url):
                # Its URL (password included) and pool size; the connections
                # are dblock's own (AUTOCOMMIT, no reset on return: see _engine).
                target, async_engine_options = _from_async_engine(url, async_engine_options)
                driver = async_driver(cast("AsyncEngine", url).url)
            elif isinstance(url, Engine):
                target = url
            else:
                # An asyncio driver's URL form names the blocking side's driver too.
                resolved = resolve_url(cast("str | URL | None", url))
                driver = async_driver(resolved)
                target = blocking_url(resolved)
            self.sync = LockManager(target, engine_options=engine_options, **options)
            self._owns = True
        try:
            #: The statements on the async engine (``_astore``: the former name).
            self.astore = self._astore = AsyncStore(
                self.sync.store, engine_options=async_engine_options, driver=driver
            )
        except BaseException:
            if self._owns:
                self.sync.close()
            raise
        #: The exclusive lock's locker, the wrapped manager's (``_locker``: the former name).
        self.locker: Locker = self.sync.locker
        self._locker = self.locker
        # Group commit for tasks, beside the threads' (dblock._store.batch).
        self.abatcher: AsyncBatcher | None = None
        if self.locker.batcher is not None:
            # Asks for orphans to be deleted soon: a nudge to the renewal thread.
            clean = functools.partial(self.locker.renewer.post, noop)
            self.abatcher = AsyncBatcher(self.sync.store, self.astore.drive, clean)
        self._abatcher = self.abatcher  # (the former name)
        _amanagers.add(self)

    def __repr__(self) -> str:
        return f"<AsyncLockManager {self.sync.url} table={self.sync.config.table!r}>"

    @property
    def config(self) -> Any:
        return self.sync.config

    # -- locks -------------------------------------------------------------

    def lock(
        self,
        key: str,
        *,
        until: object = None,
        fair: bool = False,
        **options: Unpack[LockArgs],
    ) -> AsyncLockRequest:
        """``async with alocks.lock(key) as held:`` — the options of
        :meth:`dblock.LockManager.lock` (``fair`` included), checked now,
        before any SQL. ``until=session`` (a SQLAlchemy ``AsyncSession``,
        ``async_scoped_session`` or ``Session``) holds the lock past the block
        until that session's open transaction ends (see :mod:`dblock.sessions`)."""
        defer = until_hook(until)
        checked = self.sync.checks.check(key, options)
        level2 = level2_loop(fair)
        return AsyncLockRequest(lambda: self._acquire(*checked, level2=level2), defer)

    async def acquire(
        self,
        key: str,
        *,
        fair: bool = False,
        **options: Unpack[LockArgs],
    ) -> AsyncHeldLock:
        """Like :meth:`lock` without ``async with``: ``await held.release()`` when done."""
        checked = self.sync.checks.check(key, options)
        got = await self._acquire(*checked, level2=level2_loop(fair))
        if _own_task(_ACQUIRE):
            got.held._locker.handed_on(got.held)
        return got

    async def _acquire(
        self,
        key: str,
        blocking: bool,
        timeout: float | None,
        ttl: float,
        options: Any,
        *,
        level2: Level2 | None = None,
    ) -> AsyncHeldLock:
        locker = self._locker
        opts = options or locker.defaults
        me = current_owner()
        entry, again = locker.enter(key, me, blocking)
        if again is not None:
            return AsyncHeldLock(self, again)
        steps = locker.acquire_steps(
            key, me, blocking=blocking, timeout=timeout, ttl=ttl, opts=opts,
            waiter_type=AsyncWaiter, level2=level2, seen=entry,
        )  # fmt: skip
        return AsyncHeldLock(self, await _drive(self, steps))

    def semaphore(
        self,
        key: str,
        *,
        permits: int,
        **options: Unpack[LockArgs],
    ) -> AsyncLockRequest:
        """``async with alocks.semaphore(key, permits=N) as permit:`` — a
        permit of :meth:`dblock.LockManager.semaphore`'s semaphore (the same
        options, checked now; tasks and threads of the process share its N
        local permits)."""
        from .kinds.semaphore import check_permits

        n = check_permits(permits)
        checked = self.sync.checks.check(key, options)
        return AsyncLockRequest(lambda: self._acquire_permit(n, checked))

    async def _acquire_permit(self, n: int, checked: Checked) -> AsyncHeldLock:
        key, blocking, timeout, ttl, options = checked
        from .kinds.semaphore import HeldPermit

        semaphores = self.sync.kinds.open_semaphores()
        semaphores._size(key, n)
        locker = semaphores.locker
        me = current_owner()
        try:
            for sub in semaphores.plan(key, n, blocking=blocking):
                steps = locker.acquire_steps(
                    sub,
                    me,
                    blocking=blocking,
                    timeout=timeout,
                    ttl=ttl,
                    opts=options or locker.defaults,
                    waiter_type=AsyncWaiter,
                )
                try:
                    held = await _drive(self, steps, locker)
                except LockBusy as exc:
                    if exc.level == 2:
                        raise
                    continue  # another task or thread claimed it an instant ago
                assert isinstance(held, HeldPermit)
                return AsyncHeldLock(self, held)
            raise LockBusy(key, level=1)
        except (LockNotAcquired, KindMismatch, ManagerClosed) as exc:
            raise semaphores.renamed(exc, key, n) from None

    def lock_many(
        self,
        keys: Iterable[str],
        *,
        until: object = None,
        **options: Unpack[LockArgs],
    ) -> AsyncLockRequest:
        """``async with alocks.lock_many(keys) as held:`` — every key, taken
        in one order (see :meth:`dblock.LockManager.lock_many`); ``until`` as
        for :meth:`lock`."""
        defer = until_hook(until)
        ordered, (_, blocking, wait, lease, opts) = self.sync.checks.check_many(keys, options)
        return AsyncLockRequest(
            lambda: self._acquire_many(ordered, blocking, wait, lease, opts), defer
        )

    async def acquire_many(
        self,
        keys: Iterable[str],
        **options: Unpack[LockArgs],
    ) -> AsyncHeldLocks:
        ordered, (_, blocking, wait, lease, opts) = self.sync.checks.check_many(keys, options)
        got = await self._acquire_many(ordered, blocking, wait, lease, opts)
        if _own_task(_ACQUIRE_MANY):
            for one in got.values():
                one.held._locker.handed_on(one.held)
        return got

    async def _acquire_many(
        self,
        keys: tuple[str, ...],
        blocking: bool,
        timeout: float | None,
        ttl: float,
        options: Any,
    ) -> AsyncHeldLocks:
        # The rule of dblock.multi.acquire_many (one order, one overall
        # timeout, everything taken so far given back on failure), its calls
        # awaited by the asyncio driver.
        def take(key: str, wait: float | None) -> Awaitable[AsyncHeldLock]:
            return self._acquire(key, blocking, wait, ttl, options)

        steps: ManySteps[AsyncHeldLock] = acquire_many_steps(keys, timeout, take, _release_all)
        return AsyncHeldLocks(await _drive(self, steps))

    def locked(
        self,
        template: KeySpec,
        *,
        on_busy: OnBusy = "raise",
        until: object = None,
        fair: bool = False,
        **options: Unpack[LockArgs],
    ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
        """Decorate an ``async def`` function or method so each call holds
        the lock named by ``template`` (see :meth:`dblock.LockManager.locked`;
        an ``on_busy`` handler may be sync or async; ``until`` as for
        :meth:`lock`, an ``async_scoped_session`` resolved at each exit)."""
        return decorators.alocked(
            lambda: self,
            template,
            on_busy=on_busy,
            defer=until_hook(until),
            fair=fair,
            **options,
        )

    @property
    def store(self) -> Store:
        """The blocking manager's store (what a term's guard is written by)."""
        return self.sync.store

    def leader(self, role: str, **options: Unpack[LeaderArgs]) -> AsyncLeader:
        """:meth:`dblock.LockManager.leader` on the asyncio face: ``async
        with locks.leader("outbox-relay") as term:`` waits until elected; a
        term lost while the block runs cancels the task running it, and the
        block's exit raises :class:`~dblock.LeadershipLost`. ``campaign()``
        is a coroutine to run as a task (cancel it to step down)."""
        self.sync.checks.open()
        return AsyncLeader(self, role, options, self.locker.telemetry)

    # -- jobs ----------------------------------------------------------------

    def once(
        self,
        name: str,
        *,
        per: str | None = None,
        **options: Unpack[JobArgs],
    ) -> Callable[[Callable[P, Awaitable[R]]], Callable[..., Awaitable[R | Skipped]]]:
        """:meth:`dblock.LockManager.once` for ``async def`` jobs: the same
        options, the same decisions (shared with the blocking side)."""
        once = jobs.Once(self.sync, name, per, options)

        def decorate(func: Callable[P, Awaitable[R]]) -> Callable[..., Awaitable[R | Skipped]]:
            passes_fire = once.passes_fire(func, coroutine=True)

            @functools.wraps(func)
            async def run_once(*args: Any, **kwargs: Any) -> R | Skipped:
                fire_time, next_fire = once.fire_times(passes_fire, kwargs)
                return await self._run_job(once.job, func, args, kwargs, fire_time, next_fire)

            return run_once

        return decorate

    async def run_job(
        self,
        name: str,
        func: Callable[..., Awaitable[R]],
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
        """``await alocks.run_job(name, coro_func, *args, ...)``: see
        :meth:`dblock.LockManager.run_job`. ``func`` returns an awaitable."""
        # The keywords above reach the shared check by name (JobArgs lists them).
        job, fire, nxt = jobs.prepare_run(self.sync, name, func, locals())
        return await self._run_job(job, func, args, kwargs, fire, nxt)

    async def _run_job(  # noqa: PLR0917 - internal: once and run_job call it
        self,
        job: jobs.Job,
        func: Callable[..., Awaitable[R]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        fire_time: datetime | None,
        next_fire: datetime | None,
    ) -> R | Skipped:
        """The asyncio driver of the job's steps (the blocking one is
        :func:`dblock.jobs.run_job`)."""
        locker = self.sync.checks.open()
        steps = job.steps(locker, func, args, kwargs, fire_time, next_fire, AsyncWaiter)
        return job.outcome(locker, await _drive(self, steps))  # type: ignore[no-any-return]

    # -- schema and shutdown -----------------------------------------------

    async def is_locked(self, key: str) -> bool:
        """Whether anyone holds ``key`` now (see :meth:`dblock.LockManager.is_locked`):
        one statement on the async engine."""
        key = self.sync.checks.check_key(key)
        return await self._astore.drive(self.sync.store.is_locked_steps(key))

    def owns(self, key: str) -> bool:
        """Whether the calling task holds ``key`` now (no SQL, no await needed:
        see :meth:`dblock.LockManager.owns`)."""
        return self.sync.owns(key)

    async def create_schema(self) -> None:
        await asyncio.to_thread(self.sync.create_schema)

    async def close(self, timeout: float = 0.0) -> None:
        """Close the async engine, and the wrapped manager if this one made it."""
        _amanagers.discard(self)
        await self._astore.close()
        if self._owns:
            await asyncio.to_thread(self.sync.close, timeout)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()


# After os.fork() the child's managers (the wrapped LockManager is reset by
# its own hook) drop their async connections without touching them.
_amanagers: weakref.WeakSet[AsyncLockManager] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for amanager in list(_amanagers):
        amanager.astore.after_fork()
        if amanager.abatcher is not None:
            amanager.abatcher.after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_ACQUIRE = AsyncLockManager.acquire.__code__
_ACQUIRE_MANY = AsyncLockManager.acquire_many.__code__


def _from_async_engine(
    engine: Any, options: Mapping[str, Any] | None
) -> tuple[URL, Mapping[str, Any] | None]:
    """What an ``AsyncEngine`` given to ``AsyncLockManager`` lends it: its URL
    (password included) in the blocking driver's form, and its pool's size
    for dblock's own asyncio pool (unless ``async_engine_options`` say)."""
    url = blocking_url(engine.url)
    pool = engine.sync_engine.pool
    size = getattr(pool, "size", None)
    if callable(size) and not (options and "pool_size" in options):
        options = {"pool_size": size(), **(options or {})}
    return url, options
