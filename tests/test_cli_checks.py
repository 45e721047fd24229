"""``dblock`` checks what it is given as the API does, echoes it briefly,
releases by prefix or owner, and prints one ``--json`` shape everywhere:
the real command in a subprocess, on SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from dblock import LockArgumentError, LockLost, LockManager
from dblock.keys import check_key
from tests.support.cli import COMMAND, dblock

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "django_project"
# A server nobody listens on: a command that got as far as SQL would say
# "cannot connect" (exit 1), not refuse its argument (exit 2).
NOWHERE = "postgresql+psycopg://nobody:s3cret@127.0.0.1:1/x"


def _on(private: LockManager, db_url: str) -> tuple[str, ...]:
    return ("--url", db_url, "--table", private.config.table)


def _one_line(done: subprocess.CompletedProcess[str], code: int) -> str:
    assert done.returncode == code, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def _api_message(key: str) -> str:
    with pytest.raises(LockArgumentError) as info:
        check_key(key)
    return str(info.value)


# -- arguments are checked as the API checks them, before any SQL --------------


@pytest.mark.parametrize(
    "key", [pytest.param("", id="empty"), pytest.param("x" * 10_000, id="10k")]
)
def test_release_refuses_a_bad_key_as_the_api_does(key: str) -> None:
    done = dblock("release", key, "--force", "--yes", "--url", NOWHERE)
    line = _one_line(done, 2)
    assert line == f"dblock: error: {_api_message(key)}"
    assert len(line) < 200  # a 10,000-character key is not echoed whole


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefix", ""], "--prefix must not be empty"),
        (["--owner", ""], "--owner must not be empty"),
        (["--prefix", "p" * 300], "--prefix is 300 characters long, the limit is 255"),
        (["k", "--prefix", "p"], "give KEY, or --prefix and/or --owner, not both"),
        ([], "name what to release: KEY, --prefix PREFIX or --owner OWNER"),
    ],
)
def test_release_many_refuses_bad_arguments_before_sql(args: list[str], message: str) -> None:
    done = dblock("release", *args, "--force", "--yes", "--url", NOWHERE)
    assert message in _one_line(done, 2)


@pytest.mark.parametrize("command", [["list"], ["top", "--once"]])
def test_a_prefix_is_checked_as_a_key_is(command: list[str]) -> None:
    done = dblock(*command, "--prefix", "p" * 256, "--url", NOWHERE)
    assert "--prefix is 256 characters long, the limit is 255" in _one_line(done, 2)


@pytest.mark.databases("postgresql", "mariadb")
def test_a_refused_login_is_told_apart_from_an_unreachable_server(db: str, db_url: str) -> None:
    # PostgreSQL here trusts 127.0.0.1 whatever the password: an unknown role
    # is refused; MariaDB refuses root's wrong password.
    user = "dblock_nosuchrole" if db == "postgresql" else "root"
    url = sa.make_url(db_url).set(username=user, password="wr0ng-pw")
    done = dblock("list", "--url", url.render_as_string(hide_password=False))
    line = _one_line(done, 1)
    assert "authentication failed on" in line
    assert "cannot connect" not in line
    assert "wr0ng-pw" not in done.stdout + done.stderr
    assert ":***@" in line
    reason = 'role "dblock_nosuchrole" does not exist' if db == "postgresql" else "Access denied"
    assert reason in line


def test_long_values_are_shortened_when_echoed(tmp_path: Path) -> None:
    long = "9x" * 5000
    for args in (["list", "--limit", long], ["sweep", "--every", long]):
        line = _one_line(dblock(*args, cwd=tmp_path), 2)
        assert "... (10000 characters)" in line
        assert len(line) < 500  # the value shortened to a key's longest


# -- release --prefix / --owner -------------------------------------------------


@pytest.fixture
def holders(db_url: str, private: LockManager) -> Any:
    """Managers on ``private``'s table as three processes of two hosts."""
    made: list[LockManager] = []

    def make(client_id: str) -> LockManager:
        m = LockManager(db_url, table=private.config.table, client_id=client_id, renew=False)
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def test_release_by_prefix_and_by_owner(db_url: str, private: LockManager, holders: Any) -> None:
    web1, web10, web2 = holders("web-1:100"), holders("web-10:300"), holders("web-2:200")
    tag = uuid.uuid4().hex[:8]
    held = [
        web1.acquire(f"job:{tag}:a:1", ttl=60),
        web1.acquire(f"job:{tag}:a:2", ttl=60),
        web2.acquire(f"job:{tag}:b:1", ttl=60),
        web1.acquire(f"other:{tag}", ttl=60),
        web10.acquire(f"web10:{tag}", ttl=60),
    ]
    on = _on(private, db_url)

    def keys() -> set[str]:
        return {row.key for row in private.store.rows()}

    done = dblock("release", "--prefix", f"job:{tag}:a:", "--force", "--yes", *on)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(
        f"released 2 rows with keys starting with 'job:{tag}:a:'; by "
    )
    assert keys() == {f"job:{tag}:b:1", f"other:{tag}", f"web10:{tag}"}

    # `web-1` is a host: every process under it, but not the host web-10.
    done = dblock("release", "--owner", "web-1", "--force", "--yes", *on)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith("released 1 row held by 'web-1'; by ")
    assert keys() == {f"job:{tag}:b:1", f"web10:{tag}"}

    both = ("--owner", "web-2:200", "--prefix", f"job:{tag}:")
    done = dblock("release", *both, "--force", "--yes", *on)
    assert done.returncode == 0, done.stderr
    assert "released 1 row" in done.stdout
    assert keys() == {f"web10:{tag}"}

    nothing = dblock("release", *both, "--force", "--yes", *on)
    assert nothing.returncode == 1
    assert "no lock rows with keys starting with" in nothing.stdout
    nobody = dblock("release", "--owner", "nobody-here", "--force", "--yes", *on)
    assert nobody.returncode == 1
    assert nobody.stdout.startswith("dblock: no lock rows held by 'nobody-here' in ")

    # The exact owner column (host:pid:thread) works too.
    done = dblock("release", "--owner", held[4].owner, "--force", "--yes", *on)
    assert done.returncode == 0, done.stderr
    assert keys() == set()
    for h in held:
        with pytest.raises(LockLost):
            h.release()


