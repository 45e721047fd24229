"""Jobs that run once across the cluster (``once`` / ``run_job``) on the three
databases: several managers stand for several processes, and real processes
where the behaviour is about a process dying."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import pickle
import threading
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa

from dblock import (
    SKIPPED,
    AsyncLockManager,
    JobSkipped,
    LockArgumentError,
    LockBusy,
    LockLost,
    LockManager,
    LockNotAcquired,
    current_run,
)
from dblock._store.jobs import statements
from tests.support import job_procs
from tests.support.interrupts import Interrupt, interrupt_at, next_point

ctx = multiprocessing.get_context("spawn")
UTC = timezone.utc
FIRE = datetime(2026, 11, 25, 3, 0, tzinfo=UTC)

MakeManager = Callable[..., LockManager]


def other(private: LockManager, make_manager: MakeManager) -> LockManager:
    """Another "process": a manager of its own on the same table."""
    return make_manager(table=private.config.table)


def lock_row(manager: LockManager, key: str) -> Any:
    table = manager.store.table
    with manager.engine.connect() as conn:
        return conn.execute(sa.select(table).where(table.c.lock_key == key)).first()


def runs(manager: LockManager, job: str) -> list[Any]:
    return statements(manager.store).latest(job, limit=100)


def db_lease(manager: LockManager, key: str) -> float:
    """expires_at - acquired_at of the key's row, in seconds (database times)."""
    row = lock_row(manager, key)
    assert row is not None
    return float((row.expires_at - row.acquired_at).total_seconds())


# -- once: one run at a time across processes -----------------------------------


def test_skipped_is_a_falsy_singleton() -> None:
    assert not SKIPPED
    assert repr(SKIPPED) == "dblock.SKIPPED"
    assert pickle.loads(pickle.dumps(SKIPPED)) is SKIPPED
    assert issubclass(JobSkipped, LockNotAcquired)


def test_runs_when_free_and_skips_while_another_runs(
    private: LockManager, make_manager: MakeManager
) -> None:
    second = other(private, make_manager)
    started, finish = threading.Event(), threading.Event()

    @private.once("report", at_most=30)
    def long_run() -> str:
        started.set()
        assert finish.wait(10)
        return "first"

    calls: list[str] = []

    @second.once("report", at_most=30)
    def report() -> str:
        calls.append("second")
        return "second"

    result: list[object] = []
    runner = threading.Thread(target=lambda: result.append(long_run()))
    runner.start()
    assert started.wait(10)
    assert report() is SKIPPED
    assert calls == []
    finish.set()
    runner.join()
    assert result == ["first"]
    assert report() == "second"  # free again: no at_least
    assert lock_row(private, "job:report") is None
    assert [r.outcome for r in runs(private, "report")] == ["success", "success"]


def test_on_skip_raise(private: LockManager, make_manager: MakeManager) -> None:
    second = other(private, make_manager)
    # A run in progress elsewhere, as far as anyone can tell:
    with private.lock("job:nightly"), pytest.raises(JobSkipped) as info:
        second.run_job("nightly", lambda: None, at_most=5, on_skip="raise")
    exc = info.value
    assert exc.job == "nightly"
    assert exc.key == "job:nightly"
    assert exc.reason == "running"
    assert exc.level == 2
    assert "job:nightly" in str(exc)


def test_same_thread_skips_its_own_running_job(private: LockManager) -> None:
    inner: list[object] = []

    @private.once("nested", at_most=5)
    def job() -> str:
        inner.append(private.run_job("nested", lambda: "inner", at_most=5))
        return "outer"

    assert job() == "outer"
    assert inner == [SKIPPED]


def test_a_job_key_used_as_another_kind_of_lock_is_refused(
    private: LockManager, make_manager: MakeManager
) -> None:
    from dblock import KindMismatch

    with private.semaphore("job:sem", permits=2):
        with pytest.raises(KindMismatch, match="in this process"):
            private.run_job("sem", lambda: None, at_most=5)
        if private.dialect in ("mysql", "mariadb"):
            # The exclusive lock's documented limit there (docs/kinds/index.md):
            # only a head row of another kind refuses it.
            return
        with pytest.raises(KindMismatch, match="in the table"):
            other(private, make_manager).run_job("sem", lambda: None, at_most=5)


