"""A process that ends without releasing its locks.

Interpreter exit releases what nobody can release any more (the main
thread's locks, those of tasks whose loop is gone), as a collected handle's
lock is released: the next process does not wait out the lease. Each case
runs a real Python process that acquires and ends; ``kill -9`` stays
bounded by the lease (nothing runs then).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from dblock import LockManager
from tests.conftest import row_of
from tests.support.interrupts import next_point
from tests.support.proxy import Proxy

_PRELUDE = """
import asyncio, logging, os, sys, threading, time
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
logging.getLogger("sqlalchemy").setLevel(logging.WARNING)
from dblock import AsyncLockManager, LockManager
URL, KEY = sys.argv[1], sys.argv[2]
"""


_HERE = os.path.dirname(os.path.abspath(__file__))


def _run(url: str, key: str, body: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    script = _PRELUDE + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", script, url, key],
        cwd=_HERE,  # (not the checkout's root: the installed dblock, or PYTHONPATH's)
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _quiet(stderr: str, *, task_ended: bool = False) -> None:
    """Nothing said falsely: no error, no lock lost, no owner taken for dead,
    no exception through dblock's code. (A dropped async engine's driver may
    complain at exit of its closed loop: not dblock's to say.) With
    ``task_ended``, the script's main task did end holding the lock, and a
    renewal pass that comes between its end and the loop's close says so
    truly."""
    ended = "released: its holder, task 'Task-1', ended without releasing it"
    bad = [
        line
        for line in stderr.splitlines()
        if line.startswith("ERROR dblock")
        or ("ended without releasing" in line and not (task_ended and ended in line))
        or "/dblock/" in line
    ]
    assert bad == [], stderr


def _released_at_exit(stderr: str) -> bool:
    """Released at exit, or just before by the renewal thread's pass (its
    task ended, or its loop closed: on a loaded machine a pass may come
    between the main task's end and asyncio.run's close of the loop), and
    said so."""
    return "released at interpreter exit" in stderr or (
        "released: its holder, task" in stderr
        and ("can never run again" in stderr or "ended without releasing it" in stderr)
    )


def test_a_script_that_exits_holding_a_lock_releases_its_row(
    manager: LockManager, db_url: str, key: str
) -> None:
    done = _run(
        db_url,
        key,
        """
        locks = LockManager(URL, ttl=60)
        held = locks.acquire(KEY)
        print("held", held.fence, flush=True)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "held" in done.stdout
    assert row_of(manager, key) is None, "the row outlived its process"
    assert "released at interpreter exit" in done.stderr, done.stderr
    _quiet(done.stderr)
    with manager.lock(key, blocking=False):
        pass


