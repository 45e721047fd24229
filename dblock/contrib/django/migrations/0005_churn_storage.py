"""Bring dblock's schema to alembic revision 0005: the lock table's storage
parameters for heavy churn (PostgreSQL; ``dblock.schema.CHURN_STORAGE``).

A lock table at 0004 gets them (``ALTER TABLE ... SET``, catalog only: held
locks stay held); elsewhere only the revision is recorded. A schema made at
0005 already (a fresh install, whose 0001 creates the newest schema) is left
as it is. Backwards, the parameters are reset to the server's defaults.
"""

from __future__ import annotations

import importlib

from django.db import migrations

from dblock.contrib.django import _ddl

_initial = importlib.import_module("dblock.contrib.django.migrations.0001_initial")


set_storage, reset_storage = _ddl.revision_step(
    "0004",
    "0005",
    _ddl.upgrade_0005_sql,
    _ddl.downgrade_0005_sql,
    lock_file_beside=_initial.lock_file_beside,
)


class Migration(migrations.Migration):
    # The owner column's exact collation (0004_exact_owner) comes first.
    dependencies = [("dblock", "0004_exact_owner")]

    operations = [
        # Not atomic of its own: MySQL/MariaDB cannot run DDL in a transaction.
        migrations.RunPython(set_storage, reset_storage, atomic=False),
    ]
