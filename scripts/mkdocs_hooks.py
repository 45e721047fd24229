"""MkDocs hooks (mkdocs.yml names this file): the site's front page is README.md.

The README is the repository's front page and links into the site as
``docs/PAGE.md``; the site gets it as ``index.md`` with those links made
relative to docs/, so one text serves both and strict mode checks its links.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
# A Markdown link or image target that starts with docs/ (not a URL, not an anchor).
_INTO_DOCS = re.compile(r"(\]\()docs/")


def front_page(readme: str) -> str:
    """The README as the site's index.md: links into docs/ made relative to it."""
    return _INTO_DOCS.sub(r"\1", readme)


def on_files(files: Files, config: Any, **_: Any) -> Files:
    if files.get_file_from_path("index.md") is not None:
        raise ValueError("docs/index.md must not exist: the site's front page is README.md")
    content = front_page((ROOT / "README.md").read_text())
    files.append(File.generated(config, "index.md", content=content))
    return files
