"""dblock.contrib.django and the example project under examples/django_project,
on PostgreSQL with pytest-django (its test database is this run's own):
migration, settings, decorators, middleware, commands, admin, and concurrent
requests for one user against two running servers."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from django.contrib.auth.models import Permission, User
from django.core.management import call_command
from django.db import connection
from django.http import HttpRequest, JsonResponse
from django.test import Client, RequestFactory, override_settings
from django.urls import path

import dblock.contrib.django as dj
from dblock import LockArgumentError, LockBusy, LockManager, migrations
from dblock.contrib.django import _ddl, conf
from dblock.contrib.django.apps import current_sweeper, stop_sweeper
from dblock.contrib.django.middleware import LockBusyMiddleware
from dblock.schema import TableNames
from tests.support import ledger, web
from tests.support.db import private_database
from tests.support.owners import OTHERS, held_keys, hold_rows

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "django_project"

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fresh_manager() -> Iterator[None]:
    dj.reset_manager()
    yield
    dj.reset_manager()


@pytest.fixture
def accounts() -> None:
    from accounts.models import Account

    for user_id in (1, 2):
        Account.objects.update_or_create(id=user_id, defaults={"balance": 1000})


def other_manager() -> LockManager:
    """Another process's view of the lock table (its own registry)."""
    return LockManager(conf.url_for("default"))


@pytest.fixture
def ledger_path(tmp_path: Path) -> Iterator[Path]:
    """The example's critical sections watched in this process (and in the
    servers started with ``$DBLOCK_TEST_LEDGER``): tests/support/ledger.py."""
    path = tmp_path / "ledger"
    for module in ledger.django_modules():
        ledger.watch(module, path)
    yield path
    for module in ledger.django_modules():
        ledger.unwatch(module)


# -- the migration ------------------------------------------------------------------


def _reflect(url: str, names: TableNames) -> dict[str, Any]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        inspector = sa.inspect(engine)
        columns = [
            (c["name"], str(c["type"]), c["nullable"], c.get("autoincrement"), c.get("default"))
            for c in inspector.get_columns(names.table)
        ]
        shape: dict[str, Any] = {
            "columns": columns,
            "pk": inspector.get_pk_constraint(names.table),
            "indexes": sorted(
                (i["name"], tuple(i["column_names"]), i["unique"])
                for i in inspector.get_indexes(names.table)
            ),
            "unique": sorted(
                (u["name"], tuple(u["column_names"]))
                for u in inspector.get_unique_constraints(names.table)
            ),
            "version": migrations.current(engine, names),
        }
        if engine.dialect.name == "postgresql":
            with engine.connect() as conn:
                shape["sequences"] = conn.execute(
                    sa.text(
                        "SELECT sequencename, data_type::text, start_value, increment_by, "
                        "max_value, cycle FROM pg_sequences WHERE sequencename LIKE :t"
                    ),
                    {"t": f"{names.table}%"},
                ).all()
        if engine.dialect.name == "sqlite":
            with engine.connect() as conn:
                shape["triggers"] = sorted(
                    conn.execute(
                        sa.text("SELECT name, sql FROM sqlite_master WHERE type = 'trigger'")
                    ).all()
                )
        if engine.dialect.name in ("mysql", "mariadb"):
            with engine.connect() as conn:
                shape["create"] = conn.execute(sa.text(f"SHOW CREATE TABLE {names.table}")).all()[
                    0
                ][1]
        return shape
    finally:
        engine.dispose()


def test_django_migrate_makes_the_alembic_schema(tmp_path: Path) -> None:
    """The table `manage.py migrate` made in the test database, reflected on
    PostgreSQL, equals what dblock's alembic revision makes elsewhere."""
    names = conf.table_names()
    django_url = conf.url_for("default").render_as_string(hide_password=False)
    with private_database("postgresql", tmp_path) as alembic_url:
        with LockManager(alembic_url) as m:
            m.create_schema()
        assert _reflect(django_url, names) == _reflect(alembic_url, names)
    assert migrations.head() == _ddl.ALEMBIC_REVISION


