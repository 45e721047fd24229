"""The app config: settings are checked at start-up; the optional sweeper
starts with the first request of each process (not in management commands)."""

from __future__ import annotations

import os
import threading
from typing import Any

from django.apps import AppConfig
from django.core.signals import request_started, setting_changed

from .. import _admin
from . import conf

_sweeper_lock = threading.Lock()
_sweeper: _admin.Sweeper | None = None
_sweeper_pid: int | None = None


class DBLockConfig(AppConfig):
    name = "dblock.contrib.django"
    label = "dblock"
    verbose_name = "dblock"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        settings = conf.read()  # a bad DBLOCK setting fails here, at start-up
        conf.check_engine(settings)  # and so does a bad URL or ENGINE_OPTIONS
        setting_changed.connect(_settings_changed, dispatch_uid="dblock-settings")
        if settings.sweeper:
            request_started.connect(_maybe_start_sweeper, dispatch_uid="dblock-sweeper")


def _settings_changed(*, setting: str, **_: Any) -> None:
    if setting in ("DBLOCK", "DATABASES"):
        from . import reset_manager

        reset_manager()


def _maybe_start_sweeper(**_: Any) -> None:
    if _sweeper is None or _sweeper_pid != os.getpid():
        start_sweeper()


def start_sweeper() -> _admin.Sweeper:
    """Start this process's background sweeper now."""
    global _sweeper, _sweeper_pid
    from . import get_manager

    settings = conf.read()
    with _sweeper_lock:
        if _sweeper is None or _sweeper_pid != os.getpid():
            # After a fork the parent's scheduler thread is gone: start anew.
            _sweeper = _admin.Sweeper(
                get_manager(),
                interval=settings.sweeper_interval,
                max_age=settings.sweeper_max_age,
            ).start()
            _sweeper_pid = os.getpid()
        return _sweeper


def stop_sweeper() -> None:
    global _sweeper
    with _sweeper_lock:
        sweeper, _sweeper = _sweeper, None
    if sweeper is not None:
        sweeper.stop()


def current_sweeper() -> _admin.Sweeper | None:
    return _sweeper
