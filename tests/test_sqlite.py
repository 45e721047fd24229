"""SQLite specifics: the embedded default."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dblock import LockManager


def test_default_is_sqlite_file_in_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with LockManager() as m:
        assert m.dialect == "sqlite"
        m.create_schema()
        with m.lock("user:1") as held:
            assert held.fence == 1
    assert (tmp_path / "dblock.sqlite3").exists()


def test_env_url_overrides_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "sub" / "locks.db"
    monkeypatch.setenv("DBLOCK_URL", f"sqlite:///{target}")
    with LockManager() as m:
        m.create_schema()
        assert m.url.endswith("locks.db")
    assert target.exists()


def test_fence_counter_survives_empty_table(tmp_path: Path) -> None:
    with LockManager(f"sqlite:///{tmp_path}/f.db") as m:
        m.create_schema()
        fences = []
        for _ in range(3):
            with m.lock("k") as held:  # the table is empty between these
                fences.append(held.fence)
        assert fences == [1, 2, 3]


def test_create_schema_is_idempotent(tmp_path: Path) -> None:
    with LockManager(f"sqlite:///{tmp_path}/i.db", table="my_locks") as m:
        m.create_schema()
        m.create_schema()
        with m.lock("k"):
            pass
        m.drop_schema()
        assert "my_locks" not in os.popen("true").read()


def test_whole_second_times_from_returning_are_accepted() -> None:
    """SQLite's RETURNING gives a REAL column's whole-number value back as an
    int. A lease ending on a whole second must still be a grant, not an
    AssertionError and an orphan row."""
    import sqlite3

    from dblock._store.rw import _row
    from dblock._store.sqlparts import sqlite_grant as _grant

    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE t (k TEXT PRIMARY KEY, expires_at REAL, now REAL)")
    (returned,) = db.execute(
        "INSERT INTO t VALUES ('a', 1000.0 + :ttl, 1000.0) RETURNING expires_at, now", {"ttl": 10}
    ).fetchall()
    assert returned == (1010, 1000)
    assert all(type(v) is int for v in returned)  # the premise: ints, not floats

    grant = _grant((7, *returned))
    assert grant.fence == 7
    assert grant.expires_at.timestamp() == 1010.0
    assert 9.9 < grant.expires_in < 10.0
    row = _row((1, "rw", "read", "tok", "me", 7, returned[0], 1, returned[1]))
    assert row.expires_at.timestamp() == 1010.0
