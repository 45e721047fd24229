"""Flask integration: ``DBLock(app)`` or ``DBLock()`` + ``init_app(app)``.

::

    from dblock.contrib.flask import DBLock

    dblock = DBLock()           # in extensions.py, before any app exists

    @dblock.locked("user:{user_id}", blocking=False)
    def withdraw(user_id: int, amount: int) -> int: ...

    def create_app():
        app = Flask(__name__)
        app.config["DBLOCK_TTL"] = 60
        db.init_app(app)        # Flask-SQLAlchemy, if the app has it
        dblock.init_app(app)
        return app

Configuration is read from ``app.config`` keys ``DBLOCK_<NAME>``: every
:class:`~dblock.Config` field (``DBLOCK_TABLE``, ``DBLOCK_TTL``,
``DBLOCK_TIMEOUT``, ...) and ``DBLOCK_URL``, ``DBLOCK_ENGINE_OPTIONS``,
``DBLOCK_SWEEPER``, ``DBLOCK_SWEEPER_INTERVAL``, ``DBLOCK_SWEEPER_MAX_AGE``,
``DBLOCK_BUSY_STATUS`` (409 or 423), ``DBLOCK_BUSY_RESPONSE``,
``DBLOCK_USE_SQLALCHEMY`` and ``DBLOCK_COVER_COMMIT``. The database is, in
this order: ``DBLOCK_URL``; ``$DBLOCK_URL``; the database of Flask-SQLAlchemy
when the app has the extension (dblock's engine then connects exactly as the
app's engine does, through its creator, but keeps a pool of its own: a
request holding a session connection must never wait for a second one to
take a lock); the SQLite file ``./dblock.sqlite3``. ``DBLOCK_ENGINE_OPTIONS``
shape that engine; the ones that cannot apply are refused at ``init_app``.

Locks taken through the extension cover the commit: with Flask-SQLAlchemy
(and ``DBLOCK_COVER_COMMIT``, on by default) one whose function or block ends
while ``db.session`` has a transaction open is held until that transaction
ends; a view's lock whose response is streamed is held until the body has
been sent and the response closed. An app database that is a SQLite file gets
dblock's rows in a file beside it (``app.sqlite3`` -> ``app.dblock.sqlite3``).

The extension adds ``flask dblock`` (``migrate``, ``sweep``, ``list``,
``release``, and ``run`` to run another command once across the hosts),
turns a :class:`~dblock.LockNotAcquired` escaping a view into a 409 (or 423)
response (through the app's handlers for ``DBLockError``, then for that
status, as the README orders them), and with ``DBLOCK_SWEEPER = True``
sweeps expired rows in the background from the first request of each
process on.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ParamSpec, TypeVar

import click
from flask import Flask, Response, current_app, has_app_context, request
from flask.cli import AppGroup
from sqlalchemy.engine import Engine
from werkzeug.exceptions import Conflict, Locked
from werkzeug.wrappers import Response as WerkzeugResponse

from .. import decorators, migrations
from .._engine import ENV_URL, borrow, check_engine_options, file_database
from ..decorators import KeySpec, OnBusy
from ..deferral import DeferHook, Deferred
from ..errors import DBLockError, LockArgumentError, LockNotAcquired
from ..lock import UNSET, HeldLock, Unset
from ..manager import LockManager, LockRequest
from ..multi import HeldLocks
from ..sessions import session_hook
from . import _admin, _jobrun
from ._beside import beside
from ._http import busy_body, busy_message, log_busy, negotiate
from ._settings import Settings, read_settings

__all__ = ["BusyConflict", "BusyLocked", "DBLock", "cli"]

P = ParamSpec("P")
R = TypeVar("R")

EXTENSION = "dblock"
_FLASK_ONLY = {"USE_SQLALCHEMY": True, "BUSY_RESPONSE": True, "COVER_COMMIT": True}
_ENGINE_OPTIONS = "DBLOCK_ENGINE_OPTIONS"


class _State:
    """What the extension keeps per app, in ``app.extensions["dblock"]``."""

    def __init__(self, manager: LockManager, settings: Settings) -> None:
        self.manager = manager
        self.settings = settings
        self.sweeper: _admin.Sweeper | None = None
        self.sweeper_pid: int | None = None
        self.lock = threading.Lock()
        # Held past the locked code until Flask-SQLAlchemy's session
        # transaction ends (DBLOCK_COVER_COMMIT), if the app has the extension.
        self.until: DeferHook | None = None


class DBLock:
    """The Flask extension. ``DBLock(app)`` or ``DBLock()`` then ``init_app(app)``.

    ``manager=`` uses a :class:`~dblock.LockManager` you made instead of one
    built from the config. Locks taken through the extension use the manager
    of the current app (or of the app given to the constructor, outside an
    app context), so decorators can be applied before any app exists.
    """

    def __init__(self, app: Flask | None = None, *, manager: LockManager | None = None) -> None:
        self._manager = manager
        self._app: Flask | None = None
        if app is not None:
            self.init_app(app)
            self._app = app

    def init_app(self, app: Flask) -> None:
        values = {k[len("DBLOCK_") :]: v for k, v in app.config.items() if k.startswith("DBLOCK_")}
        settings = read_settings(values, name=lambda k: f"DBLOCK_{k}", extra=_FLASK_ONLY)
        for flag in _FLASK_ONLY:
            if not isinstance(settings.extra[flag], bool):
                raise LockArgumentError(
                    f"DBLOCK_{flag} must be True or False, got {settings.extra[flag]!r}"
                )
        if self._manager is not None:
            ignored = [f"DBLOCK_{k}" for k in ("URL", "ENGINE_OPTIONS") if k in values]
            if ignored:
                raise LockArgumentError(
                    f"{' and '.join(ignored)} cannot apply: DBLock(manager=...) was given a "
                    "LockManager, which already has its engine"
                )
        manager = self._manager or _make_manager(app, settings)
        state = _State(manager, settings)
        if settings.extra["COVER_COMMIT"]:
            ext = app.extensions.get("sqlalchemy")
            if ext is not None:
                state.until = session_hook(ext.session)
        app.extensions[EXTENSION] = state
        app.cli.add_command(cli)
        if settings.extra["BUSY_RESPONSE"] and not _handles_busy(app):
            app.register_error_handler(LockNotAcquired, _busy_response)
        if settings.sweeper:
            app.before_request(_start_sweeper_once)

    # -- the manager of the current app -----------------------------------

    @property
    def manager(self) -> LockManager:
        """The current app's :class:`~dblock.LockManager`."""
        return self._state().manager

    def _state(self) -> _State:
        if has_app_context():
            app: Flask = _the_app()
        elif self._app is not None:
            app = self._app
        else:
            raise RuntimeError(
                "dblock: no Flask app here: call this inside an app context, or give the "
                "app to DBLock(app)"
            )
        return state_of(app)

    def lock(
        self,
        key: str,
        *,
        blocking: bool = True,
        timeout: float | Unset | None = UNSET,
        ttl: float | None = None,
    ) -> LockRequest[HeldLock]:
        """``LockManager.lock`` on the current app's manager (``manager``
        has the rest: ``acquire``, ``acquire_many``, ...)."""
        return self.manager.lock(key, blocking=blocking, timeout=timeout, ttl=ttl).deferred_by(
            _defer_release
        )

    def lock_many(
        self,
        keys: Iterable[str],
        *,
        blocking: bool = True,
        timeout: float | Unset | None = UNSET,
        ttl: float | None = None,
    ) -> LockRequest[HeldLocks]:
        return self.manager.lock_many(
            keys, blocking=blocking, timeout=timeout, ttl=ttl
        ).deferred_by(_defer_release)

    def locked(
        self,
        template: KeySpec,
        *,
        blocking: bool = True,
        timeout: float | Unset | None = UNSET,
        ttl: float | None = None,
        on_busy: OnBusy = "raise",
    ) -> Callable[[Callable[P, R]], Callable[P, R]]:
        """``LockManager.locked``, resolving the app's manager at each call.
        On a view, a busy lock (with the default ``on_busy="raise"``) becomes
        the extension's 409/423 response."""
        return decorators.locked(
            lambda: self.manager,
            template,
            blocking=blocking,
            timeout=timeout,
            ttl=ttl,
            on_busy=on_busy,
            defer=_defer_release,
        )

    # -- the in-app sweeper ------------------------------------------------

    def start_sweeper(self, app: Flask | None = None) -> _admin.Sweeper:
        """Start this process's background sweeper now (``DBLOCK_SWEEPER``
        starts it at the first request instead)."""
        return _start_sweeper(state_of(app) if app is not None else self._state())

    def stop_sweeper(self, app: Flask | None = None) -> None:
        state = state_of(app) if app is not None else self._state()
        with state.lock:
            sweeper, state.sweeper = state.sweeper, None
        if sweeper is not None:
            sweeper.stop()