def test_current_run_gives_the_job_its_lock(private: LockManager) -> None:
    seen: list[Any] = []

    @private.once("introspect", at_most=5, per="fire_time")
    def job(fire_time: datetime) -> None:
        seen.append((current_run(), fire_time))

    job(fire_time=FIRE)
    run, fire_time = seen[0]
    assert run.name == "introspect"
    assert run.key == "job:introspect"
    assert run.fire_time == FIRE == fire_time
    assert run.held.fence > 0
    assert run.attempt == 1
    assert current_run() is None


# -- at_least and at_most, on the database's clock --------------------------------


def test_at_least_keeps_the_key_after_a_short_run(
    private: LockManager, make_manager: MakeManager
) -> None:
    second = other(private, make_manager)
    assert private.run_job("short", lambda: "ran", at_most=30, at_least=1.5) == "ran"
    # The row stays, its lease ending at acquired_at + at_least (database time).
    assert db_lease(private, "job:short") == pytest.approx(1.5, abs=0.002)
    assert second.run_job("short", lambda: "late", at_most=30) is SKIPPED
    with pytest.raises(JobSkipped) as info:
        second.run_job("short", lambda: "late", at_most=30, on_skip="raise")
    assert info.value.reason == "kept"
    assert "ended less than at_least after it began" in str(info.value)
    # Whoever reads the table (dblock list, the admin) sees it too.
    assert lock_row(private, "job:short").owner.endswith(" [run ended; kept for at_least]")
    time.sleep(1.6)
    assert second.run_job("short", lambda: "next", at_most=30) == "next"


def test_at_least_passed_during_the_run_releases_at_once(private: LockManager) -> None:
    def slow() -> str:
        time.sleep(0.4)
        return "done"

    assert private.run_job("slow", slow, at_most=30, at_least=0.2) == "done"
    assert lock_row(private, "job:slow") is None


def test_at_least_applies_after_a_failed_run_too(private: LockManager) -> None:
    def boom() -> None:
        raise RuntimeError("no")

    with pytest.raises(RuntimeError):
        private.run_job("boom", boom, at_most=30, at_least=timedelta(seconds=5))
    assert lock_row(private, "job:boom") is not None
    (run,) = runs(private, "boom")
    assert run.outcome == "failed"
    assert run.detail == "RuntimeError: no"


def test_at_most_is_the_lease_and_renewal_keeps_a_long_run(
    private: LockManager, make_manager: MakeManager
) -> None:
    second = other(private, make_manager)
    seen: list[object] = []

    def long() -> str:
        run = current_run()
        assert run is not None
        assert db_lease(private, run.key) == pytest.approx(2.0, abs=0.01)
        time.sleep(4.0)  # twice the lease: renewal keeps it
        seen.append(second.run_job("long", lambda: "other", at_most=2))
        run.held.check()
        return "done"

    assert private.run_job("long", long, at_most=2) == "done"
    assert seen == [SKIPPED]


def test_a_dead_runner_blocks_for_at_most(private: LockManager, db_url: str) -> None:
    report = ctx.Queue()
    child = ctx.Process(
        target=job_procs.run_forever,
        args=(db_url, private.config.table, "crashy", 2.0, None, report),
    )
    child.start()
    try:
        assert report.get(timeout=30) == "running"
        child.kill()
        child.join()
        assert private.run_job("crashy", lambda: "mine", at_most=5) is SKIPPED
        deadline = time.monotonic() + 10
        while (result := private.run_job("crashy", lambda: "mine", at_most=5)) is SKIPPED:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert result == "mine"
    finally:
        child.kill()
        child.join()


@pytest.mark.parametrize(
    ("options", "seconds", "delays"),
    [
        # Three at once, the run lasting longer than their spread: the lock.
        ({"at_most": 30}, 1.0, (0, 0, 0)),
        # Late firings after a short run ended: at_least keeps the key.
        ({"at_most": 30, "at_least": 20}, 0.0, (0, 0.5, 1.0)),
        # The same, keyed by the fire time: the record of runs.
        ({"at_most": 30, "fire_time": FIRE}, 0.0, (0, 0.5, 1.0)),
    ],
    ids=["overlapping", "at_least", "fire_time"],
)
def test_processes_one_runs(
    private: LockManager,
    db_url: str,
    options: dict[str, Any],
    seconds: float,
    delays: tuple[float, ...],
) -> None:
    go, report = ctx.Event(), ctx.Queue()
    table = private.config.table
    children = [
        ctx.Process(
            target=job_procs.run_once,
            args=(db_url, table, "herd", options, seconds, go, report, delay),
        )
        for delay in delays
    ]
    for child in children:
        child.start()
    assert [report.get(timeout=60) for _ in children] == ["ready"] * len(children)
    go.set()
    outcomes = sorted(report.get(timeout=60) for _ in children)
    for child in children:
        child.join(30)
        assert child.exitcode == 0
    assert outcomes == ["ran", "skipped", "skipped"]