def test_release_many_asks_on_a_terminal(db_url: str, private: LockManager, holders: Any) -> None:
    web1 = holders("web-1:100")
    held = [web1.acquire(f"batch:{i}", ttl=60) for i in range(12)]
    on = _on(private, db_url)
    refused = dblock("release", "--prefix", "batch:", "--force", *on)  # stdin: not a terminal
    assert "add --yes" in _one_line(refused, 2)
    for answer, code in (("n", 1), ("y", 0)):
        primary, secondary = pty.openpty()
        proc = subprocess.Popen(
            [*COMMAND, "release", "--prefix", "batch:", "--force", *on],
            stdin=secondary,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        os.close(secondary)
        os.write(primary, f"{answer}\n".encode())
        out, err = proc.communicate(timeout=60)
        os.close(primary)
        assert proc.returncode == code, err
        assert "12 rows with keys starting with 'batch:'" in out
        assert "... and 2 more" in out  # ten shown
        assert "force-release these 12 rows? [y/N]" in out
        left = len(private.store.rows())
        assert left == (12 if answer == "n" else 0)
    assert "released 12 rows" in out
    for h in held:
        with contextlib.suppress(LockLost):
            h.release()


# -- top, demo ----------------------------------------------------------------------


def test_top_once_on_a_dead_database_is_one_line() -> None:
    done = dblock("top", "--once", "--url", NOWHERE)
    line = _one_line(done, 1)
    assert "cannot connect" in line
    assert "s3cret" not in done.stdout + done.stderr
    assert done.stdout == ""  # no frame, no key legend
    assert "q quit" not in done.stderr


def test_top_once_shows_no_key_legend(db_url: str, private: LockManager) -> None:
    done = dblock("top", "--once", *_on(private, db_url), env={"COLUMNS": "160"})
    assert done.returncode == 0, done.stderr
    assert "0 rows" in done.stdout
    assert "q quit" not in done.stdout


def test_demo_help_explains_every_option() -> None:
    done = dblock("demo", "--help")
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    assert "no two holders of a user's lock ever overlapped" in text
    for help_text in (
        "worker processes (default 4)",
        "threads per process (default 4)",
        "distinct lock keys, user:N (default 5)",
        "requests per thread (default 50)",
    ):
        assert help_text in text


# -- one --json shape -----------------------------------------------------------------

# What differs between two reads a moment apart.
_MOMENT = ("age", "lease_left")


def _stable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k not in _MOMENT} for row in rows]


def _flask_list(db_url: str, table: str) -> str:
    from flask import Flask

    from dblock.contrib.flask import DBLock

    app = Flask(__name__)
    app.config.update(DBLOCK_URL=db_url, DBLOCK_TABLE=table)
    ext = DBLock(app)
    try:
        done = app.test_cli_runner().invoke(args=["dblock", "list", "--json"])
        assert done.exit_code == 0, done.output
        return done.output
    finally:
        ext.manager.close()


def _django_list(db_url: str, table: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", "dblock_list", "--json"],
        check=False,
        cwd=EXAMPLE,
        env={
            **os.environ,
            "PYTHONPATH": f"{EXAMPLE.parent.parent}{os.pathsep}{EXAMPLE}",
            "DJANGO_SETTINGS_MODULE": "tests.support.django_env_settings",
            "EXAMPLE_DBLOCK": json.dumps({"URL": db_url, "TABLE": table}),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_list_json_is_one_shape_everywhere(db_url: str, private: LockManager) -> None:
    held = []
    for i in (2, 1, 3):  # apart in time: "oldest first" is the order asked for
        held.append(private.acquire(f"shape:{i}", ttl=600))
        time.sleep(0.05)
    with private.semaphore("shape:sem", permits=2):
        table = private.config.table
        outputs = {
            "dblock": dblock("list", "--json", "--url", db_url, "--table", table).stdout,
            "flask": _flask_list(db_url, table),
            "django": _django_list(db_url, table),
        }
        parsed = {name: json.loads(text) for name, text in outputs.items()}
    assert isinstance(parsed["dblock"], list)
    assert [row["key"] for row in parsed["dblock"]] == [
        "shape:2", "shape:1", "shape:3", "shape:sem",
    ]  # fmt: skip
    for name in ("flask", "django"):
        assert _stable(parsed[name]) == _stable(parsed["dblock"]), name
        assert [set(row) for row in parsed[name]] == [set(row) for row in parsed["dblock"]]
    for h in held:
        h.release()


def test_list_json_of_an_empty_table_is_an_empty_array(db_url: str, private: LockManager) -> None:
    assert json.loads(_flask_list(db_url, private.config.table)) == []