@pytest.mark.parametrize("handle", ["kept", "dropped"])
def test_an_async_script_that_ends_asyncio_run_holding_a_lock_releases_its_row(
    manager: LockManager, db_url: str, key: str, handle: str
) -> None:
    """The task ends holding the lock, its handle kept (a global) or dropped
    with the coroutine's frame (then it is collected, released as any
    dropped handle is, and the exit waits for that release to be sent)."""
    done = _run(
        db_url,
        key,
        f"""
        KEPT = []

        async def main():
            alocks = AsyncLockManager(URL, ttl=60)
            held = await alocks.acquire(KEY)
            print("held", held.fence, flush=True)
            if {handle == "kept"}:
                KEPT.append((alocks, held))

        asyncio.run(main())
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "held" in done.stdout
    assert row_of(manager, key) is None, "the row outlived its process"
    if handle == "kept":
        assert _released_at_exit(done.stderr), done.stderr
    else:
        assert "was never released by its holder; releasing it" in done.stderr, done.stderr
    _quiet(done.stderr, task_ended=True)


def test_an_async_script_that_exits_by_sys_exit_holding_a_lock_releases_its_row(
    manager: LockManager, db_url: str, key: str
) -> None:
    done = _run(
        db_url,
        key,
        """
        async def main():
            alocks = AsyncLockManager(URL, ttl=60)
            held = await alocks.acquire(KEY)
            print("held", held.fence, flush=True)
            sys.exit(3)

        asyncio.run(main())
        """,
    )
    assert done.returncode == 3, done.stderr
    assert "held" in done.stdout
    assert row_of(manager, key) is None, "the row outlived its process"
    assert _released_at_exit(done.stderr), done.stderr
    _quiet(done.stderr, task_ended=True)


def test_a_lock_a_daemon_thread_still_holds_is_left_to_its_lease(
    manager: LockManager, db_url: str, key: str
) -> None:
    """A daemon thread runs on until the interpreter stops it: releasing its
    lock at exit could let another process in while it still works under it."""
    done = _run(
        db_url,
        key,
        """
        locks = LockManager(URL, ttl=2)
        got = threading.Event()

        def work():
            with locks.lock(KEY):
                got.set()
                time.sleep(600)

        threading.Thread(target=work, daemon=True).start()
        got.wait(30)
        print("held", flush=True)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "held" in done.stdout
    assert row_of(manager, key) is not None, "released while its daemon thread held it"
    assert "released at interpreter exit" not in done.stderr
    _quiet(done.stderr)
    with manager.lock(key, timeout=30):  # its lease ends it
        pass


def test_a_forked_child_does_not_release_its_parents_rows_at_its_exit(
    manager: LockManager, db_url: str, key: str
) -> None:
    done = _run(
        db_url,
        key,
        """
        locks = LockManager(URL, ttl=60)
        held = locks.acquire(KEY)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # runs the child's atexit handlers
        os.waitpid(pid, 0)
        print("still held" if locks.is_locked(KEY) else "gone", flush=True)
        held.release()
        """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["still", "held"], done.stdout + done.stderr
    assert row_of(manager, key) is None
    _quiet(done.stderr)


def test_a_jobs_kept_row_stays_kept_after_its_process_exits(
    manager: LockManager, db_url: str, key: str
) -> None:
    """``at_least``: the run ended, its key stays taken for the rest of
    at_least, whether or not the process that ran it lives on."""
    done = _run(
        db_url,
        key,
        """
        locks = LockManager(URL, ttl=60)

        @locks.once(KEY, at_least=60)
        def job():
            return "ran"

        print(job(), flush=True)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ran"]
    from dblock.jobs import job_key

    assert row_of(manager, job_key(key)) is not None, "at_least was not kept past the exit"
    assert "released at interpreter exit" not in done.stderr
    _quiet(done.stderr)


@pytest.fixture
def proxy(db: str, db_url: str) -> Iterator[Proxy]:
    # The tests that use it are marked for PostgreSQL and MariaDB: a file
    # has no server to stand in front of, and must not pass as skipped.
    assert db != "sqlite", "the proxy stands before a server: mark the test for a server"
    url = sa.make_url(db_url)
    default_port = 5432 if url.get_backend_name() == "postgresql" else 3306
    p = Proxy(url.host or "127.0.0.1", url.port or default_port)
    yield p
    p.close()


@pytest.mark.databases("postgresql", "mariadb")
def test_an_exit_does_not_wait_for_a_database_that_does_not_answer(
    manager: LockManager, db_url: str, key: str, proxy: Proxy
) -> None:
    """The release at exit is held at the server's door: the process still
    ends within the exit's deadline, leaving the row to its lease, and says so."""
    script = _PRELUDE + textwrap.dedent(
        """
        locks = LockManager(URL, ttl=3, batch=False)
        held = locks.acquire(KEY)
        print("held", flush=True)
        sys.stdin.readline()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script, proxy.url_for(db_url), key],
        cwd=_HERE,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdin is not None
        assert child.stdout.readline().strip() == "held"
        _, let_go = proxy.hold(b"DELETE")
        started = time.monotonic()
        child.stdin.write("go\n")
        child.stdin.flush()
        _, stderr = child.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, stderr
    assert took < 10, f"exit took {took:.1f} s"
    assert "did not answer within 3 s at interpreter exit" in stderr, stderr
    assert "released at interpreter exit" not in stderr, stderr
    let_go.set()
    with manager.lock(key, timeout=30):  # the lease (or the held DELETE) ends it
        pass


def test_an_exit_interrupted_anywhere_in_its_release_still_releases(
    manager: LockManager, db_url: str, key: str, tmp_path: Path
) -> None:
    """A signal handler's exception (a second Ctrl-C, SIGTERM's SystemExit)
    at each point of the atexit hook's code where CPython can raise it,
    frame starts included: the row is still released at exit, not left for
    its lease (60 s), and the exception is not swallowed (Python prints it).
    Before: one landing after a lock was claimed and before the release was
    posted left the row for its lease."""
    n = 0
    while True:
        n = next_point(n)
        note = tmp_path / f"point-{n}"
        done = _run(
            db_url,
            key,
            f"""
            import atexit
            sys.path.insert(0, {os.path.dirname(_HERE)!r})
            from tests.support.interrupts import LOCK_FILES, arm
            locks = LockManager(URL, ttl=60)
            held = locks.acquire(KEY)
            armed = arm({n}, "dblock/manager.py", *LOCK_FILES, "dblock/renewal.py",
                        note={str(note)!r})
            atexit.register(armed.start)  # (runs before dblock's hook: LIFO)
            """,
        )
        deadline = time.monotonic() + 5
        while row_of(manager, key) is not None:
            assert time.monotonic() < deadline, (
                f"interrupted at point {n} ({note.read_text() if note.exists() else '-'}):"
                f" the row stayed\n{done.stderr}"
            )
            time.sleep(0.05)
        if not note.exists():
            break  # an exit went by without reaching point n
        assert "Interrupt" in done.stderr, f"{note.read_text()}: swallowed\n{done.stderr}"
    assert n > 3
