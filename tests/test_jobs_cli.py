"""``dblock run`` (a cluster-wide flock for cron) and ``dblock jobs``, as an
operator drives them: the real command in subprocesses and shells, on
SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from dblock import LockManager
from dblock._store.jobs import statements
from tests.support.cli import COMMAND, dblock, start_dblock
from tests.support.sizes import FULL

SKIP = 75


def _on(private: LockManager, db_url: str) -> tuple[str, ...]:
    return ("--url", db_url, "--table", private.config.table)


def _lock_row(manager: LockManager, key: str) -> object:
    table = manager.store.table
    with manager.engine.connect() as conn:
        return conn.execute(sa.select(table).where(table.c.lock_key == key)).first()


def _runs(manager: LockManager, job: str) -> list[object]:
    return statements(manager.store).latest(job, limit=100)  # type: ignore[return-value]


def _wait_for(path: Path, text: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}")


def _shell_dblock(private: LockManager, db_url: str) -> str:
    return " ".join(shlex.quote(part) for part in [*COMMAND, *_on(private, db_url)])


# -- one runs, the others skip ----------------------------------------------------------


def test_three_shells_at_once_one_runs(private: LockManager, db_url: str, tmp_path: Path) -> None:
    out = tmp_path / "ran"
    procs = [
        start_dblock(
            *_on(private, db_url),
            "run",
            "herd",
            "--at-least",
            "30s",
            "--",
            "sh",
            "-c",
            f"echo $$ >> {shlex.quote(str(out))}; sleep 1",
        )
        for _ in range(3)
    ]
    statuses = sorted(p.wait(timeout=120) for p in procs)
    for p in procs:
        p.communicate()
    assert statuses == [0, SKIP, SKIP]
    assert len(out.read_text().splitlines()) == 1
    (run,) = _runs(private, "herd")
    assert run.outcome == "success"  # type: ignore[attr-defined]


def test_cron_like_loops_on_three_hosts_run_once(
    private: LockManager, db_url: str, tmp_path: Path
) -> None:
    """Three "hosts" whose crons fire the same minute, each a little late
    (0 to 0.6 s): the first run's at_least keeps the late ones out."""
    out, statuses = tmp_path / "ran", tmp_path / "statuses"
    command = _shell_dblock(private, db_url)
    loop = (
        "for delay in 0 0.3 0.6; do sleep $delay; "
        f"{command} run cleanup --at-least 20s -q -- sh -c 'echo x >> {out}'; "
        f"echo $? >> {statuses}; done"
    )
    shells = [subprocess.Popen(["sh", "-c", loop]) for _ in range(3)]
    for shell in shells:
        assert shell.wait(timeout=180) == 0
    assert out.read_text().splitlines() == ["x"]
    assert sorted(statuses.read_text().split()) == ["0"] + [str(SKIP)] * 8


def test_a_fire_time_runs_once_whenever_it_arrives(private: LockManager, db_url: str) -> None:
    on = _on(private, db_url)
    first = dblock(*on, "run", "mail", "--fire-time", "2026-11-25T03:00Z", "--", "true")
    assert first.returncode == 0, first.stderr
    # A host whose cron fired late: the run is done, it skips (the key itself is free).
    late = dblock(*on, "run", "mail", "--fire-time", "2026-11-25T04:00+01:00", "--", "true")
    assert late.returncode == SKIP
    assert "succeeded" in late.stderr
    nxt = dblock(*on, "run", "mail", "--fire-time", "2026-11-26T03:00Z", "--", "true")
    assert nxt.returncode == 0, nxt.stderr


# -- the command's status, and signals ---------------------------------------------------


def test_the_commands_exit_status_comes_back(private: LockManager, db_url: str) -> None:
    on = _on(private, db_url)
    done = dblock(*on, "run", "status", "--", "sh", "-c", "echo out; echo err >&2; exit 7")
    assert done.returncode == 7
    assert done.stdout == "out\n"
    assert done.stderr == "err\n"
    (run,) = _runs(private, "status")
    assert (run.outcome, run.detail) == ("failed", "exit status 7")  # type: ignore[attr-defined]
    assert _lock_row(private, "job:status") is None


def test_skip_status_is_chosen_and_quiet_says_nothing(private: LockManager, db_url: str) -> None:
    on = _on(private, db_url)
    with private.lock("job:busy"):
        loud = dblock(*on, "run", "busy", "--", "true")
        quiet = dblock(*on, "run", "busy", "-q", "--skip-status", "0", "--", "true")
    assert loud.returncode == SKIP
    assert loud.stderr.startswith("dblock run: job 'busy' skipped: its key 'job:busy' is held")
    assert len(loud.stderr.splitlines()) == 1
    assert (quiet.returncode, quiet.stderr) == (0, "")