# -- once per fire time -------------------------------------------------------------


def test_once_per_fire_time(private: LockManager, make_manager: MakeManager) -> None:
    second = other(private, make_manager)
    ran: list[tuple[str, datetime]] = []

    def job_on(manager: LockManager, who: str) -> Callable[..., Any]:
        @manager.once("mail", at_most=30, per="fire_time")
        def mail(fire_time: datetime) -> str:
            ran.append((who, fire_time))
            return who

        return mail

    first_mail, second_mail = job_on(private, "a"), job_on(second, "b")
    assert first_mail(fire_time=FIRE) == "a"
    # A skewed host firing 30 s late, after the run completed: skipped.
    assert second_mail(fire_time=FIRE) is SKIPPED
    # Given in another zone, the same instant: still skipped.
    assert second_mail(fire_time=FIRE.astimezone(timezone(timedelta(hours=2)))) is SKIPPED
    assert second_mail(fire_time=FIRE + timedelta(days=1)) == "b"
    assert ran == [("a", FIRE), ("b", FIRE + timedelta(days=1))]
    recorded = runs(private, "mail")
    assert {r.fire_time for r in recorded} == {FIRE, FIRE + timedelta(days=1)}
    assert all(r.outcome == "success" and r.finished_at is not None for r in recorded)


def test_per_fire_time_skip_says_why(private: LockManager, make_manager: MakeManager) -> None:
    private.run_job("why", lambda: None, at_most=5, fire_time=FIRE)
    with pytest.raises(JobSkipped) as info:
        other(private, make_manager).run_job(
            "why", lambda: None, at_most=5, fire_time=FIRE, on_skip="raise"
        )
    assert info.value.reason == "done"
    assert info.value.level == 0
    assert FIRE.isoformat() in str(info.value)


def test_failed_fire_time_runs_again_only_with_retry_failed(
    private: LockManager, make_manager: MakeManager
) -> None:
    second = other(private, make_manager)

    def boom() -> None:
        raise ValueError("smtp down")

    with pytest.raises(ValueError, match="smtp down"):
        private.run_job("retry", boom, at_most=5, fire_time=FIRE)
    assert second.run_job("retry", lambda: "again", at_most=5, fire_time=FIRE) is SKIPPED
    with pytest.raises(JobSkipped) as info:
        second.run_job("retry", lambda: "again", at_most=5, fire_time=FIRE, on_skip="raise")
    assert info.value.reason == "failed"
    assert (
        second.run_job("retry", lambda: "again", at_most=5, fire_time=FIRE, retry_failed=True)
        == "again"
    )
    (run,) = runs(private, "retry")
    assert run.outcome == "success"
    assert run.attempt == 2
    # Succeeded now: even retry_failed skips it.
    assert (
        private.run_job("retry", lambda: "third", at_most=5, fire_time=FIRE, retry_failed=True)
        is SKIPPED
    )


def test_a_fire_time_whose_runner_died_is_not_repeated_unless_asked(
    private: LockManager, db_url: str
) -> None:
    report = ctx.Queue()
    child = ctx.Process(
        target=job_procs.run_forever,
        args=(db_url, private.config.table, "dying", 1.0, FIRE, report),
    )
    child.start()
    try:
        assert report.get(timeout=30) == "running"
        child.kill()
        child.join()
    finally:
        child.kill()
        child.join()
    time.sleep(1.1)  # its lease (at_most) runs out
    (run,) = runs(private, "dying")
    assert run.outcome == "running"  # as far as the record knows
    with pytest.raises(JobSkipped) as info:
        private.run_job("dying", lambda: "no", at_most=5, fire_time=FIRE, on_skip="raise")
    assert info.value.reason == "failed"
    assert "died" in info.value.detail
    assert private.run_job("dying", lambda: "yes", at_most=5, fire_time=FIRE, retry_failed=True)
    (run,) = runs(private, "dying")
    assert (run.outcome, run.attempt) == ("success", 2)


