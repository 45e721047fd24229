"""The tested code blocks of a Markdown page under docs/: a block after
``<!-- tested: runs -->`` is run as a script in an empty directory, one after
``<!-- tested: PATH -->`` must be a verbatim excerpt of that file (which the
tests run), as for the README (tests/test_readme.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def blocks(page: str) -> list[tuple[str, str]]:
    text = (ROOT / "docs" / page).read_text()
    return re.findall(r"<!-- tested: (\S+) -->\n```\w*\n(.*?)```\n", text, re.DOTALL)


def check_excerpt(path: str, code: str) -> None:
    assert code in (ROOT / path).read_text(), f"the docs' copy of {path} is out of date"


def run_block(code: str, directory: Path) -> str:
    """Run ``code`` as a script in ``directory``; its output."""
    script = directory / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "DBLOCK_URL"}
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout
