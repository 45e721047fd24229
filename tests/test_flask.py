"""dblock.contrib.flask and the example app in examples/flask_app: the test
client, the `flask dblock` commands, busy responses, configuration, and real
concurrent HTTP requests against two running server processes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import sqlalchemy as sa
from flask import Flask, jsonify
from flask_sqlalchemy import SQLAlchemy
from werkzeug.exceptions import HTTPException

from dblock import (
    DBLockError,
    LockArgumentError,
    LockBusy,
    LockManager,
    LockNotAcquired,
    LockTimeout,
)
from dblock._engine import SQLITE_BUSY_SLICE_MS, sqlite_busy_total
from dblock.contrib._beside import beside
from dblock.contrib.flask import DBLock
from dblock.schema import HEAD_REVISION
from tests.support import ledger, web
from tests.support.db import private_database
from tests.support.owners import OTHERS, held_keys, hold_rows

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "flask_app"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dblock_flask_example", EXAMPLE / "app.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


example = load_example()


@pytest.fixture
def private_url(db: str, tmp_path: Path) -> Iterator[str]:
    with private_database(db, tmp_path) as url:
        yield url


@pytest.fixture
def app(private_url: str) -> Iterator[Flask]:
    """The example app on a database of its own, set up with its commands."""
    app = example.create_app({"SQLALCHEMY_DATABASE_URI": private_url, "TESTING": True})
    runner = app.test_cli_runner()
    result = runner.invoke(args=["init-db"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(args=["dblock", "migrate"])
    assert result.exit_code == 0, result.output
    assert "migrated dblock_locks" in result.output
    yield app
    with app.app_context():
        example.db.engine.dispose()
    app.extensions["dblock"].manager.close()


@pytest.fixture
def ledger_path(tmp_path: Path) -> Iterator[Path]:
    """The example's critical section watched in this process (and in the
    servers started with ``$DBLOCK_TEST_LEDGER``): tests/support/ledger.py."""
    path = tmp_path / "ledger"
    ledger.watch(example, path)
    yield path
    ledger.unwatch(example)


def other_manager(app: Flask) -> LockManager:
    """Another process's view of the same lock table (its own registry)."""
    return LockManager(app.extensions["dblock"].manager.engine.url)


# -- the example through the test client ---------------------------------------


def test_withdraw_through_the_test_client(app: Flask, ledger_path: Path) -> None:
    client = app.test_client()
    assert client.post("/users/1/withdraw", json={"amount": 5}).get_json() == {
        "user_id": 1,
        "balance": 995,
    }
    too_much = client.post("/users/1/withdraw", json={"amount": 5000})
    assert too_much.status_code == 400
    assert client.get("/users/1/balance").get_json()["balance"] == 995
    assert client.get("/users/9/balance").status_code == 404  # as in every example
    assert client.post("/users/9/withdraw", json={"amount": 5}).status_code == 404
    rows = ledger.rows(ledger_path)
    assert [r[2] for r in rows] == ["enter", "exit"]  # the refused one paid nothing
    assert web.ledger_problems(rows) == []


def test_busy_lock_becomes_409_json_or_text(app: Flask) -> None:
    client = app.test_client()
    with other_manager(app) as other, other.lock("user:1"):
        as_json = client.get("/users/1/balance", headers={"Accept": "application/json"})
        as_text = client.get("/users/1/balance", headers={"Accept": "text/html,*/*;q=0.8"})
        other_user = client.get("/users/2/balance")
    assert as_json.status_code == 409
    assert as_json.content_type == "application/json"
    assert as_json.get_json() == {
        "error": "locked",
        "status": 409,
        "message": "Another request holds the lock for this resource. Try again shortly.",
        "retryable": True,
    }
    assert as_text.status_code == 409
    assert as_text.content_type.startswith("text/plain")
    assert as_text.get_data(as_text=True).startswith("409 Conflict: Another request holds")
    assert "user:1" not in as_text.get_data(as_text=True)  # keys are not for clients
    assert other_user.status_code == 200
    assert client.get("/users/1/balance").status_code == 200  # released


@pytest.mark.databases("sqlite")
def test_waiting_request_that_times_out_is_409(app: Flask) -> None:
    @app.get("/slow/<int:user_id>")
    @example.dblock.locked("user:{user_id}", timeout=0.2)
    def slow(user_id: int) -> str:
        return "ok"

    with other_manager(app) as other, other.lock("user:1"):
        response = app.test_client().get("/slow/1", headers={"Accept": "application/json"})
    assert response.status_code == 409
    assert "longer than 0.2 s" in response.get_json()["message"]


