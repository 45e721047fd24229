"""One command line, three faces: every subcommand the faces share, run as
``dblock X``, ``flask dblock X`` and ``manage.py dblock_X`` on the same
database (one of its own, default table), each in a process of its own as
an operator runs it; stdout, stderr and the exit status compared after the
program's name, the URL's driver and the values that tick between the three
calls (ages, leases, fences, timings) are normalized.

Mutating commands (release, sweep) get the same rows before each face. The
confirmation is checked both off a terminal (stdin /dev/null: refused
without --yes) and on one (a pty answering y or n).

On SQLite by default (about a hundred processes per database: what the
faces add to the shell's commands is the same on every database, whose
own behaviour the shell's tests cover on each); on the three with
``DBLOCK_FULL=1``.
"""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dblock import DBLockError, HeldLock, LockManager
from tests.support.db import private_database
from tests.support.jobs_check import ROOT
from tests.support.sizes import FULL

pytestmark = pytest.mark.databases(*(("sqlite", "postgresql", "mariadb") if FULL else ("sqlite",)))

EXAMPLE = ROOT / "examples" / "django_project"
FACES = ("dblock", "flask", "django")
#: run's command after --, in each face: a program, a flask command, a management command.
COMMANDS = {
    "dblock": ["true"],
    "flask": ["work", "--seconds", "0", "x"],
    "django": ["check"],
}


@pytest.fixture
def url(db: str, tmp_path: Path) -> Iterator[str]:
    with private_database(db, tmp_path) as url:
        with LockManager(url) as m:
            m.create_schema()
        yield url


def _face(
    face: str, ask: list[str], url: str, tmp_path: Path
) -> tuple[list[str], dict[str, str], Path]:
    env = {
        **{
            k: v for k, v in os.environ.items() if k not in ("DBLOCK_URL", "DJANGO_SETTINGS_MODULE")
        },
        "PYTHONWARNINGS": "ignore",
        "COLUMNS": "120",
        "PYTHONPATH": str(ROOT),
    }
    if "--" in ask:
        ask = [*ask[: ask.index("--") + 1], *COMMANDS[face]]
    if face == "dblock":
        return [sys.executable, "-m", "dblock", *ask], {**env, "DBLOCK_URL": url}, ROOT
    if face == "flask":
        argv = [sys.executable, "-m", "flask", "--app", "tests.support.jobs_flask_app", "dblock"]
        return [*argv, *ask], {**env, "DBLOCK_URL": url}, ROOT
    env.update(
        PYTHONPATH=f"{ROOT}{os.pathsep}{EXAMPLE}",
        DJANGO_SETTINGS_MODULE="tests.support.django_env_settings",
        EXAMPLE_DB_ENGINE="sqlite",
        EXAMPLE_DB_NAME=str(tmp_path / "django.sqlite3"),
        EXAMPLE_DBLOCK=json.dumps({"URL": url}),
    )
    return [sys.executable, "manage.py", f"dblock_{ask[0]}", *ask[1:]], env, EXAMPLE


