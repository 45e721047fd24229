"""Errors: bad input is refused before any SQL; database faults are clear."""

from __future__ import annotations

import math

import pytest
import sqlalchemy as sa

import dblock
from dblock import (
    AuthenticationFailed,
    BackendError,
    ConnectionLost,
    DatabaseUnreachable,
    DBLockError,
    LockArgumentError,
    LockBusy,
    LockLost,
    LockManager,
    LockNotAcquired,
    LockTimeout,
    PoolExhausted,
    SchemaMissing,
)
from tests.support.counting import StatementCounter

BAD_KEYS = [
    pytest.param("", "must not be empty", id="empty"),
    pytest.param(None, "must be a str", id="none"),
    pytest.param(42, "must be a str", id="int"),
    pytest.param(b"user:1", "must be a str", id="bytes"),
    pytest.param("x" * 256, "limit is 255", id="too-long"),
    pytest.param("a\x00b", "NUL", id="nul"),
]

BAD_OPTIONS = [
    pytest.param({"ttl": 0}, "ttl", id="ttl-zero"),
    pytest.param({"ttl": -1}, "ttl", id="ttl-negative"),
    pytest.param({"ttl": math.nan}, "ttl", id="ttl-nan"),
    pytest.param({"ttl": math.inf}, "ttl", id="ttl-inf"),
    pytest.param({"ttl": "30"}, "ttl", id="ttl-string"),
    pytest.param({"ttl": True}, "ttl", id="ttl-bool"),
    pytest.param({"timeout": -0.1}, "timeout", id="timeout-negative"),
    pytest.param({"timeout": math.nan}, "timeout", id="timeout-nan"),
    pytest.param({"timeout": "1"}, "timeout", id="timeout-string"),
    pytest.param({"blocking": "yes"}, "blocking", id="blocking-string"),
]


def test_error_tree() -> None:
    assert issubclass(LockBusy, LockNotAcquired)
    assert issubclass(LockTimeout, LockNotAcquired)
    for cls in (LockNotAcquired, LockLost, LockArgumentError, BackendError, SchemaMissing):
        assert issubclass(cls, DBLockError)
    assert issubclass(LockArgumentError, ValueError)
    assert LockBusy.__module__ == "dblock"
    assert all(hasattr(dblock, name) for name in dblock.errors.__all__)
    assert issubclass(AuthenticationFailed, DatabaseUnreachable)
    assert issubclass(PoolExhausted, DatabaseUnreachable)
    assert issubclass(DatabaseUnreachable, BackendError)
    assert issubclass(ConnectionLost, BackendError)


def test_every_error_is_named_as_users_import_it() -> None:
    # A traceback shows `dblock.X`, never a private module's path.
    import dblock._store.base as base

    for name in dblock.errors.__all__:
        cls = getattr(dblock.errors, name)
        assert cls.__module__ == "dblock", name
        assert getattr(dblock, name) is cls
    assert base.Unreachable is DatabaseUnreachable
    assert base.Interrupted is ConnectionLost


@pytest.mark.parametrize(("bad", "message"), BAD_KEYS)
def test_bad_keys_refused_before_sql(manager: LockManager, bad: object, message: str) -> None:
    with StatementCounter(manager.engine) as c:
        with pytest.raises(LockArgumentError, match=message):
            manager.lock(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=message):
            manager.acquire(bad, blocking=False)  # type: ignore[arg-type]
    assert c.count == 0


