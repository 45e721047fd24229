"""Running dblock's alembic migrations from code (and from ``dblock migrate``).

The revisions live in ``alembic/`` at the top of the source tree and ship
inside the wheel as ``dblock/_alembic``, so an installed package migrates a
database without a checkout. Each lock table keeps its own version table
(``<table>_version``), never the application's ``alembic_version``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from sqlalchemy import URL, MetaData, Table, inspect
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from .errors import BackendError
from .schema import TableNames

if TYPE_CHECKING:
    from alembic.config import Config as AlembicConfig

__all__ = ["current", "downgrade", "head", "script_location", "upgrade", "upgrade_sql"]


def script_location() -> Path:
    here = Path(__file__).resolve().parent
    for candidate in (here / "_alembic", here.parent / "alembic"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError(
        "dblock's alembic migrations are missing: expected dblock/_alembic (installed) "
        "or alembic/ next to the dblock package (source checkout)"
    )


def _config(names: TableNames, **attributes: Any) -> AlembicConfig:
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
        with engine.connect() as plain:
            yield plain.execution_options(isolation_level=plain.default_isolation_level)
    except DBAPIError as exc:
        detail = str(exc.orig or exc).strip().splitlines()[0]
        url = engine.url.render_as_string(hide_password=True)
        raise BackendError(f"migration on {url} failed: {detail}") from exc


def head() -> str:
    from alembic.script import ScriptDirectory

    script = ScriptDirectory(str(script_location()))
    rev = script.get_current_head()
    assert rev is not None
    return rev


def current(engine: Engine, names: TableNames) -> str | None:
    """The revision the database is at, or None if dblock was never migrated there."""
    from alembic.migration import MigrationContext

    with _transactional(engine) as conn:
        if not inspect(conn).has_table(names.version_table):
            return None
        ctx = MigrationContext.configure(conn, opts={"version_table": names.version_table})
        return ctx.get_current_revision()


def upgrade(engine: Engine, names: TableNames, revision: str = "head") -> None:
    from alembic import command

    try:
        with _transactional(engine) as conn:
            command.upgrade(_config(names, connection=conn), revision)
            conn.commit()
    except BackendError:
        # Another process may have migrated the same table at the same moment.
        if revision == "head" and current(engine, names) == head():
            return
        raise


def downgrade(engine: Engine, names: TableNames, revision: str = "base") -> None:
    """Downgrade to ``revision``; to ``"base"`` also drops the version table,
    so nothing of dblock is left."""
    from alembic import command

    with _transactional(engine) as conn:
        command.downgrade(_config(names, connection=conn), revision)
        if revision == "base":
            version = Table(names.version_table, MetaData())
            version.drop(conn, checkfirst=True)
        conn.commit()


def upgrade_sql(url: URL, names: TableNames, out: TextIO) -> None:
    """Write the DDL that :func:`upgrade` would run, for a DBA to review and apply."""
    from alembic import command

    cfg = _config(names, offline_url=url)
    cfg.output_buffer = out
    command.upgrade(cfg, "head", sql=True)
