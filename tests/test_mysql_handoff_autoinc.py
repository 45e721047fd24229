"""MariaDB: the hand-off takes the table's AUTO-INC lock before it touches
the held row, as every acquisition does, so the two cannot deadlock.

The hand-off draws its fences by inserting rows that meet the held row. As
``INSERT … VALUES`` with two rows or more (the run's reserve), its first row
locked ours and its second then waited for the AUTO-INC lock, which a
waiter's acquisition (``INSERT … SELECT``: the table lock, held to its end)
had taken while it waited for our row. MariaDB 10.11 broke that deadlock
only about 2 s later, and every process of a hot key stood still meanwhile:
``benchmarks/rounds.py`` (4 processes of 8 threads on one key) saw a 2 s gap
without a grant in about one 5 s run in ten, and the server's last detected
deadlock was this pair. The order cannot be staged from outside one
statement, so this checks the statement's shape; the benchmark, 25 runs
after the change, saw no gap over 0.65 s.
"""

from __future__ import annotations

import pytest

from dblock import LockManager

pytestmark = pytest.mark.databases("mariadb")


def test_the_hand_off_is_a_bulk_insert(manager: LockManager, key: str) -> None:
    manager.acquire(key).release()  # the server's capabilities, read
    store = manager.store
    assert store.can_transfer  # type: ignore[attr-defined]
    for extra in (0, 1, 6):
        sql = store._transfer_sql(extra)  # type: ignore[attr-defined]
        insert = sql.split("ON DUPLICATE KEY UPDATE")[0]
        assert " SELECT * FROM (" in insert, sql
        assert "VALUES" not in insert, sql
        assert insert.count(" UNION ALL ") == extra, sql
