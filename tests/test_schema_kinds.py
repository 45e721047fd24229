"""Revision 0002 (more kinds of lock) upgrades a live 0001 table in place and
downgrades back: held exclusive locks stay held across both.

Each test uses a table of its own in the test database, brought to revision
0001 and holding locks written as 0001's code writes them (one INSERT per
dialect, the fence from the dialect's own counter), then migrated by
``create_schema()`` or the ``dblock migrate`` command.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from dblock import DowngradeRefused, LockBusy, LockManager, migrations
from dblock.schema import TableNames
from tests.support.cli import dblock

NOW = {
    "postgresql": "now()",
    "mariadb": "UTC_TIMESTAMP(6)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}


def _lease(db: str, seconds: int) -> str:
    if db == "postgresql":
        return f"now() + interval '{seconds} seconds'"
    if db == "mariadb":
        return f"UTC_TIMESTAMP(6) + INTERVAL {seconds} SECOND"
    return f"{NOW['sqlite']} + {seconds}"


def _hold_0001(engine: sa.Engine, db: str, names: TableNames, key: str, token: str) -> None:
    """A held lock as revision 0001's code writes it (its columns only)."""
    t = names.table
    if db == "postgresql":
        fence = f"nextval('{names.sequence}')"
    elif db == "sqlite":
        fence = f"(SELECT value + 1 FROM {names.fence_table} WHERE id = 1)"
    else:
        fence = None
    cols = "lock_key, owner, token, acquired_at, expires_at" + (", fence" if fence else "")
    values = f"'{key}', 'old:1:MainThread', '{token}', {NOW[db]}, {_lease(db, 300)}"
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"INSERT INTO {t} ({cols}) VALUES ({values}{', ' + fence if fence else ''})"
        )


def _hold_semaphore_row(engine: sa.Engine, db: str, names: TableNames, key: str) -> None:
    """A live permit row, as the semaphore writes it (revision 0002 columns)."""
    token = uuid.uuid4().hex
    fence = {"postgresql": f"nextval('{names.sequence}')", "mariadb": "NULL"}.get(
        db, f"(SELECT value + 1 FROM {names.fence_table} WHERE id = 1)"
    )
    with engine.begin() as conn:
        conn.exec_driver_sql(
            f"INSERT INTO {names.table} (lock_key, slot, kind, mode, permits, owner, token, "
            f"fence, acquired_at, expires_at) VALUES ('{key}', 'p0', 'semaphore', 'permit', 2, "
            f"'x:1:T', '{token}', {fence}, {NOW[db]}, {_lease(db, 300)})"
        )


def _raw_rows(engine: sa.Engine, names: TableNames) -> list[tuple[str, str, int]]:
    with engine.connect() as conn:
        return [
            (r[0], r[1], int(r[2]))
            for r in conn.exec_driver_sql(
                f"SELECT lock_key, token, fence FROM {names.table} ORDER BY lock_key"
            ).all()
        ]


@pytest.fixture
def table(db_url: str) -> Iterator[tuple[TableNames, sa.Engine]]:
    names = TableNames(table=f"dblock_up_{uuid.uuid4().hex[:8]}")
    with LockManager(db_url, table=names.table) as m:
        migrations.upgrade(m.engine, names, "0001")
    engine = sa.create_engine(db_url, poolclass=sa.pool.NullPool)
    try:
        yield names, engine
    finally:
        with LockManager(db_url, table=names.table) as m:
            if migrations.current(m.engine, names) is not None:
                migrations.downgrade(m.engine, names)
        engine.dispose()


def _migrate(how: str, db_url: str, names: TableNames, revision: str = "head") -> None:
    if how == "create_schema":
        with LockManager(db_url, table=names.table) as m:
            if revision == "head":
                m.create_schema()
            else:
                migrations.downgrade(m.engine, names, revision)
        return
    assert revision == "head"
    done = dblock("migrate", "--url", db_url, "--table", names.table)
    assert done.returncode == 0, done.stderr
    assert "0001 -> 0005" in done.stdout


