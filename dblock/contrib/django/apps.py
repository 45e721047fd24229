"""The app config: settings are checked at start-up; the optional sweeper
starts with the first request of each process (not in management commands)."""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import TYPE_CHECKING, Any

from django.apps import AppConfig
from django.core.signals import request_started, setting_changed

from .. import _admin
from . import conf

if TYPE_CHECKING:
    from django.db.backends.base.creation import BaseDatabaseCreation

_sweeper_lock = threading.Lock()
_sweeper: _admin.Sweeper | None = None
_sweeper_pid: int | None = None


class DBLockConfig(AppConfig):
    name = "dblock.contrib.django"
    label = "dblock"
    verbose_name = "dblock"
    default_auto_field = "django.db.models.BigAutoField"

    def __init__(self, app_name: str, app_module: Any) -> None:
        super().__init__(app_name, app_module)
        # Made as INSTALLED_APPS are read, before any app's ready() or a
        # connection could import Django's MySQL backend.
        _pymysql_for_mysqldb()

    def ready(self) -> None:
        settings = conf.read()  # a bad DBLOCK setting fails here, at start-up
        conf.check_engine(settings)  # and so does a bad URL or ENGINE_OPTIONS
        setting_changed.connect(_settings_changed, dispatch_uid="dblock-settings")
        _follow_test_databases()
        if settings.sweeper:
            request_started.connect(_maybe_start_sweeper, dispatch_uid="dblock-sweeper")


def _pymysql_for_mysqldb() -> None:
    """Django's MySQL backend imports ``MySQLdb`` (mysqlclient, a C module
    that needs a compiler and libmariadb to install); dblock's ``mysql``
    extra installs PyMySQL. If the project's databases use that backend,
    mysqlclient is missing and PyMySQL is there, PyMySQL stands in for it
    (``pymysql.install_as_MySQLdb()``, as Django's own docs suggest doing in
    settings), so installing the ``django,mysql`` extras starts a project on
    MariaDB or MySQL as it is. With mysqlclient installed nothing changes."""
    from django.conf import settings

    engines = {db.get("ENGINE") for db in getattr(settings, "DATABASES", {}).values()}
    if "django.db.backends.mysql" not in engines:
        return
    try:  # (the backend imports it next anyway)
        import MySQLdb  # noqa: F401
    except ImportError:
        pass
    else:
        return
    try:
        import pymysql
    except ImportError:
        return  # Django's own error names mysqlclient: nothing better to say
    pymysql.install_as_MySQLdb()


def _settings_changed(*, setting: str, **_: Any) -> None:
    if setting in ("DBLOCK", "DATABASES"):
        _reset()


def _follow_test_databases() -> None:
    """Django's test runner swaps the database under the project's manager
    without a signal: it creates the test database and points the
    connection's settings at it, and at the end points them back and drops
    it. The manager follows: made afresh once a test database exists (one
    made earlier, say by a module the runner imported to find the tests,
    would write its rows to the real database), and closed before a test
    database is dropped (PostgreSQL refuses to drop a database any session
    is connected to, and the manager's pool keeps its connections: a test
    run whose tests took a lock ended with "database ... is being accessed
    by other users" and exit status 1)."""
    from django.db.backends.base.creation import BaseDatabaseCreation

    if getattr(BaseDatabaseCreation.create_test_db, "dblock_follows", False):
        return
    create, destroy = BaseDatabaseCreation.create_test_db, BaseDatabaseCreation.destroy_test_db

    @functools.wraps(create)
    def create_test_db(self: BaseDatabaseCreation, *args: Any, **kwargs: Any) -> Any:
        name = create(self, *args, **kwargs)
        _reset()
        return name

    @functools.wraps(destroy)
    def destroy_test_db(self: BaseDatabaseCreation, *args: Any, **kwargs: Any) -> Any:
        _reset()
        _sessions_ended(self)
        return destroy(self, *args, **kwargs)

    create_test_db.dblock_follows = True  # type: ignore[attr-defined]
    BaseDatabaseCreation.create_test_db = create_test_db
    BaseDatabaseCreation.destroy_test_db = destroy_test_db


def _sessions_ended(creation: BaseDatabaseCreation, within: float = 2.0) -> None:
    """Wait, up to ``within`` seconds, until PostgreSQL has no session left on
    the test database, since DROP DATABASE fails at once on any. A lock
    released by a rolled-back transaction (every ``TestCase``'s end) is
    released on dblock's worker thread, and its statement may still be
    running as the manager closes (its connection is closed when it
    returns); a closed connection's server process ends a moment later."""
    if creation.connection.vendor != "postgresql":
        return
    name = creation.connection.settings_dict["NAME"]
    deadline = time.monotonic() + within
    with creation._nodb_cursor() as cursor:
        while True:
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                [name],
            )
            if not cursor.fetchone()[0] or time.monotonic() >= deadline:
                return
            time.sleep(0.01)


def _reset() -> None:
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
