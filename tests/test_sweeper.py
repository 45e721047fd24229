"""The sweeper: runs, coordination between sweepers, the schedule, and the
case it was made for (a release that could not reach the database)."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from dblock import DBLockError, LockArgumentError, LockLost, LockManager
from dblock.sweeper import Sweeper, SweeperConfig
from tests.support.cli import dblock, start_dblock
from tests.support.proxy import Proxy
from tests.support.rows import backdate, insert_expired


def _keys_in(manager: LockManager) -> set[str]:
    return {row.key for row in manager.store.rows()}


def _wait_for(condition: object, timeout: float = 60.0, every: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(every)
    return False


@pytest.mark.parametrize(
    ("options", "message"),
    [
        pytest.param({"interval": 0}, "interval", id="interval-zero"),
        pytest.param({"grace": -1}, "grace", id="grace-negative"),
        pytest.param({"grace": "5"}, "grace", id="grace-string"),
        pytest.param({"max_hold": 5, "lock_ttl": 10}, "max_hold", id="max-hold-below-lock-ttl"),
        pytest.param({"max_hold": -1}, "max_hold", id="max-hold-negative"),
        pytest.param({"batch_size": 0}, "batch_size", id="batch-zero"),
        pytest.param({"batch_size": True}, "batch_size", id="batch-bool"),
        pytest.param({"batch_size": 2.5}, "batch_size", id="batch-float"),
        pytest.param({"lock_ttl": float("nan")}, "lock_ttl", id="lock-ttl-nan"),
        pytest.param({"batchsize": 10}, "unknown sweeper option", id="unknown"),
    ],
)
def test_bad_sweeper_options_refused(options: dict[str, object], message: str) -> None:
    with pytest.raises(LockArgumentError, match=message):
        SweeperConfig.from_options(None, options)


def test_config_is_frozen_and_keyword_only() -> None:
    config = SweeperConfig(grace=1, max_hold=3600)
    assert (config.grace, config.max_hold, config.batch_size) == (1.0, 3600.0, 500)
    with pytest.raises(AttributeError):
        config.grace = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        SweeperConfig(30.0)  # type: ignore[misc]


def test_max_hold_defaults_to_the_managers(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'locks.sqlite3'}"
    with LockManager(url, max_hold=3600) as capped, LockManager(url) as uncapped:
        assert Sweeper(capped).config.max_hold == 3600
        assert Sweeper(capped, max_hold=7200).config.max_hold == 7200
        assert Sweeper(capped, max_hold=None).config.max_hold is None
        assert Sweeper(uncapped).config.max_hold is None


def test_run_sweeps_the_backlog_in_batches(private: LockManager, keys: object) -> None:
    *backlog, live_key = keys(13)  # type: ignore[operator]
    insert_expired(private, backlog)
    live = private.acquire(live_key, ttl=60)
    result = Sweeper(private, grace=0, batch_size=5).run_once()
    assert (result.expired, result.max_hold, result.batches) == (12, 0, 3)
    assert result.complete
    assert result.busy is None
    # Only the live lock is left: the sweeper released its own lock too.
    assert _keys_in(private) == {live_key}
    live.release()


def test_one_sweeper_at_a_time(private: LockManager, make_manager: object, key: str) -> None:
    insert_expired(private, [key])
    other = make_manager(table=private.config.table, client_id="sweeper-b")  # type: ignore[operator]
    sweeper = Sweeper(private, grace=0)
    busy = other.acquire(sweeper.key, ttl=30)  # another sweeper, mid-run
    result = sweeper.run_once()
    assert result.busy is not None
    assert result.busy.startswith("sweeper-b")
    assert result.swept == 0
    assert key in _keys_in(private)
    busy.release()
    assert sweeper.run_once().expired == 1
    assert _keys_in(private) == set()


def test_max_hold_deletions_are_warnings(
    private: LockManager, keys: object, caplog: pytest.LogCaptureFixture
) -> None:
    old_key, young_key = keys(2)  # type: ignore[operator]
    old = private.acquire(old_key, ttl=600)
    backdate(private, old_key, 7300)
    young = private.acquire(young_key, ttl=600)
    with caplog.at_level(logging.INFO, logger="dblock.sweeper"):
        result = Sweeper(private, grace=0, max_hold=7200).run_once()
    assert (result.expired, result.max_hold) == (0, 1)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert repr(old_key) in message
    assert old.owner in message
    assert "held by" in message
    assert " for 730" in message  # its age, in seconds
    assert _keys_in(private) == {young_key}
    with pytest.raises(LockLost):
        old.release()
    young.release()


def test_renewing_holder_learns_at_once_that_its_row_was_swept(
    private: LockManager, make_manager: object, key: str
) -> None:
    """A lock kept alive by renewal but held past max_hold: the sweeper
    deletes it, and the holder's next renewal reports it lost."""
    app = make_manager(table=private.config.table)  # type: ignore[operator]
    lost = threading.Event()
    held = app.acquire(key, ttl=1.5, on_lost=lambda _held: lost.set())
    backdate(private, key, 7300)
    assert Sweeper(private, grace=0, max_hold=7200).run_once().max_hold == 1
    assert lost.wait(30)
    assert held.lost
    with pytest.raises(LockLost):
        held.release()


