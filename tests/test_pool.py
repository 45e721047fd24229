"""dblock's own pool: however small, lock statements queue for its
connections and never starve on them (the sizing rule in the README's Flask
and Django sections)."""

from __future__ import annotations

import threading

import pytest

from dblock import LockManager


@pytest.mark.parametrize("pool_size", [1, 2])
def test_threads_share_a_pool_without_overflow(db_url: str, keys: object, pool_size: int) -> None:
    """More threads than connections, each taking and releasing keys of its
    own: every statement gets a connection, none waits out the pool's
    timeout (a connection kept idle by one thread while another waits for
    the pool would make it)."""
    threads, rounds = 4, 25
    names = keys(threads)  # type: ignore[operator]
    errors: list[BaseException] = []
    start = threading.Barrier(threads)
    options = {"pool_size": pool_size, "max_overflow": 0, "pool_timeout": 3}
    with LockManager(db_url, engine_options=options) as manager:

        def work(key: str) -> None:
            try:
                start.wait(10)
                for _ in range(rounds):
                    with manager.lock(key, timeout=10):
                        pass
            except BaseException as exc:  # reported below
                errors.append(exc)

        pool = [threading.Thread(target=work, args=(k,)) for k in names]
        for t in pool:
            t.start()
        for t in pool:
            t.join(120)
        assert manager.engine.pool.checkedout() <= pool_size  # type: ignore[attr-defined]
    assert errors == []
