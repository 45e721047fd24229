"""Running example web apps in real server processes, sending them
concurrent requests, and checking the ledger they keep."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(
    command: Sequence[str], *, cwd: Path, env: dict[str, str], port: int, ready_path: str
) -> Iterator[str]:
    """Run a server process until the ``with`` ends; yields its base URL once
    ``ready_path`` answers."""
    log = cwd / f".server-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            list(command),
            cwd=cwd,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(base + ready_path, timeout=5):
                    break
            except (OSError, urllib.error.URLError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server did not answer:\n{log.read_text()}") from None
                time.sleep(0.2)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(20)
        log.unlink(missing_ok=True)


def request(
    method: str, url: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    for name, value in (headers or {}).items():
        req.add_header(name, value)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def concurrently(
    calls: Sequence[tuple[str, str, dict[str, Any] | None]], threads: int
) -> list[int]:
    """Send ``calls`` (method, url, json body) from ``threads`` threads at once;
    the status codes, in the order of ``calls``."""
    statuses: list[int] = [0] * len(calls)
    next_call = iter(range(len(calls)))
    lock = threading.Lock()
    start = threading.Barrier(threads)

    def worker() -> None:
        start.wait()
        while True:
            with lock:
                i = next(next_call, None)
            if i is None:
                return
            method, url, body = calls[i]
            statuses[i] = request(method, url, body)[0]

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(600)
    return statuses


def ledger_problems(rows: Sequence[tuple[Any, ...]]) -> list[str]:
    """``rows`` of (user_id, request_id, event) in insertion order: per user,
    every "enter" must be followed by the "exit" of the same request before
    anyone else enters. Returns what broke that rule."""
    inside: dict[Any, Any] = {}
    problems: list[str] = []
    for user_id, request_id, event in rows:
        current = inside.get(user_id)
        if event == "enter":
            if current is not None:
                problems.append(f"user {user_id}: {request_id} entered while {current} was inside")
            inside[user_id] = request_id
        elif current != request_id:
            problems.append(f"user {user_id}: {request_id} left but {current} was inside")
        else:
            inside[user_id] = None
    problems += [f"user {u}: {r} never left" for u, r in inside.items() if r is not None]
    return problems
