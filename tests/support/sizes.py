"""How long the suite's long runs are: smoke size by default, full size
with ``DBLOCK_FULL=1`` (``DBLOCK_FULL=1 scripts/test``), for a release or
after touching what they guard."""

from __future__ import annotations

import os

#: Every long run at full size: the jobs integrations' 60 s runs, each
#: Patroni failover by every way to the leader.
FULL = os.environ.get("DBLOCK_FULL") == "1"
