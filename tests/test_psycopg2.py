"""dblock on psycopg2 (``postgresql+psycopg2://``, or an application's engine
on it): the lock statements, LISTEN/NOTIFY wake-ups, renewal and fencing.

Many applications still run psycopg2; dblock shares their engine rather than
asking for a second driver. The PostgreSQL tests that exercise the driver
(lock, release, the listener's wake-ups and its reconnection, renewal, the
fenced write of a paused holder) run here again on a psycopg2 URL: this
module's ``db_url`` replaces the suite's. The asyncio face runs on psycopg 3
whatever the URL's driver (psycopg2 has no asyncio connection).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from dblock import AsyncLockManager, LockManager, SchemaMissing
from tests.support.counting import StatementCounter
from tests.support.db import DEFAULT_URLS, reachable

# The suite's own tests, collected again here with this module's db_url.
from tests.test_leases import (  # noqa: F401
    test_max_hold_caps_renewal,
    test_paused_holder_learns_it_lost_and_its_fenced_write_is_refused,
    test_renewal_across_processes,
    test_renewal_keeps_lock_for_several_leases,
    test_row_taken_while_held_is_detected_by_renewal,
)
from tests.test_lock import (  # noqa: F401
    test_expired_row_is_taken_over,
    test_fence_grows_across_takeover,
    test_fence_strictly_increases,
    test_lock_yields_held_lock_and_releases_row,
    test_threads_exclude_each_other,
    test_timeout_when_held_elsewhere,
    test_waiter_gets_lock_when_released_in_other_manager,
)
from tests.test_notify_waiters import (  # noqa: F401
    bouncer,
    heard,
    test_a_release_before_the_registration_is_not_missed,
    test_a_release_nobody_waits_for_sends_no_notify,
    test_a_waiter_registered_before_the_release_is_notified,
)
from tests.test_postgresql import (  # noqa: F401
    test_contention_raises_no_server_errors,
    test_listener_is_one_connection_per_manager_and_stops_on_close,
    test_listener_survives_its_connection_being_killed,
    test_waiter_is_woken_by_notify_not_polling,
)

pytest.importorskip("psycopg2", reason="psycopg2-binary is in the dev extra")

pytestmark = pytest.mark.databases("postgresql")

URL = sa.make_url(DEFAULT_URLS["postgresql"]).set(drivername="postgresql+psycopg2")
URL_TEXT = URL.render_as_string(hide_password=False)


@pytest.fixture(scope="module")
def db_url() -> str:
    """The suite's PostgreSQL database, through psycopg2."""
    problem = reachable(URL_TEXT)
    if problem:
        pytest.fail(f"postgresql is required by the test suite and unreachable: {problem}")
    with LockManager(URL_TEXT) as m:
        assert m.engine.dialect.driver == "psycopg2"
        m.create_schema()
    return URL_TEXT


@pytest.fixture
def app_engine(db_url: str) -> Iterator[sa.Engine]:
    """An application's own engine on psycopg2 (not in autocommit)."""
    engine = sa.create_engine(db_url)
    yield engine
    engine.dispose()


def test_an_applications_psycopg2_engine_is_shared(app_engine: sa.Engine, key: str) -> None:
    """Given the application's engine, dblock locks through it (its
    statements run on psycopg2 connections) and a second manager on the same
    engine waits, woken by the release's NOTIFY."""
    holder = LockManager(app_engine)
    waiter = LockManager(app_engine, notify_recheck=30.0)
    try:
        assert waiter.store.can_notify
        held = holder.acquire(key)
        got = threading.Event()

        def wait() -> None:
            with waiter.lock(key, timeout=30):
                got.set()

        with StatementCounter(waiter.engine) as c:
            t = threading.Thread(target=wait)
            t.start()
            deadline = time.monotonic() + 10
            while c.count < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(0.5)
            attempts = c.count
            released = time.monotonic()
            held.release()
            assert got.wait(10)
            woke = time.monotonic() - released
            t.join(10)
        # Woken by the notification (poll_max and the recheck are far longer),
        # with one more attempt: no polling in between.
        assert woke < 1.0
        # The winning attempt, and the two releases (the holder's statements
        # go through the same engine, so they are counted too).
        assert c.count == attempts + 3
    finally:
        waiter.close()
        holder.close()
    with app_engine.connect() as conn:  # the application's engine still works
        assert conn.execute(sa.text("SELECT 1")).scalar() == 1


def test_a_waiter_polls_when_told_not_to_listen(make_manager: object, key: str) -> None:
    holder = make_manager()  # type: ignore[operator]
    waiter = make_manager(notify=False, poll_initial=0.01, poll_max=0.05)  # type: ignore[operator]
    taken = threading.Event()

    def hold() -> None:
        with holder.lock(key):
            taken.set()
            time.sleep(0.3)

    t = threading.Thread(target=hold)
    t.start()
    assert taken.wait(10)
    started = time.monotonic()
    with waiter.lock(key, timeout=10):
        assert 0.1 < time.monotonic() - started < 5
    t.join(10)


def test_a_missing_table_is_named_as_such(db_url: str, key: str) -> None:
    """psycopg2 carries the SQLSTATE as ``pgcode``: read, the missing table
    is reported as SchemaMissing, not as a database error."""
    table = f"dblock_none_{uuid.uuid4().hex[:8]}"
    with LockManager(db_url, table=table) as m, pytest.raises(SchemaMissing, match="migrate"):
        m.acquire(key)


def test_the_asyncio_face_runs_on_psycopg_3_for_a_psycopg2_url(db_url: str, key: str) -> None:
    import asyncio

    async def main(url: str | sa.Engine) -> int:
        async with AsyncLockManager(url) as m, m.lock(key) as held:
            return held.fence

    assert asyncio.run(main(db_url)) > 0
    engine = sa.create_engine(db_url)  # an application's engine on psycopg2
    try:
        assert asyncio.run(main(engine)) > 0
    finally:
        engine.dispose()


def test_the_django_settings_choose_psycopg2_when_django_runs_on_it() -> None:
    """Without psycopg 3 installed (hidden from the child process), Django
    runs on psycopg2 and so does dblock's URL for its database."""
    code = (
        "import sys; sys.modules['psycopg'] = None\n"
        "from dblock.contrib.django.conf import url_from\n"
        "print(url_from('postgresql', {'NAME': 'app', 'HOST': 'db'}).drivername)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == "postgresql+psycopg2"
