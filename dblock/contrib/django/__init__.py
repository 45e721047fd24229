"""Django integration: add ``"dblock.contrib.django"`` to ``INSTALLED_APPS``.

::

    DBLOCK = {"TTL": 30}            # optional; every key is optional

    from dblock.contrib.django import locked, locked_view

    @locked("user:{user_id}")        # service layer: LockBusy / LockTimeout on busy
    def withdraw(user_id: int, amount: int) -> int: ...

    @locked_view("user:{user_id}", blocking=False)   # a view: 409 on busy
    def statement(request, user_id): ...

    @locked_view("user:{user_id}", blocking=False)   # async views too
    async def summary(request, user_id): ...

Settings are the ``DBLOCK`` dict: every :class:`~dblock.Config` field under
its upper-case name (``TABLE``, ``TTL``, ``TIMEOUT``, ...), plus ``URL``,
``ENGINE_OPTIONS`` (for dblock's own engine and pool; checked at start-up),
``DATABASE`` (the alias whose connection settings make the URL when ``URL``
is not given; default ``"default"``), ``SWEEPER``,
``SWEEPER_INTERVAL``, ``SWEEPER_MAX_AGE`` and ``BUSY_STATUS`` (409 or 423).

The lock covers the commit: a lock taken through this module (``locked``,
``locked_view``, ``lock``, ``lock_many``) whose function or block ends while
a transaction is open on one of Django's connections (``ATOMIC_REQUESTS``,
``transaction.atomic()``) is held until that transaction commits or rolls
back; a view's lock whose response is streamed (``StreamingHttpResponse``,
``FileResponse``) is held until the body has been sent and the response
closed.

``locked`` and ``locked_view`` decorate ``async def`` functions and views as
well (same options, same busy response): their locks are taken through an
:class:`~dblock.AsyncLockManager` (:func:`get_async_manager`) that shares the
process's level 1 with the synchronous views' threads, and ``alock`` /
``alock_many`` are ``lock`` / ``lock_many`` for ``async with``.

``manage.py migrate`` creates the lock table (the schema of dblock's alembic
revision); ``dblock_list``, ``dblock_sweep`` and ``dblock_release --force``
are management commands; the admin shows held locks read-only with a
force-release action; ``dblock.contrib.django.middleware.LockBusyMiddleware``
answers 409 for a busy lock raised anywhere in a view.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from ... import decorators
from ...decorators import KeySpec, OnBusy
from ...deferral import Deferred
from ...lock import UNSET, HeldLock, Unset
from ...manager import LockManager, LockRequest
from ...multi import HeldLocks

if TYPE_CHECKING:
    from ...aio import AsyncLockManager, AsyncLockRequest

__all__ = [
    "alock",
    "alock_many",
    "get_async_manager",
    "get_manager",
    "lock",
    "lock_many",
    "locked",
    "locked_view",
    "reset_manager",
]

P = ParamSpec("P")
R = TypeVar("R")

_lock = threading.Lock()
_manager: LockManager | None = None
_amanager: AsyncLockManager | None = None
_closing: set[asyncio.Task[None]] = set()  # closes of async managers under way


def get_manager() -> LockManager:
    """The process's :class:`~dblock.LockManager`, made from the settings on
    first use (so under the test runner it uses the test database)."""
    global _manager
    manager = _manager
    if manager is None:
        with _lock:
            if _manager is None:
                _manager = _make_manager()
            manager = _manager
    return manager


def get_async_manager() -> AsyncLockManager:
    """The process's :class:`~dblock.AsyncLockManager` for async views and
    functions: it wraps :func:`get_manager`'s manager, so threads and tasks
    of the process share one level 1 (and one table, one renewal thread)."""
    global _amanager
    manager = get_manager()
    amanager = _amanager
    if amanager is None or amanager.sync is not manager:
        from ...aio import AsyncLockManager

        with _lock:
            if _amanager is None or _amanager.sync is not manager:
                _amanager = AsyncLockManager(manager)
            amanager = _amanager
    return amanager


def reset_manager() -> None:
    """Close the manager; the next lock makes a new one from the settings
    (done automatically when ``DBLOCK`` or ``DATABASES`` change in tests)."""
    global _manager, _amanager
    with _lock:
        manager, _manager = _manager, None
        amanager, _amanager = _amanager, None
    if amanager is not None:
        _close_async(amanager)
    if manager is not None:
        from .apps import stop_sweeper

        stop_sweeper()
        manager.close()


def _close_async(amanager: AsyncLockManager) -> None:
    """Close the async manager's connections from sync code: on a loop of
    our own when this thread runs none, else soon on the one it runs (sync
    code inside an async test or view, ``override_settings`` say: dropping
    them untouched left them open until collected, and the test database
    could not be dropped)."""

    loop = asyncio._get_running_loop()
    if loop is not None:
        task = loop.create_task(amanager.astore.close())  # always finishes
        _closing.add(task)  # (the loop keeps only a weak reference)
        task.add_done_callback(_closing.discard)
        return
    try:
        asyncio.run(amanager.astore.close())
    except Exception:  # a connection of a dead loop that cannot close: let it go
        amanager.astore.forget()


def _make_manager() -> LockManager:
    from . import conf

    settings = conf.read()
    url, engine_options = conf.engine_args(settings)
    return LockManager(url, config=settings.config, engine_options=engine_options)


def locked(
    template: KeySpec,
    *,
    blocking: bool = True,
    timeout: float | Unset | None = UNSET,
    ttl: float | None = None,
    on_busy: OnBusy = "raise",
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """``LockManager.locked`` on the project's manager (looked up per call,
    so it can decorate at import time); on an ``async def`` function,
    ``AsyncLockManager.locked`` on :func:`get_async_manager`."""
    return _either(
        decorators.locked(
            get_manager,
            template,
            blocking=blocking,
            timeout=timeout,
            ttl=ttl,
            on_busy=on_busy,
            defer=defer_release,
        ),
        decorators.alocked(
            get_async_manager,
            template,
            blocking=blocking,
            timeout=timeout,
            ttl=ttl,
            on_busy=on_busy,
            defer=defer_release,
        ),
    )


def _either(sync: Callable[[Any], Any], asyn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The decorator for what it is applied to: ``asyn`` for coroutine
    functions (``async def``), ``sync`` for everything else (which refuses
    what it cannot lock, as ``LockManager.locked`` does)."""

    def decorate(func: Any) -> Any:
        inner = func.__func__ if isinstance(func, (classmethod, staticmethod)) else func
        return (asyn if inspect.iscoroutinefunction(inner) else sync)(func)

    return decorate


