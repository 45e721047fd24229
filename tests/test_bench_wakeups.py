"""benchmarks/wakeups.py, the measure of how soon a waiter of another
process gets a key after its release with many keys awaited (MariaDB's
named-lock wake-ups), at smoke size: every waiter served, every delay
counted, and, on MariaDB, keys beyond the waker's probe slots woken as soon
as the others (they were polled with the polling backoff before)."""

from __future__ import annotations

import pytest

from benchmarks.wakeups import main, measure
from dblock._store.wake import NamedLockWaker


@pytest.mark.databases("mariadb", "sqlite")
def test_every_waiter_is_served_soon_after_its_release(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = NamedLockWaker.SLOTS + 12
    got = measure(db_url, keys=keys, gap=0.02, idle=0.5, settle=1.5, timeout=60)
    assert got.missing == 0
    assert len(got.delays) == keys
    assert got.waiter_statements >= 0
    if db_url.startswith("mysql"):
        assert got.server_questions is not None
        # Polling's step for the keys beyond the slots grows to poll_max
        # (0.5 s); a look comes every 40 ms. Only a gross regression is
        # caught here (a loaded CI machine saw 0.30 s): the figure itself
        # is the benchmark's (docs/benchmarks.md).
        assert got.quantile(0.5) < 0.5, sorted(got.delays)
    main([db_url, "--keys", "3", "--gap", "0.01", "--idle", "0.2", "--settle", "0.5"])
    out = capsys.readouterr().out
    assert "grant after release p50" in out
    assert "statements/s" in out


def test_the_recheck_interval_grows_with_the_waiters_of_a_process() -> None:
    from dblock._store.base import RECHECKS_PER_SECOND, recheck_every

    assert recheck_every(2.0, 1) == 2.0
    assert recheck_every(2.0, int(2 * RECHECKS_PER_SECOND)) == 2.0
    assert recheck_every(2.0, 1000) == 1000 / RECHECKS_PER_SECOND


@pytest.mark.databases("mariadb", "postgresql")
def test_many_keys_awaited_send_few_statements_while_they_wait(db_url: str) -> None:
    """600 keys awaited from one process: the re-checks that insure against
    a lost wake-up come at most 100 a second between them (they were 300 a
    second here, one per waiter every 2 s). The figure is the benchmark's
    (``python -m benchmarks.wakeups URL --keys 1000``: about 100 a second on
    a quiet machine, 835 before). Beside the suite's other workers MariaDB's
    count reads 490-530 a second (three fresh-clone runs; alone, with CPU
    burners beside it, it passes the benchmark's bound): not explained yet,
    so here the bound is one per waiter per second: it catches a gross
    regression only, and the benchmark is where the figure is judged."""
    keys = 600
    got = measure(db_url, keys=keys, gap=0.002, idle=2.0, settle=3.0, timeout=90)
    assert got.missing == 0
    assert got.waiter_statements < 1.0 * keys, got.waiter_statements
