"""``dblock bench``: the benchmark suite, every comparison side by side in one run.

* uncontended lock+unlock on distinct keys: dblock against the raw driver
  sending the same statements and the plainest INSERT/DELETE, PostgreSQL
  advisory locks (sqlalchemy-dlock) and a redis-py ``Lock``
  (:mod:`~dblock.bench.uncontended`);
* level 1 in-process: refusal and re-entrant acquire, zero SQL;
* hot key: P processes x T threads on one key, fail-fast and waiting, with and
  without level 1 (:mod:`~dblock.bench.hotkey`);
* hand-off latency across processes (:mod:`~dblock.bench.handoff`);
* memory after a million distinct keys (:mod:`~dblock.bench.memory`);
* asyncio (:mod:`~dblock.bench.aio`): ``AsyncLockManager`` uncontended
  against the raw asyncio driver, level 1 for tasks, hot key P processes x
  T tasks, and the event loop's lag while tasks contend;
* many users at once (:mod:`~dblock.bench.many`): P processes x T threads
  (and asyncio tasks) on random keys of a large space, dblock against the
  raw driver sending its statements, sqlalchemy-dlock and redis-py ``Lock``.

Apart from the suite, :mod:`~dblock.bench.listeners` measures what each of
many listening processes hears on PostgreSQL (``scripts/bench-listeners``,
on a private instance of its own).

It prints Markdown tables (with the PostgreSQL targets judged) and writes
``bench.md``, ``bench.json`` and ``bench.png`` (and ``bench-many.png``) to ``--out``. Its own
dependencies (the ``bench`` extra: redis, sqlalchemy-dlock, matplotlib, tqdm)
are imported only while it runs, so ``import dblock`` never needs them.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from ..errors import LockArgumentError
from .options import BenchOptions, Variant, add_arguments

__all__ = ["BenchOptions", "Variant", "add_arguments", "main"]

_EXTRA = ("redis", "sqlalchemy_dlock", "matplotlib", "tqdm", "psycopg", "pymysql")


def main(args: argparse.Namespace) -> int:
    """``dblock bench``: run, print the Markdown, write the files. 0 when
    every target judged in this run was met, 1 otherwise."""
    missing = [m for m in _EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise LockArgumentError(
            f"dblock bench needs the bench extra ({', '.join(missing)} missing): "
            "pip install 'dblock[bench]'"
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
