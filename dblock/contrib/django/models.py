"""An unmanaged model over dblock's lock table, for the admin page.

dblock itself never goes through this model: locks are taken and released on
dblock's own engine. The table is created by this app's migration.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import models

from ...schema import to_utc
from . import conf


class LockTimeField(models.DateTimeField):
    """A lock time as each database stores it (SQLite: REAL unix seconds;
    MySQL: naive UTC), read as an aware UTC datetime."""

    def get_internal_type(self) -> str:
        # Not "DateTimeField": the backends' converters for that type would
        # choke on SQLite's REAL seconds before from_db_value sees them.
        return "DBLockTimeField"

    def from_db_value(self, value: Any, expression: Any, connection: Any) -> datetime | None:
        return to_utc(value)

    def get_db_prep_value(self, value: Any, connection: Any, prepared: bool = False) -> Any:
        """A time to compare with (the admin's filters), in the column's own form."""
        if value is None or not isinstance(value, datetime):
            return super().get_db_prep_value(value, connection, prepared)
        aware = to_utc(value)
        assert aware is not None
        if connection.vendor == "sqlite":
            return aware.timestamp()
        if connection.vendor == "mysql":
            return aware.replace(tzinfo=None)
        return aware


class Lock(models.Model):
    # Not the table's whole primary key since revision 0002 (that is
    # ``(lock_key, slot)``): a key may have several rows (semaphore permits,
    # read-write rows); the admin reads rows by key and acts on whole keys.
    lock_key = models.CharField("key", max_length=255, primary_key=True)
    slot = models.CharField(max_length=64, default="")
    kind = models.CharField(max_length=16, default="exclusive")
    mode = models.CharField(max_length=16, default="exclusive")
    holders = models.IntegerField(default=1)
    permits = models.IntegerField(null=True)
    owner = models.CharField(max_length=255)
    token = models.CharField(max_length=32)
    fence = models.BigIntegerField()
    acquired_at = LockTimeField("acquired")
    expires_at = LockTimeField("lease ends")

    class Meta:
        managed = False
        db_table = conf.table_names().table
        ordering = ("lock_key",)
        default_permissions = ("view",)
        permissions = (("force_release_lock", "Can force-release a lock"),)
        verbose_name = "held lock"

    def __str__(self) -> str:
        return str(self.lock_key)


class JobRun(models.Model):
    """One run of a job (``LockManager.once`` / ``run_job`` / ``dblock run``),
    from the record of runs (``<table>_runs``, revision 0003). Read-only:
    dblock writes it."""

    run_id = models.CharField(max_length=32, primary_key=True)
    job = models.CharField(max_length=255)
    fire_time = LockTimeField("fire time", null=True)
    runner = models.CharField(max_length=255)
    token = models.CharField(max_length=32)
    started_at = LockTimeField("started")
    finished_at = LockTimeField("finished", null=True)
    outcome = models.CharField(max_length=16)
    detail = models.CharField(max_length=255, null=True)
    attempt = models.IntegerField(default=1)
    next_fire = LockTimeField("next fire", null=True)

    class Meta:
        managed = False
        db_table = conf.table_names().runs_table
        ordering = ("-started_at",)
        default_permissions = ("view",)
        verbose_name = "job run"

    def __str__(self) -> str:
        return f"{self.job} @ {self.fire_time or self.started_at}"