def test_sigterm_reaches_the_command_and_releases_the_key(
    private: LockManager, db_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    child = (
        "import signal, sys, time\n"
        f"out = open({str(out)!r}, 'a', buffering=1)\n"
        "def term(*_):\n"
        "    out.write('TERM\\n'); sys.exit(42)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        "out.write('started\\n')\n"
        "time.sleep(60)\n"
    )
    proc = start_dblock(
        *_on(private, db_url), "run", "term", "--at-most", "30s", "--", sys.executable, "-c", child
    )
    _wait_for(out, "started")
    assert _lock_row(private, "job:term") is not None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 42
    proc.communicate()
    assert out.read_text().splitlines() == ["started", "TERM"]
    assert _lock_row(private, "job:term") is None
    (run,) = _runs(private, "term")
    assert (run.outcome, run.detail) == ("failed", "exit status 42")  # type: ignore[attr-defined]


def test_a_command_killed_by_a_signal_exits_128_plus_n(
    private: LockManager, db_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = start_dblock(
        *_on(private, db_url), "run", "killed", "--", "sh", "-c", f"echo up > {out}; exec sleep 60"
    )
    _wait_for(out, "up")
    time.sleep(0.2)  # the shell has exec'd sleep
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    proc.communicate()
    (run,) = _runs(private, "killed")
    assert run.detail == "exit status 143 (SIGTERM)"  # type: ignore[attr-defined]
    assert _lock_row(private, "job:killed") is None


def test_a_signal_while_waiting_for_the_key_gives_everything_back(
    private: LockManager, db_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    with private.lock("job:waited", ttl=60):
        proc = start_dblock(
            *_on(private, db_url), "run", "waited", "--wait", "60s", "--", "touch", str(out)
        )
        time.sleep(2.0)  # started, connected, waiting
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        _, err = proc.communicate()
        assert "SIGTERM before the command started" in err
        assert "Traceback" not in err
    assert not out.exists()
    assert _runs(private, "waited") == []


def test_wait_runs_once_the_key_is_free(private: LockManager, db_url: str) -> None:
    held = private.acquire("job:later", ttl=60)
    proc = start_dblock(*_on(private, db_url), "run", "later", "--wait", "60s", "--", "true")
    time.sleep(1.0)
    assert proc.poll() is None
    held.release()
    assert proc.wait(timeout=60) == 0


def test_python_m_dblock_run(private: LockManager, db_url: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dblock", *_on(private, db_url), "run", "pym", "--", "echo", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={k: v for k, v in os.environ.items() if k != "DBLOCK_URL"},
    )
    assert (done.returncode, done.stdout) == (0, "hi\n"), done.stderr


# -- bad input: a clear error, nothing taken ----------------------------------------------


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (["--at-least", "5m", "--at-most", "1m"], 2, "at_least (300 s) must not exceed at_most"),
        (["--at-least=-5s"], 2, "at_least must be a duration >= 0"),
        (["--at-most", "-1"], 2, "at_most must be a duration > 0"),
        (["--wait", "-1"], 2, "wait must be a duration >= 0"),
        (["--fire-time", "2026-11-25T03:00"], 2, "needs its UTC offset"),
        (["--retry-failed"], 2, "--retry-failed needs --fire-time"),
        (["--skip-status", "300"], 2, "an exit status is 0 to 255"),
    ],
)
def test_bad_options(args: list[str], status: int, message: str) -> None:
    # A database nobody could reach: the error must come before any connection.
    done = dblock(
        "--url", "postgresql+psycopg://nobody@127.0.0.1:1/none", "run", "k", *args, "--", "true"
    )
    assert done.returncode == status, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("key", "command", "status", "message"),
    [
        ("x" * 300, ["true"], 2, "makes no valid lock key"),
        ("", ["true"], 2, "non-empty"),
        ("ok", ["no-such-command-anywhere"], 127, "command not found"),
        ("ok", ["/etc/passwd"], 126, "command is not executable"),
        ("ok", ["/no/such/file"], 127, "command not found"),
        ("ok", [], 2, "needs a command"),
    ],
)
def test_bad_key_or_command_takes_nothing(
    private: LockManager, db_url: str, key: str, command: list[str], status: int, message: str
) -> None:
    done = dblock(*_on(private, db_url), "run", key, "--", *command)
    assert done.returncode == status, done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert private.store.rows() == []
    assert statements(private.store).latest() == []


# -- dblock jobs --------------------------------------------------------------------------