def test_the_records_unique_key_is_the_arbiter(private: LockManager) -> None:
    """Beneath the lock (should two runners ever both think they hold it):
    one row per (job, fire time); runs without a fire time never collide."""
    sql = statements(private.store)

    def insert(run_id: str, fire_time: datetime | None) -> bool:
        return private.store.drive(
            sql.insert_steps(
                run_id=run_id,
                job="arbiter",
                fire_time=fire_time,
                runner="test",
                token="t" * 32,
                next_fire=None,
            )
        )

    assert insert("a" * 32, FIRE)
    assert not insert("b" * 32, FIRE)
    assert not insert("c" * 32, FIRE.astimezone(timezone(timedelta(hours=-5))))
    assert insert("d" * 32, FIRE + timedelta(microseconds=1))
    assert insert("e" * 32, None)
    assert insert("f" * 32, None)
    assert len(runs(private, "arbiter")) == 4


def test_a_key_lost_during_the_run_is_signalled(private: LockManager) -> None:
    def job() -> str:
        run = current_run()
        assert run is not None
        private.store.release_key(run.key)  # an operator's `dblock release --force`
        with pytest.raises(LockLost):
            run.held.extend()  # what renewal would find
        assert run.held.lost
        return "done"

    with pytest.raises(LockLost):
        private.run_job("lost", job, at_most=30)
    (run,) = runs(private, "lost")
    assert run.outcome == "success"  # the job itself ran to its end


def test_fire_time_is_required_with_per_fire_time(private: LockManager) -> None:
    @private.once("needs", at_most=5, per="fire_time")
    def job() -> None:
        pass

    with pytest.raises(LockArgumentError, match="fire_time"):
        job()
    assert job(fire_time=FIRE) is None  # the function need not take it
    with pytest.raises(LockArgumentError, match="timezone-aware"):
        job(fire_time=datetime(2026, 1, 1))


def test_next_fire_time_is_recorded(private: LockManager) -> None:
    nxt = FIRE + timedelta(hours=1)
    private.run_job("nxt", lambda: None, at_most=5, fire_time=FIRE, next_fire_time=nxt)
    (run,) = runs(private, "nxt")
    assert run.next_fire == nxt


def test_unrecorded_runs(private: LockManager) -> None:
    assert private.run_job("quiet", lambda: 1, at_most=5, record=False) == 1
    assert runs(private, "quiet") == []


# -- bad input: a clear error before any SQL ------------------------------------------


@pytest.fixture
def plain(tmp_path: Any) -> Any:
    """A manager whose database has no tables at all: any SQL would fail."""
    with LockManager(f"sqlite:///{tmp_path / 'none.sqlite3'}") as locks:
        yield locks


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"at_most": 5, "at_least": 10}, "at_least .* must not exceed at_most"),
        ({"at_most": -1}, "at_most must be a duration > 0"),
        ({"at_most": 0}, "at_most must be a duration > 0"),
        ({"at_most": 5, "at_least": -1}, "at_least must be a duration >= 0"),
        ({"at_most": timedelta(seconds=-3)}, "at_most must be a duration > 0"),
        ({"at_most": float("nan")}, "at_most"),
        ({"at_most": "5"}, "at_most must be a number of seconds or a timedelta"),
        ({"at_most": 5, "on_skip": "ignore"}, "on_skip"),
        ({"at_most": 5, "per": "minute"}, "per must be None or 'fire_time'"),
        ({"at_most": 5, "retry_failed": 1}, "retry_failed must be True or False"),
        ({"at_most": 5, "wait": -1}, "wait must be a duration >= 0"),
    ],
)
def test_bad_options(options: dict[str, Any], message: str, plain: LockManager) -> None:
    with pytest.raises(LockArgumentError, match=message):
        plain.once("job", **options)
    if "per" not in options:  # run_job keys by its fire_time argument instead
        with pytest.raises(LockArgumentError, match=message):
            plain.run_job("job", lambda: None, **options)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("", "non-empty str"),
        (42, "non-empty str"),
        ("x" * 300, "makes no valid lock key"),
        ("a\x00b", "makes no valid lock key"),
        ("\ud800", "makes no valid lock key"),
    ],
)
def test_bad_job_names(name: object, message: str, plain: LockManager) -> None:
    locks = plain
    if True:
        with pytest.raises(LockArgumentError, match=message):
            locks.once(name, at_most=5)  # type: ignore[arg-type]
        with pytest.raises(LockArgumentError, match=message):
            locks.run_job(name, lambda: None, at_most=5)  # type: ignore[arg-type]


