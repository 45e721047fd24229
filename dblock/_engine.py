"""Making the engine dblock runs its statements on.

Given a URL, dblock makes its own small engine in AUTOCOMMIT with no reset on
return to the pool: every lock statement is a transaction of its own, so a
pooled connection never holds anything to roll back. Given an Engine, dblock
uses it as it is (through an AUTOCOMMIT view of it) and never disposes it.

The web integrations find an application's engine without being handed it,
so they never share its pool (a request holding one of its connections would
wait for a second one to take a lock): :func:`borrow` gives the URL and
options of an engine of dblock's own that connects the way the application's
does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from sqlalchemy import URL, create_engine, event, make_url
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import ArgumentError

from ._signals import unshielded
from .errors import LockArgumentError, install_hint

__all__ = [
    "DEFAULT_URL",
    "Dialect",
    "async_driver",
    "blocking_url",
    "borrow",
    "check_engine_options",
    "check_url",
    "dialect_of",
    "file_database",
    "is_async_engine",
    "make_engine",
    "mask",
    "mask_text",
    "resolve_url",
]

DEFAULT_URL = "sqlite:///dblock.sqlite3"
ENV_URL = "DBLOCK_URL"

_DRIVERS = {"postgresql": "psycopg", "mysql": "pymysql", "mariadb": "pymysql"}

#: The databases dblock speaks, and the DBAPI drivers it speaks them through.
#: psycopg2 so that an application on it can share its engine (or its URL):
#: everything but the asyncio face, which runs on psycopg 3 (psycopg2 has no
#: asyncio connection).
SUPPORTED: dict[str, tuple[str, ...]] = {
    "postgresql": ("psycopg", "psycopg2"),
    "mysql": ("pymysql", "mysqldb"),
    "mariadb": ("pymysql", "mysqldb"),
    "sqlite": ("pysqlite",),
}
_EXTRAS = {"postgresql": "postgresql", "mysql": "mysql", "mariadb": "mysql"}


class AsyncForm(NamedTuple):
    """An asyncio driver's URL form, as ``AsyncLockManager`` speaks it."""

    #: The blocking driver of the same database its blocking side speaks
    #: (its tasks' statements go through the asyncio one).
    blocking: str
    #: The asyncio driver's name in dblock's own async engine's URL.
    driver: str
    #: The extra that installs it.
    extra: str


#: The asyncio drivers' URL forms ``AsyncLockManager`` takes, by (dialect,
#: SQLAlchemy's name for the driver): the one table of them.
ASYNC_FORMS: dict[tuple[str, str], AsyncForm] = {
    ("postgresql", "psycopg_async"): AsyncForm("psycopg", "psycopg", "postgresql-async"),
    ("postgresql", "asyncpg"): AsyncForm("psycopg", "asyncpg", "postgresql-asyncpg"),
    ("mysql", "aiomysql"): AsyncForm("pymysql", "aiomysql", "mysql-async"),
    ("mariadb", "aiomysql"): AsyncForm("pymysql", "aiomysql", "mysql-async"),
    ("mysql", "asyncmy"): AsyncForm("pymysql", "asyncmy", "mysql-asyncmy"),
    ("mariadb", "asyncmy"): AsyncForm("pymysql", "asyncmy", "mysql-asyncmy"),
    ("sqlite", "aiosqlite"): AsyncForm("pysqlite", "aiosqlite", "sqlite-async"),
}


