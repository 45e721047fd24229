"""The holder's view of its lease never outlasts the database's.

``HeldLock.remaining`` counts down to a local deadline that must not be later
than the moment the database itself considers the lease over (when another
process may take the row over). Found by the torture run on SQLite, whose
clock (``julianday('now')``) is truncated to the millisecond: the database
could start the lease up to 1 ms before the client sent the statement, so a
holder near its lease end could still believe it held a key another process
had just taken over.
"""

from __future__ import annotations

import time

from dblock import LockManager

# Two clock readings (wall and monotonic) separate the compared values.
_READING = 0.0002


def test_local_lease_deadline_is_never_after_the_databases(
    manager: LockManager, keys: object
) -> None:
    worst = float("-inf")
    for key in keys(60):  # type: ignore[operator]
        held = manager.acquire(key, ttl=30)
        local_deadline = time.time() + held.remaining
        worst = max(worst, local_deadline - held.expires_at.timestamp())
        held.release()
    assert worst <= _READING, f"the holder's deadline was {worst * 1e3:.3f} ms late"
