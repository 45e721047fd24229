"""The lock table, defined once as SQLAlchemy metadata.

Everything that creates the schema (``LockManager.create_schema()``, the
alembic revision shipped in the wheel, the check against the Django migration)
builds it from :func:`create_statements`, so the three dialects and the
configurable names stay in one place.

Columns (docs/internals.md describes each): ``lock_key``, ``owner``, ``token``,
``fence``,
``acquired_at``, ``expires_at`` (indexed for the sweeper); since revision
0002 also ``slot`` (the primary key is ``(lock_key, slot)``), ``kind``,
``mode``, ``holders`` and ``permits``, so one key may have several rows
(semaphore permits, read-write and queue rows; see docs/kinds/index.md).
The exclusive lock's row is the key's head row, ``slot = ''``.

The layout of each revision is kept (``revision=``): the 0001 revision
creates the old layout and 0002 upgrades it in place
(:mod:`dblock.schema_upgrade`), so a fresh install and an upgraded one end
with the same table, columns in the same order.

The fencing number must grow for every acquisition of any key, and each
dialect has its own idiom for a counter that survives deleted rows:

* PostgreSQL: a sequence, ``nextval`` in the INSERT.
* MySQL/MariaDB: ``AUTO_INCREMENT`` on ``fence`` (persisted across restarts
  since MySQL 8.0 and MariaDB 10.2.4), read back as ``lastrowid``.
* SQLite: a one-row counter table kept current by triggers, because SQLite
  only auto-increments the rowid primary key.

Times are UTC ``timestamptz`` / ``DATETIME(6)``; on SQLite they are REAL unix
seconds so the database can compare and add to them without string formats.
"""

from __future__ import annotations

import dataclasses
import hashlib
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Float,
    Index,
    Integer,
    MetaData,
    Sequence,
    String,
    Table,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.schema import (
    CreateColumn,
    CreateIndex,
    CreateSequence,
    CreateTable,
    DropIndex,
    DropSequence,
    DropTable,
    ExecutableDDLElement,
)
from sqlalchemy.sql.expression import Executable, TextClause
from sqlalchemy.types import TypeDecorator, TypeEngine

from .config import Config

__all__ = [
    "CHURN_STORAGE",
    "HEAD_REVISION",
    "MAX_IDENTIFIER",
    "TableNames",
    "UTCDateTime",
    "create_statements",
    "derived_name",
    "drop_statements",
    "exact_owner_statements",
    "lock_table",
    "runs_table",
]

MYSQL_FAMILY = ("mysql", "mariadb")

#: The newest schema revision (``alembic/versions``).
HEAD_REVISION = "0005"
#: The revisions whose table layout :func:`lock_table` can build.
REVISIONS = ("0001", "0002", "0003", "0004", "0005")
#: The revision that added the record of job runs (:func:`runs_table`).
RUNS_REVISION = "0003"
#: The revision that gave ``owner`` the binary collation on MySQL/MariaDB
#: (:func:`exact_owner_statements`).
OWNER_REVISION = "0004"
#: The revision that set the lock table's storage parameters (:data:`CHURN_STORAGE`).
STORAGE_REVISION = "0005"

#: PostgreSQL storage parameters of the lock table, a small table with heavy
#: churn: every grant is an INSERT and every release a DELETE, so at a few
#: thousand grants a second it makes that many dead tuples a second around a
#: few hundred live rows. The default thresholds (20 % of the table plus 50
#: rows) are meant for big tables; here a vacuum is due as soon as a thousand
#: rows are dead, analyze likewise, and it runs unthrottled (a few MB take it
#: milliseconds). Measured by the soak run (benchmarks/soak.py,
#: docs/operations.md "Vacuum and bloat"). No fillfactor: ``expires_at`` is
#: indexed, so a renewal's UPDATE is never a HOT update and free room on the
#: page would only make the table bigger.
CHURN_STORAGE = {
    "autovacuum_vacuum_scale_factor": "0",
    "autovacuum_vacuum_threshold": "1000",
    "autovacuum_vacuum_insert_scale_factor": "0",
    "autovacuum_vacuum_insert_threshold": "1000",
    "autovacuum_analyze_scale_factor": "0",
    "autovacuum_analyze_threshold": "1000",
    "autovacuum_vacuum_cost_delay": "0",
}
_UTC = timezone.utc


