"""``dblock demo``, driven as a user runs it: the real command in a subprocess."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from dblock.demo import run_demo


def _dblock(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dblock.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_demo_on_default_sqlite_file(tmp_path: Path) -> None:
    done = _dblock("demo", "--processes", "3", "--threads", "4", "--requests", "30", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "sqlite:///dblock.sqlite3" in out
    numbers = {
        name: int(value)
        for name, value in re.findall(r"^\s+([A-Za-z0-9 -]+?)\s{2,}(\d+)", out, flags=re.MULTILINE)
    }
    assert numbers["requests"] == 3 * 4 * 30
    assert numbers["granted"] > 0
    assert numbers["refused at level 1"] > 0  # level 1 did filter
    assert numbers["SQL statements"] > 0
    assert numbers["mutual-exclusion violations"] == 0
    assert (
        numbers["granted"]
        + numbers["refused at level 1"]
        + numbers["refused at level 2"]
        + numbers["timed out waiting"]
        == numbers["requests"]
    )
    assert (tmp_path / "dblock.sqlite3").exists()


@pytest.mark.databases("postgresql", "mariadb")
def test_demo_on_server(db_url: str) -> None:
    report = run_demo(db_url, processes=2, threads=3, users=3, requests=20)
    assert report.ok
    assert report.requests == 120
    assert report.granted > 0


def test_demo_bad_argument_is_one_line(tmp_path: Path) -> None:
    done = _dblock("demo", "--processes", "0", cwd=tmp_path)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert "must be at least 1" in done.stderr