@pytest.mark.django_db(transaction=False)
def test_migration_sql_matches_alembic_on_every_database(db: str, tmp_path: Path) -> None:
    """The SQL the Django migration runs, compiled for each database, makes
    the same schema as alembic there (private databases, a private table name)."""
    names = TableNames(table=f"dblock_dj_{uuid.uuid4().hex[:8]}")
    vendor = {"sqlite": "sqlite", "postgresql": "postgresql", "mariadb": "mysql"}[db]
    with private_database(db, tmp_path) as one, private_database(db, tmp_path) as two:
        engine = sa.create_engine(one, poolclass=sa.pool.NullPool)
        with engine.begin() as conn:
            for sql in _ddl.create_sql(vendor, names):
                conn.exec_driver_sql(sql)
        engine.dispose()
        with LockManager(two, table=names.table) as m:
            m.create_schema()
        assert _reflect(one, names) == _reflect(two, names)
        with LockManager(one, table=names.table) as m, m.lock("works") as held:
            assert held.fence >= 1
        engine = sa.create_engine(one, poolclass=sa.pool.NullPool)
        with engine.begin() as conn:
            for sql in _ddl.drop_sql(vendor, names):
                conn.exec_driver_sql(sql)
        assert sa.inspect(engine).get_table_names() == []
        engine.dispose()


def test_migrate_backwards_and_over_an_alembic_table() -> None:
    names = conf.table_names()
    call_command("migrate", "dblock", "zero", verbosity=0)
    assert names.table not in connection.introspection.table_names()
    # A project that ran `dblock migrate` before adopting the app keeps its table.
    with other_manager() as m:
        m.create_schema()
        held = m.acquire("kept")
        call_command("migrate", "dblock", verbosity=0)
        assert names.table in connection.introspection.table_names()
        assert held.release()  # its row survived the migration
    call_command("migrate", "dblock", "zero", verbosity=0)
    call_command("migrate", "dblock", verbosity=0)
    with other_manager() as m:
        assert migrations.current(m.engine, names) == migrations.head()


def test_migration_0002_upgrades_a_0001_table_in_place_and_back() -> None:
    """A deployment at 0001 holding locks: `manage.py migrate` brings the
    table to 0002 with the locks still held; back to 0001 is refused while a
    semaphore permit is live, and keeps the exclusive lock once it is not."""
    from dblock import DowngradeRefused

    names = conf.table_names()
    call_command("migrate", "dblock", "zero", verbosity=0)
    with other_manager() as m:
        migrations.upgrade(m.engine, names, "0001")
        token = uuid.uuid4().hex
        with m.engine.begin() as conn:
            conn.exec_driver_sql(
                f"INSERT INTO {names.table} (lock_key, owner, token, fence, acquired_at, "
                f"expires_at) VALUES ('dj:old', 'old:1:T', '{token}', "
                f"nextval('{names.sequence}'), now(), now() + interval '5 minutes')"
            )
        call_command("migrate", "dblock", "0001", "--fake", verbosity=0)
        call_command("migrate", "dblock", verbosity=0)
        assert migrations.current(m.engine, names) == "0005"
        with pytest.raises(LockBusy), other_manager() as other:
            other.acquire("dj:old", blocking=False)
        permit = m.semaphore("dj:sem", permits=2).__enter__()
        with pytest.raises(DowngradeRefused, match="dj:sem"):
            call_command("migrate", "dblock", "0001", verbosity=0)
        permit.release()
        call_command("migrate", "dblock", "0001", verbosity=0)
        assert migrations.current(m.engine, names) == "0001"
        assert [r[0] for r in m.engine.connect().exec_driver_sql(
            f"SELECT token FROM {names.table}"
        ).all()] == [token]  # fmt: skip
        call_command("migrate", "dblock", verbosity=0)
        assert m.store.release("dj:old", token)


# -- settings -----------------------------------------------------------------------


def test_manager_uses_the_test_database_and_settings() -> None:
    manager = dj.get_manager()
    assert manager.engine.url.database == connection.settings_dict["NAME"]
    assert manager.engine.url.database.startswith("test_dblock_")
    assert manager.config.ttl == 30.0  # the example's DBLOCK["TTL"]
    assert dj.get_manager() is manager
    with override_settings(DBLOCK={"TTL": 7, "TIMEOUT": 2, "CLIENT_ID": "web-7"}):
        changed = dj.get_manager()
        assert changed is not manager
        assert (changed.config.ttl, changed.config.timeout, changed.config.client_id) == (
            7.0,
            2.0,
            "web-7",
        )


