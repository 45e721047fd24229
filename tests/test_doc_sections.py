"""Every section the documentation points to exists, in prose as in links.

``scripts/docs`` (mkdocs, strict) fails on a link to a missing anchor; a
sentence saying "see the README's asyncio section" is not a link, and went
stale unnoticed when that section moved to its own page. This test reads
README.md, docs/**/*.md (found by glob) and the examples' Python files for

* links with an anchor (``[text](page.md#anchor)``, ``[text](#anchor)``),
  checked against the anchors the target page's headings make;
* phrases naming a section: "the README's X section", "the X section of
  the README" (or "of page.md"), and, on the page itself, "the X section" and
  "see X below/above" where X is written as a title (capitalised, in
  backticks or emphasis), checked against the headings of the page named.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]
SOURCES = sorted((ROOT / "examples").glob("**/*.py"))

_FENCE = re.compile(r"^\s*(```|~~~)")
# (attr_list's `{#id}` or `{ #id }` sets the anchor)
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*(?:\{\s*#(?P<id>[\w-]+)\s*\})?\s*#*\s*$")
_LINK = re.compile(r"\]\((?P<page>[^)\s#]*)#(?P<anchor>[^)\s]+)\)")
# A bold lead of a paragraph or list item ("* **No herd.** ...") names a
# section as a heading does.
_LEAD = re.compile(r"^\s*(?:[*-] )?\*\*(?P<name>[^*]+?)[.:]?\*\*")
# A section's name: one to four words, none of them "the" or "of" (so "the
# settings of the Django section" names "Django"), no possessive.
_WORD = r"(?!(?:the|of|a|an)\b)[\w`*./-]+"
_NAME = rf"(?P<name>{_WORD}(?: {_WORD}){{0,3}})"
_TITLE = rf"(?P<name>(?=[A-Z`*]){_WORD}(?: {_WORD}){{0,3}})"  # written as a title
_PAGE = r"(?P<page>README|[\w./-]+\.md|this page)"
_PHRASES = [
    # (pattern, the page it names when it has no `page` group: None = this one)
    (re.compile(rf"\bREADME(?:\.md)?'s {_NAME} section", re.IGNORECASE), "README"),
    (re.compile(rf"\bthe {_NAME} section of (?:the )?{_PAGE}", re.IGNORECASE), None),
    (re.compile(rf"\bthe {_TITLE} section\b(?! of)"), None),
    (re.compile(rf"\bsee (?:the )?{_TITLE} (?:section )?(?:below|above)"), None),
]


@dataclass(frozen=True)
class Page:
    path: Path
    prose: str  # outside code fences, one line
    headings: tuple[str, ...]  # normalised
    anchors: frozenset[str]


def _norm(text: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text
    return " ".join(re.sub(r"[*_`]", "", text).lower().split())


def _slug(text: str) -> str:
    """The anchor Python-Markdown's toc (mkdocs) makes of a heading."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).replace("`", "")
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _read(path: Path) -> Page:
    prose: list[str] = []
    headings: list[str] = []
    anchors: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found = _HEADING.match(line)
        if found:
            headings.append(_norm(found.group(2)))
            anchors.add(found.group("id") or _slug(found.group(2)))
        lead = _LEAD.match(line)
        if lead:
            headings.append(_norm(lead.group("name")))
        prose.append(line)
    return Page(path, " ".join(" ".join(prose).split()), tuple(headings), frozenset(anchors))


_CACHE: dict[Path, Page] = {}


def page(path: Path) -> Page:
    if path not in _CACHE:
        _CACHE[path] = _read(path)
    return _CACHE[path]


def _target(here: Path, named: str | None) -> Path:
    if named is None or named.lower() == "this page":
        return here
    if named.upper() == "README":
        return ROOT / "README.md"
    for base in (here.parent, ROOT / "docs", ROOT):
        if (base / named).exists():
            return (base / named).resolve()
    return ROOT / named  # missing: reported as such


def _has_section(target: Page, name: str) -> bool:
    wanted = _norm(name)
    return any(
        heading == wanted or re.search(rf"(?<![\w-]){re.escape(wanted)}(?![\w-])", heading)
        for heading in target.headings
    )


def section_references(path: Path, text: str) -> list[str]:
    """What ``text`` (found in ``path``) names that does not exist."""
    text = " ".join(text.split())
    problems = []
    for pattern, fixed in _PHRASES:
        for found in pattern.finditer(text):
            named = found.groupdict().get("page") or fixed
            target = _target(path, named)
            name = found.group("name")
            if not target.exists():
                problems.append(f"{found.group(0)!r}: no page {named}")
            elif not _has_section(page(target), name):
                where = target.relative_to(ROOT)
                problems.append(f"{found.group(0)!r}: {where} has no section {name!r}")
    return problems


def link_anchors(path: Path) -> list[str]:
    problems = []
    for found in _LINK.finditer(page(path).prose):
        link, anchor = found.group("page"), found.group("anchor")
        if link.startswith(("http:", "https:")):
            continue
        target = (path.parent / link).resolve() if link else path
        if not target.exists() or target.suffix != ".md":
            continue  # a missing page is scripts/docs' to report
        if anchor not in page(target).anchors:
            problems.append(f"{found.group(0)}: {target.relative_to(ROOT)} has no #{anchor}")
    return problems


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_sections_named_in_the_documentation_exist(path: Path) -> None:
    problems = section_references(path, page(path).prose) + link_anchors(path)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_sections_named_in_the_examples_exist(path: Path) -> None:
    problems = section_references(path, path.read_text())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("text", "wrong"),
    [
        ("see the README's asyncio section.", True),
        ("see the README's *asyncio* section.", True),
        ("the settings of the Django section of the\nREADME apply", True),
        ("the Scheduler section of docs/operations.md", True),  # not a heading there
        ("the sweeper section of operations.md", False),  # `## The sweeper`
        ("see the README's A first example section", False),
        ("the critical section", False),  # a term, not a reference
        ("see Nowhere below", True),
        ("see Keys below", False),  # `## Keys` on this page
    ],
)
def test_the_check_itself(text: str, wrong: bool) -> None:
    here = ROOT / "docs" / "service-layer.md"
    assert bool(section_references(here, text)) is wrong, section_references(here, text)
