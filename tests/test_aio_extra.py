"""AsyncLockManager without SQLAlchemy's asyncio support (greenlet, which
SQLAlchemy 2.1 no longer installs by itself and dblock's asyncio extras do):
a LockArgumentError naming the extra, before any statement, not SQLAlchemy's
ImportError. tests/test_docs_install.py shows it in a real venv with only
``[postgresql]``; here the import is made to fail in this process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dblock import AsyncLockManager, LockArgumentError


@pytest.mark.parametrize(
    ("url", "extra"),
    [
        pytest.param("postgresql+psycopg://nobody@127.0.0.1:1/none", "postgresql-async", id="pg"),
        pytest.param("mysql+pymysql://nobody@127.0.0.1:1/none", "mysql-async", id="mysql"),
        pytest.param("sqlite:///{tmp}/locks.sqlite3", "sqlite-async", id="sqlite"),
    ],
)
def test_without_greenlet_the_error_names_the_extra(
    url: str, extra: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "sqlalchemy.ext.asyncio", None)  # import fails
    with pytest.raises(LockArgumentError) as info:
        AsyncLockManager(url.format(tmp=tmp_path))
    message = str(info.value)
    assert f"pip install '.[{extra}]'" in message
    assert "'dblock[" not in message  # dblock is not on a package index
    assert "greenlet" in message
