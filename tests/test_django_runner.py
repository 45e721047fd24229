"""Django's own test runner (``manage.py test``) on a project whose tests
take locks, on PostgreSQL and MariaDB: the runner swaps the database under
dblock's manager (creates the test database, drops it at the end) without a
signal, and the manager must follow. A manager made before the test database
existed (here, by the test module the runner imports) must not write to the
real database, and the test database must drop cleanly after a
``TestCase`` that took a lock: its transaction's rollback releases the lock
on dblock's worker thread, and PostgreSQL refuses to drop a database any
session is still connected to (the run ended with "being accessed by other
users" and exit status 1)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "django_project"

TESTS = """
from django.db import connection
from django.test import TestCase

import dblock.contrib.django as dj
from accounts.models import Account
from accounts.services import withdraw

# Made while the runner imports the tests, before the test database exists.
EARLY = dj.get_manager()


class LockInATestCase(TestCase):
    def test_withdraw_takes_its_lock_in_the_test_database(self):
        Account.objects.create(pk=9999, balance=100)
        self.assertEqual(withdraw(9999, 30), 70)
        manager = dj.get_manager()
        self.assertEqual(manager.store.engine.url.database, connection.settings_dict["NAME"])
        self.assertIsNot(manager, EARLY)
"""


@pytest.mark.databases("postgresql", "mariadb")
def test_manage_py_test_with_locks(db: str, db_url: str, tmp_path: Path) -> None:
    url = sa.make_url(db_url)
    project = tmp_path / "project"
    shutil.copytree(EXAMPLE, project, ignore=shutil.ignore_patterns("*.sqlite3", "__pycache__"))
    (project / "accounts" / "tests.py").write_text(TESTS)
    name = f"dblock_runner_{uuid.uuid4().hex[:10]}"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "EXAMPLE_DB_ENGINE": "postgresql" if db == "postgresql" else "mysql",
        "EXAMPLE_DB_NAME": name,
        "EXAMPLE_DB_HOST": url.host or "127.0.0.1",
        "EXAMPLE_DB_PORT": str(url.port or (5432 if db == "postgresql" else 3306)),
        "EXAMPLE_DB_USER": url.username or "",
        "EXAMPLE_DB_PASSWORD": url.password or "",
    }
    env.pop("DJANGO_SETTINGS_MODULE", None)  # the project's own settings
    try:
        done = subprocess.run(
            [sys.executable, "manage.py", "test", "accounts", "--noinput"],
            cwd=project,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        output = done.stdout + done.stderr
        assert done.returncode == 0, output
        assert "Ran 1 test" in output, output
        assert "\nOK" in output, output
        assert "being accessed by other users" not in output, output
    finally:
        _drop(db, url, f"test_{name}")


def _drop(db: str, url: sa.URL, database: str) -> None:
    """The test database, if the runner left it behind."""
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            if db == "postgresql":
                conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
            else:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS `{database}`")
    finally:
        engine.dispose()
