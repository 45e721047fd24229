"""alembic environment for dblock's lock table.

Run through ``dblock migrate`` or ``dblock.migrations``: they pass the table
names (``dblock_names``) and either a connection (online) or a URL (``--sql``).
"""

from __future__ import annotations

from alembic import context
from dblock.schema import TableNames

config = context.config
names: TableNames = config.attributes.get("dblock_names") or TableNames()


def run_offline() -> None:
    context.configure(
        url=config.attributes["offline_url"],
        literal_binds=True,
        version_table=names.version_table,
    )
    with context.begin_transaction():
        context.run_migrations(names=names)


def run_online() -> None:
    context.configure(
        connection=config.attributes["connection"],
        version_table=names.version_table,
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations(names=names)


if context.is_offline_mode():
    run_offline()
else:
    run_online()
