"""A day of churn (issue 35): the lock table's storage parameters, what
``dblock stats`` says of dead rows and purge lag, and the sweeper's VACUUM.

The shared PostgreSQL runs with autovacuum off, so dead rows made here stay
until something vacuums them; the private PostgreSQL 18 has it on, so each
test that counts dead rows turns it off for its own table first.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from dblock import LockBusy, LockManager, migrations
from dblock._store.admin import TableHealth
from dblock.schema import CHURN_STORAGE, TableNames
from dblock.sweeper import Sweeper
from tests.conftest import ALSO_PG18
from tests.support.cli import dblock

PG = ("postgresql", "postgresql18")
pytestmark = pytest.mark.databases(*ALSO_PG18)


def reloptions(manager: LockManager) -> dict[str, str]:
    with manager.engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT reloptions FROM pg_class WHERE oid = to_regclass(:t)"),
            {"t": manager.config.table},
        ).scalar()
    return dict(option.split("=", 1) for option in found or [])


def make_dead_rows(manager: LockManager, n: int) -> None:
    """``n`` rows inserted and deleted: what ``n`` grants and releases leave."""
    t = manager.config.table
    seq = manager.names.sequence
    engine = manager.engine
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"INSERT INTO {t} (lock_key, owner, token, fence, acquired_at, expires_at) "
            f"SELECT 'dead:' || i, 'soak', md5(i::text), nextval('{seq}'), now(), now() "
            f"FROM generate_series(1, {n}) AS i"
        )
    with engine.begin() as conn:
        conn.exec_driver_sql(f"DELETE FROM {t} WHERE lock_key LIKE 'dead:%%'")
    # The backend sends its statistics within seconds of going idle: wait_health.


def wait_health(
    manager: LockManager, until: Callable[[TableHealth], bool], timeout: float = 20.0
) -> TableHealth:
    deadline = time.monotonic() + timeout
    while True:
        health = manager.store.table_health()
        assert health is not None
        if until(health) or time.monotonic() > deadline:
            return health
        time.sleep(0.2)


@pytest.fixture
def no_autovacuum(private: LockManager) -> LockManager:
    with private.engine.begin() as conn:
        conn.exec_driver_sql(f"ALTER TABLE {private.config.table} SET (autovacuum_enabled = false)")
    return private


# -- the storage parameters -----------------------------------------------------------


@pytest.mark.databases(*PG)
def test_a_new_lock_table_has_the_churn_storage_parameters(private: LockManager) -> None:
    assert reloptions(private) == CHURN_STORAGE


def test_the_newest_schema_made_in_one_go_has_them_too() -> None:
    """What the Django migration's 0001 runs on a fresh database (create_statements at head)."""
    from dblock.contrib.django import _ddl
    from dblock.schema import create_statements

    def storage(dialect: str, revision: str = "0005") -> list[str]:
        made = create_statements(TableNames(), dialect, revision=revision)
        return [str(s) for s in made if "autovacuum" in str(s)]

    assert len(storage("postgresql")) == 1
    assert all(f"{k} = {v}" in storage("postgresql")[0] for k, v in CHURN_STORAGE.items())
    assert storage("postgresql", "0004") == []
    assert storage("mysql") == storage("sqlite") == []
    assert any(
        "autovacuum_vacuum_threshold" in sql for sql in _ddl.create_sql("postgresql", TableNames())
    )


@pytest.fixture
def names(db_url: str) -> Iterator[TableNames]:
    made = TableNames(table=f"dblock_c_{uuid.uuid4().hex[:8]}")
    yield made
    with LockManager(db_url, table=made.table) as m:
        migrations.downgrade(m.engine, made, "base")


def test_migration_0005_sets_them_on_a_table_holding_locks_and_back(
    db: str, db_url: str, names: TableNames
) -> None:
    with LockManager(db_url, table=names.table) as m:
        migrations.upgrade(m.engine, names, "0004")
        if db.startswith("postgresql"):
            assert reloptions(m) == {}
        held = m.acquire("churn:held", ttl=300)
        migrations.upgrade(m.engine, names)  # to head: 0005
        assert migrations.current(m.engine, names) == "0005"
        if db.startswith("postgresql"):
            assert reloptions(m) == CHURN_STORAGE
        with LockManager(db_url, table=names.table) as other, pytest.raises(LockBusy):
            other.acquire("churn:held", blocking=False)
        assert held.release()
        migrations.downgrade(m.engine, names, "0004")
        if db.startswith("postgresql"):
            assert reloptions(m) == {}


# -- what stats say ---------------------------------------------------------------------


def test_health_figures_warn_of_dead_rows_autovacuum_off_and_purge_lag() -> None:
    assert TableHealth(size_bytes=1, dead_rows=500, live_rows=10, autovacuum=True).warnings == []
    bloated = TableHealth(dead_rows=50_000, live_rows=300, autovacuum=True).warnings
    assert len(bloated) == 1
    assert "50000 dead rows to 300 live" in bloated[0]
    # Many dead rows beside many live ones: a big table, not bloat.
    assert TableHealth(dead_rows=50_000, live_rows=10_000, autovacuum=True).warnings == []
    assert "autovacuum is off" in TableHealth(autovacuum=False).warnings[0]
    assert "purge lags 2000000" in TableHealth(purge_lag=2_000_000).warnings[0]
    assert TableHealth(purge_lag=1000).warnings == []


