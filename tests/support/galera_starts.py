"""Start private Galera clusters over and over: issue 43's "galera node 2 exited".

``python -m tests.support.galera_starts [N] [--burners B] [--churn P]``

Starts and closes a 3-node :class:`~tests.support.servers.PrivateGalera` N
times (10), beside B processes spinning on the CPU (2) and, with ``--churn``,
one that holds P listening ports of 127.0.0.1 for half a second at a time,
over and over, as the suite's other processes bind ports (private servers,
proxies, web apps). Prints one line per start (a failure with its message:
where the logs are kept, and their last lines) and the count of failures;
exit status 1 if any start failed.

Measured on 2 cores: without churn, 10 of 10 started (with the ports chosen
by ``free_port`` and with held ones). With ``--churn 2000``: ports chosen by
``free_port`` failed 5 starts of 6, every log saying "Address already in
use" (a node's gcomm, IST or SQL port, taken between its choice and the
node's start); held ports (``held_port``): 6 of 6 started.
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time

from tests.support.servers import PrivateGalera


def churn(ports: int) -> None:
    """Hold ``ports`` listening ports for 0.5 s, then others, forever."""
    while True:
        held = []
        for _ in range(ports):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            s.listen()
            held.append(s)
        time.sleep(0.5)
        for s in held:
            s.close()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("starts", nargs="?", type=int, default=10)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--churn", type=int, default=0, metavar="PORTS")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    helpers = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
               for _ in range(args.burners)]  # fmt: skip
    if args.churn:
        code = f"from tests.support.galera_starts import churn; churn({args.churn})"
        helpers.append(subprocess.Popen([sys.executable, "-c", code]))
    failed = 0
    try:
        for i in range(args.starts):
            began = time.monotonic()
            try:
                with PrivateGalera(3):
                    pass
            except Exception as exc:
                failed += 1
                print(f"{i}: FAILED after {time.monotonic() - began:.1f} s: {exc}", flush=True)
            else:
                print(f"{i}: started in {time.monotonic() - began:.1f} s", flush=True)
    finally:
        for p in helpers:
            p.kill()
            p.wait()
    print(f"failed {failed} of {args.starts}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
