"""A release by owner matches that owner exactly (issue 32, defect 3).

On MySQL/MariaDB the ``owner`` column had the table's default collation
(``utf8mb4_general_ci``), so ``dblock release --owner deadhost:999`` also
released the rows of ``DEADHOST:999:T`` and ``deadhöst:999:T``. Since
revision 0004 it has ``utf8mb4_bin``, as the key has, and
the filter compares lengths too, so a trailing space counts (``utf8mb4_bin``
is a PAD SPACE collation). Checked on every database through ``dblock
release``, the store's own ``rows``, for a new table and for one migrated
from the previous revision (by alembic and by the Django migration's SQL).
The Flask and Django commands: tests/test_flask.py, tests/test_django.py.
"""

from __future__ import annotations

import types
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from dblock import LockManager, migrations
from dblock.contrib.django import _ddl
from dblock.schema import HEAD_REVISION, OWNER_REVISION, TableNames
from tests.support.cli import dblock
from tests.support.db import private_database
from tests.support.owners import EXACT, OTHERS, held_keys, hold_rows


def owner_collation(engine: sa.Engine, table: str) -> str | None:
    """MySQL/MariaDB: the ``owner`` column's collation."""
    with engine.connect() as conn:
        return conn.execute(
            sa.text(
                "SELECT collation_name FROM information_schema.COLUMNS WHERE "
                "table_schema = DATABASE() AND table_name = :t AND column_name = 'owner'"
            ),
            {"t": table},
        ).scalar_one_or_none()


def test_rows_by_owner_are_exact(private: LockManager) -> None:
    tag = uuid.uuid4().hex[:8]
    hold_rows(private, tag)
    rows = private.store.rows(owner="deadhost:999")
    assert sorted(row.owner for row in rows) == sorted(EXACT)
    for owner in OTHERS:
        assert [row.owner for row in private.store.rows(owner=owner)] == [owner]


def test_dblock_release_by_owner_takes_only_that_owner(db_url: str, private: LockManager) -> None:
    tag = uuid.uuid4().hex[:8]
    hold_rows(private, tag)
    on = ("--url", db_url, "--table", private.config.table)
    done = dblock("release", "--owner", "deadhost:999", "--force", "--yes", *on)
    assert done.returncode == 0, done.stderr
    # (who released them follows: "; by user@host")
    assert done.stdout.strip().startswith("released 2 rows held by 'deadhost:999'; by "), (
        done.stdout
    )
    assert held_keys(private, tag) == set(OTHERS.values())


@pytest.fixture
def table_at_0003(db: str, tmp_path: Path) -> Iterator[tuple[str, TableNames]]:
    """A database of its own with a lock table made by the previous revision."""
    names = TableNames(table=f"dblock_ow_{uuid.uuid4().hex[:8]}")
    with private_database(db, tmp_path) as url:
        with LockManager(url, table=names.table) as m:
            migrations.upgrade(m.engine, names, "0003")
        yield url, names


def test_migrating_an_old_table_makes_owners_exact(
    db: str, table_at_0003: tuple[str, TableNames]
) -> None:
    url, names = table_at_0003
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with LockManager(url, table=names.table) as m:
            hold_rows(m, "old")
            if db == "mariadb":  # the old table's owner: the database's default collation
                assert owner_collation(engine, names.table) == "utf8mb4_general_ci"
                assert len(m.store.rows(owner="deadhost:999")) > len(EXACT)  # the defect
            m.create_schema()
            assert migrations.current(m.engine, names) == HEAD_REVISION
            if db == "mariadb":
                assert owner_collation(engine, names.table) == "utf8mb4_bin"
            # Held locks stay held, and only the exact owner's rows match.
            assert held_keys(m, "old") == set(OTHERS.values()) | set(EXACT.values())
            assert sorted(r.owner for r in m.store.rows(owner="deadhost:999")) == sorted(EXACT)
            if db == "mariadb":
                # The lock statements still find their row by the primary key.
                with engine.connect() as conn:
                    plan = (
                        conn.execute(
                            sa.text(
                                f"EXPLAIN SELECT token FROM {names.table} "
                                "WHERE lock_key = 'old:exact' AND slot = ''"
                            )
                        )
                        .mappings()
                        .one()
                    )
                assert plan["key"] == "PRIMARY", plan
            # And back: the downgrade restores the old collation, rows kept.
            migrations.downgrade(m.engine, names, "0003")
            if db == "mariadb":
                assert owner_collation(engine, names.table) == "utf8mb4_general_ci"
            assert len(m.store.rows(prefix="old:")) == len(OTHERS) + len(EXACT)
            m.create_schema()
            assert migrations.current(m.engine, names) == HEAD_REVISION
    finally:
        engine.dispose()


def test_the_django_migration_sql_makes_owners_exact(
    db: str, table_at_0003: tuple[str, TableNames]
) -> None:
    """The SQL the Django migration ``0004_exact_owner`` runs brings the old
    table where alembic brings it (its DDL compiled for each database)."""
    url, names = table_at_0003
    vendor = {"sqlite": "sqlite", "postgresql": "postgresql", "mariadb": "mysql"}[db]
    connection = types.SimpleNamespace(vendor=vendor)
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            for sql in _ddl.upgrade_0004_sql(connection, names):
                conn.exec_driver_sql(sql)
        with LockManager(url, table=names.table) as m:
            assert migrations.current(m.engine, names) == OWNER_REVISION
            hold_rows(m, "dj")
            assert sorted(r.owner for r in m.store.rows(owner="deadhost:999")) == sorted(EXACT)
        if db == "mariadb":
            assert owner_collation(engine, names.table) == "utf8mb4_bin"
        with engine.begin() as conn:
            for sql in _ddl.downgrade_0004_sql(connection, names):
                conn.exec_driver_sql(sql)
        with LockManager(url, table=names.table) as m:
            assert migrations.current(m.engine, names) == "0003"
        if db == "mariadb":
            assert owner_collation(engine, names.table) == "utf8mb4_general_ci"
    finally:
        engine.dispose()
