"""Running dblock's alembic migrations from code (and from ``dblock migrate``).

The revisions live in ``alembic/`` at the top of the source tree and ship
inside the wheel as ``dblock/_alembic``, so an installed package migrates a
database without a checkout. Each lock table keeps its own version table
(``<table>_version``), never the application's ``alembic_version``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from sqlalchemy import URL, MetaData, Table, event, inspect
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.schema import CreateTable

from ._engine import mask, sqlite_whole_wait
from .errors import BackendError
from .schema import TableNames

if TYPE_CHECKING:
    from alembic.config import Config as AlembicConfig

__all__ = ["current", "downgrade", "head", "script_location", "upgrade", "upgrade_sql"]

log = logging.getLogger("dblock")


def script_location() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "_alembic", here.parent / "alembic"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError(
        "dblock's alembic migrations are missing: expected dblock/_alembic (installed) "
        "or alembic/ next to the dblock package (source checkout)"
    )


def alembic_config(names: TableNames, **attributes: Any) -> AlembicConfig:
    from alembic.config import Config as AlembicConfig

    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(script_location()))
    cfg.attributes["dblock_names"] = names
    cfg.attributes.update(attributes)
    return cfg


@contextlib.contextmanager
def _transactional(engine: Engine) -> Iterator[Connection]:
    """A connection with the driver's default isolation (DDL in a transaction
    where the database has transactional DDL), even on dblock's AUTOCOMMIT engine."""
    try:
        with engine.connect() as plain, sqlite_whole_wait(plain):
            yield plain.execution_options(isolation_level=plain.default_isolation_level)
    except SQLAlchemyError as exc:
        raise _failed(engine, exc) from exc


def _failed(engine: Engine, exc: SQLAlchemyError) -> BackendError:
    cause = exc.orig if isinstance(exc, DBAPIError) else exc
    detail = str(cause or exc).strip().splitlines()[0]
    return BackendError(f"migration on {mask(engine.url)} failed: {detail}")


def head() -> str:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(script_location()))
    rev = script.get_current_head()
    assert rev is not None
    return rev


def known_revision(revision: str) -> bool:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(script_location()))
    try:
        return script.get_revision(revision) is not None
    except Exception:  # alembic's ResolutionError / CommandError: not one of ours
        return False


def current(engine: Engine, names: TableNames) -> str | None:
    """The revision the database is at, or None if dblock was never migrated there."""
    from alembic.migration import MigrationContext

    with _transactional(engine) as conn:
        if not inspect(conn).has_table(names.version_table):
            return None
        ctx = MigrationContext.configure(conn, opts={"version_table": names.version_table})
        return ctx.get_current_revision()


def upgrade(engine: Engine, names: TableNames, revision: str = "head") -> None:
    """Migrate to ``revision``. If it fails, nothing it made is left behind:
    PostgreSQL rolls the DDL back; MySQL/MariaDB (whose DDL commits at once)
    and SQLite (whose driver commits some of it) get the tables this run
    created dropped again."""
    from alembic import command

    if revision == "head":
        at = current(engine, names)
        if at is not None and not known_revision(at):
            # A newer dblock migrated this table (a rolling deploy, where old
            # and new processes run side by side): its revisions only add, so
            # this version works on it as it is. Never fail the start-up.
            log.warning(
                "dblock: the lock table %r is at schema revision %s, newer than this "
                "dblock knows (head %s); leaving it as it is",
                names.table,
                at,
                head(),
            )
            return
    created: list[str] = []
    try:
        with _transactional(engine) as conn:
            event.listen(conn, "after_execute", _record_created(created))
            command.upgrade(alembic_config(names, connection=conn), revision)
            conn.commit()
    except BaseException as exc:
        if created and engine.dialect.name != "postgresql":
            _drop_tables(engine, created)
        # Another process may have migrated the same table at the same moment.
        concurrent = isinstance(exc, BackendError) and revision == "head"
        if concurrent and current(engine, names) == head():
            return
        raise


def _record_created(created: list[str]) -> Callable[..., None]:
    """An ``after_execute`` listener noting every table a statement created."""

    def record(_conn: Connection, statement: object, *_args: Any) -> None:
        if isinstance(statement, CreateTable):
            created.append(statement.element.name)

    return record


def _drop_tables(engine: Engine, tables: list[str]) -> None:
    """Undo a failed migration: drop ``tables`` (newest first) with their
    indexes and triggers. Never raises: the migration's own error matters."""
    quote = engine.dialect.identifier_preparer.quote
    try:
        with engine.connect() as conn, sqlite_whole_wait(conn):
            auto = conn.execution_options(isolation_level="AUTOCOMMIT")
            for table in reversed(tables):
                auto.exec_driver_sql(f"DROP TABLE IF EXISTS {quote(table)}")
    except SQLAlchemyError as exc:
        log.error(
            "dblock: a failed migration left %s behind and dropping it failed too: %s",
            ", ".join(tables),
            exc,
        )


def downgrade(engine: Engine, names: TableNames, revision: str = "base") -> None:
    """Downgrade to ``revision``; to ``"base"`` also drops the version table,
    so nothing of dblock is left."""
    from alembic import command

    with _transactional(engine) as conn:
        command.downgrade(alembic_config(names, connection=conn), revision)
        if revision == "base":
            version = Table(names.version_table, MetaData())
            version.drop(conn, checkfirst=True)
        conn.commit()


def upgrade_sql(url: URL, names: TableNames, out: TextIO) -> None:
    """Write the DDL that :func:`upgrade` would run, for a DBA to review and apply."""
    from alembic import command

    cfg = alembic_config(names, offline_url=url)
    cfg.output_buffer = out
    command.upgrade(cfg, "head", sql=True)
