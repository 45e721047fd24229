"""Streamed bodies under a view's lock, for tests that read them chunk by
chunk from another process: the server's body waits at a gate (a file the
test creates) before each chunk after the first, so the test decides when the
body goes on and can check the lock in between."""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

CHUNKS = 3


def chunk(i: int) -> str:
    return f"chunk-{i:03d}\n"  # 10 bytes


def wait_gate(key: str, i: int) -> None:
    path = Path(os.environ["STREAM_GATES"]) / f"{key}.{i}"
    deadline = time.monotonic() + 60
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {path} never opened")
        time.sleep(0.01)


def body(key: str) -> Iterator[str]:
    for i in range(CHUNKS):
        if i:
            wait_gate(key, i)
        yield chunk(i)
    wait_gate(key, CHUNKS)  # the body ends only when the test says so


async def async_body(key: str) -> AsyncIterator[str]:
    for part in body(key):
        yield part