def _run(
    argv: list[str], env: dict[str, str], cwd: Path, answer: str | None
) -> tuple[int, str, str]:
    """Run to the end: stdin /dev/null, or (``answer``) a terminal where it is typed."""
    if answer is None:
        done = subprocess.run(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        return done.returncode, done.stdout, done.stderr
    main, secondary = pty.openpty()
    try:
        os.write(main, f"{answer}\n".encode())
        done = subprocess.run(argv, cwd=cwd, env=env, stdin=secondary,
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    finally:
        os.close(secondary)
        os.close(main)
    return done.returncode, done.stdout, done.stderr


_PROG = re.compile(r"(?:\S*python\S* -m flask dblock|manage\.py dblock_|python -m dblock) ?(\w+)")
_TICKING = [
    (re.compile(r"\b\d+(?:\.\d+)?(?:ms|s)\b|\b\d+m\d\ds\b|\b\d+\.\d+ s\b"), "<t>"),
    (re.compile(r"fence \d+"), "fence <n>"),
    (re.compile(r'"(age|lease_left|for_s|lease_left_s|fence)": -?[\d.e+-]+'), r'"\1": <n>'),
    (re.compile(r"\d\d:\d\d:\d\d"), "<time>"),
    # The storage lines of stats: what the server's vacuum and purge do meanwhile.
    (re.compile(r"\b(size|dead|purge lag) +[\d.]+( [kM]B)?"), r"\1 <n>"),
    (re.compile(r"\(\d+ runs?\)"), "(<n> runs)"),
    (
        re.compile(
            r'"(size_bytes|live_rows|dead_rows|autovacuum_count|vacuum_count|purge_lag)": '
            r"[\d.]+"
        ),
        r'"\1": <n>',
    ),
    (re.compile(r'"(last_autovacuum|last_vacuum)": "[^"]*"'), r'"\1": <t>'),
]


def _same(text: str) -> str:
    """``text`` as every face would say it: one program name (the shell's
    ``dblock: error`` for a face's ``flask dblock list: error``), one
    spelling of the URL, no ticking values, whitespace folded (usage lines
    wrap where the program's name ends)."""
    text = _PROG.sub(r"dblock \1", text)
    text = re.sub(r"\bdblock \w+(: error: | --help\))", r"dblock\1", text)
    text = text.replace("sqlite+pysqlite://", "sqlite://")
    for pattern, value in _TICKING:
        text = pattern.sub(value, text)
    text = " ".join(text.split())
    # --help: what --url and --table default to is each face's own.
    text = re.sub(r"(--url URL database URL) \(default: .*?\)(?= --table)", r"\1", text)
    return re.sub(r"(--table TABLE lock table name) \(default: [^)]*\)", r"\1", text)


def _compare(
    ask: list[str],
    url: str,
    tmp_path: Path,
    *,
    before: Callable[[], None] | None = None,
    answer: str | None = None,
    faces: tuple[str, ...] = FACES,
) -> tuple[int, str, str]:
    """``ask`` through each face (``before`` each); their common (status,
    stdout, stderr), normalized; the test fails naming the face that differs."""
    seen = {}
    for face in faces:
        if before is not None:
            before()
        argv, env, cwd = _face(face, ask, url, tmp_path)
        status, out, err = _run(argv, env, cwd, answer)
        if ask[0] == "top":  # the frame's time of day
            out = "\n".join(line for line in out.splitlines() if " at " not in line)
        if ask[0] == "run":  # the command's own output (each face runs its own)
            out = ""
        seen[face] = (status, _same(out), _same(err))
    first = seen[faces[0]]
    for face in faces[1:]:
        assert seen[face] == first, (ask, faces[0], first, face, seen[face])
    return first


def test_the_faces_have_the_same_commands() -> None:
    """Every command the faces share is in each (Django's migrate is
    ``manage.py migrate``: no second way)."""
    from dblock.cli import FACE_COMMANDS
    from dblock.contrib.flask import cli as flask_group

    django = {
        p.stem for p in (ROOT / "dblock/contrib/django/management/commands").glob("dblock_*.py")
    }
    assert set(flask_group.commands) == set(FACE_COMMANDS)
    assert django == {f"dblock_{name}" for name in FACE_COMMANDS if name != "migrate"}


class Holder:
    """The rows the faces are shown: held by one owner, taken anew before
    each face when a face changes them."""

    def __init__(self, url: str) -> None:
        self.manager = LockManager(url, client_id="faces-host:1:t", renew=False)
        self.kept: list[HeldLock] = []

    def hold(self, key: str, ttl: float = 600) -> None:
        for lock in [lock for lock in self.kept if lock.key == key]:
            self.kept.remove(lock)
            with contextlib.suppress(DBLockError):  # (a face took it: LockLost)
                lock.release()
        self.kept.append(self.manager.acquire(key, ttl=ttl))

    def held_and_expired(self) -> None:
        self.hold("faces:held")
        self.hold("faces:gone", ttl=0.1)
        time.sleep(0.3)

    def close(self) -> None:
        for lock in self.kept:
            with contextlib.suppress(DBLockError):
                lock.release()
        self.manager.close()


@pytest.fixture
def holder(url: str) -> Iterator[Holder]:
    holder = Holder(url)
    yield holder
    holder.close()


def test_list_stats_top(url: str, holder: Holder, tmp_path: Path) -> None:
    holder.held_and_expired()
    assert _compare(["list"], url, tmp_path)[0] == 0
    assert _compare(["list", "-v", "--prefix", "faces:h"], url, tmp_path)[0] == 0
    assert _compare(["list", "--json"], url, tmp_path)[0] == 0
    assert _compare(["stats"], url, tmp_path)[0] == 0
    assert _compare(["stats", "--json"], url, tmp_path)[0] == 0
    assert _compare(["top", "--once", "--prefix", "faces:"], url, tmp_path)[0] == 0
    assert _compare(["list", "--limit", "0"], url, tmp_path)[0] == 2
    assert _compare(["list", "--bogus"], url, tmp_path)[0] == 2


def test_release(url: str, holder: Holder, tmp_path: Path) -> None:
    """--force and --yes; the refusal off a terminal; the question on one."""
    held = lambda: holder.hold("faces:held")  # noqa: E731
    status, out, _ = _compare(["release", "faces:held", "--force", "--yes"], url, tmp_path,
                              before=held)  # fmt: skip
    assert status == 0
    assert out.startswith("released 'faces:held' held by faces-host:1:t:MainThread for <t>")
    status, _, err = _compare(["release", "faces:held", "--force"], url, tmp_path, before=held)
    assert status == 2
    assert "standard input is not a terminal; add --yes" in err
    status, out, _ = _compare(["release", "faces:held", "--force"], url, tmp_path,
                              before=held, answer="y")  # fmt: skip
    assert status == 0
    assert "? [y/N] released 'faces:held'" in out
    status, out, _ = _compare(["release", "faces:held", "--force"], url, tmp_path,
                              before=held, answer="n")  # fmt: skip
    assert (status, out.endswith("dblock: not released")) == (1, True)
    assert _compare(["release", "faces:held"], url, tmp_path)[0] == 2  # no --force
    assert _compare(["release", "faces:none", "--force", "-y"], url, tmp_path)[0] == 1
    status, out, _ = _compare(["release", "--prefix", "faces:", "--owner", "faces-host",
                               "--force", "--yes"], url, tmp_path,
                              before=holder.held_and_expired)  # fmt: skip
    assert status == 0
    assert out.startswith("released 2 rows with keys starting with 'faces:' and held by")
    assert _compare(["release", "--help"], url, tmp_path)[0] == 0


def test_sweep_and_migrate(url: str, holder: Holder, tmp_path: Path) -> None:
    status, out, _ = _compare(["sweep", "--once", "--grace", "0"], url, tmp_path,
                              before=holder.held_and_expired)  # fmt: skip
    assert status == 0
    assert "swept 1 expired row and 0 held past max_hold" in out
    assert _compare(["sweep"], url, tmp_path)[0] == 2  # neither --once nor --every
    # (manage.py migrate is Django's: no dblock_migrate.)
    flask_and_shell = ("dblock", "flask")
    status, out, _ = _compare(["migrate"], url, tmp_path, faces=flask_and_shell)
    assert (status, "is up to date" in out) == (0, True)
    status, out, _ = _compare(["migrate", "--sql"], url, tmp_path, faces=flask_and_shell)
    assert (status, "the latest: no SQL" in out) == (0, True)
    status, out, _ = _compare(["migrate", "--sql", "--from", "0004"], url, tmp_path,
                              faces=flask_and_shell)  # fmt: skip
    assert status == 0


def test_run_and_jobs(url: str, tmp_path: Path) -> None:
    """A fire time that already ran is skipped alike; the usage errors; the record."""
    job = f"faces-{uuid.uuid4().hex[:8]}"
    fire = ["run", job, "--fire-time", "2026-01-01T03:00Z", "--at-most", "5"]
    first = _run(*_face("dblock", [*fire, "--"], url, tmp_path), None)
    assert first[0] == 0, first
    status, _, err = _compare([*fire, "--"], url, tmp_path)
    assert status == 75
    assert err.startswith(f"dblock run: job '{job}' skipped")
    assert _compare([*fire, "-q", "--skip-status", "3", "--"], url, tmp_path)[:3:2] == (3, "")
    assert _compare(["run", job, "--at-least", "5m", "--at-most", "1m", "--"], url,
                    tmp_path)[0] == 2  # fmt: skip
    assert _compare(["run", job, "--fire-time", "2026-01-01T03:00"], url, tmp_path)[0] == 2
    assert _compare(["run", job], url, tmp_path)[0] == 2  # no command
    assert _compare(["jobs"], url, tmp_path)[0] == 0
    assert _compare(["jobs", job, "--json"], url, tmp_path)[0] == 0
    assert _compare(["jobs", "--limit", "0"], url, tmp_path)[0] == 2


def test_each_face_runs_its_own_command(url: str, tmp_path: Path) -> None:
    """``run``'s command is the face's own: a program, a flask command, a
    management command; one that does not exist ends as the shell's (127,
    nothing taken); a failing one fails the run with its status."""
    job = f"faces-{uuid.uuid4().hex[:8]}"
    for face, ran in (("dblock", ""), ("flask", "ran x"), ("django", "System check")):
        status, out, err = _run(*_face(face, ["run", f"{job}-{face}", "--"], url, tmp_path), None)
        assert (status, ran in out) == (0, True), (face, out, err)
    missing = {"dblock": ["nope-x"], "flask": ["nope-x"], "django": ["nope-x"]}
    for face, command in missing.items():
        argv, env, cwd = _face(face, ["run", job], url, tmp_path)
        status, _, err = _run([*argv, "--", *command], env, cwd, None)
        assert status == 127, (face, err)
        assert err.rstrip().endswith("'nope-x'; nothing was taken"), (face, err)
    failing = {"dblock": ["false"], "flask": ["fail"], "django": ["migrate", "--bogus"]}
    for face, command in failing.items():
        argv, env, cwd = _face(face, ["run", f"{job}-fails-{face}"], url, tmp_path)
        status, _, err = _run([*argv, "--", *command], env, cwd, None)
        assert status in (1, 2), (face, status, err)
        with LockManager(url) as m:
            from dblock._store.jobs import statements

            (run,) = statements(m.store).latest(f"{job}-fails-{face}")
        assert (run.outcome, run.detail) == ("failed", f"exit status {status}"), face
