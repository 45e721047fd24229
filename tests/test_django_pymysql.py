"""Django on MariaDB with only dblock's ``mysql`` extra (PyMySQL, no
mysqlclient): docs/django.md's install line ``'.[django,mysql]'`` must start
a project as it is. mysqlclient is installed in the suite's environment, so
the project here runs in a process where importing ``MySQLdb`` fails as it
does where it was never installed; Django's MySQL backend then loads PyMySQL
in its place (dblock's app does that), and a lock and Django's own queries
both work on the real server."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sqlalchemy.engine import make_url

from tests.support.db import DEFAULT_URLS

PROJECT = """
import sys, importlib.abc

class NoMysqlclient(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "MySQLdb":  # (its submodules come from whatever stands in for it)
            raise ImportError("No module named 'MySQLdb'")
        return None

sys.meta_path.insert(0, NoMysqlclient())

import django
from django.conf import settings

settings.configure(
    INSTALLED_APPS=["dblock.contrib.django"],
    DATABASES={"default": {"ENGINE": "django.db.backends.mysql", "NAME": sys.argv[1],
                           "HOST": sys.argv[2], "PORT": sys.argv[3], "USER": sys.argv[4]}},
)
django.setup()

from django.db import connection
import dblock.contrib.django as dj

with connection.cursor() as cursor:
    cursor.execute("SELECT VERSION()")
    print("server", cursor.fetchone()[0])
dj.get_manager().create_schema()
with dj.lock("pymysql:stand-in", ttl=10) as held:
    print("locked", held.fence > 0)
"""


@pytest.mark.databases("mariadb")
def test_django_on_mariadb_with_pymysql_only(db_server: str) -> None:
    url = make_url(DEFAULT_URLS["mariadb"])
    done = subprocess.run(
        [sys.executable, "-c", PROJECT, str(url.database), str(url.host), str(url.port or 3306),
         str(url.username)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "MariaDB" in done.stdout
    assert "locked True" in done.stdout