def test_dblock_jobs_shows_the_runs(private: LockManager, db_url: str, tmp_path: Path) -> None:
    on = _on(private, db_url)
    assert dblock(*on, "run", "alpha", "--", "true").returncode == 0
    assert dblock(*on, "run", "beta", "--", "false").returncode == 1
    out = tmp_path / "out"
    # (Its command lets go of dblock's pipes and says its pid: it outlives dblock below.)
    script = f"exec >/dev/null 2>&1; echo $$ > {out}.pid; echo up > {out}; exec sleep 60"
    proc = start_dblock(*on, "run", "gamma", "--at-most", "2s", "--", "sh", "-c", script)
    try:
        _wait_for(out, "up")
        listing = dblock(*on, "jobs")
        assert listing.returncode == 0, listing.stderr
        lines = listing.stdout.splitlines()
        assert lines[0].endswith(": 3 jobs")
        assert lines[2].split()[:3] == ["JOB", "FIRE", "TIME"]
        rows = {line.split()[0]: line for line in lines[3:]}
        assert "success" in rows["alpha"]
        assert "failed" in rows["beta"]
        assert "exit status 1" in rows["beta"]
        assert "running" in rows["gamma"]
        as_json = json.loads(dblock(*on, "jobs", "--json").stdout)
        by_job = {entry["job"]: entry for entry in as_json}
        assert by_job["gamma"]["status"] == "running"
        assert by_job["alpha"]["duration"] >= 0
        assert by_job["beta"]["detail"] == "exit status 1"
        # The runner dies without a word: once its lease (at_most) is over, it shows.
        proc.kill()
        proc.wait()
        time.sleep(2.2)
        as_json = json.loads(dblock(*on, "jobs", "--json").stdout)
        assert {e["job"]: e["status"] for e in as_json}["gamma"] == "died"
    finally:
        proc.kill()
        proc.communicate()
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(Path(f"{out}.pid").read_text()), signal.SIGKILL)
    history = dblock(*on, "jobs", "alpha")
    assert history.returncode == 0
    assert "1 run of 'alpha'" in history.stdout


def test_dblock_jobs_without_the_record_says_to_migrate(db_url: str) -> None:
    import uuid

    from dblock import migrations

    table = f"dblock_j_{uuid.uuid4().hex[:8]}"
    with LockManager(db_url, table=table) as manager:
        migrations.upgrade(manager.engine, manager.names, "0002")
        try:
            done = dblock("--url", db_url, "--table", table, "jobs")
            assert done.returncode == 1
            assert f"the record of job runs '{table}_runs' does not exist" in done.stderr
            assert "dblock migrate" in done.stderr
            assert "Traceback" not in done.stderr
        finally:
            manager.drop_schema()


def _run_on_a_terminal(private: LockManager, db_url: str, job: str, child: str) -> tuple[int, int]:
    """``dblock run JOB -- python -c CHILD`` in a session of its own whose
    controlling terminal is a new pty: its pid and the pty's primary side."""
    import pty

    argv = [*COMMAND, *_on(private, db_url), "run", job, "--", sys.executable, "-c", child]
    pid, primary = pty.fork()
    if pid == 0:  # the child: a session of its own, the pty its controlling terminal
        os.execvpe(argv[0], argv, {k: v for k, v in os.environ.items() if k != "DBLOCK_URL"})
    return pid, primary


def _wait_drained(pid: int, primary: int, seconds: float = 30) -> int:
    """Wait for the process on a pty to end, draining the terminal's buffer
    meanwhile (a full one would block its writes); its wait status."""
    import select

    deadline = time.monotonic() + seconds
    while True:
        if select.select([primary], [], [], 0.05)[0]:
            with contextlib.suppress(OSError):  # EIO once the child is gone
                os.read(primary, 4096)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        assert time.monotonic() < deadline


def test_ctrl_c_in_a_terminal_reaches_the_command_once(
    private: LockManager, db_url: str, tmp_path: Path
) -> None:
    """In a terminal, Ctrl-C goes to the whole foreground group, the command
    included: dblock run does not send it a second time."""

    out = tmp_path / "out"
    child = (
        "import signal, sys, time\n"
        f"out = open({str(out)!r}, 'a', buffering=1)\n"
        "signal.signal(signal.SIGINT, lambda *_: out.write('INT\\n'))\n"
        "out.write('started\\n')\n"
        "time.sleep(1.5)\n"  # a second SIGINT would arrive meanwhile
        "time.sleep(0.5)\n"
        "sys.exit(3)\n"
    )
    pid, primary = _run_on_a_terminal(private, db_url, "tty", child)
    try:
        _wait_for(out, "started")
        os.write(primary, b"\x03")  # Ctrl-C
        status = _wait_drained(pid, primary)
    finally:
        os.close(primary)
    assert os.waitstatus_to_exitcode(status) == 3
    assert out.read_text().splitlines() == ["started", "INT"]
    assert _lock_row(private, "job:tty") is None