def state_of(app: Flask) -> _State:
    state = app.extensions.get(EXTENSION)
    if not isinstance(state, _State):
        raise RuntimeError(f"dblock is not set up on {app.name}: call DBLock(app) or init_app")
    return state


def _make_manager(app: Flask, settings: Settings) -> LockManager:
    options: dict[str, Any] = {"config": settings.config}
    url = settings.url or os.environ.get(ENV_URL)
    if url is not None:
        engine_options = check_engine_options(settings.engine_options, name=_ENGINE_OPTIONS)
        return LockManager(url, engine_options=engine_options, **options)
    if settings.extra["USE_SQLALCHEMY"]:
        engine = _sqlalchemy_engine(app)
        if engine is not None:
            # Never the app's pool itself: a request holding a session
            # connection would wait for a second one to take a lock.
            borrowed, engine_options = borrow(engine, settings.engine_options, name=_ENGINE_OPTIONS)
            if file_database(engine.dialect.name):
                # SQLite has one writer: dblock's rows go in a file of their
                # own beside the app's (see dblock.contrib._beside).
                borrowed = beside(borrowed)
            return LockManager(borrowed, engine_options=engine_options, **options)
        if "SQLALCHEMY_DATABASE_URI" in app.config:
            # Locks in a local SQLite file would not be shared with the other
            # servers: that mistake must not pass silently.
            raise LockArgumentError(
                "the app configures SQLALCHEMY_DATABASE_URI but Flask-SQLAlchemy is not set up "
                "on it yet: call db.init_app(app) before dblock's init_app, or set DBLOCK_URL"
            )
    engine_options = check_engine_options(settings.engine_options, name=_ENGINE_OPTIONS)
    return LockManager(engine_options=engine_options, **options)


