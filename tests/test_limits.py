"""Input that no database can take, and durations no database can represent:
refused with ``LockArgumentError`` before any SQL, on every path (issue 9,
items 9 and 12). And an orphan whose row can never be deleted does not
disable the manager."""

from __future__ import annotations

import json
import logging
import time
import uuid

import pytest

from dblock import Config, LockArgumentError, LockManager
from dblock.config import MAX_SECONDS
from dblock.sweeper import SweeperConfig
from tests.conftest import row_of
from tests.support.counting import StatementCounter

# What json.loads gives for client input with a broken escape.
SURROGATE_KEY = json.loads('"alice\\ud800"')


# -- keys that cannot be encoded ----------------------------------------------


def test_lone_surrogate_key_refused_before_sql(manager: LockManager, key: str) -> None:
    with StatementCounter(manager.engine) as c:
        for call in (
            lambda: manager.acquire(SURROGATE_KEY),
            lambda: manager.acquire(SURROGATE_KEY, blocking=False),
            lambda: manager.lock(SURROGATE_KEY),
            lambda: manager.lock_many([key, SURROGATE_KEY]).__enter__(),
        ):
            with pytest.raises(LockArgumentError, match=r"lone surrogate '\\ud800' at position 5"):
                call()
    assert c.count == 0
    assert len(manager._locker.registry) == 0
    assert not manager.store.has_orphans
    # ... and nothing of it lingers: the next valid key works at once.
    with manager.lock(key, blocking=False) as held:
        assert row_of(manager, key) is not None
        assert held.fence > 0
    manager.close()  # does not raise


def test_surrogate_key_from_a_template_refused_before_sql(manager: LockManager) -> None:
    @manager.locked("user:{name}")
    def work(name: str) -> None:
        raise AssertionError("must not run")

    with StatementCounter(manager.engine) as c, pytest.raises(LockArgumentError, match="surrogate"):
        work(SURROGATE_KEY)
    assert c.count == 0


def test_valid_non_ascii_keys_still_work(manager: LockManager, key: str) -> None:
    for suffix in ("café", "😀", "日本"):
        with manager.lock(f"{key}:{suffix}", blocking=False):
            assert row_of(manager, f"{key}:{suffix}") is not None


def test_thread_name_with_a_surrogate_does_not_break_acquire(
    manager: LockManager, key: str
) -> None:
    import threading

    seen: list[object] = []

    def run() -> None:
        try:
            with manager.lock(key, blocking=False) as held:
                seen.append(held.owner)
        except BaseException as exc:  # report it to the test thread
            seen.append(exc)

    thread = threading.Thread(target=run, name=f"worker-{SURROGATE_KEY}")
    thread.start()
    thread.join()
    assert len(seen) == 1, seen
    assert isinstance(seen[0], str), seen
    assert seen[0].endswith("worker-alice?")
    assert not manager.store.has_orphans


def test_client_id_must_be_encodable(tmp_path: object) -> None:
    with pytest.raises(LockArgumentError, match="client_id is not valid Unicode"):
        Config(client_id=f"host-{SURROGATE_KEY}")


# -- orphans that can never be deleted ---------------------------------------


def test_a_poisoned_orphan_is_dropped_and_blocks_no_other_key(
    manager: LockManager, keys: object, caplog: pytest.LogCaptureFixture
) -> None:
    """An orphan whose DELETE can never be sent (the driver cannot encode its
    key) is dropped with an ERROR line; valid orphans behind it are still
    deleted, valid keys are still granted, and close() does not raise."""
    a, b, c = keys(3)  # type: ignore[operator]
    leftover = manager.acquire(b)
    token = leftover.token
    # The row of b stays behind as if its acquisition's outcome were unknown.
    manager._locker.registry.leave(leftover.state.entry)
    manager._locker.renewer.untrack(leftover)
    store = manager.store
    store.add_orphan(SURROGATE_KEY, uuid.uuid4().hex)
    store.add_orphan(b, token)
    with caplog.at_level(logging.INFO, logger="dblock"):
        with manager.lock(a, blocking=False):
            pass
        with manager.lock(c, blocking=False):
            pass
        # The renewal thread may be the one cleaning them (a pass takes the
        # orphans' lock; the acquiring thread then leaves them to it): let it finish.
        with store._orphans_lock:
            pass
    assert not store.has_orphans
    assert row_of(manager, b) is None  # the valid orphan behind it was deleted
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert repr(SURROGATE_KEY) in errors[0].getMessage()
    assert "giving up" in errors[0].getMessage()
    store.add_orphan(SURROGATE_KEY, uuid.uuid4().hex)
    manager.close()  # must not raise


