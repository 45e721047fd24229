"""Bring dblock's schema to alembic revision 0003: the record of job runs.

A lock table at 0002 gets the runs table (``<table>_runs``) beside it; the
lock table and its held locks are not touched. A schema made at 0003 already
(a fresh install, whose 0001 creates the newest schema) is left as it is.
Backwards, the runs table is dropped (it holds history, not held locks).
"""

from __future__ import annotations

import importlib

from django.db import migrations, models

import dblock.contrib.django.models
from dblock.contrib.django import _ddl, conf

_initial = importlib.import_module("dblock.contrib.django.migrations.0001_initial")


create_runs_table, drop_runs_table = _ddl.revision_step(
    "0002",
    "0003",
    _ddl.upgrade_0003_sql,
    _ddl.downgrade_0003_sql,
    lock_file_beside=_initial.lock_file_beside,
)


class Migration(migrations.Migration):
    dependencies = [("dblock", "0002_lock_kinds")]

    operations = [
        migrations.CreateModel(
            name="JobRun",
            fields=[
                ("run_id", models.CharField(max_length=32, primary_key=True, serialize=False)),
                ("job", models.CharField(max_length=255)),
                (
                    "fire_time",
                    dblock.contrib.django.models.LockTimeField(null=True, verbose_name="fire time"),
                ),
                ("runner", models.CharField(max_length=255)),
                ("token", models.CharField(max_length=32)),
                ("started_at", dblock.contrib.django.models.LockTimeField(verbose_name="started")),
                (
                    "finished_at",
                    dblock.contrib.django.models.LockTimeField(null=True, verbose_name="finished"),
                ),
                ("outcome", models.CharField(max_length=16)),
                ("detail", models.CharField(max_length=255, null=True)),
                ("attempt", models.IntegerField(default=1)),
                (
                    "next_fire",
                    dblock.contrib.django.models.LockTimeField(null=True, verbose_name="next fire"),
                ),
            ],
            options={
                "verbose_name": "job run",
                "db_table": conf.table_names().runs_table,
                "ordering": ("-started_at",),
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
        # Not atomic of its own: MySQL/MariaDB cannot run DDL in a transaction.
        migrations.RunPython(create_runs_table, drop_runs_table, atomic=False),
    ]