@pytest.mark.django_db(transaction=False)
@pytest.mark.parametrize(
    ("dblock", "message"),
    [
        pytest.param({"TLL": 3}, r"unknown dblock setting DBLOCK\['TLL'\]", id="typo"),
        pytest.param({"TTL": 0}, "ttl must be", id="ttl"),
        pytest.param({"DATABASE": "nope"}, "not in DATABASES", id="alias"),
        pytest.param({"BUSY_STATUS": 200}, "409 or 423", id="status"),
        pytest.param([("TTL", 3)], "must be a dict", id="not-dict"),
        pytest.param(
            {"ENGINE_OPTIONS": {"no_such_option": 1}}, "'no_such_option'", id="engine-option"
        ),
        pytest.param(
            {"ENGINE_OPTIONS": {"isolation_level": "READ COMMITTED"}},
            r"DBLOCK\['ENGINE_OPTIONS'\]\['isolation_level'\] is not allowed: .*AUTOCOMMIT",
            id="isolation",
        ),
        pytest.param(
            {"ENGINE_OPTIONS": {"pool": sa.pool.NullPool(lambda: None)}},
            "dblock keeps a pool of its own",
            id="pool",
        ),
    ],
)
def test_bad_settings_are_refused(dblock: Any, message: str) -> None:
    from django.apps import apps

    with override_settings(DBLOCK=dblock):
        with pytest.raises(LockArgumentError, match=message):
            apps.get_app_config("dblock").ready()  # start-up
        with pytest.raises(LockArgumentError, match=message):
            dj.get_manager()


def test_engine_options_shape_dblocks_own_pool() -> None:
    """dblock's pool is its own (Django's connection is never used for a
    lock), sized by ENGINE_OPTIONS; connect_args add to the OPTIONS it took
    from DATABASES."""
    assert dj.get_manager().engine.pool.size() == 5  # type: ignore[attr-defined]
    options = {"pool_size": 1, "connect_args": {"application_name": "dblock-dj-test"}}
    with override_settings(DBLOCK={"ENGINE_OPTIONS": options}):
        manager = dj.get_manager()
        assert manager.engine.pool.size() == 1  # type: ignore[attr-defined]
        with manager.engine.connect() as conn:
            name = conn.exec_driver_sql("SELECT current_setting('application_name')").scalar()
        assert name == "dblock-dj-test"
        with manager.lock("dj:pool") as held:
            assert held.fence > 0


