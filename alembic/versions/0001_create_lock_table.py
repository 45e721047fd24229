"""Create the lock table.

Built from the one SQLAlchemy definition in ``dblock.schema`` with the
configured names: the table, its ``expires_at`` index and the dialect's
fencing counter (PostgreSQL sequence, MySQL AUTO_INCREMENT key, SQLite
counter table and triggers).

Revision ID: 0001
Revises:
Create Date: 2026-11-21
"""

from __future__ import annotations

from alembic import op
from dblock.schema import TableNames, create_statements, drop_statements

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade(names: TableNames = TableNames()) -> None:  # noqa: B008 - frozen value object
    for statement in create_statements(names, op.get_context().dialect.name, revision="0001"):
        op.execute(statement)


def downgrade(names: TableNames = TableNames()) -> None:  # noqa: B008
    for statement in drop_statements(names, op.get_context().dialect.name, revision="0001"):
        op.execute(statement)
