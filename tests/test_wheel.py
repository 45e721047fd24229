"""The migrations ship in the wheel: an installed dblock, without the source
tree, migrates a real PostgreSQL database. The benchmark suite does not."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest
import sqlalchemy as sa

from dblock import LockManager
from dblock.schema import HEAD_REVISION

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DBLOCK_URL")}
    done = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"{args}\n{done.stdout}\n{done.stderr}"
    return done


@pytest.mark.slow
@pytest.mark.databases("postgresql")
def test_installed_wheel_migrates_postgresql(db_url: str, tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "build", "--wheel", "--outdir", dist, ROOT, cwd=tmp_path)
    (wheel,) = dist.glob("dblock-*.whl")
    # The benchmark suite lives beside the package (benchmarks/), not in it.
    with zipfile.ZipFile(wheel) as built:
        names = built.namelist()
        (metadata,) = (n for n in names if n.endswith(".dist-info/METADATA"))
        extras = [x for x in built.read(metadata).decode().splitlines() if "Extra" in x]
    assert "dblock/cli.py" in names
    assert not [n for n in names if "bench" in n.lower()]
    assert "Provides-Extra: bench" not in extras
    venv = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python, script = venv / "bin" / "python", venv / "bin" / "dblock"
    requirement = f"dblock[postgresql] @ {wheel.as_uri()}"
    _run(python, "-m", "pip", "install", "--quiet", requirement, cwd=tmp_path)

    # The installed package, and its migrations, not the checkout's.
    code = "import dblock.migrations as m; print(m.__file__); print(m.script_location())"
    where = _run(python, "-c", code, cwd=tmp_path).stdout.split()
    site = str(venv / "lib")
    assert where[0].startswith(site)
    assert where[1].startswith(site)
    assert where[1].endswith("dblock/_alembic")

    helped = _run(script, "--help", cwd=tmp_path).stdout
    assert "migrate" in helped
    assert "bench" not in helped

    table = f"dblock_t_{uuid.uuid4().hex[:8]}"
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        done = _run(script, "migrate", "--url", db_url, "--table", table, cwd=tmp_path)
        assert f"migrated {table}" in done.stdout
        assert f"empty -> {HEAD_REVISION}" in done.stdout
        inspector = sa.inspect(engine)
        assert inspector.has_table(table)
        assert inspector.has_table(f"{table}_version")
        assert inspector.has_table(f"{table}_runs")  # revision 0003 ships too
        with LockManager(db_url, table=table) as m, m.lock("wheel", blocking=False):
            pass
    finally:
        with LockManager(db_url, table=table) as m:
            m.drop_schema()
    assert not sa.inspect(engine).has_table(table)
    engine.dispose()
