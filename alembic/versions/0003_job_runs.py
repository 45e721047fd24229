"""The record of job runs: ``<table>_runs`` (``once(per="fire_time")``, ``dblock jobs``).

A new table beside the lock table, with its unique ``(job, fire_time)`` key
and ``started_at`` index; the lock table is not touched, so a live database
upgrades with every held lock kept. The downgrade drops the record (runs
are history, not held state).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25
"""

from __future__ import annotations

from alembic import op
from dblock.schema import TableNames, runs_create_statements, runs_drop_statements

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade(names: TableNames = TableNames()) -> None:  # noqa: B008 - frozen value object
    for statement in runs_create_statements(names):
        op.execute(statement)


def downgrade(names: TableNames = TableNames()) -> None:  # noqa: B008
    for statement in runs_drop_statements(names):
        op.execute(statement)