@pytest.mark.parametrize(("options", "name"), BAD_OPTIONS)
def test_bad_options_refused_before_sql(
    manager: LockManager, key: str, options: dict[str, object], name: str
) -> None:
    with StatementCounter(manager.engine) as c:
        with pytest.raises(LockArgumentError, match=name):
            manager.lock(key, **options)  # type: ignore[arg-type]
        with pytest.raises(LockArgumentError, match=name):
            manager.locked(key + "{x}", **options)  # type: ignore[arg-type]
    assert c.count == 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        pytest.param({"ttl": 0}, "ttl", id="ttl"),
        pytest.param({"timeout": -1}, "timeout", id="timeout"),
        pytest.param({"tll": 5}, r"unknown option 'tll' \(did you mean 'ttl'\?\)", id="typo"),
        pytest.param({"table": "locks; drop"}, "table", id="table"),
        pytest.param({"handoff_limit": -1}, "handoff_limit", id="handoff"),
        pytest.param({"poll_initial": 2, "poll_max": 1}, "poll_initial", id="poll"),
    ],
)
def test_bad_manager_options(tmp_path: object, options: dict[str, object], message: str) -> None:
    with pytest.raises(LockArgumentError, match=message):
        LockManager(f"sqlite:///{tmp_path}/x.sqlite3", **options)


def test_unsupported_urls() -> None:
    with pytest.raises(LockArgumentError, match="in-memory"):
        LockManager("sqlite://")
    with pytest.raises(LockArgumentError, match="not a database URL"):
        LockManager("no such thing")
    with pytest.raises(LockArgumentError, match="oracle"):
        LockManager("oracle://scott:tiger@localhost/x")


def test_template_naming_missing_argument_fails_at_decoration(manager: LockManager) -> None:
    with pytest.raises(LockArgumentError, match=r"'user'.*not a parameter"):

        @manager.locked("user:{user}")
        def work(user_id: int) -> None: ...

    with pytest.raises(LockArgumentError, match="positions"):

        @manager.locked("user:{0}")
        def work2(user_id: int) -> None: ...


def test_template_producing_bad_key_fails_before_sql(manager: LockManager) -> None:
    @manager.locked("{name}")
    def work(name: str) -> None: ...

    with StatementCounter(manager.engine) as c, pytest.raises(LockArgumentError, match="empty"):
        work("")
    assert c.count == 0


def test_missing_schema_says_run_migrate(db_url: str, key: str) -> None:
    with LockManager(db_url, table="dblock_never_created") as m:
        with pytest.raises(SchemaMissing, match="dblock migrate") as info:
            m.acquire(key)
        assert "dblock_never_created" in str(info.value)
        assert "dblock migrate --table dblock_never_created" in str(info.value)
        assert len(m._locker.registry) == 0


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://nobody:secret@127.0.0.1:1/x",
        "mysql+pymysql://nobody:secret@127.0.0.1:1/x",
    ],
    ids=["postgresql", "mysql"],
)
def test_unreachable_database_is_a_backend_error(url: str, key: str) -> None:
    # A port nothing listens on: refused at once.
    with LockManager(url) as m:
        with pytest.raises(DatabaseUnreachable) as info:
            m.acquire(key)
        assert type(info.value) is DatabaseUnreachable  # not mistaken for a refused login
        assert "cannot connect" in str(info.value)
        assert "secret" not in str(info.value)
        assert "***" in str(info.value)
        assert len(m._locker.registry) == 0  # no half-state left behind


def test_engine_is_borrowed_not_disposed(db_url: str, key: str) -> None:
    engine = sa.create_engine(db_url)
    with LockManager(engine) as m, m.lock(key):
        pass
    with engine.connect() as conn:  # still usable
        conn.execute(sa.text("SELECT 1"))
    engine.dispose()


def test_closed_manager_refuses(manager: LockManager, key: str) -> None:
    manager.close()
    with pytest.raises(DBLockError, match="closed"):
        manager.lock(key)


# -- a refused login is told apart from a server that does not answer ----------


def _login_as(db_url: str, **parts: str) -> str:
    return sa.make_url(db_url).set(**parts).render_as_string(hide_password=False)  # type: ignore[arg-type]


