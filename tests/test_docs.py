"""The documentation's code is the code the tests run.

Every Markdown file of the documentation (README.md and docs/**/*.md, found
by glob, so a page added later is covered without touching this file) is
read for fenced code blocks. The line right before a fence may carry a tag:

* ``<!-- tested: runs -->``: the block is run as a Python script in an empty
  directory (SQLite there by default, no ``$DBLOCK_URL``) and must exit 0;
* ``<!-- tested: continues -->``: the block goes on from the ``runs`` block
  before it on the page (and the ``continues`` blocks between): they are run
  as one script, so an example can be told in steps;
* ``<!-- tested: PATH -->``: the block is a verbatim excerpt of that file of
  the repository (which the other tests run);
* ``<!-- tested: django-shell -->``: the Django page's shell block, run
  command by command against a PostgreSQL database of its own;
* ``<!-- tested: sql DIALECT NAME -->``: the statement dblock's store for
  DIALECT sends as NAME (``acquire``, ``release``, ...), for the default
  table, whitespace aside;
* ``<!-- tested: ddl DIALECT -->``: the DDL that creates the lock table on
  DIALECT, whitespace aside;
* ``<!-- tested: install -->``: the page's install line (``pip install
  '.[EXTRAS]' ...``, from a clone's root), installed into a fresh virtualenv
  where the page's examples then run (tests/test_docs_install.py);
* ``<!-- not tested: REASON -->``: not run, for the reason given (a Python
  block must still compile).

A Python block without a tag fails, and so does a tag that is not followed
by a fence or names something this file does not know.

Beside the blocks: every `dblock ...` command shown parses, the SQL shown is
what an acquire and a release put on the wire on each database, and the site
builds in strict mode (``scripts/docs``,
which scripts/test runs), where a broken link or anchor fails.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa

from dblock import LockManager
from tests.support.db import DEFAULT_URLS

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
PYTHON = {"python", "py", "python3"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")
TAG = re.compile(r"^\s*<!-- (?P<kind>tested|not tested): (?P<what>.+?) -->\s*$")
SPECIAL = ("runs", "continues", "django-shell", "sql ", "ddl ", "install")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    tag: str | None  # "tested: ..." or "not tested: ..."
    what: str | None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse(page: Path) -> tuple[list[Block], list[str]]:
    """The fenced blocks of a page, and the problems found reading it."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    problems: list[str] = []
    pending: tuple[int, str, str] | None = None  # a tag waiting for its fence
    i = 0
    while i < len(lines):
        line = lines[i]
        tag = TAG.match(line)
        fence = FENCE.match(line)
        if tag:
            if pending:
                problems.append(f"{page.relative_to(ROOT)}:{pending[0]}: tag without a fence")
            pending = (i + 1, tag["kind"], tag["what"])
        elif fence:
            indent, mark = fence["indent"], fence["fence"]
            body: list[str] = []
            i += 1
            while i < len(lines) and not lines[i].strip().startswith(mark):
                text = lines[i]
                body.append(text[len(indent) :] if text.startswith(indent) else text.lstrip())
                i += 1
            start = i - len(body)
            kind, what = (pending[1], pending[2]) if pending else (None, None)
            found.append(
                Block(page, start, fence["lang"].lower(), "\n".join(body) + "\n", kind, what)
            )
            pending = None
        elif line.strip() and pending:
            problems.append(f"{page.relative_to(ROOT)}:{pending[0]}: tag without a fence")
            pending = None
        i += 1
    if pending:
        problems.append(f"{page.relative_to(ROOT)}:{pending[0]}: tag without a fence")
    return found, problems


PARSED = [parse(page) for page in PAGES]
BLOCKS = [block for blocks, _ in PARSED for block in blocks]
PROBLEMS = [problem for _, problems in PARSED for problem in problems]


def tagged(kind: str) -> list[Block]:
    """The blocks tagged ``tested: KIND`` (a prefix when KIND ends in a space)."""
    return [
        b
        for b in BLOCKS
        if b.tag == "tested"
        and b.what is not None
        and (b.what.startswith(kind) if kind.endswith(" ") else b.what == kind)
    ]


def params(blocks: list[Block]) -> list[object]:
    return [pytest.param(b, id=b.id) for b in blocks]


def test_every_python_block_is_tagged_and_every_tag_is_known() -> None:
    problems = list(PROBLEMS)
    for b in BLOCKS:
        if b.lang in PYTHON and b.tag is None:
            problems.append(
                f"{b.id}: a python block without `<!-- tested: runs -->` (or another tag; "
                "`<!-- not tested: REASON -->` if it cannot run)"
            )
        if (
            b.tag == "tested"
            and b.what is not None
            and not b.what.startswith(SPECIAL)
            and not (ROOT / b.what).is_file()
        ):
            problems.append(f"{b.id}: `tested: {b.what}` names no file of the repository")
        if b.tag == "not tested" and len((b.what or "").split()) < 2:
            problems.append(f"{b.id}: `not tested:` needs a reason, not {b.what!r}")
    assert not problems, "\n".join(problems)