@pytest.mark.databases("sqlite")
def test_busy_status_423_and_busy_response_off(private_url: str) -> None:
    for config, expected in (({"DBLOCK_BUSY_STATUS": 423}, 423), ({}, 409)):
        app = example.create_app({"SQLALCHEMY_DATABASE_URI": private_url, **config})
        app.test_cli_runner().invoke(args=["dblock", "migrate"])
        with other_manager(app) as other, other.lock("user:1"):
            response = app.test_client().get("/users/1/balance")
        assert response.status_code == expected
        if expected == 423:
            assert response.get_data(as_text=True).startswith("423 Locked:")

    app = example.create_app(
        {"SQLALCHEMY_DATABASE_URI": private_url, "DBLOCK_BUSY_RESPONSE": False, "TESTING": True}
    )
    with other_manager(app) as other, other.lock("user:1"), pytest.raises(LockBusy):
        app.test_client().get("/users/1/balance")


@pytest.mark.databases("sqlite")
@pytest.mark.parametrize("when", ["before", "after"])
def test_app_handler_wins(private_url: str, when: str) -> None:
    """An app that handles a busy lock itself keeps its own handler, whether
    it registered it before or after init_app."""
    app = Flask(__name__)
    app.config["DBLOCK_URL"] = private_url
    ext = DBLock()

    def mine(exc: LockNotAcquired) -> tuple[Any, int]:
        return jsonify(mine=True), 429

    if when == "before":
        app.register_error_handler(LockBusy, mine)
    ext.init_app(app)
    if when == "after":
        app.register_error_handler(LockNotAcquired, mine)

    @app.get("/x")
    @ext.locked(lambda: "x", blocking=False)
    def view() -> str:
        return "ok"

    with app.app_context():
        ext.manager.create_schema()
    with LockManager(private_url) as other, other.lock("x"):
        response = app.test_client().get("/x")
    assert (response.status_code, response.get_json()) == (429, {"mine": True})
    app.extensions["dblock"].manager.close()


def test_busy_lock_answers_problem_json(app: Flask) -> None:
    """Clients that accept anything, or problem+json, get RFC 9457's body;
    plain-text clients keep the text body."""
    client = app.test_client()
    with other_manager(app) as other, other.lock("user:1"):
        answers = {
            accept: client.get("/users/1/balance", headers={"Accept": accept})
            for accept in ("*/*", "application/problem+json", "text/plain")
        }
    for accept in ("*/*", "application/problem+json"):
        response = answers[accept]
        assert response.status_code == 409
        assert response.content_type == "application/problem+json"
        assert json.loads(response.get_data(as_text=True)) == {
            "type": "about:blank",
            "title": "Conflict",
            "status": 409,
            "detail": "Another request holds the lock for this resource. Try again shortly.",
        }
    text = answers["text/plain"]
    assert text.content_type.startswith("text/plain")
    assert text.get_data(as_text=True).startswith("409 Conflict: Another request holds")


@pytest.mark.databases("sqlite")
@pytest.mark.parametrize(
    ("registered", "seen"),
    [
        pytest.param(DBLockError, "LockBusy", id="DBLockError"),
        pytest.param(409, "BusyConflict", id="status-409"),
        pytest.param(HTTPException, "BusyConflict", id="HTTPException"),
        pytest.param(Exception, "BusyConflict", id="Exception"),
    ],
)
@pytest.mark.parametrize("when", ["before", "after"])
def test_app_wide_handlers_see_a_busy_lock(
    private_url: str, registered: Any, seen: str, when: str
) -> None:
    """The order, as documented: a handler for a dblock error class gets the
    lock error itself; else the busy lock is a 409 HTTP error (like
    ``abort(409)``) that handlers for 409, HTTPException or Exception get,
    with the lock error as ``lock_error``."""
    app = Flask(__name__)
    app.config["DBLOCK_URL"] = private_url
    ext = DBLock()

    def mine(exc: Exception) -> tuple[Any, int]:
        lock_error = getattr(exc, "lock_error", exc)
        return jsonify(seen=type(exc).__name__, key=lock_error.key), 429

    if when == "before":
        app.register_error_handler(registered, mine)
    ext.init_app(app)
    if when == "after":
        app.register_error_handler(registered, mine)

    @app.get("/x")
    @ext.locked(lambda: "x", blocking=False)
    def view() -> str:
        return "ok"

    with app.app_context():
        ext.manager.create_schema()
    with LockManager(private_url) as other, other.lock("x"):
        response = app.test_client().get("/x")
    assert (response.status_code, response.get_json()) == (429, {"seen": seen, "key": "x"})
    assert app.test_client().get("/x").get_data(as_text=True) == "ok"
    app.extensions["dblock"].manager.close()


