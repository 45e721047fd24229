"""The Django side of issue 35: the migration ``0005_churn_storage`` sets the
lock table's storage parameters and takes them back, and the admin's lock
list shows the table's storage, with a warning when vacuum cannot keep up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client

import dblock.contrib.django as dj
from dblock import LockManager, migrations
from dblock.contrib.django import conf
from dblock.schema import CHURN_STORAGE

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fresh_manager() -> Iterator[None]:
    dj.reset_manager()
    yield
    dj.reset_manager()


def reloptions(manager: LockManager) -> dict[str, str]:
    with manager.engine.connect() as conn:
        found = conn.exec_driver_sql(
            f"SELECT reloptions FROM pg_class WHERE oid = to_regclass('{manager.config.table}')"
        ).scalar()
    return dict(option.split("=", 1) for option in found or [])


def test_migration_0005_sets_the_storage_parameters_and_takes_them_back() -> None:
    names = conf.table_names()
    with LockManager(conf.url_for("default"), table=names.table) as m:
        call_command("migrate", "dblock", verbosity=0)
        assert reloptions(m) == CHURN_STORAGE
        held = m.acquire("dj:churn", ttl=60)
        call_command("migrate", "dblock", "0004_exact_owner", verbosity=0)
        assert migrations.current(m.engine, names) == "0004"
        assert reloptions(m) == {}
        call_command("migrate", "dblock", verbosity=0)
        assert migrations.current(m.engine, names) == "0005"
        assert reloptions(m) == CHURN_STORAGE
        assert held.release()  # held throughout


def test_admin_lock_list_shows_the_table_storage_and_warns() -> None:
    admin_user = User.objects.create_superuser("churn", "churn@example.com", "pw")
    client = Client()
    client.force_login(admin_user)
    table = conf.table_names().table
    with LockManager(conf.url_for("default"), table=table) as m:
        with m.engine.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
        try:
            html = client.get("/admin/dblock/lock/").content.decode()
        finally:
            with m.engine.begin() as conn:
                conn.exec_driver_sql(f"ALTER TABLE {table} RESET (autovacuum_enabled)")
    assert "Lock table: " in html
    assert "MB with indexes" in html
    assert "dead rows" in html
    assert "autovacuum is off for this table" in html
