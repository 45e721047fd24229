"""Running the real ``dblock`` command, as an operator does, in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

# The console script pip installed next to this interpreter (fall back to -m).
_SCRIPT = Path(sys.executable).with_name("dblock")
COMMAND = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "dblock.cli"]


def _env(extra: Mapping[str, str] | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DBLOCK_URL"}
    env["PYTHONWARNINGS"] = "ignore"
    env.update(extra or {})
    return env


def dblock(
    *args: str,
    env: Mapping[str, str] | None = None,
    input: str | None = None,
    cwd: Path | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run ``dblock ARGS`` to the end (stdin: ``input``, else /dev/null)."""
    return subprocess.run(
        [*COMMAND, *args],
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(env),
        cwd=cwd,
        check=False,
    )


def start_dblock(*args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[str]:
    """Start ``dblock ARGS`` in the background; stdout and stderr are pipes."""
    return subprocess.Popen(
        [*COMMAND, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(env),
    )
