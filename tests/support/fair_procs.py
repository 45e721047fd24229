"""Child processes of the fair-queue tests (spawned: nothing is inherited)."""

from __future__ import annotations

import time
from typing import Any

from dblock import LockManager


def fair_waiter(url: str, key: str, name: str, ttl: float, report: Any) -> None:
    """Wait in the fair queue of ``key``; once granted, report who, the fence
    and when, then release."""
    with LockManager(url, ttl=ttl) as m, m.lock(key, fair=True, timeout=120) as held:
        report.put((name, held.fence, time.monotonic()))


def fair_holder(url: str, key: str, ttl: float, report: Any) -> None:
    """Take ``key`` fairly, report the fence, and hold it until killed."""
    m = LockManager(url, ttl=ttl)
    held = m.acquire(key, fair=True, timeout=120)
    report.put(held.fence)
    while True:
        time.sleep(1)