@pytest.mark.databases("postgresql")
def test_an_orphan_the_database_keeps_refusing_is_dropped_after_a_few_tries(
    manager: LockManager, keys: object, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL refuses a NUL in a string: a DELETE answered with an error
    every time. The orphan is tried a bounded number of times, then dropped,
    and never stops other keys."""
    from dblock._store.base import ORPHAN_ATTEMPTS

    (a,) = keys(1)  # type: ignore[operator]
    store = manager.store
    store.add_orphan("bad\x00key", uuid.uuid4().hex)
    with caplog.at_level(logging.ERROR, logger="dblock"):
        # Each acquire tries the orphans once, unless the renewal thread is
        # trying them at that moment (then it counts that try): bounded, not exact.
        for _ in range(ORPHAN_ATTEMPTS * 50):
            with manager.lock(a, blocking=False):
                pass
            if not store.has_orphans:
                break
            time.sleep(0.01)
    assert not store.has_orphans
    assert any("giving up" in r.getMessage() for r in caplog.records)


# -- durations no database can represent --------------------------------------

TOO_LONG = [
    pytest.param({"ttl": 3e11}, "ttl", id="ttl"),
    pytest.param({"ttl": MAX_SECONDS + 1}, "ttl", id="ttl-just-over"),
    pytest.param({"timeout": 1e300}, "timeout", id="timeout"),
    pytest.param({"max_hold": 3e11}, "max_hold", id="max_hold"),
    pytest.param({"blocking": False, "timeout": 1}, "blocking=False", id="fail-fast-timeout"),
    pytest.param({"blocking": False, "timeout": 0}, "blocking=False", id="fail-fast-timeout-0"),
]


@pytest.mark.parametrize(("options", "name"), TOO_LONG)
def test_out_of_range_durations_refused_before_sql(
    manager: LockManager, key: str, options: dict[str, object], name: str
) -> None:
    with StatementCounter(manager.engine) as c:
        for call in (
            lambda: manager.acquire(key, **options),  # type: ignore[arg-type]
            lambda: manager.lock(key, **options),  # type: ignore[arg-type]
            lambda: manager.lock_many([key], **options),  # type: ignore[arg-type]
            lambda: manager.acquire_many([key], **options),  # type: ignore[arg-type]
            lambda: manager.locked(key + "{x}", **options),  # type: ignore[arg-type]
        ):
            with pytest.raises(LockArgumentError, match=name):
                call()
    assert c.count == 0
    assert len(manager._locker.registry) == 0


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"ttl": 3e11}, id="ttl"),
        pytest.param({"timeout": 3e11}, id="timeout"),
        pytest.param({"max_hold": 3e11}, id="max_hold"),
        pytest.param({"poll_max": 3e11}, id="poll_max"),
        pytest.param({"notify_recheck": 3e11}, id="notify_recheck"),
    ],
)
def test_out_of_range_config_refused(tmp_path: object, options: dict[str, object]) -> None:
    with pytest.raises(LockArgumentError, match="at most 31622400 seconds"):
        Config(**options)  # type: ignore[arg-type]
    with pytest.raises(LockArgumentError, match="at most 31622400 seconds"):
        LockManager(f"sqlite:///{tmp_path}/x.sqlite3", **options)


@pytest.mark.parametrize("name", ["interval", "grace", "max_hold", "lock_ttl"])
def test_out_of_range_sweeper_options_refused(name: str) -> None:
    with pytest.raises(LockArgumentError, match=name):
        SweeperConfig(**{name: 3e11})


def test_a_manager_default_timeout_does_not_refuse_fail_fast(
    make_manager: object, key: str
) -> None:
    m = make_manager(timeout=5)  # type: ignore[operator]
    with m.lock(key, blocking=False):
        pass
    held = m.acquire(key, blocking=False, timeout=None)  # None: no timeout given
    held.release()


def test_the_longest_durations_allowed_work(manager: LockManager, key: str) -> None:
    """A lease (and a hold) of MAX_SECONDS fits every database's time type."""
    with manager.lock(key, ttl=MAX_SECONDS, max_hold=MAX_SECONDS, timeout=MAX_SECONDS) as held:
        assert MAX_SECONDS - 60 < held.remaining <= MAX_SECONDS
        row = row_of(manager, key)
        assert row is not None
    assert row_of(manager, key) is None
