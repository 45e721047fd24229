"""Django settings for the test suite: the example project's own, with a test
database name of this run's own (the PostgreSQL server is shared)."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "django_project"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

from exampleproject.settings import *  # noqa: E402, F403

DATABASES["default"]["TEST"] = {"NAME": f"test_dblock_{uuid.uuid4().hex[:12]}"}  # noqa: F405
# The live-server tests ask for the admin CSS: a 404, not a server error.
STATIC_ROOT = str(EXAMPLE / "static")
