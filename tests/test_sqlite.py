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
