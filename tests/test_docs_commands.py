"""Every shell line the documentation shows, and every example in a
command's ``--help``, is checked: run, or at least parsed.

Collected: the ``sh``/``bash``/``shell``/``console`` blocks of README.md and
docs/**/*.md (and ``$ `` prompt lines in any block), and the examples in the
help texts of ``dblock`` and each of its commands, of the Flask CLI group and
of the Django management commands (a command written in backticks, or on a
line of its own, starting with ``dblock``, ``flask dblock`` or
``manage.py dblock_``). Then:

* every shell block passes ``bash -n`` (syntax);
* every ``dblock ...`` line is parsed by dblock's own argparse parser and
  then *run*, in a fresh directory, against the SQLite file there (migrated,
  with the key a ``release`` line names held), stdin answering ``y``: it must
  not be refused (exit 2) nor raise, so a command's own checks, those made
  after argparse (``--at-least`` longer than the lease, say), are applied as
  well. A ``--url`` naming a reader's server is pointed at a port where
  nothing listens: the command must get as far as connecting (exit 1, "cannot
  connect"), which every command does only after checking its arguments.
  A long-running line (``sweep --every``) must still be running after a few
  seconds and stop cleanly on SIGTERM;
* ``flask dblock ...`` and ``manage.py dblock_...`` lines are parsed by the
  Flask group's and the Django command's own parsers;
* a ``cd`` names a directory of the repository;
* a crontab line (five time fields, then a ``dblock`` command) is run as
  cron runs it: its command part through ``sh -c``, in cron's bare
  environment plus the variables its block sets (``DBLOCK_URL=...``), that
  variable's value being the database the test provides: a crontab that
  does not name the database fails, as it would under cron;
* a variable set on a line of its own (``DBLOCK_URL=...``, ``export``) is
  for the lines after it; the ``dblock run`` lines, shown "from a shell
  where ``DBLOCK_URL`` is set", get it set to the test's database;
* any other line must be in :data:`ALLOWED`, which says why it is not run
  here (a server it needs, a placeholder, the test that runs it elsewhere);
  a line matching nothing fails, so a new kind of line is never skipped
  silently. :data:`NOT_RUN` does the same for the ``dblock`` lines that are
  parsed but not run.
"""

from __future__ import annotations

import contextlib
import io
import os
import pty
import re
import select
import shlex
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dblock import LockManager
from tests.support.cli import COMMAND
from tests.test_docs import BLOCKS, ROOT, Block

SHELLS = ("sh", "bash", "shell", "console")

# A URL nothing answers: a command that reaches the database says it cannot
# connect (exit 1), after its arguments were checked (a mistake is exit 2).
NOWHERE = {
    "postgresql": "postgresql+psycopg://nobody@127.0.0.1:1/app",
    "mysql": "mysql+pymysql://nobody@127.0.0.1:1/app",
}

#: Lines other than dblock's, Flask's and Django's commands: the first words,
#: and why the line is not run here (bash -n still checks its syntax).
ALLOWED: dict[tuple[str, ...], str] = {
    ("pip", "install"): "tests/test_docs_install.py installs each page's line in a fresh venv",
    ("scripts/test",): "the whole suite: CI runs it",
    ("scripts/demo",): "`dblock demo` on SQLite: tests/test_demo.py runs it",
    ("scripts/bench",): "checked as `dblock bench` (its arguments), which it runs",
    (".venv/bin/python", "scripts/torture.py"): "fault injection on the three servers, minutes",
    ("python", "manage.py", "migrate"): "Django's own: tests/test_docs.py runs this block",
    ("python", "manage.py", "runserver"): "a server that runs until stopped",
    ("createdb",): "creates a PostgreSQL database: tests/test_docs.py runs this block",
    ("uvicorn",): "starts the example's server (tests/test_fastapi.py, test_django_async.py)",
    ("curl",): "needs the example servers the lines before start",
    ("export",): "sets the example's database URL for the lines after it",
    ("python", "app.py", "init-db"): "needs the DATABASE_URL the line before sets",
    ("celery",): "Celery beat needs a broker (tests/test_jobs_celery.py runs the scheduler)",
}

