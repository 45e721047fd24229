"""docs/kinds/read-write.md: every block tagged ``<!-- tested: runs -->``
runs as a script in an empty directory (against SQLite by default)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "kinds" / "read-write.md"
BLOCKS = re.findall(r"<!-- tested: runs -->\n```python\n(.*?)```\n", PAGE.read_text(), re.DOTALL)


def test_page_has_tested_blocks() -> None:
    assert BLOCKS


@pytest.mark.parametrize("code", BLOCKS)
def test_block_runs(code: str, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "DBLOCK_URL"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout or "UpgradeRefused" not in code