@pytest.mark.databases("sqlite")
def test_a_handler_for_one_kind_leaves_the_other_to_the_extension(private_url: str) -> None:
    app = Flask(__name__)
    app.config["DBLOCK_URL"] = private_url
    app.register_error_handler(LockTimeout, lambda e: ("timed out", 503))
    ext = DBLock(app)

    @app.get("/busy")
    @ext.locked(lambda: "x", blocking=False)
    def busy() -> str:
        return "ok"

    @app.get("/wait")
    @ext.locked(lambda: "x", timeout=0.1)
    def wait() -> str:
        return "ok"

    ext.manager.create_schema()
    with LockManager(private_url) as other, other.lock("x"):
        assert app.test_client().get("/wait").status_code == 503
        assert app.test_client().get("/busy").status_code == 409
    ext.manager.close()


@pytest.mark.databases("sqlite")
def test_status_423_goes_to_a_423_handler(private_url: str) -> None:
    app = Flask(__name__)
    app.config.update(DBLOCK_URL=private_url, DBLOCK_BUSY_STATUS=423)
    ext = DBLock(app)
    app.register_error_handler(423, lambda e: (f"mine: {e.description}", 423))

    @app.get("/x")
    @ext.locked(lambda: "x", blocking=False)
    def view() -> str:
        return "ok"

    ext.manager.create_schema()
    with LockManager(private_url) as other, other.lock("x"):
        response = app.test_client().get("/x")
    assert response.status_code == 423
    assert response.get_data(as_text=True).startswith("mine: Another request holds")
    ext.manager.close()


# -- configuration -------------------------------------------------------------


@pytest.mark.databases("sqlite")
def test_config_keys_reach_the_manager(private_url: str) -> None:
    app = Flask(__name__)
    app.config.update(
        DBLOCK_URL=private_url,
        DBLOCK_TABLE="flask_locks",
        DBLOCK_TTL=12,
        DBLOCK_TIMEOUT=3,
        DBLOCK_HANDOFF_LIMIT=0,
        DBLOCK_CLIENT_ID="web-1",
    )
    ext = DBLock(app)
    m = ext.manager  # outside an app context: the app given to DBLock(app)
    assert (m.config.table, m.config.ttl, m.config.timeout) == ("flask_locks", 12.0, 3.0)
    assert (m.config.handoff_limit, m.config.client_id) == (0, "web-1")
    assert m.url == private_url
    m.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        pytest.param({"DBLOCK_TLL": 5}, "unknown dblock setting DBLOCK_TLL", id="typo"),
        pytest.param({"DBLOCK_TTL": -5}, "ttl must be", id="bad-ttl"),
        pytest.param({"DBLOCK_BUSY_STATUS": 500}, "DBLOCK_BUSY_STATUS must be 409 or 423", id="st"),
        pytest.param({"DBLOCK_SWEEPER": "yes"}, "DBLOCK_SWEEPER must be True", id="sweeper"),
        pytest.param({"DBLOCK_USE_SQLALCHEMY": 1}, "DBLOCK_USE_SQLALCHEMY", id="flag"),
        pytest.param({"DBLOCK_URL": "nonsense://"}, "not support the 'nonsense'", id="bad-url"),
    ],
)
def test_bad_config_is_refused_at_init(config: dict[str, Any], message: str) -> None:
    app = Flask(__name__)
    app.config.update(config)
    with pytest.raises(LockArgumentError, match=message):
        DBLock(app)


def _probe(db: str, name: str) -> tuple[dict[str, Any], str | None]:
    """Connect arguments that mark a connection with ``name``, and the SQL
    that reads the mark back."""
    if db == "postgresql":
        return {"application_name": name}, "SELECT current_setting('application_name')"
    if db == "mariadb":
        return {"init_command": f"SET @dblock_probe = '{name}'"}, "SELECT @dblock_probe"
    return {}, None