#: Variables the pages set on a line of their own, and what for.
ENV_SET: dict[str, str] = {
    "DBLOCK_URL=": "the database of the dblock lines after it (a crontab's: "
    "test_crontab_lines_run_as_cron_runs_them gives it the test's database)",
}

#: ``dblock`` lines parsed but not run: the words they start with, and why.
NOT_RUN: dict[tuple[str, ...], str] = {
    ("bench",): "the benchmark runs for minutes on the three servers (scripts/bench)",
    ("top",): "full-screen and interactive without --once (tests/test_top.py drives it)",
}

#: Lines known to fail, being mended elsewhere: the line's start, and by whom.
#: (Not strict: once the mend is merged they pass; then delete the entry.)
PENDING: dict[str, str] = {}

# A crontab entry: five time fields, then the command.
CRON = re.compile(r"^(?:[\d*/,-]+\s+){5}")
# A variable set on a line of its own (in a crontab, or a shell).
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
# A command in a help text: `...` or ``...``, or a line of its own.
IN_HELP = re.compile(
    r"``((?:flask |\S*manage\.py |)dblock[ _][^`]+)``|`((?:flask |\S*manage\.py |)dblock[ _][^`]+)`"
)


@dataclass(frozen=True)
class Line:
    where: str
    text: str


def shell_blocks() -> list[Block]:
    return [b for b in BLOCKS if b.lang in SHELLS]


def doc_lines() -> Iterator[Line]:
    for b in BLOCKS:
        for n, raw in enumerate(b.code.splitlines(), start=b.line):
            text = raw.strip()
            if text.startswith("$ "):
                text = text[2:]
            elif b.lang not in SHELLS or b.lang == "console":
                continue
            yield Line(f"{b.page.relative_to(ROOT)}:{n}", text)


def help_texts() -> Iterator[tuple[str, str]]:
    """(where, help text) of every command of dblock's, Flask's and Django's."""
    from dblock.cli import build_parser

    parser = build_parser()
    yield "dblock --help", parser.format_help()
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        for name, sub in getattr(action, "choices", {}).items():
            yield f"dblock {name} --help", sub.format_help()

    import click

    from dblock.contrib.flask import cli as flask_group

    ctx = click.Context(flask_group, info_name="dblock")
    yield "flask dblock --help", flask_group.get_help(ctx)
    for name in flask_group.list_commands(ctx):
        command = flask_group.get_command(ctx, name)
        assert command is not None
        yield (
            f"flask dblock {name} --help",
            command.get_help(click.Context(command, info_name=name)),
        )

    for name in django_commands():
        command = _django_command(name)
        yield f"manage.py {name} --help", command.create_parser("manage.py", name).format_help()


def django_commands() -> list[str]:
    folder = ROOT / "dblock" / "contrib" / "django" / "management" / "commands"
    return sorted(p.stem for p in folder.glob("dblock_*.py"))


def _django_command(name: str) -> object:
    from django.core.management import load_command_class

    return load_command_class("dblock.contrib.django", name)


def help_lines() -> Iterator[Line]:
    for where, text in help_texts():
        flat = " ".join(text.split())  # argparse wraps a backticked example
        for match in IN_HELP.finditer(flat):
            yield Line(where, match.group(1) or match.group(2))
        for raw in text.splitlines():  # a transcript: `$ dblock ...`
            stripped = raw.strip()
            if re.match(r"\$ (flask dblock|\S*manage\.py dblock_|dblock) \S", stripped):
                yield Line(where, stripped[2:])


DOC_LINES = list(doc_lines())
HELP_LINES = list(help_lines())


def words_of(line: Line) -> list[str]:
    text = CRON.sub("", line.text)
    words = shlex.split(text, comments=True)
    if words and words[-1] == "&":
        words = words[:-1]
    return words


