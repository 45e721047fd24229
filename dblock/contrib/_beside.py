"""SQLite beside the app: dblock's rows in a file of their own next to the
app's SQLite database.

SQLite lets one transaction write at a time. A lock row written into the
app's own file while the app has a write transaction open (Django's
``ATOMIC_REQUESTS``, a Flask-SQLAlchemy session that wrote before the locked
call) waits for that transaction, which waits for the lock: a stall until the
busy timeout, then ``database is locked``. So when the app's database is a
SQLite file, the integrations keep dblock's rows in ``<name>.dblock<suffix>``
in the same directory (``db.sqlite3`` -> ``db.dblock.sqlite3``), and say so
in one INFO line at start-up.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import URL

from .._engine import file_database

__all__ = ["beside"]

log = logging.getLogger("dblock")

_told: set[str] = set()  # lock files already announced in this process


def beside(url: URL) -> URL:
    """The URL dblock uses for an app whose database is ``url``: unchanged
    unless it is a SQLite file, else the lock file next to it."""
    if not file_database(url):
        return url
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:") or "mode=memory" in str(url):
        return url  # not a plain file: dblock refuses in-memory databases itself
    app_file = Path(database)
    lock_file = app_file.with_name(f"{app_file.stem}.dblock{app_file.suffix}")
    if str(lock_file) in _told:
        return URL.create("sqlite", database=str(lock_file))
    _told.add(str(lock_file))
    log.info(
        "dblock: the app's database is the SQLite file %s; dblock keeps its locks in %s "
        "beside it (SQLite has one writer: a lock row in the app's file would wait for "
        "the app's open transaction)",
        app_file,
        lock_file,
    )
    return URL.create("sqlite", database=str(lock_file))