def _sqlalchemy_engine(app: Flask) -> Engine | None:
    """The default engine of Flask-SQLAlchemy on ``app``, if it is set up there."""
    ext = app.extensions.get("sqlalchemy")
    if ext is None:
        return None
    with app.app_context():
        engine = ext.engine
    assert isinstance(engine, Engine)
    return engine


# -- when the lock is released ----------------------------------------------------

_NEVER_CLOSED = (
    "its streamed response was garbage-collected without being closed (a server that "
    "never calls close() on the response)"
)


def _defer_release(deferred: Deferred, result: Any) -> Any:
    """Hold a lock past the locked code until the app's session transaction
    ends (Flask-SQLAlchemy, ``DBLOCK_COVER_COMMIT``) and until a streamed body
    has been sent and closed."""
    if has_app_context():
        state = current_app.extensions.get(EXTENSION)
        if isinstance(state, _State) and state.until is not None:
            result = state.until(deferred, result)
    if isinstance(result, tuple) and result:
        return (_defer_body(deferred, result[0]), *result[1:])
    return _defer_body(deferred, result)


def _defer_body(deferred: Deferred, body: Any) -> Any:
    if isinstance(body, WerkzeugResponse):
        if body.is_streamed:
            body.call_on_close(deferred.trigger(dropped=_NEVER_CLOSED))
        return body
    if isinstance(body, Iterator) and not isinstance(body, (str, bytes, bytearray)):
        # A view returning a generator: Flask makes the response around it.
        return _ClosingBody(body, deferred.trigger(dropped=_NEVER_CLOSED))
    return body


class _ClosingBody:
    """A body iterator that reports its close (the server closes the body
    once it is sent, or abandoned)."""

    __slots__ = ("_body", "_closed")

    def __init__(self, body: Iterator[Any], closed: Callable[[], None]) -> None:
        self._body = body
        self._closed = closed

    def __iter__(self) -> _ClosingBody:
        return self

    def __next__(self) -> Any:
        return next(self._body)

    def close(self) -> None:
        try:
            close = getattr(self._body, "close", None)
            if close is not None:
                close()
        finally:
            self._closed()


# -- busy responses -----------------------------------------------------------


class BusyConflict(Conflict):
    """A busy lock, as the HTTP error the app's handlers for 409 (or
    ``HTTPException``, or ``Exception``) receive; ``lock_error`` is the
    :class:`~dblock.LockNotAcquired` it stands for."""

    lock_error: LockNotAcquired


