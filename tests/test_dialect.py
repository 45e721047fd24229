"""One dialect object per store: what dblock decides by the database it speaks
to is decided once (from the URL's name, then from the server at its first
connection) and read from ``Store.dialect``; ``mariadb://`` is the MySQL
family, one way."""

from __future__ import annotations

import uuid

import pytest
import sqlalchemy as sa

from dblock import LockManager
from dblock._engine import Dialect, dialect_of
from dblock._hooks import lock_statements
from dblock.errors import LockArgumentError
from tests.test_hooks import _run


def test_names_map_to_one_family_each() -> None:
    assert dialect_of("postgresql").family == "postgresql"
    assert dialect_of("sqlite").family == "sqlite"
    mysql, mariadb = dialect_of("mysql"), dialect_of("mariadb")
    assert (mysql.family, mariadb.family) == ("mysql", "mysql")
    assert mariadb.name == "mariadb"
    # The same facts but the name: MariaDB is handled the MySQL way.
    assert dataclass_facts(mariadb) == dataclass_facts(mysql)
    assert dialect_of(sa.make_url("mariadb+pymysql://u@h/db")) is mariadb


def dataclass_facts(dialect: Dialect) -> tuple[object, ...]:
    return (dialect.family, dialect.file, dialect.charset, dialect.lease_us, dialect.known)


def test_what_only_the_server_says_is_unknown_until_it_said_it() -> None:
    assert dialect_of("postgresql").known
    assert dialect_of("sqlite").known
    mysql = dialect_of("mysql")
    assert not mysql.known
    assert mysql.galera is None
    met = mysql.connected(returning=True, galera=False, server_version="10.11.6-MariaDB")
    assert met.known
    assert met.returning
    assert met.name == "mysql"
    assert not mysql.known  # frozen: the store keeps the copy


def test_pick_chooses_by_family() -> None:
    choices = {"postgresql": 1, "mysql": 2, "sqlite": 3}
    for name, family in [("postgresql", 1), ("mysql", 2), ("mariadb", 2), ("sqlite", 3)]:
        assert dialect_of(name).pick(**choices) == family


def test_lease_params_in_the_unit_of_the_statement() -> None:
    assert dialect_of("postgresql").lease_params(1.5) == {"ttl": 1.5}
    assert dialect_of("mariadb").lease_params(1.5) == {"ttl_us": 1_500_000}


def test_unknown_dialect_refused() -> None:
    with pytest.raises(LockArgumentError, match="does not support"):
        dialect_of("oracle")


def test_store_reads_its_dialect_once(manager: LockManager) -> None:
    store = manager.store
    assert store.dialect.name == manager.dialect
    with manager.lock(f"dialect:{uuid.uuid4().hex[:8]}"):
        pass
    met = store.dialect
    assert met.known
    assert store.known_dialect() is met  # not read again


@pytest.mark.databases("mariadb")
def test_mariadb_url_speaks_the_mysql_way(db_url: str) -> None:
    """A ``mariadb+pymysql://`` URL: the MySQL store, its server facts, and
    the exclusive lock's statements for the benchmark's hooks (which once
    looked for statements the MySQL store does not have)."""
    url = sa.make_url(db_url).set(drivername="mariadb+pymysql")
    manager = LockManager(url)
    try:
        assert manager.dialect == "mariadb"
        store = manager.store
        assert store.dialect.family == "mysql"
        sql = lock_statements(manager)
        assert store.dialect.known
        assert store.dialect.server_version
        assert sql.returning is bool(store.dialect.returning)
        key = f"dialect:{uuid.uuid4().hex[:8]}"
        token = uuid.uuid4().hex
        params = {"key": key, "owner": "test", "token": token, **sql.acquire_params(30.0)}
        assert sql.granted(*_run(manager, sql.acquire, params, True), token)
        assert manager.is_locked(key)
        _run(manager, sql.release, {"key": key, "token": token, **sql.release_params}, False)
        assert not manager.is_locked(key)
        with manager.lock(key, blocking=False) as held:
            assert held.fence > 0
    finally:
        manager.close()