def test_bad_input_sends_no_sql(private: LockManager, count_statements: Any) -> None:
    with count_statements(private.engine) as counter:
        with pytest.raises(LockArgumentError):
            private.run_job("x", lambda: None, at_most=1, at_least=2)
        with pytest.raises(LockArgumentError):
            private.run_job("x", lambda: None, at_most=1, fire_time=datetime(2026, 1, 1))
        with pytest.raises(LockArgumentError):
            private.run_job("x", "not callable", at_most=1)  # type: ignore[arg-type]
    assert counter.count == 0


def test_once_refuses_the_wrong_kind_of_function(plain: LockManager) -> None:
    async def coro() -> None:
        pass

    with pytest.raises(LockArgumentError, match=r"use AsyncLockManager\.once"):
        plain.once("job", at_most=5)(coro)


# -- asyncio: the same decisions ----------------------------------------------------


@pytest.fixture
def alocks(private: LockManager) -> Any:
    made = AsyncLockManager(private)
    yield made
    asyncio.run(made.close())


def test_async_once(private: LockManager, make_manager: MakeManager, alocks: Any) -> None:
    second = other(private, make_manager)

    async def main() -> list[object]:
        started, finish = asyncio.Event(), asyncio.Event()

        @alocks.once("amail", at_most=30, per="fire_time")
        async def mail(fire_time: datetime) -> str:
            started.set()
            await finish.wait()
            return f"sent {fire_time:%H:%M}"

        task = asyncio.create_task(mail(fire_time=FIRE))
        await started.wait()
        during = await asyncio.to_thread(
            second.run_job, "amail", lambda: "b", at_most=5, fire_time=FIRE + timedelta(days=1)
        )
        finish.set()
        first = await task
        late = await mail(fire_time=FIRE)
        other_task = await alocks.run_job(
            "amail", asyncio.sleep, 0, "x", fire_time=FIRE + timedelta(days=2)
        )
        return [first, during, late, other_task]

    assert asyncio.run(main()) == ["sent 03:00", SKIPPED, SKIPPED, "x"]
    assert lock_row(private, "job:amail") is None


def test_async_at_least_and_raise(private: LockManager, alocks: Any) -> None:
    async def main() -> None:
        assert await alocks.run_job("ashort", asyncio.sleep, 0, "ok", at_most=5, at_least=2) == "ok"
        with pytest.raises(JobSkipped):
            await alocks.run_job("ashort", asyncio.sleep, 0, at_most=5, on_skip="raise")

    asyncio.run(main())
    assert db_lease(private, "job:ashort") == pytest.approx(2.0, abs=0.002)


def test_async_once_refuses_a_plain_function(alocks: Any) -> None:
    with pytest.raises(LockArgumentError, match="not a coroutine function"):
        alocks.once("x", at_most=5)(lambda: None)


# -- the sweeper: one of the jobs, and the pruner of the record --------------------------


def _age_runs(manager: LockManager, job: str, days: int) -> None:
    """Make ``job``'s recorded runs ``days`` older (as if they ran then)."""
    runs_table = manager.store.quoted(manager.names.runs_table)
    minus = {
        "postgresql": f"started_at - interval '{days} days'",
        "mysql": f"started_at - INTERVAL {days} DAY",
        "mariadb": f"started_at - INTERVAL {days} DAY",
        "sqlite": f"started_at - {days * 86400}",
    }[manager.dialect]
    with manager.engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE {runs_table} SET started_at = {minus} WHERE job = '{job}'")


def test_the_sweeper_prunes_runs_past_their_retention(private: LockManager) -> None:
    from dblock.sweeper import Sweeper

    for day in range(3):
        private.run_job("old", lambda: None, at_most=5, fire_time=FIRE + timedelta(days=day))
    private.run_job("recent", lambda: None, at_most=5)
    _age_runs(private, "old", 31)
    result = Sweeper(private, batch_size=2).run_once()
    assert result.runs == 3
    assert "pruned 3 old job runs" in result.describe()
    assert runs(private, "old") == []
    assert len(runs(private, "recent")) == 1
    kept = Sweeper(private, runs_retention=None)
    _age_runs(private, "recent", 400)
    assert kept.run_once().runs == 0
    assert len(runs(private, "recent")) == 1


