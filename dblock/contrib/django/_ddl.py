"""The Django migration's SQL: dblock's own schema definition compiled for
the connection's database, run on Django's connection inside the migration.

It is built from :func:`dblock.schema.create_statements`, the same source the
alembic revision uses, so both create one schema (a test reflects both and
compares them). It also writes alembic's version table at the revision it
matches, so ``dblock migrate`` on the same database finds it up to date.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Column, MetaData, PrimaryKeyConstraint, String, Table
from sqlalchemy.engine import Dialect
from sqlalchemy.schema import CreateTable, DropTable

from ...schema import TableNames, create_statements, drop_statements

__all__ = ["ALEMBIC_REVISION", "create_sql", "drop_sql"]

#: The alembic revision this migration's schema is (``alembic/versions``).
ALEMBIC_REVISION = "0001"


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


def drop_sql(vendor: str, names: TableNames) -> list[str]:
    dialect = _dialect(vendor)
    sql = [_compile(DropTable(_version_table(names)), dialect)]
    return sql + [_compile(s, dialect) for s in drop_statements(names, dialect.name)]