def test_borrows_connection_settings_not_the_pool(db: str, db_url: str, tmp_path: Path) -> None:
    """dblock connects the way Flask-SQLAlchemy's engine does (URL, driver,
    connect_args, do_connect hooks, pre-ping, recycle) through a pool of its
    own, sized by DBLOCK_ENGINE_OPTIONS."""
    name = f"dblock-{tmp_path.name[-12:]}"
    connect_args, probe = _probe(db, name)
    hooked: list[str] = []

    def make(config: dict[str, Any]) -> tuple[Flask, SQLAlchemy, DBLock]:
        app = Flask(__name__)
        app.config["SQLALCHEMY_DATABASE_URI"] = db_url
        app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {
            "connect_args": connect_args,
            "pool_pre_ping": True,
            "pool_recycle": 600,
        }
        app.config.update(config)
        sqla = SQLAlchemy()
        sqla.init_app(app)
        with app.app_context():
            sa.event.listen(sqla.engine, "do_connect", lambda *a: hooked.append("called"))
        return app, sqla, DBLock(app)

    app, sqla, ext = make({})
    with app.app_context():
        app_engine = sqla.engine
        manager = ext.manager
        assert manager.store.owns_engine
        assert manager.engine is not app_engine
        assert manager.engine.pool is not app_engine.pool
        if db == "sqlite":
            # SQLite has one writer: dblock's rows go in a file beside the app's.
            app_file = Path(app_engine.url.database)
            lock_file = app_file.with_name(f"{app_file.stem}.dblock{app_file.suffix}")
            assert manager.engine.url.database == str(lock_file)
            manager.create_schema()  # `flask dblock migrate` migrates the lock file
        else:
            assert manager.engine.url.database == app_engine.url.database
        assert manager.engine.pool.size() == 5  # type: ignore[attr-defined]
        with manager.lock(f"flask:borrow:{tmp_path.name}") as held:
            assert held.fence > 0
        if probe is not None:
            assert hooked  # the app's do_connect hook made dblock's connection
            assert manager.engine.pool._pre_ping  # type: ignore[attr-defined]
            assert manager.engine.pool._recycle == 600  # type: ignore[attr-defined]
            with manager.engine.connect() as conn:
                assert conn.exec_driver_sql(probe).scalar() == name
    manager.close()

    small, _, small_ext = make({"DBLOCK_ENGINE_OPTIONS": {"pool_size": 1}})
    with small.app_context():
        assert small_ext.manager.engine.pool.size() == 1  # type: ignore[attr-defined]
        small_ext.manager.close()
    for each in (app, small):
        with each.app_context():
            each.extensions["sqlalchemy"].engine.dispose()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        pytest.param(
            {"DBLOCK_ENGINE_OPTIONS": {"no_such_option": 1}}, "'no_such_option'", id="unknown"
        ),
        pytest.param(
            {"DBLOCK_ENGINE_OPTIONS": {"connect_args": {"connect_timeout": 1}}},
            r"DBLOCK_ENGINE_OPTIONS\['connect_args'\] is not allowed when dblock borrows",
            id="connect-args",
        ),
        pytest.param(
            {"DBLOCK_ENGINE_OPTIONS": {"creator": lambda: None}},
            r"DBLOCK_ENGINE_OPTIONS\['creator'\] is not allowed when dblock borrows",
            id="creator",
        ),
        pytest.param(
            {"DBLOCK_ENGINE_OPTIONS": {"isolation_level": "SERIALIZABLE"}},
            r"DBLOCK_ENGINE_OPTIONS\['isolation_level'\] is not allowed: .*AUTOCOMMIT",
            id="isolation",
        ),
        pytest.param(
            {"DBLOCK_ENGINE_OPTIONS": {"pool": sa.pool.NullPool(lambda: None)}},
            r"\['pool'\] is not allowed: dblock keeps a pool of its own",
            id="pool",
        ),
        pytest.param(
            {"DBLOCK_ENGINE_OPTIONS": {"pool_size": "x"}}, "cannot make an engine", id="bad-value"
        ),
    ],
)
@pytest.mark.databases("postgresql", "mariadb")
def test_engine_options_are_checked_at_init_when_borrowing(
    db_url: str, config: dict[str, Any], message: str
) -> None:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = db_url
    app.config.update(config)
    SQLAlchemy(app)
    with pytest.raises(LockArgumentError, match=message):
        DBLock(app)


@pytest.mark.databases("sqlite")
def test_engine_options_with_a_url_of_its_own(private_url: str) -> None:
    """With DBLOCK_URL dblock configures its connections itself: connect_args
    add to dblock's own (SQLite keeps its busy timeout), isolation_level is
    refused, and a manager given to the extension takes no engine settings."""
    app = Flask(__name__)
    app.config["DBLOCK_URL"] = private_url
    app.config["DBLOCK_ENGINE_OPTIONS"] = {"connect_args": {"cached_statements": 7}}
    ext = DBLock(app)
    with ext.manager.engine.connect() as conn:
        # (Each statement waits for the write lock in slices, 30 s in all.)
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == SQLITE_BUSY_SLICE_MS
    assert sqlite_busy_total(ext.manager.engine) == 30.0
    ext.manager.close()

    refused = Flask(__name__)
    refused.config["DBLOCK_URL"] = private_url
    refused.config["DBLOCK_ENGINE_OPTIONS"] = {"isolation_level": "SERIALIZABLE"}
    with pytest.raises(LockArgumentError, match="AUTOCOMMIT"):
        DBLock(refused)

    with LockManager(private_url) as mine:
        given = Flask(__name__)
        given.config["DBLOCK_ENGINE_OPTIONS"] = {"pool_size": 1}
        with pytest.raises(LockArgumentError, match="DBLOCK_ENGINE_OPTIONS cannot apply"):
            DBLock(given, manager=mine)


