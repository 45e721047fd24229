"""Storage parameters for a small table with heavy churn (PostgreSQL).

Every grant is an INSERT and every release a DELETE, so a busy service makes
thousands of dead rows a second around a few hundred live ones; the default
autovacuum thresholds (20 % of the table) are meant for big tables. This sets
``dblock.schema.CHURN_STORAGE`` on the lock table (vacuum and analyze after
1000 changed rows, unthrottled), chosen by the soak run (benchmarks/soak.py,
docs/operations.md "Vacuum and bloat"). ``ALTER TABLE ... SET`` changes only
the catalog: held locks stay held, nothing is rewritten. MariaDB/MySQL and
SQLite have no such parameters: only the revision is recorded there.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26
"""

from __future__ import annotations

from alembic import op
from dblock.schema import TableNames, storage_reset_statements, storage_statements

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade(names: TableNames = TableNames()) -> None:  # noqa: B008 - frozen value object
    for statement in storage_statements(names, op.get_context().dialect.name):
        op.execute(statement)


def downgrade(names: TableNames = TableNames()) -> None:  # noqa: B008
    for statement in storage_reset_statements(names, op.get_context().dialect.name):
        op.execute(statement)
