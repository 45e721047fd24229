"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from __future__ import annotations

from alembic import op

from dblock.schema import TableNames

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = ${repr(branch_labels)}
depends_on = ${repr(depends_on)}


def upgrade(names: TableNames = TableNames()) -> None:
    ${upgrades if upgrades else "pass"}


def downgrade(names: TableNames = TableNames()) -> None:
    ${downgrades if downgrades else "pass"}
