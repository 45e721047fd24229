"""The module map of docs/internals.md, the import graph of dblock/, and the picture of the floors.

``tests/test_house_map.py`` checks the three against each other; this module
only reads and draws. Run it to rewrite the picture from the map:

    .venv/bin/python -m tests.support.house_map            # rewrite docs/img/floors.svg
    .venv/bin/python -m tests.support.house_map --arrows   # print every import that runs up a floor

The map is the table in docs/internals.md between the two ``house map``
comments: one row per module (or a few modules that share a line), its floor
in the first column, written once on the floor's first row and left empty
on the rows that follow. A module is a path under ``dblock/``; a path that
ends in ``/`` stands for every module under it that no row names itself.
"""

from __future__ import annotations

import ast
import dataclasses
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from html import escape
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PACKAGE = ROOT / "dblock"
DOC = ROOT / "docs" / "internals.md"
PICTURE = ROOT / "docs" / "img" / "floors.svg"

START = "<!-- house map: start"
END = "<!-- house map: end -->"


# -- the map -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Row:
    floor: int
    floor_name: str
    #: Paths under dblock/, as written: "lock.py", "_store/base.py", "contrib/".
    modules: tuple[str, ...]
    what: str
    line: int  # of docs/internals.md


@dataclasses.dataclass(frozen=True)
class Floor:
    number: int
    name: str
    rows: tuple[Row, ...]


class MapError(Exception):
    """The table cannot be read: the message says which line and why."""


_FLOOR = re.compile(r"^(?P<number>\d+)\s+(?P<name>.+)$")
_CODE = re.compile(r"`([^`]+)`")


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def read_map(text: str | None = None) -> list[Floor]:
    """The floors of the map in docs/internals.md, bottom (1) first."""
    if text is None:
        text = DOC.read_text()
    lines = text.splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.strip().startswith(START)]
    ends = [i for i, ln in enumerate(lines) if ln.strip() == END]
    if len(starts) != 1 or len(ends) != 1 or ends[0] < starts[0]:
        raise MapError(
            f"{DOC.name}: expected one `{START} ... -->` and one `{END}` around the module map, "
            f"found {len(starts)} and {len(ends)}"
        )
    rows: list[Row] = []
    floor: tuple[int, str] | None = None
    body = [(i, ln) for i, ln in enumerate(lines[starts[0] + 1 : ends[0]], starts[0] + 2)]
    table = [(i, ln) for i, ln in body if ln.strip().startswith("|")]
    if len(table) < 3:
        raise MapError(f"{DOC.name}:{starts[0] + 1}: the module map has no rows")
    for number, line in table[2:]:  # the header and the |---| line
        cells = _cells(line)
        if len(cells) != 3:
            raise MapError(
                f"{DOC.name}:{number}: a map row has 3 cells (floor, module, what): {line}"
            )
        if cells[0]:
            m = _FLOOR.match(cells[0].replace("*", ""))
            if m is None:
                raise MapError(f"{DOC.name}:{number}: a floor cell is `N name`, not {cells[0]!r}")
            new = (int(m["number"]), m["name"].strip())
            expected = 1 if floor is None else floor[0] + 1
            if new[0] != expected:
                raise MapError(f"{DOC.name}:{number}: floor {new[0]} after floor {expected - 1}")
            floor = new
        if floor is None:
            raise MapError(f"{DOC.name}:{number}: the first row names no floor")
        modules = tuple(_CODE.findall(cells[1]))
        if not modules:
            raise MapError(f"{DOC.name}:{number}: a row names its modules in `code`: {line}")
        rows.append(Row(floor[0], floor[1], modules, cells[2], number))
    floors: list[Floor] = []
    for row in rows:
        if not floors or floors[-1].number != row.floor:
            floors.append(Floor(row.floor, row.floor_name, ()))
        last = floors[-1]
        floors[-1] = dataclasses.replace(last, rows=(*last.rows, row))
    return floors


def module_name(entry: str) -> str:
    """``_store/base.py`` -> ``dblock._store.base``; ``contrib/`` -> ``dblock.contrib``."""
    parts = entry.rstrip("/").removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["dblock", *[p for p in parts if p]])


