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

from django.db import migrations, models

from dblock.contrib.django import _ddl

_initial = importlib.import_module("dblock.contrib.django.migrations.0001_initial")


upgrade_lock_table, downgrade_lock_table = _ddl.revision_step(
    "0001",
    "0002",
    _ddl.upgrade_0002_sql,
    _ddl.downgrade_0002_sql,
    lock_file_beside=_initial.lock_file_beside,
)


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