def kind_of(words: list[str]) -> tuple[str, list[str]]:
    """What a line runs: ("dblock" | "flask" | "django" | "cd" | "other", its arguments)."""
    if words[0] in ("dblock", ".venv/bin/dblock"):
        return "dblock", words[1:]
    if words[:3] == ["python", "-m", "dblock"]:
        return "dblock", words[3:]
    if words[0] == "flask" and "dblock" in words:
        return "flask", words[words.index("dblock") + 1 :]
    for i, word in enumerate(words[:2]):
        if word.endswith("manage.py") and len(words) > i + 1 and words[i + 1].startswith("dblock_"):
            return "django", words[i + 1 :]
    if words[0] == "cd":
        return "cd", words[1:]
    if all(ASSIGNMENT.match(word) for word in words):
        return "env", words
    return "other", words


def allowed(words: list[str]) -> str | None:
    for prefix, reason in ALLOWED.items():
        if tuple(words[: len(prefix)]) == prefix:
            return reason
    return None


def lines_to_check() -> list[object]:
    seen: set[str] = set()
    params = []
    for line in [*DOC_LINES, *HELP_LINES]:
        words = words_of(line)
        if not words or (
            line.text in seen and line.where.startswith(("dblock", "flask", "manage"))
        ):
            continue
        seen.add(line.text)
        marks = []
        for start, reason in PENDING.items():
            if line.text.startswith(start):
                marks.append(pytest.mark.xfail(reason=reason, strict=False))
        params.append(pytest.param(line, id=f"{line.where}: {line.text[:60]}", marks=marks))
    return params


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in shell_blocks()])
def test_shell_blocks_are_valid_bash(block: Block) -> None:
    code = block.code
    if block.lang == "console":
        code = "\n".join(
            line.strip()[2:] for line in code.splitlines() if line.strip().startswith("$ ")
        )
    result = subprocess.run(
        ["bash", "-n"], input=code, capture_output=True, text=True, timeout=30, check=False
    )
    assert result.returncode == 0, f"{block.id}: {result.stderr}"


def test_the_collection_finds_the_lines() -> None:
    """A guard against a collector that silently finds nothing."""
    texts = [line.text for line in DOC_LINES]
    assert any(t.startswith("dblock sweep --every") for t in texts)
    assert any(t.startswith("dblock release user:42 --force") for t in texts)  # a prompt line
    wheres = {line.where for line in HELP_LINES}
    assert "dblock run --help" in wheres
    assert "flask dblock run --help" in wheres


@pytest.mark.parametrize("line", lines_to_check())
def test_every_line_is_checked(line: Line, tmp_path: Path) -> None:
    kind, args = kind_of(words_of(line))
    if kind == "dblock":
        check_dblock(line, args, tmp_path)
    elif kind == "flask":
        check_flask(line, args)
    elif kind == "django":
        check_django(line, args)
    elif kind == "cd":
        assert (ROOT / args[0]).is_dir(), f"{line.where}: no directory {args[0]!r}"
    elif kind == "env":
        assert all(ASSIGNMENT.match(word).group(0) in ENV_SET for word in args), (  # type: ignore[union-attr]
            f"{line.where}: {line.text!r} sets a variable nothing here knows: add it to ENV_SET"
        )
    else:
        reason = allowed(args)
        assert reason is not None, (
            f"{line.where}: {line.text!r} is neither run nor parsed here: check it, or add "
            "its first words to ALLOWED with the reason it cannot be"
        )


def check_dblock(line: Line, args: list[str], tmp_path: Path) -> None:
    from dblock.cli import parse_args

    code: object = 0
    try:
        parse_args(args)
    except SystemExit as exc:  # --help exits 0; a mistake exits 2
        code = exc.code
    assert code == 0, f"{line.where}: dblock {shlex.join(args)} is refused by argparse"
    if "--help" in args or "-h" in args:
        return
    for prefix, _reason in NOT_RUN.items():
        if tuple(args[: len(prefix)]) == prefix and "--once" not in args:
            return
    run_dblock(line, args, tmp_path)