def test_start_sweeper_in_app_and_close_stops_it(private: LockManager, keys: object) -> None:
    backlog = keys(20)  # type: ignore[operator]
    insert_expired(private, backlog)
    sweeper = private.start_sweeper(interval=0.2, grace=0, batch_size=7)
    assert sweeper.running
    with pytest.raises(DBLockError, match="already runs"):
        private.start_sweeper(interval=1)
    assert _wait_for(lambda: not _keys_in(private))
    # Rows that expire later are swept by later runs.
    late = private.acquire(backlog[0], ttl=0.1)
    assert _wait_for(lambda: not _keys_in(private))
    with pytest.raises(LockLost):
        late.release()
    private.close()
    assert not sweeper.running
    assert not [t for t in threading.enumerate() if t.name == "APScheduler"]


def test_sweeper_stops_cleanly_at_interpreter_exit(db_url: str, private: LockManager) -> None:
    """An application that never closes its manager: the exit hook stops the
    schedule, and the sweeper's lock row is released, not left behind."""
    script = textwrap.dedent(
        f"""
        import logging, time
        from dblock import LockManager
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
        manager = LockManager({db_url!r}, table={private.config.table!r})
        manager.start_sweeper(interval=0.05, grace=0)
        time.sleep(1.0)
        print("leaving without close()", flush=True)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "leaving without close()" in done.stdout
    assert "stopped sweeping" in done.stderr
    assert _keys_in(private) == set()


# -- the case the design was made for --------------------------------------------


@pytest.fixture
def proxy(db_url: str) -> Iterator[Proxy]:
    url = sa.make_url(db_url)
    p = Proxy(url.host or "127.0.0.1", url.port or (5432 if "postgresql" in db_url else 3306))
    yield p
    p.close()


@pytest.mark.databases("postgresql", "mariadb")
def test_release_that_cannot_reach_the_database_is_swept_later(
    db_url: str, private: LockManager, proxy: Proxy, keys: object
) -> None:
    """The release's DELETE fails (database unreachable at that moment) and
    the application never reaches the database again (it stops): the caller
    went on, the row stays until its lease ends, the sweeper removes it then,
    and nothing else is lost. (A manager that does reach the database again
    deletes such a row itself: tests/test_pg_failover.py.)"""
    table = private.config.table
    stranded_key, other_key = keys(2)  # type: ignore[operator]
    app = LockManager(proxy.url_for(db_url), table=table, renew=False)
    try:
        other = private.acquire(other_key, ttl=120)  # another holder, not behind the proxy
        held = app.acquire(stranded_key, ttl=2.0)
        proxy.cut_all()
        proxy.refuse(True)
        assert held.release() is False  # logged, local lock freed
        assert len(app._locker.registry) == 0
        app.close()  # still unreachable: the row is stranded
        proxy.refuse(False)

        sweeper = Sweeper(private, grace=0.5, lock_ttl=5)
        assert stranded_key in _keys_in(private)
        assert sweeper.run_once().expired == 0  # its lease is still running
        assert _keys_in(private) == {stranded_key, other_key}

        time.sleep(3.0)  # the 2 s lease and the 0.5 s grace are over
        assert sweeper.run_once().expired == 1
        assert _keys_in(private) == {other_key}

        # Nothing else lost: the other holder still holds and releases normally,
        # the application locks the key again with a greater fence.
        assert other.release() is True
        with (
            LockManager(proxy.url_for(db_url), table=table, renew=False) as restarted,
            restarted.lock(stranded_key, blocking=False) as again,
        ):
            assert again.fence > held.fence
    finally:
        app.close()


@pytest.mark.databases("postgresql", "mariadb")
def test_scheduled_sweeper_survives_a_database_outage(
    db_url: str,
    private: LockManager,
    proxy: Proxy,
    keys: object,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A run that cannot reach the database is logged; the schedule goes on
    and the next run after the outage sweeps."""
    app = LockManager(proxy.url_for(db_url), table=private.config.table)
    try:
        with caplog.at_level(logging.ERROR, logger="dblock"):
            proxy.refuse(True)
            proxy.cut_all()
            sweeper = app.start_sweeper(interval=0.1, grace=0)
            assert _wait_for(lambda: any("failed" in r.getMessage() for r in caplog.records))
            assert sweeper.running
            proxy.refuse(False)
            backlog = keys(5)  # type: ignore[operator]
            insert_expired(private, backlog)
            assert _wait_for(lambda: not _keys_in(private))
    finally:
        app.close()


# -- many sweepers, one dies -------------------------------------------------------


def test_killed_sweeper_is_replaced_after_its_lease(
    db_url: str, private: LockManager, keys: object
) -> None:
    table = private.config.table
    backlog = keys(20_000)  # type: ignore[operator]
    insert_expired(private, backlog)
    # A lease long enough to outlast the kill and the row count below on a
    # loaded machine (4 s did not once: the dead sweeper's lease, renewed
    # last a third of it before the freeze, ran out before run_once asked).
    sweeper = Sweeper(private, grace=0, lock_ttl=10)
    common = ("--url", db_url, "--table", table, "--grace", "0", "--lock-ttl", "10")
    first = start_dblock("sweep", "--once", "--batch-size", "1", *common)

    def mid_run() -> bool:
        # Its lock row is there and the backlog is going down.
        store = private.store
        return bool(store.rows(key=sweeper.key)) and store.stats().rows <= len(backlog)

    try:
        # Freeze it the moment it is seen mid-run (however fast this machine
        # deletes), then kill it: a sweeper dying with its lock held.
        assert _wait_for(mid_run, timeout=60, every=0.002)
        first.send_signal(signal.SIGSTOP)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
    assert first.returncode == -signal.SIGKILL
    left = _keys_in(private)
    assert sweeper.key in left  # the dead sweeper's lock row
    assert len(left) > 1  # it died mid-run
    assert sweeper.run_once().busy is not None  # its lease still holds the others off

    second = start_dblock("sweep", "--every", "0.5s", "--batch-size", "200", *common)
    try:
        assert _wait_for(lambda: not _keys_in(private), timeout=90)
    finally:
        second.send_signal(signal.SIGTERM)
        _, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    assert "swept" in err


def test_sweep_once_on_busy_table_says_so(
    db_url: str, private: LockManager, make_manager: object
) -> None:
    sweeper = Sweeper(private)
    other = make_manager(table=private.config.table, client_id="elsewhere")  # type: ignore[operator]
    with other.lock(sweeper.key, ttl=30):
        done = dblock("sweep", "--once", "--url", db_url, "--table", private.config.table)
    assert done.returncode == 0, done.stderr
    assert "another sweeper (elsewhere" in done.stdout
