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


# -- the URL forms and engines AsyncLockManager takes (issue 47) -------------------


ASYNC_FORMS = {
    "sqlite": ("sqlite+aiosqlite",),
    "postgresql": ("postgresql+psycopg_async", "postgresql+psycopg", "postgresql+asyncpg"),
    "mariadb": ("mysql+aiomysql", "mariadb+aiomysql", "mysql+asyncmy", "mariadb+asyncmy"),
}


@pytest.mark.databases("sqlite", "postgresql", "mariadb")
def test_each_async_url_form_and_an_async_engine_take_a_lock(
    db_server: str, db_url: str, key: str
) -> None:
    import asyncio

    from sqlalchemy.engine import make_url
    from sqlalchemy.ext.asyncio import create_async_engine

    base = make_url(db_url)

    async def run(source: object) -> int:
        alocks = AsyncLockManager(source)  # type: ignore[arg-type]
        try:
            async with alocks.lock(key) as held:
                return held.fence
        finally:
            await alocks.close()

    fences = []
    for form in ASYNC_FORMS[db_server]:
        url = base.set(drivername=form)
        fences.append(asyncio.run(run(url.render_as_string(hide_password=False))))

        async def on_engine(url: object = url) -> int:
            engine = create_async_engine(url, pool_size=2)  # type: ignore[arg-type]
            try:
                return await run(engine)
            finally:
                await engine.dispose()

        fences.append(asyncio.run(on_engine()))
    assert fences == sorted(fences)
    assert len(set(fences)) == len(fences)


@pytest.mark.parametrize(
    "source", ["postgresql+asyncpg://u@h/db", "mysql+asyncmy://u@h/db", "mariadb+asyncmy://u@h/db"]
)
def test_asyncpg_and_asyncmy_urls_given_to_lock_manager_are_refused(source: str) -> None:
    from dblock import LockManager

    with pytest.raises(LockArgumentError, match="is an asyncio driver: give this URL to"):
        LockManager(source)


def test_an_async_engine_or_url_given_to_lock_manager_is_refused(tmp_path: Path) -> None:
    import sqlalchemy as sa
    from sqlalchemy.ext.asyncio import create_async_engine

    from dblock import LockManager

    path = tmp_path / "x.sqlite3"
    # (A blocking Engine is taken: it is the blocking side's, shared; see
    # tests/test_psycopg2.py.)
    assert isinstance(AsyncLockManager(sa.create_engine(f"sqlite:///{path}")).sync, LockManager)
    with pytest.raises(LockArgumentError, match="an AsyncEngine is for AsyncLockManager"):
        LockManager(create_async_engine(f"sqlite+aiosqlite:///{path}"))  # type: ignore[arg-type]
    with pytest.raises(LockArgumentError, match="is an asyncio driver: give this URL to"):
        LockManager(f"sqlite+aiosqlite:///{path}")


@pytest.mark.parametrize(
    ("url", "module", "extra"),
    [
        ("postgresql+asyncpg://nobody@127.0.0.1:1/none", "asyncpg", "postgresql-asyncpg"),
        ("mysql+asyncmy://nobody@127.0.0.1:1/none", "asyncmy", "mysql-asyncmy"),
        ("mariadb+asyncmy://nobody@127.0.0.1:1/none", "asyncmy", "mysql-asyncmy"),
    ],
)
def test_without_asyncpg_or_asyncmy_the_error_names_their_extra(
    url: str, module: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails
    with pytest.raises(LockArgumentError) as info:
        AsyncLockManager(url)
    message = str(info.value)
    assert f"pip install '.[{extra}]'" in message
    assert module in message