def _manage(*args: str, dblock: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """``manage.py`` of the example project in a process of its own, with
    ``dblock`` added to its DBLOCK setting."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        check=False,
        cwd=EXAMPLE,
        env={
            **os.environ,
            "PYTHONPATH": f"{EXAMPLE.parent.parent}{os.pathsep}{EXAMPLE}",
            "DJANGO_SETTINGS_MODULE": "tests.support.django_env_settings",
            "EXAMPLE_DB_NAME": connection.settings_dict["NAME"],
            "EXAMPLE_DBLOCK": json.dumps(dblock),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.django_db(transaction=False)
def test_bad_engine_options_stop_django_at_start_up() -> None:
    """A real ``manage.py check`` process: a misspelt engine option stops
    Django while it starts, naming the option; a good one passes."""
    bad = _manage("check", dblock={"ENGINE_OPTIONS": {"pool_szie": 1}})
    assert bad.returncode != 0
    assert "'pool_szie'" in bad.stderr
    good = _manage("check", dblock={"ENGINE_OPTIONS": {"pool_size": 1}})
    assert good.returncode == 0, good.stderr


@pytest.mark.django_db(transaction=False)
def test_url_from_databases() -> None:
    url = conf.url_for("default")
    assert url.drivername == "postgresql+psycopg"
    assert (url.host, url.port, url.username) == ("127.0.0.1", 5432, "postgres")
    assert url.database == connection.settings_dict["NAME"]
    pg = conf.url_from(
        "postgresql",
        {
            "NAME": "app",
            "USER": "u",
            "PASSWORD": "p@ss",
            "HOST": "db",
            "PORT": "6432",
            "OPTIONS": {"sslmode": "require", "pool": True, "isolation_level": 1},
        },
    )
    assert pg.render_as_string(hide_password=False) == (
        "postgresql+psycopg://u:p%40ss@db:6432/app?sslmode=require"
    )
    assert str(conf.url_from("mysql", {"NAME": "app", "HOST": "h", "USER": "root"})) == (
        "mysql+pymysql://root@h/app"
    )
    assert str(conf.url_from("sqlite", {"NAME": Path("/srv/db.sqlite3")})) == (
        "sqlite:////srv/db.sqlite3"
    )
    with pytest.raises(LockArgumentError, match="'oracle'; dblock supports"):
        conf.url_from("oracle", {"NAME": "x"})


# -- the example through Django's test client -----------------------------------------


def test_withdraw_through_the_test_client(accounts: None, ledger_path: Path) -> None:
    client = Client()
    response = client.post("/users/1/withdraw", {"amount": 5}, content_type="application/json")
    assert response.json() == {"user_id": 1, "balance": 995}
    too_much = client.post("/users/1/withdraw", {"amount": 5000}, content_type="application/json")
    assert too_much.status_code == 400
    assert client.get("/users/1/balance").json()["balance"] == 995
    assert client.get("/users/9/balance").status_code == 404  # as in every example
    missing = client.post("/users/9/withdraw", {"amount": 5}, content_type="application/json")
    assert missing.status_code == 404
    rows = ledger.rows(ledger_path)
    assert [r[2] for r in rows] == ["enter", "exit"]  # the refused one paid nothing
    assert web.ledger_problems(rows) == []


def test_view_decorator_answers_409(accounts: None) -> None:
    client = Client()
    with other_manager() as other, other.lock("user:1"):
        as_json = client.get("/users/1/balance", HTTP_ACCEPT="application/json")
        as_text = client.get("/users/1/balance", HTTP_ACCEPT="text/html")
        free = client.get("/users/2/balance")
        with override_settings(DBLOCK={"BUSY_STATUS": 423}):
            locked_status = client.get("/users/1/balance").status_code
    assert as_json.status_code == 409
    assert as_json.json()["error"] == "locked"
    assert as_text.status_code == 409
    assert as_text.content.decode().startswith("409 Conflict: Another request holds")
    assert free.status_code == 200
    assert locked_status == 423


@dj.locked("report:{user_id}", blocking=False)
def _report(user_id: int) -> str:
    return "report"


def _report_view(request: HttpRequest, user_id: int) -> JsonResponse:
    return JsonResponse({"report": _report(user_id)})


urlpatterns = [path("report/<int:user_id>", _report_view)]


def test_busy_answers_problem_json(accounts: None) -> None:
    """The view decorator and the middleware answer RFC 9457's body to
    clients that accept anything or problem+json; text clients get text."""
    client = Client()
    with other_manager() as other, other.lock("user:1"):
        anything = client.get("/users/1/balance", HTTP_ACCEPT="*/*")
        problem = client.get("/users/1/balance", HTTP_ACCEPT="application/problem+json")
        text = client.get("/users/1/balance", HTTP_ACCEPT="text/plain")
    with override_settings(ROOT_URLCONF=__name__), other_manager() as other, other.lock("report:4"):
        middleware = client.get("/report/4", HTTP_ACCEPT="*/*")
    expected = {
        "type": "about:blank",
        "title": "Conflict",
        "status": 409,
        "detail": "Another request holds the lock for this resource. Try again shortly.",
    }
    for response in (anything, problem, middleware):
        assert response.status_code == 409
        assert response["Content-Type"] == "application/problem+json"
        assert json.loads(response.content) == expected
    assert text["Content-Type"].startswith("text/plain")
    assert text.content.decode().startswith("409 Conflict: Another request holds")


@override_settings(ROOT_URLCONF=__name__)
def test_middleware_answers_409_for_the_service_layer() -> None:
    client = Client()
    assert client.get("/report/3").json() == {"report": "report"}
    with other_manager() as other, other.lock("report:3"):
        response = client.get("/report/3", HTTP_ACCEPT="application/json")
    assert response.status_code == 409
    assert response.json()["message"].startswith("Another request holds")


@pytest.mark.django_db(transaction=False)
def test_middleware_leaves_other_errors_alone() -> None:
    request = RequestFactory().get("/x")
    middleware = LockBusyMiddleware(lambda r: JsonResponse({}))
    assert middleware.process_exception(request, ValueError("x")) is None
    response = middleware.process_exception(request, LockBusy("k", level=2))
    assert response is not None
    assert response.status_code == 409


@pytest.mark.django_db(transaction=False)
def test_async_views_get_the_async_decorator() -> None:
    """(tests/test_django_async.py runs them.)"""

    @dj.locked_view("user:{user_id}")
    async def view(request: HttpRequest, user_id: int) -> None:
        await asyncio.sleep(0)

    assert asyncio.iscoroutinefunction(view)
    with pytest.raises(LockArgumentError, match="generator function"):

        @dj.locked_view("user:{user_id}")
        def stream(request: HttpRequest, user_id: int) -> Iterator[int]:
            yield 1


@pytest.mark.django_db(transaction=False)
def test_view_template_is_checked_at_decoration() -> None:
    with pytest.raises(LockArgumentError, match="'uid', which is not a parameter"):

        @dj.locked_view("user:{uid}")
        def view(request: HttpRequest, user_id: int) -> None: ...


def test_class_based_view_method(accounts: None) -> None:
    from django.views import View

    class Balance(View):
        @dj.locked_view("user:{user_id}", blocking=False)
        def get(self, request: HttpRequest, user_id: int) -> JsonResponse:
            return JsonResponse({"ok": True})

    view = Balance.as_view()
    request = RequestFactory().get("/x", HTTP_ACCEPT="application/json")
    assert view(request, user_id=1).status_code == 200
    with other_manager() as other, other.lock("user:1"):
        assert view(request, user_id=1).status_code == 409


# -- management commands ------------------------------------------------------------


def test_management_commands(capsys: pytest.CaptureFixture[str]) -> None:
    """`manage.py dblock_list|dblock_sweep|dblock_release` are `dblock
    list|sweep|release` on the project's table, from call_command too, with
    strings or keywords (tests/test_faces_commands.py compares the faces)."""
    with other_manager() as other:
        held = other.acquire("cmd:held", ttl=60)
        _short = other.acquire("cmd:short", ttl=0.2, renew=False)  # kept, not released
        time.sleep(0.5)

        call_command("dblock_list", "--prefix", "cmd:")
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].endswith(": 2 rows, 1 expired"), lines
        assert lines[3].startswith("cmd:held")
        assert lines[4].startswith("cmd:short")
        assert "expired" in lines[4]

        call_command("dblock_list", "--json", "--prefix", "cmd:h")
        assert '"key": "cmd:held"' in capsys.readouterr().out

        call_command("dblock_sweep", once=True, grace="0")
        assert ": swept 1 expired row and 0 held past max_hold" in capsys.readouterr().out
        with pytest.raises(SystemExit) as no_when:
            call_command("dblock_sweep")
        assert no_when.value.code == 2
        assert "one of the arguments --once --every is required" in capsys.readouterr().err

        with pytest.raises(SystemExit) as refused:
            call_command("dblock_release", "cmd:held")
        assert refused.value.code == 2
        assert "add --force" in capsys.readouterr().err
        with pytest.raises(SystemExit) as not_asked:  # (pytest's stdin is no terminal)
            call_command("dblock_release", "cmd:held", "--force")
        assert not_asked.value.code == 2
        assert "not a terminal; add --yes" in capsys.readouterr().err
        call_command("dblock_release", "cmd:held", "--force", "--yes")
        assert capsys.readouterr().out.startswith("released 'cmd:held' held by ")
        with pytest.raises(SystemExit) as missing:
            call_command("dblock_release", key="cmd:held", force=True, yes=True)
        assert missing.value.code == 1
        assert "dblock: no lock 'cmd:held' in dblock_locks" in capsys.readouterr().out
        with pytest.raises(Exception, match="lost"):
            held.release()


def test_release_command_by_prefix_and_owner(capsys: pytest.CaptureFixture[str]) -> None:
    """`manage.py dblock_release --prefix/--owner`, as `dblock release`."""
    url = conf.url_for("default")
    with LockManager(url, client_id="gone-host:1") as gone, other_manager() as alive:
        a = gone.acquire("cmdp:1:a", ttl=60)
        kept = alive.acquire("cmdp:1:b", ttl=60)
        for argv, said in (
            (["cmdp:1:a", "--prefix", "cmdp:", "--force"], "not both"),
            (["--force"], "name what to release"),
            (["--owner", "gone-host"], "add --force"),
        ):
            with pytest.raises(SystemExit) as refused:
                call_command("dblock_release", *argv)
            assert refused.value.code == 2
            assert said in capsys.readouterr().err
        call_command(
            "dblock_release", "--prefix", "cmdp:1:", "--owner", "gone-host:1", "--force", "--yes"
        )
        assert capsys.readouterr().out.startswith(
            "released 1 row with keys starting with 'cmdp:1:' and held by 'gone-host:1'; by "
        )
        assert [row.key for row in alive.store.rows(prefix="cmdp:")] == ["cmdp:1:b"]
        with pytest.raises(Exception, match="lost"):
            a.release()
        kept.release()


def test_release_command_by_owner_is_exact(capsys: pytest.CaptureFixture[str]) -> None:
    """`manage.py dblock_release --owner` takes that owner's rows only (issue 32)."""
    with other_manager() as m:
        tag = uuid.uuid4().hex[:8]
        hold_rows(m, tag)
        call_command("dblock_release", "--owner", "deadhost:999", "--force", "--yes")
        assert capsys.readouterr().out.startswith("released 2 rows held by 'deadhost:999'; by ")
        assert held_keys(m, tag) == set(OTHERS.values())
        for row in m.store.rows(prefix=f"{tag}:"):
            assert m.store.release_row(row.key, row.slot, row.token)


def test_release_command_wakes_a_waiter_at_once() -> None:
    """On PostgreSQL a force-release announces the key like a release, so a
    waiter in another process gets it without waiting for a re-check."""
    with other_manager() as holder, other_manager() as waiter:
        _held = holder.acquire("cmd:wake", ttl=60)  # kept: a dropped lock is released
        got: list[float] = []

        def wait() -> None:
            with waiter.lock("cmd:wake", timeout=30):
                got.append(time.monotonic())

        import threading

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.5)  # the waiter is asleep on LISTEN
        released_at = time.monotonic()
        call_command("dblock_release", "cmd:wake", "--force", "--yes", verbosity=0)
        thread.join(30)
    assert got
    assert got[0] - released_at < 1.5  # its re-check interval is 2 s


