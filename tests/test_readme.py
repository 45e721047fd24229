"""The README's integration examples are the ones the tests run.

A code block after ``<!-- tested: runs -->`` is run as a script in an empty
directory; one after ``<!-- tested: PATH -->`` must be a verbatim excerpt of
that file (which the other tests run); the ``django-shell`` block is run
command by command against a database of its own.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from dblock import LockManager
from tests.support.db import DEFAULT_URLS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"<!-- tested: (\S+) -->\n```\w*\n(.*?)```\n", README, re.DOTALL)


def blocks(kind: str) -> list[str]:
    return [code for tag, code in BLOCKS if tag == kind]


def test_readme_has_the_tested_blocks() -> None:
    tags = [tag for tag, _ in BLOCKS]
    assert tags.count("runs") >= 1
    assert "examples/flask_app/app.py" in tags
    assert "examples/django_project/accounts/services.py" in tags
    assert "django-shell" in tags


@pytest.mark.parametrize(
    ("path", "code"),
    [
        pytest.param(tag, code, id=tag)
        for tag, code in BLOCKS
        if tag not in ("runs", "django-shell")
    ],
)
def test_readme_excerpts_are_the_example_files(path: str, code: str) -> None:
    assert code in (ROOT / path).read_text(), f"the README's copy of {path} is out of date"


@pytest.mark.parametrize("code", blocks("runs"))
def test_readme_service_layer_example_runs(code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "DBLOCK_URL"}
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "dblock.sqlite3").exists()


def test_readme_django_commands_run(tmp_path: Path) -> None:
    """The shell block of the Django section, line by line, on a PostgreSQL
    database of its own (`runserver` is left to the server test)."""
    (code,) = blocks("django-shell")
    name = f"dblock_readme_{uuid.uuid4().hex[:10]}"
    project = ROOT / "examples" / "django_project"
    env = {
        **{k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
        "EXAMPLE_DB_NAME": name,
        "PYTHONPATH": str(ROOT),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    url = sa.make_url(DEFAULT_URLS["postgresql"]).set(database=name)
    ran = []
    try:
        for line in code.splitlines():
            command = shlex.split(line, comments=True)
            if not command or command[0] == "cd" or "runserver" in command:
                continue
            command = [name if word == "dblock_example" else word for word in command]
            holder = None
            if "dblock_release" in command:
                holder = LockManager(url)
                held = holder.acquire(command[command.index("dblock_release") + 1])
            result = subprocess.run(
                command,
                cwd=project,
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
            ran.append(command[2] if command[0] == "python" else command[0])
            if holder is not None:
                assert result.stdout.strip() == f"released {held.key}"
                holder.close()
    finally:
        admin = sa.create_engine(
            DEFAULT_URLS["postgresql"], isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
        )
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()
    assert ran == ["createdb", "migrate", "dblock_list", "dblock_sweep", "dblock_release"]
