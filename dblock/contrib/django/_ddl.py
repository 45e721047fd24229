"""The Django migration's SQL: dblock's own schema definition compiled for
the connection's database, run on Django's connection inside the migration.

It is built from :func:`dblock.schema.create_statements`, the same source the
alembic revision uses, so both create one schema (a test reflects both and
compares them). It also writes alembic's version table at the revision it
matches, so ``dblock migrate`` on the same database finds it up to date.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy import Column, MetaData, PrimaryKeyConstraint, String, Table
from sqlalchemy.engine import Dialect
from sqlalchemy.schema import CreateTable, DropTable

from ...errors import DowngradeRefused
from ...schema import (
    HEAD_REVISION,
    OWNER_REVISION,
    TableNames,
    create_statements,
    drop_statements,
    exact_owner_statements,
    runs_create_statements,
    runs_drop_statements,
    storage_reset_statements,
    storage_statements,
)
from ...schema_upgrade import downgrade_0002, live_other_kinds_sql, upgrade_0002
from . import conf

__all__ = [
    "ALEMBIC_REVISION",
    "create_sql",
    "downgrade_0002_sql",
    "downgrade_0003_sql",
    "downgrade_0004_sql",
    "downgrade_0005_sql",
    "drop_sql",
    "upgrade_0002_sql",
    "upgrade_0003_sql",
    "upgrade_0004_sql",
    "upgrade_0005_sql",
]

#: The alembic revision the schema made by :func:`create_sql` is (``alembic/versions``).
ALEMBIC_REVISION = HEAD_REVISION


def _dialect(vendor: str) -> Dialect:
    if vendor == "postgresql":
        from sqlalchemy.dialects import postgresql

        return postgresql.dialect()  # type: ignore[no-untyped-call]
    if vendor == "mysql":
        from sqlalchemy.dialects import mysql

        return mysql.dialect()
    if vendor == "sqlite":
        from sqlalchemy.dialects import sqlite

        return sqlite.dialect()
    raise ValueError(f"dblock has no schema for the {vendor!r} database")


def _version_table(names: TableNames) -> Table:
    # alembic's own layout of its version table (alembic.runtime.migration).
    return Table(
        names.version_table,
        MetaData(),
        Column("version_num", String(32), nullable=False),
        PrimaryKeyConstraint("version_num", name=f"{names.version_table}_pkc"),
    )


def _compile(statement: Any, dialect: Dialect) -> str:
    return str(statement.compile(dialect=dialect)).strip()


def create_sql(vendor: str, names: TableNames) -> list[str]:
    """Statements creating the lock table on a Django ``vendor`` database."""
    dialect = _dialect(vendor)
    sql = [_compile(s, dialect) for s in create_statements(names, dialect.name)]
    version = _version_table(names)
    sql.append(_compile(CreateTable(version), dialect))
    sql.append(
        f"INSERT INTO {dialect.identifier_preparer.quote(names.version_table)} "
        f"(version_num) VALUES ('{ALEMBIC_REVISION}')"
    )
    return sql


def drop_sql(vendor: str, names: TableNames, revision: str = HEAD_REVISION) -> list[str]:
    """Statements dropping what the schema at ``revision`` has."""
    dialect = _dialect(vendor)
    sql = [_compile(DropTable(_version_table(names)), dialect)]
    return sql + [
        _compile(s, dialect) for s in drop_statements(names, dialect.name, revision=revision)
    ]


def _pk_name(connection: Any, table: str) -> str | None:
    with connection.cursor() as cursor:
        constraints = connection.introspection.get_constraints(cursor, table)
    for name, info in constraints.items():
        if info.get("primary_key"):
            return str(name)
    return None


def version_of(connection: Any, names: TableNames) -> str | None:
    """The alembic revision recorded for the lock table, if any."""
    if names.version_table not in connection.introspection.table_names():
        return None
    quote = _dialect(connection.vendor).identifier_preparer.quote
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT version_num FROM {quote(names.version_table)}")
        row = cursor.fetchone()
    return None if row is None else str(row[0])


def _set_version(dialect: Dialect, names: TableNames, revision: str) -> str:
    quote = dialect.identifier_preparer.quote
    return f"UPDATE {quote(names.version_table)} SET version_num = '{revision}'"


def upgrade_0003_sql(connection: Any, names: TableNames) -> list[str]:
    """Statements bringing a 0002 schema to 0003: the record of job runs beside the lock table."""
    dialect = _dialect(connection.vendor)
    sql = [_compile(s, dialect) for s in runs_create_statements(names)]
    return [*sql, _set_version(dialect, names, "0003")]


def downgrade_0003_sql(connection: Any, names: TableNames) -> list[str]:
    dialect = _dialect(connection.vendor)
    sql = [_compile(s, dialect) for s in runs_drop_statements(names)]
    return [*sql, _set_version(dialect, names, "0002")]


def upgrade_0004_sql(connection: Any, names: TableNames) -> list[str]:
    """Statements bringing a 0003 schema to 0004: the owner
    column compares exactly (the binary collation on MySQL/MariaDB; nothing
    to change elsewhere but the recorded revision)."""
    dialect = _dialect(connection.vendor)
    sql = [_compile(s, dialect) for s in exact_owner_statements(names, dialect)]
    return [*sql, _set_version(dialect, names, OWNER_REVISION)]


def downgrade_0004_sql(connection: Any, names: TableNames) -> list[str]:
    dialect = _dialect(connection.vendor)
    sql = [_compile(s, dialect) for s in exact_owner_statements(names, dialect, exact=False)]
    return [*sql, _set_version(dialect, names, "0003")]


def upgrade_0005_sql(connection: Any, names: TableNames) -> list[str]:
    """Statements bringing a 0004 schema to 0005: the lock table's storage
    parameters on PostgreSQL (catalog only: held locks stay held)."""
    dialect = _dialect(connection.vendor)
    sql = [_compile(s, dialect) for s in storage_statements(names, dialect.name)]
    return [*sql, _set_version(dialect, names, "0005")]


def downgrade_0005_sql(connection: Any, names: TableNames) -> list[str]:
    dialect = _dialect(connection.vendor)
    sql = [_compile(s, dialect) for s in storage_reset_statements(names, dialect.name)]
    return [*sql, _set_version(dialect, names, "0004")]


def upgrade_0002_sql(connection: Any, names: TableNames) -> list[str]:
    """Statements bringing a 0001 lock table on Django's ``connection`` to 0002, in place."""
    dialect = _dialect(connection.vendor)
    pk = _pk_name(connection, names.table) if connection.vendor == "postgresql" else None
    sql = [_compile(s, dialect) for s in upgrade_0002(names, dialect, None, pk_name=pk)]
    return [*sql, _set_version(dialect, names, "0002")]