T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Dialect:
    """What dblock decides by the database it speaks to, decided once.

    The facts a dialect name says are fixed by :func:`dialect_of` from the
    URL (before any engine is made); what only the server can say (MySQL or
    MariaDB, its version, RETURNING, Galera, the AUTO-INC mode) is read by
    the store at its first connection and kept in the copy
    :meth:`connected` makes (``Store.dialect``). Every kind, the engine's
    making and the command line read these flags instead of comparing
    dialect names; the one place that turns a name into flags is the table
    below, and a kind's statements come from its dialect's class through
    :meth:`pick` (``Store.kind_sql``)."""

    #: SQLAlchemy's name for it, as the URL spells it (``mariadb`` stays ``mariadb``).
    name: str
    #: Which store module speaks it (``dblock._store.<family>``): postgresql,
    #: mysql (MySQL and MariaDB alike: one way, whatever the URL's name) or sqlite.
    family: str
    #: One file on this machine (SQLite): no server to share an engine's pool
    #: with, a directory to make, WAL pragmas, and the file's write lock
    #: waited for in slices.
    file: bool
    #: The connection charset asked for when the URL names none (the MySQL
    #: family's utf8mb4: a key or owner of any Unicode text).
    charset: str | None
    #: LISTEN/NOTIFY (PostgreSQL): ``listen_url`` applies, and a release
    #: answers with rows (its NOTIFY's SELECT).
    notifies: bool
    #: The driver may prepare statements on the server (psycopg 3), which a
    #: transaction-mode pooler cannot follow: turned off with ``pooler=True``.
    prepares: bool
    #: The exclusive lock's acquire takes its lease in microseconds
    #: (``ttl_us``: the SQL adds an INTERVAL … MICROSECOND), else in
    #: seconds (``ttl``); see :meth:`lease_params`.
    lease_us: bool
    #: INSERT … RETURNING: known from the name on PostgreSQL and SQLite, from
    #: the server's version on the MySQL family (None until it was read).
    returning: bool | None
    #: A Galera cluster (MariaDB with ``wsrep_on``): None until read.
    galera: bool | None
    #: The server's version string, once read (the MySQL family).
    server_version: str | None = None
    #: InnoDB's ``innodb_autoinc_lock_mode``, once read (the MySQL family).
    autoinc_mode: int | None = None
    #: A granted row's fence is drawn again while the row is ours (InnoDB's
    #: AUTO-INC mode 2 with RETURNING; see dblock._store.mysql).
    redraws_fences: bool = False

    @property
    def known(self) -> bool:
        """Whether what the server says is known (always, but on the MySQL
        family before its first connection)."""
        return self.returning is not None

    def pick(self, *, postgresql: T, mysql: T, sqlite: T) -> T:
        """The one of three that is this dialect's family's (a kind's class
        of statements, a driver's rule): the one way code outside the
        dialect modules chooses by dialect."""
        return {"postgresql": postgresql, "mysql": mysql, "sqlite": sqlite}[self.family]

    def lease_params(self, ttl: float) -> dict[str, Any]:
        """The exclusive acquire's lease parameter for ``ttl`` seconds."""
        return {"ttl_us": round(ttl * 1e6)} if self.lease_us else {"ttl": ttl}

    def connected(self, **server: Any) -> Dialect:
        """This dialect with what its server said at the first connection."""
        return dataclasses.replace(self, **server)


_POSTGRESQL = Dialect(
    "postgresql",
    "postgresql",
    file=False,
    charset=None,
    notifies=True,
    prepares=True,
    lease_us=False,
    returning=True,
    galera=False,
)
_MYSQL = Dialect(
    "mysql",
    "mysql",
    file=False,
    charset="utf8mb4",
    notifies=False,
    prepares=False,
    lease_us=True,
    returning=None,
    galera=None,
)
_SQLITE = Dialect(
    "sqlite",
    "sqlite",
    file=True,
    charset=None,
    notifies=False,
    prepares=False,
    lease_us=False,
    returning=True,
    galera=False,
)
# The one table from a dialect's name to its facts (the drivers: SUPPORTED).
_DIALECTS: dict[str, Dialect] = {
    "postgresql": _POSTGRESQL,
    "mysql": _MYSQL,
    "mariadb": dataclasses.replace(_MYSQL, name="mariadb"),
    "sqlite": _SQLITE,
}


def dialect_of(name: str | URL) -> Dialect:
    """The facts of the dialect ``name`` (or of a URL's), before any
    connection: refused as :func:`check_dialect` refuses an unknown one."""
    if isinstance(name, URL):
        name = name.get_backend_name()
    found = _DIALECTS.get(name)
    if found is None:
        check_dialect(name, "")
        raise AssertionError(name)  # check_dialect raised for every name not here
    return found


