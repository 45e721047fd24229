"""Lost fire times under APScheduler on skewed clocks: issue 43's probe.

``python -m tests.support.skew_stress URL [--rounds 10] [--skew 10]
[--interval 1] [--seconds 20] [--work 0.1] [--burners 2] [--max-instances 1]
[--recheck S] [--no-coalesce]``

Each round starts three schedulers (tests/support/skew_sched.py) at once,
under ``faketime`` at -SKEW, 0 and +SKEW seconds, each with dblock's
``OncePerClusterExecutor`` and a job firing every INTERVAL seconds on an
interval trigger anchored at a fixed start, for SECONDS; BURNERS processes
spin on the CPU meanwhile. A fire time is *lost* when some scheduler fired
it (a run, a skip, a fire turned away for ``max_instances``, a miss) or it
lies between two that were, and no scheduler ran it. Prints a line per
round and the totals; exit status 1 if any fire time was lost or run twice.

A lost fire time is told by its rows: ``skip`` (a fire waited for the job's
lock through its grace), ``missed`` (its turn came past its grace),
``maxinst`` (APScheduler turned it away), none (never submitted: coalesced
with the next by a scheduler that woke late, or never fired).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from datetime import datetime, timedelta
from pathlib import Path

from tests.support import jobs_app
from tests.support.jobs_check import ROOT, start, stop

ANCHOR = "2020-01-01T00:00:00+00:00"


def lost_fires(rows: list[dict[str, object]], interval: float) -> tuple[list[str], list[str]]:
    """(fire times no one ran, fire times run more than once). A scheduler
    was due to fire every grid point from the first fire time it left a row
    for (a run, a skip, a fire turned away, a miss) to its last; a point due
    somewhere that no one ran is lost (started at different instants, the
    schedulers' spans of fire times need not meet: a point between them is
    due nowhere)."""
    runs: Counter[str] = Counter(str(r["fire_time"]) for r in rows if r["kind"] == "run")
    spans: dict[object, list[datetime]] = defaultdict(list)
    for r in rows:
        spans[r["pid"]].append(datetime.fromisoformat(str(r["fire_time"])))
    due: set[datetime] = set()
    step = timedelta(seconds=interval)
    for times in spans.values():
        point = min(times)
        while point <= max(times):
            due.add(point)
            point += step
    lost = sorted(p.isoformat() for p in due if p.isoformat() not in runs)
    return lost, sorted(f for f, n in runs.items() if n > 1)


def one_round(args: argparse.Namespace, faketime: str, work_dir: Path, n: int) -> dict[str, object]:
    ledger = uuid.uuid4().hex[:12]
    jobs_app.reset_ledger(args.url, ledger)
    procs = []
    for i, offset in enumerate((-args.skew, 0, args.skew)):
        argv = [sys.executable, "-m", "tests.support.skew_sched", str(args.seconds)]
        if offset:
            argv = [faketime, "-f", f"{offset:+d}s", *argv]
        env = {
            "DBLOCK_JOBS_URL": args.url,
            "DBLOCK_JOBS_LEDGER": ledger,
            "DBLOCK_JOBS_ANCHOR": ANCHOR,
            "DBLOCK_JOBS_INTERVAL": str(args.interval),
            "DBLOCK_JOBS_WORK": str(args.work),
            "DBLOCK_JOBS_MAX_INSTANCES": str(args.max_instances),
            **({"DBLOCK_JOBS_RECHECK": str(args.recheck)} if args.recheck else {}),
            "DBLOCK_JOBS_COALESCE": "0" if args.no_coalesce else "1",
            "DBLOCK_JOBS_STORE": f"sqlite:///{work_dir / f'store{n}-{i}.sqlite'}",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
            "PYTHONUNBUFFERED": "1",
        }
        procs.append(start(argv, env=env, log=work_dir / f"round{n}-sched{i}.log", cwd=ROOT))
    deadline = time.monotonic() + args.seconds + 60
    for p in procs:
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop(p)
    rows = jobs_app.read_ledger(args.url, ledger)
    lost, twice = lost_fires(rows, args.interval)
    kinds = Counter(str(r["kind"]) for r in rows)
    seen: dict[str, list[str]] = defaultdict(list)
    for r in rows:
        seen[str(r["fire_time"])].append(f"{r['kind']}@{r['pid']}")
    return {
        "round": n,
        "fires": len({r["fire_time"] for r in rows}),
        "runs": kinds["run"],
        "lost": len(lost),
        "twice": len(twice),
        "maxinst": kinds["maxinst"],
        "missed": kinds["missed"],
        "exits": [p.returncode for p in procs],
        "detail": {f[11:19]: seen.get(f, []) for f in lost + twice},
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--skew", type=int, default=10)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--work", type=float, default=0.1)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--max-instances", type=int, default=1)
    parser.add_argument("--recheck", type=float, help="the managers' notify_recheck (seconds)")
    parser.add_argument(
        "--no-coalesce", action="store_true", help="coalesce=False (APScheduler's default: True)"
    )
    parser.add_argument("--keep", help="a directory to keep the schedulers' logs in")
    args = parser.parse_args(argv)
    faketime = shutil.which("faketime")
    if faketime is None:
        print("faketime is required (apt-get install faketime)", file=sys.stderr)
        return 2
    from dblock import LockManager

    with LockManager(args.url) as m:
        m.create_schema()
    # Ended by a signal, still end the burners (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    burn = "while True: pass"
    burners = [subprocess.Popen([sys.executable, "-c", burn]) for _ in range(args.burners)]
    totals: Counter[str] = Counter()
    try:
        with tempfile.TemporaryDirectory(prefix="skew-stress-") as tmp:
            work_dir = Path(args.keep) if args.keep else Path(tmp)
            work_dir.mkdir(parents=True, exist_ok=True)
            for n in range(args.rounds):
                got = one_round(args, faketime, work_dir, n)
                print(" ".join(f"{k}={v}" for k, v in got.items()), flush=True)
                for k in ("fires", "runs", "lost", "twice", "maxinst", "missed"):
                    totals[k] += int(got[k])  # type: ignore[call-overload]
    finally:
        for b in burners:
            b.kill()
            b.wait()
    print("total " + " ".join(f"{k}={totals[k]}" for k in
                              ("fires", "runs", "lost", "twice", "maxinst", "missed")))  # fmt: skip
    return 1 if totals["lost"] or totals["twice"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
