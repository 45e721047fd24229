"""Counting the SQL statements a manager's engine sends (SQLAlchemy events).

A listener on the engine switches dblock's executor to its observed path
(``Connection.exec_driver_sql``), which costs some client CPU per statement;
the benchmark says so where it counts with it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

__all__ = ["Counter", "count_statements"]


class Counter:
    """Statements seen since it started (or since :meth:`reset`)."""

    __slots__ = ("_lock", "count")

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def __call__(self, *_args: Any) -> None:
        with self._lock:
            self.count += 1

    def reset(self) -> None:
        with self._lock:
            self.count = 0


@contextmanager
def count_statements(engine: Engine) -> Iterator[Counter]:
    counter = Counter()
    event.listen(engine, "before_cursor_execute", counter)
    try:
        yield counter
    finally:
        event.remove(engine, "before_cursor_execute", counter)