@pytest.mark.databases(*PG)
def test_stats_show_size_dead_rows_autovacuum_and_warn(
    db_url: str, no_autovacuum: LockManager
) -> None:
    m = no_autovacuum
    make_dead_rows(m, 12_000)
    health = wait_health(m, lambda h: (h.dead_rows or 0) >= 12_000)
    assert health.dead_rows is not None
    assert health.dead_rows >= 12_000
    assert health.size_bytes is not None
    assert health.size_bytes > 1_000_000
    assert health.autovacuum is False
    assert any("autovacuum is off" in w for w in health.warnings)
    assert any("dead rows to" in w for w in health.warnings)
    assert m.store.stats(storage=True).table is not None
    assert m.store.stats().table is None  # the counts alone unless asked (dblock list's)

    done = dblock("stats", "--url", db_url, "--table", m.config.table)
    assert done.returncode == 0, done.stderr
    assert "MB (table and indexes)" in done.stdout
    assert "dead" in done.stdout
    assert "autovacuum OFF" in done.stdout
    assert "warning: autovacuum is off for this table" in done.stdout
    assert "dead rows to" in done.stdout

    done = dblock("stats", "--json", "--url", db_url, "--table", m.config.table)
    storage = json.loads(done.stdout)["storage"]
    assert storage["dead_rows"] >= 12_000
    assert storage["autovacuum"] is False
    assert len(storage["warnings"]) == 2


@pytest.mark.databases("mariadb")
def test_stats_show_size_and_purge_lag_on_mariadb(db_url: str, private: LockManager) -> None:
    with private.lock("churn:one"):
        pass
    health = private.store.stats(storage=True).table
    assert health is not None
    assert health.size_bytes is not None
    assert health.size_bytes > 0
    assert health.purge_lag is not None
    assert health.purge_lag >= 0
    assert health.dead_rows is None
    done = dblock("stats", "--url", db_url, "--table", private.config.table)
    assert "purge lag" in done.stdout
    assert "B (table and indexes)" in done.stdout  # kB or MB


@pytest.mark.databases("sqlite")
def test_stats_say_nothing_of_storage_on_sqlite(db_url: str, private: LockManager) -> None:
    assert private.store.stats(storage=True).table is None
    done = dblock("stats", "--json", "--url", db_url, "--table", private.config.table)
    assert "storage" not in json.loads(done.stdout)


# -- the sweeper's VACUUM ----------------------------------------------------------------


@pytest.mark.databases(*PG)
def test_the_sweeper_vacuums_the_table_once_dead_rows_pass_its_threshold(
    no_autovacuum: LockManager,
) -> None:
    m = no_autovacuum
    sweeper = Sweeper(m, vacuum_dead=5000)
    make_dead_rows(m, 2000)
    before = wait_health(m, lambda h: (h.dead_rows or 0) >= 2000)
    assert before.dead_rows is not None
    assert 2000 <= before.dead_rows < 5000
    assert not sweeper.run_once().vacuumed  # below the threshold

    make_dead_rows(m, 4000)
    wait_health(m, lambda h: (h.dead_rows or 0) >= 6000)
    result = sweeper.run_once()
    assert result.vacuumed
    assert "vacuumed the table" in result.describe()
    after = wait_health(m, lambda h: (h.vacuum_count or 0) > (before.vacuum_count or 0))
    assert after.vacuum_count == (before.vacuum_count or 0) + 1
    assert after.last_vacuum is not None
    assert (after.dead_rows or 0) < 1000


@pytest.mark.databases(*PG)
def test_a_sweeper_told_not_to_vacuum_leaves_it_to_autovacuum(no_autovacuum: LockManager) -> None:
    m = no_autovacuum
    make_dead_rows(m, 3000)
    wait_health(m, lambda h: (h.dead_rows or 0) >= 3000)
    assert not Sweeper(m, vacuum_dead=None).run_once().vacuumed
    health: Any = m.store.table_health()
    assert health.vacuum_count == 0


@pytest.mark.databases(*PG)
def test_dblock_sweep_vacuums_or_not_as_told(db_url: str, no_autovacuum: LockManager) -> None:
    m = no_autovacuum
    make_dead_rows(m, 1500)
    wait_health(m, lambda h: (h.dead_rows or 0) >= 1500)
    on = ("--url", db_url, "--table", m.config.table)
    done = dblock("sweep", "--once", "--vacuum-dead", "off", *on)
    assert done.returncode == 0, done.stderr
    assert "vacuumed" not in done.stdout
    done = dblock("sweep", "--once", *on)  # the default: 1000 dead rows
    assert done.returncode == 0, done.stderr
    assert "vacuumed the table" in done.stdout
    assert dblock("sweep", "--once", "--vacuum-dead", "-1", *on).returncode == 2
