"""Bring dblock's schema to alembic revision 0004: owners compare exactly.

On MySQL/MariaDB the lock table's ``owner`` column gets the binary
collation (``utf8mb4_bin``, as ``lock_key`` has), so a release by owner
(``manage.py dblock_release --owner``, the admin's release report) matches
that owner only, not its other spellings in case or accents. On PostgreSQL
and SQLite only the recorded revision changes. A schema made at this
revision already (a fresh install, whose 0001 creates the newest schema) is
left as it is. Backwards, the column gets the table's default collation again.
"""

from __future__ import annotations

import importlib

from django.db import migrations

from dblock.contrib.django import _ddl

_initial = importlib.import_module("dblock.contrib.django.migrations.0001_initial")


exact_owner, default_owner_collation = _ddl.revision_step(
    "0003",
    "0004",
    _ddl.upgrade_0004_sql,
    _ddl.downgrade_0004_sql,
    lock_file_beside=_initial.lock_file_beside,
)


class Migration(migrations.Migration):
    dependencies = [("dblock", "0003_job_runs")]

    operations = [
        # Not atomic of its own: MySQL/MariaDB cannot run DDL in a transaction.
        migrations.RunPython(exact_owner, default_owner_collation, atomic=False),
    ]
