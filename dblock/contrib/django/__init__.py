"""Django integration: add ``"dblock.contrib.django"`` to ``INSTALLED_APPS``.

::

    DBLOCK = {"TTL": 30}            # optional; every key is optional

    from dblock.contrib.django import locked, locked_view

    @locked("user:{user_id}")        # service layer: LockBusy / LockTimeout on busy
    def withdraw(user_id: int, amount: int) -> int: ...

    @locked_view("user:{user_id}", blocking=False)   # a view: 409 on busy
    def statement(request, user_id): ...

Settings are the ``DBLOCK`` dict: every :class:`~dblock.Config` field under
its upper-case name (``TABLE``, ``TTL``, ``TIMEOUT``, ...), plus ``URL``,
``ENGINE_OPTIONS`` (for dblock's own engine and pool; checked at start-up),
``DATABASE`` (the alias whose connection settings make the URL when ``URL``
is not given; default ``"default"``), ``SWEEPER``,
``SWEEPER_INTERVAL``, ``SWEEPER_MAX_AGE`` and ``BUSY_STATUS`` (409 or 423).

``manage.py migrate`` creates the lock table (the schema of dblock's alembic
revision); ``dblock_list``, ``dblock_sweep`` and ``dblock_release --force``
are management commands; the admin shows held locks read-only with a
force-release action; ``dblock.contrib.django.middleware.LockBusyMiddleware``
answers 409 for a busy lock raised anywhere in a view.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from ... import decorators
from ...decorators import KeySpec, OnBusy
from ...lock import UNSET, Unset
from ...manager import LockManager

__all__ = ["get_manager", "locked", "locked_view", "reset_manager"]

P = ParamSpec("P")
R = TypeVar("R")

_lock = threading.Lock()
_manager: LockManager | None = None


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


def reset_manager() -> None:
    """Close the manager; the next lock makes a new one from the settings
    (done automatically when ``DBLOCK`` or ``DATABASES`` change in tests)."""
    global _manager
    with _lock:
        manager, _manager = _manager, None
    if manager is not None:
        from .apps import stop_sweeper

        stop_sweeper()
        manager.close()


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
    so it can decorate at import time)."""
    return decorators.locked(
        get_manager, template, blocking=blocking, timeout=timeout, ttl=ttl, on_busy=on_busy
    )


def locked_view(
    template: KeySpec,
    *,
    blocking: bool = True,
    timeout: float | Unset | None = UNSET,
    ttl: float | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Like :func:`locked` for a view: the template names the view's
    arguments (``"user:{user_id}"``, ``"user:{request.user.pk}"``), and a
    busy lock answers 409 (``DBLOCK["BUSY_STATUS"]``) instead of raising."""

    def busy(error: Any, *args: Any, **kwargs: Any) -> Any:
        from .views import busy_response, find_request

        return busy_response(find_request(args), error)

    return decorators.locked(
        get_manager, template, blocking=blocking, timeout=timeout, ttl=ttl, on_busy=busy
    )