def test_bad_engine_options_stop_the_app_from_starting(db: str, tmp_path: Path) -> None:
    """A real `flask` process loading an app with a misspelt engine option
    exits at start-up, naming the option."""
    with private_database(db, tmp_path) as url:
        result = subprocess.run(
            [sys.executable, "-m", "flask", "--app", POOL_APP, "routes"],
            check=False,
            cwd=tmp_path,
            env={
                **os.environ,
                "DATABASE_URL": url,
                "PYTHONPATH": str(ROOT),
                "DBLOCK_ENGINE_OPTIONS": json.dumps({"pool_szie": 1}),
            },
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode != 0
    assert "'pool_szie'" in result.stderr
    assert "LockArgumentError" in result.stderr


@pytest.mark.databases("postgresql")
def test_lock_does_not_join_the_session_transaction(app: Flask) -> None:
    """A lock taken while the request's session has an open transaction is
    committed at once, and the session rolling back does not undo it."""
    with app.app_context():
        example.db.session.execute(sa.text("SELECT 1"))  # session transaction open
        held = example.dblock.manager.acquire("user:tx")
        example.db.session.rollback()
        with other_manager(app) as other, pytest.raises(LockBusy):
            other.acquire("user:tx", blocking=False)
        held.release()


def test_sqlalchemy_uri_without_extension_is_refused(tmp_path: Path) -> None:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path}/x.sqlite3"
    with pytest.raises(LockArgumentError, match=r"db\.init_app\(app\) before dblock"):
        DBLock(app)


def test_one_extension_many_apps(tmp_path: Path) -> None:
    ext = DBLock()
    apps = []
    for name in ("a", "b"):
        app = Flask(name)
        app.config["DBLOCK_URL"] = f"sqlite:///{tmp_path}/{name}.sqlite3"
        ext.init_app(app)
        apps.append(app)
    with apps[0].app_context():
        first = ext.manager
    with apps[1].app_context():
        second = ext.manager
    assert first is not second
    assert first.url.endswith("a.sqlite3")
    with pytest.raises(RuntimeError, match="no Flask app here"):
        _ = ext.manager
    first.close()
    second.close()


# -- flask dblock ... ------------------------------------------------------------


def test_cli_list_sweep_release(app: Flask) -> None:
    """`flask dblock list|sweep|release` are `dblock list|sweep|release` on
    the app's table (tests/test_faces_commands.py compares the three faces)."""
    runner = app.test_cli_runner()
    with other_manager(app) as other:
        held = other.acquire("user:9", ttl=60)
        short = other.acquire("user:8", ttl=0.2, renew=False)
        time.sleep(0.5)  # user:8's lease ends

        listed = runner.invoke(args=["dblock", "list"])
        assert listed.exit_code == 0, listed.output
        lines = listed.output.splitlines()
        assert lines[0].endswith(": 2 rows, 1 expired"), lines
        assert lines[2].split()[:2] == ["KEY", "KIND"]
        assert lines[3].startswith("user:9")  # oldest first
        assert lines[4].startswith("user:8")
        assert "expired" in lines[4]

        as_json = runner.invoke(args=["dblock", "list", "--json", "--prefix", "user:9"])
        (row,) = json.loads(as_json.output)
        assert (row["key"], row["fence"], row["expired"]) == ("user:9", held.fence, False)

        swept = runner.invoke(args=["dblock", "sweep", "--once", "--grace", "0"])
        assert swept.exit_code == 0, swept.output
        assert ": swept 1 expired row and 0 held past max_hold" in swept.output

        refused = runner.invoke(args=["dblock", "release", "user:9"])
        assert refused.exit_code == 2
        assert "add --force" in refused.output
        not_asked = runner.invoke(args=["dblock", "release", "user:9", "--force"])
        assert not_asked.exit_code == 2  # (the runner's stdin is no terminal)
        assert "standard input is not a terminal; add --yes" in not_asked.output

        released = runner.invoke(args=["dblock", "release", "user:9", "--force", "--yes"])
        assert released.exit_code == 0, released.output
        assert released.output.startswith("released 'user:9' held by ")
        missing = runner.invoke(args=["dblock", "release", "user:9", "--force", "--yes"])
        assert missing.exit_code == 1
        assert "dblock: no lock 'user:9' in dblock_locks" in missing.output

        assert runner.invoke(args=["dblock", "list"]).output.endswith(": 0 rows, 0 expired\n")
        del short
        with pytest.raises(Exception, match="lost"):
            held.release()


