"""``dblock`` driven as an operator drives it: the real command in a
subprocess, against SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import json
import os
import pty
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from dblock import LockLost, LockManager
from tests.support.cli import COMMAND, dblock, start_dblock
from tests.support.rows import insert_expired


def _on(private: LockManager, db_url: str) -> tuple[str, ...]:
    return ("--url", db_url, "--table", private.config.table)


def _keys_in(manager: LockManager) -> set[str]:
    return {row.key for row in manager.store.rows()}


def _count(manager: LockManager, prefix: str) -> int:
    """Rows whose key starts with ``prefix`` (not the sweep's own lock row,
    which a whole-table count took for a swept row: the test signalled the
    sweeper before its first batch)."""
    table = manager.store.table
    key = table.c.lock_key
    with manager.engine.connect() as conn:
        return int(
            conn.execute(
                sa.select(sa.func.count())
                .select_from(table)
                .where(sa.func.substr(key, 1, len(prefix)) == prefix)
            ).scalar_one()
        )


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("dblock")
    return lines[0]


# -- migrate -----------------------------------------------------------------------


def test_migrate_honours_table_and_index_names(db_url: str) -> None:
    table = f"dblock_t_{uuid.uuid4().hex[:8]}"
    index = f"{table}_by_expiry"
    names = ("--url", db_url, "--table", table, "--index", index)
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        done = dblock("migrate", *names)
        assert done.returncode == 0, done.stderr
        assert f"migrated {table}" in done.stdout
        assert "empty -> 0005" in done.stdout
        inspector = sa.inspect(engine)
        assert inspector.has_table(table)
        assert inspector.has_table(f"{table}_version")
        assert index in {ix["name"] for ix in inspector.get_indexes(table)}
        again = dblock("migrate", *names)
        assert again.returncode == 0, again.stderr
        assert "up to date (revision 0005)" in again.stdout
        with LockManager(db_url, table=table, index=index) as m, m.lock("k", blocking=False):
            pass
    finally:
        with LockManager(db_url, table=table, index=index) as m:
            m.drop_schema()
    inspector = sa.inspect(engine)
    assert not inspector.has_table(table)
    assert not inspector.has_table(f"{table}_version")
    engine.dispose()


def test_migrate_sql_prints_the_ddl_with_the_configured_names(db_url: str) -> None:
    table = f"dblock_t_{uuid.uuid4().hex[:8]}"
    done = dblock("migrate", "--sql", "--url", db_url, "--table", table, "--index", f"{table}_exp")
    assert done.returncode == 0, done.stderr
    assert f"CREATE TABLE {table}" in done.stdout
    assert f"CREATE INDEX {table}_exp ON {table} (expires_at)" in done.stdout
    assert f"{table}_version" in done.stdout
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    assert not sa.inspect(engine).has_table(table)  # printed, not run
    engine.dispose()


# -- list, stats ---------------------------------------------------------------------


def test_list_and_stats(db_url: str, private: LockManager, keys: object) -> None:
    live_key, dead_key = keys(2)  # type: ignore[operator]
    insert_expired(private, [dead_key])
    live = private.acquire(live_key, ttl=60)
    on = _on(private, db_url)

    done = dblock("list", *on)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].endswith(": 2 rows, 1 expired")
    assert lines[2].split() == ["KEY", "KIND", "OWNER", "AGE", "LEASE", "LEFT", "FENCE"]
    dead_line, live_line = lines[3], lines[4]  # oldest first
    assert dead_line.startswith(dead_key)
    assert "crashed:1:MainThread" in dead_line
    assert "expired 1h00m ago" in dead_line
    assert live_line.startswith(live_key)
    assert live.owner in live_line
    assert live_line.split()[-1] == str(live.fence)

    done = dblock("list", "--json", *on)
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [row["key"] for row in rows] == [dead_key, live_key]
    assert rows[1]["owner"] == live.owner
    assert rows[1]["fence"] == live.fence
    assert rows[1]["expired"] is False
    assert 30 < rows[1]["lease_left"] <= 60
    assert (rows[1]["kind"], rows[1]["mode"], rows[1]["slot"]) == ("exclusive", "exclusive", "")
    assert rows[0]["expired"] is True
    assert rows[0]["age"] > 3600
    assert "token" not in rows[0]

    done = dblock("list", "--prefix", live_key, *on)
    assert done.returncode == 0, done.stderr
    assert live_key in done.stdout
    assert dead_key not in done.stdout

    done = dblock("list", "--limit", "1", *on)
    assert done.returncode == 0, done.stderr
    assert live_key not in done.stdout
    assert "... 1 more, not shown (--limit)" in done.stdout

    done = dblock("stats", *on)
    assert done.returncode == 0, done.stderr
    figures = dict(line.split(None, 1) for line in done.stdout.splitlines()[1:])
    assert (figures["rows"], figures["live"], figures["expired"]) == ("2", "1", "1")
    assert figures["oldest"].startswith(f"{dead_key!r}, held by crashed:1:MainThread")

    done = dblock("stats", "--json", *on)
    assert done.returncode == 0, done.stderr
    stats = json.loads(done.stdout)
    assert (stats["rows"], stats["live"], stats["expired"]) == (2, 1, 1)
    assert stats["oldest"]["key"] == dead_key
    assert stats["table"] == private.config.table
    live.release()


def test_list_of_an_empty_table(db_url: str, private: LockManager) -> None:
    done = dblock("list", *_on(private, db_url))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(": 0 rows, 0 expired")
    assert json.loads(dblock("list", "--json", *_on(private, db_url)).stdout) == []


# -- release --force ---------------------------------------------------------------


def test_release_force(db_url: str, private: LockManager, key: str) -> None:
    held = private.acquire(key, ttl=60)
    on = _on(private, db_url)

    done = dblock("release", key, *on)
    assert done.returncode == 2
    assert "--force" in _one_line_error(done)

    done = dblock("release", key, "--force", *on)  # stdin is not a terminal
    assert done.returncode == 2
    assert "--yes" in _one_line_error(done)
    assert key in _keys_in(private)

    done = dblock("release", key, "--force", "--yes", *on)
    assert done.returncode == 0, done.stderr
    # Said once, on stdout, with who did it (user@host); not again on stderr.
    (line,) = done.stdout.splitlines()
    assert line.startswith(f"released {key!r} held by {held.owner}")
    assert re.search(r"; by \S+@\S+$", line), line
    assert done.stderr == ""
    assert key not in _keys_in(private)
    with pytest.raises(LockLost):
        held.release()

    done = dblock("release", key, "--force", "--yes", *on)
    assert done.returncode == 1
    assert "no lock" in done.stdout


@pytest.mark.databases("sqlite")
def test_release_force_asks_on_a_terminal(db_url: str, private: LockManager, key: str) -> None:
    held = private.acquire(key, ttl=60)
    for answer, code in (("n", 1), ("y", 0)):
        primary, secondary = pty.openpty()
        proc = subprocess.Popen(
            [*COMMAND, "release", key, "--force", *_on(private, db_url)],
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
        assert f"force-release {key!r} held by {held.owner}" in out
        assert "[y/N]" in out
        if answer == "n":
            assert "not released" in out
            assert key in _keys_in(private)
    assert key not in _keys_in(private)


# -- sweep ---------------------------------------------------------------------------


def test_sweep_once(db_url: str, private: LockManager, keys: object) -> None:
    *backlog, live_key = keys(6)  # type: ignore[operator]
    insert_expired(private, backlog)
    live = private.acquire(live_key, ttl=60)
    done = dblock("sweep", "--once", "--batch-size", "2", *_on(private, db_url))
    assert done.returncode == 0, done.stderr
    assert "swept 5 expired rows and 0 held past max_hold in 3 batches" in done.stdout
    assert _keys_in(private) == {live_key}
    live.release()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sweep_every_stops_on_signal_after_the_batch_in_hand(
    db_url: str, private: LockManager, keys: object, sig: signal.Signals
) -> None:
    # SQLite sweeps a batch of one in about 0.1 ms: 5,000 rows went in 0.6 s,
    # which a loaded test process could miss entirely before its signal.
    backlog = keys(30_000 if private.engine.dialect.name == "sqlite" else 5000)  # type: ignore[operator]
    insert_expired(private, backlog)
    proc = start_dblock(
        "sweep", "--every", "1h", "--batch-size", "1", "--grace", "0", "--lock-ttl", "600",
        *_on(private, db_url),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        prefix = backlog[0].rsplit(":", 1)[0] + ":"  # keys() makes "<prefix>:<n>"
        while _count(private, prefix) == len(backlog) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    assert f"{sig.name} received; finishing the batch in hand" in err
    assert "stopped sweeping" in err
    left = _keys_in(private)
    assert left  # it stopped mid-run, it did not drain the backlog first
    assert len(left) < len(backlog)
    assert f"dblock:sweeper:{private.config.table}" not in left  # its lock was released


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["list", "--limit", "0"], id="limit-zero"),
        pytest.param(["sweep"], id="sweep-without-when"),
        pytest.param(["sweep", "--once", "--every", "1s"], id="sweep-once-and-every"),
        pytest.param(["sweep", "--every", "soon"], id="bad-duration"),
        pytest.param(["sweep", "--every", "0"], id="zero-every"),
        pytest.param(["sweep", "--once", "--batch-size", "-3"], id="bad-batch"),
        pytest.param(["sweep", "--once", "--max-hold", "1s"], id="max-hold-below-lock-ttl"),
        pytest.param(["list", "--table", "locks; drop table x"], id="bad-table"),
        pytest.param(["list", "--url", "::not a url::"], id="bad-url"),
        pytest.param(["list", "--url", "oracle://scott@db/x"], id="unsupported-database"),
        pytest.param(["frobnicate"], id="unknown-command"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(args: list[str], tmp_path: Path) -> None:
    done = dblock(*args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    _one_line_error(done)
    assert list(tmp_path.iterdir()) == []  # refused before touching any database


def test_missing_table_says_run_migrate(db_url: str) -> None:
    table = f"dblock_t_{uuid.uuid4().hex[:8]}"
    for command in (["list"], ["stats"], ["sweep", "--once"], ["sweep", "--every", "1s"]):
        done = dblock(*command, "--url", db_url, "--table", table)
        assert done.returncode == 1, done.stderr
        line = _one_line_error(done)
        assert f"lock table {table!r} does not exist" in line
        assert f"run `dblock migrate --table {table}`" in line


@pytest.mark.databases("postgresql", "mariadb")
def test_unreachable_database_is_one_line(db_url: str) -> None:
    # A port nobody listens on, and a password that must never be shown.
    url = sa.make_url(db_url).set(port=1, password="s3cret-pw").render_as_string(False)
    commands = [
        ["list"], ["stats"], ["migrate"], ["sweep", "--once"], ["sweep", "--every", "1s"],
        ["release", "k", "--force", "--yes"],
    ]  # fmt: skip
    for command in commands:
        done = dblock(*command, "--url", url)
        assert done.returncode == 1, (command, done.stderr)
        line = _one_line_error(done)
        assert "s3cret-pw" not in done.stdout + done.stderr
        assert ":***@" in line
        assert "cannot connect" in line or "failed" in line


@pytest.mark.databases("postgresql")
def test_password_is_masked_in_everything_printed_or_logged(
    db_url: str, private: LockManager, key: str, keys: object
) -> None:
    """The server trusts local connections, so a password in the URL is
    accepted and ignored: every command runs for real with it."""
    secret = "s3cret-pw"
    url = sa.make_url(db_url).set(password=secret).render_as_string(False)
    table = ("--table", private.config.table)
    insert_expired(private, keys(3))  # type: ignore[operator]
    _held = private.acquire(key, ttl=60)  # kept: a dropped lock is released
    runs = [
        dblock("migrate", "-v", "--url", url, *table),
        dblock("migrate", "--sql", "--url", url, *table),
        dblock("list", "-v", "--url", url, *table),
        dblock("list", "--json", "--url", url, *table),
        dblock("stats", "-v", "--url", url, *table),
        dblock("stats", "--json", "--url", url, *table),
        dblock("sweep", "--once", "-v", "--grace", "0", "--url", url, *table),
        dblock("release", key, "--force", "--yes", "-v", "--url", url, *table),
        dblock("stats", *table, env={"DBLOCK_URL": url}),
    ]
    for done in runs:
        assert done.returncode == 0, done.stderr
        assert secret not in done.stdout + done.stderr
    assert sum(":***@" in done.stdout + done.stderr for done in runs) >= 7
    with_env = runs[-1]
    assert private.config.table in with_env.stdout  # DBLOCK_URL was used

    proc = start_dblock("sweep", "--every", "0.2s", "-v", "--url", url, *table)
    # Signal it once it is sweeping (its handler is set by then), not after a guess.
    assert proc.stderr is not None
    first: list[str] = []
    while not any(":***@" in line for line in first):
        line = proc.stderr.readline()
        assert line, "".join(first)
        first.append(line)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    err = "".join(first) + err
    assert proc.returncode == 0, err
    assert secret not in out + err
    assert ":***@" in err


# -- hardening (issue 9, item 14) ------------------------------------------------------


def test_a_non_utf8_key_is_a_clear_error(private: LockManager, db_url: str) -> None:
    undecodable = os.fsdecode(b"user:\xff")  # what Python makes of $'user:\xff'
    for args in (
        ["release", undecodable, "--force", "--yes"],
        ["list", "--prefix", undecodable],
    ):
        done = dblock(*args, *_on(private, db_url))
        assert done.returncode == 2, done.stderr
        line = _one_line_error(done)
        assert "not valid UTF-8" in line
        assert "user:\\xff" in line


@pytest.mark.parametrize("command", [["list"], ["migrate"], ["migrate", "--sql"]])
def test_an_unsupported_database_is_named_with_the_supported_ones(
    tmp_path: Path, command: list[str]
) -> None:
    done = dblock(*command, "--url", "oracle://scott:tiger@db/x?password=tiger", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    line = _one_line_error(done)
    assert "does not support the 'oracle' database" in line
    assert "PostgreSQL" in line
    assert "MariaDB" in line
    assert "SQLite" in line
    assert "pip install" not in line
    assert "tiger" not in done.stdout + done.stderr
    assert done.stdout == ""


def test_read_only_commands_create_no_sqlite_database(tmp_path: Path) -> None:
    missing = tmp_path / "missing" / "dir" / "x.db"
    for args in (
        ["list"],
        ["list", "--json"],
        ["stats"],
        ["release", "k", "--force", "--yes"],
        ["sweep", "--once"],
    ):
        done = dblock(*args, "--url", f"sqlite:///{missing}", cwd=tmp_path)
        assert done.returncode == 1, (args, done.stderr)
        line = _one_line_error(done)
        assert "does not exist" in line
        assert "dblock migrate" in line
        assert list(tmp_path.iterdir()) == []  # no directory, no file


def test_global_options_before_or_after_the_command(private: LockManager, db_url: str) -> None:
    table = private.config.table
    held = private.acquire("k1", ttl=60)  # kept: a dropped handle is released when collected
    for args in (
        ["--url", db_url, "--table", table, "list", "--json"],
        ["list", "--json", "--url", db_url, "--table", table],
        ["--url", db_url, "list", "--json", "--table", table],
        ["--url", "sqlite:////nonexistent/x.db", "--table", "nope", "list", "--json", "--url",
         db_url, "--table", table],  # after the command wins
    ):  # fmt: skip
        done = dblock(*args)
        assert done.returncode == 0, (args, done.stderr)
        assert [row["key"] for row in json.loads(done.stdout)] == ["k1"]
    done = dblock("-v", "--url", db_url, "--table", table, "stats")
    assert done.returncode == 0, done.stderr
    assert table in done.stdout
    held.release()


def test_every_zero_and_a_malformed_every_are_refused_alike(tmp_path: Path) -> None:
    """Both by argparse, naming the option the same way (one was refused by
    the sweeper's own check as "interval", the other as "argument --every")."""
    zero = _one_line_error(dblock("sweep", "--every", "0", cwd=tmp_path))
    bad = _one_line_error(dblock("sweep", "--every", "5x", cwd=tmp_path))
    assert zero.startswith("dblock sweep: error: argument --every: "), zero
    assert bad.startswith("dblock sweep: error: argument --every: "), bad


def test_verbose_list_and_stats_show_the_times(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'locks.sqlite3'}"
    with LockManager(url, renew=False) as m:
        m.create_schema()
        held = m.acquire("user:42", ttl=600)
        plain = dblock("list", "--url", url).stdout
        listed = dblock("list", "-v", "--url", url).stdout
        stats = dblock("stats", "-v", "--url", url).stdout
        assert "ACQUIRED (UTC)" not in plain
        assert "ACQUIRED (UTC)" in listed
        assert "acquired " in stats
        # Never the token (the holder's): not with -v either.
        assert held.token not in listed + stats
        held.release()