def floor_of(floors: Sequence[Floor]) -> dict[str, tuple[int, Row]]:
    """Each module of dblock/ (dotted) to its floor and row.

    A folder's entry covers the modules under it that no row names."""
    exact: dict[str, tuple[int, Row]] = {}
    trees: list[tuple[str, int, Row]] = []
    for floor in floors:
        for row in floor.rows:
            for entry in row.modules:
                if entry.endswith("/"):
                    trees.append((module_name(entry), floor.number, row))
                else:
                    exact[module_name(entry)] = (floor.number, row)
    result: dict[str, tuple[int, Row]] = {}
    for name in modules():
        if name in exact:
            result[name] = exact[name]
            continue
        covering = [t for t in trees if name == t[0] or name.startswith(t[0] + ".")]
        if covering:
            tree = max(covering, key=lambda t: len(t[0]))
            result[name] = (tree[1], tree[2])
    return result


# -- the import graph ----------------------------------------------------------------------------


def modules() -> dict[str, Path]:
    """Every module of dblock/ (dotted name) and its file."""
    found: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


@dataclasses.dataclass(frozen=True)
class Import:
    source: str  # dotted module that imports
    target: str  # dotted module imported (dblock's own only)
    line: int
    names: tuple[str, ...]  # what the statement names ("__version__", "lock", ...)
    where: (
        str  # "module" (at import time), "function" (when called) or "typing" (TYPE_CHECKING only)
    )

    @property
    def place(self) -> str:
        path = modules()[self.source].relative_to(ROOT)
        return f"{path.as_posix()}:{self.line}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, where: str) -> Iterator[tuple[ast.AST, str]]:
    """Every node under ``node`` with where it runs: at import, in a function, for typing."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield stmt, "typing"
                yield from _walk(stmt, "typing")
            for stmt in child.orelse:
                yield stmt, where
                yield from _walk(stmt, where)
            continue
        inner = where
        if where == "module" and isinstance(
            child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
        ):
            inner = "function"
        yield child, inner
        yield from _walk(child, inner)


def _resolve(name: str, known: Iterable[str]) -> str | None:
    """The longest module of ``known`` that ``name`` is or is in: ``dblock.x.Y`` -> ``dblock.x``."""
    known = set(known)
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in known:
            return candidate
        parts.pop()
    return None


def imports() -> list[Import]:
    """Every import of one dblock module by another, at a module's top, in a function or for typing.

    ``from . import x`` names module ``x`` when it is one, else the package; a
    literal ``importlib.import_module("dblock...")`` counts too. Importing
    ``dblock.a.b`` also runs ``dblock/__init__`` and ``dblock/a/__init__``
    first, but that is Python's doing, not a dependency the code chose: only
    the module named is an arrow.
    """
    known = modules()
    found: list[Import] = []
    for source, path in known.items():
        is_package = path.name == "__init__.py"
        package = source if is_package else source.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        for node, where in _walk(tree, "module"):
            targets: list[tuple[str, tuple[str, ...]]] = []
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "dblock":
                        targets.append((alias.name, (alias.name,)))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")
                    if node.level > 1:
                        base_parts = base_parts[: -(node.level - 1)]
                    base = ".".join(base_parts)
                    if node.module:
                        base = f"{base}.{node.module}"
                else:
                    base = node.module or ""
                if base.split(".")[0] != "dblock":
                    continue
                plain: list[str] = []
                for alias in node.names:
                    if f"{base}.{alias.name}" in known:
                        targets.append((f"{base}.{alias.name}", (alias.name,)))
                    else:
                        plain.append(alias.name)
                if plain:
                    targets.append((base, tuple(plain)))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, (ast.Attribute, ast.Name))
                and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
                == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and node.args[0].value.startswith("dblock")
            ):
                targets.append((node.args[0].value, (node.args[0].value,)))
            for name, names in targets:
                target = _resolve(name, known)
                if target is None or target == source:
                    continue
                found.append(Import(source, target, node.lineno, names, where))  # type: ignore[attr-defined]
    return found


# -- the picture ---------------------------------------------------------------------------------

_FILLS = ("#eae4e9", "#f0efeb", "#e8e8e4", "#dfe7fd", "#fff1e6", "#e2ece9", "#fde2e4", "#e4ecf7")
_WIDTH = 980
_SIZE = 13  # px, the boxes' font size
# Helvetica's widths (Arial's and Liberation Sans's too) in thousandths of the
# font size, for the characters a module's name has: the boxes fit their text.
_WIDTHS = dict.fromkeys("abdeghnopqu0123456789_", 556) | dict.fromkeys("ckvsxyz", 500)
_WIDTHS |= dict.fromkeys("ijl", 222) | dict.fromkeys("ft/,. ", 278) | {"r": 333, "m": 833, "w": 722}
_BOX_HEIGHT = 26
_GAP = 8


def label(row: Row) -> str:
    """A row's box in the picture: its modules without ``.py``, a shared folder written once."""
    names = [m.removesuffix(".py") for m in row.modules]
    folder = names[0].rpartition("/")[0] if "/" in names[0].rstrip("/") else ""
    if folder and all(n.startswith(folder + "/") for n in names):
        return folder + "/" + ", ".join(n[len(folder) + 1 :] for n in names)
    return ", ".join(names)


