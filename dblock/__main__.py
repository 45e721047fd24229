"""``python -m dblock``: the ``dblock`` command line (``python -m dblock run KEY -- cmd``)."""

from __future__ import annotations

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