def test_kill_int_and_quit_from_another_process_reach_a_terminals_command(
    private: LockManager, db_url: str, tmp_path: Path
) -> None:
    """In a terminal's foreground, `kill -INT` / `kill -QUIT` of dblock run
    from another process reach only dblock run: it passes each on, once
    (a terminal's Ctrl-C, which the command gets itself, it does not)."""

    out = tmp_path / "out"
    child = (
        "import signal, sys, time\n"
        f"out = open({str(out)!r}, 'a', buffering=1)\n"
        "signal.signal(signal.SIGINT, lambda *_: out.write('INT\\n'))\n"
        "signal.signal(signal.SIGQUIT, lambda *_: out.write('QUIT\\n'))\n"
        "out.write('started\\n')\n"
        "deadline = time.monotonic() + 20\n"
        "while out.tell() < 15 and time.monotonic() < deadline:\n"  # started, INT, QUIT
        "    time.sleep(0.05)\n"
        "time.sleep(0.5)\n"  # a doubled signal would arrive meanwhile
        "sys.exit(4)\n"
    )
    pid, primary = _run_on_a_terminal(private, db_url, "tty-kill", child)
    try:
        _wait_for(out, "started")
        os.kill(pid, signal.SIGINT)
        _wait_for(out, "INT")
        os.kill(pid, signal.SIGQUIT)
        status = _wait_drained(pid, primary)
    finally:
        os.close(primary)
    assert os.waitstatus_to_exitcode(status) == 4
    assert out.read_text().splitlines() == ["started", "INT", "QUIT"]
    assert _lock_row(private, "job:tty-kill") is None


# -- the documented cron line, --per ---------------------------------------------------


def test_the_documented_cron_line_runs(private: LockManager, db_url: str) -> None:
    """`dblock run nightly-cleanup --at-least 5m -- …` (dblock run --help,
    docs/jobs.md): at_most, not given, follows at_least instead of refusing it."""
    on = _on(private, db_url)
    first = dblock(*on, "run", "nightly-cleanup", "--at-least", "5m", "--", "true")
    assert first.returncode == 0, first.stderr
    row = _lock_row(private, "job:nightly-cleanup")
    assert row is not None  # kept for at_least
    late = dblock(*on, "run", "nightly-cleanup", "--at-least", "5m", "-q", "--", "true")
    assert late.returncode == SKIP, late.stderr


def test_per_names_the_fire_time_by_this_hosts_clock(private: LockManager, db_url: str) -> None:
    on = _on(private, db_url)
    first = dblock(*on, "run", "hourly", "--per", "1h", "--", "true")
    assert first.returncode == 0, first.stderr
    again = dblock(*on, "run", "hourly", "--per", "1h", "--", "true")
    assert again.returncode == SKIP
    assert "succeeded" in again.stderr
    (run,) = _runs(private, "hourly")
    fire = run.fire_time  # type: ignore[attr-defined]
    assert (fire.minute, fire.second, fire.microsecond) == (0, 0, 0)
    both = dblock(
        *on, "run", "hourly", "--per", "1h", "--fire-time", "2026-01-01T00:00Z", "--", "true"
    )
    assert both.returncode == 2
    assert "not both" in both.stderr


# -- commands that cannot be executed ---------------------------------------------------


def test_a_script_without_an_interpreter_line_runs_as_sh_runs_it(
    private: LockManager, db_url: str, tmp_path: Path
) -> None:
    script = tmp_path / "cleanup"
    script.write_text('echo "ran with $1"\n')
    script.chmod(0o755)
    done = dblock(*_on(private, db_url), "run", "plain", "--", str(script), "arg")
    assert (done.returncode, done.stdout) == (0, "ran with arg\n"), done.stderr
    (run,) = _runs(private, "plain")
    assert run.outcome == "success"  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x7fNOT-ELF\x00\x01\x02", "cannot execute binary file"),  # refused before the key
        (b"#!/no/such/interpreter\n", "No such file or directory"),  # refused by execve
    ],
)
def test_a_command_that_cannot_be_executed_exits_126_and_leaves_nothing(
    private: LockManager, db_url: str, tmp_path: Path, content: bytes, message: str
) -> None:
    program = tmp_path / "prog"
    program.write_bytes(content)
    program.chmod(0o755)
    on = _on(private, db_url)
    for _ in range(2):  # nothing recorded: the next firing is refused the same way, not skipped
        done = dblock(*on, "run", "noexec", "--at-least", "1m", "--per", "1h", "--", str(program))
        assert done.returncode == 126, done.stderr
        assert message in done.stderr
        assert "nothing" in done.stderr
        assert "Traceback" not in done.stderr
        assert private.store.rows() == []
        assert _runs(private, "noexec") == []


