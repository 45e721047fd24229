"""Rows of owners that differ only in case, accents or a trailing space
(issue 32, defect 3): a release by owner must take the exact owner's only."""

from __future__ import annotations

import uuid

from dblock import LockManager
from dblock._store.base import Grant

#: Owners that differ from ``deadhost:999`` (and its threads) only in case,
#: accents or a trailing space, each with the key it holds.
OTHERS = {
    "DEADHOST:999:T": "upper",
    "deadhöst:999:T": "accent",
    "deadhost:999 ": "space",
    "Deadhost:999": "title",
    "deadhost:9990:T": "longer-pid",
}
#: The owner itself and one of its threads: what the release takes.
EXACT = {"deadhost:999": "exact", "deadhost:999:T": "thread"}


def hold_rows(manager: LockManager, tag: str) -> None:
    """A row for each owner of :data:`OTHERS` and :data:`EXACT`, written as
    the owner's own acquire writes it."""
    for owner, name in {**OTHERS, **EXACT}.items():
        got = manager.store.try_acquire(f"{tag}:{name}", uuid.uuid4().hex, owner, 300.0)
        assert isinstance(got, Grant), got


def held_keys(manager: LockManager, tag: str) -> set[str]:
    return {row.key.split(":", 1)[1] for row in manager.store.rows(prefix=f"{tag}:")}
