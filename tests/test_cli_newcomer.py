"""What a new user working from a wheel found (issue 43, items 2 to 8): the
command line's defaults, messages and the pages they follow.

Each test fails without its mend: ``dblock run`` without a database,
echoed values, ``migrate --sql`` from the database's revision, the pages'
install lines, the prompt skip of a kept key under ``--per``, the version,
``list``/``top`` widths, plurals and argument mistakes.
"""

from __future__ import annotations

import ast
import importlib.metadata
import inspect
import os
import re
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import dblock
from dblock import JobSkipped, LockManager, migrations
from dblock._store.jobs import statements
from dblock.cli import main, shortened
from dblock.options import LockArgs
from dblock.schema import TableNames
from tests.support.cli import COMMAND
from tests.support.cli import dblock as run_dblock
from tests.test_docs import BLOCKS, ROOT

SKIP = 75


def _pyproject() -> dict[str, Any]:
    """pyproject.toml, read (tomllib from 3.11; its backport, as pip vendors it, on 3.10)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        from pip._vendor import tomli as tomllib  # type: ignore[no-redef]
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


LONG = "k" * 10_000


def _one_line(done: subprocess.CompletedProcess[str], status: int) -> str:
    assert done.returncode == status, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr
    return lines[0]


# -- item 2: dblock run takes no default database ---------------------------------------


def test_run_without_a_database_refuses_in_one_line(tmp_path: Path) -> None:
    """Under cron (no DBLOCK_URL) a local SQLite file would be a lock only
    this host sees: every host would run the job. Refused, exit 2, and no
    file made."""
    line = _one_line(run_dblock("run", "nightly", "--", "true", cwd=tmp_path), 2)
    assert "--url or $DBLOCK_URL" in line
    assert "crontab" in line
    assert list(tmp_path.iterdir()) == []  # no ./dblock.sqlite3, nothing taken


def test_run_on_an_explicit_sqlite_url_is_one_host_by_choice(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'one-host.sqlite3'}"
    assert run_dblock("--url", url, "migrate").returncode == 0
    done = run_dblock("--url", url, "run", "nightly", "--", "true", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    done = run_dblock("run", "nightly2", "--", "true", env={"DBLOCK_URL": url}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr


# -- item 3: the extra named for mysqlclient ---------------------------------------------


def test_pyproject_cites_pages_that_exist() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    cited = re.findall(r"docs/[\w./-]+\.md", text)
    assert cited
    for page in cited:
        assert (ROOT / page).is_file(), f"pyproject.toml cites {page}, which does not exist"


def test_mysqlclient_missing_names_its_own_extra(tmp_path: Path) -> None:
    """``mysql+mysqldb://`` without mysqlclient: the hint installs mysqlclient
    (``.[mysqlclient]``), not PyMySQL (``.[mysql]``)."""
    code = (
        "import sys; sys.modules['MySQLdb'] = None; "
        "from dblock.cli import main; "
        "sys.exit(main(['--url', 'mysql+mysqldb://nobody@127.0.0.1:1/x', 'list']))"
    )
    env = {k: v for k, v in os.environ.items() if k != "DBLOCK_URL"}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    line = _one_line(done, 2)
    assert "'.[mysqlclient]'" in line, line


# -- item 4: long values are shortened, whatever the command ----------------------------


def test_shortened_cuts_every_long_quoted_value() -> None:
    long_double = "it's" + "x" * 400
    message = f"a {LONG!r} b {long_double!r} c 'short'"
    out = shortened(message)
    assert len(out) < 800
    assert "... (10000 characters)" in out
    assert "... (404 characters)" in out
    assert out.endswith("c 'short'")
    assert shortened("a 'k' b") == "a 'k' b"


def test_run_with_a_long_key_is_short_and_exit_2(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.sqlite3'}"
    line = _one_line(run_dblock("--url", url, "run", LONG, "--", "true"), 2)
    assert len(line) < 600, len(line)
    assert "(10000 characters)" in line


def test_jobs_with_an_impossible_name_is_a_usage_error(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'x.sqlite3'}"
    assert run_dblock("--url", url, "migrate").returncode == 0
    line = _one_line(run_dblock("--url", url, "jobs", LONG), 2)
    assert len(line) < 600, len(line)
    # The longest job name is the key's limit less "job:": 251 is fine, 252 is not.
    assert run_dblock("--url", url, "jobs", "j" * 251).returncode == 0
    assert "the limit is 251" in _one_line(run_dblock("--url", url, "jobs", "j" * 252), 2)


def test_argparse_refusals_of_long_values_are_short() -> None:
    done = run_dblock("run", "k", "--fire-time", LONG, "--", "true")
    line = _one_line(done, 2)
    assert len(line) < 600
    assert "(10000 characters)" in line


# -- item 5: migrate --sql from where the database is ----------------------------------


def _names() -> TableNames:
    return TableNames(table=f"dblock_t_{uuid.uuid4().hex[:8]}")


def test_migrate_sql_starts_at_the_databases_revision(db_url: str) -> None:
    names = _names()
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        migrations.upgrade(engine, names, "0001")
        done = run_dblock("migrate", "--sql", "--url", db_url, "--table", names.table)
        assert done.returncode == 0, done.stderr
        assert f"CREATE TABLE {names.table} " not in done.stdout  # it exists
        assert "Running upgrade 0001 -> 0002" in done.stdout
        assert "-> 0001" not in done.stdout
        assert migrations.current(engine, names) == "0001"  # printed, not run
        migrations.upgrade(engine, names)
        latest = run_dblock("migrate", "--sql", "--url", db_url, "--table", names.table)
        assert latest.returncode == 0, latest.stderr
        assert latest.stdout.startswith("-- ")
        assert "the latest: no SQL" in latest.stdout
        assert "CREATE" not in latest.stdout
        assert "ALTER" not in latest.stdout
    finally:
        migrations.downgrade(engine, names)
        engine.dispose()


def test_migrate_sql_of_an_unreachable_database_is_an_error() -> None:
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none"
    line = _one_line(run_dblock("migrate", "--sql", "--url", url), 1)
    assert "connect" in line


def test_migrate_sql_from_a_revision_is_offline() -> None:
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none"  # never reached
    done = run_dblock("migrate", "--sql", "--from", "0001", "--url", url)
    assert done.returncode == 0, done.stderr
    assert "Running upgrade 0001 -> 0002" in done.stdout
    assert "CREATE TABLE dblock_locks " not in done.stdout
    whole = run_dblock("migrate", "--sql", "--from", "base", "--url", url)
    assert "CREATE TABLE dblock_locks " in whole.stdout
    assert "not a revision" in _one_line(run_dblock("migrate", "--sql", "--from", "9"), 2)
    assert "--from goes with --sql" in _one_line(run_dblock("migrate", "--from", "0001"), 2)


def test_migrate_sql_of_a_missing_sqlite_file_is_the_whole_script(tmp_path: Path) -> None:
    done = run_dblock("migrate", "--sql", "--url", f"sqlite:///{tmp_path / 'new.sqlite3'}")
    assert done.returncode == 0, done.stderr
    assert "CREATE TABLE dblock_locks " in done.stdout
    assert list(tmp_path.iterdir()) == []  # not made


# -- item 6: the OpenTelemetry example runs with its page's install line ---------------


def _provides(distribution: str, module: str) -> bool:
    path = module.replace(".", "/")
    files = importlib.metadata.distribution(distribution).files or []
    return any(str(f).startswith(f"{path}/") or str(f) == f"{path}.py" for f in files)


def test_the_opentelemetry_example_needs_only_what_its_page_installs() -> None:
    page = ROOT / "docs" / "operations.md"
    (example,) = [
        b for b in BLOCKS if b.page == page and b.lang == "python" and "opentelemetry" in b.code
    ]
    imported = {
        ".".join(node.module.split(".")[:2])
        for node in ast.walk(ast.parse(example.code))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("opentel")
    }
    assert "opentelemetry.sdk" in imported
    (line,) = [
        line
        for b in BLOCKS
        if b.page == page and b.lang == "sh"
        for line in b.code.splitlines()
        if line.startswith("pip install") and "otel" in line
    ]
    words = line.split("#")[0].split()[2:]
    extras = _pyproject()["project"]["optional-dependencies"]
    installed: set[str] = set()
    for word in words:
        if word.startswith("'.["):
            for extra in word[3:-2].split(","):
                installed |= {re.split(r"[<>=\[ ]", r)[0] for r in extras[extra]}
        else:
            installed.add(word)
    for module in imported:
        assert any(_provides(d, module) for d in installed), (
            f"{module} (imported by the example) comes with none of {sorted(installed)}"
        )


# -- item 7: --per on a key kept for at_least skips at once -----------------------------


def test_a_fire_time_skips_a_kept_key_at_once(private: LockManager) -> None:
    name = f"kept-{uuid.uuid4().hex[:8]}"
    private.run_job(name, lambda: None, at_least=300)
    fire = datetime(2026, 11, 25, 3, tzinfo=timezone.utc)
    began = time.monotonic()
    with pytest.raises(JobSkipped) as info:
        private.run_job(name, lambda: None, fire_time=fire, at_most=20, on_skip="raise")
    assert time.monotonic() - began < 3  # not the 20 s of at_most
    assert info.value.reason == "kept"
    assert statements(private.store).latest(name)[0].fire_time is None  # nothing recorded


def test_run_per_on_a_kept_key_skips_promptly(private: LockManager, db_url: str) -> None:
    on = ("--url", db_url, "--table", private.config.table)
    first = run_dblock(*on, "run", "nightly-cleanup", "--at-least", "5m", "--", "true")
    assert first.returncode == 0, first.stderr
    began = time.monotonic()
    late = run_dblock(
        *on, "run", "nightly-cleanup", "--per", "1d", "--at-most", "20s", "--", "true"
    )
    took = time.monotonic() - began
    assert late.returncode == SKIP, late.stderr
    assert "kept" in late.stderr
    assert took < 10, took  # a process start, not the 20 s of --at-most


# -- item 8 -------------------------------------------------------------------------------


def test_the_version_is_written_once_and_the_changelog_agrees() -> None:
    project = _pyproject()
    assert "version" not in project["project"]
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["hatch"]["version"]["path"] == "dblock/_version.py"
    version = dblock.__version__
    heading = next(
        line for line in (ROOT / "CHANGELOG.md").read_text().splitlines() if line.startswith("## ")
    )
    assert heading.split()[1] == version, heading
    assert ("unreleased" in heading) == (".dev" in version), heading
    done = run_dblock("--version")
    assert done.stdout.strip() == f"dblock {version}"
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for wheel in re.findall(r"dblock-([\w.]+)-py3-none-any\.whl", page.read_text()):
            assert wheel in (version, "<version>"), f"{page.name} names dblock-{wheel}"


def test_a_long_key_does_not_widen_every_list_row(private: LockManager, db_url: str) -> None:
    short = private.acquire("s", ttl=60)
    long = private.acquire("L" * 255, ttl=60)
    try:
        done = run_dblock("list", "--url", db_url, "--table", private.config.table)
        assert done.returncode == 0, done.stderr
        rows = done.stdout.splitlines()[2:]
        assert max(len(row) for row in rows) < 200, done.stdout
        assert any("L" * 50 + "..." in row for row in rows)
        whole = run_dblock("list", "--json", "--url", db_url, "--table", private.config.table)
        assert "L" * 255 in whole.stdout  # --json keeps it whole
    finally:
        short.release()
        long.release()


def test_top_once_in_a_pipe_is_as_wide_as_its_rows(private: LockManager, db_url: str) -> None:
    key = "wide:" + "w" * 150
    held = private.acquire(key, ttl=60)
    env = {k: v for k, v in os.environ.items() if k not in ("DBLOCK_URL", "COLUMNS")}
    try:
        done = subprocess.run(
            [*COMMAND, "top", "--once", "--url", db_url, "--table", private.config.table],
            capture_output=True,
            text=True,
            env=env,
            stdin=subprocess.DEVNULL,
            timeout=120,
            check=False,
        )
    finally:
        held.release()
    assert done.returncode == 0, done.stderr
    assert any(key in line for line in done.stdout.splitlines()), done.stdout  # not folded


def test_plurals(private: LockManager, db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    on = ["--url", db_url, "--table", private.config.table]
    assert main([*on, "run", "solo", "--", "true"]) == 0
    capsys.readouterr()
    assert main([*on, "jobs", "solo"]) == 0
    assert ": 1 run of 'solo'" in capsys.readouterr().out
    assert main([*on, "jobs"]) == 0
    assert ": 1 job\n" in capsys.readouterr().out


def test_one_row_is_this_row(
    private: LockManager, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []
    monkeypatch.setattr("dblock.cli._confirm", lambda prompt: asked.append(prompt) or False)
    held = private.acquire("only:1", ttl=60)
    try:
        on = ["--url", db_url, "--table", private.config.table]
        assert main([*on, "release", "--prefix", "only:", "--force"]) == 1
    finally:
        held.release()
    assert asked == ["force-release this row? [y/N] "]


def test_an_unknown_option_before_the_command_is_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--tabel", "x", "list"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized option '--tabel'" in err
    assert "invalid choice" not in err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "k", "--at-most", "-5s", "--", "true"], "at_most must be a duration > 0"),
        (["run", "k", "--at-least", "-5s", "--", "true"], "at_least must be a duration >= 0"),
        (["run", "k", "--wait", "-1", "--", "true"], "wait must be a duration >= 0"),
        (["sweep", "--once", "--grace", "-5s"], "a duration cannot be negative: '-5s'"),
    ],
)
def test_negative_durations_are_taken_then_refused(args: list[str], message: str) -> None:
    url = "postgresql+psycopg://nobody@127.0.0.1:1/none"  # refused before it is reached
    line = _one_line(run_dblock("--url", url, *args), 2)
    assert message in line
    assert "expected one argument" not in line


def test_getting_started_lists_every_option_of_locked_and_lock_many() -> None:
    text = " ".join((ROOT / "docs" / "getting-started.md").read_text().split())
    for name in ("locked", "lock_many"):
        match = re.search(rf"`{name}\((\w+), \*, ([^)]*)\)`", text)
        assert match is not None, name
        shown = {word.strip() for word in match.group(2).split(",")}
        method = getattr(LockManager, name)
        named = {
            p.name
            for p in inspect.signature(method).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY
        }
        assert shown == named | set(LockArgs.__annotations__), name


def test_the_commands_own_arguments_are_never_rewritten() -> None:
    from dblock.cli import parse_args

    args = parse_args(["run", "k", "--at-most", "-5s", "--", "cmd", "--at-most", "-5"])
    assert args.argv == ["cmd", "--at-most", "-5"]
    assert args.at_most == -5.0  # refused by the job's own check, naming at_most
    args = parse_args(["run", "k", "--", "cmd", "--wait", "-1"])
    assert args.argv == ["cmd", "--wait", "-1"]
    with pytest.raises(SystemExit):
        parse_args(["run", "k", "--wait", "--", "cmd", "--wait", "-1"])