def run_dblock(line: Line, args: list[str], tmp_path: Path) -> None:
    args = list(args)
    remote = False
    if "--url" in args:
        i = args.index("--url") + 1
        dialect = args[i].split(":", 1)[0].split("+", 1)[0]
        if dialect != "sqlite":
            args[i], remote = NOWHERE[dialect], True
    env = {k: v for k, v in os.environ.items() if k != "DBLOCK_URL"}
    env["PYTHONWARNINGS"] = "ignore"
    url = f"sqlite:///{tmp_path / 'dblock.sqlite3'}"
    if args[:1] in (["run"], ["lead"]):
        # `dblock run` and `dblock lead` take no default database: their
        # lines are shown from a shell where DBLOCK_URL is set (the
        # crontab's sets it; see test_crontab_lines_run_as_cron_runs_them).
        env["DBLOCK_URL"] = url
    holder = None
    if not remote:
        with LockManager(url) as m:
            m.create_schema()
        if args[:1] == ["release"] and len(args) > 1 and not args[1].startswith("-"):
            holder = LockManager(url, renew=False)
            held = holder.acquire(args[1], ttl=600)  # kept: a lock dropped is released
    command = [*COMMAND, *args]
    try:
        if args[:1] == ["sweep"] and "--every" in args:
            status, out, err = _run_until_stopped(command, tmp_path, env)
        else:
            status, out, err = _run_answering_yes(command, tmp_path, env)
    finally:
        if holder is not None:
            del held
            holder.close()
    shown = f"{line.where}: dblock {shlex.join(args)} -> {status}\n{out}\n{err}"
    assert "Traceback" not in err, shown
    assert status != 2, shown  # refused: a mistake in the line
    if remote:
        assert status == 0 or "connect" in err, shown
    elif args[:1] in (["run"], ["lead"]):
        # The line's command is a placeholder (/usr/local/bin/cleanup): not
        # found (127) or not executable (126), said before anything is taken.
        assert status in (0, 126, 127), shown
    else:
        assert status == 0, shown