def file_database(url: str | URL) -> bool:
    """Whether ``url`` (or a dialect name) is a database in one local file
    (SQLite: see :attr:`Dialect.file`); False for one dblock does not speak,
    which is refused where the URL is used."""
    found = _DIALECTS.get(url if isinstance(url, str) else url.get_backend_name())
    return found is not None and found.file


def check_dialect(dialect: str, driver: str) -> None:
    """Refuse, before any engine is made, a database or driver dblock does not speak."""
    if dialect not in SUPPORTED:
        raise LockArgumentError(
            f"dblock does not support the {dialect!r} database; it supports PostgreSQL "
            "(postgresql://), MySQL/MariaDB (mysql://, mariadb://) and SQLite (sqlite://)"
        )
    drivers = SUPPORTED[dialect]
    if (dialect, driver) in ASYNC_FORMS:
        raise LockArgumentError(
            f"{dialect}+{driver} is an asyncio driver: give this URL to AsyncLockManager, or "
            f"use {dialect}+{ASYNC_FORMS[dialect, driver].blocking}://... with LockManager"
        )
    if driver not in drivers:
        raise LockArgumentError(
            f"dblock speaks {dialect} through {' or '.join(drivers)}, not {driver!r}; "
            f"use a URL like {dialect}+{drivers[0]}://..."
        )


def resolve_url(url: str | URL | None) -> URL:
    """``url``, else ``$DBLOCK_URL``, else the SQLite file ``./dblock.sqlite3``;
    bare ``postgresql://`` and ``mysql://`` get the drivers dblock speaks."""
    raw = url if url is not None else os.environ.get(ENV_URL) or DEFAULT_URL
    try:
        parsed = make_url(raw)
    except (ArgumentError, ValueError) as exc:
        raise LockArgumentError(f"not a database URL: {mask(str(raw))!r} ({exc})") from exc
    if "+" not in parsed.drivername and parsed.drivername in _DRIVERS:
        parsed = parsed.set(drivername=f"{parsed.drivername}+{_DRIVERS[parsed.drivername]}")
    return parsed


def blocking_url(url: URL) -> URL:
    """For ``AsyncLockManager``: ``url`` with an asyncio driver of
    :data:`ASYNC_FORMS` turned into the blocking driver of its database (its
    blocking side's); any other URL as it is."""
    form = ASYNC_FORMS.get((url.get_backend_name(), url.get_driver_name()))
    if form is None:
        return url
    return url.set(drivername=f"{url.get_backend_name()}+{form.blocking}")


def async_driver(url: URL) -> str | None:
    """The asyncio driver ``url`` names, if it is one of :data:`ASYNC_FORMS`
    (SQLAlchemy's name: ``asyncpg``, ``psycopg_async``, ...); else None."""
    if (url.get_backend_name(), url.get_driver_name()) in ASYNC_FORMS:
        return url.get_driver_name()
    return None


def is_async_engine(engine: object) -> bool:
    """Whether ``engine`` is SQLAlchemy's ``AsyncEngine`` (told without
    importing the asyncio extension, which needs greenlet)."""
    kind = type(engine)
    return kind.__name__ == "AsyncEngine" and kind.__module__.startswith("sqlalchemy.ext.asyncio")


# Query parameters whose value is a secret: libpq's password/sslpassword,
# PyMySQL's passwd, ODBC-style pwd, and tokens or keys of any kind.
_SECRET_PARAM = re.compile(r"pass|pwd|secret|token|credential|api_?key", re.IGNORECASE)


def check_url(url: URL) -> None:
    """Refuse a URL naming a database or driver dblock does not speak."""
    backend = url.get_backend_name()
    # Only a known dialect's default driver can be looked up without loading it.
    check_dialect(backend, url.get_driver_name() if backend in SUPPORTED else "")