class BusyLocked(Locked):
    """The same with ``DBLOCK_BUSY_STATUS = 423``."""

    lock_error: LockNotAcquired


def _handles_busy(app: Flask) -> bool:
    """Whether the app registered its own handler for every busy lock already
    (one for LockBusy or LockTimeout alone wins over ours by being nearer in
    the class tree, and leaves the other kind to ours)."""
    return LockNotAcquired in app.error_handler_spec.get(None, {}).get(None, {})


def _busy_response(exc: LockNotAcquired) -> Any:
    """The extension's handler for a busy lock. Flask picks it before the
    app's handler for ``DBLockError`` (it is nearer in the class tree), so it
    hands over to that one; otherwise the busy lock goes on as a 409/423 HTTP
    error through the app's handlers for that status, ``HTTPException`` or
    ``Exception``; with none, the body negotiated with the client."""
    app: Flask = _the_app()
    log_busy(exc, f"{request.method} {request.path}")
    mine = app.error_handler_spec.get(None, {}).get(None, {}).get(DBLockError)
    if mine is not None:
        return app.ensure_sync(mine)(exc)
    status = state_of(app).settings.busy_status
    body, content_type = busy_body(
        exc, status, negotiate(request.headers.get("Accept"), request.content_type)
    )
    error = (BusyConflict if status == 409 else BusyLocked)(
        description=busy_message(exc),
        response=Response(body, status=status, content_type=content_type),
    )
    error.lock_error = exc
    error.__cause__ = exc
    handled = app.handle_http_exception(error)
    return error.get_response() if handled is error else handled


# -- the in-app sweeper -------------------------------------------------------


def _start_sweeper(state: _State) -> _admin.Sweeper:
    with state.lock:
        pid = os.getpid()
        if state.sweeper is None or state.sweeper_pid != pid:
            # After a fork the parent's scheduler thread is gone: start anew.
            state.sweeper = _admin.Sweeper(
                state.manager,
                interval=state.settings.sweeper_interval,
                max_age=state.settings.sweeper_max_age,
            ).start()
            state.sweeper_pid = pid
        return state.sweeper


def _the_app() -> Flask:
    """The app itself behind ``current_app`` (a proxy): Flask's documented
    ``_get_current_object()``, read here only."""
    app: Flask = current_app._get_current_object()  # type: ignore[attr-defined]
    return app


def _start_sweeper_once() -> None:
    state = state_of(_the_app())
    if state.sweeper is None or state.sweeper_pid != os.getpid():
        _start_sweeper(state)


# -- flask dblock ... ----------------------------------------------------------

cli = AppGroup(
    "dblock",
    help="dblock's lock table: migrate, sweep, list, stats, top, release; run a job, "
    "and its record (jobs).",
)


def _manager() -> LockManager:
    return state_of(_the_app()).manager


def _run(action: Callable[[], str | None]) -> None:
    try:
        output = action()
    except LockArgumentError as exc:
        raise click.UsageError(str(exc)) from exc
    except DBLockError as exc:
        raise click.ClickException(str(exc)) from exc
    if output:
        click.echo(output)


@cli.command("migrate")
@click.option("--sql", is_flag=True, help="Print the DDL for a DBA instead of running it.")
def migrate_command(sql: bool) -> None:
    """Create or upgrade the lock table (dblock's alembic migrations)."""

    def run() -> str | None:
        manager = _manager()
        if sql:
            migrations.upgrade_sql(manager.engine.url, manager.names, sys.stdout)
            return None
        before = migrations.current(manager.engine, manager.names)
        manager.create_schema()
        after = migrations.current(manager.engine, manager.names)
        table = manager.names.table
        if before == after:
            return f"{table} on {manager.url} is up to date (revision {after})"
        return f"migrated {table} on {manager.url}: {before or 'empty'} -> {after}"

    _run(run)


@cli.command("sweep")
@click.option(
    "--max-age", type=float, default=None, help="Also delete rows held longer than this (s)."
)
def sweep_command(max_age: float | None) -> None:
    """Delete rows whose lease ended (and, with --max-age, rows held too long)."""
    _run(lambda: _admin.sweep_report(_manager(), max_age=max_age))