# -- the admin page -------------------------------------------------------------------


def test_admin_lists_locks_read_only_and_force_releases() -> None:
    admin_user = User.objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(admin_user)
    with other_manager() as other:
        held = other.acquire("admin:held", ttl=60)
        page = client.get("/admin/dblock/lock/")
        assert page.status_code == 200
        html = page.content.decode()
        assert "admin:held" in html
        assert held.owner in html
        assert "Force-release the selected locks" in html
        assert "/admin/dblock/lock/add/" not in html
        detail = client.get("/admin/dblock/lock/admin:held/change/")
        assert detail.status_code == 200
        assert held.token not in detail.content.decode()
        assert client.get("/admin/dblock/lock/add/").status_code == 403

        response = client.post(
            "/admin/dblock/lock/",
            {"action": "force_release", "_selected_action": ["admin:held"]},
            follow=True,
        )
        assert "Released 1 lock(s): admin:held" in response.content.decode()
        assert "admin:held" not in client.get("/admin/dblock/lock/").content.decode()
        with pytest.raises(Exception, match="lost"):
            held.release()


def test_admin_names_each_roles_leader_and_filters_them() -> None:
    admin_user = User.objects.create_superuser("lead", "lead@example.com", "pw")
    client = Client()
    client.force_login(admin_user)
    with other_manager() as other:
        leader = other.leader("admin-relay", ttl=60)
        term = leader.elect()
        plain = other.acquire("admin:plain", ttl=60)
        try:
            html = client.get("/admin/dblock/lock/").content.decode()
            assert f"Leader of &#x27;admin-relay&#x27;: {term.holder}, term {term.fence}" in html
            only = client.get("/admin/dblock/lock/?as=leader").content.decode()
            assert "leader:admin-relay" in only
            assert "admin:plain" not in only
            others = client.get("/admin/dblock/lock/?as=lock").content.decode()
            assert "admin:plain" in others
            assert "leader:admin-relay</a>" not in others
        finally:
            plain.release()
            leader.step_down()
    assert "Leader of" not in client.get("/admin/dblock/lock/").content.decode()


