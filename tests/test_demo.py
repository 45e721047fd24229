"""``dblock demo``, driven as a user runs it: the real command in a subprocess."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
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


# -- scripts/demo: dblock alone, not the development extra ------------------------

ROOT = Path(__file__).resolve().parent.parent


def _tree_copy(to: Path) -> Path:
    """What a fresh clone holds that scripts/demo installs from."""
    import shutil

    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, to / name)
    for name in ("dblock", "alembic", "scripts"):
        shutil.copytree(ROOT / name, to / name, ignore=shutil.ignore_patterns("__pycache__"))
    return to


def _script(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DBLOCK_URL", "VIRTUAL_ENV")}
    return subprocess.run(
        ["scripts/demo", *args],
        cwd=tree,
        env={**env, "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_scripts_demo_installs_dblock_alone(tmp_path: Path) -> None:
    tree = _tree_copy(tmp_path)
    started = time.monotonic()
    done = _script(tree, "--processes", "2", "--threads", "2", "--requests", "10")
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert "OK: no two requests for one user were ever inside at once." in done.stdout
    assert "installing dblock into .venv-demo" in done.stderr
    assert not (tree / ".venv").exists()  # the development environment is not made
    listed = subprocess.run(
        [str(tree / ".venv-demo/bin/python"), "-m", "pip", "list", "--format=freeze"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    installed = {line.split("==")[0].lower() for line in listed.stdout.split()}
    assert {"dblock", "sqlalchemy", "alembic", "apscheduler"} <= installed
    assert not installed & {"matplotlib", "selenium", "mkdocs", "psycopg", "pymysql", "django"}
    assert len(installed) < 20, installed
    assert took < 120, took  # about 20 s here, against 73 s for [dev]
    # The stamp names the extras: scripts/test, wanting [dev], installs again.
    stamp = (tree / ".venv-demo/.dblock-installed").read_text().split()
    assert stamp[1:] == ["[]"]

    again = _script(tree, "--processes", "1", "--threads", "1", "--requests", "1")
    assert again.returncode == 0, again.stderr
    assert "installing" not in again.stderr  # up to date: nothing installed twice


def test_scripts_demo_uses_an_up_to_date_dev_environment(tmp_path: Path) -> None:
    tree = _tree_copy(tmp_path)
    stamp = ROOT / ".venv/.dblock-installed"
    if not stamp.exists():
        pytest.fail("run scripts/test (or source scripts/_venv.sh) first: .venv has no stamp")
    (tree / ".venv").symlink_to(ROOT / ".venv")  # made by scripts/test, for this pyproject.toml
    done = _script(tree, "--processes", "1", "--threads", "2", "--requests", "5")
    assert done.returncode == 0, done.stderr
    assert "installing" not in done.stderr
    assert not (tree / ".venv-demo").exists()
