"""One suite over the real databases.

Every test that takes ``db_url`` (or ``manager``) runs on SQLite, PostgreSQL
and MariaDB. An unreachable server is a failure, not a skip: set
``DBLOCK_TEST_POSTGRESQL_URL`` / ``DBLOCK_TEST_MYSQL_URL`` to point elsewhere,
or pass ``--db sqlite`` to choose databases explicitly for a local run.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from dblock import LockManager
from tests.support.counting import StatementCounter
from tests.support.db import DEFAULT_URLS, reachable
from tests.support.patroni import PrivatePatroni
from tests.support.servers import PrivateGalera, PrivatePostgresPair
from tests.support.workers import drop_own_databases, group, use_own_databases, worker

DATABASES = ("sqlite", "postgresql", "mariadb")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--db",
        action="append",
        choices=DATABASES,
        help="run the database-parametrised tests on these only (default: all three)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "databases(*names): run this test on these databases only")
    name = worker()
    if name is not None:  # one of scripts/test's xdist workers: see tests/support/workers.py
        use_own_databases(name)


def pytest_unconfigure(config: pytest.Config) -> None:
    name = worker()
    if name is not None:
        drop_own_databases(name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group(items)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "db" in metafunc.fixturenames:
        chosen = metafunc.config.getoption("--db") or list(DATABASES)
        marker = metafunc.definition.get_closest_marker("databases")
        wanted = marker.args if marker else DATABASES
        metafunc.parametrize("db", [d for d in chosen if d in wanted], indirect=True)


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'dblock-test.sqlite3'}"


@pytest.fixture(scope="session")
def _migrated() -> set[str]:
    return set()


@pytest.fixture
def db(request: pytest.FixtureRequest) -> str:
    """The database name of this parametrisation."""
    return str(request.param)


@pytest.fixture
def db_url(db: str, sqlite_url: str, _migrated: set[str]) -> str:
    url = sqlite_url if db == "sqlite" else DEFAULT_URLS[db]
    if db not in _migrated:
        problem = reachable(url)
        if problem:
            pytest.fail(f"{db} is required by the test suite and unreachable: {problem}")
        with LockManager(url) as m:
            m.create_schema()
        _migrated.add(db)
    return url


@pytest.fixture
def manager(db_url: str) -> Iterator[LockManager]:
    m = LockManager(db_url)
    yield m
    m.close()


@pytest.fixture
def private(db_url: str) -> Iterator[LockManager]:
    """A manager on a lock table of its own, created for this test and dropped
    after it: for tests that count, list, sweep or delete rows table-wide.
    Its locks are not renewed, so a lease runs out as a crashed holder's does."""
    table = f"dblock_t_{uuid.uuid4().hex[:8]}"
    m = LockManager(db_url, table=table, renew=False)
    m.create_schema()
    yield m
    m.close()
    with LockManager(db_url, table=table) as admin:
        admin.drop_schema()


@pytest.fixture
def make_manager(db_url: str) -> Iterator[object]:
    """A factory for extra managers on the same database (closed after the test)."""
    made: list[LockManager] = []

    def make(**options: object) -> LockManager:
        m = LockManager(db_url, **options)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


@pytest.fixture(scope="session")
def galera() -> Iterator[PrivateGalera]:
    """A private 3-node Galera cluster for the whole session, with the lock
    table created (through node 0; Galera replicates DDL). Started on first
    use (~15 s), stopped at the end. A test that stops a node starts it again."""
    cluster = PrivateGalera(3)
    try:
        with LockManager(cluster.nodes[0].url) as m:
            m.create_schema()
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def patroni() -> Iterator[PrivatePatroni]:
    """A private Patroni cluster (etcd x3, PostgreSQL x2 under Patroni in
    synchronous mode, HAProxy) for the session: started on first use
    (~10 s; Debian's etcd-server, patroni and haproxy are installed first if
    missing), stopped at the end. A test that injects a fault waits until the
    cluster is healthy again (a leader, a synchronous standby) before the next."""
    cluster = PrivatePatroni(2)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="session")
def pg_pair() -> Iterator[PrivatePostgresPair]:
    """A private PostgreSQL primary with a synchronous standby, for the
    session. A test that fails over calls ``pg_pair.reset()`` to rebuild it."""
    pair = PrivatePostgresPair()
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture
def key(request: pytest.FixtureRequest) -> str:
    """A lock key no other test (or earlier run) uses."""
    return f"t:{request.node.name[:150]}:{uuid.uuid4().hex[:12]}"


@pytest.fixture
def keys(request: pytest.FixtureRequest) -> object:
    prefix = f"t:{request.node.name[:120]}:{uuid.uuid4().hex[:12]}"

    def make(n: int) -> list[str]:
        return [f"{prefix}:{i}" for i in range(n)]

    return make


@pytest.fixture
def count_statements() -> object:
    """``with count_statements(engine) as c: ...; c.count``"""
    return StatementCounter


@pytest.fixture(autouse=True)
def _no_env_url(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DBLOCK_URL", raising=False)


def row_of(manager: LockManager, key: str) -> sa.Row[tuple[object, ...]] | None:
    table = manager.store.table
    with manager.engine.connect() as conn:
        return conn.execute(sa.select(table).where(table.c.lock_key == key)).first()


os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def wait_queued(manager: LockManager, key: str, n: int) -> None:
    """Until ``n`` threads of ``manager`` are queued in level 1 for ``key``."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        entry = manager._locker.registry.get(key)
        if entry is not None and len(entry.queue) >= n:
            return
        time.sleep(0.001)
    raise AssertionError(f"{n} waiters never queued")
