"""Counting the statements an engine sends, with SQLAlchemy engine events."""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine


class StatementCounter:
    """Counts statements (and the most ever in flight at once) on ``engine``."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.count = 0
        self.statements: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()

    def _before(self, conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        with self._lock:
            self.count += 1
            self.statements.append(statement)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def _after(self, *args: Any) -> None:
        with self._lock:
            self.in_flight -= 1

    def reset(self) -> None:
        with self._lock:
            self.count = 0
            self.statements.clear()
            self.max_in_flight = self.in_flight

    def __enter__(self) -> StatementCounter:
        event.listen(self.engine, "before_cursor_execute", self._before)
        event.listen(self.engine, "after_cursor_execute", self._after)
        event.listen(self.engine, "handle_error", self._after)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        event.remove(self.engine, "before_cursor_execute", self._before)
        event.remove(self.engine, "after_cursor_execute", self._after)
        event.remove(self.engine, "handle_error", self._after)
