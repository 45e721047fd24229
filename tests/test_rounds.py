"""benchmarks/rounds.py, the tool that shows in which order processes get a
hot key at run ends (docs/benchmarks.md), at smoke size: real processes on
one key, every grant counted once, every process served."""

from __future__ import annotations

import pytest

from benchmarks.rounds import main, measure


@pytest.mark.databases("sqlite")
def test_rounds_counts_every_grant_and_serves_every_process(
    db_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rounds = measure(db_url, processes=2, threads=2, seconds=1.0)
    assert rounds.grants, "no grant at all"
    assert sum(n for _, n in rounds.runs) == len(rounds.grants)
    assert {p for _, p, _ in rounds.grants} == {0, 1}
    # Consecutive runs belong to different processes, by construction.
    assert all(a[0] != b[0] for a, b in zip(rounds.runs, rounds.runs[1:], strict=False))
    assert sum(rounds.gaps().values()) == len(rounds.runs) - 2
    main([db_url, "--processes", "2", "--threads", "1", "--seconds", "0.5"])
    out = capsys.readouterr().out
    assert "grants," in out
    assert "process 1:" in out
