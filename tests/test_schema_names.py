"""Every table name the docs allow works on every database (issue 9, item 13):
the longest one (derived names shortened deterministically), reserved words
and mixed case (every identifier quoted in all DDL); and a failed migration
leaves nothing half-made."""

from __future__ import annotations

import string
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from dblock import BackendError, LockArgumentError, LockBusy, LockManager
from dblock._store import Grant
from dblock.config import Config
from dblock.contrib.django import _ddl
from dblock.schema import MAX_IDENTIFIER, TableNames
from dblock.sweeper import Sweeper
from tests.support.db import private_database
from tests.support.rows import insert_expired

LONGEST = 51  # what Config allows: a letter or _, then up to 50 letters, digits or _


@pytest.fixture
def own_db(db: str, tmp_path: Path) -> Iterator[str]:
    """A database of its own: reserved-word table names cannot collide with
    anyone else's tests on the shared servers."""
    with private_database(db, tmp_path) as url:
        yield url


def _longest() -> str:
    name = f"dblock_{uuid.uuid4().hex}_"
    return name + "x" * (LONGEST - len(name))


def _tables(url: str) -> set[str]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_config_allows_what_the_docs_say() -> None:
    Config(table="a" * LONGEST)
    Config(table="_" + string.ascii_letters[:50])
    for bad in ("a" * (LONGEST + 1), "1abc", "a-b", "a b", ""):
        with pytest.raises(LockArgumentError, match="at most 51 characters"):
            Config(table=bad)


def test_derived_names_fit_every_database_and_are_stable() -> None:
    long = "t" * LONGEST
    names = TableNames(table=long)
    for name in names.all():
        assert len(name) <= MAX_IDENTIFIER, name
    # alembic names the version table's primary key <version_table>_pkc.
    assert len(names.version_table + "_pkc") <= MAX_IDENTIFIER
    assert len(set(names.all())) == len(names.all())
    assert TableNames(table=long).all() == names.all()  # deterministic
    other = TableNames(table="t" * (LONGEST - 1) + "u")
    assert other.expires_index != names.expires_index  # distinct tables, distinct names
    # Names that fit are what they always were (existing schemas keep theirs).
    short = TableNames(table="dblock_locks")
    assert short.expires_index == "dblock_locks_expires_at_idx"
    assert short.sequence == "dblock_locks_fence_seq"
    assert short.triggers == ("dblock_locks_fence_on_insert", "dblock_locks_fence_on_update")
    assert short.version_table == "dblock_locks_version"


@pytest.mark.parametrize(
    "table",
    [
        pytest.param("LONGEST", id="longest"),
        pytest.param("order", id="order"),
        pytest.param("select", id="select"),
        pytest.param("MixedCase_Locks", id="mixed-case"),
    ],
)
def test_every_allowed_table_name_works(own_db: str, db: str, table: str, key: str) -> None:
    table = _longest() if table == "LONGEST" else table
    before = _tables(own_db)
    with LockManager(own_db, table=table, renew=False) as m:
        m.create_schema()
        m.create_schema()  # up to date: a no-op
        names = m.names
        assert table in _tables(own_db)
        # Every statement dblock runs on the table: acquire, contention (the
        # holder read), hand-over, renewal, release, list, stats, sweep.
        with LockManager(own_db, table=table) as other:
            token = uuid.uuid4().hex
            first = m.store.try_acquire(key, token, "me", 30.0)
            assert isinstance(first, Grant)
            with pytest.raises(LockBusy):
                other.acquire(key, blocking=False)
            if m.store.can_transfer:
                new_token = uuid.uuid4().hex
                assert m.store.transfer(key, token, new_token, "me", 30.0) is not None
                token = new_token
            assert len(m.store.renew([(key, token, 30.0)])) == 1
            assert m.store.release(key, token)
            with other.lock(key, blocking=False) as again:
                assert again.fence > first.fence
        insert_expired(m, [f"{key}:old"])
        assert [r.key for r in m.store.rows()] == [f"{key}:old"]
        assert m.store.stats().expired == 1
        assert Sweeper(m, grace=0).run_once().expired == 1
        m.drop_schema()
    assert _tables(own_db) == before
    if db == "postgresql":
        engine = sa.create_engine(own_db, poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            left = conn.exec_driver_sql(
                "SELECT relname FROM pg_class WHERE relname = %(n)s", {"n": names.sequence}
            ).all()
        engine.dispose()
        assert left == []


@pytest.mark.parametrize("table", ["order", "select", "MixedCase_Locks", "t" * LONGEST])
def test_django_migration_sql_quotes_and_shortens(table: str) -> None:
    names = TableNames(table=table)
    for vendor in ("postgresql", "mysql", "sqlite"):
        sql = "\n".join(_ddl.create_sql(vendor, names) + _ddl.drop_sql(vendor, names))
        assert names.expires_index in sql
        if vendor == "sqlite":
            assert f'ON "{table}"' in sql
            assert f'"{names.triggers[0]}"' in sql


def test_a_failed_migration_leaves_nothing_half_made(own_db: str, db: str) -> None:
    """The version table is in the way (a NOT NULL column alembic does not
    fill), so the migration fails at its last step, after creating the lock
    table: on MariaDB and SQLite that DDL was already committed."""
    table = f"dblock_{uuid.uuid4().hex[:8]}"
    names = TableNames(table=table)
    engine = sa.create_engine(own_db, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE TABLE {names.version_table} "
            "(version_num VARCHAR(32) NOT NULL PRIMARY KEY, extra INTEGER NOT NULL)"
        )
    before = _tables(own_db)
    try:
        with (
            LockManager(own_db, table=table) as m,
            pytest.raises(BackendError, match=r"migration on .* failed"),
        ):
            m.create_schema()
        assert _tables(own_db) == before  # the lock and fence tables are gone again
        assert names.version_table in before  # not ours: left alone
    finally:
        engine.dispose()