def picture(floors: Sequence[Floor], upward: Sequence[tuple[str, str, str]] = ()) -> str:
    """The floors as an SVG, top floor first; ``upward``: (from, to, why), the arrows up."""
    out: list[str] = []
    inner = _WIDTH - 2 * 22
    bands: list[tuple[Floor, list[list[tuple[str, float]]]]] = []
    for floor in reversed(floors):
        lines: list[list[tuple[str, float]]] = [[]]
        used = 0.0
        for row in floor.rows:
            text = label(row)
            width = round(sum(_WIDTHS.get(c, 667) for c in text) * _SIZE / 1000 + 12, 1)
            if lines[-1] and used + width > inner:
                lines.append([])
                used = 0.0
            lines[-1].append((text, width))
            used += width + _GAP
        bands.append((floor, lines))
    y = 50.0
    body: list[str] = []
    for floor, lines in bands:
        height = 38 + len(lines) * (_BOX_HEIGHT + 6) + 2
        fill = _FILLS[(floor.number - 1) % len(_FILLS)]
        body.append(
            f'<rect x="10" y="{y:g}" width="{_WIDTH - 20}" height="{height:g}" rx="8" '
            f'fill="{fill}" stroke="#777"/>'
        )
        body.append(
            f'<text x="22" y="{y + 22:g}" font-weight="bold">'
            f"{floor.number} {escape(floor.name)}</text>"
        )
        box_y = y + 34
        for line in lines:
            x = 22.0
            for text, width in line:
                body.append(
                    f'<rect x="{x:g}" y="{box_y:g}" width="{width:g}" height="{_BOX_HEIGHT}" '
                    'rx="4" fill="white" stroke="#999"/>'
                )
                body.append(f'<text x="{x + 6:g}" y="{box_y + 18:g}">{escape(text)}</text>')
                x += width + _GAP
            box_y += _BOX_HEIGHT + 6
        y += height + 8
    notes = [
        "Every import of one module by another (at its top, in a function or for type checking) "
        "stays on its floor or points down"
    ]
    if upward:
        notes[0] += ", but:"
        notes += [f"{a} imports {b} ({why})" for a, b, why in upward]
    else:
        notes[0] += "."
    for note in notes:
        y += 18
        body.append(
            f'<text x="{_WIDTH / 2:g}" y="{y:g}" text-anchor="middle" font-size="12" fill="#555">'
            f"{escape(note)}</text>"
        )
    out.append(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{y + 14:g}" '
        f'font-family="Helvetica, Arial, sans-serif" font-size="13">'
    )
    title = "dblock's floors: every import points down" + (" but those listed" if upward else "")
    out.append(
        f'<text x="{_WIDTH / 2:g}" y="28" text-anchor="middle" font-size="17" font-weight="bold">'
        f"{escape(title)}</text>"
    )
    out += body
    out.append("</svg>")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str]) -> int:
    floors = read_map()
    if "--arrows" in argv:
        where = floor_of(floors)
        for imp in imports():
            if (
                imp.source in where
                and imp.target in where
                and where[imp.target][0] > where[imp.source][0]
            ):
                print(
                    f"{imp.place}: {imp.source} (floor {where[imp.source][0]}) imports "
                    f"{', '.join(imp.names)} from {imp.target} (floor {where[imp.target][0]}), "
                    f"{imp.where}"
                )
        return 0
    from tests.test_house_map import allowed_arrows  # the arrows allowed up are the test's to list

    PICTURE.write_text(picture(floors, allowed_arrows()))
    print(f"wrote {PICTURE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
