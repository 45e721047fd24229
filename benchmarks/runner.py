"""One benchmark run: every section, side by side, with a progress bar.

Sections run one after the other (never two at once: they would measure each
other). Each database gets private tables named ``dblock_bench_<random>``,
dropped at the end, so the run is safe on shared servers. On PostgreSQL they
are vacuumed before each section (:meth:`Bench.vacuum`), so no section
measures on the dead rows of those before it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from dblock import DBLockError

from .aio import (
    AsyncBench,
    AsyncLevel1Result,
    LagResult,
    LagSpec,
    hot_spec,
    make_async_contenders,
    measure_async_level1,
    run_async_hot_key,
    run_lag,
)
from .handoff import HandoffResult, HandoffSpec, run_handoff
from .hotkey import HotKeyResult, HotKeySpec, run_hot_key
from .many import ManyResult, make_specs, run_many, summarise
from .memory import MemoryResult, run_memory
from .options import BenchOptions
from .uncontended import (
    Bench,
    CycleResult,
    Level1Result,
    Unavailable,
    close_all,
    make_contenders,
    measure_interleaved,
    measure_level1,
)

__all__ = ["Results", "run_bench"]


@dataclasses.dataclass
class Results:
    options: dict[str, Any]
    machine: dict[str, str]
    started: str = ""
    seconds: float = 0.0
    uncontended: list[CycleResult] = dataclasses.field(default_factory=list)
    unavailable: list[Unavailable] = dataclasses.field(default_factory=list)
    level1: list[Level1Result] = dataclasses.field(default_factory=list)
    hotkey: list[HotKeyResult] = dataclasses.field(default_factory=list)
    # The fair queue beside the default mode, same shape, waiting, in turn.
    fair: list[HotKeyResult] = dataclasses.field(default_factory=list)
    handoff: list[HandoffResult] = dataclasses.field(default_factory=list)
    memory: list[MemoryResult] = dataclasses.field(default_factory=list)
    async_uncontended: list[CycleResult] = dataclasses.field(default_factory=list)
    async_unavailable: list[Unavailable] = dataclasses.field(default_factory=list)
    async_level1: list[AsyncLevel1Result] = dataclasses.field(default_factory=list)
    async_hotkey: list[HotKeyResult] = dataclasses.field(default_factory=list)
    lag: list[LagResult] = dataclasses.field(default_factory=list)
    many: list[ManyResult] = dataclasses.field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, default=str)


class _Progress:
    """A tqdm bar on stderr (or nothing), advanced in units of planned work."""

    def __init__(self, total: float, enabled: bool) -> None:
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=round(total, 3),
                unit="step",
                file=sys.stderr,
                bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} [{elapsed}<{remaining}]",
            )

    def stage(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(text)

    def advance(self, amount: float = 1.0) -> None:
        if self._bar is not None:
            self._bar.update(amount)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _plan(options: BenchOptions) -> float:
    """Progress units: about one per second of expected run time."""
    dbs = len(options.databases)
    variants = len(options.variants)
    total = 0.0
    if "uncontended" in options.sections:
        total += 4.0 * dbs
    if "level1" in options.sections:
        total += 2.0
    if "hotkey" in options.sections:
        total += dbs * 2 * (2 + variants) * (options.seconds + 2)
    if "fair" in options.sections:
        total += dbs * 2 * options.fair_rounds * (options.seconds + 2)
    if "handoff" in options.sections:
        total += sum(len(_handoff_ways(db)) for db in options.databases) * 3.0
    if "memory" in options.sections:
        total += 4.0
    if "async" in options.sections:
        total += dbs * (4.0 + 2.0 + 2 * (options.seconds + 3) + 2 * (options.seconds + 3))
    if "many" in options.sections:
        total += _many_windows(options) * (options.many_seconds + 0.3)
    return total


def _many_windows(options: BenchOptions) -> int:
    """Windows of the many-users section (an upper bound: 4 contenders)."""
    configs = len(options.many_processes) * len(options.many_threads) + len(options.many_tasks)
    dbs = len([db for db in options.databases if db != "galera"])
    return dbs * configs * 2 * options.many_rounds * 4


def run_bench(options: BenchOptions) -> Results:
    """Run every chosen section and return the results (see :mod:`benchmarks.suite`)."""
    options.out.mkdir(parents=True, exist_ok=True)
    results = Results(
        options={k: str(v) for k, v in dataclasses.asdict(options).items() if k != "urls"},
        machine=describe_machine(options),
        started=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    )
    benches: dict[str, Bench] = {}
    progress = _Progress(_plan(options), options.progress)
    t0 = time.monotonic()
    try:
        for db in options.databases:
            progress.stage(f"{db}: private tables")
            try:
                benches[db] = Bench(db, options.url(db))
            except DBLockError as exc:
                raise DBLockError(f"the benchmark needs {db}: {exc}") from exc
        for section in options.sections:
            # Each section starts on tables with no dead rows of the ones before.
            for db, bench in benches.items():
                progress.stage(f"{db}: vacuum before {section}")
                bench.vacuum()
            _SECTIONS[section](options, benches, results, progress)
    finally:
        progress.close()
        for bench in benches.values():
            bench.close()
        sqlite_file = options.out / "bench.sqlite3"
        for suffix in ("", "-wal", "-shm"):
            Path(f"{sqlite_file}{suffix}").unlink(missing_ok=True)
    results.seconds = time.monotonic() - t0
    results.machine["loadavg after"] = _loadavg()
    return results


def _uncontended(
    options: BenchOptions, benches: dict[str, Bench], results: Results, progress: _Progress
) -> None:
    rng = random.Random(options.seed)
    for db, bench in benches.items():
        progress.stage(f"uncontended, {db}")
        contenders, missing = make_contenders(bench, options, options.redis_url)
        results.unavailable += missing
        try:
            results.uncontended += measure_interleaved(
                contenders,
                rounds=options.rounds,
                block=options.block,
                rng=rng,
                tick=lambda: progress.advance(4.0 / options.rounds),
            )
        finally:
            close_all(contenders)


def _level1(
    options: BenchOptions, benches: dict[str, Bench], results: Results, progress: _Progress
) -> None:
    db = "postgresql" if "postgresql" in benches else next(iter(benches))
    progress.stage(f"level 1 micro-benchmarks, {db}")
    results.level1.append(measure_level1(benches[db].manager, db, options.micro_ops))
    progress.advance(2.0)


def _hotkey(
    options: BenchOptions, benches: dict[str, Bench], results: Results, progress: _Progress
) -> None:
    for spec in _hot_specs(options, benches):
        progress.stage(f"hot key, {spec.database}, {spec.mode}, {spec.label}")
        results.hotkey.append(run_hot_key(spec))
        progress.advance(spec.seconds + 2)


def _fair(
    options: BenchOptions, benches: dict[str, Bench], results: Results, progress: _Progress
) -> None:
    for db, bench in benches.items():
        for _ in range(options.fair_rounds):
            for fair in (False, True):
                spec = HotKeySpec(
                    database=db,
                    url=bench.url,
                    table=bench.table,
                    label="fair" if fair else "default",
                    options=(),
                    blocking=True,
                    processes=options.processes,
                    threads=options.threads,
                    seconds=options.seconds,
                    hold=options.hold,
                    retry_after=options.retry_after,
                    urls=bench.urls if len(bench.urls) > 1 else (),
                    fair=fair,
                )
                progress.stage(f"fair queue, {db}, {spec.label}")
                results.fair.append(run_hot_key(spec))
                progress.advance(spec.seconds + 2)


def _handoff(
    options: BenchOptions, benches: dict[str, Bench], results: Results, progress: _Progress
) -> None:
    for spec in _handoff_specs(options, benches):
        progress.stage(f"hand-off, {spec.database}, {spec.label}")
        results.handoff.append(run_handoff(spec))
        progress.advance(3.0)


def _memory(
    options: BenchOptions, benches: dict[str, Bench], results: Results, progress: _Progress
) -> None:
    progress.stage("memory: registry alone")
    results.memory.append(run_memory("registry", options.memory_keys, options.memory_burst))
    progress.advance(1.0)
    if "sqlite" in benches:
        progress.stage(f"memory: {options.memory_keys:,} keys through LockManager")
        bench = benches["sqlite"]
        results.memory.append(
            run_memory("lock", options.memory_keys, options.memory_burst, bench.url, bench.table)
        )
    progress.advance(3.0)


def _async(
    options: BenchOptions, benches: dict[str, Bench], results: Results, progress: _Progress
) -> None:
    rng = random.Random(options.seed + 1)
    loop = AsyncBench()
    usable: dict[str, Bench] = {}
    try:
        for db, bench in benches.items():
            if db == "galera":
                continue
            progress.stage(f"asyncio uncontended, {db}")
            contenders, missing = make_async_contenders(bench, loop)
            results.async_unavailable += missing
            try:
                results.async_uncontended += measure_interleaved(
                    contenders,
                    rounds=options.rounds,
                    block=options.block,
                    rng=rng,
                    tick=lambda: progress.advance(4.0 / options.rounds),
                )
            finally:
                close_all(contenders)
            if contenders:
                usable[db] = bench
                progress.stage(f"asyncio level 1, {db}")
                results.async_level1.append(measure_async_level1(bench, loop, options.micro_ops))
            progress.advance(2.0)
    finally:
        loop.close()
    for db, bench in usable.items():
        for label, opts in (
            ("dblock asyncio", ()),
            ("asyncio, level 2 only", (("local_filter", False),)),
        ):
            progress.stage(f"asyncio hot key, {db}, {label}")
            spec = hot_spec(
                db,
                bench.url,
                bench.table,
                label,
                opts,
                processes=options.processes,
                threads=options.tasks,
                seconds=options.seconds,
                hold=options.hotkey_hold,
            )
            results.async_hotkey.append(run_async_hot_key(spec))
            progress.advance(options.seconds + 3)
        for processes in dict.fromkeys((1, options.processes)):
            progress.stage(f"event-loop lag, {db}, {processes} process(es)")
            results.lag.append(
                run_lag(
                    LagSpec(
                        database=db,
                        url=bench.url,
                        table=bench.table,
                        processes=processes,
                        tasks=options.lag_tasks,
                        keys=options.lag_keys,
                        seconds=options.seconds,
                        hold=options.hold,
                    )
                )
            )
            progress.advance(options.seconds + 3)


def _many(
    options: BenchOptions, benches: dict[str, Bench], results: Results, progress: _Progress
) -> None:
    rng = random.Random(options.seed + 2)
    dbs = [db for db in benches if db != "galera"]
    step = options.many_seconds + 0.3
    for db in dbs:
        specs = make_specs(
            benches[db],
            redis_url=options.redis_url,
            with_redis=db == dbs[0],  # the same Redis whichever database: measured once
            processes=options.many_processes,
            threads=options.many_threads,
            tasks=options.many_tasks,
            rounds=options.many_rounds,
            seconds=options.many_seconds,
            keys=options.many_keys,
            connections=options.many_connections,
            timeout=options.many_timeout,
            rng=rng,
        )
        for spec in specs:
            shape = f"{spec.processes} process{'es' if spec.processes > 1 else ''}"
            progress.stage(f"many users, {db}, {spec.face}, {shape}")
            parts = run_many(spec, lambda: progress.advance(step))
            results.many += summarise(spec, parts)


_SECTIONS: dict[str, Callable[[BenchOptions, dict[str, Bench], Results, _Progress], None]] = {
    "uncontended": _uncontended,
    "level1": _level1,
    "hotkey": _hotkey,
    "fair": _fair,
    "handoff": _handoff,
    "memory": _memory,
    "async": _async,
    "many": _many,
}


def _hot_specs(options: BenchOptions, benches: dict[str, Bench]) -> list[HotKeySpec]:
    labels: list[tuple[str, tuple[tuple[str, Any], ...]]] = [
        ("dblock", ()),
        *((f"dblock {v.name}", v.options) for v in options.variants),
        ("level 2 only", (("local_filter", False),)),
    ]
    return [
        HotKeySpec(
            database=db,
            url=bench.url,
            table=bench.table,
            label=label,
            options=opts,
            blocking=blocking,
            processes=options.processes,
            threads=options.threads,
            seconds=options.seconds,
            hold=options.hotkey_hold,
            retry_after=options.retry_after,
            urls=bench.urls if len(bench.urls) > 1 else (),
        )
        for db, bench in benches.items()
        for blocking in (False, True)
        for label, opts in labels
    ]


# How a woken waiter learns of a release (``notify=True``), by database; each
# is measured beside polling (``notify=False``), so the rows show what the
# wake-up buys. A Galera cluster keeps its polling row alone for now (its
# named locks are each node's; not yet measured here).
_WOKEN = {"postgresql": "LISTEN/NOTIFY", "mariadb": "named lock", "sqlite": "datagram"}


def _handoff_ways(db: str) -> list[tuple[str, bool]]:
    """(label, notify) of each hand-off row of ``db``: woken, then polling."""
    woken = _WOKEN.get(db)
    return [*([(woken, True)] if woken else []), ("polling", False)]


def _handoff_specs(options: BenchOptions, benches: dict[str, Bench]) -> list[HandoffSpec]:
    specs = []
    for db, bench in benches.items():
        for label, notify in _handoff_ways(db):
            specs.append(
                HandoffSpec(
                    database=db,
                    url=bench.url,
                    table=bench.table,
                    label=label,
                    notify=notify,
                    handoffs=options.handoffs,
                    hold=options.handoff_hold,
                )
            )
    return specs


def _loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def describe_machine(options: BenchOptions) -> dict[str, str]:
    """What the numbers came from: CPU, memory, versions, load."""
    info: dict[str, str] = {
        "cpus": str(os.cpu_count()),
        "cpu model": _cpu_model(),
        "memory": _ram(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "sqlalchemy": sa.__version__,
        "loadavg before": _loadavg(),
    }
    for db in options.databases:
        if db == "sqlite":
            import sqlite3

            info["sqlite"] = sqlite3.sqlite_version
            continue
        try:
            engine = sa.create_engine(options.url(db).split(",")[0], poolclass=sa.pool.NullPool)
            with engine.connect() as conn:
                query = "SHOW server_version" if db == "postgresql" else "SELECT VERSION()"
                info[db] = str(conn.exec_driver_sql(query).scalar())
            engine.dispose()
        except Exception as exc:
            info[db] = f"unreachable ({type(exc).__name__})"
    commit = _git_commit()
    if commit:
        info["dblock commit"] = commit
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def _ram() -> str:
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
        return f"{kb / 1024 / 1024:.1f} GiB"
    except (OSError, ValueError, IndexError):
        return "?"


def _git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        done = subprocess.run(
            [shutil.which("git") or "git", "describe", "--always", "--dirty"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""
