"""``scripts/bench-listeners`` at smoke-test size (PostgreSQL).

Three pairs of processes, each pair taking turns on a key of its own, on a
private PostgreSQL instance with ``max_connections`` raised (as the full run
starts one). Speed is never asserted here; the counts must add up, and each
process must hear the releases of its own key, not everybody's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.databases("postgresql")


def test_bench_listeners_smoke(tmp_path: Path) -> None:
    out = tmp_path / "listeners.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_listeners.py"),
         "--processes", "6", "--seconds", "2", "--max-connections", "60", "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "notifications heard per process per second" in done.stdout
    r = json.loads(out.read_text())
    assert r["processes"] == 6
    assert r["grants"] > 0
    assert r["p50_ms"] <= r["p99_ms"]
    assert r["releases_per_s"] > 0
    # Every release of a key notifies (the other side of its pair waits),
    # and each process hears the releases of its own key and, with 1,024
    # buckets, almost never another's (one channel per table: 3 times as many).
    assert r["ratio"][0] >= 0.9
    assert r["ratio"][1] < 2.5
    assert r["channels"] <= 1  # its own key's bucket
