"""The admin side of every kind of lock: `dblock list`, `dblock release
--force`, the integrations' force-release and the sweeper, on rows of
semaphores next to exclusive ones."""

from __future__ import annotations

import json
import time

import pytest

from dblock import LockLost, LockManager
from dblock.contrib import _admin
from dblock.sweeper import Sweeper
from tests.support.cli import dblock


def _cut(key: str, width: int = 60) -> str:
    return key if len(key) <= width else key[: width - 3] + "..."


def _on(manager: LockManager, db_url: str) -> tuple[str, ...]:
    return ("--url", db_url, "--table", manager.config.table)


def test_list_shows_kind_mode_and_slot(db_url: str, private: LockManager, key: str) -> None:
    a = private.semaphore(f"{key}:s", permits=3).__enter__()
    b = private.semaphore(f"{key}:s", permits=3).__enter__()
    x = private.acquire(f"{key}:x", ttl=60)
    done = dblock("list", *_on(private, db_url))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].endswith(": 3 rows, 0 expired")
    body = {tuple(line.split()[:3]) for line in lines[3:]}
    # (The KEY column cuts a key past 60 characters; --json keeps it whole.)
    assert (_cut(f"{key}:s"), "semaphore", "p0/3") in body
    assert (_cut(f"{key}:s"), "semaphore", "p1/3") in body
    assert (_cut(f"{key}:x"), "exclusive", x.owner) in body
    done = dblock("list", "--json", *_on(private, db_url))
    rows = json.loads(done.stdout)
    assert sorted((r["slot"], r["kind"], r["mode"], r["permits"]) for r in rows) == [
        ("", "exclusive", "exclusive", None),
        ("p0", "semaphore", "permit", 3),
        ("p1", "semaphore", "permit", 3),
    ]
    for held in (a, b, x):
        held.release()


def test_release_force_takes_every_row_of_a_key(
    db_url: str, private: LockManager, key: str
) -> None:
    permits = [private.semaphore(key, permits=2).__enter__() for _ in range(2)]
    done = dblock("release", key, "--force", "--yes", *_on(private, db_url))
    assert done.returncode == 0, done.stderr
    assert f"2 rows of {key!r}" in done.stdout
    assert "semaphore p0/2" in done.stdout
    assert "semaphore p1/2" in done.stdout
    assert private.store.rows(key=key) == []
    for permit in permits:
        with pytest.raises(LockLost):
            permit.release()
    with private.semaphore(key, permits=2, blocking=False) as again:
        assert again.fence > max(p.fence for p in permits)


def test_integrations_force_release_every_row(private: LockManager, key: str) -> None:
    permits = [private.semaphore(key, permits=3).__enter__() for _ in range(3)]
    assert _admin.force_release(private, key)
    assert private.store.rows(key=key) == []
    assert not _admin.force_release(private, key)
    for permit in permits:
        with pytest.raises(LockLost):
            permit.release()


def test_sweeper_deletes_expired_rows_of_every_kind(private: LockManager, key: str) -> None:
    kept = [  # referenced: a dropped lock is released
        private.semaphore(f"{key}:s", permits=2, ttl=0.2).__enter__(),
        private.semaphore(f"{key}:s", permits=2, ttl=0.2).__enter__(),
        private.acquire(f"{key}:x", ttl=0.2),
    ]
    live = private.semaphore(f"{key}:live", permits=2, ttl=60).__enter__()
    store = private.store
    deadline = time.monotonic() + 30
    while store.stats().expired < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert Sweeper(private, grace=0).run_once().expired == 3
    assert [(r.key, r.slot) for r in store.rows()] == [(f"{key}:live", live.slot)]
    live.release()
    for held in kept:
        with pytest.raises(LockLost):
            held.release()


def test_top_shows_the_kind_of_each_row(db_url: str, private: LockManager, key: str) -> None:
    with private.semaphore(key, permits=3), private.lock(f"{key}:x", ttl=600):
        done = dblock(
            "top", "--once", "--url", db_url, "--table", private.config.table,
            env={"COLUMNS": "200"},
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "KIND" in done.stdout
    assert "semaphore p0/3" in done.stdout
    assert "exclusive" in done.stdout
