"""``manage.py dblock_run`` and ``flask dblock run``: the same command
started on several hosts at once (four processes here, as four crontabs
would) runs once; the others skip with exit status 75, as ``dblock run``.

Each test starts the processes together and stops them by PID within a bound.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from dblock import LockManager
from tests.support.jobs_check import ROOT

EXAMPLE = ROOT / "examples" / "django_project"
HOSTS = 4


def _together(
    argvs: list[list[str]], *, env: dict[str, str], cwd: Path
) -> list[tuple[int, str, str]]:
    """Start the processes at once; each one's (status, stdout, stderr)."""
    procs = [
        subprocess.Popen(argv, cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for argv in argvs
    ]  # fmt: skip
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            results.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def _runs(db_url: str, job: str) -> list[str]:
    import sqlalchemy as sa

    with LockManager(db_url) as m:
        runs = sa.Table(m.names.runs_table, sa.MetaData(), autoload_with=m.engine)
        with m.engine.connect() as conn:
            return [r.outcome for r in conn.execute(sa.select(runs).where(runs.c.job == job))]


# -- Django ---------------------------------------------------------------------


def _django_env(db_url: str, tmp_path: Path) -> dict[str, str]:
    return {
        "PYTHONPATH": f"{ROOT}{os.pathsep}{EXAMPLE}",
        "DJANGO_SETTINGS_MODULE": "tests.support.django_env_settings",
        "EXAMPLE_DB_ENGINE": "sqlite",
        "EXAMPLE_DB_NAME": str(tmp_path / "django.sqlite3"),
        "EXAMPLE_DBLOCK": json.dumps({"URL": db_url}),
    }


@pytest.mark.slow
def test_django_dblock_run_on_four_hosts_runs_once(db_url: str, tmp_path: Path) -> None:
    name = f"dj-{uuid.uuid4().hex[:10]}"
    code = "import time; time.sleep(1.5); print('ran it')"
    argv = [sys.executable, "manage.py", "dblock_run", name, "--at-most", "30s", "--per", "1h",
            "--", "shell", "-c", code]  # fmt: skip
    results = _together([argv] * HOSTS, env=_django_env(db_url, tmp_path), cwd=EXAMPLE)
    assert sorted(r[0] for r in results) == [0] + [75] * (HOSTS - 1), results
    ran = [r for r in results if "ran it" in r[1]]
    skipped = [r for r in results if "skipped" in r[2]]
    assert (len(ran), len(skipped)) == (1, HOSTS - 1), results
    assert _runs(db_url, name) == ["success"]


@pytest.mark.databases("sqlite")
def test_django_dblock_run_usage(db_url: str, tmp_path: Path) -> None:
    env = _django_env(db_url, tmp_path)
    base = [sys.executable, "manage.py", "dblock_run", f"dj-{uuid.uuid4().hex[:10]}"]
    no_command = _together([[*base, "--at-most", "5"]], env=env, cwd=EXAMPLE)[0]
    assert no_command[0] == 2  # as `dblock run`: a usage error
    assert "dblock run needs a command after --" in no_command[2]
    no_zone = _together([[*base, "--at-most", "5", "--fire-time", "2026-01-01T03:00", "--",
                          "check"]], env=env, cwd=EXAMPLE)[0]  # fmt: skip
    assert no_zone[0] == 2
    assert "a fire time needs its UTC offset" in no_zone[2]
    unknown = _together([[*base, "--", "nope"]], env=env, cwd=EXAMPLE)[0]
    assert unknown[0] == 127  # as the shell's "command not found"
    assert "no such management command: 'nope'; nothing was taken" in unknown[2]
    bad = _together([[*base, "--at-most", "5 weeks", "--", "check"]], env=env, cwd=EXAMPLE)[0]
    assert bad[0] == 2
    assert "not a duration: '5 weeks'" in bad[2]
    # The same fire time twice: the second is skipped, with the status asked for.
    fire = ["--fire-time", "2026-01-01T03:00Z", "--skip-status", "3", "--", "check"]
    first = _together([[*base, "--at-most", "5", *fire]], env=env, cwd=EXAMPLE)[0]
    again = _together([[*base, "--at-most", "5", *fire]], env=env, cwd=EXAMPLE)[0]
    assert (first[0], again[0]) == (0, 3), (first, again)
    assert "System check identified no issues" in first[1]
    assert "skipped" in again[2]
    quiet = _together([[*base, "-q", *fire]], env=env, cwd=EXAMPLE)[0]
    assert (quiet[0], quiet[2]) == (3, "")


# -- Flask ----------------------------------------------------------------------


def _flask(*args: str) -> list[str]:
    return [sys.executable, "-m", "flask", "--app", "tests.support.jobs_flask_app", *args]


@pytest.mark.slow
def test_flask_dblock_run_on_four_hosts_runs_once(db_url: str) -> None:
    name = f"fl-{uuid.uuid4().hex[:10]}"
    argv = _flask("dblock", "run", name, "--at-most", "30s", "--per", "1h", "--",
                  "work", "--seconds", "1.5", "nightly")  # fmt: skip
    results = _together([argv] * HOSTS, env={"DBLOCK_URL": db_url}, cwd=ROOT)
    assert sorted(r[0] for r in results) == [0] + [75] * (HOSTS - 1), results
    ran = [r for r in results if "ran nightly" in r[1]]
    skipped = [r for r in results if "skipped" in r[2]]
    assert (len(ran), len(skipped)) == (1, HOSTS - 1), results
    assert _runs(db_url, name) == ["success"]


@pytest.mark.databases("sqlite")
def test_flask_dblock_run_usage_and_a_failing_command(db_url: str) -> None:
    env = {"DBLOCK_URL": db_url}
    name = f"fl-{uuid.uuid4().hex[:10]}"
    unknown = _together([_flask("dblock", "run", name, "--at-most", "5", "--", "nope")],
                        env=env, cwd=ROOT)[0]  # fmt: skip
    assert unknown[0] == 127  # as the shell's "command not found"
    assert "dblock run: error: no such flask command: 'nope'; nothing was taken" in unknown[2]
    argv = _flask("dblock", "run", name, "--at-most", "5", "--fire-time", "2026-01-01T03:00Z",
                  "--", "fail")  # fmt: skip
    failed = _together([argv], env=env, cwd=ROOT)[0]
    assert failed[0] == 1
    assert "failed on purpose" in failed[2]
    assert _runs(db_url, name) == ["failed"]


# -- one skip line, three faces ----------------------------------------------------------


@pytest.mark.databases("sqlite")
def test_the_three_faces_say_the_same_skip(db_url: str, tmp_path: Path) -> None:
    """A fire time that already ran, asked again through ``dblock run``,
    ``manage.py dblock_run`` and ``flask dblock run``: the same exit status
    and the same line, naming the job, the fire time and why."""
    name = f"faces-{uuid.uuid4().hex[:10]}"
    fire = ["--fire-time", "2026-01-01T03:00Z", "--at-most", "5"]
    dblock = os.path.join(os.path.dirname(sys.executable), "dblock")
    first = _together([[dblock, "run", name, *fire, "--", "true"]],
                      env={"DBLOCK_URL": db_url}, cwd=ROOT)[0]  # fmt: skip
    assert first[0] == 0, first
    shell = _together([[dblock, "run", name, *fire, "--", "true"]],
                      env={"DBLOCK_URL": db_url}, cwd=ROOT)[0]  # fmt: skip
    django = _together([[sys.executable, "manage.py", "dblock_run", name, *fire, "--", "check"]],
                       env=_django_env(db_url, tmp_path), cwd=EXAMPLE)[0]  # fmt: skip
    flask = _together([_flask("dblock", "run", name, *fire, "--", "work", "nightly")],
                      env={"DBLOCK_URL": db_url}, cwd=ROOT)[0]  # fmt: skip
    assert shell[0] == django[0] == flask[0] == 75, (shell, django, flask)
    line = shell[2].strip()
    assert line.startswith(f"dblock run: job '{name}'"), line
    assert "skipped" in line
    assert django[2].strip().splitlines()[-1] == line, django[2]
    assert flask[2].strip().splitlines()[-1] == line, flask[2]


@pytest.mark.databases("sqlite")
def test_jobs_stats_and_top_are_the_shells_in_every_face(db_url: str, tmp_path: Path) -> None:
    """``dblock jobs|stats|top``, ``flask dblock jobs|stats|top`` and
    ``manage.py dblock_jobs|dblock_stats|dblock_top``: one parser, so the
    same output and exit status, bad input included."""
    name = f"faces-{uuid.uuid4().hex[:10]}"
    dblock = os.path.join(os.path.dirname(sys.executable), "dblock")
    ran = _together([[dblock, "run", name, "--per", "1d", "--", "true"]],
                    env={"DBLOCK_URL": db_url}, cwd=ROOT)[0]  # fmt: skip
    assert ran[0] == 0, ran
    asks = [
        ["jobs", name, "--json"],
        ["stats", "--json"],
        ["top", "--once", "--prefix", "nothing-here:"],
        ["jobs", "--limit", "0"],
        ["stats", "--bogus"],
    ]
    for ask in asks:
        shell = _together([[dblock, *ask]], env={"DBLOCK_URL": db_url, "COLUMNS": "120"},
                          cwd=ROOT)[0]  # fmt: skip
        flask = _together([_flask("dblock", *ask)], env={"DBLOCK_URL": db_url, "COLUMNS": "120"},
                          cwd=ROOT)[0]  # fmt: skip
        django = _together(
            [[sys.executable, "manage.py", f"dblock_{ask[0]}", *ask[1:]]],
            env={**_django_env(db_url, tmp_path), "COLUMNS": "120"},
            cwd=EXAMPLE,
        )[0]
        assert shell[0] == flask[0] == django[0], (ask, shell, flask, django)

        def same(text: str) -> str:  # (the URL as each face names it: its own engine's)
            # (and the program's name in a refusal: the face's)
            text = re.sub(r"\S*python\S* -m flask dblock |manage\.py dblock_", "dblock ", text)
            text = re.sub(r"\bdblock \w+(: error: | --help\))", r"dblock\1", text)
            return text.replace("sqlite+pysqlite://", "sqlite://")

        if ask[-1] == "--json":
            # (Ages and leases left tick between the three: the rows of
            # other tests of this worker's database among them.)
            got = {json.dumps(_steady(json.loads(same(out[1])))) for out in (shell, flask, django)}
            assert len(got) == 1, (ask, got)
        elif ask[0] == "top":
            got = {same(shell[1]), same(flask[1]), same(django[1])}
            if ask[0] == "top":  # the frame's time of day may tick between the three
                got = {
                    "\n".join(line for line in t.splitlines() if " at " not in line) for t in got
                }
            assert len(got) == 1, (ask, got)
        else:
            assert same(shell[2]) == same(flask[2]) == same(django[2]), (ask, shell, flask, django)
    listed = _together([[dblock, "jobs", name, "--json"]], env={"DBLOCK_URL": db_url}, cwd=ROOT)
    jobs = json.loads(listed[0][1])
    assert jobs[0]["job"] == name


def _steady(value: object) -> object:
    """``value`` (parsed JSON) without what changes from one second to the next."""
    ticking = {"age", "lease_left", "expired", "for_s", "lease_left_s"}
    if isinstance(value, dict):
        return {k: _steady(v) for k, v in value.items() if k not in ticking}
    if isinstance(value, list):
        return [_steady(v) for v in value]
    return value