def downgrade_0002_sql(connection: Any, names: TableNames) -> list[str]:
    """Statements bringing the lock table back to 0001; refuses
    (:class:`~dblock.errors.DowngradeRefused`) while live rows of other kinds exist."""
    dialect = _dialect(connection.vendor)
    with connection.cursor() as cursor:
        cursor.execute(live_other_kinds_sql(names, dialect))
        live = [str(r[0]) for r in cursor.fetchall()]
    if live:
        raise DowngradeRefused(names.table, "0001", live)
    pk = _pk_name(connection, names.table) if connection.vendor == "postgresql" else None
    sql = [_compile(s, dialect) for s in downgrade_0002(names, dialect, None, pk_name=pk)]
    return [*sql, _set_version(dialect, names, "0001")]


#: A revision's statements for one connection and table names.
SqlFor = Callable[[Any, TableNames], list[str]]
#: A ``RunPython`` function: ``(apps, schema_editor)``.
RunFn = Callable[[Any, Any], None]


def revision_step(
    previous: str,
    revision: str,
    upgrade: SqlFor,
    downgrade: SqlFor,
    *,
    lock_file_beside: Callable[[Any], bool],
) -> tuple[RunFn, RunFn]:
    """The two ``RunPython`` functions of a migration that brings dblock's
    tables from alembic revision ``previous`` to ``revision`` in place (and
    back): each acts only on dblock's database, on a lock table at the
    revision it starts from, so a schema made at the newest revision
    already (a fresh install, whose 0001 creates the newest schema) is left
    as it is; a SQLite app whose locks live in a file beside it
    (``lock_file_beside``, from 0001) is migrated to the newest there."""

    def ours(connection: Any, at: str) -> TableNames | None:
        if connection.alias != conf.database_alias():
            return None
        names = conf.table_names()
        if names.table not in connection.introspection.table_names():
            return None
        return names if version_of(connection, names) == at else None

    def forward(apps: Any, schema_editor: Any) -> None:
        connection = schema_editor.connection
        if connection.alias != conf.database_alias() or lock_file_beside(connection):
            return
        names = ours(connection, previous)
        for sql in [] if names is None else upgrade(connection, names):
            schema_editor.execute(sql, params=None)

    def backward(apps: Any, schema_editor: Any) -> None:
        connection = schema_editor.connection
        names = ours(connection, revision)
        for sql in [] if names is None else downgrade(connection, names):
            schema_editor.execute(sql, params=None)

    return forward, backward
