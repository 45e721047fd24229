"""``dblock top``: the lock rows, refreshing in the terminal.

An operator's live view of the lock table, in the manner of ``top``: which
keys are held, by whom, for how long, how much lease is left, and which rows
expired without being released (a crashed holder the sweeper has not reached
yet). It reads through the store's admin statements (``Store.rows`` and
``Store.stats``), so every age and lease is a difference of two database
readings, never the terminal's clock.

Keys while it runs::

    a  sort by age (oldest first)      l  sort by lease left (soonest first)
    k  sort by key                     f  sort by fence (newest first)
    x  expired rows only (toggle)      /  filter by key prefix (Enter applies, Esc cancels)
    r  refresh now                     q  quit (also Ctrl-C)

A database that stops answering is shown in the header and retried at the
next refresh; the view does not exit for it. The rendering uses rich (the
``top`` extra).
"""

from __future__ import annotations

import contextlib
import enum
import os
import select
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, TextIO

from ._store.admin import LockRow, LockStats
from .errors import DBLockError
from .leader import LEADER_PREFIX, leaders_of

if TYPE_CHECKING:
    from rich.console import RenderableType

    from .manager import LockManager

__all__ = ["Sort", "TopState", "render", "run"]

#: Rows fetched per refresh; the header says when there are more.
DEFAULT_LIMIT = 200


class Sort(enum.Enum):
    """The orders ``dblock top`` can show rows in, with the key that picks each."""

    AGE = "a"
    LEASE = "l"
    KEY = "k"
    FENCE = "f"

    @property
    def label(self) -> str:
        return {"a": "age", "l": "lease left", "k": "key", "f": "fence"}[self.value]

    def apply(self, rows: list[LockRow]) -> list[LockRow]:
        if self is Sort.AGE:
            return sorted(rows, key=lambda r: (-r.age, r.key))
        if self is Sort.LEASE:
            return sorted(rows, key=lambda r: (r.lease_left, r.key))
        if self is Sort.FENCE:
            return sorted(rows, key=lambda r: -r.fence)
        return sorted(rows, key=lambda r: r.key)

    @classmethod
    def named(cls, name: str) -> Sort:
        for sort in cls:
            if name in (sort.name.lower(), sort.value, sort.label):
                return sort
        choices = ", ".join(s.name.lower() for s in cls)
        raise ValueError(f"unknown sort {name!r} (choose from {choices})")


@dataclass
class TopState:
    """What the view shows and how: changed by keys, filled by refreshes."""

    sort: Sort = Sort.AGE
    prefix: str = ""
    expired_only: bool = False
    limit: int = DEFAULT_LIMIT
    rows: list[LockRow] = field(default_factory=list)
    #: The roles led now (their lock rows, live ones: see leaders_of).
    leaders: list[LockRow] = field(default_factory=list)
    more: bool = False
    stats: LockStats | None = None
    error: str | None = None
    read_at: datetime | None = None
    # While the operator types a prefix after "/": the text so far.
    editing: str | None = None

    def handle(self, key: str) -> bool:
        """Apply one key press; False means quit."""
        if self.editing is not None:
            if key in ("\r", "\n"):
                self.prefix, self.editing = self.editing, None
            elif key == "\x1b":
                self.editing = None
            elif key in ("\x7f", "\b"):
                self.editing = self.editing[:-1]
            elif key.isprintable():
                self.editing += key
            return True
        if key in ("q", "Q", "\x03"):
            return False
        if key == "x":
            self.expired_only = not self.expired_only
        elif key == "/":
            self.editing = self.prefix
        else:
            with contextlib.suppress(ValueError):
                self.sort = Sort.named(key)
        return True

    def refresh(self, manager: LockManager, *, raising: bool = False) -> None:
        """Read the rows again; a database error is kept for the header (or,
        ``raising``, raised: there is no next refresh to retry)."""
        try:
            rows = manager.store.rows(prefix=self.prefix or None, limit=self.limit + 1)
            self.stats = manager.store.stats()
            self.leaders = leaders_of(manager.store.rows(prefix=LEADER_PREFIX, limit=LEADERS))
        except DBLockError as exc:
            if raising:
                raise
            self.error = str(exc)
            return
        self.error = None
        self.more = len(rows) > self.limit
        self.rows = rows[: self.limit]
        self.read_at = rows[0].now if rows else datetime.now(timezone.utc)

    def shown(self) -> list[LockRow]:
        rows = [r for r in self.rows if r.expired] if self.expired_only else self.rows
        return self.sort.apply(rows)


#: How many roles' leaders the header names at most.
LEADERS = 20