@cli.command("list")
@click.option("--prefix", default=None, help="Only keys starting with this.")
@click.option("--json", "as_json", is_flag=True, help="A JSON array, as `dblock list --json`.")
def list_command(prefix: str | None, as_json: bool) -> None:
    """Show the locks held now."""
    _run(lambda: _admin.list_report(_manager(), prefix=prefix, as_json=as_json))


@cli.command("release")
@click.argument("key", required=False)
@click.option("--prefix", default=None, help="Every row whose key starts with this.")
@click.option(
    "--owner",
    default=None,
    help="Every row held by this owner: exactly, or every thread under HOST:PID, "
    "or every process under HOST.",
)
@click.option("--force", is_flag=True, help="Required: delete the rows whoever holds them.")
def release_command(key: str | None, prefix: str | None, owner: str | None, force: bool) -> None:
    """Force-release KEY (or every row matching --prefix and/or --owner):
    delete the rows whoever holds them.

    The holders are not told and go on without mutual exclusion; use this
    only for locks whose holders are known to be gone.
    """
    _run(lambda: _admin.release_report(_manager(), key, force=force, prefix=prefix, owner=owner))


#: The commands ``flask dblock`` runs as the shell's ``dblock`` runs them (its
#: parser, output and exit statuses), on the app's database and table.
SHELL_COMMANDS = {
    "jobs": "The record of job runs (as `dblock jobs`; --help for its options).",
    "stats": "Rows held, expired, the oldest, who leads each role (as `dblock stats`).",
    "top": "The rows refreshing in the terminal (as `dblock top`; needs rich).",
}


def _shell_command(name: str, help_text: str) -> click.Command:
    @click.command(
        name,
        help=help_text,
        context_settings={"ignore_unknown_options": True, "help_option_names": []},
    )
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    def command(args: tuple[str, ...]) -> None:
        from .. import cli as shell

        manager = _manager()
        face = shell.Face(url=manager.engine.url, table=manager.config.table)
        status = shell.main([name, *args], face=face)
        if status:
            raise SystemExit(status)

    return command


for _name, _help in SHELL_COMMANDS.items():
    cli.add_command(_shell_command(_name, _help))


def _durations(ctx: click.Context, param: click.Parameter, value: str | None) -> float | None:
    if value is None:
        return None
    try:
        return _jobrun.duration(value)
    except DBLockError as exc:
        raise click.BadParameter(str(exc)) from None


@cli.command("run", context_settings={"ignore_unknown_options": True})
@click.argument("name")
@click.option("--at-most", callback=_durations, default=None, help=_jobrun.HELP["at_most"])
@click.option("--at-least", callback=_durations, default="0", help=_jobrun.HELP["at_least"])
@click.option("--fire-time", default=None, help=_jobrun.HELP["fire_time"])
@click.option("--per", callback=_durations, default=None, help=_jobrun.HELP["per"])
@click.option("--retry-failed", is_flag=True, help=_jobrun.HELP["retry_failed"])
@click.option("--wait", callback=_durations, default=None, help=_jobrun.HELP["wait"])
@click.option(
    "--skip-status",
    type=click.IntRange(0, 255),
    default=_jobrun.SKIP_STATUS,
    help=_jobrun.HELP["skip_status"],
)
@click.option("-q", "--quiet", is_flag=True, help=_jobrun.HELP["quiet"])
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def run_command(name: str, command: tuple[str, ...], **options: Any) -> None:
    """Run a flask command once across the hosts: NAME is the job's name;
    the command and its arguments follow --, e.g.
    ``flask dblock run nightly --per 1d --at-most 30m -- purge --days 30``.
    The others skip (exit status 75, as dblock run, unless --skip-status)."""
    if not command:
        raise click.UsageError("give the command to run after --")
    root = click.get_current_context().find_root()
    group = root.command
    target = group.get_command(root, command[0]) if isinstance(group, click.Group) else None
    if target is None:
        raise click.UsageError(f"no such command: {command[0]!r}")

    def invoke() -> None:
        # The command runs in this process and app context, as if called
        # as ``flask COMMAND ARGS``: its own parser, its own exit status.
        with target.make_context(command[0], list(command[1:]), parent=root) as ctx:
            target.invoke(ctx)

    status = 0

    def run() -> str | None:
        nonlocal status
        status = _jobrun.run_command(_manager(), name, _jobrun.RunOptions(**options), invoke, _say)
        return None

    _run(run)
    if status:
        raise SystemExit(status)


def _say(text: str) -> None:
    click.echo(text, err=True)