def test_cli_release_by_prefix_and_owner(app: Flask) -> None:
    """`flask dblock release --prefix/--owner`, as `dblock release`: every
    matching row, checked before anything runs, --force required."""
    runner = app.test_cli_runner()
    url = app.extensions["dblock"].manager.engine.url
    with LockManager(url, client_id="gone-host:1") as gone, LockManager(url) as alive:
        a = gone.acquire("tenant:1:a", ttl=60)
        b = gone.acquire("tenant:1:b", ttl=60)
        kept = alive.acquire("tenant:1:c", ttl=60)
        other = gone.acquire("tenant:2:a", ttl=60)

        both = runner.invoke(args=["dblock", "release", "tenant:1:a", "--prefix", "t", "--force"])
        assert both.exit_code == 2
        assert "not both" in both.output
        nothing = runner.invoke(args=["dblock", "release", "--force"])
        assert nothing.exit_code == 2
        assert "name what to release" in nothing.output
        empty = runner.invoke(args=["dblock", "release", "--prefix", "", "--force"])
        assert empty.exit_code == 2
        assert "--prefix" in empty.output
        refused = runner.invoke(args=["dblock", "release", "--prefix", "tenant:1:"])
        assert refused.exit_code == 2
        assert "add --force" in refused.output

        released = runner.invoke(
            args=["dblock", "release", "--prefix", "tenant:1:", "--owner", "gone-host", "--force",
                  "--yes"]
        )  # fmt: skip
        assert released.exit_code == 0, released.output
        assert released.output.startswith(
            "released 2 rows with keys starting with 'tenant:1:' and held by 'gone-host'; by "
        )
        left = {row.key for row in alive.store.rows(prefix="tenant:")}
        assert left == {"tenant:1:c", "tenant:2:a"}
        again = runner.invoke(args=["dblock", "release", "--owner", "nobody", "--force", "-y"])
        assert again.exit_code == 1
        assert "dblock: no lock rows held by 'nobody' in dblock_locks" in again.output
        for lost in (a, b):
            with pytest.raises(Exception, match="lost"):
                lost.release()
        kept.release()
        other.release()


def test_cli_release_by_owner_is_exact(app: Flask) -> None:
    """`flask dblock release --owner` takes the rows of that owner (and its
    threads) only: not those of owners differing in case, accents or a
    trailing space, which MariaDB's default collation took too (issue 32)."""
    runner = app.test_cli_runner()
    manager = app.extensions["dblock"].manager
    tag = uuid.uuid4().hex[:8]
    hold_rows(manager, tag)
    released = runner.invoke(
        args=["dblock", "release", "--owner", "deadhost:999", "--force", "--yes"]
    )
    assert released.exit_code == 0, released.output
    assert released.output.startswith("released 2 rows held by 'deadhost:999'; by ")
    assert held_keys(manager, tag) == set(OTHERS.values())
    for row in manager.store.rows(prefix=f"{tag}:"):
        assert manager.store.release_row(row.key, row.slot, row.token)


def test_cli_migrate_sql_and_up_to_date(app: Flask) -> None:
    runner = app.test_cli_runner()
    again = runner.invoke(args=["dblock", "migrate"])
    assert f"is up to date (revision {HEAD_REVISION})" in again.output
    latest = runner.invoke(args=["dblock", "migrate", "--sql"])  # as `dblock migrate --sql`
    assert latest.exit_code == 0
    assert f"is at revision {HEAD_REVISION}, the latest: no SQL" in latest.output
    sql = runner.invoke(args=["dblock", "migrate", "--sql", "--from", "base"])
    assert sql.exit_code == 0
    assert "CREATE TABLE dblock_locks" in sql.output


@pytest.mark.databases("sqlite")
def test_cli_reports_missing_table(private_url: str) -> None:
    app = example.create_app({"SQLALCHEMY_DATABASE_URI": private_url})
    result = app.test_cli_runner().invoke(args=["dblock", "list"])
    assert result.exit_code == 1
    assert "`dblock migrate` creates it" in result.output