def test_the_documentation_has_the_tested_blocks() -> None:
    """The examples the other tests run are the ones the pages show."""
    readme = [b for b in BLOCKS if b.page.name == "README.md"]
    assert any(b.what == "runs" for b in readme), "the README's first example must run"
    whats = [b.what for b in BLOCKS if b.tag == "tested"]
    assert "examples/flask_app/app.py" in whats
    assert "examples/django_project/accounts/services.py" in whats
    assert whats.count("django-shell") == 1
    assert sum(1 for w in whats if w and w.startswith("sql ")) >= 8
    assert sum(1 for w in whats if w and w.startswith("ddl ")) == 3


@pytest.mark.parametrize(
    "block",
    params(
        [
            b
            for b in BLOCKS
            if b.tag == "tested" and b.what is not None and not b.what.startswith(SPECIAL)
        ]
    ),
)
def test_excerpts_are_the_example_files(block: Block) -> None:
    assert block.what is not None
    path = ROOT / block.what
    assert block.code in path.read_text(), f"{block.id}: the copy of {block.what} is out of date"


@pytest.mark.parametrize("block", params([b for b in BLOCKS if b.tag == "not tested"]))
def test_untested_python_blocks_compile(block: Block) -> None:
    if block.lang in PYTHON:
        compile(block.code, block.id, "exec")


def scripts() -> tuple[list[tuple[Block, str]], list[str]]:
    """Each ``runs`` block with the ``continues`` blocks after it, as one script."""
    chains: list[tuple[Block, str]] = []
    problems = []
    for b in BLOCKS:
        if b.tag != "tested" or b.what not in ("runs", "continues"):
            continue
        if b.what == "runs":
            chains.append((b, b.code))
        elif chains and chains[-1][0].page == b.page:
            first, code = chains[-1]
            chains[-1] = (first, f"{code}\n\n{b.code}")
        else:
            problems.append(f"{b.id}: `tested: continues` with no `runs` block before it")
    return chains, problems


SCRIPTS, CHAIN_PROBLEMS = scripts()
PROBLEMS += CHAIN_PROBLEMS


@pytest.mark.parametrize(("block", "code"), [pytest.param(b, c, id=b.id) for b, c in SCRIPTS])
def test_examples_run(block: Block, code: str, tmp_path: Path) -> None:
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
    assert result.returncode == 0, f"{block.id}\n{result.stdout}\n{result.stderr}"


def normalised(sql: str) -> str:
    """Whitespace aside: runs of it become one space, none just inside parentheses,
    and a trailing semicolon is dropped."""
    text = " ".join(sql.split())
    text = re.sub(r"\(\s+", "(", text)
    text = re.sub(r"\s+\)", ")", text)
    return re.sub(r"\s*;\s*", ";", text).rstrip(";")


def store_statement(dialect: str, name: str) -> str:
    """What the store sends as ``name`` on ``dialect``, for the default table.
    The store is made on an engine that never connects: its statements are
    built once, in its constructor (the benchmark reads them the same way)."""
    from dblock._store import open_store
    from dblock.config import Config

    url = {
        "postgresql": "postgresql+psycopg://",
        "mysql": "mysql+pymysql://",
        "sqlite": "sqlite://",
    }[dialect]
    engine = sa.create_engine(url)
    store = open_store(engine, config=Config(), owns_engine=True)
    sql = getattr(store, f"_{name}_sql", None)
    assert isinstance(sql, str), f"the {dialect} store has no statement {name!r}"
    return sql


@pytest.mark.parametrize("block", params(tagged("sql ")))
def test_sql_is_what_the_store_sends(block: Block) -> None:
    assert block.what is not None
    _, dialect, name = block.what.split()
    sent = store_statement(dialect, name)
    assert normalised(block.code) == normalised(sent), (
        f"{block.id}: the {dialect} {name} statement changed; it is now:\n{sent}"
    )


def ddl(dialect: str) -> str:
    from sqlalchemy.dialects import mysql, postgresql, sqlite

    from dblock.config import Config
    from dblock.schema import TableNames, create_statements

    compiler = {"postgresql": postgresql, "mysql": mysql, "sqlite": sqlite}[dialect].dialect()
    names = TableNames.of(Config())
    return "\n".join(
        str(s.compile(dialect=compiler)).strip() + ";" for s in create_statements(names, dialect)
    )


