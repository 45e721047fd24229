"""The benchmark suite (``scripts/bench``): every comparison side by side in one run.

* uncontended lock+unlock on distinct keys: dblock against the raw driver
  sending the same statements and the plainest INSERT/DELETE, PostgreSQL
  advisory locks (sqlalchemy-dlock) and a redis-py ``Lock``
  (:mod:`~benchmarks.uncontended`);
* level 1 in-process: refusal and re-entrant acquire, zero SQL;
* hot key: P processes x T threads on one key, fail-fast and waiting, with and
  without level 1 (:mod:`~benchmarks.hotkey`);
* hand-off latency across processes (:mod:`~benchmarks.handoff`);
* memory after a million distinct keys (:mod:`~benchmarks.memory`);
* asyncio (:mod:`~benchmarks.aio`): ``AsyncLockManager`` uncontended
  against the raw asyncio driver, level 1 for tasks, hot key P processes x
  T tasks, and the event loop's lag while tasks contend;
* many users at once (:mod:`~benchmarks.many`): P processes x T threads
  (and asyncio tasks) on random keys of a large space, dblock against the
  raw driver sending its statements, sqlalchemy-dlock and redis-py ``Lock``.

Apart from the suite, :mod:`~benchmarks.listeners` measures what each of
many listening processes hears on PostgreSQL (``scripts/bench-listeners``,
on a private instance of its own).

It prints Markdown tables (with the PostgreSQL targets judged) and writes
``bench.md``, ``bench.json`` and ``bench.png`` (and ``bench-many.png``) to ``--out``.

It lives beside the package, not in it: the wheel carries none of it, and it
reaches dblock through the public API and :mod:`dblock._hooks` (the one
module that lists what such tools may read of dblock's insides). Its own
dependencies are the ``bench`` dependency group of pyproject.toml (redis,
sqlalchemy-dlock, matplotlib, tqdm) beside the drivers of the ``dev`` extra.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from collections.abc import Sequence

from dblock import DBLockError, LockArgumentError

from .options import BenchOptions, Variant, add_arguments

__all__ = ["BenchOptions", "Variant", "add_arguments", "build_parser", "main", "run"]

_NEEDS = ("redis", "sqlalchemy_dlock", "matplotlib", "tqdm", "psycopg", "pymysql")


def build_parser() -> argparse.ArgumentParser:
    """``scripts/bench``'s command line."""
    parser = argparse.ArgumentParser(
        prog="scripts/bench",
        description="Every benchmark side by side in one run; prints Markdown tables and "
        "writes bench.md, bench.json and bench.png.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``scripts/bench [options]``: 0 when every target judged in this run
    was met, 1 when one was missed (or the run failed), 2 on a mistake in
    the arguments."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("dblock").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    try:
        return run(args)
    except LockArgumentError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 2
    except DBLockError as exc:
        print(f"bench: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130


def run(args: argparse.Namespace) -> int:
    """Run, print the Markdown, write the files. 0 when every target judged
    in this run was met, 1 otherwise."""
    missing = [m for m in _NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise LockArgumentError(
            f"the benchmark suite needs {', '.join(missing)}: run it with scripts/bench "
            "(which installs the dev extra and the bench dependency group)"
        )
    options = BenchOptions.from_args(args)
    from .report import render_markdown, targets, write_chart, write_many_chart
    from .runner import run_bench

    results = run_bench(options)
    text = render_markdown(results)
    (options.out / "bench.md").write_text(text + "\n")
    (options.out / "bench.json").write_text(results.to_json() + "\n")
    print(text)
    if options.chart:
        chart = write_chart(results, options.out / "bench.png")
        print(f"\nChart: {chart}", file=sys.stderr)
        if results.many:
            chart = write_many_chart(results, options.out / "bench-many.png")
            print(f"Chart of the many-users rows: {chart}", file=sys.stderr)
    return 0 if all(t.met is not False for t in targets(results)) else 1
