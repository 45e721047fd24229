"""What ``scripts/bench`` measures and where: one frozen options object.

The command-line arguments are defined here (:func:`add_arguments`, used by
:func:`benchmarks.suite.build_parser`). This module imports nothing heavy:
the benchmark's own dependencies (the ``bench`` dependency group) are
imported only when it runs.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
from pathlib import Path
from typing import Any

from dblock import Config, LockArgumentError

__all__ = ["CLUSTERS", "DATABASES", "SECTIONS", "BenchOptions", "Variant", "add_arguments"]

DATABASES = ("postgresql", "mariadb", "sqlite")
# Measured only when asked for: a MariaDB Galera cluster, given by its nodes' URLs.
CLUSTERS = ("galera",)
SECTIONS = ("uncontended", "level1", "hotkey", "fair", "handoff", "memory", "async", "many")

_DEFAULT_URLS = {
    "postgresql": (
        "DBLOCK_BENCH_POSTGRESQL_URL",
        "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    ),
    "mariadb": ("DBLOCK_BENCH_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"),
    "redis": ("DBLOCK_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0"),
    "galera": ("DBLOCK_BENCH_GALERA_URLS", ""),
}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Variant:
    """A dblock contender with extra manager options (``--variant``), measured
    beside plain dblock: e.g. ``renewal:renew=True`` once leases renew."""

    name: str
    options: tuple[tuple[str, Any], ...]

    @classmethod
    def parse(cls, text: str) -> Variant:
        name, sep, rest = text.partition(":")
        if not sep or not name.strip():
            raise LockArgumentError(
                f"--variant must look like NAME:option=value,option=value, got {text!r}"
            )
        options: list[tuple[str, Any]] = []
        for item in filter(None, (part.strip() for part in rest.split(","))):
            opt, eq, raw = item.partition("=")
            if not eq:
                raise LockArgumentError(f"--variant {name}: {item!r} is not option=value")
            try:
                value: Any = ast.literal_eval(raw)
            except (ValueError, SyntaxError):
                value = raw  # a bare word is a string
            options.append((opt.strip(), value))
        variant = cls(name=name.strip(), options=tuple(options))
        Config.from_options(None, variant.manager_options())  # refuse bad options now
        return variant

    def manager_options(self) -> dict[str, Any]:
        return dict(self.options)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class BenchOptions:
    """Every knob of one benchmark run. ``quick()`` shrinks it to a smoke test."""

    databases: tuple[str, ...] = DATABASES
    sections: tuple[str, ...] = SECTIONS
    urls: tuple[tuple[str, str], ...] = ()
    redis_url: str = _DEFAULT_URLS["redis"][1]
    out: Path = Path("bench-results")
    chart: bool = True
    progress: bool = True
    seed: int = 20240601
    # Measured beside plain dblock (whose defaults renew leases): without renewal.
    variants: tuple[Variant, ...] = (Variant(name="no-renew", options=(("renew", False),)),)
    # uncontended: interleaved blocks of `block` cycles, `rounds` of them per contender
    rounds: int = 100
    block: int = 20
    # level 1: in-process micro-benchmarks
    micro_ops: int = 200_000
    # hot key
    processes: int = 4
    threads: int = 8
    seconds: float = 5.0
    # The hot key's critical section is empty: what it measures is what the
    # lock costs per grant, which is what level 1 is for. Any hold h caps a
    # key at 1/h grants/s whatever the lock (1 ms: 1,000/s), so a long hold
    # measures the hold; --hotkey-hold gives one anyway.
    hotkey_hold: float = 0.0
    # The fair queue's comparison and the event-loop lag: a 1 ms critical section.
    hold: float = 0.001
    # The fair queue's comparison: default and fair mode alternate this many
    # times per database (A B A B), so load that drifts touches both alike.
    fair_rounds: int = 2
    retry_after: float = 0.001
    # asyncio: hot key tasks per process; event-loop lag: tasks in all, on lag_keys keys
    tasks: int = 50
    lag_tasks: int = 200
    lag_keys: int = 5
    # hand-off
    handoffs: int = 100
    handoff_hold: float = 0.020
    # memory
    memory_keys: int = 1_000_000
    memory_burst: int = 2_000
    # many users: P processes x T threads, and asyncio (P, tasks per process),
    # each looping on random keys of many_keys; contenders interleaved in
    # windows of many_seconds, many_rounds per contender and configuration.
    many_processes: tuple[int, ...] = (1, 4)
    many_threads: tuple[int, ...] = (1, 8, 32)
    many_tasks: tuple[tuple[int, int], ...] = ((1, 200), (4, 50))
    many_rounds: int = 3
    many_seconds: float = 2.0
    many_keys: int = 1_000_000
    # Server connections in all for the contender of a window (connections //
    # P per process, everything included): under PostgreSQL's default 100.
    many_connections: int = 80
    many_timeout: float = 5.0

    def url(self, database: str) -> str:
        return dict(self.urls)[database]

    @classmethod
    def quick(cls, **overrides: Any) -> BenchOptions:
        small: dict[str, Any] = {
            "rounds": 8,
            "block": 5,
            "micro_ops": 20_000,
            "processes": 2,
            "threads": 3,
            "tasks": 5,
            "lag_tasks": 20,
            "seconds": 1.0,
            "handoffs": 10,
            "memory_keys": 20_000,
            "memory_burst": 1_500,
            "many_processes": (2,),
            "many_threads": (3,),
            "many_tasks": ((2, 3),),
            "many_rounds": 1,
            "many_seconds": 0.1,
            "fair_rounds": 1,
        }
        small.update(overrides)
        return cls(**small)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> BenchOptions:
        given: dict[str, Any] = {
            name: getattr(args, name)
            for name in (
                "rounds",
                "block",
                "processes",
                "threads",
                "tasks",
                "lag_tasks",
                "seconds",
                "handoffs",
                "memory_keys",
                "seed",
                "many_rounds",
                "many_seconds",
                "many_connections",
                "many_keys",
            )
            if getattr(args, name) is not None
        }
        if args.many_processes:
            given["many_processes"] = _ints(args.many_processes, "--many-processes")
        if args.many_threads:
            given["many_threads"] = _ints(args.many_threads, "--many-threads")
        if args.many_tasks:
            given["many_tasks"] = _shapes(args.many_tasks)
        if args.hold is not None:
            given["hold"] = args.hold / 1000.0
        if args.hotkey_hold is not None:
            given["hotkey_hold"] = args.hotkey_hold / 1000.0
        urls = {
            db: getattr(args, attr) or os.environ.get(env) or default
            for db, attr, (env, default) in (
                ("postgresql", "postgresql", _DEFAULT_URLS["postgresql"]),
                ("mariadb", "mysql", _DEFAULT_URLS["mariadb"]),
                ("galera", "galera", _DEFAULT_URLS["galera"]),
            )
        }
        out = Path(args.out)
        urls["sqlite"] = f"sqlite:///{(out / 'bench.sqlite3').resolve()}"
        env, default = _DEFAULT_URLS["redis"]
        given.update(
            databases=_choices(args.databases, DATABASES, "--databases", DATABASES + CLUSTERS),
            sections=_choices(args.only, SECTIONS, "--only"),
            urls=tuple(urls.items()),
            redis_url=args.redis or os.environ.get(env) or default,
            out=out,
            chart=not args.no_chart,
            progress=not args.no_progress,
        )
        if args.variant:  # given variants replace the default one
            given["variants"] = tuple(Variant.parse(v) for v in args.variant)
        options = cls.quick(**given) if args.quick else cls(**given)
        options.check()
        return options

    def check(self) -> None:
        for name in (
            "rounds",
            "block",
            "micro_ops",
            "processes",
            "threads",
            "tasks",
            "lag_tasks",
            "lag_keys",
            "handoffs",
            "many_rounds",
            "many_keys",
        ):
            if getattr(self, name) < 1:
                raise LockArgumentError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.handoffs < 2:
            raise LockArgumentError("handoffs must be at least 2")
        if self.seconds <= 0 or self.hold < 0 or self.hotkey_hold < 0:
            raise LockArgumentError("seconds must be > 0, hold and hotkey-hold >= 0")
        if self.many_seconds <= 0 or self.many_timeout <= 0:
            raise LockArgumentError("many-seconds and the many timeout must be > 0")
        if not self.many_processes or not self.many_threads:
            raise LockArgumentError("many: give at least one process count and thread count")
        if min((*self.many_processes, *self.many_threads)) < 1 or any(
            p < 1 or n < 1 for p, n in self.many_tasks
        ):
            raise LockArgumentError("many: processes, threads and tasks must be at least 1")
        most = max((*self.many_processes, *(p for p, _ in self.many_tasks)))
        if self.many_connections // most < 3:
            raise LockArgumentError(
                f"many-connections {self.many_connections} leaves under 3 connections per "
                f"process for {most} processes (dblock asyncio needs 3 on PostgreSQL)"
            )
        if self.memory_keys < self.memory_burst:
            raise LockArgumentError("memory-keys must be at least the burst size")
        if "galera" in self.databases and not dict(self.urls).get("galera"):
            raise LockArgumentError(
                "--databases galera needs the nodes: --galera URL,URL,... "
                "(or $DBLOCK_BENCH_GALERA_URLS; scripts/bench starts a private cluster)"
            )


def _choices(
    text: str | None, default: tuple[str, ...], flag: str, allowed: tuple[str, ...] = ()
) -> tuple[str, ...]:
    allowed = allowed or default
    if not text:
        return default
    chosen = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    unknown = [c for c in chosen if c not in allowed]
    if unknown or not chosen:
        raise LockArgumentError(
            f"{flag} takes a comma-separated list of {', '.join(allowed)}; got {text!r}"
        )
    return chosen


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        values = ()
    if not values:
        raise LockArgumentError(f"{flag} takes comma-separated integers, got {text!r}")
    return values


def _shapes(text: str) -> tuple[tuple[int, int], ...]:
    shapes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        p, sep, n = part.lower().partition("x")
        if not sep or not p.strip().isdigit() or not n.strip().isdigit():
            raise LockArgumentError(
                f"--many-tasks takes PROCESSESxTASKS,... (e.g. 1x200,4x50), got {text!r}"
            )
        shapes.append((int(p), int(n)))
    if not shapes:
        raise LockArgumentError(f"--many-tasks takes PROCESSESxTASKS,..., got {text!r}")
    return tuple(shapes)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``scripts/bench`` arguments."""
    where = parser.add_argument_group("where")
    where.add_argument(
        "--postgresql", metavar="URL", help="PostgreSQL URL ($DBLOCK_BENCH_POSTGRESQL_URL)"
    )
    where.add_argument("--mysql", metavar="URL", help="MariaDB/MySQL URL ($DBLOCK_BENCH_MYSQL_URL)")
    where.add_argument("--redis", metavar="URL", help="Redis URL ($DBLOCK_BENCH_REDIS_URL)")
    where.add_argument(
        "--galera",
        metavar="URL,URL,...",
        help="a Galera cluster's node URLs, for --databases galera ($DBLOCK_BENCH_GALERA_URLS)",
    )
    where.add_argument(
        "--databases",
        metavar="LIST",
        help=f"comma-separated subset of {','.join(DATABASES)} (the default), or galera",
    )
    where.add_argument("--only", metavar="LIST", help=f"sections: {','.join(SECTIONS)}")
    where.add_argument(
        "--out",
        default="bench-results",
        metavar="DIR",
        help="where bench.md, bench.json and bench.png go (default: bench-results)",
    )
    where.add_argument("--no-chart", action="store_true", help="do not write the PNG chart")
    where.add_argument("--no-progress", action="store_true", help="no progress bar")
    where.add_argument(
        "--variant",
        action="append",
        metavar="NAME:OPT=VAL,...",
        help="also measure dblock with these manager options (repeatable; "
        "default: no-renew:renew=False)",
    )
    how = parser.add_argument_group("how much")
    how.add_argument("--quick", action="store_true", help="a smoke run: small sizes everywhere")
    how.add_argument("--rounds", type=int, help="uncontended: interleaved rounds (100)")
    how.add_argument("--block", type=int, help="uncontended: cycles per block (20)")
    how.add_argument("--processes", type=int, help="hot key: processes (4)")
    how.add_argument("--threads", type=int, help="hot key: threads per process (8)")
    how.add_argument("--seconds", type=float, help="hot key: seconds per configuration (5)")
    how.add_argument("--tasks", type=int, help="asyncio hot key: tasks per process (50)")
    how.add_argument(
        "--lag-tasks", type=int, help="asyncio event-loop lag: tasks on 5 keys, in all (200)"
    )
    how.add_argument(
        "--hotkey-hold",
        type=float,
        help="hot key (threads and asyncio): critical section in ms (0: what the lock costs)",
    )
    how.add_argument(
        "--hold", type=float, help="fair queue, event-loop lag: critical section in ms (1)"
    )
    how.add_argument("--handoffs", type=int, help="hand-off: measured hand-offs (100)")
    how.add_argument("--memory-keys", type=int, help="memory: distinct keys (1000000)")
    how.add_argument("--seed", type=int, help="shuffle seed for the interleaving")
    many = parser.add_argument_group("many users (--only many)")
    many.add_argument("--many-processes", metavar="LIST", help="processes, comma-separated (1,4)")
    many.add_argument(
        "--many-threads", metavar="LIST", help="threads per process, comma-separated (1,8,32)"
    )
    many.add_argument(
        "--many-tasks",
        metavar="PxN,...",
        help="asyncio: processes x tasks per process (1x200,4x50)",
    )
    many.add_argument("--many-rounds", type=int, help="interleaved rounds per configuration (3)")
    many.add_argument("--many-seconds", type=float, help="seconds per contender per round (2)")
    many.add_argument(
        "--many-connections",
        type=int,
        help="server connections in all for one contender, split over the processes (80)",
    )
    many.add_argument("--many-keys", type=int, help="size of the random key space (1000000)")
