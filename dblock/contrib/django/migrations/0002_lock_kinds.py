"""Bring dblock's lock table to alembic revision 0002 (more kinds of lock), in place.

A table made by 0001 of this app (or by ``dblock migrate`` at revision 0001)
gets the slot, kind, mode, holders and permits columns and the primary key
``(lock_key, slot)``, keeping its rows: held locks stay held. A table made at
0002 already (a fresh install, whose 0001 creates the newest schema) is left
as it is. Backwards, the table goes back to 0001, refused while live rows of
other kinds exist (see ``dblock.schema_upgrade``).
"""

from __future__ import annotations

import importlib
from typing import Any

from django.db import migrations, models

from dblock.contrib.django import _ddl, conf

_initial = importlib.import_module("dblock.contrib.django.migrations.0001_initial")


def _ours(schema_editor: Any) -> bool:
    connection = schema_editor.connection
    if connection.alias != conf.database_alias():
        return False
    names = conf.table_names()
    return names.table in connection.introspection.table_names()


def upgrade_lock_table(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.alias != conf.database_alias():
        return
    if _initial.lock_file_beside(connection):  # migrated to the newest there
        return
    names = conf.table_names()
    if not _ours(schema_editor) or _ddl.version_of(connection, names) != "0001":
        return
    for sql in _ddl.upgrade_0002_sql(connection, names):
        schema_editor.execute(sql, params=None)


def downgrade_lock_table(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    names = conf.table_names()
    if not _ours(schema_editor) or _ddl.version_of(connection, names) != "0002":
        return
    for sql in _ddl.downgrade_0002_sql(connection, names):
        schema_editor.execute(sql, params=None)


class Migration(migrations.Migration):
    dependencies = [("dblock", "0001_initial")]

    operations = [
        # The model is unmanaged: these change Django's view of the table only.
        migrations.AddField("lock", "slot", models.CharField(max_length=64, default="")),
        migrations.AddField("lock", "kind", models.CharField(max_length=16, default="exclusive")),
        migrations.AddField("lock", "mode", models.CharField(max_length=16, default="exclusive")),
        migrations.AddField("lock", "holders", models.IntegerField(default=1)),
        migrations.AddField("lock", "permits", models.IntegerField(null=True)),
        migrations.RunPython(upgrade_lock_table, downgrade_lock_table, atomic=False),
    ]
