"""Spawned worker processes that start measuring together.

Each worker sets itself up (imports, a manager, a warm connection), says
``ready``, waits for ``go`` and puts one result; only then does the parent
collect. Spawned, not forked: a worker inherits nothing but its arguments.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
from collections.abc import Callable
from typing import Any

__all__ = ["Start", "run_together"]


@dataclasses.dataclass
class Start:
    """What a worker gets to line up with the others (passed last)."""

    ready: Any  # queue: one item per worker once it is set up
    go: Any  # event: set when every worker is ready
    results: Any  # queue: one result per worker
    counter: Any  # a shared integer (multiprocessing.Value "i"), under its own lock
    shared: Any = None  # shared doubles (multiprocessing.Array "d"), if asked for


def run_together(
    target: Callable[..., None],
    args: tuple[Any, ...],
    *,
    processes: int,
    timeout: float,
    doubles: int = 0,
    after_go: Callable[[], None] | None = None,
) -> list[Any]:
    """Run ``target(*args, start)`` in ``processes`` spawned processes and
    return their results (in the order they arrived); ``doubles``: the size
    of ``start.shared``, lock-free; ``after_go`` is called in this process
    as the workers are let go."""
    ctx = multiprocessing.get_context("spawn")
    start = Start(
        ready=ctx.Queue(),
        go=ctx.Event(),
        results=ctx.Queue(),
        counter=ctx.Value("i", 0),
        shared=ctx.Array("d", doubles, lock=False) if doubles else None,
    )
    workers = [
        ctx.Process(target=target, args=(*args, start), daemon=True) for _ in range(processes)
    ]
    for w in workers:
        w.start()
    try:
        for _ in workers:
            start.ready.get(timeout=120)
        start.go.set()
        if after_go is not None:
            after_go()
        return [start.results.get(timeout=timeout) for _ in workers]
    finally:
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