def _span(seconds: float) -> str:
    seconds = abs(seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    if seconds < 86400:
        return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
    return f"{int(seconds // 86400)}d{int(seconds % 86400 // 3600):02d}h"


def render(
    state: TopState, where: str, *, legend: bool = True, fit: bool = False
) -> RenderableType:
    """The whole screen for ``state``: a header, the table of rows and
    (``legend``) the keys. ``fit``: each column as wide as its widest cell
    (a frame printed in a pipe), not the terminal's width shared out."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    header = Text()
    header.append("dblock top", style="bold")
    header.append(f"  {where}")
    if state.read_at is not None:
        header.append(f"  at {state.read_at:%H:%M:%S} (database time)")
    status = Text()
    if state.stats is not None:
        stats = state.stats
        status.append(f"{stats.rows} row{'' if stats.rows == 1 else 's'}, {stats.live} live, ")
        status.append(f"{stats.expired} expired", style="bold red" if stats.expired else "")
    shown = state.shown()
    status.append(f"  |  showing {len(shown)}")
    if state.more:
        status.append(f" (first {state.limit} by age)")
    status.append(f"  |  sort: {state.sort.label}")
    if state.prefix:
        status.append(f"  |  prefix: {state.prefix!r}")
    if state.expired_only:
        status.append("  |  expired only", style="bold red")
    lines: list[RenderableType] = [header, status]
    if state.error is not None:
        lines.append(Text(f"database error (retrying): {state.error}", style="bold red"))
    if state.editing is not None:
        lines.append(Text(f"prefix: {state.editing}_  (Enter applies, Esc cancels)"))
    if state.leaders:
        lines.append(_leaders_line(state.leaders))

    table = Table(expand=not fit, show_edge=False, pad_edge=False)
    # KIND is never cut (a label of a few words: its own width); KEY and
    # OWNER share the rest and fold rather than hide anything: an operator
    # reads the owner to find the process (a frame printed in a pipe is as
    # wide as it needs: see run()). A short key is not folded at all.
    longest = max((len(row.key) for row in shown), default=0)
    table.add_column(
        "KEY", overflow="fold", ratio=None if fit else 2, min_width=min(longest, 24) or None
    )
    table.add_column("KIND", no_wrap=True)
    table.add_column("OWNER", overflow="fold", ratio=None if fit else 1)
    table.add_column("AGE", justify="right", no_wrap=True)
    table.add_column("LEASE", justify="right", no_wrap=True)
    table.add_column("FENCE", justify="right", no_wrap=True)
    leading = {(row.key, row.token) for row in state.leaders}
    for row in shown:
        if row.expired:
            lease = Text(f"EXPIRED {_span(row.lease_left)} ago", style="bold red")
        else:
            lease = Text(_span(row.lease_left))
        kind = "leader" if (row.key, row.token) in leading else row.kind_label
        table.add_row(row.key, kind, row.owner, _span(row.age), lease, str(row.fence))
    lines.append(table)
    if legend:
        lines.append(
            Text(
                "a age  l lease  k key  f fence  x expired only  / prefix  r refresh  q quit",
                style="dim",
            )
        )
    return Group(*lines)


def _leaders_line(leaders: list[LockRow]) -> RenderableType:
    """Who leads each role: ``leaders: 'relay' host:pid:thread (term 41, 3m02s)``."""
    from rich.text import Text

    line = Text("leaders: ", style="bold")
    for i, row in enumerate(leaders):
        line.append(("  " if i else "") + f"{row.key[len(LEADER_PREFIX) :]!r} ")
        line.append(f"{row.owner} (term {row.fence}, {_span(row.age)})")
    return line


@contextlib.contextmanager
def _keys(stream: TextIO) -> Iterator[Callable[[float], str | None]]:
    """Key presses from a terminal, one at a time, without echo or Enter.

    Yields ``next_key(timeout)``, which returns a key or ``None`` when none
    came within ``timeout`` seconds. Off a terminal (a pipe), no keys come.
    """
    if not stream.isatty():

        def nothing(timeout: float) -> str | None:
            time.sleep(timeout)
            return None

        yield nothing
        return

    import termios
    import tty

    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)

    def next_key(timeout: float) -> str | None:
        ready, _, _ = select.select([fd], [], [], max(timeout, 0.0))
        if not ready:
            return None
        data = os.read(fd, 1)
        return data.decode("utf-8", "replace") if data else "q"

    try:
        yield next_key
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run(
    manager: LockManager,
    *,
    state: TopState,
    interval: float,
    once: bool = False,
    stream: TextIO | None = None,
) -> int:
    """Show the view until ``q`` (or Ctrl-C); ``once`` prints one frame and returns."""
    from rich.console import Console
    from rich.live import Live

    where = f"{manager.config.table} on {manager.url}"
    console = Console()
    if once:
        # For scripts: one frame, no keys to press; a database error is the
        # command's one error line (exit 1), not a frame saying "retrying".
        state.refresh(manager, raising=True)
        frame = render(state, where, legend=False)
        if not console.is_terminal and not os.environ.get("COLUMNS"):
            # In a pipe rich would assume 80 columns and fold the keys and
            # owners a script reads: the frame gets the width it needs.
            from rich.measure import Measurement

            frame = render(state, where, legend=False, fit=True)
            needed = Measurement.get(console, console.options.update_width(10**6), frame)
            console = Console(width=max(needed.maximum, 80))
        console.print(frame)
        return 0
    state.refresh(manager)
    keys_in = stream if stream is not None else sys.stdin
    with (
        _keys(keys_in) as next_key,
        Live(render(state, where), console=console, screen=True, auto_refresh=False) as live,
    ):
        due = time.monotonic() + interval
        while True:
            key = next_key(due - time.monotonic())
            if key is not None:
                if not state.handle(key):
                    return 0
                if key == "r" or (state.editing is None and key in "\r\n"):
                    due = 0.0
            if time.monotonic() >= due:
                state.refresh(manager)
                due = time.monotonic() + interval
            live.update(render(state, where), refresh=True)
