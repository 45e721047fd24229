"""dblock on mysqlclient (``mysql+mysqldb://``), the C driver for MySQL and
MariaDB, beside PyMySQL (the default, pure Python; the rest of the suite).

mysqlclient does its protocol work in C with the GIL released, where
PyMySQL spends half of the GIL's time with one process of eight threads
(issue 34). The store speaks both through one DBAPI path; these tests drive
what differs between drivers on a real server: the lone request's one
statement each way, a waiter of another process woken by the named lock
(the waker's own connections, ``thread_id()``), a half-open connection and
a stuck batch that must not hold up the process nor outlive a timeout.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from benchmarks.turn import measure
from dblock import LockManager
from tests import test_stuck_statement
from tests.support.counting import StatementCounter

pytestmark = pytest.mark.databases("mariadb")


@pytest.fixture
def mdb_url(db_url: str) -> str:
    if importlib.util.find_spec("MySQLdb") is None:
        pytest.fail(
            "mysqlclient is not installed: scripts/_venv.sh builds it "
            "(it needs libmariadb-dev, pkg-config and gcc: apt-get install them)"
        )
    return sa.make_url(db_url).set(drivername="mysql+mysqldb").render_as_string(False)


@pytest.fixture
def make_mdb(mdb_url: str) -> Iterator[Callable[..., LockManager]]:
    made: list[LockManager] = []

    def make(**options: object) -> LockManager:
        m = LockManager(mdb_url, **options)  # type: ignore[arg-type]
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def test_the_lone_request_is_one_statement_each_way(
    make_mdb: Callable[..., LockManager], key: str
) -> None:
    manager = make_mdb()
    assert manager.engine.dialect.driver == "mysqldb"
    with manager.lock(key) as first:  # warm up: connection, server capabilities
        pass
    with StatementCounter(manager.engine) as c:
        held = manager.acquire(key)
        assert c.count == 1
        assert held.fence > first.fence
        held.release()
        assert c.count == 2


def test_a_waiter_of_another_process_is_woken_and_gets_its_turn(mdb_url: str) -> None:
    """A spawned process waits for a key eleven threads here hand on: woken
    through the named lock (the waker's own mysqlclient connections), it
    gets the key every time. (Not within one run: on MySQL/MariaDB a remote
    waiter can still lose a few races in a row, up to 49 local grants on a
    quiet machine; see test_turn.py.)"""
    counts = measure(mdb_url, runs=5, threads=11, handoff_limit=8)
    assert len(counts) == 5
    assert max(counts) < 500, counts  # woken each time, not starved


def test_a_half_open_connection_holds_up_no_other_request(
    mdb_url: str, make_mdb: Callable[..., LockManager], key: str
) -> None:
    test_stuck_statement.test_a_half_open_connection_holds_up_no_other_request(
        mdb_url, make_mdb, key
    )


def test_a_request_in_a_stuck_batch_leaves_at_its_deadline(
    mdb_url: str, make_mdb: Callable[..., LockManager], key: str
) -> None:
    test_stuck_statement.test_a_request_in_a_stuck_batch_leaves_at_its_deadline(
        mdb_url, make_mdb, key
    )
