"""What the dblock management commands share: the project's manager and
dblock errors turned into CommandError (exit status 1)."""

from __future__ import annotations

from collections.abc import Callable

from django.core.management.base import CommandError

from .....errors import DBLockError
from .....manager import LockManager
from ... import get_manager


def run(action: Callable[[LockManager], str]) -> str:
    try:
        return action(get_manager())
    except DBLockError as exc:
        raise CommandError(str(exc)) from exc
