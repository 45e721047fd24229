"""Owners compare exactly: the ``owner`` column gets the binary collation.

On MySQL/MariaDB the column had the table's default collation
(``utf8mb4_general_ci`` on most servers), so ``dblock release --owner
deadhost:999`` also released the rows of ``DEADHOST:999:T`` and
``deadhöst:999:T``. It becomes ``utf8mb4_bin``, as the key has been from
the start; PostgreSQL and SQLite compare exactly already (nothing to do).
An ``ALTER TABLE … MODIFY`` of a column without an index: held locks stay
held. The downgrade gives the column the table's default collation again.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26
"""

from __future__ import annotations

from alembic import op
from dblock.schema import TableNames, exact_owner_statements

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade(names: TableNames = TableNames()) -> None:  # noqa: B008 - frozen value object
    for statement in exact_owner_statements(names, op.get_context().dialect):
        op.execute(statement)


def downgrade(names: TableNames = TableNames()) -> None:  # noqa: B008
    for statement in exact_owner_statements(names, op.get_context().dialect, exact=False):
        op.execute(statement)
