"""Each page's install line, as a newcomer types it, is enough for that page.

A page's ``<!-- tested: install -->`` block holds its install line, written
for a clone's root (``pip install '.[flask,postgresql]'``). Here each distinct
line is installed into a fresh virtualenv (``python -m venv``, no system
site-packages; ``.`` is this clone), and in it

* every example of the page (its ``runs`` blocks, with their ``continues``)
  runs as a script, with ``$DBLOCK_URL`` pointing at a private PostgreSQL
  database when the line names a PostgreSQL extra, so the driver the line
  installs is the one the example uses;
* the page's example application, where it has one, is set up the way its
  page says (``flask --app app init-db``, ``manage.py migrate``,
  ``python app.py init-db``) on a private PostgreSQL database.

And: ``AsyncLockManager`` in a virtualenv with only ``[postgresql]`` (no
greenlet) raises a ``LockArgumentError`` naming the extra to install.

The venvs cost about 5-15 s each with pip's cache warm; these tests use no
``db`` fixture, so the suite runs them once, not once per database, and they
carry the ``slow`` marker.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support.db import private_database
from tests.test_docs import BLOCKS, ROOT, SCRIPTS, Block, tagged

pytestmark = pytest.mark.slow

INSTALLS = tagged("install")
#: Pages whose install line is not theirs to explain (they explain the menu).
NO_LINK_NEEDED = {"README.md", "docs/getting-started.md"}


def install_args(block: Block) -> list[str]:
    """The arguments of the block's single ``pip install`` line, with ``.``
    (the clone's root, as the pages say) made this clone's path."""
    lines = [shlex.split(line, comments=True) for line in block.code.splitlines()]
    commands = [words for words in lines if words]
    assert len(commands) == 1, f"{block.id}: one install line per page, not {len(commands)}"
    (words,) = commands
    assert words[:2] == ["pip", "install"], f"{block.id}: not a `pip install` line: {words}"
    args = []
    for word in words[2:]:
        from_clone = word == "." or word.startswith(".[")
        args.append(f"{ROOT}{word[1:]}" if from_clone else word)
    assert any(a.startswith(str(ROOT)) for a in args), f"{block.id}: does not install the clone"
    return args


def extras(block: Block) -> set[str]:
    found: set[str] = set()
    for arg in install_args(block):
        if arg.startswith(str(ROOT)) and "[" in arg:
            found |= set(arg[arg.index("[") + 1 : arg.rindex("]")].split(","))
    return found


def test_every_install_line_is_one_line_from_the_clone() -> None:
    assert INSTALLS, "no page tags its install line"
    pages = {str(b.page.relative_to(ROOT)) for b in INSTALLS}
    for page in ("README.md", "docs/flask.md", "docs/django.md", "docs/fastapi.md"):
        assert page in pages, f"{page} has no `<!-- tested: install -->` line"
    for block in INSTALLS:
        install_args(block)
        assert str(block.page.relative_to(ROOT)) not in [
            str(b.page.relative_to(ROOT)) for b in INSTALLS if b is not block
        ], f"{block.id}: a second install line on the page"


@pytest.mark.parametrize("page", ["docs/flask.md", "docs/django.md", "docs/fastapi.md"])
def test_every_framework_page_opens_with_a_minimal_example(page: str) -> None:
    """Before the page's first section: a complete app that runs (its
    ``runs`` block), so a reader sees the whole of it first."""
    text = (ROOT / page).read_text()
    top = text[: text.index("\n## ")]
    assert "<!-- tested: runs -->" in top, f"{page}: no runnable example before its first section"


def test_every_page_with_an_install_line_says_how_to_install_from_a_clone() -> None:
    """The site says once (Getting started, Install) how to install from a
    clone or a wheel; a page with an install line links there."""
    for block in INSTALLS:
        page = str(block.page.relative_to(ROOT))
        if page in NO_LINK_NEEDED:
            continue
        assert "getting-started.md#install" in block.page.read_text(), (
            f"{page}: link to getting-started.md#install from beside its install line"
        )
    assert "wheel" in (ROOT / "docs" / "getting-started.md").read_text()


class Venvs:
    """One fresh virtualenv per distinct install line, made on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: dict[tuple[str, ...], Path] = {}

    def python(self, args: list[str]) -> Path:
        key = tuple(args)
        if key not in self.made:
            venv = self.root / f"venv{len(self.made)}"
            # The line's own arguments, run by this suite's pip into the new
            # venv (--python): a venv without pip of its own is made in a
            # fifth of a second instead of six, and --no-compile leaves the
            # bytecode to the first import (Django's would take 10 s). What
            # gets installed is the line's, as written.
            subprocess.run(
                [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
            )
            pip = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python")]
            result = subprocess.run(
                [*pip, "install", "--quiet", "--no-compile", *args],
                capture_output=True,
                text=True,
                timeout=600,
                check=False,
            )
            assert result.returncode == 0, f"pip install {shlex.join(args)}\n{result.stderr}"
            self.made[key] = venv
        return self.made[key] / "bin" / "python"


@pytest.fixture(scope="module")
def venvs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venvs]:
    root = tmp_path_factory.mktemp("install-lines")
    yield Venvs(root)
    shutil.rmtree(root, ignore_errors=True)


