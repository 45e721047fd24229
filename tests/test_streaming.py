"""A view's lock covers its streamed body: held while the server sends every
chunk, released once the response is closed. Real server processes (flask
run, manage.py runserver); the test reads the body chunk by chunk and checks
the lock from its own process between chunks."""

from __future__ import annotations

import http.client
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dblock import LockBusy, LockManager
from tests.support import web
from tests.support.streaming import CHUNKS, chunk

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "django_project"

pytestmark = pytest.mark.slow


def read_checking(base: str, path: str, key: str, gates: Path, locks: LockManager) -> None:
    """GET ``path``; after each chunk, the lock must be held elsewhere; once
    the body is read and the connection closed, it must come free."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", path)
    response = conn.getresponse()
    assert response.status == 200
    for i in range(CHUNKS):
        if i:
            (gates / f"{key}.{i}").touch()  # let the server produce chunk i
        assert response.read(len(chunk(i))).decode() == chunk(i)
        with pytest.raises(LockBusy), locks.lock(key, blocking=False):
            pass
    (gates / f"{key}.{CHUNKS}").touch()  # let the body end
    assert response.read() == b""
    conn.close()
    deadline = time.monotonic() + 30
    while True:  # the server releases once it has closed the response
        try:
            with locks.lock(key, blocking=False):
                return
        except LockBusy:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


@pytest.fixture
def gates(tmp_path: Path) -> Path:
    path = tmp_path / "gates"
    path.mkdir()
    return path


@pytest.mark.parametrize("view", ["response", "generator"])
def test_flask_streamed_body_is_under_the_lock(
    db_url: str, view: str, gates: Path, manager: LockManager
) -> None:
    port = web.free_port()
    env = {"STREAM_DBLOCK_URL": db_url, "STREAM_GATES": str(gates), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "flask", "--app", "tests.support.stream_flask", "run"]
    with web.serving(
        [*command, "--port", str(port), "--with-threads"],
        cwd=ROOT,
        env=env,
        port=port,
        ready_path="/ready",
    ) as base:
        key = f"stream:{uuid.uuid4().hex}"
        read_checking(base, f"/{view}/{key}", key, gates, manager)


@pytest.fixture
def django_stream(tmp_path: Path, gates: Path) -> Iterator[tuple[str, LockManager]]:
    """The example project with streaming views, on a SQLite file under
    ATOMIC_REQUESTS, in a runserver process; and a manager on its lock file."""
    env: dict[str, Any] = {
        "DJANGO_SETTINGS_MODULE": "tests.support.stream_django_settings",
        "PYTHONPATH": f"{ROOT}:{EXAMPLE}",
        "EXAMPLE_DB_ENGINE": "sqlite",
        "EXAMPLE_DB_NAME": str(tmp_path / "db.sqlite3"),
        "STREAM_GATES": str(gates),
        "DJANGO_DEBUG": "0",
    }
    import os
    import subprocess

    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"],
        cwd=EXAMPLE,
        env={**os.environ, **env},
        check=True,
        timeout=300,
    )
    port = web.free_port()
    with (
        web.serving(
            [sys.executable, "manage.py", "runserver", "--noreload", f"127.0.0.1:{port}"],
            cwd=EXAMPLE,
            env=env,
            port=port,
            ready_path="/ready",
        ) as base,
        LockManager(f"sqlite:///{tmp_path / 'db.dblock.sqlite3'}") as locks,
    ):
        yield base, locks


def test_django_streamed_body_is_under_the_lock(
    django_stream: tuple[str, LockManager], gates: Path
) -> None:
    base, locks = django_stream
    key = f"stream:{uuid.uuid4().hex}"
    read_checking(base, f"/stream/{key}", key, gates, locks)
