"""Create dblock's lock table: the schema of alembic revision 0001.

The SQL is compiled from ``dblock.schema`` for this connection's database
and runs on Django's connection, in this migration's transaction where the
database has transactional DDL. A table already created by ``dblock
migrate`` is left as it is. Only the database named by ``DBLOCK["DATABASE"]``
(default ``"default"``) gets the table.
"""

from __future__ import annotations

from typing import Any

from django.db import migrations, models

import dblock.contrib.django.models
from dblock import LockManager
from dblock.contrib._beside import beside
from dblock.contrib.django import _ddl, conf


def create_lock_table(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.alias != conf.database_alias():
        return
    if lock_file_beside(connection):
        return
    names = conf.table_names()
    if names.table in connection.introspection.table_names():
        return
    for sql in _ddl.create_sql(connection.vendor, names):
        schema_editor.execute(sql, params=None)


def lock_file_beside(connection: Any) -> bool:
    """A SQLite app database keeps dblock's rows in a file beside it (see
    dblock.contrib._beside): the table goes there, by dblock's own migrations."""
    settings = conf.read()
    if connection.vendor != "sqlite" or settings.url is not None:
        return False
    url = conf.url_for(connection.alias)
    lock_url = beside(url)
    if lock_url == url:
        return False
    with LockManager(lock_url, config=settings.config) as manager:
        manager.create_schema()
    return True


def drop_lock_table(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.alias != conf.database_alias():
        return
    names = conf.table_names()
    if names.table not in connection.introspection.table_names():
        return
    revision = _ddl.version_of(connection, names) or _ddl.ALEMBIC_REVISION
    for sql in _ddl.drop_sql(connection.vendor, names, revision):
        schema_editor.execute(sql, params=None)


class Migration(migrations.Migration):
    initial = True
    dependencies: list[tuple[str, str]] = []

    operations = [
        migrations.CreateModel(
            name="Lock",
            fields=[
                (
                    "lock_key",
                    models.CharField(
                        max_length=255, primary_key=True, serialize=False, verbose_name="key"
                    ),
                ),
                ("owner", models.CharField(max_length=255)),
                ("token", models.CharField(max_length=32)),
                ("fence", models.BigIntegerField()),
                (
                    "acquired_at",
                    dblock.contrib.django.models.LockTimeField(verbose_name="acquired"),
                ),
                (
                    "expires_at",
                    dblock.contrib.django.models.LockTimeField(verbose_name="lease ends"),
                ),
            ],
            options={
                "verbose_name": "held lock",
                "db_table": conf.table_names().table,
                "ordering": ("lock_key",),
                "permissions": (("force_release_lock", "Can force-release a lock"),),
                "managed": False,
                "default_permissions": ("view",),
            },
        ),
        # Not atomic of its own: MySQL/MariaDB cannot run DDL in a transaction
        # (where DDL is transactional the migration's transaction covers it).
        migrations.RunPython(create_lock_table, drop_lock_table, atomic=False),
    ]
