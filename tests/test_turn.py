"""Another process gets its turn on a key local threads keep handing on.

Eleven threads of this process take one key again and again, so each
release hands it to the next of them; a second process (spawned, a real
one) waits for the same key. After ``handoff_limit`` local grants in a row
(the row's own and its hand-offs) the row is deleted and the next local
thread gives way for a few round trips:
the other process, woken by the release, takes the row first. Without that
pause the local thread, one mutex away, won the race again in most runs and
the other process waited through run after run.
"""

from __future__ import annotations

import pytest

from benchmarks.turn import measure

LIMIT = 8


# Not MariaDB, where the give-way is measured by the benchmark only
# (benchmarks/turn.py): it has no hand-off (each local grant is its own
# INSERT and DELETE), a run of handoff_limit local grants ends with the same
# give-way when the release's named lock showed another process waiting
# (Store.others_wait, tested in test_wake.py), and the other process's
# wake-up takes three of its threads (the probe's, the waiter's, the
# statement's): 99 of 100 within 8 local grants on a quiet machine (95
# before, the worst 358), but 3 of 10 late (11 to 66 grants) beside the
# suite's other workers.
@pytest.mark.databases("sqlite", "postgresql")
def test_another_process_gets_the_key_within_one_run(db_url: str) -> None:
    counts = measure(db_url, runs=10, threads=11, handoff_limit=LIMIT)
    if not _within(counts):
        # Measured once more before failing: beside three workers, a fresh
        # clone's run once saw one remote wake-up 24 grants late on
        # PostgreSQL (the other nine at 0). Without the give-way pause a
        # third of the runs miss by 20 to 100 grants, in both measurements.
        first = counts
        counts = measure(db_url, runs=10, threads=11, handoff_limit=LIMIT)
        assert _within(counts), (first, counts)


def _within(counts: list[int]) -> bool:
    # A run is LIMIT local grants (the row's own acquisition and its
    # hand-offs): a request waits at most the run under way as it asked,
    # counting a grant on its way then. The target is 99 runs in 100 within
    # LIMIT (benchmarks/turn.py measures it). Here, on a machine the other
    # test workers load, a remote wake-up can take longer than the pause now
    # and then (seen on MariaDB, once in 30 runs; on PostgreSQL beside three
    # other workers, 2 runs of 10 at 15 and 16 grants): two grants of slack,
    # at most two runs in ten late, and none by more than one more run.
    # Without the give-way pause about a third of the runs miss, by 20 to
    # 100 grants: caught by the last rule in 98 tests of 100.
    late = [c for c in counts if c > LIMIT + 2]
    return len(late) <= 2 and max(counts) <= 2 * LIMIT + 2
