"""The benchmark suite: ``python scripts/bench.py [options]`` (see ``scripts/bench``).

The suite lives beside the package, in benchmarks/ (not in the wheel); this
puts the checkout on the path and runs :func:`benchmarks.suite.main`.

``--databases ...,galera`` without ``--galera URL,...`` (or
``$DBLOCK_BENCH_GALERA_URLS``) starts a private 3-node Galera cluster on
loopback for the run (tests/support/servers.py) and stops it afterwards.
"""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.suite import main


def _wants_private_galera(argv: list[str]) -> bool:
    databases = ""
    for i, arg in enumerate(argv):
        if arg == "--databases" and i + 1 < len(argv):
            databases = argv[i + 1]
        elif arg.startswith("--databases="):
            databases = arg.split("=", 1)[1]
    given = any(a == "--galera" or a.startswith("--galera=") for a in argv)
    return (
        "galera" in databases.split(",")
        and not given
        and not os.environ.get("DBLOCK_BENCH_GALERA_URLS")
    )


if __name__ == "__main__":
    argv = sys.argv[1:]
    if not _wants_private_galera(argv):
        sys.exit(main(argv))
    from tests.support.servers import PrivateGalera

    print("... starting a private 3-node Galera cluster", file=sys.stderr, flush=True)
    with PrivateGalera(3) as cluster:
        code = main([*argv, "--galera", ",".join(cluster.urls)])
    sys.exit(code)