# -- the command never outlives the lock --------------------------------------------------

_SLEEPER = (
    "import os, signal, sys, time\n"
    "out = open(sys.argv[1], 'a', buffering=1)\n"
    "def term(*_):\n"
    "    out.write('TERM\\n'); sys.exit(42)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "out.write(f'started {os.getpid()}\\n')\n"
    "time.sleep(60)\n"
    "out.write('ended\\n')\n"
)


def _gone(pid: int) -> bool:
    """Whether process ``pid`` ended (a zombie not yet reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_lost_lock_stops_the_command(private: LockManager, db_url: str, tmp_path: Path) -> None:
    """The job's row is deleted mid-run (an operator's `dblock release
    --force`, a sweeper, a failover): the command is stopped, not left to run
    beside the next holder's, and its record says the lock was lost."""
    out = tmp_path / "out"
    proc = start_dblock(
        *_on(private, db_url), "run", "lost", "--at-most", "2s", "--",
        sys.executable, "-c", _SLEEPER, str(out),
    )  # fmt: skip
    _wait_for(out, "started")
    row = _lock_row(private, "job:lost")
    assert row is not None
    assert private.store.release("job:lost", row.token)  # type: ignore[attr-defined]
    assert proc.wait(timeout=30) == 42  # its SIGTERM handler's status
    _, err = proc.communicate()
    assert "lock was lost" in err
    assert out.read_text().splitlines()[1:] == ["TERM"]
    (run,) = _runs(private, "lost")
    assert run.outcome == "failed"  # type: ignore[attr-defined]
    assert run.detail.startswith("lost its lock")  # type: ignore[attr-defined]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_kill_9_of_dblock_run_ends_the_command(
    private: LockManager, db_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    proc = start_dblock(
        *_on(private, db_url), "run", "orphan", "--at-most", "2s", "--",
        sys.executable, "-c", _SLEEPER, str(out),
    )  # fmt: skip
    _wait_for(out, "started")
    pid = int(out.read_text().split()[1])
    proc.kill()
    proc.communicate()
    deadline = time.monotonic() + 10
    while not _gone(pid):
        assert time.monotonic() < deadline, "the command outlived dblock run (and its lock)"
        time.sleep(0.05)
    assert "ended" not in out.read_text()


def test_a_signal_as_the_command_starts_never_says_nothing_ran(
    private: LockManager, db_url: str, tmp_path: Path
) -> None:
    """SIGTERM sent at moments around the command's start: whenever dblock
    run says "nothing ran", the command never started; whenever it started,
    it got the signal (and dblock run reports its status)."""
    on = _on(private, db_url)
    # How long dblock run takes to start its command here (under this load).
    out = tmp_path / "probe"
    began = time.monotonic()
    probe = start_dblock(*on, "run", "probe", "--", "sh", "-c", f"echo up > {out}; sleep 5")
    _wait_for(out, "up")
    start_at = time.monotonic() - began
    probe.send_signal(signal.SIGTERM)
    probe.wait(timeout=30)
    probe.communicate()
    wrong = []
    tries = 16 if FULL else 8  # (each a dblock run process: about 1 s apiece here)
    for i in range(tries):
        marker = tmp_path / f"ran{i}"
        proc = start_dblock(
            *on, "run", f"edge{i}", "--", "sh", "-c",
            # (The sleep's output away from dblock run's pipes, and killed
            # with the shell: an orphaned sleep holding them kept the
            # test's communicate() for its whole 10 s.)
            f"echo started > {marker}; trap 'kill $! 2>/dev/null; exit 42' TERM; "
            "sleep 10 </dev/null >/dev/null 2>&1 & wait",
        )  # fmt: skip
        time.sleep(max(0.0, start_at * (0.7 + 0.45 * i / tries)))
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=30)
        _, err = proc.communicate()
        time.sleep(0.3)  # a command started unbeknown to dblock run has written by now
        if "nothing ran" in err and marker.exists():
            wrong.append((i, status, err))
        if marker.exists():
            assert status in (42, 128 + signal.SIGTERM), err
    assert wrong == []
