"""``dblock top`` driven as an operator drives it: the real command in a
terminal (tmux), keys sent with send-keys and the screen read back with
capture-pane, on SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dblock import LockManager
from dblock.top import Sort, TopState
from tests.support.cli import COMMAND, dblock
from tests.support.rows import insert_expired

TMUX = shutil.which("tmux")


class Terminal:
    """One tmux pane on a private tmux server, running one command."""

    def __init__(
        self, command: list[str], status: Path, *, width: int = 180, height: int = 40
    ) -> None:
        assert TMUX, "tmux is needed for the terminal tests (apt-get install tmux)"
        self.socket = f"dblock-test-{uuid.uuid4().hex[:8]}"
        self.status = status
        # The exit code goes to a file: tmux's own pane status is not always set.
        shell = f"env -u DBLOCK_URL {shlex.join(command)}; echo $? > {shlex.quote(str(status))}"
        self._tmux("new-session", "-d", "-s", "t", "-x", str(width), "-y", str(height), shell)

    def _tmux(self, *args: str) -> str:
        done = subprocess.run(
            [TMUX or "tmux", "-L", self.socket, *args],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        return done.stdout

    def screen(self) -> str:
        return self._tmux("capture-pane", "-p", "-t", "t")

    def send(self, *keys: str) -> None:
        self._tmux("send-keys", "-t", "t", *keys)

    def wait_for(self, check: Callable[[str], bool], what: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            screen = self.screen()
            if check(screen):
                return screen
            if time.monotonic() > deadline:
                pytest.fail(f"the screen never showed {what}:\n{screen}")
            time.sleep(0.05)

    def exit_status(self) -> int | None:
        text = self.status.read_text() if self.status.exists() else ""
        return int(text) if text.endswith("\n") else None

    def close(self) -> None:
        subprocess.run([TMUX or "tmux", "-L", self.socket, "kill-server"], check=False)


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Callable[[list[str]], Terminal]]:
    opened: list[Terminal] = []

    def open_(command: list[str]) -> Terminal:
        term = Terminal(command, tmp_path / f"status-{len(opened)}")
        opened.append(term)
        return term

    yield open_
    for term in opened:
        term.close()


def _line_of(screen: str, key: str) -> str:
    (line,) = [line for line in screen.splitlines() if line.startswith(key)]
    return line


def test_top_shows_rows_live_and_takes_keys(
    private: LockManager, db_url: str, terminal: Callable[[list[str]], Terminal]
) -> None:
    tag = uuid.uuid4().hex[:6]
    live, gone, other = f"user:{tag}:live", f"user:{tag}:crashed", f"order:{tag}:9001"
    held = private.acquire(live, ttl=600)
    insert_expired(private, [gone], ago=120)
    term = terminal(
        [*COMMAND, "top", "--url", db_url, "--table", private.config.table, "--interval", "0.2"]
    )
    screen = term.wait_for(lambda s: live in s and gone in s, "both user rows")
    assert "EXPIRED" in _line_of(screen, gone)
    assert "EXPIRED" not in _line_of(screen, live)
    assert "2 rows, 1 live, 1 expired" in screen

    # A new row shows up at the next refresh, with no key pressed.
    newer = private.acquire(other, ttl=600)
    term.wait_for(lambda s: other in s, "the row acquired after start")

    term.send("x")  # expired rows only
    screen = term.wait_for(lambda s: "expired only" in s and live not in s, "the expired filter")
    assert gone in screen
    assert other not in screen
    term.send("x")
    term.wait_for(lambda s: live in s, "all rows again")

    term.send("/", *f"user:{tag}", "Enter")  # a prefix, typed in the view
    screen = term.wait_for(
        lambda s: f"prefix: 'user:{tag}'" in s and other not in s, "the prefix filter"
    )
    assert live in screen
    assert gone in screen

    term.send("l")  # lease left, soonest first: the expired row leads
    screen = term.wait_for(lambda s: "sort: lease left" in s, "the lease sort")
    lines = screen.splitlines()
    assert lines.index(_line_of(screen, gone)) < lines.index(_line_of(screen, live))
    term.send("k")  # key order: "...:crashed" before "...:live"
    term.wait_for(lambda s: "sort: key" in s, "the key sort")

    # A force-released row disappears from the view.
    assert dblock("release", "--force", "-y", "--url", db_url, "--table",
                  private.config.table, gone).returncode == 0  # fmt: skip
    term.wait_for(lambda s: gone not in s and live in s, "the released row gone")

    term.send("q")
    deadline = time.monotonic() + 20
    while term.exit_status() is None:
        assert time.monotonic() < deadline, term.screen()
        time.sleep(0.05)
    assert term.exit_status() == 0
    held.release()
    newer.release()


def test_top_once_prints_one_frame(private: LockManager, db_url: str) -> None:
    key = f"t:once:{uuid.uuid4().hex[:8]}"
    with private.lock(key, ttl=600):
        done = dblock(
            "top", "--once", "--url", db_url, "--table", private.config.table,
            env={"COLUMNS": "160"},
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert key in done.stdout
    assert "1 row, 1 live, 0 expired" in done.stdout


def test_top_names_the_leaders(private: LockManager, db_url: str) -> None:
    leader = private.leader("top-relay", ttl=600)
    term = leader.elect()
    try:
        done = dblock(
            "top", "--once", "--url", db_url, "--table", private.config.table,
            env={"COLUMNS": "200"},
        )  # fmt: skip
    finally:
        leader.step_down()
    assert done.returncode == 0, done.stderr
    assert f"leaders: 'top-relay' {term.holder} (term {term.fence}," in done.stdout
    (row,) = [line for line in done.stdout.splitlines() if "leader:top-relay" in line]
    assert [cell.strip() for cell in row.split("│")][1] == "leader"


def test_top_refuses_a_bad_interval() -> None:
    done = dblock("top", "--interval", "0", "--url", "sqlite:///ignored.sqlite3")
    assert done.returncode == 2
    assert "--interval must be positive" in done.stderr


# -- the view's state, without a terminal -----------------------------------------


def test_keys_change_sort_filter_and_prefix() -> None:
    state = TopState()
    assert state.handle("l")
    assert state.sort is Sort.LEASE
    assert state.handle("x")
    assert state.expired_only
    for key in ["/", "a", "b", "\x7f", "c", "\r"]:
        assert state.handle(key)
    assert state.prefix == "ac"
    assert state.editing is None
    # Esc cancels an edit; keys typed meanwhile are text, not commands.
    for key in ["/", "q", "\x1b"]:
        assert state.handle(key)
    assert state.prefix == "ac"
    assert state.handle("z")  # unknown keys are ignored
    assert not state.handle("q")


def test_top_once_in_a_pipe_at_80_columns_cuts_nothing(private: LockManager, db_url: str) -> None:
    """A frame printed in a pipe is 80 columns wide: KIND keeps its width
    and a long OWNER folds, as KEY does, rather than ending in an ellipsis."""
    key = f"tenant:acme-corporation:invoice:2026-11-0042:recompute:{uuid.uuid4().hex[:8]}"
    taken, done_with = threading.Event(), threading.Event()

    def hold() -> None:
        with private.lock(key, ttl=600):
            taken.set()
            done_with.wait(60)

    holder = threading.Thread(target=hold, name="ThreadPoolExecutor-0_12")
    holder.start()
    try:
        assert taken.wait(30)
        done = dblock(
            "top", "--once", "--url", db_url, "--table", private.config.table,
            env={"COLUMNS": "80"},
        )  # fmt: skip
    finally:
        done_with.set()
        holder.join(30)
    assert done.returncode == 0, done.stderr
    assert "1 row, 1 live, 0 expired" in done.stdout
    body = [line.split("│") for line in done.stdout.splitlines() if line.count("│") == 5]
    assert max(len(line) for line in done.stdout.splitlines()) <= 80
    cells = ["".join(row[i].strip() for row in body) for i in range(3)]
    assert cells[0] == key
    assert cells[1] == "exclusive"
    assert cells[2].endswith(":ThreadPoolExecutor-0_12"), cells[2]
    assert "…" not in done.stdout