#: The longest identifier every supported database takes (PostgreSQL: 63
#: bytes; MySQL/MariaDB: 64 characters). Derived names are kept within it.
MAX_IDENTIFIER = 63


def derived_name(table: str, suffix: str) -> str:
    """``<table><suffix>``, or, when that would exceed :data:`MAX_IDENTIFIER`,
    the table name cut short plus eight hex digits of its SHA-256 and the
    suffix: deterministic (every process and migration derives the same name)
    and distinct for distinct tables."""
    name = f"{table}{suffix}"
    if len(name) <= MAX_IDENTIFIER:
        return name
    digest = hashlib.sha256(table.encode("utf-8")).hexdigest()[:8]
    return f"{table[: MAX_IDENTIFIER - len(suffix) - 9]}_{digest}{suffix}"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TableNames:
    """The names of every schema object dblock owns, derived from the table
    name (see :func:`derived_name` for names that would be too long)."""

    table: str = "dblock_locks"
    index: str | None = None

    @classmethod
    def of(cls, config: Config) -> TableNames:
        return cls(table=config.table, index=config.index)

    @property
    def expires_index(self) -> str:
        return self.index or derived_name(self.table, "_expires_at_idx")

    @property
    def sequence(self) -> str:
        return derived_name(self.table, "_fence_seq")

    @property
    def fence_key(self) -> str:
        return derived_name(self.table, "_fence_key")

    @property
    def fence_table(self) -> str:
        return derived_name(self.table, "_fence")

    @property
    def triggers(self) -> tuple[str, str]:
        """SQLite: the triggers keeping the fence counter current (insert, update)."""
        return (
            derived_name(self.table, "_fence_on_insert"),
            derived_name(self.table, "_fence_on_update"),
        )

    @property
    def runs_table(self) -> str:
        """The record of job runs (``once(per="fire_time")``, ``dblock jobs``)."""
        return derived_name(self.table, "_runs")

    @property
    def runs_fire_key(self) -> str:
        """Unique ``(job, fire_time)``: the arbiter of one run per fire time."""
        return derived_name(self.table, "_runs_fire_key")

    @property
    def runs_started_index(self) -> str:
        """``started_at``: the sweeper prunes old runs by it."""
        return derived_name(self.table, "_runs_started_idx")

    @property
    def runs_job_index(self) -> str:
        """``(job, started_at)``: a job's latest runs (``dblock jobs``)."""
        return derived_name(self.table, "_runs_job_idx")

    @property
    def version_table(self) -> str:
        """alembic's version table for this lock table (never the app's ``alembic_version``).
        alembic names its primary key ``<version_table>_pkc``, so it stays 4 short."""
        return derived_name(self.table, "_version" + "_pkc")[: -len("_pkc")]

    @property
    def channel(self) -> str:
        """The PostgreSQL NOTIFY channel releases were announced on before
        the channels per key bucket (listened to still, for the releases of
        processes of earlier versions during a rolling upgrade)."""
        return self.table

    @property
    def channel_prefix(self) -> str:
        """The PostgreSQL NOTIFY channels releases are announced on: this
        prefix and the key's bucket number (``dblock_locks:17``), within
        PostgreSQL's 63 bytes whatever the bucket."""
        return derived_name(self.table, ":0000")[:-4]

    def all(self) -> tuple[str, ...]:
        """Every name dblock creates in the database for this table."""
        return (
            self.table,
            self.expires_index,
            self.sequence,
            self.fence_key,
            self.fence_table,
            *self.triggers,
            self.runs_table,
            self.runs_fire_key,
            self.runs_started_index,
            self.runs_job_index,
            self.version_table,
        )


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in Python; the database's native type where it has one."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def load_dialect_impl(self, dialect: Dialect) -> TypeEngine[Any]:
        if dialect.name == "sqlite":
            return dialect.type_descriptor(Float(precision=53))
        if dialect.name in MYSQL_FAMILY:
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(DateTime(timezone=True))

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("dblock times must be timezone-aware")
        if dialect.name == "sqlite":
            return value.timestamp()
        if dialect.name in MYSQL_FAMILY:
            return value.astimezone(_UTC).replace(tzinfo=None)
        return value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        return to_utc(value)


