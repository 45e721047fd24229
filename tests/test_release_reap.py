"""A renewal pass that runs while a release is under way.

The renewal thread's pass (``Locker._reap``) passes on the key of a level-1
entry whose owner can never run again and that holds no lock. A deferred
release (``until=session``, the integrations) outlives its taking thread or
task, so its release runs with that owner gone: at no point of it may the
entry look abandoned, or the pass hands the key on before the DELETE and
logs that the owner "ended without releasing it" (seen under the suite's
three workers in test_aio_until's deferred-release test).

A tracer runs the reaper at every line of the release's code in
``dblock/lock.py``: deterministic, where the renewal thread would need the
interpreter to switch threads at just that line.
"""

from __future__ import annotations

import logging
import sys
import threading
from types import FrameType
from typing import Any

import pytest

from dblock import HeldLock, LockManager
from dblock.deferral import Deferred
from dblock.registry import Registry
from tests.conftest import row_of


def test_a_reaper_pass_at_any_line_of_a_release_leaves_the_key_to_it(
    manager: LockManager,
    key: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.WARNING, logger="dblock")
    locker = manager._locker
    registry = locker.registry
    box: list[HeldLock] = []
    triggers: list[Any] = []

    def take() -> None:
        held = manager.acquire(key)
        deferred = Deferred(held)
        triggers.append(deferred.trigger())  # its release waits for this end
        deferred.finish(None)  # the taking thread is done with it, and ends
        box.append(held)

    t = threading.Thread(target=take)
    t.start()
    t.join(30)
    held = box[0]
    entry = registry.get(key)
    assert entry is not None
    assert entry.held is held.state
    evicted: list[str] = []
    evict = Registry.evict

    def watch_evict(self: Registry, e: Any, owner: object) -> tuple[bool, Any]:
        got = evict(self, e, owner)
        if got[0] and self is registry:
            evicted.append(e.key)
        return got

    monkeypatch.setattr(Registry, "evict", watch_evict)
    lines = 0
    busy = False

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal lines, busy
        if event == "line" and not busy:
            busy = True
            try:
                lines += 1
                locker._reap()  # a renewal pass, right before this line runs
            finally:
                busy = False
        return local

    def start(frame: FrameType, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename.endswith("dblock/lock.py") and not busy:
            return local
        return None

    sys.settrace(start)
    try:
        triggers.pop()()  # the end it waited for: released by this thread
    finally:
        sys.settrace(None)
    assert lines > 10
    assert evicted == [], "the key was passed on at level 1 while its release was under way"
    assert "ended without releasing" not in caplog.text
    assert "passed on at level 1" not in caplog.text
    assert registry.get(key) is None
    assert row_of(manager, key) is None
    assert held.released
    assert not held.lost