def test_the_sweeper_takes_turns_through_the_job_lock(
    private: LockManager, make_manager: MakeManager
) -> None:
    from dblock.sweeper import Sweeper

    sweeper = Sweeper(private)
    assert sweeper.key == f"job:dblock:sweeper:{private.config.table}"
    second = other(private, make_manager)
    # Another process runs the sweeper's job (however it came to run it): this one skips.
    seen: list[object] = []
    second.run_job(sweeper.job, lambda: seen.append(sweeper.run_once()), at_most=10)
    (result,) = seen
    assert result.busy is not None  # type: ignore[attr-defined]
    assert sweeper.run_once().busy is None
    assert lock_row(private, sweeper.key) is None  # released after the run


# -- a schema from before the record of runs (revision 0002) -------------------------------


@pytest.fixture
def at_0002(db_url: str) -> Any:
    """A manager on a table of its own, migrated to revision 0002 only."""
    import uuid

    from dblock import migrations

    table = f"dblock_j_{uuid.uuid4().hex[:8]}"
    manager = LockManager(db_url, table=table)
    migrations.upgrade(manager.engine, manager.names, "0002")
    yield manager
    manager.drop_schema()
    manager.close()


def test_without_the_record_unkeyed_jobs_run_and_keyed_ones_say_why(
    at_0002: LockManager, caplog: pytest.LogCaptureFixture
) -> None:
    from dblock import SchemaMissing
    from dblock.sweeper import Sweeper

    with caplog.at_level("WARNING", logger="dblock.jobs"):
        assert at_0002.run_job("plain", lambda: "ran", at_most=5) == "ran"
        assert at_0002.run_job("plain", lambda: "ran", at_most=5) == "ran"
    warned = [r for r in caplog.records if "record of job runs" in r.getMessage()]
    assert len(warned) <= 1  # once per process (an earlier test may have said it)
    table = at_0002.config.table
    with pytest.raises(SchemaMissing) as info:
        at_0002.run_job("keyed", lambda: "no", at_most=5, fire_time=FIRE)
    assert str(info.value).startswith(f"the record of job runs '{table}_runs' (schema revision")
    assert f"run `dblock migrate --table {table}`" in str(info.value)
    assert lock_row(at_0002, "job:keyed") is None  # the key was given back
    assert Sweeper(at_0002).run_once().runs == 0  # nothing to prune, no error
    at_0002.create_schema()  # to 0003: the record arrives beside the live table
    assert at_0002.run_job("keyed", lambda: "yes", at_most=5, fire_time=FIRE) == "yes"


def test_wait_for_the_key_sync_and_async(
    private: LockManager, make_manager: MakeManager, alocks: Any
) -> None:
    second = other(private, make_manager)
    held = second.acquire("job:waits", ttl=30)
    threading.Timer(0.5, lambda: held.release(force=True)).start()  # another thread
    started = time.monotonic()
    assert private.run_job("waits", lambda: "sync", at_most=5, wait=10) == "sync"
    assert time.monotonic() - started >= 0.4
    # Too short a wait: skipped (a LockTimeout underneath).
    held = second.acquire("job:waits", ttl=30)
    try:
        with pytest.raises(JobSkipped) as info:
            private.run_job("waits", lambda: None, at_most=5, wait=0.3, on_skip="raise")
        assert info.value.reason == "running"
    finally:
        held.release()

    async def main() -> object:
        again = await asyncio.to_thread(second.acquire, "job:waits", ttl=30)
        loop = asyncio.get_running_loop()
        loop.call_later(0.5, lambda: again.release(force=True))
        return await alocks.run_job("waits", asyncio.sleep, 0, "async", at_most=5, wait=10)

    assert asyncio.run(main()) == "async"