def test_admin_lists_job_runs_read_only() -> None:
    admin_user = User.objects.create_superuser("jobs", "jobs@example.com", "pw")
    client = Client()
    client.force_login(admin_user)
    fire = datetime(2026, 11, 25, 3, 0, tzinfo=timezone.utc)
    with other_manager() as other:
        other.run_job("admin-nightly", lambda: None, at_most=5, fire_time=fire)
        with pytest.raises(RuntimeError):
            other.run_job("admin-broken", _boom, at_most=5)
    page = client.get("/admin/dblock/jobrun/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "admin-nightly" in html
    assert "success" in html
    assert "RuntimeError: broken" in html
    assert "/admin/dblock/jobrun/add/" not in html
    assert client.get("/admin/dblock/jobrun/add/").status_code == 403
    assert (
        client.get("/admin/dblock/jobrun/?outcome=failed").content.decode().count("admin-broken")
        >= 1
    )


def _boom() -> None:
    raise RuntimeError("broken")


def test_admin_permissions() -> None:
    staff = User.objects.create_user("staff", password="pw", is_staff=True)
    client = Client()
    client.force_login(staff)
    assert client.get("/admin/dblock/lock/").status_code == 403
    staff.user_permissions.add(Permission.objects.get(codename="view_lock"))
    staff = User.objects.get(pk=staff.pk)
    client.force_login(staff)
    with other_manager() as other, other.lock("admin:perm"):
        page = client.get("/admin/dblock/lock/").content.decode()
        assert "admin:perm" in page
        assert "Force-release" not in page  # seen, not touched
        refused = client.post(
            "/admin/dblock/lock/",
            {"action": "force_release", "_selected_action": ["admin:perm"]},
        )
        assert refused.status_code in (200, 302, 403)
        assert "admin:perm" in client.get("/admin/dblock/lock/").content.decode()
        staff.user_permissions.add(Permission.objects.get(codename="force_release_lock"))
        client.force_login(User.objects.get(pk=staff.pk))
        assert "Force-release" in client.get("/admin/dblock/lock/").content.decode()


# -- the in-app sweeper ----------------------------------------------------------------


def test_sweeper_starts_with_the_first_request(accounts: None) -> None:
    from django.core.signals import request_started

    from dblock.contrib.django.apps import _maybe_start_sweeper

    with override_settings(DBLOCK={"SWEEPER": True, "SWEEPER_INTERVAL": 0.2}):
        # ready() connects the signal when SWEEPER is set at start-up.
        request_started.connect(_maybe_start_sweeper, dispatch_uid="dblock-sweeper")
        try:
            with other_manager() as other:
                _kept = other.acquire("sweep:me", ttl=0.2, renew=False)  # not released
                assert Client().get("/users/2/balance").status_code == 200
                sweeper = current_sweeper()
                assert sweeper is not None
                deadline = time.monotonic() + 30
                while sweeper.swept == 0 and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert sweeper.swept >= 1
        finally:
            request_started.disconnect(dispatch_uid="dblock-sweeper")
            stop_sweeper()


# -- the example under real concurrent HTTP requests ------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "dblock",
    [
        pytest.param({}, id="default-pool"),
        pytest.param({"ENGINE_OPTIONS": {"pool_size": 1, "max_overflow": 0}}, id="one-connection"),
    ],
)
def test_running_servers_let_one_request_per_user_in(
    accounts: None, dblock: dict[str, Any], ledger_path: Path
) -> None:
    """Two `manage.py runserver` processes (threaded) on the test database;
    many concurrent withdrawals for two users. Each request holds Django's
    connection in the critical section; with dblock's pool cut to one
    connection (and the LISTEN connection) per process, lock statements only
    queue for it."""
    env = {
        "EXAMPLE_DB_NAME": connection.settings_dict["NAME"],
        "DJANGO_DEBUG": "0",
        "PYTHONPATH": f"{EXAMPLE.parent.parent}{os.pathsep}{EXAMPLE}",
        "DJANGO_SETTINGS_MODULE": "tests.support.django_env_settings",
        "EXAMPLE_DBLOCK": json.dumps(dblock),
        ledger.ENV: str(ledger_path),
    }
    ports = [web.free_port(), web.free_port()]
    per_user = 24

    def server(port: int) -> Any:
        return web.serving(
            [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"],
            cwd=EXAMPLE,
            env=env,
            port=port,
            ready_path="/users/2/balance",
        )

    with server(ports[0]) as one, server(ports[1]) as two:
        calls = [
            ("POST", f"{(one, two)[i % 2]}/users/{1 + (i // 2) % 2}/withdraw", {"amount": 1})
            for i in range(per_user * 2)
        ]
        statuses = web.concurrently(calls, threads=12)
    assert statuses == [200] * len(calls)
    rows = ledger.rows(ledger_path)
    assert web.ledger_problems(rows) == []
    assert len(rows) == 2 * len(calls)
    from accounts.models import Account

    assert dict(Account.objects.values_list("id", "balance")) == {
        1: 1000 - per_user,
        2: 1000 - per_user,
    }


# -- the lock covers the commit ------------------------------------------------------


def _held_elsewhere(key: str) -> bool:
    with other_manager() as other:
        try:
            with other.lock(key, blocking=False):
                return False
        except LockBusy:
            return True


def _wait_free(key: str) -> bool:
    deadline = time.monotonic() + 30
    while _held_elsewhere(key):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_lock_in_a_transaction_is_held_until_commit() -> None:
    from django.db import transaction

    key = f"commit:{uuid.uuid4().hex}"

    @dj.locked(lambda: key)
    def service() -> str:
        return "done"

    with transaction.atomic():
        assert service() == "done"
        assert _held_elsewhere(key)  # still held: the transaction is open
        assert service() == "done"  # the same request re-enters, no self-deadlock
        with dj.lock(key), dj.lock_many([key, f"{key}:b"]):
            pass
        assert _held_elsewhere(key)
        assert _held_elsewhere(f"{key}:b")
    assert not _held_elsewhere(key)  # released by on_commit
    assert not _held_elsewhere(f"{key}:b")
    assert service() == "done"  # outside a transaction: released on return
    assert not _held_elsewhere(key)


def test_lock_in_a_transaction_is_released_by_a_rollback() -> None:
    from django.db import transaction

    key = f"rollback:{uuid.uuid4().hex}"
    with pytest.raises(ZeroDivisionError), transaction.atomic():
        with dj.lock(key):
            pass
        assert _held_elsewhere(key)
        1 / 0  # noqa: B018
    assert _wait_free(key)
    with transaction.atomic():
        with transaction.atomic():  # a savepoint rolled back: the work is undone
            with dj.lock(f"{key}:sp"):
                pass
            transaction.set_rollback(True)
        assert _wait_free(f"{key}:sp")


@override_settings(ROOT_URLCONF="tests.support.stream_django_urls")
def test_async_streamed_body_is_under_the_lock_on_asgi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ASGI a streamed body (here an async iterator) is sent after the
    view returned; the lock is held for every chunk and released once the
    handler closes the response."""
    from django.core.handlers.asgi import ASGIHandler

    from tests.support.streaming import CHUNKS, chunk

    monkeypatch.setenv("STREAM_GATES", str(tmp_path))
    key = f"astream:{uuid.uuid4().hex}"
    sent: list[bytes] = []
    held_during: list[bool] = []

    received: list[bool] = []

    async def receive() -> dict[str, Any]:
        if not received:
            received.append(True)
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client never disconnects
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        if message["type"] != "http.response.body" or not message.get("body"):
            return
        sent.append(message["body"])
        held_during.append(await asyncio.to_thread(_held_elsewhere, key))
        (tmp_path / f"{key}.{len(sent)}").touch()  # let the body go on

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": f"/stream-async/{key}",
        "raw_path": f"/stream-async/{key}".encode(),
        "query_string": b"",
        "headers": [(b"host", b"testserver")],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }
    asyncio.run(ASGIHandler()(scope, receive, send))
    assert b"".join(sent).decode() == "".join(chunk(i) for i in range(CHUNKS))
    assert held_during == [True] * CHUNKS
    assert _wait_free(key)
