"""A job whose run ends while the database is away for a few seconds (a
restart, a failover): its outcome is still recorded, and its ``at_least``
still kept, on private PostgreSQL and MariaDB servers stopped and started
over the run's end.

Before, the outcome was written once (a failure only logged: the record
stayed ``running``, ``dblock jobs`` showed the run as died, and
``retry_failed=True`` ran a fire time that had succeeded a second time), and
the keep of ``at_least`` went the way of a failed release: its row was
deleted on reconnect, and another host ran the job at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest

from dblock import JobSkipped, LockManager
from dblock._store.jobs import KEPT, statements
from tests.support.servers import PrivateServer, migrated

pytestmark = pytest.mark.slow

FIRE = datetime(2026, 11, 25, 3, 0, tzinfo=timezone.utc)


@pytest.fixture(scope="module", params=["postgresql", "mariadb"])
def server(request: pytest.FixtureRequest) -> Iterator[PrivateServer]:
    with migrated(request.param) as made:
        yield made


def _owner_of(server: PrivateServer, key: str) -> str | None:
    with LockManager(server.url) as m:
        rows = [r for r in m.store.rows() if r.key == key]
    return rows[0].owner if rows else None


@pytest.mark.parametrize("record", [True, False])
def test_a_run_ending_in_an_outage_keeps_its_outcome_and_at_least(
    server: PrivateServer, record: bool
) -> None:
    name = f"outage-{record}-{time.monotonic_ns()}"
    started, end = threading.Event(), threading.Event()
    results: list[object] = []

    def work() -> str:
        started.set()
        assert end.wait(60)
        return "done"

    runner = LockManager(server.url, poll_max=0.2)

    def run() -> None:
        try:
            fire = FIRE if record else None
            results.append(
                runner.run_job(name, work, fire_time=fire, record=record, at_most=30, at_least=25)
            )
        except BaseException as exc:
            results.append(exc)

    thread = threading.Thread(target=run)
    try:
        with runner.lock(f"{name}:warm-up"):  # a pooled connection, capabilities read
            pass
        thread.start()
        assert started.wait(30)
        server.crash()
        end.set()  # the run ends with the database away
        time.sleep(2.0)
        server.start()
        thread.join(60)
        assert results == ["done"]
        # The key is kept for at_least (the runner's renewal thread keeps the
        # row once it reaches the database again, if its release could not).
        deadline = time.monotonic() + 20
        while (owner := _owner_of(server, f"job:{name}")) is None or not owner.endswith(KEPT):
            assert owner is not None, "the row was deleted: at_least is lost"
            assert time.monotonic() < deadline, owner
            time.sleep(0.1)
        with LockManager(server.url) as other:  # another host, a little later
            with pytest.raises(JobSkipped) as skipped:
                other.run_job(name, lambda: "again", on_skip="raise", at_most=30, at_least=25)
            assert skipped.value.reason == "kept"
            if record:
                (found,) = statements(other.store).latest(name)
                assert (found.outcome, found.fire_time) == ("success", FIRE)
                with pytest.raises(JobSkipped) as done:
                    other.run_job(
                        name, lambda: "twice", fire_time=FIRE, retry_failed=True, on_skip="raise"
                    )
                assert done.value.reason == "done"
    finally:
        end.set()
        thread.join(60)
        runner.close()
