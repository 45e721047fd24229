"""The soak run (benchmarks/soak.py, scripts/soak) at smoke size: a private
PostgreSQL with autovacuum on, a short full-tilt mix of every kind of lock,
a per-second job and the sweeper; exclusion checked from the ledger, the
table kept small by the sweeper's VACUUM. ``DBLOCK_FULL=1`` runs it at full
width for 3 minutes on PostgreSQL and MariaDB (about 8 minutes); the 30-minute
run is ``scripts/soak`` (docs/operations.md, "Vacuum and bloat")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FULL = os.environ.get("DBLOCK_FULL") == "1"

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900 if FULL else 300)
def test_soak_keeps_exclusion_and_the_table_small(tmp_path: Path) -> None:
    out, chart = tmp_path / "soak.json", tmp_path / "soak.png"
    size = ["--minutes", "3"] if FULL else ["--minutes", "0.75", "--procs", "2", "--threads", "8"]
    dbs = ["--db", "postgresql"] + (["--db", "mariadb"] if FULL else [])
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.soak", *dbs, *size, "--window", "5",
         "--json", str(out), "--chart", str(chart)],
        cwd=ROOT, capture_output=True, text=True, timeout=800 if FULL else 280, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert chart.stat().st_size > 10_000
    for result in results:
        ledger, jobs = result["ledger"], result["jobs"]
        assert ledger["sections"] > 1000, result
        assert (ledger["real_overlaps"], ledger["fence_violations"]) == (0, 0), ledger
        assert jobs["twice"] == 0
        assert jobs["fire_times"] >= 0.5 * 60 * result["minutes"]
        samples = result["samples"]
        assert all(s["grants_s"] > 0 for s in samples[1:]), samples
        if result["db"] == "postgresql":
            # The sweeper vacuumed between autovacuum's visits, and the table stayed small.
            assert samples[-1]["vacuums"] >= 1, samples
            assert max(s["table_mb"] for s in samples) <= 16
        else:
            assert all(s["history"] >= 0 for s in samples)
