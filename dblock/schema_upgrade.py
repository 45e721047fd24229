"""Revision 0002 in place: the kind columns and the ``(lock_key, slot)`` key.

Shared by the alembic revision (``dblock migrate``, ``create_schema()``) and
the Django migration, so both change a live table the same way:

* Upgrade: the new columns get defaults that describe what every existing
  row is (``slot = ''``, ``kind = mode = 'exclusive'``, ``holders = 1``), so
  held exclusive locks stay held, with their tokens, fences and leases.
  PostgreSQL adds the columns and swaps the primary key inside the
  migration's transaction; MySQL/MariaDB does all of it in one ``ALTER
  TABLE`` (atomic there); SQLite, which cannot change a primary key, copies
  the rows into a new table in one transaction and renames it (the fence
  counter table is kept, so fences keep growing).
* Downgrade refuses (:class:`~dblock.errors.DowngradeRefused`, naming the
  keys) while *live* rows of other kinds exist: dropping them would let two
  holders of a semaphore permit or a read lock and a writer in at once with
  nothing telling them. Such rows whose lease has ended protect nothing and
  are deleted. Exclusive rows stay held across the downgrade too.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Dialect
from sqlalchemy.schema import CreateColumn, CreateIndex, CreateTable
from sqlalchemy.sql.expression import TextClause

from .errors import DowngradeRefused
from .schema import (
    MYSQL_FAMILY,
    TableNames,
    derived_name,
    lock_table,
    sqlite_quote,
    sqlite_triggers,
)

__all__ = ["downgrade_0002", "live_other_kinds_sql", "upgrade_0002"]

_OLD_COLUMNS = "lock_key, owner, token, fence, acquired_at, expires_at"
_NEW_COLUMNS = ("slot", "kind", "mode", "holders", "permits")
# Rows revision 0001 cannot represent.
_NOT_0001 = "slot <> '' OR kind <> 'exclusive' OR mode <> 'exclusive'"
_NOW = {
    "postgresql": "now()",
    "mysql": "UTC_TIMESTAMP(6)",
    "mariadb": "UTC_TIMESTAMP(6)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}


def _compile(element: Any, dialect: Dialect) -> str:
    return str(element.compile(dialect=dialect)).strip()


def _pk_name(names: TableNames, bind: Connection | None, given: str | None) -> str:
    """PostgreSQL: the primary key constraint's name; ``given``, or read from
    the catalog when connected, else PostgreSQL's own default
    (``<table>_pkey``, the table name cut to fit 63 bytes)."""
    if given:
        return given
    if bind is not None:
        name = inspect(bind).get_pk_constraint(names.table).get("name")
        if name:
            return str(name)
    raw = names.table.encode("utf-8")[: 63 - len("_pkey")]
    return raw.decode("utf-8", errors="ignore") + "_pkey"


def upgrade_0002(
    names: TableNames, dialect: Dialect, bind: Connection | None, *, pk_name: str | None = None
) -> list[TextClause]:
    """The statements bringing a 0001 lock table to 0002, keeping its rows."""
    quote = dialect.identifier_preparer.quote
    t = quote(names.table)
    head = lock_table(names, revision="0002")
    if dialect.name == "sqlite":
        return _sqlite_rebuild(names, dialect, "0002")
    adds = ", ".join(
        f"ADD COLUMN {_compile(CreateColumn(head.c[c]), dialect)}" for c in _NEW_COLUMNS
    )
    if dialect.name in MYSQL_FAMILY:
        # One statement: MySQL commits each DDL statement on its own.
        return [text(f"ALTER TABLE {t} {adds}, DROP PRIMARY KEY, ADD PRIMARY KEY (lock_key, slot)")]
    pk = quote(_pk_name(names, bind, pk_name))
    return [
        text(f"ALTER TABLE {t} {adds}"),
        text(
            f"ALTER TABLE {t} DROP CONSTRAINT {pk}, "
            f"ADD CONSTRAINT {pk} PRIMARY KEY (lock_key, slot)"
        ),
    ]


def live_other_kinds_sql(names: TableNames, dialect: Dialect) -> str:
    """The keys with live rows revision 0001 cannot store."""
    t = dialect.identifier_preparer.quote(names.table)
    return (
        f"SELECT DISTINCT lock_key FROM {t} WHERE ({_NOT_0001}) "
        f"AND expires_at > {_NOW[dialect.name]} ORDER BY lock_key"
    )


def downgrade_0002(
    names: TableNames, dialect: Dialect, bind: Connection | None, *, pk_name: str | None = None
) -> list[TextClause]:
    """The statements bringing a 0002 lock table back to 0001. Connected,
    first refuses if live rows of other kinds exist (see the module)."""
    quote = dialect.identifier_preparer.quote
    t = quote(names.table)
    if bind is not None:
        live = bind.exec_driver_sql(live_other_kinds_sql(names, dialect)).all()
        if live:
            raise DowngradeRefused(names.table, "0001", [str(r[0]) for r in live])
    # Connected: only expired ones are left. Offline (--sql): the operator
    # reviews the script; it drops every such row.
    out = [text(f"DELETE FROM {t} WHERE {_NOT_0001}")]
    if dialect.name == "sqlite":
        return out + _sqlite_rebuild(names, dialect, "0001")
    drops = ", ".join(f"DROP COLUMN {quote(c)}" for c in _NEW_COLUMNS)
    if dialect.name in MYSQL_FAMILY:
        return [
            *out,
            text(f"ALTER TABLE {t} DROP PRIMARY KEY, {drops}, ADD PRIMARY KEY (lock_key)"),
        ]
    pk = quote(_pk_name(names, bind, pk_name))
    return [
        *out,
        text(
            f"ALTER TABLE {t} DROP CONSTRAINT {pk}, {drops}, "
            f"ADD CONSTRAINT {pk} PRIMARY KEY (lock_key)"
        ),
    ]


def _sqlite_rebuild(names: TableNames, dialect: Dialect, revision: str) -> list[TextClause]:
    """SQLite cannot change a primary key: make the table anew as
    ``revision`` lays it out, copy the rows (the columns both revisions
    have; new ones take their defaults), swap the tables, and put back the
    index and the fence triggers (dropped with the old table). The fence
    counter table is untouched, so fences keep growing."""
    quote = sqlite_quote
    temporary = derived_name(names.table, "_rebuild")
    new = lock_table(TableNames(table=temporary), revision=revision)
    index = next(iter(lock_table(names, revision=revision).indexes))
    return [
        text(f"DROP TABLE IF EXISTS {quote(temporary)}"),
        text(_compile(CreateTable(new), dialect)),
        text(
            f"INSERT INTO {quote(temporary)} ({_OLD_COLUMNS}) "
            f"SELECT {_OLD_COLUMNS} FROM {quote(names.table)}"
        ),
        text(f"DROP TABLE {quote(names.table)}"),
        text(f"ALTER TABLE {quote(temporary)} RENAME TO {quote(names.table)}"),
        text(_compile(CreateIndex(index), dialect)),
        *sqlite_triggers(names),
    ]
