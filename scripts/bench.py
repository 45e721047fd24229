"""The benchmark suite: ``python scripts/bench.py [options]`` is ``dblock bench``.

The code lives in the package (dblock/bench/) so the installed ``dblock``
command runs exactly the same thing; see ``scripts/bench`` for the one
command that also sets up the environment.
"""

import sys

from dblock.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
