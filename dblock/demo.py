"""``dblock demo``: many processes, many threads, a handful of users.

Every worker thread sends requests for random users, half of them fail-fast
and half waiting (with a timeout). A granted request runs a critical section
that checks mutual exclusion itself, on a ledger table in the same database:

* it claims the user's ``holder`` slot with a compare-and-set
  (``UPDATE … SET holder = me WHERE holder IS NULL``) and frees it the same way
  at the end: a CAS that matches no row means another request was inside at
  the same time;
* in between it does a deliberately non-atomic read-modify-write of the
  user's counter, so overlapping sections would also lose updates: at the end
  the counters must add up to the number of grants.

The report counts grants, refusals by level, timeouts, the lock's own SQL
statements (counted with SQLAlchemy engine events in every worker) and the
violations found. The exit code is non-zero if there was any violation.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import random
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from ._engine import resolve_url
from .errors import LockBusy, LockTimeout
from .lock import UNSET
from .manager import LockManager

__all__ = ["DemoReport", "run_demo"]

LEDGER = sa.Table(
    "dblock_demo",
    sa.MetaData(),
    sa.Column("user_id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("holder", sa.String(64), nullable=True),
    sa.Column("counter", sa.Integer, nullable=False),
)


@dataclasses.dataclass
class DemoReport:
    url: str = ""
    processes: int = 0
    threads: int = 0
    users: int = 0
    requests: int = 0
    granted: int = 0
    refused_level1: int = 0
    refused_level2: int = 0
    timed_out: int = 0
    statements: int = 0
    violations: int = 0
    lost_updates: int = 0
    seconds: float = 0.0

    def add(self, other: DemoReport) -> None:
        for field in ("requests", "granted", "refused_level1", "refused_level2", "timed_out",
                      "statements", "violations"):  # fmt: skip
            setattr(self, field, getattr(self, field) + getattr(other, field))

    @property
    def ok(self) -> bool:
        return self.violations == 0 and self.lost_updates == 0

    def render(self) -> str:
        per = self.statements / self.requests if self.requests else 0.0
        violations = self.violations + self.lost_updates
        rows = [
            ("requests", self.requests, ""),
            ("granted", self.granted, "ran the critical section"),
            ("refused at level 1", self.refused_level1, "this process had it: no SQL sent"),
            ("refused at level 2", self.refused_level2, "another process held the row"),
            ("timed out waiting", self.timed_out, ""),
            ("SQL statements", self.statements, f"{per:.2f} per request, by the lock"),
            ("mutual-exclusion violations", violations, "checked: holder CAS, lost updates"),
        ]
        width = max(len(r[0]) for r in rows)
        lines = [
            f"dblock demo on {self.url}",
            f"{_count(self.processes, 'process', 'processes')} x "
            f"{_count(self.threads, 'thread', 'threads')}, {_count(self.users, 'user', 'users')}, "
            f"{_count(self.requests, 'request', 'requests')} in {self.seconds:.1f} s",
            "",
        ]
        lines += [f"  {name:<{width}}  {value:>7}  {note}".rstrip() for name, value, note in rows]
        lines.append("")
        lines.append("OK: no two requests for one user were ever inside at once." if self.ok
                     else "FAILED: mutual exclusion was violated.")  # fmt: skip
        return "\n".join(lines)


def run_demo(
    url: str | None = None,
    *,
    processes: int = 4,
    threads: int = 4,
    users: int = 5,
    requests: int = 50,
    hold: float = 0.002,
    progress: Callable[[str], None] | None = None,
) -> DemoReport:
    """Run the demo and return its report (see the module docstring)."""
    resolved = resolve_url(url).render_as_string(hide_password=False)
    say = progress or (lambda _msg: None)
    with LockManager(resolved) as manager:
        say(f"creating the lock table on {manager.url} (if needed)")
        manager.create_schema()
        report = DemoReport(url=manager.url, processes=processes, threads=threads, users=users)
    ledger = _ledger_engine(resolved)
    LEDGER.create(ledger, checkfirst=True)
    with ledger.begin() as conn:
        conn.execute(LEDGER.delete())
        conn.execute(
            LEDGER.insert(), [{"user_id": u, "holder": None, "counter": 0} for u in range(users)]
        )

    ctx = multiprocessing.get_context("spawn")
    results: Any = ctx.Queue()
    go = ctx.Event()
    plan = _Plan(url=resolved, users=users, threads=threads, requests=requests, hold=hold)
    workers = [
        ctx.Process(
            target=_worker,
            args=(plan, go, results),
            name=f"dblock-demo-{i}",
        )
        for i in range(processes)
    ]
    say(
        f"starting {_count(processes, 'process', 'processes')} x "
        f"{_count(threads, 'thread', 'threads')}"
    )
    for w in workers:
        w.start()
    started = time.monotonic()
    go.set()
    for _ in workers:
        report.add(results.get(timeout=600))
    for w in workers:
        w.join(60)
    report.seconds = time.monotonic() - started

    with ledger.connect() as conn:
        total = conn.execute(sa.select(sa.func.sum(LEDGER.c.counter))).scalar_one() or 0
        stuck = conn.execute(
            sa.select(sa.func.count()).where(LEDGER.c.holder.is_not(None))
        ).scalar_one()
    ledger.dispose()
    report.lost_updates = report.granted - int(total)
    report.violations += int(stuck)
    return report


def _ledger_engine(url: str) -> sa.Engine:
    options: dict[str, Any] = {"isolation_level": "AUTOCOMMIT"}
    if url.startswith("sqlite"):
        options["connect_args"] = {"timeout": 60.0}
    return sa.create_engine(url, **options)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Plan:
    url: str
    users: int
    threads: int
    requests: int
    hold: float


def _worker(plan: _Plan, go: Any, results: Any) -> None:
    manager = LockManager(plan.url)
    ledger = _ledger_engine(plan.url)
    statements = 0
    count_lock = threading.Lock()

    def count(*_args: Any) -> None:
        nonlocal statements
        with count_lock:
            statements += 1

    sa.event.listen(manager.engine, "before_cursor_execute", count)
    reports = [DemoReport() for _ in range(plan.threads)]

    def run(report: DemoReport) -> None:
        rng = random.Random()
        for i in range(plan.requests):
            user = rng.randrange(plan.users)
            report.requests += 1
            try:
                blocking = i % 2 == 0  # half wait (at most 5 s), half fail fast
                wait = 5.0 if blocking else UNSET
                with manager.lock(f"demo:user:{user}", blocking=blocking, timeout=wait):
                    report.granted += 1
                    report.violations += _critical_section(ledger, user, plan.hold)
            except LockBusy as exc:
                if exc.level == 1:
                    report.refused_level1 += 1
                else:
                    report.refused_level2 += 1
            except LockTimeout:
                report.timed_out += 1

    pool = [threading.Thread(target=run, args=(r,)) for r in reports]
    go.wait()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    total = DemoReport()
    for r in reports:
        total.add(r)
    total.statements = statements
    manager.close()
    ledger.dispose()
    results.put(total)


def _critical_section(ledger: sa.Engine, user: int, hold: float) -> int:
    """Returns how many mutual-exclusion violations this section saw (0 or more)."""
    me = f"{os.getpid()}:{threading.get_ident()}:{uuid.uuid4().hex[:8]}"
    row = LEDGER.c.user_id == user
    violations = 0
    with ledger.connect() as conn:
        claimed = conn.execute(
            LEDGER.update().where(row, LEDGER.c.holder.is_(None)).values(holder=me)
        ).rowcount
        if claimed != 1:
            violations += 1
        value = conn.execute(sa.select(LEDGER.c.counter).where(row)).scalar_one()
    time.sleep(hold)  # a lost update needs overlapping sections; make them likely
    with ledger.connect() as conn:
        conn.execute(LEDGER.update().where(row).values(counter=value + 1))
        freed = conn.execute(
            LEDGER.update().where(row, LEDGER.c.holder == me).values(holder=None)
        ).rowcount
        if freed != 1:
            violations += 1
    return violations


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"
