"""Leadership failover: how soon a standby leads after the leader dies or steps down.

    .venv/bin/python -m benchmarks.leadership URL [URL ...] [--trials 20] [--ttl 2]

Two candidate processes (``LockManager.leader(role).campaign()``) stand for
one role on the database at each URL. A trial ends the leader's tenure one of
two ways and times, on the system-wide monotonic clock both processes share,
how long the role had nobody:

* **kill -9** of the leader's process: from the kill to the standby's
  ``on_elected``. Nobody releases the row: the standby must see its lease run
  out, so the figure is the lease's remainder plus how late the standby looks
  (the target: within the lease + 1 s);
* **step-down**: the leader's ``stop()`` (the row released at once): from the
  call to the standby's ``on_elected``; the standby is woken, not polling.

After each trial a fresh candidate takes the place of the one that left and
stands by before the next trial begins. Alongside, the **idle cost**: the
statements each candidate sent over two leases while one led and the other
stood by (counted on its engine; a waiter blocked in a wake-up statement
counts once).

Run from the repository root. Touches only its own table
(``dblock_bench_leader``), created and dropped here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import IO

from .stats import percentile

__all__ = ["FailoverResult", "main", "run_failover"]

TABLE = "dblock_bench_leader"
ROLE = "bench-relay"


@dataclass
class FailoverResult:
    database: str
    ttl: float
    kills: list[float]  # seconds from kill -9 to the standby's election
    step_downs: list[float]  # seconds from stop() to the standby's election
    leader_statements_per_lease: float
    standby_statements_per_lease: float
    fences_grew: bool

    def row(self) -> str:
        k, s = self.kills, self.step_downs
        return (
            f"| {self.database} | {self.ttl:g} s | {len(k)} | {percentile(k, 50):.2f} s "
            f"| {percentile(k, 99):.2f} s (lease + {percentile(k, 99) - self.ttl:.2f} s) "
            f"| {len(s)} | {percentile(s, 50) * 1e3:.1f} ms | {percentile(s, 99) * 1e3:.1f} ms "
            f"| {self.leader_statements_per_lease:.1f} | {self.standby_statements_per_lease:.1f} |"
        )


HEAD = (
    "| database | lease | kill -9 trials | to a new leader p50 | p99 | step-down trials "
    "| p50 | p99 | leader's statements per lease | standby's statements per lease |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


# -- a candidate process ---------------------------------------------------------------


def candidate(url: str, ttl: float) -> None:
    """Stand for ROLE; say ``elected FENCE T`` when elected; on stdin's
    ``down`` step down and say ``down T`` (T taken just before ``stop()``);
    on ``count`` say how many statements this process has sent."""
    import sqlalchemy as sa

    from dblock import LockManager

    manager = LockManager(url, table=TABLE, client_id=f"bench-leader-{os.getpid()}")
    sent = [0]
    sa.event.listen(manager.engine, "before_cursor_execute", lambda *_: _bump(sent))
    out = threading.Lock()

    def say(line: str) -> None:
        with out:
            print(line, flush=True)

    leader = manager.leader(
        ROLE, ttl=ttl, on_elected=lambda term: say(f"elected {term.fence} {time.monotonic()!r}")
    )
    leader.campaign()
    say("standing")
    for line in sys.stdin:
        command = line.strip()
        if command == "count":
            say(f"count {sent[0]}")
        elif command == "down":
            t = time.monotonic()
            leader.stop()
            say(f"down {t!r}")
            break
    manager.close()


def _bump(counter: list[int]) -> None:
    counter[0] += 1


# -- the parent ------------------------------------------------------------------------


class Candidate:
    def __init__(self, url: str, ttl: float, lines: queue.Queue[tuple[Candidate, str]]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.leadership", "--candidate", url, "--ttl", str(ttl)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        self.lines = lines
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, stream: IO[str] | None) -> None:
        assert stream is not None
        for line in stream:
            self.lines.put((self, line.strip()))

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


def _expect(
    lines: queue.Queue[tuple[Candidate, str]], word: str, timeout: float
) -> tuple[Candidate, list[str]]:
    """The next line starting with ``word`` (others in between are kept in order)."""
    give_up = time.monotonic() + timeout
    while True:
        left = give_up - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no {word!r} line within {timeout:g} s")
        try:
            who, line = lines.get(timeout=left)
        except queue.Empty:
            continue
        parts = line.split()
        if parts and parts[0] == word:
            return who, parts[1:]


def run_failover(database: str, url: str, trials: int, ttl: float) -> FailoverResult:
    from dblock import LockManager

    with LockManager(url, table=TABLE) as admin:
        admin.create_schema()
    lines: queue.Queue[tuple[Candidate, str]] = queue.Queue()
    bound = 4 * ttl + 30
    kills: list[float] = []
    downs: list[float] = []
    fences: list[int] = []
    per_lease = {"leader": 0.0, "standby": 0.0}
    running: list[Candidate] = []
    try:
        first = Candidate(url, ttl, lines)
        running.append(first)
        leader, (fence, _) = _expect(lines, "elected", bound)
        fences.append(int(fence))
        standby = Candidate(url, ttl, lines)
        running.append(standby)
        _expect(lines, "standing", bound)
        time.sleep(0.5)  # its first look made: it waits
        per_lease = _idle_cost(leader, standby, lines, ttl)
        for n in range(2 * trials):
            kill = n % 2 == 0
            if kill:
                leader.proc.kill()
                ended = time.monotonic()
            else:
                leader.send("down")
                _, (t,) = _expect(lines, "down", bound)
                ended = float(t)
            new, (fence, at) = _expect(lines, "elected", bound)
            assert new is standby, "the stepped-down or killed leader was elected again"
            (kills if kill else downs).append(float(at) - ended)
            fences.append(int(fence))
            leader.close()
            running.remove(leader)
            leader, standby = standby, Candidate(url, ttl, lines)
            running.append(standby)
            _expect(lines, "standing", bound)
            time.sleep(0.3)
    finally:
        for c in running:
            c.close()
        with LockManager(url, table=TABLE) as admin:
            admin.drop_schema()
    return FailoverResult(
        database=database,
        ttl=ttl,
        kills=kills,
        step_downs=downs,
        leader_statements_per_lease=per_lease["leader"],
        standby_statements_per_lease=per_lease["standby"],
        fences_grew=all(b > a for a, b in itertools.pairwise(fences)),
    )


def _idle_cost(
    leader: Candidate, standby: Candidate, lines: queue.Queue[tuple[Candidate, str]], ttl: float
) -> dict[str, float]:
    """Statements per lease each sent over two leases, one leading, one standing by."""

    def counts() -> dict[Candidate, int]:
        got = {}
        for c in (leader, standby):
            c.send("count")
            who, (n,) = _expect(lines, "count", 10)
            got[who] = int(n)
        return got

    before = counts()
    time.sleep(2 * ttl)
    after = counts()
    return {
        "leader": (after[leader] - before[leader]) / 2,
        "standby": (after[standby] - before[standby]) / 2,
    }


def _name(url: str) -> str:
    scheme = url.split(":", 1)[0].split("+", 1)[0]
    return {"mysql": "mariadb", "postgresql": "postgresql"}.get(scheme, scheme)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("urls", nargs="*", metavar="URL", help="database URLs, one run each")
    parser.add_argument("--trials", type=int, default=20, help="of each kind (20)")
    parser.add_argument("--ttl", type=float, default=2.0, help="the role's lease, seconds (2)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--candidate", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.candidate:
        candidate(args.candidate, args.ttl)
        return 0
    if not args.urls:
        parser.error("give at least one database URL")
    results = []
    for url in args.urls:
        print(f"... {_name(url)}: {args.trials} trials of each", file=sys.stderr, flush=True)
        results.append(run_failover(_name(url), url, args.trials, args.ttl))
    print(HEAD)
    for r in results:
        print(r.row())
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    return 0 if all(r.fences_grew for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