@pytest.mark.databases("mariadb")
def test_wrong_password_is_authentication_failed(db_url: str, key: str) -> None:
    url = _login_as(db_url, password="wrong-s3cret")
    with LockManager(url) as m:
        with pytest.raises(AuthenticationFailed) as info:
            m.acquire(key)
        message = str(info.value)
        assert "wrong-s3cret" not in message
        assert ":***@" in message
        assert "Access denied for user" in message  # the server's reason
        assert "error 1045" in message
        assert len(m._locker.registry) == 0


@pytest.mark.databases("mariadb")
def test_unknown_user_is_authentication_failed(db_url: str, key: str) -> None:
    url = _login_as(db_url, username="dblock_nosuchuser", password="pw")
    with LockManager(url) as m, pytest.raises(AuthenticationFailed, match="dblock_nosuchuser"):
        m.acquire(key)


@pytest.mark.databases("postgresql")
def test_unknown_role_is_authentication_failed(db_url: str, key: str) -> None:
    url = _login_as(db_url, username="dblock_nosuchrole", password="pw-s3cret")
    with LockManager(url) as m, pytest.raises(AuthenticationFailed) as info:
        m.acquire(key)
    assert 'role "dblock_nosuchrole" does not exist' in str(info.value)
    assert "pw-s3cret" not in str(info.value)


@pytest.mark.databases("postgresql")
def test_role_not_permitted_to_log_in_is_authentication_failed(db_url: str, key: str) -> None:
    # The server here trusts 127.0.0.1, so a wrong password is not refused; a
    # NOLOGIN role is, with the same class of SQLSTATE (28000).
    role = f"dblock_nologin_{key[-8:]}".lower()
    admin = sa.create_engine(db_url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE ROLE "{role}" NOLOGIN')
    try:
        url = _login_as(db_url, username=role)
        with LockManager(url) as m, pytest.raises(AuthenticationFailed, match="not permitted"):
            m.acquire(key)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP ROLE "{role}"')
        admin.dispose()


@pytest.mark.databases("postgresql", "mariadb")
@pytest.mark.parametrize("which", [0, 1], ids=["driver0", "driver1"])
def test_async_refused_login_is_authentication_failed(
    db: str, db_url: str, key: str, which: int
) -> None:
    """On each asyncio driver of the database (psycopg and asyncpg, aiomysql
    and asyncmy: see tests/support/db.py)."""
    import asyncio

    from dblock import AsyncLockManager
    from tests.support.db import driver_form

    user = "dblock_nosuchrole" if db == "postgresql" else "root"
    url, _ = driver_form(db, _login_as(db_url, username=user, password="wrong-s3cret"), which)

    async def main() -> None:
        async with AsyncLockManager(url) as alocks:
            with pytest.raises(AuthenticationFailed) as info:
                await alocks.acquire(key)
            assert "wrong-s3cret" not in str(info.value)

    asyncio.run(main())


def test_a_mistyped_option_is_refused_by_every_request_of_both_faces(
    manager: LockManager, key: str
) -> None:
    """The options are one TypedDict for both faces (dblock.options): a name
    that is not one of them is refused before any SQL, naming it, wherever
    it is given (a TypedDict checks nothing at run time by itself)."""
    from dblock import AsyncLockManager

    alocks = AsyncLockManager(manager)
    requests = [
        lambda: manager.lock(key, tmeout=1),
        lambda: manager.acquire(key, tmeout=1),
        lambda: manager.semaphore(key, permits=2, tmeout=1),
        lambda: manager.read_lock(key, tmeout=1),
        lambda: manager.write_lock(key, tmeout=1),
        lambda: manager.lock_many([key], tmeout=1),
        lambda: manager.locked(key, tmeout=1),
        lambda: alocks.lock(key, tmeout=1),
        lambda: alocks.semaphore(key, permits=2, tmeout=1),
        lambda: alocks.lock_many([key], tmeout=1),
        lambda: alocks.locked(key, tmeout=1),
    ]
    with StatementCounter(manager.engine) as c:
        for request in requests:
            with pytest.raises(LockArgumentError, match="unknown option 'tmeout'"):
                request()
    assert c.count == 0
