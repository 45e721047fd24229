"""Watching the example apps' critical sections from the tests.

Each example's withdrawal calls ``pay_out(user_id, amount)``, its slow
part (a payment provider's API in a real app), inside the lock. The tests
replace that function with one that appends an "enter" and an "exit" line
to a ledger file around the original, and ``web.ledger_problems`` checks the
file: no two requests for one user were ever inside at once. Lines are
appended with ``O_APPEND`` (one ``write`` each), so the file's order is the
order of the events across the server processes. None of this is in the
examples: they read like an application, and the tests bring the probe.

* In the tests' process: ``watch(module, path)`` (undone by ``unwatch``).
* In server processes the tests start, the ledger's path is
  ``$DBLOCK_TEST_LEDGER``: ``flask --app tests.support.ledger:flask_app``,
  ``uvicorn --factory tests.support.ledger:fastapi_app`` (run in the
  example's directory), and for Django the settings module
  ``tests.support.django_env_settings``, which then installs
  :class:`WatchDjangoExample`.
"""

from __future__ import annotations

import functools
import inspect
import os
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

from django.apps import AppConfig

ENV = "DBLOCK_TEST_LEDGER"
PROBE = "pay_out"


def append(path: str | Path, user_id: int, request_id: str, event: str) -> None:
    line = f"{user_id} {request_id} {event}\n".encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def rows(path: str | Path) -> list[tuple[int, str, str]]:
    """The ledger's (user_id, request_id, event) rows, in order."""
    if not Path(path).exists():
        return []
    found = []
    for line in Path(path).read_text().splitlines():
        user_id, request_id, event = line.split()
        found.append((int(user_id), request_id, event))
    return found


def watch(module: ModuleType, path: str | Path) -> None:
    """Record every call of ``module.pay_out`` in the ledger at ``path``."""
    original = getattr(module, PROBE)
    if inspect.iscoroutinefunction(original):

        @functools.wraps(original)
        async def watched_async(user_id: int, *args: Any, **kwargs: Any) -> Any:
            request_id = uuid.uuid4().hex
            append(path, user_id, request_id, "enter")
            try:
                return await original(user_id, *args, **kwargs)
            finally:
                append(path, user_id, request_id, "exit")

        setattr(module, PROBE, watched_async)
    else:

        @functools.wraps(original)
        def watched(user_id: int, *args: Any, **kwargs: Any) -> Any:
            request_id = uuid.uuid4().hex
            append(path, user_id, request_id, "enter")
            try:
                return original(user_id, *args, **kwargs)
            finally:
                append(path, user_id, request_id, "exit")

        setattr(module, PROBE, watched)


def unwatch(module: ModuleType) -> None:
    probe = getattr(module, PROBE)
    setattr(module, PROBE, getattr(probe, "__wrapped__", probe))


def _example_module() -> ModuleType:
    import app  # the example's app.py: servers run in its directory

    return app


def flask_app() -> Any:
    """The Flask example's app, watched (``flask --app`` calls this)."""
    example = _example_module()
    watch(example, os.environ[ENV])
    return example.create_app()


def fastapi_app() -> Any:
    """The FastAPI example's app, watched (``uvicorn --factory`` calls this)."""
    example = _example_module()
    watch(example, os.environ[ENV])
    return example.create_app()


def django_modules() -> list[ModuleType]:
    """The example project's modules with a ``pay_out``: the sync service
    and the async views (import them once Django is set up)."""
    from accounts import async_views, services

    return [services, async_views]


class WatchDjangoExample(AppConfig):
    """Watches the example project's sync and async withdrawals once Django
    is set up (tests.support.django_env_settings installs it when
    ``$DBLOCK_TEST_LEDGER`` is set)."""

    name = "tests.support"
    label = "dblock_test_ledger"

    def ready(self) -> None:
        for module in django_modules():
            watch(module, os.environ[ENV])