def to_utc(value: Any) -> datetime | None:
    """A time as any of our dialects return it, as an aware UTC datetime."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return datetime.fromtimestamp(value, _UTC)
    if isinstance(value, datetime):
        if value.tzinfo is None:
            return value.replace(tzinfo=_UTC)
        return value.astimezone(_UTC)
    raise TypeError(f"not a time: {value!r}")


def _exact(length: int) -> TypeEngine[str]:
    # utf8mb4_bin: keys compare exactly as they do in PostgreSQL and SQLite
    # (the server default collation would make "User:1" and "user:1" one lock).
    return String(length).with_variant(
        mysql.VARCHAR(length, charset="utf8mb4", collation="utf8mb4_bin"), *MYSQL_FAMILY
    )


def kind_columns() -> list[Column[Any]]:
    """The columns revision 0002 adds, in table order (after ``expires_at``)."""
    return [
        Column("slot", _exact(64), primary_key=True, server_default=""),
        Column("kind", String(16), nullable=False, server_default="exclusive"),
        Column("mode", String(16), nullable=False, server_default="exclusive"),
        Column("holders", Integer, nullable=False, server_default=text("1")),
        Column("permits", Integer, nullable=True),
    ]


def lock_table(
    names: TableNames, metadata: MetaData | None = None, *, revision: str = HEAD_REVISION
) -> Table:
    """The lock table for ``names``, on ``metadata`` (a fresh one by default),
    as ``revision`` lays it out."""
    if revision not in REVISIONS:
        raise ValueError(f"unknown dblock schema revision {revision!r}")
    metadata = metadata if metadata is not None else MetaData()
    key_type = _exact(255)
    extra = kind_columns() if revision >= "0002" else []
    # Before OWNER_REVISION the owner had the table's default collation: on
    # MySQL/MariaDB a case- and accent-blind one, so `dblock release --owner
    # host:1` also released the rows of HOST:1 and höst:1 (issue 32).
    owner_type = _exact(255) if revision >= OWNER_REVISION else String(255)
    return Table(
        names.table,
        metadata,
        Column("lock_key", key_type, primary_key=True),
        Column("owner", owner_type, nullable=False),
        Column("token", String(32), nullable=False),
        Column(
            "fence",
            BigInteger,
            Sequence(names.sequence, metadata=metadata),
            nullable=False,
            info={"dblock_autoincrement": True},
        ),
        Column("acquired_at", UTCDateTime(), nullable=False),
        Column("expires_at", UTCDateTime(), nullable=False),
        *extra,
        # AUTO_INCREMENT needs an index led by the column; elsewhere the
        # sequence or counter already guarantees uniqueness for free.
        UniqueConstraint("fence", name=names.fence_key).ddl_if(
            dialect=MYSQL_FAMILY  # type: ignore[arg-type]  # a tuple of names works
        ),
        Index(names.expires_index, "expires_at"),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )


#: The values of the runs table's ``outcome`` column.
RUNNING, SUCCESS, FAILED = "running", "success", "failed"


def runs_table(names: TableNames, metadata: MetaData | None = None) -> Table:
    """The record of job runs (revision 0003), one row per run of a job
    started through ``LockManager.once`` / ``run_job`` / ``dblock run``.

    ``(job, fire_time)`` is unique: for a run keyed by its scheduled fire
    time, the INSERT of its row decides whether that fire time runs (a NULL
    fire time, an unkeyed run, never collides). ``token`` is the job lock's
    token while it ran, so a reader can tell a live run from one whose runner
    died (its lock row is gone or someone else's). Times are database time,
    stored as the lock table stores them."""
    return Table(
        names.runs_table,
        metadata if metadata is not None else MetaData(),
        Column("run_id", String(32), primary_key=True),
        Column("job", _exact(255), nullable=False),
        Column("fire_time", UTCDateTime(), nullable=True),
        Column("runner", String(255), nullable=False),
        Column("token", String(32), nullable=False),
        Column("started_at", UTCDateTime(), nullable=False),
        Column("finished_at", UTCDateTime(), nullable=True),
        Column("outcome", String(16), nullable=False),
        Column("detail", String(255), nullable=True),
        Column("attempt", Integer, nullable=False, server_default=text("1")),
        Column("next_fire", UTCDateTime(), nullable=True),
        UniqueConstraint("job", "fire_time", name=names.runs_fire_key),
        Index(names.runs_started_index, "started_at"),
        Index(names.runs_job_index, "job", "started_at"),
        mysql_engine="InnoDB",
        mysql_charset="utf8mb4",
    )


def exact_owner_statements(
    names: TableNames, dialect: Dialect, *, exact: bool = True
) -> list[TextClause]:
    """DDL giving the lock table's ``owner`` column the binary collation
    (``exact``; revision 0004) or the table's default again
    (its downgrade). Only MySQL/MariaDB need it: PostgreSQL's and SQLite's
    default collations already compare exactly. The runs table's text
    columns are left: ``job`` is binary since it was made, and nothing
    filters by ``runner`` (tokens and run ids are dblock's own hex)."""
    if dialect.name not in MYSQL_FAMILY:
        return []
    table = dialect.identifier_preparer.quote(names.table)
    collation = " CHARACTER SET utf8mb4 COLLATE utf8mb4_bin" if exact else ""
    return [text(f"ALTER TABLE {table} MODIFY owner VARCHAR(255){collation} NOT NULL")]


def runs_create_statements(names: TableNames) -> list[Executable]:
    """DDL creating the runs table and its indexes (revision 0003)."""
    table = runs_table(names)
    indexes = sorted(table.indexes, key=lambda index: str(index.name))
    return [CreateTable(table), *(CreateIndex(index) for index in indexes)]


def runs_drop_statements(names: TableNames) -> list[ExecutableDDLElement]:
    table = runs_table(names)
    return [*(DropIndex(index) for index in table.indexes), DropTable(table)]


def fence_table(names: TableNames, metadata: MetaData | None = None) -> Table:
    """SQLite only: the one-row fencing counter."""
    return Table(
        names.fence_table,
        metadata if metadata is not None else MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("value", BigInteger, nullable=False),
    )


@compiles(CreateColumn, *MYSQL_FAMILY)
def _auto_increment_fence(element: CreateColumn, compiler: Any, **kw: Any) -> str:
    sql: str = compiler.visit_create_column(element, **kw)
    if element.element.info.get("dblock_autoincrement"):
        sql += " AUTO_INCREMENT"
    return sql


def create_statements(
    names: TableNames, dialect: str, *, revision: str = HEAD_REVISION
) -> list[Executable]:
    """DDL creating dblock's schema (as of ``revision``) on ``dialect`` (a
    SQLAlchemy dialect name)."""
    metadata = MetaData()
    table = lock_table(names, metadata, revision=revision)
    index = next(iter(table.indexes))
    out: list[Executable] = []
    if dialect == "postgresql":
        out.append(CreateSequence(Sequence(names.sequence)))
    out += [CreateTable(table, include_foreign_key_constraints=[]), CreateIndex(index)]
    if dialect == "sqlite":
        out += [CreateTable(fence_table(names, metadata)), *_sqlite_fence_ddl(names)]
    if dialect == "postgresql" and revision >= STORAGE_REVISION:
        out += storage_statements(names)
    if revision >= RUNS_REVISION:
        out += runs_create_statements(names)
    return out


def storage_statements(names: TableNames, dialect: str = "postgresql") -> list[Executable]:
    """PostgreSQL: set :data:`CHURN_STORAGE` on the lock table (revision 0005);
    nothing elsewhere (InnoDB purges on its own; SQLite has no vacuum daemon)."""
    if dialect != "postgresql":
        return []
    settings = ", ".join(f"{name} = {value}" for name, value in CHURN_STORAGE.items())
    return [text(f"ALTER TABLE {pg_quote(names.table)} SET ({settings})")]


def storage_reset_statements(names: TableNames, dialect: str = "postgresql") -> list[Executable]:
    """The downgrade of :func:`storage_statements`: the server's defaults again."""
    if dialect != "postgresql":
        return []
    return [text(f"ALTER TABLE {pg_quote(names.table)} RESET ({', '.join(CHURN_STORAGE)})")]


def pg_quote(name: str) -> str:
    """Quoted as SQLAlchemy quotes the names it creates (so a mixed-case table stays one)."""
    from sqlalchemy.dialects import postgresql

    preparer = postgresql.dialect().identifier_preparer  # type: ignore[no-untyped-call]
    return str(preparer.quote(name))


def drop_statements(
    names: TableNames, dialect: str, *, revision: str = HEAD_REVISION
) -> list[ExecutableDDLElement | TextClause]:
    """DDL removing what :func:`create_statements` created."""
    metadata = MetaData()
    table = lock_table(names, metadata, revision=revision)
    index = next(iter(table.indexes))
    out: list[ExecutableDDLElement | TextClause] = []
    if revision >= RUNS_REVISION:
        out += runs_drop_statements(names)
    if dialect == "sqlite":
        quote = sqlite_quote
        out += [text(f"DROP TRIGGER IF EXISTS {quote(trigger)}") for trigger in names.triggers]
        out.append(DropTable(fence_table(names, metadata)))
    out += [DropIndex(index), DropTable(table)]
    if dialect == "postgresql":
        out.append(DropSequence(Sequence(names.sequence)))
    return out


def sqlite_quote(name: str) -> str:
    """Always quoted: a table may be called ``order`` or ``select``."""
    return '"' + name.replace('"', '""') + '"'


def sqlite_triggers(names: TableNames) -> list[TextClause]:
    """SQLite: the triggers keeping the fence counter current."""
    quote = sqlite_quote
    t = quote(names.table)
    on_insert, on_update = map(quote, names.triggers)
    f = quote(names.fence_table)
    bump = f"UPDATE {f} SET value = NEW.fence WHERE id = 1 AND value < NEW.fence;"
    return [
        text(f"CREATE TRIGGER {on_insert} AFTER INSERT ON {t} BEGIN {bump} END"),
        text(f"CREATE TRIGGER {on_update} AFTER UPDATE OF fence ON {t} BEGIN {bump} END"),
    ]


def _sqlite_fence_ddl(names: TableNames) -> list[Executable]:
    quote = sqlite_quote
    t, f = quote(names.table), quote(names.fence_table)
    on_insert, on_update = map(quote, names.triggers)
    bump = f"UPDATE {f} SET value = NEW.fence WHERE id = 1 AND value < NEW.fence;"
    return [
        text(f"INSERT INTO {f} (id, value) VALUES (1, 0)"),
        text(f"CREATE TRIGGER {on_insert} AFTER INSERT ON {t} BEGIN {bump} END"),
        text(f"CREATE TRIGGER {on_update} AFTER UPDATE OF fence ON {t} BEGIN {bump} END"),
    ]


# -- the kinds of lock a row can be (its ``kind`` column; see dblock.kinds) --

EXCLUSIVE = "exclusive"
RW = "rw"
SEMAPHORE = "semaphore"
#: Every value of the ``kind`` column.
KINDS = (EXCLUSIVE, RW, SEMAPHORE)
#: The slot of a key's head row.
HEAD_SLOT = ""


def describe(kind: str, permits: int | None = None) -> str:
    """How :class:`~dblock.errors.KindMismatch` names a kind: ``semaphore(3)``, ``rw``."""
    return f"{kind}({permits})" if kind == SEMAPHORE and permits is not None else kind
