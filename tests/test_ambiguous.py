"""A connection that breaks while the acquire statement is in flight.

A TCP proxy between dblock and the real server cuts the connection at the
worst moment: after the server ran the INSERT, before its answer arrives.
The lock's token then decides, on a new connection, whether we hold it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from dblock import BackendError, LockManager
from tests.conftest import row_of
from tests.support.proxy import Proxy

pytestmark = pytest.mark.databases("postgresql", "mariadb")


@pytest.fixture
def proxy(db_url: str) -> Iterator[Proxy]:
    url = sa.make_url(db_url)
    default_port = 5432 if url.get_backend_name() == "postgresql" else 3306
    p = Proxy(url.host or "127.0.0.1", url.port or default_port)
    yield p
    p.close()


@pytest.fixture
def proxied(db_url: str, proxy: Proxy) -> Iterator[LockManager]:
    m = LockManager(proxy.url_for(db_url))
    yield m
    m.close()


def test_cut_after_insert_committed_we_hold_it(
    proxied: LockManager, proxy: Proxy, key: str
) -> None:
    fired = proxy.cut_after(key.encode())
    held = proxied.acquire(key, timeout=30)
    assert fired.is_set()  # the statement ran and its answer was lost
    row = row_of(proxied, key)
    assert row is not None
    assert row.token == held.token
    assert row.fence == held.fence
    assert held.release() is True  # no LockLost: it really was ours
    assert row_of(proxied, key) is None
    assert not proxied.store.has_orphans


def test_cut_before_insert_we_insert_again(proxied: LockManager, proxy: Proxy, key: str) -> None:
    fired = proxy.cut_before(key.encode())
    with proxied.lock(key, blocking=False) as held:
        assert fired.is_set()
        row = row_of(proxied, key)
        assert row is not None
        assert row.token == held.token
    assert row_of(proxied, key) is None


def test_cut_then_unreachable_leaves_no_orphan(
    proxied: LockManager, proxy: Proxy, db_url: str, key: str
) -> None:
    """The INSERT committed, then the database became unreachable: the caller
    is told it failed, and the row is deleted as soon as the database answers,
    not left for the sweeper."""
    with proxied.lock(key + ":warm-up"):  # a pooled connection to cut
        pass
    fired = proxy.cut_after(key.encode())
    proxy.refuse(True)
    with pytest.raises(BackendError, match="learn the outcome"):
        proxied.acquire(key, timeout=30)
    assert fired.is_set()
    with LockManager(db_url) as direct:
        assert row_of(direct, key) is not None  # committed, in doubt
        assert proxied.store.has_orphans
        assert len(proxied._locker.registry) == 0
        proxy.refuse(False)
        # The next use of the manager cleans up before it does anything else.
        with proxied.lock(key + ":other"):
            pass
        assert not proxied.store.has_orphans
        assert row_of(direct, key) is None


def test_release_on_broken_connection_is_logged_and_leaves_row(
    proxied: LockManager, proxy: Proxy, db_url: str, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    held = proxied.acquire(key)
    proxy.cut_all()
    proxy.refuse(True)
    assert held.release() is False
    assert any(key in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)
    assert len(proxied._locker.registry) == 0  # freed locally anyway
    with LockManager(db_url) as direct:
        assert row_of(direct, key) is not None  # left to its lease and the sweeper
    proxy.refuse(False)
