"""The example project's settings with ``DBLOCK`` entries taken from the
environment (``EXAMPLE_DBLOCK``, JSON), for tests that start Django in a
process of its own: ``DJANGO_SETTINGS_MODULE=tests.support.django_env_settings``."""

from __future__ import annotations

import json
import os

from exampleproject.settings import *  # noqa: F403
from exampleproject.settings import DBLOCK

DBLOCK = {**DBLOCK, **json.loads(os.environ.get("EXAMPLE_DBLOCK") or "{}")}

# The tests' probe in the example's critical sections (tests/support/ledger.py).
if os.environ.get("DBLOCK_TEST_LEDGER"):
    INSTALLED_APPS = [*INSTALLED_APPS, "tests.support.ledger.WatchDjangoExample"]  # noqa: F405
