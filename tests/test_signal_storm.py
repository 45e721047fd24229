"""The signal storm (scripts/signal_storm.py), at smoke size: real
``setitimer`` SIGALRMs at random microseconds raise in the main thread
while it acquires and releases every kind of lock (issue 43).

Twice per database: with the handler raising only where the signal finds
dblock's own code running (``--land-in dblock``), and wherever it lands
(``--land-in anywhere``): inside SQLAlchemy's pool and the drivers too,
where an exception used to leave the pool's queue mutex held or its
overflow count wrong (a hang, or ``PoolExhausted``, within a few hundred
operations). dblock's executor now holds handlers back while the pool's
bookkeeping runs (dblock._signals) and lets them run in its waits.

Zero, always: no storm exception swallowed, turned into another or raised
late, no key left that this process or another can never take, no entry
left in the registry, no unexpected error, no renewal running late, no
hang, and ``close()`` within a second. Not asserted (known, left to the
lease): the row of a statement cut off inside the store's own code after
it was sent, and a read share cut off as it joined another reader's phase
(read counts carry no names), each ended by its lease.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "signal_storm.py"

# A few hundred releases (and the acquires before them), the loop capped at
# 12 s and a hang called after 8 s without progress: about half a minute
# at most, even when the run fails.
SMOKE = ["--ops", "300", "--seconds", "12", "--hang", "8", "--seed", "43"]

#: The counts that must be zero (see the script's docstring).
ZERO = (
    "swallowed",
    "wrapped",
    "stale",
    "unraisable",
    "local_left",
    "stranded_own",
    "stranded_other",
    "errors",
    "thread_errors",
    "ran_late",
)


@pytest.mark.parametrize("land_in", ["dblock", "anywhere"])
def test_signal_storm(db_url: str, tmp_path: Path, land_in: str) -> None:
    out = tmp_path / "storm.json"
    done = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--url", db_url, *SMOKE),
            *("--land-in", land_in, "--json", str(out)),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    report = done.stdout + done.stderr[-6000:]
    assert out.exists(), report
    result = json.loads(out.read_text())
    assert result["raised"] > 20, report  # the storm did land
    assert result["releases"] > 50, report
    assert not result.get("hung"), report
    assert not result.get("stopped"), report
    assert not str(result.get("pool_mutex_locked") or "").startswith("held"), report
    if land_in == "anywhere":
        # CPython itself swallows what a handler raises inside a finalizer:
        # a driver's connection (PyMySQL's __del__) that the cyclic collector
        # frees in the middle of a later statement. Nobody, dblock included,
        # can see that exception. And a driver's object the storm cut off as
        # it was built fails in its own finalizer later (PyMySQL's
        # MySQLResult.__del__: AttributeError). Both are the driver's code,
        # where a statement must stay interruptible; anything else swallowed
        # or unraisable still counts.
        in_finalizer = [
            s
            for s in result.get("swallowed_detail") or []
            if (s.get("raised_in") or [""])[0].startswith("__del__ ")
        ]
        result["swallowed"] -= len(in_finalizer)
        drivers = [
            u
            for u in result.get("unraisable_detail") or []
            if u.get("site") == "(outside dblock)" and ".__del__ " in str(u.get("object"))
        ]
        result["unraisable"] -= len(drivers)
    nonzero = {name: result.get(name) for name in ZERO if result.get(name) != 0}
    assert nonzero == {}, report
    assert result["close_s"] < 1.0, report
    # (The script's own verdict counts the rows and the pool too: see above.)
