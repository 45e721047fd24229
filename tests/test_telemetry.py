"""Metrics and traces through OpenTelemetry, read back with the SDK's
in-memory metric reader and span exporter, on the three databases."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dblock import LockArgumentError, LockBusy, LockManager, LockTimeout
from dblock.sweeper import Sweeper
from dblock.telemetry import Telemetry
from tests.support.rows import insert_expired
from tests.support.web import free_port


class Readout:
    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.telemetry = Telemetry(
            meter_provider=MeterProvider(metric_readers=[self.reader]),
            tracer_provider=tracer_provider,
        )

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        found = []
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found.extend(metric.data.data_points)
        return found

    def count(self, name: str, **attributes: object) -> int:
        """The sum of a counter's points whose attributes include ``attributes``."""
        wanted = {f"dblock.{k}": v for k, v in attributes.items()}
        return sum(
            int(p.value) for p in self.points(name) if wanted.items() <= dict(p.attributes).items()
        )

    def histogram_count(self, name: str, **attributes: object) -> int:
        wanted = {f"dblock.{k}": v for k, v in attributes.items()}
        return sum(
            p.count for p in self.points(name) if wanted.items() <= dict(p.attributes).items()
        )


@pytest.fixture
def readout() -> Readout:
    return Readout()


@pytest.fixture
def observed(db_url: str, readout: Readout) -> Iterator[LockManager]:
    with LockManager(db_url, telemetry=readout.telemetry) as m:
        yield m


def test_outcomes_are_counted_by_level(
    observed: LockManager, make_manager: Callable[..., LockManager], key: str, readout: Readout
) -> None:
    table = observed.config.table
    with observed.lock(key):
        # Level 1: another thread of this process, refused with no SQL.
        caught: list[BaseException] = []

        def refused() -> None:
            try:
                observed.acquire(key, blocking=False)
            except LockBusy as exc:
                caught.append(exc)

        thread = threading.Thread(target=refused)
        thread.start()
        thread.join()
        # Level 2: another process (another manager) holds the row.
        with pytest.raises(LockBusy):
            make_manager(telemetry=readout.telemetry).acquire(key, blocking=False)
    assert caught
    name = "dblock.lock.acquisitions"
    assert readout.count(name, outcome="granted", level=2, table=table, kind="exclusive") == 1
    assert readout.count(name, outcome="busy", level=1) == 1
    assert readout.count(name, outcome="busy", level=2) == 1
    # The granted request did not wait: no wait time and no span for it.
    assert readout.histogram_count("dblock.lock.wait") == 0
    assert readout.spans.get_finished_spans() == ()
    assert readout.histogram_count("dblock.lock.hold") == 1


def test_a_request_that_waits_has_a_span_and_a_wait_time(
    observed: LockManager, make_manager: Callable[..., LockManager], key: str, readout: Readout
) -> None:
    other = make_manager()
    # A holder that crashes, in effect: its lease runs out unrenewed, so the
    # second request surely waits (for the takeover) before it is granted.
    # (A lease of 0.5 s once ran out before the next line's timeout on a
    # loaded machine: the request was granted instead of timing out.)
    held = other.acquire(key, ttl=2.0, renew=False)
    with pytest.raises(LockTimeout):
        observed.acquire(key, timeout=0.05)
    with observed.lock(key, timeout=30) as mine:
        fence = mine.fence
    assert held.lost

    assert readout.count("dblock.lock.acquisitions", outcome="timeout", level=2) == 1
    assert readout.count("dblock.lock.acquisitions", outcome="granted") == 1
    assert readout.histogram_count("dblock.lock.wait", outcome="timeout") == 1
    assert readout.histogram_count("dblock.lock.wait", outcome="granted") == 1
    spans = {s.attributes["dblock.outcome"]: s for s in readout.spans.get_finished_spans()}
    assert set(spans) == {"timeout", "granted"}
    granted = spans["granted"]
    assert granted.name == "dblock.acquire"
    assert granted.attributes["dblock.fence"] == fence
    assert granted.attributes["dblock.level"] == 2
    assert granted.attributes["dblock.key.prefix"] == key.split(":", 1)[0]
    # Keys carry user ids: the span has a hash of the key, never the key.
    assert granted.attributes["dblock.key.hash"] == hashlib.sha256(key.encode()).hexdigest()[:16]
    assert key not in {str(v) for s in spans.values() for v in s.attributes.values()}