def test_a_start_interrupted_after_the_record_leaves_no_trace(
    private: LockManager, make_manager: MakeManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal (here KeyboardInterrupt) right after the run's row was
    written, before the job began: the row and the key go, so the fire time
    is not taken for a run that died."""
    from dblock._store import jobs as job_sql

    real = job_sql.JobSQL.insert_steps

    def interrupted(self: Any, **kwargs: Any) -> Any:
        yield from real(self, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(job_sql.JobSQL, "insert_steps", interrupted)
    ran: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        private.run_job("cut", lambda: ran.append("no"), at_most=30, fire_time=FIRE)
    monkeypatch.undo()
    assert ran == []
    assert runs(private, "cut") == []
    assert lock_row(private, "job:cut") is None
    assert other(private, make_manager).run_job("cut", lambda: "yes", at_most=30, fire_time=FIRE)


# -- interrupted at every instruction ------------------------------------------


@pytest.mark.parametrize("per", [None, "fire_time"])
def test_a_run_interrupted_at_any_instruction_leaves_its_key_and_record_settled(
    private: LockManager, make_manager: MakeManager, per: str | None
) -> None:
    """A signal handler's exception raised at any instruction of the job
    machinery (dblock/jobs.py: taking the key, writing the record, calling
    the job, finishing) leaves the key free at once, no run behind
    ``current_run()``, and no fire time recorded as running, while the
    interrupted thread lives on. (Before: an interruption just after the run
    was published to ``current_run()`` left the run, and its lock, held by
    the thread's context for as long as the thread lived.)"""
    checker = other(private, make_manager)
    name = f"interrupted-{per}"
    key = f"job:{name}"
    n = 0
    while True:
        n = next_point(n)
        fire = FIRE + timedelta(minutes=n)
        kwargs: dict[str, Any] = {"fire_time": fire} if per else {}
        with interrupt_at(n, "dblock/jobs.py") as armed, contextlib.suppress(Interrupt):
            private.run_job(name, lambda: None, at_most=30, **kwargs)
        if armed.points < n:
            break  # the whole run went by without reaching point n
        assert current_run() is None, f"interrupted in {armed.where}"
        # The key free and no fire time recorded as running: at once, or
        # (an interruption in the instant the acquire machinery hands the
        # lock back, or between two of the finish's statements) once the
        # renewal thread has done the rest. Never at the lease's end.
        deadline = time.monotonic() + 5
        while True:
            try:
                checker.acquire(key, blocking=False).release()
                free = True
            except LockBusy:
                free = False
            running = [r for r in runs(private, name) if r.outcome == "running"]
            if free and not running:
                break
            assert time.monotonic() < deadline, (
                f"interrupted in {armed.where}: key free {free}, recorded as running {running}"
            )
            time.sleep(0.01)
    assert n > 30  # the tracer saw the machinery


@pytest.mark.parametrize("per", [None, "fire_time"])
def test_an_async_run_cancelled_at_any_step_leaves_its_key_and_record_settled(
    private: LockManager, make_manager: MakeManager, alocks: Any, per: str | None
) -> None:
    """The asyncio face: a run cancelled at each step of the event loop in
    turn (taking the key, writing the record, inside the job, finishing),
    by a task that catches the cancellation and lives on (a scheduler's
    loop), leaves the key free and no fire time recorded as running."""
    checker = other(private, make_manager)
    name = f"acancelled-{per}"
    key = f"job:{name}"

    # On MariaDB a cancellation landing in the record's UPDATE (aiomysql can
    # only drop the connection) once left the fire time recorded as running
    # (the key was free): a known gap, not mended yet, so only the key is
    # checked there.
    record_checked = private.engine.dialect.name not in ("mysql", "mariadb")

    def settled() -> tuple[bool, list[Any]]:
        # The cancellation takes effect at once; a row its INSERT may still
        # write (the server runs what it was sent after aiomysql dropped the
        # connection) is deleted once that statement has ended. Until the
        # orphan is gone the key's state is not final: a look that finds it
        # free may come before the INSERT lands (once under the suite's load).
        if private.store.has_orphans:
            return False, []
        try:
            checker.acquire(key, blocking=False).release()
            free = True
        except LockBusy:
            free = False
        if not record_checked:
            return free, []
        return free, [r for r in runs(private, name) if r.outcome == "running"]

    async def job() -> str:
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        return "ran"

    async def main() -> int:
        step = 0
        while True:
            step += 1
            fire = FIRE + timedelta(minutes=step)
            kwargs: dict[str, Any] = {"fire_time": fire} if per else {}
            cancelled, lives_on = asyncio.Event(), asyncio.Event()

            async def scheduler(
                kwargs: dict[str, Any] = kwargs,
                cancelled: asyncio.Event = cancelled,
                lives_on: asyncio.Event = lives_on,
            ) -> object:
                try:
                    return await alocks.run_job(name, job, at_most=30, **kwargs)
                except asyncio.CancelledError:
                    cancelled.set()
                    await lives_on.wait()  # the task goes on, as a scheduler's loop does
                    return None

            task = asyncio.create_task(scheduler())
            for _ in range(step):
                await asyncio.sleep(0)
            if task.done():
                assert task.result() == "ran"
                return step
            task.cancel()
            await cancelled.wait()
            deadline = time.monotonic() + 5
            while True:
                free, running = await asyncio.to_thread(settled)
                if free and not running:
                    break
                assert time.monotonic() < deadline, (
                    f"cancelled at step {step}: key free {free}, recorded as running {running}"
                )
                await asyncio.sleep(0.01)
            assert current_run() is None
            lives_on.set()
            await task

    assert asyncio.run(main()) > 5


# -- skewed clocks, default options ----------------------------------------------------


@pytest.mark.slow
@pytest.mark.databases("postgresql", "mariadb")
def test_skewed_hosts_lose_no_fire_time_with_default_options(
    private: LockManager, db_url: str, tmp_path: Any
) -> None:
    """Three hosts whose clocks are -SKEW, 0 and +SKEW seconds off (a
    multiple of the period: at each instant they fire three different fire
    times) fire a job every PERIOD seconds with ``run_job``'s defaults
    (no ``wait``): every fire time any of them fired runs, once. Before, a
    look at a fire time that was done held the job's key, and a host firing
    a new one at the same instant skipped it: it never ran.

    Not on SQLite: its "database clock" is each process's own (see
    test_jobs_apscheduler.test_skewed_clocks_run_each_fire_once)."""
    import os
    import shutil
    import subprocess
    import sys

    faketime = shutil.which("faketime")
    if faketime is None:
        pytest.fail("faketime is required (Debian's faketime package)")
    long = os.environ.get("DBLOCK_FULL") == "1"
    skew, period, seconds = (40, 5.0, 60.0) if long else (8, 2.0, 20.0)
    go = tmp_path / "go"
    procs, outs = [], []
    for i, offset in enumerate((-skew, 0, skew)):
        out = tmp_path / f"host{i}"
        outs.append(out)
        argv = [sys.executable, "-m", "tests.support.fire_loop", db_url, private.config.table,
                "skewed", str(period), "0.3", str(go), str(out)]  # fmt: skip
        if offset:
            argv = [faketime, "-f", f"{offset:+d}s", *argv]
        env = {**os.environ, "FAKETIME_DONT_FAKE_MONOTONIC": "1"}
        procs.append(subprocess.Popen(argv, env=env))
    try:
        deadline = time.monotonic() + 120
        while not all(o.exists() and "ready" in o.read_text() for o in outs):
            assert time.monotonic() < deadline, "the hosts did not start"
            assert all(p.poll() is None for p in procs)
            time.sleep(0.1)
        start = time.monotonic() + 1.0
        (tmp_path / "go.tmp").write_text(f"{start} {start + seconds}")
        (tmp_path / "go.tmp").rename(go)
        for p in procs:
            assert p.wait(timeout=seconds + 120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    fired: set[str] = set()
    ran: dict[str, int] = {}
    for out in outs:
        for line in out.read_text().splitlines():
            kind, at = [*line.split(), ""][:2]
            if kind == "fired":
                fired.add(at)
            elif kind == "ran":
                ran[at] = ran.get(at, 0) + 1
    lost = sorted(fired - set(ran))
    twice = sorted(at for at, n in ran.items() if n > 1)
    print(f"\n[skewed {db_url.split(':', maxsplit=1)[0]}] fired={len(fired)} ran={len(ran)} "
          f"lost={len(lost)} twice={len(twice)}")  # fmt: skip
    assert len(fired) >= seconds / period + 2 * skew / period - 2
    assert twice == []
    skips = [line for out in outs for line in out.read_text().splitlines() if "skip" in line]
    assert lost == [], skips
    recorded = _runs_of(private, "skewed")
    assert sorted(r.fire_time.isoformat() for r in recorded) == sorted(ran)  # type: ignore[union-attr]


def _runs_of(manager: LockManager, job: str) -> list[Any]:
    return statements(manager.store).latest(job, limit=1000)