@pytest.mark.parametrize("block", params(tagged("ddl ")))
def test_ddl_is_what_the_migration_creates(block: Block) -> None:
    assert block.what is not None
    _, dialect = block.what.split()
    made = ddl(dialect)
    assert normalised(block.code) == normalised(made), (
        f"{block.id}: the {dialect} schema changed; it is now:\n{made}"
    )


def test_django_commands_run(tmp_path: Path) -> None:
    """The shell block of the Django page, line by line, on a PostgreSQL
    database of its own (`runserver` is left to the server test)."""
    (block,) = tagged("django-shell")
    code = block.code
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
                assert result.stdout.startswith(f"released {held.key!r} held by "), result
                holder.close()
    finally:
        admin = sa.create_engine(
            DEFAULT_URLS["postgresql"], isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool
        )
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()
    assert ran == ["createdb", "migrate", "dblock_list", "dblock_sweep", "dblock_release"]


def build_site(root: Path) -> subprocess.CompletedProcess[str]:
    """``scripts/docs`` (what scripts/test runs) on the tree at ``root``."""
    return subprocess.run(
        ["bash", str(root / "scripts" / "docs")],
        env={**os.environ, "DBLOCK_DOCS_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_the_site_builds_in_strict_mode() -> None:
    result = build_site(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("page", "text", "complaint"),
    [
        pytest.param("leases.md", "[gone](nowhere.md)", "nowhere.md", id="link"),
        pytest.param("leases.md", "[gone](internals.md#nowhere)", "#nowhere", id="anchor"),
        pytest.param("README.md", "[gone](docs/nowhere.md)", "nowhere.md", id="readme-link"),
        pytest.param("orphan.md", "# Not in the nav", "orphan.md", id="page-not-in-nav"),
        pytest.param("leases.md", "![gone](img/nowhere.svg)", "nowhere.svg", id="picture"),
    ],
)
def test_a_broken_site_fails_the_build(
    page: str, text: str, complaint: str, tmp_path: Path
) -> None:
    """Strict mode is on where scripts/test builds the site (`--quiet`, say,
    would silence the warnings it counts)."""
    for name in ("README.md", "mkdocs.yml", "scripts/docs", "scripts/mkdocs_hooks.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text((ROOT / name).read_text())
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    target = tmp_path / page if page == "README.md" else tmp_path / "docs" / page
    with target.open("a") as f:
        f.write(f"\n{text}\n")
    result = build_site(tmp_path)
    assert result.returncode != 0
    assert complaint in result.stdout + result.stderr


def test_the_statements_shown_are_the_ones_sent(manager: LockManager, db: str, key: str) -> None:
    """The internals page shows the store's statements for the default table
    (checked above); here, on each database, they are what an uncontended
    acquire and release put on the wire."""
    from tests.support.counting import StatementCounter

    dialect = "mysql" if db == "mariadb" else db
    manager.acquire(f"{key}:warm-up").release()  # MySQL reads its capabilities once
    with StatementCounter(manager.engine) as sent:
        manager.acquire(key).release()
    acquire = "insert_returning" if dialect == "mysql" else "acquire"
    assert sent.statements == [
        store_statement(dialect, acquire),
        store_statement(dialect, "release"),
    ]


def command_lines() -> list[tuple[str, list[str]]]:
    """Every `dblock ...` command the pages show, as `dblock` arguments: lines
    of shell blocks starting with `dblock`, `.venv/bin/dblock` or
    `scripts/bench` (the benchmark suite's command line, as `bench ...`), and
    `$ dblock ...` prompts in any block."""
    found = []
    for b in BLOCKS:
        for n, line in enumerate(b.code.splitlines(), start=b.line + 1):
            text = line.strip()
            if text.startswith("$ "):
                text = text[2:]
            elif b.lang not in ("sh", "bash", "shell", "console"):
                continue
            words = shlex.split(text, comments=True)
            if not words:
                continue
            if words[0] in ("dblock", ".venv/bin/dblock"):
                found.append((f"{b.page.relative_to(ROOT)}:{n}", words[1:]))
            elif words[0] == "scripts/bench":
                found.append((f"{b.page.relative_to(ROOT)}:{n}", ["bench", *words[1:]]))
    return found


@pytest.mark.parametrize(("where", "argv"), [pytest.param(w, a, id=w) for w, a in command_lines()])
def test_documented_commands_parse(where: str, argv: list[str]) -> None:
    """The commands and options the pages show are the ones `dblock` (or
    `scripts/bench`) takes (parsed, not run: they name servers of the reader's)."""
    from benchmarks.suite import build_parser
    from dblock.cli import parse_args

    code: object = 0
    try:
        if argv[:1] == ["bench"]:
            build_parser().parse_args(argv[1:])
        else:
            parse_args(argv)
    except SystemExit as exc:  # --help exits 0; a mistake exits 2
        code = exc.code
    assert code == 0, f"{where}: dblock {shlex.join(argv)} is refused"
