"""The ``dblock`` command line: the admin side of dblock.

Every command takes the database from ``--url`` or ``$DBLOCK_URL`` (default:
the SQLite file ``./dblock.sqlite3``) and the lock table from ``--table``.
User mistakes and unreachable databases end in one clear line on stderr and a
non-zero exit code, never a traceback:

* 0: done; 1: the database refused or failed (unreachable, no lock table, a
  check failed); 2: bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from . import __version__, migrations
from ._engine import ENV_URL, mask, resolve_url
from .bench.options import add_arguments as add_bench_arguments
from .config import Config
from .errors import DBLockError, LockArgumentError
from .schema import TableNames

__all__ = ["main"]

log = logging.getLogger("dblock.cli")

Command = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("dblock").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    command: Command = args.command
    try:
        return command(args)
    except LockArgumentError as exc:
        print(f"dblock: error: {exc}", file=sys.stderr)
        return 2
    except DBLockError as exc:
        print(f"dblock: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dblock: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=None,
        help=f"database URL (default: ${ENV_URL}, else sqlite:///dblock.sqlite3)",
    )
    common.add_argument("--table", default="dblock_locks", help="lock table name")
    common.add_argument("-v", "--verbose", action="store_true", help="log debug messages")

    parser = argparse.ArgumentParser(
        prog="dblock", description="Distributed locks in your relational database."
    )
    parser.add_argument("--version", action="version", version=f"dblock {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="several processes x threads contending for a few users; checks exclusion",
    )
    demo.add_argument("--processes", type=_positive_int, default=4)
    demo.add_argument("--threads", type=_positive_int, default=4)
    demo.add_argument("--users", type=_positive_int, default=5)
    demo.add_argument("--requests", type=_positive_int, default=50, help="per thread")
    demo.set_defaults(command=cmd_demo)

    migrate = sub.add_parser(
        "migrate", parents=[common], help="create or upgrade the lock table (alembic)"
    )
    migrate.add_argument(
        "--sql", action="store_true", help="print the DDL for a DBA instead of running it"
    )
    migrate.set_defaults(command=cmd_migrate)

    bench = sub.add_parser(
        "bench",
        help="the benchmark suite: dblock vs raw drivers, advisory locks and Redis",
        description="Every benchmark side by side in one run; prints Markdown tables and "
        "writes bench.md, bench.json and bench.png (needs: pip install 'dblock[bench]').",
    )
    bench.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    add_bench_arguments(bench)
    bench.set_defaults(command=cmd_bench)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _names(args: argparse.Namespace) -> TableNames:
    return TableNames.of(Config(table=args.table))  # Config validates the name


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    report = run_demo(
        args.url,
        processes=args.processes,
        threads=args.threads,
        users=args.users,
        requests=args.requests,
        progress=lambda msg: print(f"... {msg}", file=sys.stderr),
    )
    print(report.render())
    return 0 if report.ok else 1


def cmd_migrate(args: argparse.Namespace) -> int:
    names = _names(args)
    url = resolve_url(args.url)
    if args.sql:
        migrations.upgrade_sql(url, names, sys.stdout)
        return 0
    from .manager import LockManager

    with LockManager(url, table=names.table) as manager:
        before = migrations.current(manager.engine, names)
        migrations.upgrade(manager.engine, names)
        after = migrations.current(manager.engine, names)
    if before == after:
        print(f"{names.table} on {mask(url)} is up to date (revision {after})")
    else:
        print(f"migrated {names.table} on {mask(url)}: {before or 'empty'} -> {after}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
