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

The extension adds ``flask dblock``: the shell's ``dblock`` commands
(``migrate``, ``list``, ``stats``, ``release``, ``sweep``, ``top``, ``jobs``:
their options, output and exit statuses) on the app's lock table, and
``run`` to run one of the app's flask commands once across the hosts,
turns a :class:`~dblock.LockNotAcquired` escaping a view into a 409 (or 423)
response (through the app's handlers for ``DBLockError``, then for that
status, as the README orders them), and with ``DBLOCK_SWEEPER = True``
sweeps expired rows in the background from the first request of each
process on.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ParamSpec, TypeVar

import click
from flask import Flask, Response, current_app, has_app_context, request
from flask.cli import AppGroup, with_appcontext
from sqlalchemy.engine import Engine
from werkzeug.exceptions import Conflict, Locked
from werkzeug.wrappers import Response as WerkzeugResponse

from .. import decorators
from .._engine import ENV_URL, borrow, check_engine_options, file_database
from ..decorators import KeySpec, OnBusy
from ..deferral import DeferHook, Deferred
from ..errors import DBLockError, LockArgumentError, LockNotAcquired
from ..lock import UNSET, HeldLock, Unset
from ..manager import LockManager, LockRequest
from ..multi import HeldLocks
from ..sessions import session_hook
from . import _admin
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
    help="The shell's dblock commands on the app's lock table (each one's --help: the "
    "options of the shell's); run runs a flask command once across the hosts.",
)


def _manager() -> LockManager:
    return state_of(_the_app()).manager


_ARGV = "dblock.argv"


class _Untouched(click.Command):
    """A command whose words are kept as given, ``--`` included, for the
    shell's parser (``ctx.meta["dblock.argv"]``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[_ARGV] = tuple(args)
        return super().parse_args(ctx, args)


def _shell_command(name: str, help_text: str) -> click.Command:
    """``flask dblock NAME ARGS``: ``dblock NAME ARGS`` (its parser, output
    and exit statuses) on the app's database, table and index (``run``: the
    command after ``--`` is one of the app's flask commands, run in this
    process and app context)."""

    @click.command(
        name,
        cls=_Untouched,
        help=help_text,
        short_help=help_text.partition(" (e.g. ")[0],
        context_settings={"ignore_unknown_options": True, "help_option_names": []},
    )
    @click.argument("args", nargs=-1, type=click.UNPROCESSED)
    @with_appcontext
    def command(args: tuple[str, ...]) -> None:
        from .. import cli as shell

        ctx = click.get_current_context()
        args = ctx.meta[_ARGV]  # (click drops a --: run's command follows it)
        manager = _manager()
        face = shell.Face(
            url=manager.engine.url,
            table=manager.names.table,
            index=manager.names.index,
            prog=ctx.command_path,
            run=_flask_command(ctx.find_root()) if name == "run" else None,
        )
        status = shell.main([name, *args], face=face)
        if status:
            raise SystemExit(status)

    return command


def _flask_command(root: click.Context) -> Callable[[list[str]], Callable[[], int]]:
    """What ``flask dblock run`` runs after ``--``: a command of the app's
    ``flask`` (in this process and app context), as ``flask COMMAND ARGS``
    would run it: its own parser, messages and exit status."""

    def find(argv: list[str]) -> Callable[[], int]:
        from ..runner import EX_NOTFOUND, CommandError

        group = root.command
        name, args = argv[0], argv[1:]
        target = group.get_command(root, name) if isinstance(group, click.Group) else None
        if target is None:
            raise CommandError(f"no such flask command: {name!r}", EX_NOTFOUND)

        def invoke() -> int:
            try:
                with target.make_context(name, list(args), parent=root) as ctx:
                    target.invoke(ctx)
            except click.exceptions.Exit as exc:
                return exc.exit_code
            except click.ClickException as exc:
                exc.show()
                return exc.exit_code
            except click.Abort:
                click.echo("Aborted!", err=True)
                return 1
            except SystemExit as exc:
                code = exc.code
                if code is None or isinstance(code, int):
                    return code or 0
                click.echo(code, err=True)
                return 1
            return 0

        return invoke

    return find


def _shell_help() -> dict[str, str]:
    from .. import cli as shell

    every = shell.command_help()
    return {name: every[name] for name in shell.FACE_COMMANDS}


#: ``flask dblock``'s commands: the shell's, each with its one line of help
#: (``run`` runs one of the app's flask commands, not a program).
_HELP = {
    **_shell_help(),
    "run": "run a flask command once across the hosts, as the shell's run runs a program "
    "(e.g. `flask dblock run nightly --per 1d --at-most 30m -- purge --days 30`)",
}

for _name, _help in _HELP.items():
    cli.add_command(_shell_command(_name, _help))