@pytest.mark.parametrize("how", ["create_schema", "dblock migrate"])
def test_upgrade_keeps_held_exclusive_locks(
    db: str, db_url: str, table: tuple[TableNames, sa.Engine], key: str, how: str
) -> None:
    names, engine = table
    tokens = {f"{key}:a": uuid.uuid4().hex, f"{key}:b": uuid.uuid4().hex}
    for k, token in tokens.items():
        _hold_0001(engine, db, names, k, token)
    before = _raw_rows(engine, names)

    _migrate(how, db_url, names)

    with LockManager(db_url, table=names.table) as m:
        assert migrations.current(m.engine, names) == migrations.head() == "0005"
        assert _raw_rows(engine, names) == before  # same tokens, same fences
        rows = {r.key: r for r in m.store.rows()}
        assert {(r.slot, r.kind, r.mode, r.holders, r.permits) for r in rows.values()} == {
            ("", "exclusive", "exclusive", 1, None)
        }
        with LockManager(db_url, table=names.table) as other:
            for k in tokens:
                with pytest.raises(LockBusy):
                    other.acquire(k, blocking=False)
            # The old holders renew and release by their tokens.
            renewed = m.store.renew([(k, t, 60.0) for k, t in tokens.items()])
            assert set(renewed) == set(tokens.values())
            for k, token in tokens.items():
                assert m.store.release(k, token)
            top = max(fence for _, _, fence in before)
            with other.lock(f"{key}:a", blocking=False) as again:
                assert again.fence > top
            with other.lock(f"{key}:new", blocking=False) as fresh:
                assert fresh.fence > again.fence
        m.create_schema()  # at head: nothing to do
        assert migrations.current(m.engine, names) == "0005"


def test_downgrade_keeps_exclusive_locks_and_refuses_live_other_kinds(
    db: str, db_url: str, table: tuple[TableNames, sa.Engine], key: str
) -> None:
    names, engine = table
    _migrate("create_schema", db_url, names)
    with LockManager(db_url, table=names.table) as m:
        # 0003 (the record of job runs) and the later revisions go back first;
        # the lock table is 0002's.
        migrations.downgrade(m.engine, names, "0002")
        held = m.acquire(f"{key}:x", ttl=300)
        _hold_semaphore_row(engine, db, names, f"{key}:sem")
        with pytest.raises(DowngradeRefused, match=re.escape(f"{key}:sem")) as refused:
            migrations.downgrade(m.engine, names, "0001")
        assert refused.value.keys == [f"{key}:sem"]
        assert migrations.current(m.engine, names) == "0002"
        assert len(m.store.rows()) == 2  # nothing changed
        # Once the permit row's lease is over it protects nothing: dropped.
        with engine.begin() as conn:
            conn.exec_driver_sql(
                f"UPDATE {names.table} SET expires_at = acquired_at WHERE slot = 'p0'"
            )
        migrations.downgrade(m.engine, names, "0001")
        assert migrations.current(m.engine, names) == "0001"
        rows = _raw_rows(engine, names)
        assert rows == [(f"{key}:x", held.token, held.fence)]
        with engine.connect() as conn:
            columns = {c["name"] for c in sa.inspect(conn).get_columns(names.table)}
        assert "slot" not in columns
        assert "kind" not in columns
        # And up again: still held, and its holder releases it.
        m.create_schema()
        with LockManager(db_url, table=names.table) as other, pytest.raises(LockBusy):
            other.acquire(f"{key}:x", blocking=False)
        held.release()
        with m.lock(f"{key}:x", blocking=False) as again:
            assert again.fence > held.fence


def test_newer_schema_is_left_alone(db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A rolling deploy: a newer dblock migrated the table to a revision this
    one does not know. create_schema() (and so `dblock migrate`) warns and
    leaves it; locks still work on it."""
    table = f"dblock_t_{uuid.uuid4().hex[:8]}"
    m = LockManager(db_url, table=table)
    try:
        m.create_schema()
        version = m.engine.dialect.identifier_preparer.quote(m.names.version_table)
        with m.engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE {version} SET version_num = '9999_future'"))
        with caplog.at_level("WARNING", logger="dblock"):
            m.create_schema()
        assert any("newer than this dblock" in r.getMessage() for r in caplog.records)
        with m.lock("newer-schema", blocking=False) as held:
            assert held.fence
    finally:
        with m.engine.begin() as conn:
            conn.execute(sa.text(f"UPDATE {version} SET version_num = :v"),
                         {"v": migrations.head()})  # fmt: skip
        m.drop_schema()
        m.close()
