"""The lock must cover the commit, with the example Django project under
``ATOMIC_REQUESTS`` in real ``runserver`` processes: concurrent withdrawals
for one user lose nothing, on PostgreSQL, MariaDB and a SQLite file (where
dblock keeps its rows in a file beside the app's, so nothing stalls)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.support import web
from tests.support.db import private_database

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "django_project"

pytestmark = pytest.mark.slow


def example_env(db: str, url: str, **extra: str) -> dict[str, str]:
    """The example project's settings for the database at ``url``."""
    parsed = sa.make_url(url)
    env = {
        "DJANGO_SETTINGS_MODULE": "exampleproject.settings",
        "DJANGO_DEBUG": "0",
        "PYTHONPATH": str(EXAMPLE.parent.parent),
        "EXAMPLE_DB_ENGINE": {"sqlite": "sqlite", "postgresql": "postgresql", "mariadb": "mysql"}[
            db
        ],
        "EXAMPLE_DB_NAME": str(parsed.database),
        **extra,
    }
    if db != "sqlite":
        env |= {
            "EXAMPLE_DB_HOST": str(parsed.host),
            "EXAMPLE_DB_PORT": str(parsed.port or (3306 if db == "mariadb" else 5432)),
            "EXAMPLE_DB_USER": str(parsed.username),
        }
    return env


def manage(env: dict[str, str], *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=EXAMPLE,
        env={**__import__("os").environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


@pytest.fixture
def project_url(db: str, tmp_path: Path) -> Iterator[str]:
    if db == "sqlite":
        yield f"sqlite:///{tmp_path / 'db.sqlite3'}"  # Django's default file name
        return
    with private_database(db, tmp_path) as url:
        yield url


def withdraw_concurrently(env: dict[str, str], *, requests: int) -> tuple[list[int], Any]:
    """Two runserver processes; ``requests`` withdrawals of 1 for user 1 at
    once; the statuses and the final balance."""
    ports = [web.free_port(), web.free_port()]

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
            ("POST", f"{(one, two)[i % 2]}/users/1/withdraw", {"amount": 1})
            for i in range(requests)
        ]
        statuses = web.concurrently(calls, threads=10)
        status, body = web.request("GET", f"{one}/users/1/balance")
        assert status == 200, body
    return statuses, json.loads(body)["balance"]


def test_atomic_requests_lose_no_withdrawal(db: str, project_url: str, tmp_path: Path) -> None:
    """20 concurrent withdrawals of 1 from 100 under ATOMIC_REQUESTS end at
    exactly 80: each lock is released after its request's transaction commits."""
    env = example_env(db, project_url, EXAMPLE_ATOMIC_REQUESTS="1")
    out = manage(env, "migrate", "-v", "0")
    manage(
        env,
        "shell",
        "-c",
        "from accounts.models import Account; Account.objects.filter(id=1).update(balance=100)",
    )
    statuses, balance = withdraw_concurrently(env, requests=20)
    assert statuses == [200] * 20
    assert balance == 80
    if db == "sqlite":
        # dblock's rows live beside the app's file, not in it.
        assert (tmp_path / "db.dblock.sqlite3").exists(), out
        engine = sa.create_engine(project_url)
        assert "dblock_locks" not in sa.inspect(engine).get_table_names()
        engine.dispose()