def mask(url: str | URL) -> str:
    """The URL with its password replaced by ``***``, for anything printed or
    logged: the user-info password and any query parameter that carries one
    (``?password=``, ``?passwd=``, ``?pwd=``, ``?sslpassword=``, ...)."""
    if not isinstance(url, URL):
        try:
            url = make_url(url)
        except (ArgumentError, ValueError):
            return "<unparseable URL>"
    secret = [name for name in url.query if _SECRET_PARAM.search(name)]
    if not secret:
        return url.render_as_string(hide_password=True)
    url = url.update_query_dict(dict.fromkeys(secret, "***"))
    return url.render_as_string(hide_password=True).replace("=%2A%2A%2A", "=***")


def mask_text(text: str) -> str:
    """``text`` with every URL in it (``scheme://...``) masked as by :func:`mask`."""
    return _URL_IN_TEXT.sub(lambda m: mask(m.group(0)), text)


_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]*")


# Options that would make dblock's engine something it must not be.
_REFUSED = {
    "isolation_level": (
        "dblock runs every lock statement in a transaction of its own (AUTOCOMMIT); "
        "another isolation level would leave lock rows uncommitted"
    ),
    "pool": (
        "dblock keeps a pool of its own, so that a lock statement never waits for a "
        "connection the application holds; shape it with poolclass and the pool_* options"
    ),
}
# ... and, when borrowing an application's engine, the ones that say how to
# connect: dblock connects exactly as that engine does.
_BORROWED = ("connect_args", "creator")