def _run_answering_yes(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """Run to the end, on a terminal's stdin where ``y`` is typed: a
    command that asks for confirmation (``release --force``) gets it, as
    the transcripts show."""
    main, secondary = pty.openpty()
    try:
        os.write(main, b"y\n")
        done = subprocess.run(
            command,
            cwd=cwd,
            env=env,
            stdin=secondary,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
    finally:
        os.close(secondary)
        os.close(main)
    return done.returncode, done.stdout, done.stderr


def _run_until_stopped(command: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """A command that runs until stopped: still running after a few
    seconds (it passed its checks), then ended by SIGTERM, cleanly."""
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    # Its first line (the sweeper says it started) comes after its checks
    # and its signal handlers; a line after a mistake comes with the end.
    ready, _, _ = select.select([proc.stderr], [], [], 120)
    first = proc.stderr.readline() if ready else ""
    time.sleep(0.5)
    running = proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    err = first + err
    if not running:
        return proc.returncode if proc.returncode != 0 else -1, out, err + "\n(ended by itself)"
    return proc.returncode, out, err


def check_flask(line: Line, args: list[str]) -> None:
    """A ``flask dblock`` line: its command is the shell's (dblock.cli.Face),
    checked by the shell's parser."""
    from dblock.contrib.flask import cli as group

    assert (args or [""])[0] in group.commands, f"{line.where}: flask dblock {args[:1]}?"
    _check_shell(line, f"flask dblock {shlex.join(args)}", args)


def check_django(line: Line, args: list[str]) -> None:
    """A ``manage.py dblock_X`` line: ``dblock X`` (see check_flask)."""
    name, argv = args[0], args[1:]
    assert name in django_commands(), f"{line.where}: no command manage.py {name}"
    _check_shell(line, f"manage.py {shlex.join(args)}", [name.removeprefix("dblock_"), *argv])


def _check_shell(line: Line, shown: str, args: list[str]) -> None:
    from dblock.cli import parse_args

    try:
        with contextlib.redirect_stderr(io.StringIO()) as said:
            parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"{line.where}: {shown} is refused: {said.getvalue()}") from exc


def crontabs() -> list[tuple[Block, list[str], list[str]]]:
    """The blocks with a crontab line running ``dblock``: (block, the
    variables it sets, its crontab lines)."""
    found = []
    for block in shell_blocks():
        lines = [line.strip() for line in block.code.splitlines()]
        cron = [line for line in lines if CRON.match(line) and "dblock " in CRON.sub("", line)]
        cron = [line for line in cron if kind_of(shlex.split(CRON.sub("", line)))[0] == "dblock"]
        if cron:
            assigned = [line for line in lines if ASSIGNMENT.match(line) and " " not in line]
            found.append((block, assigned, cron))
    return found


def test_the_crontab_lines_are_found() -> None:
    """A guard: docs/jobs.md's crontab (the line cron runs on every host)."""
    assert any(b.page.name == "jobs.md" for b, _, _ in crontabs())


@pytest.mark.parametrize(
    ("block", "assigned", "entries"), [pytest.param(*c, id=c[0].id) for c in crontabs()]
)
def test_crontab_lines_run_as_cron_runs_them(
    block: Block, assigned: list[str], entries: list[str], private: LockManager, db_url: str
) -> None:
    """Each crontab line's command runs as cron would run it: ``sh -c``,
    cron's bare environment (HOME, LOGNAME, SHELL, PATH=/usr/bin:/bin) and
    the variables the crontab sets, ``DBLOCK_URL`` being the shared
    database this test runs on (its own table). A crontab that names no
    database fails here as it does under cron: ``dblock run`` has no default."""
    env = {
        "HOME": os.environ.get("HOME", "/"),
        "LOGNAME": "cron",
        "SHELL": "/bin/sh",
        "PATH": "/usr/bin:/bin",
        "PYTHONWARNINGS": "ignore",
    }
    for line in assigned:
        name, _, value = line.partition("=")
        env[name] = db_url if name == "DBLOCK_URL" else value
    for entry in entries:
        words = shlex.split(CRON.sub("", entry), comments=True)
        _, args = kind_of(words)
        # The venv's dblock (not on cron's PATH here), on the test's own
        # table; the job's program (a placeholder, /usr/local/bin/cleanup)
        # is `true`, so the run is taken, run and recorded on the database.
        if "--" in args:
            args = [*args[: args.index("--") + 1], "true"]
        command = shlex.join([*COMMAND, "--table", private.config.table, *args])
        done = subprocess.run(
            ["sh", "-c", command],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        shown = f"{block.id}: {entry} -> {done.returncode}\n{done.stdout}\n{done.stderr}"
        assert "Traceback" not in done.stderr, shown
        assert done.returncode == 0, shown
        if args[:1] == ["run"]:
            from dblock._store.jobs import statements

            (run,) = statements(private.store).latest(args[1])
            assert run.outcome == "success", shown


def test_a_mistaken_line_fails(tmp_path: Path) -> None:
    """The checks catch what they are for: an option that does not exist,
    and a combination the command's own checks refuse after argparse."""
    with pytest.raises(AssertionError, match="refused by argparse"):
        check_dblock(Line("x", "dblock list --nope"), ["list", "--nope"], Path("."))
    with pytest.raises(AssertionError, match="-> 2"):
        run_dblock(
            Line("x", "dblock run j --at-least 5m --at-most 1m -- true"),
            ["run", "j", "--at-least", "5m", "--at-most", "1m", "--", "true"],
            tmp_path,
        )
    with pytest.raises(AssertionError, match="refused"):
        check_flask(Line("x", "flask dblock list --nope"), ["list", "--nope"])
    with pytest.raises(AssertionError, match="refused"):
        check_django(Line("x", "manage.py dblock_list --nope"), ["dblock_list", "--nope"])


def test_install_hints_follow_one_rule() -> None:
    """dblock is installed from its clone (or a wheel built there), not from a
    package index: no page or message says `pip install 'dblock[...]'` (pip
    would look for dblock on the index); they say `'.[extra]'`."""
    from dblock.errors import install_hint

    assert install_hint("top").startswith("pip install '.[top]'")
    files = [
        *sorted((ROOT / "dblock").rglob("*.py")),
        *sorted((ROOT / "docs").rglob("*.md")),
        ROOT / "README.md",
        *sorted((ROOT / "examples").rglob("*.py")),
    ]
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        # A clone's path (/path/to/dblock[...]) is the rule's own form.
        if re.search(r"(?<![/\w-])dblock\[(?!postgresql|mysql|asyncio)", line)
    ]
    assert not found, "\n".join(found)