def test_a_local_queue_and_a_handoff(observed: LockManager, key: str, readout: Readout) -> None:
    held = observed.acquire(key)
    queued = threading.Event()
    got: list[int] = []

    def second() -> None:
        queued.set()
        with observed.lock(key, timeout=30) as h:
            got.append(h.fence)

    thread = threading.Thread(target=second)
    thread.start()
    queued.wait()
    entry = observed._locker.registry.get(key)
    while entry is not None and not entry.queue:  # wait until it is queued at level 1
        threading.Event().wait(0.001)
    held.release()
    thread.join()
    assert got
    spans = readout.spans.get_finished_spans()
    assert [s.attributes["dblock.level"] for s in spans] == [1]
    if observed.store.can_transfer:
        assert readout.count("dblock.lock.handoffs") == 1


def test_lost_locks_renewals_and_sweeps(
    db_url: str, private: LockManager, key: str, readout: Readout
) -> None:
    with LockManager(db_url, table=private.config.table, telemetry=readout.telemetry) as m:
        lost = threading.Event()
        held = m.acquire(key, ttl=0.3, renew=False, on_lost=lambda _h: lost.set())
        assert lost.wait(10)
        assert readout.count("dblock.lock.lost") == 1
        renewed = m.acquire(key + ":renewed", ttl=0.3)
        while readout.count("dblock.lock.renewals", outcome="renewed") == 0:
            threading.Event().wait(0.01)
        renewed.release()
        del held
        insert_expired(m, [key + ":crashed-1", key + ":crashed-2"])
        result = Sweeper(m, interval=3600).run_once()
        assert result.expired >= 2, result
        assert readout.count("dblock.sweeper.deleted", reason="expired") >= 2


def test_telemetry_off_and_bad_values(db_url: str) -> None:
    with LockManager(db_url, telemetry=False) as m:
        assert m.telemetry is None
    with pytest.raises(LockArgumentError, match="telemetry must be"):
        LockManager(db_url, telemetry="yes")
    with pytest.raises(LockArgumentError, match="key_attribute"):
        Telemetry(key_attribute="plain")  # type: ignore[arg-type]


def test_the_prometheus_example_exports_dblock_metrics(db_url: str, tmp_path: Path) -> None:
    """The example app, run as a user runs it, scraped over HTTP as Prometheus does."""
    port = free_port()
    example = Path(__file__).resolve().parent.parent / "examples" / "metrics" / "prometheus_app.py"
    proc = subprocess.Popen(
        [sys.executable, str(example), "--url", db_url, "--port", str(port), "--seconds", "60"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert "serving metrics" in proc.stdout.readline()
        deadline = time.monotonic() + 60
        while True:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                text = r.read().decode()
            if "dblock_lock_acquisitions_total" in text and "dblock_lock_hold" in text:
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
        assert 'dblock_outcome="granted"' in text
        assert "user:" not in text  # no key in any metric
    finally:
        proc.kill()
        proc.wait(20)


def test_job_runs_and_skips_are_counted(
    observed: LockManager, make_manager: Callable[..., LockManager], readout: Readout
) -> None:
    from datetime import datetime, timezone

    fire = datetime(2026, 11, 25, 3, 0, tzinfo=timezone.utc)
    job = f"metrics-{time.monotonic_ns()}"
    other = make_manager(telemetry=readout.telemetry)
    assert observed.run_job(job, lambda: "ran", at_most=30, at_least=30) == "ran"
    assert not other.run_job(job, lambda: "again", at_most=5)  # kept by at_least

    def boom() -> None:
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        observed.run_job(job + "-f", boom, at_most=5, fire_time=fire)
    assert not other.run_job(job + "-f", lambda: None, at_most=5, fire_time=fire)
    name = "dblock.job.runs"
    assert readout.count(name, outcome="success") == 1
    assert readout.count(name, outcome="failed") == 1
    assert readout.count(name, outcome="skipped", reason="kept") == 1
    assert readout.count(name, outcome="skipped", reason="failed") == 1


def test_leadership_is_counted_per_role(observed: LockManager, key: str, readout: Readout) -> None:
    """Elections, the wait to be elected, terms ended (and why) and who
    leads now (an up-down count per role: 1 while this process leads)."""
    leader = observed.leader(key, ttl=1)
    with leader:
        assert readout.count("dblock.leader.leading", role=key) == 1
    assert readout.count("dblock.leader.leading", role=key) == 0
    assert readout.count("dblock.leader.elections", role=key) == 1
    assert readout.histogram_count("dblock.leader.wait", role=key) == 1
    assert readout.count("dblock.leader.terms", role=key, reason="stepped_down") == 1
    leader.elect()
    table = observed.store.table
    with observed.engine.begin() as conn:
        conn.execute(table.delete().where(table.c.lock_key == f"leader:{key}"))
    assert leader.ended.wait(30)
    assert readout.count("dblock.leader.terms", role=key, reason="lost") == 1
    assert readout.count("dblock.leader.leading", role=key) == 0