# -- the in-app sweeper ---------------------------------------------------------


@pytest.mark.databases("sqlite", "postgresql")
def test_sweeper_starts_with_the_first_request(private_url: str) -> None:
    app = example.create_app(
        {
            "SQLALCHEMY_DATABASE_URI": private_url,
            "DBLOCK_SWEEPER": True,
            "DBLOCK_SWEEPER_INTERVAL": 0.2,
        }
    )
    runner = app.test_cli_runner()
    runner.invoke(args=["init-db"])
    runner.invoke(args=["dblock", "migrate"])
    state = app.extensions["dblock"]
    assert state.sweeper is None  # commands do not start it
    with other_manager(app) as other:
        _kept = other.acquire("user:77", ttl=0.2, renew=False)  # kept, not released
        assert app.test_client().get("/users/1/balance").status_code == 200
        try:
            assert state.sweeper is not None
            assert state.sweeper.running
            deadline = time.monotonic() + 30
            left = None
            while left != 0 and time.monotonic() < deadline:
                time.sleep(0.1)
                with other.engine.connect() as conn:
                    left = conn.execute(sa.text("SELECT count(*) FROM dblock_locks")).scalar()
            assert left == 0
            assert state.sweeper.swept >= 1
        finally:
            example.dblock.stop_sweeper(app)
    assert state.sweeper is None


# -- the example under real concurrent HTTP requests ----------------------------


@pytest.mark.slow
def test_running_servers_let_one_request_per_user_in(
    db: str, app: Flask, private_url: str, ledger_path: Path
) -> None:
    """Two `flask run` processes, threaded, on one database; many concurrent
    withdrawals for two users. The ledger shows no two requests for one user
    inside the critical section at once, and no update was lost."""
    env = {
        "DATABASE_URL": private_url,
        "PYTHONPATH": str(ROOT),
        ledger.ENV: str(ledger_path),
    }
    ports = [web.free_port(), web.free_port()]
    watched = "tests.support.ledger:flask_app"  # the example's app, its pay_out watched
    command = [sys.executable, "-m", "flask", "--app", watched, "run", "--with-threads"]
    per_user = 24
    with (
        web.serving(
            [*command, "--port", str(ports[0])],
            cwd=EXAMPLE,
            env=env,
            port=ports[0],
            ready_path="/users/2/balance",
        ) as one,
        web.serving(
            [*command, "--port", str(ports[1])],
            cwd=EXAMPLE,
            env=env,
            port=ports[1],
            ready_path="/users/2/balance",
        ) as two,
    ):
        calls = [
            ("POST", f"{(one, two)[i % 2]}/users/{1 + (i // 2) % 2}/withdraw", {"amount": 1})
            for i in range(per_user * 2)
        ]
        statuses = web.concurrently(calls, threads=12)
    assert statuses == [200] * len(calls)
    rows = ledger.rows(ledger_path)
    assert web.ledger_problems(rows) == []
    assert len(rows) == 2 * len(calls)
    with app.app_context():
        balances = dict(
            example.db.session.execute(sa.select(example.Account.id, example.Account.balance)).all()
        )
        example.db.session.remove()
    assert balances == {1: 1000 - per_user, 2: 1000 - per_user}


def test_ledger_check_notices_an_overlap() -> None:
    """The check the server test relies on does catch two requests inside."""
    rows = [(1, "a", "enter"), (1, "b", "enter"), (1, "a", "exit"), (1, "b", "exit")]
    assert web.ledger_problems(rows)
    assert web.ledger_problems([(1, "a", "enter")]) == ["user 1: a never left"]
    assert (
        web.ledger_problems(
            [(1, "a", "enter"), (2, "b", "enter"), (1, "a", "exit"), (2, "b", "exit")]
        )
        == []
    )


# -- dblock's own pool ----------------------------------------------------------

POOL_APP = "tests.support.flask_pool_app:create_app"