def clean_env(python: Path, **extra: str) -> dict[str, str]:
    """The environment of a newcomer's shell: the venv first on PATH, none of
    this suite's variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("DBLOCK_", "DJANGO_", "PYTHON", "VIRTUAL_ENV", "EXAMPLE_"))
    }
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def run(python: Path, argv: list[str], cwd: Path, env: dict[str, str], what: str) -> str:
    result = subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, f"{what}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def setup_example(page: str, python: Path, url: str, tmp_path: Path) -> None:
    """Set the page's example application up as its page says, on ``url``."""
    env_url = {"DATABASE_URL": url}
    if page == "docs/flask.md":
        app = tmp_path / "flask_app"
        shutil.copytree(ROOT / "examples" / "flask_app", app)
        env = clean_env(python, **env_url)
        run(python, ["flask", "--app", "app", "init-db"], app, env, "flask init-db")
        out = run(python, ["flask", "--app", "app", "dblock", "migrate"], app, env, "migrate")
        assert "dblock_locks" in out
    elif page in ("docs/django.md", "docs/django-async.md"):
        project = tmp_path / "django_project"
        shutil.copytree(ROOT / "examples" / "django_project", project)
        u = sa.make_url(url)
        env = clean_env(
            python,
            EXAMPLE_DB_NAME=str(u.database),
            EXAMPLE_DB_HOST=str(u.host or "127.0.0.1"),
            EXAMPLE_DB_PORT=str(u.port or 5432),
            EXAMPLE_DB_USER=str(u.username or "postgres"),
            EXAMPLE_DB_PASSWORD=str(u.password or ""),
        )
        run(python, ["python", "manage.py", "migrate"], project, env, "manage.py migrate")
        if page == "docs/django-async.md":
            code = (
                "import asyncio, django\n"
                "django.setup()\n"
                "from dblock.contrib.django import alock\n"
                "async def main():\n"
                "    async with alock('user:1') as held:\n"
                "        print('fence', held.fence)\n"
                "asyncio.run(main())\n"
            )
            env["DJANGO_SETTINGS_MODULE"] = "exampleproject.settings"
            out = run(python, ["python", "-c", code], project, env, "alock in the project")
            assert out.startswith("fence")
    elif page == "docs/fastapi.md":
        app = tmp_path / "fastapi_app"
        shutil.copytree(ROOT / "examples" / "fastapi_app", app)
        run(python, ["python", "app.py", "init-db"], app, clean_env(python, **env_url), "init-db")


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in INSTALLS])
def test_the_install_line_runs_the_page(block: Block, venvs: Venvs, tmp_path: Path) -> None:
    page = str(block.page.relative_to(ROOT))
    python = venvs.python(install_args(block))
    wants_postgresql = bool(extras(block) & {"postgresql", "postgresql-async"})
    with private_database("postgresql", tmp_path) as url:
        for first, code in SCRIPTS:
            if first.page != block.page:
                continue
            where = tmp_path / f"run-{first.line}"
            where.mkdir()
            (where / "example.py").write_text(code)
            env = clean_env(python, **({"DBLOCK_URL": url} if wants_postgresql else {}))
            run(python, [str(python), "example.py"], where, env, f"{first.id} in {python}")
        if wants_postgresql:
            setup_example(page, python, url, tmp_path)


def test_async_lock_manager_without_the_asyncio_extra_names_it(
    venvs: Venvs, tmp_path: Path
) -> None:
    """`pip install '.[postgresql]'` (Getting started's line for PostgreSQL)
    has no greenlet: AsyncLockManager says which extra to add, before any
    statement, instead of SQLAlchemy's ImportError."""
    python = venvs.python([f"{ROOT}[postgresql]"])
    probe = subprocess.run(
        [str(python), "-c", "import greenlet"], capture_output=True, timeout=60, check=False
    )
    assert probe.returncode != 0, "greenlet is installed: this venv cannot show the error"
    code = (
        "from dblock import AsyncLockManager, LockArgumentError\n"
        "try:\n"
        "    AsyncLockManager('postgresql+psycopg://nobody@127.0.0.1:1/none')\n"
        "except LockArgumentError as exc:\n"
        "    print(exc)\n"
        "else:\n"
        "    raise SystemExit('no error')\n"
    )
    out = run(python, [str(python), "-c", code], tmp_path, clean_env(python), "probe")
    assert "pip install '.[postgresql-async]'" in out
    assert "greenlet" in out


def test_the_blocks_are_parsed() -> None:
    """The page parser of test_docs sees the install blocks (a guard against
    a tag this file would silently skip)."""
    assert all(b.lang in ("sh", "bash", "shell") for b in INSTALLS)
    assert len(INSTALLS) == len({b.page for b in INSTALLS})
    assert any(b in INSTALLS for b in BLOCKS)
