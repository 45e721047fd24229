"""``python scripts/bench_listeners.py [options]``: see ``scripts/bench-listeners``.

Without ``--url`` it starts a private PostgreSQL instance on loopback
(tests/support/servers.py) with ``max_connections`` raised for the run, so
hundreds of processes never weigh on a shared server, and removes it after.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.listeners import ListenersSpec, render, run_listeners
from dblock import LockManager


def server_cpu(data: Path) -> float:
    """CPU seconds of the PostgreSQL instance whose data directory is ``data``
    so far: its postmaster's and its children's (backends, background workers)."""
    postmaster = int((data / "postmaster.pid").read_text().split()[0])
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        # After the name: state, ppid, ..., utime and stime are fields 14 and 15.
        if int(entry.name) == postmaster or int(fields[1]) == postmaster:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a PostgreSQL URL (default: a private instance)")
    parser.add_argument("--processes", type=int, default=100, help="an even number (100)")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window (10)")
    parser.add_argument("--hold", type=float, default=100.0, help="ms each side holds (100)")
    parser.add_argument("--gap", type=float, default=25.0, help="ms before asking again (25)")
    parser.add_argument("--max-connections", type=int, default=400, help="private server's (400)")
    parser.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = parser.parse_args(argv)
    server = None
    url = args.url
    if url is None:
        from tests.support.servers import PrivatePostgres

        print("... starting a private PostgreSQL instance", file=sys.stderr, flush=True)
        server = PrivatePostgres(max_connections=args.max_connections)
        url = server.url
    try:
        with LockManager(url) as m:
            m.create_schema()
        spec = ListenersSpec(
            url=url,
            processes=args.processes,
            seconds=args.seconds,
            hold=args.hold / 1e3,
            gap=args.gap / 1e3,
        )
        cpu = None if server is None else (lambda: server_cpu(server.data))
        result = run_listeners(spec, cpu)
    finally:
        if server is not None:
            server.close()
    print(render(result))
    if args.json:
        Path(args.json).write_text(result.to_json() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