def pool_app_server(url: str, directory: Path, **env: str) -> Any:
    """``tests/support/flask_pool_app.py`` (app pool: 2 connections, no
    overflow, 3 s pool timeout) in a threaded `flask run` process."""
    port = web.free_port()
    return web.serving(
        [
            sys.executable,
            *("-m", "flask", "--app", POOL_APP),
            *("run", "--with-threads", "--port", str(port)),
        ],
        cwd=directory,
        env={"DATABASE_URL": url, "PYTHONPATH": str(ROOT), **env},
        port=port,
        ready_path="/ready",
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "dblock_pool",
    [
        pytest.param({}, id="default-pool"),
        pytest.param({"pool_size": 1, "max_overflow": 0}, id="one-connection"),
    ],
)
def test_requests_holding_the_apps_pool_still_get_their_locks(
    private_url: str, tmp_path: Path, dblock_pool: dict[str, int]
) -> None:
    """Four concurrent requests, each holding one of the app pool's two
    connections when it takes the lock (timeout 8 s): all get it, none waits
    for the app's pool (3 s timeout, no overflow); even with dblock's own
    pool cut to one connection, lock statements only queue for it."""
    # dblock's database: the app's, or for SQLite the lock file beside it.
    with LockManager(beside(sa.make_url(private_url))) as m:
        m.create_schema()
    options = {"DBLOCK_ENGINE_OPTIONS": json.dumps(dblock_pool)} if dblock_pool else {}
    with pool_app_server(private_url, tmp_path, **options) as base:
        statuses = web.concurrently([("POST", f"{base}/hold/pool", None)] * 4, threads=4)
    assert statuses == [200] * 4


# -- the lock covers the session's commit ------------------------------------------


def _withdraw_app(url: str, cover: bool) -> tuple[Flask, SQLAlchemy]:
    """An app whose locked service writes through db.session and whose view
    commits after the service returned, as many views do."""
    sqla = SQLAlchemy()
    ext = DBLock()
    app = Flask(__name__)
    app.config.update(SQLALCHEMY_DATABASE_URI=url, DBLOCK_COVER_COMMIT=cover)
    sqla.init_app(app)
    ext.init_app(app)

    @ext.locked("acct:{account}", timeout=60)
    def withdraw(account: str) -> None:
        balance = sqla.session.execute(
            sa.text("SELECT balance FROM acct WHERE name = :n"), {"n": account}
        ).scalar_one()
        sqla.session.execute(
            sa.text("UPDATE acct SET balance = :b WHERE name = :n"),
            {"b": balance - 1, "n": account},
        )

    @app.post("/withdraw/<account>")
    def view(account: str) -> str:
        withdraw(account)
        time.sleep(0.02)  # the rest of the view, before its commit
        sqla.session.commit()
        return "ok"

    with app.app_context(), sqla.engine.begin() as conn:
        conn.execute(sa.text("CREATE TABLE acct (name VARCHAR(64) PRIMARY KEY, balance INT)"))
    return app, sqla


def _withdraw_20(app: Flask, sqla: SQLAlchemy, account: str) -> int:
    import threading

    with app.app_context(), sqla.engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO acct VALUES (:n, 100)"), {"n": account})
    statuses: list[int] = []

    def one() -> None:
        statuses.append(app.test_client().post(f"/withdraw/{account}").status_code)

    threads = [threading.Thread(target=one) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert statuses == [200] * 20
    with app.app_context(), sqla.engine.connect() as conn:
        balance = conn.execute(
            sa.text("SELECT balance FROM acct WHERE name = :n"), {"n": account}
        ).scalar_one()
    app.extensions["dblock"].manager.close()
    with app.app_context():
        sqla.engine.dispose()
    return int(balance)


@pytest.mark.databases("postgresql", "mariadb")
def test_session_commit_is_covered_by_default(private_url: str) -> None:
    app, sqla = _withdraw_app(private_url, cover=True)
    with app.app_context():
        app.extensions["dblock"].manager.create_schema()
    assert _withdraw_20(app, sqla, "a") == 80


@pytest.mark.databases("postgresql", "mariadb")
def test_without_cover_commit_updates_are_lost(private_url: str) -> None:
    app, sqla = _withdraw_app(private_url, cover=False)
    with app.app_context():
        app.extensions["dblock"].manager.create_schema()
    assert _withdraw_20(app, sqla, "a") > 80


def test_a_streamed_response_never_closed_releases_when_collected(
    db_url: str, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    import gc
    import logging

    from flask import Response

    app = Flask(__name__)
    app.config["DBLOCK_URL"] = db_url
    ext = DBLock(app)

    @ext.locked(lambda: key)
    def view() -> Response:
        return Response(iter(["a", "b"]))

    with app.test_request_context():
        response = view()
    other = ext.manager
    assert response.is_streamed
    assert other._locker.registry.get(key) is not None  # held until the body is closed
    with caplog.at_level(logging.WARNING, logger="dblock"), pytest.warns(ResourceWarning):  # noqa: PT031
        del response
        gc.collect()
        deadline = time.monotonic() + 30
        while other._locker.registry.get(key) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert other._locker.registry.get(key) is None
    assert "garbage-collected without being closed" in caplog.text
    other.close()
