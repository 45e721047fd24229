"""More kinds of lock: the slot, kind, mode, holders and permits columns.

The primary key becomes ``(lock_key, slot)`` so a key may have several rows
(semaphore permits, read-write and queue rows). Applied in place: held
exclusive locks stay held (see ``dblock.schema_upgrade``). The downgrade
refuses while live rows of other kinds exist, naming their keys.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

from alembic import op
from dblock.schema import TableNames
from dblock.schema_upgrade import downgrade_0002, upgrade_0002

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _bind():  # type: ignore[no-untyped-def]
    return None if op.get_context().as_sql else op.get_bind()


def upgrade(names: TableNames = TableNames()) -> None:  # noqa: B008 - frozen value object
    dialect = op.get_context().dialect
    for statement in upgrade_0002(names, dialect, _bind()):
        op.execute(statement)


def downgrade(names: TableNames = TableNames()) -> None:  # noqa: B008
    dialect = op.get_context().dialect
    for statement in downgrade_0002(names, dialect, _bind()):
        op.execute(statement)