def locked_view(
    template: KeySpec,
    *,
    blocking: bool = True,
    timeout: float | Unset | None = UNSET,
    ttl: float | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Like :func:`locked` for a view (sync or ``async def``): the template
    names the view's arguments (``"user:{user_id}"``,
    ``"user:{request.user.pk}"``), and a busy lock answers 409
    (``DBLOCK["BUSY_STATUS"]``) instead of raising."""

    def busy(error: Any, *args: Any, **kwargs: Any) -> Any:
        from .views import busy_response, find_request

        return busy_response(find_request(args), error)

    return _either(
        decorators.locked(
            get_manager,
            template,
            blocking=blocking,
            timeout=timeout,
            ttl=ttl,
            on_busy=busy,
            defer=defer_release,
        ),
        decorators.alocked(
            get_async_manager,
            template,
            blocking=blocking,
            timeout=timeout,
            ttl=ttl,
            on_busy=busy,
            defer=defer_release,
        ),
    )


def lock(
    key: str,
    *,
    blocking: bool = True,
    timeout: float | Unset | None = UNSET,
    ttl: float | None = None,
) -> LockRequest[HeldLock]:
    """``LockManager.lock`` on the project's manager, held past the block
    until the open transaction (if any) commits or rolls back."""
    return (
        get_manager()
        .lock(key, blocking=blocking, timeout=timeout, ttl=ttl)
        .deferred_by(defer_release)
    )


def lock_many(
    keys: Iterable[str],
    *,
    blocking: bool = True,
    timeout: float | Unset | None = UNSET,
    ttl: float | None = None,
) -> LockRequest[HeldLocks]:
    """``LockManager.lock_many`` on the project's manager, held like :func:`lock`."""
    return (
        get_manager()
        .lock_many(keys, blocking=blocking, timeout=timeout, ttl=ttl)
        .deferred_by(defer_release)
    )


def alock(
    key: str,
    *,
    blocking: bool = True,
    timeout: float | Unset | None = UNSET,
    ttl: float | None = None,
) -> AsyncLockRequest:
    """:func:`lock` for async code: ``async with alock("user:42"):``."""
    return (
        get_async_manager()
        .lock(key, blocking=blocking, timeout=timeout, ttl=ttl)
        .deferred_by(defer_release)
    )


def alock_many(
    keys: Iterable[str],
    *,
    blocking: bool = True,
    timeout: float | Unset | None = UNSET,
    ttl: float | None = None,
) -> AsyncLockRequest:
    """:func:`lock_many` for async code."""
    return (
        get_async_manager()
        .lock_many(keys, blocking=blocking, timeout=timeout, ttl=ttl)
        .deferred_by(defer_release)
    )


_NEVER_CLOSED = (
    "its streamed response was garbage-collected without being closed (a server that "
    "never calls close() on the response)"
)


def defer_release(deferred: Deferred, result: Any) -> Any:
    """Hold the lock until every open transaction of this thread's database
    connections has ended, and until a streamed response is closed. (An
    async view's ORM work runs on other threads, in transactions that end
    before it returns: Django refuses ``ATOMIC_REQUESTS`` for async views.)"""
    from django.db import connections
    from django.http.response import HttpResponseBase

    for connection in connections.all(initialized_only=True):
        if connection.in_atomic_block:
            # Called after the commit; a rollback drops the callback, which
            # fires the trigger as it is collected (see dblock.deferral).
            connection.on_commit(deferred.trigger())
    if isinstance(result, HttpResponseBase) and result.streaming:
        # The server calls close() once the body is sent (WSGI and ASGI alike);
        # close() calls every resource closer.
        result._resource_closers.append(deferred.trigger(dropped=_NEVER_CLOSED))
    return result
