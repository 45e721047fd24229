"""The suite on several pytest-xdist workers (``scripts/test`` runs them).

Two rules keep the workers out of each other's way:

* **A database per worker.** Worker ``gw1`` works in
  ``<database>_<run>_gw1`` on each shared server (``<run>``: the first
  characters of xdist's id of the run, so two runs at once on the same
  servers, say a developer's beside CI's, never drop each other's),
  created when the worker starts and dropped when it ends, so a test that
  counts, sweeps or lists rows of the default table never sees another
  worker's. The URLs are set in the environment too, for the
  processes the tests start.
* **A file runs whole on one worker** (``--dist loadgroup``, each test's
  group its file): a file's tests share session fixtures, ports and
  assumptions about order. The tests on private clusters (Galera, a
  PostgreSQL pair, Patroni) form one group across files, so each cluster is
  started once, by one worker, and two never compete for the two cores.
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import sqlalchemy as sa

from tests.support.db import DEFAULT_URLS, reachable

ENVIRONMENT = {"postgresql": "DBLOCK_TEST_POSTGRESQL_URL", "mariadb": "DBLOCK_TEST_MYSQL_URL"}

# The session fixtures of private clusters: their tests share one worker.
CLUSTERS = ("galera", "pg_pair", "patroni")


def worker() -> str | None:
    """This process's xdist worker id (``gw0``...), None when not under xdist."""
    return os.environ.get("PYTEST_XDIST_WORKER")


def run_id() -> str:
    """This run's id (the same on all its workers), short: part of the names."""
    return os.environ.get("PYTEST_XDIST_TESTRUNUID", "solo")[:8]


def _admin(url: str) -> sa.Engine:
    return sa.create_engine(url, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)


def use_own_databases(name: str) -> None:
    """Point DEFAULT_URLS (and the environment) at databases of this worker's
    own, made now. A server that does not answer is left as it is: the
    tests that need it fail with the usual message."""
    for db, base in list(DEFAULT_URLS.items()):
        if reachable(base):
            continue
        url = sa.make_url(base)
        own = f"{url.database}_{run_id()}_{name}"
        admin = _admin(base)
        try:
            with admin.connect() as conn:
                if db == "postgresql":
                    exists = conn.execute(
                        sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": own}
                    ).first()
                    if not exists:
                        _create(conn, f'CREATE DATABASE "{own}"')
                else:
                    conn.execute(
                        sa.text(f"CREATE DATABASE IF NOT EXISTS `{own}` CHARACTER SET utf8mb4")
                    )
        finally:
            admin.dispose()
        DEFAULT_URLS[db] = url.set(database=own).render_as_string(hide_password=False)
        os.environ[ENVIRONMENT[db]] = DEFAULT_URLS[db]


def _create(conn: sa.Connection, statement: str) -> None:
    # Two CREATE DATABASE at once can meet on template1 ("being accessed by
    # other users" while the other copies it): try again for a while.
    for attempt in range(20):
        try:
            conn.execute(sa.text(statement))
            return
        except sa.exc.OperationalError:
            if attempt == 19:
                raise
            time.sleep(0.25)


def drop_own_databases(name: str) -> None:
    """At the worker's end: its databases go (sessions still on them, such as
    a process a failed test left behind, are ended)."""
    for db, url in DEFAULT_URLS.items():
        parsed = sa.make_url(url)
        if not (parsed.database or "").endswith(f"_{run_id()}_{name}"):
            continue
        base = parsed.set(database="postgres" if db == "postgresql" else None)
        admin = _admin(base.render_as_string(hide_password=False))
        try:
            name_sql = f'"{parsed.database}"' if db == "postgresql" else f"`{parsed.database}`"
            force = " WITH (FORCE)" if db == "postgresql" else ""
            with admin.connect() as conn:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name_sql}{force}"))
        except Exception as exc:  # the run's outcome is the tests', not the tidying's
            warnings.warn(f"could not drop {parsed.database} on {db}: {exc}", stacklevel=1)
        finally:
            admin.dispose()


def group(items: list[pytest.Item]) -> None:
    """Mark each test with its xdist group: its file, or the clusters' group."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        name = "clusters" if any(f in fixtures for f in CLUSTERS) else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(name))