def check_engine_options(
    options: Mapping[str, Any] | None, *, name: str = "engine_options", borrowed: bool = False
) -> dict[str, Any]:
    """``options`` for :func:`make_engine`, refused with a message naming
    ``name`` (the setting as the user spelled it) and saying why."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise LockArgumentError(f"{name} must be a dict of create_engine options, got {options!r}")
    for option in options:
        if not isinstance(option, str):
            raise LockArgumentError(f"{name}: option names are strings, got {option!r}")
        if option == "connect_args" and not isinstance(options[option], Mapping):
            raise LockArgumentError(f"{name}['connect_args'] must be a dict")
        if option in _REFUSED:
            raise LockArgumentError(f"{name}[{option!r}] is not allowed: {_REFUSED[option]}")
        if borrowed and option in _BORROWED:
            raise LockArgumentError(
                f"{name}[{option!r}] is not allowed when dblock borrows the application's "
                "engine: dblock connects exactly as that engine does (its URL, connect_args "
                "and creator). Set it on the application's engine, or give dblock a URL of "
                "its own to configure its connections separately"
            )
    return dict(options)


def borrow(
    engine: Engine, options: Mapping[str, Any] | None = None, *, name: str = "engine_options"
) -> tuple[URL, dict[str, Any]]:
    """The URL and :func:`make_engine` options of an engine of dblock's own on
    the database ``engine`` connects to.

    The new engine connects through ``engine``'s pool creator: the same URL,
    driver, ``connect_args``, ``creator`` and ``do_connect`` hooks; it keeps
    ``engine``'s ``pool_pre_ping`` and ``pool_recycle`` (they describe the
    network and the server), and has a pool of its own, sized by ``options``
    (SQLAlchemy's defaults otherwise). On SQLite dblock opens the same file
    with its own connection settings (busy timeout, WAL) instead.
    """
    # The driver spelled out: the connections are that driver's, and a bare
    # postgresql:// must not turn into dblock's default driver on the way.
    url = engine.url.set(drivername=f"{engine.url.get_backend_name()}+{engine.dialect.driver}")
    file = file_database(url)
    kwargs = check_engine_options(options, name=name, borrowed=not file)
    if file:
        return url, kwargs
    return url, {**pool_connects_as(engine.pool), **kwargs}


def make_engine(
    url: URL, options: Mapping[str, Any] | None = None, *, pooler: bool = False
) -> Engine:
    options = check_engine_options(options)
    kwargs: dict[str, Any] = {
        "isolation_level": "AUTOCOMMIT",
        "pool_reset_on_return": None,
    }
    backend = url.get_backend_name()
    check_url(url)
    dialect = dialect_of(backend)
    if dialect.file:
        database = url.database or ""
        if database in ("", ":memory:") or "mode=memory" in str(url):
            raise LockArgumentError(
                "an in-memory SQLite database is private to one connection and cannot hold "
                "locks; use a file, e.g. sqlite:///dblock.sqlite3"
            )
        if not database.startswith("file:"):
            _sqlite_directory(database)
        # The caller's connect_args add to these: without them the lock
        # file would fail at once when busy, or on the renewal thread.
        options["connect_args"] = {
            "timeout": SQLITE_BUSY_TOTAL,
            "check_same_thread": False,
            **(options.get("connect_args") or {}),
        }
    elif dialect.charset is not None and "charset" not in url.query:
        url = url.update_query_dict({"charset": dialect.charset})
    kwargs.update(options)
    try:
        engine = create_engine(url, **kwargs)
    except ImportError as exc:
        if url.get_driver_name() == "psycopg2":
            # No extra of dblock's installs it: an application on psycopg2
            # brings its own (psycopg2 or psycopg2-binary).
            hint = "pip install psycopg2-binary, or use postgresql+psycopg://"
        elif url.get_driver_name() == "mysqldb":
            # mysql+mysqldb:// is mysqlclient, the C driver: its own extra
            # (the mysql extra installs PyMySQL).
            hint = install_hint("mysqlclient")
        else:
            hint = install_hint(_EXTRAS.get(backend, backend))
        raise LockArgumentError(
            f"the driver for {mask(url)} is not installed: {hint} ({exc})"
        ) from exc
    except (ArgumentError, TypeError) as exc:
        raise LockArgumentError(f"cannot make an engine for {mask(url)}: {exc}") from exc
    if dialect.file:
        event.listen(engine, "connect", sqlite_pragmas)
        busy = options["connect_args"].get("timeout", SQLITE_BUSY_TOTAL)
        _sqlite_busy[engine] = float(busy) if isinstance(busy, (int, float)) else SQLITE_BUSY_TOTAL
    if pooler and dialect.prepares and url.get_driver_name() == "psycopg":
        # psycopg2 never prepares a statement: nothing to turn off.
        event.listen(engine, "connect", _never_prepare)
    return engine


def _never_prepare(dbapi_connection: Any, _record: Any) -> None:
    # Behind a transaction-mode pooler each transaction may get another server
    # connection: a statement psycopg prepared on one is missing (or already
    # there) on the next. Set per connection, so that it holds for connections
    # made through a borrowed engine's creator too.
    dbapi_connection.prepare_threshold = None


def _sqlite_directory(database: str) -> None:
    """Make the directory of the SQLite file ``database`` if need be, or say
    in one line what is wrong with the path (before any SQL: a connect would
    only say "unable to open database file")."""
    path = Path(database).expanduser()
    try:
        path = path.resolve()
        if path.is_dir():
            raise LockArgumentError(
                f"the SQLite database {database!r} is a directory; name a file in it, "
                f"e.g. sqlite:///{path / 'dblock.sqlite3'}"
            )
        parent = path.parent
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        # FileExistsError: a file where a directory must be (mkdir's own
        # wording, "File exists", does not say that); anything else as the
        # system says it (no such directory under /proc, permission denied).
        blocker = _not_a_directory(path.parent)
        if blocker is not None:
            why = f"{str(blocker)!r} is a file, not a directory"
        else:
            why = exc.strerror or type(exc).__name__
            where = exc.filename if exc.filename is not None else path.parent
            why = f"{why}: {str(where)!r}"
        raise LockArgumentError(
            f"cannot use the SQLite database {database!r}: its directory cannot be made ({why})"
        ) from exc


def _not_a_directory(directory: Path) -> Path | None:
    """The first existing component of ``directory`` that is not a directory."""
    for ancestor in (*reversed(directory.parents), directory):
        try:
            if ancestor.exists() and not ancestor.is_dir():
                return ancestor
        except OSError:
            return None
    return None


#: SQLite: how long a statement may wait for the database file's write lock
#: in all, by default (pysqlite's ``timeout`` connect argument, which the
#: caller's ``connect_args`` may change). The store waits for it in slices
#: (:data:`SQLITE_BUSY_SLICE_MS`) and decides per statement how many: an
#: acquire that finds the file locked answers "busy" and waits (or not) as
#: the request says, a release gives up sooner (see dblock._store.sqlite).
SQLITE_BUSY_TOTAL = 30.0
#: SQLite: the busy timeout set on each connection once it is open (its
#: pragmas having waited the whole ``timeout``): one statement's wait for
#: the file's write lock, after which SQLite answers "database is locked".
#: SQLite's busy handler ignores ``interrupt()`` and holds a pysqlite
#: statement in C (no signal handler runs), so the wait is cut this fine.
SQLITE_BUSY_SLICE_MS = 10

# The total busy wait of each SQLite engine dblock made (SQLITE_BUSY_TOTAL,
# or the caller's connect_args["timeout"]).
_sqlite_busy: weakref.WeakKeyDictionary[Engine, float] = weakref.WeakKeyDictionary()


def sqlite_busy_total(engine: Engine) -> float | None:
    """How long a statement on the SQLite ``engine`` may wait for the file's
    write lock in all, in slices of :data:`SQLITE_BUSY_SLICE_MS`; None for an
    engine dblock did not make (its connections wait as they were set up to)."""
    return _sqlite_busy.get(engine)


@contextlib.contextmanager
def sqlite_whole_wait(conn: Connection) -> Iterator[None]:
    """Statements on ``conn`` that are not the store's (migrations: no retry
    rule waits for them in slices) wait for the SQLite file's write lock
    for the engine's whole busy timeout, as every statement did before the
    slices; one slice again after (the connection goes back to the pool).
    Nothing on an engine dblock did not make, or not on SQLite."""
    total = sqlite_busy_total(conn.engine)
    if total is None:
        yield
        return
    dbapi_connection = conn.connection.dbapi_connection
    _busy_timeout(dbapi_connection, round(total * 1000))
    try:
        yield
    finally:
        try:
            _busy_timeout(dbapi_connection, SQLITE_BUSY_SLICE_MS)
        except Exception:
            conn.invalidate()  # never back in the pool with the whole wait


def _busy_timeout(dbapi_connection: Any, ms: int) -> None:
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout = {ms}")
    finally:
        cursor.close()


def sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    # WAL lets readers (dblock list, stats) run beside the writer; NORMAL
    # sync is durable against a crash of the process, which is what a
    # single-machine lock file needs. Then each statement's wait for the
    # file's write lock is one slice (see SQLITE_BUSY_SLICE_MS); the
    # pragmas themselves waited the connection's whole timeout.
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_SLICE_MS}")
    finally:
        cursor.close()


# -- SQLAlchemy's and the drivers' internals, read here only ------------------
# dblock reads a few private attributes of other libraries where they offer
# no public way; each is read by one function below, which says why, so an
# upgrade that moves one breaks here, in one place.


def has_events(engine: Engine) -> bool:
    """Whether anything listens for ``engine``'s execution events (statement
    counters, tracing, logging): SQLAlchemy's own test (``_has_events``),
    which has no public name. If the attribute ever goes away: True, the
    observed path, which is always correct."""
    return bool(getattr(engine, "_has_events", True))


def max_overflow(pool: Any) -> int:
    """A ``QueuePool``'s ``max_overflow`` (negative: unbounded), which it
    keeps private (``size()`` and ``timeout()`` are public, this is not);
    -1 for a pool without one."""
    value = getattr(pool, "_max_overflow", -1)
    return value if isinstance(value, int) else -1


def invalidate_in_pool(pool: Any, connection: Any, exc: BaseException) -> None:
    """Like SQLAlchemy on a disconnect (``Pool._invalidate``, its own way to
    recycle every connection older than ``connection``): the others are
    likely dead too, or reach the same standby."""
    pool._invalidate(connection, exc)


def gate_pool_wait(pool: Any, gate: Any) -> None:
    """Make ``gate(get)`` what a ``QueuePool`` calls to hand out a connection
    (its ``_do_get``, where it waits when all are out): dblock's executor
    must count the threads waiting there (see ``Executor._gate``); the pool
    has no public hook for it."""
    get = pool._do_get
    pool._do_get = lambda: gate(get)


def unshield_waits(engine: Engine) -> None:
    """Open windows in dblock's signal shield (:mod:`dblock._signals`) where
    the pool may block: the driver's connect and pre-ping (the dialect's
    ``connect`` and ``do_ping``, which the pool's creator and checkout look
    up on the dialect at each call) and a ``QueuePool``'s wait for a
    connection (its queue's condition). A handler's exception there is an
    error the pool already undoes; held back, a request timeout would wait
    for a connect to a dead host. Outside a shield the wrappers only call
    through. Idempotent, per dialect and per queue."""
    dialect: Any = engine.dialect
    if dialect not in _unshielded:
        _unshielded.add(dialect)
        dialect.connect = functools.partial(unshielded, dialect.connect)
        dialect.do_ping = functools.partial(unshielded, dialect.do_ping)
    queue = pool_queue(engine.pool)
    condition = getattr(queue, "not_empty", None)
    if condition is not None and condition not in _unshielded:
        _unshielded.add(condition)
        condition.wait = functools.partial(unshielded, condition.wait)


_unshielded: weakref.WeakSet[Any] = weakref.WeakSet()


def pool_connects_as(pool: Any) -> dict[str, Any]:
    """The options of a new engine that connects as ``pool`` does (see
    :func:`borrow`): its creator (the URL's driver, ``connect_args``,
    ``creator`` and ``do_connect`` hooks), pre-ping and recycling, which
    a pool keeps private."""
    options: dict[str, Any] = {"creator": pool._creator}
    if getattr(pool, "_pre_ping", False):
        options["pool_pre_ping"] = True
    recycle = getattr(pool, "_recycle", -1)
    if recycle > 0:
        options["pool_recycle"] = recycle
    return options


def unbind_closed_loop(pool: Any) -> None:
    """An async pool's checkout queue (an ``asyncio.Queue`` under its
    ``_pool``, bound by asyncio's mixin to the loop that first waited on it
    in ``_loop``) unbound from its loop if that loop is closed, so that the
    next loop's first wait binds it again: asyncio raises for any other loop,
    and offers no public way to rebind a queue."""
    inner = getattr(pool_queue(pool), "__dict__", {}).get("_queue")
    bound = getattr(inner, "_loop", None)
    if inner is not None and bound is not None and bound.is_closed():
        inner._loop = None


def pool_queue(pool: Any) -> Any:
    """The queue of a pool's idle connection records (``QueuePool._pool``),
    emptied by hand when their event loop is closed; None for a pool
    without one."""
    return getattr(pool, "_pool", None)


def drop_aiomysql_stream(driver: Any) -> bool:
    """An aiomysql connection of a closed event loop: close its socket (the
    transport's ``_sock``) and forget its streams (``_writer``, ``_reader``),
    since its own close schedules on the dead loop. False if ``driver`` is
    not such a connection."""
    writer = getattr(driver, "_writer", None)  # aiomysql's StreamWriter, on the dead loop
    if writer is None:
        return False
    sock = getattr(writer.transport, "_sock", None)
    if sock is not None:
        sock.close()
    driver._writer = driver._reader = None
    return True


def drop_transport(driver: Any) -> bool:
    """An asyncpg or asyncmy connection of a closed event loop: close its
    socket (its asyncio transport's ``_transport._sock``) and forget the
    transport, since closing it schedules on the dead loop. False if
    ``driver`` has no such transport."""
    transport: Any = getattr(driver, "_transport", None)
    sock = getattr(transport, "_sock", None)
    if sock is None:
        return False
    sock.close()
    transport._sock = None
    with contextlib.suppress(AttributeError, TypeError):
        driver._transport = None
    if hasattr(driver, "_aborted"):  # asyncpg's: closed, as its own abort says
        driver._aborted = True
    return True
