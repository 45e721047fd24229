"""docs/internals.md's module map is the import graph of dblock/, floor by floor (issue 44, item 5).

The map is the table between the ``house map`` comments in docs/internals.md
(see ``tests/support/house_map.py`` for how it is read). Against the imports
of ``dblock/`` read with ``ast``, this fails when

* a module of ``dblock/`` has no row in the map (it says which floor fits);
* a row names a module that does not exist (it says which line);
* an import runs up a floor and is not one of :data:`ALLOWED_UP` (it names
  the file, line and what is imported, and the ways out);
* an arrow of :data:`ALLOWED_UP` is no longer drawn by any import, or there
  are more than three of them (issue 44's target);
* two modules the map names apart import each other, directly or round a
  circle (one that an arrow of :data:`ALLOWED_UP` closes aside);
* a module imports an underscored name of a module in another package;
* the picture of the floors, ``docs/img/floors.svg``, is not the one the map
  draws. Draw it again with::

      .venv/bin/python -m tests.support.house_map

Every import counts, wherever it runs: at a module's top, inside a function
(it runs later, but the module still needs the one it imports to work: a
function-level import is how a cycle is hidden, not removed) and under
``if TYPE_CHECKING:``. A type-only import runs nothing, but it is the same
dependency for a reader: to understand the lower module one must read the
higher one, and mypy checks the lower floor against the higher floor's
code. Where a lower floor needs something of a higher one, the house's way
is a ``Protocol`` on the lower floor (``renewal.Renewable``,
``sweeper.SweepHost``, ...), which costs nothing at run time either, so
type-only imports get no pass of their own. The failure message says which
kind an import is, so a maintainer sees at once whether it runs.

Importing ``dblock.a.b`` also runs ``dblock/__init__.py`` and
``dblock/a/__init__.py`` first; that is Python's doing, not a dependency the
code chose, and draws no arrow. A literal ``importlib.import_module("dblock.x")``
draws one; ``_store/__init__.py`` loads its dialect modules by a computed
name, all on its own floor.
"""

from __future__ import annotations

import graphlib
from collections import defaultdict

import pytest

from tests.support import house_map as hm

#: The imports allowed to run up a floor, (importer, imported) as dotted
#: module names, each with why (the picture prints the reason). Issue 44's
#: target: at most 3. Remove an entry as soon as its import is gone: the
#: test fails while an entry is drawn by no import.
ALLOWED_UP: dict[tuple[str, str], str] = {}


def path(module: str) -> str:
    """``dblock._store.base`` -> ``dblock/_store/base.py``."""
    return hm.modules()[module].relative_to(hm.ROOT).as_posix()


def entry(module: str) -> str:
    """How the map writes a module: its path under dblock/."""
    return path(module).removeprefix("dblock/")


def floor_names(floors: list[hm.Floor]) -> dict[int, str]:
    return {f.number: f.name for f in floors}


@pytest.fixture(scope="module")
def floors() -> list[hm.Floor]:
    return hm.read_map()


@pytest.fixture(scope="module")
def imports() -> list[hm.Import]:
    return hm.imports()


KINDS = {"module": "at import", "function": "inside a function", "typing": "for type checking only"}


def unmapped(floors: list[hm.Floor], imports: list[hm.Import]) -> list[str]:
    """A line per module of dblock/ without a row, with the floors it fits."""
    where = hm.floor_of(floors)
    names = floor_names(floors)
    problems = []
    for module in hm.modules():
        if module in where:
            continue
        # The floors it fits: at or above every floor it imports from, at or
        # below every floor that imports it.
        uses = {where[i.target][0] for i in imports if i.source == module and i.target in where}
        used = {where[i.source][0] for i in imports if i.target == module and i.source in where}
        low, high = max(uses, default=1), min(used, default=max(names))
        if low == high:
            fits = f"floor {low} ({names[low]})"
        elif low < high:
            fits = f"one of floors {low} ({names[low]}) to {high} ({names[high]})"
        else:
            fits = (
                f"floor {low} ({names[low]}), after moving its importers on floor {high} up "
                "(or what it imports down)"
            )
        problems.append(
            f"{path(module)} has no row in the module map of docs/internals.md: add the row "
            f"`| | `{entry(module)}` | what it holds |` to {fits}"
        )
    return problems


def missing(floors: list[hm.Floor]) -> list[str]:
    """A line per name in the map that is no module (or folder) of dblock/, or is there twice."""
    problems = []
    seen: dict[str, int] = {}
    for floor in floors:
        for row in floor.rows:
            for name in row.modules:
                target = hm.PACKAGE / name
                if name.endswith("/") and not target.is_dir():
                    problems.append(
                        f"docs/internals.md:{row.line}: the map names `{name}`, and dblock/{name} "
                        "is no folder: take it out of the row, or write where its modules went"
                    )
                elif not name.endswith("/") and not (name.endswith(".py") and target.is_file()):
                    problems.append(
                        f"docs/internals.md:{row.line}: the map names `{name}`, and dblock/{name} "
                        "is no module: take it out of the row, or write where it went"
                    )
                if name in seen:
                    problems.append(
                        f"docs/internals.md:{row.line}: `{name}` is in the map twice "
                        f"(line {seen[name]} too): keep one"
                    )
                seen[name] = row.line
    return problems


def upward(floors: list[hm.Floor], imports: list[hm.Import]) -> list[str]:
    """A line per import that runs up a floor and is not in ALLOWED_UP, with the ways out."""
    where = hm.floor_of(floors)
    names = floor_names(floors)
    importers: dict[str, set[str]] = defaultdict(set)
    for i in imports:
        importers[i.target].add(i.source)
    problems = []
    for i in imports:
        if i.source not in where or i.target not in where:
            continue  # a module without a row: unmapped() names it
        low, high = where[i.source][0], where[i.target][0]
        if high <= low or (i.source, i.target) in ALLOWED_UP:
            continue
        below = sorted(entry(s) for s in importers[i.source] if s in where and where[s][0] < high)
        mover = f"move `{entry(i.source)}`"
        move_up = (
            f"{mover}'s row up to floor {high} ({names[high]}) in docs/internals.md"
            if not below
            else f"{mover} up (but {', '.join(below)}, below floor {high}, import it)"
        )
        problems.append(
            f"{i.place}: {entry(i.source)} (floor {low}, {names[low]}) imports "
            f"{', '.join(i.names)} from {entry(i.target)} (floor {high}, {names[high]}), "
            f"{KINDS[i.where]}. Move what it imports down to floor {low} or below, name what "
            f"it needs as a Protocol on floor {low}, or {move_up}"
        )
    return problems


def test_every_module_of_dblock_has_a_row(floors: list[hm.Floor], imports: list[hm.Import]) -> None:
    problems = unmapped(floors, imports)
    assert not problems, "\n".join(problems)


def test_every_row_names_a_module_that_exists(floors: list[hm.Floor]) -> None:
    problems = missing(floors)
    assert not problems, "\n".join(problems)


def test_no_import_runs_up_a_floor(floors: list[hm.Floor], imports: list[hm.Import]) -> None:
    problems = upward(floors, imports)
    assert not problems, "\n".join(problems)


def test_the_allowed_arrows_up_are_few_and_each_still_drawn(
    floors: list[hm.Floor], imports: list[hm.Import]
) -> None:
    assert len(ALLOWED_UP) <= 3, "issue 44: at most 3 arrows that run back up a floor"
    where = hm.floor_of(floors)
    drawn = {
        (i.source, i.target)
        for i in imports
        if i.source in where and i.target in where and where[i.target][0] > where[i.source][0]
    }
    gone = [
        f"ALLOWED_UP allows {a} -> {b}, and no import runs up from {a} to {b} any more: "
        "remove the entry and draw the picture again (python -m tests.support.house_map)"
        for a, b in ALLOWED_UP
        if (a, b) not in drawn
    ]
    assert not gone, "\n".join(gone)


def test_no_import_circle(floors: list[hm.Floor], imports: list[hm.Import]) -> None:
    """No circle between modules the map names apart.

    Not counted: the arrows of ALLOWED_UP (an import up a floor closes a
    circle as soon as the floor above reaches the importer by imports down),
    and imports inside a folder the map names as one row (``contrib/``: the
    map says nothing of its inside; today contrib/django/__init__.py and
    contrib/django/apps.py import each other inside functions).
    """
    where = hm.floor_of(floors)
    graph: dict[str, set[str]] = defaultdict(set)
    lines: dict[tuple[str, str], str] = {}
    for i in imports:
        if (i.source, i.target) in ALLOWED_UP:
            continue
        rows = (where.get(i.source), where.get(i.target))
        if rows[0] is not None and rows[0] == rows[1] and rows[0][1].modules[0].endswith("/"):
            continue
        graph[i.source].add(i.target)
        lines.setdefault((i.source, i.target), f"{i.place} ({', '.join(i.names)})")
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        circle = e.args[1]  # [a, b, ..., a]: each is imported by the next
        steps = [
            f"{circle[n]} is imported by {circle[n + 1]} at {lines[(circle[n + 1], circle[n])]}"
            for n in range(len(circle) - 1)
        ]
        pytest.fail("an import circle:\n" + "\n".join(steps))


def package_of(module: str) -> str:
    """The package a module is in (a package's ``__init__`` is in the package itself)."""
    return module if hm.modules()[module].name == "__init__.py" else module.rpartition(".")[0]


def test_no_module_imports_another_packages_private_name(imports: list[hm.Import]) -> None:
    """docs/internals.md: an underscored name in a module is its package's own.

    An underscored *module* (``_threads.py``, ``_store/``) is private to the
    package it is in, subpackages included, which the imports above already
    keep inside dblock/: this is about the names in a module.
    """
    known = hm.modules()
    problems = [
        f"{i.place}: {entry(i.source)} imports {name} from {entry(i.target)}, a private name of "
        f"another package ({package_of(i.target)}): give it a name without the underscore "
        "(a documented in-package name or a Protocol), or move the importer beside it"
        for i in imports
        for name in i.names
        if name.startswith("_")
        and not name.startswith("__")
        and f"{i.target}.{name}" not in known
        and not i.target.endswith(f".{name}")  # the module itself: the floors keep those
        and package_of(i.source) != package_of(i.target)
    ]
    assert not problems, "\n".join(problems)


def allowed_arrows() -> list[tuple[str, str, str]]:
    """ALLOWED_UP as the picture prints it."""
    return [(entry(a), entry(b), why) for (a, b), why in ALLOWED_UP.items()]


def test_the_picture_is_drawn_from_the_map(floors: list[hm.Floor]) -> None:
    assert hm.PICTURE.read_text() == hm.picture(floors, allowed_arrows()), (
        f"{hm.PICTURE.relative_to(hm.ROOT)} is not the map's picture: draw it again with "
        ".venv/bin/python -m tests.support.house_map"
    )


def test_the_messages_name_the_module_and_the_import(
    floors: list[hm.Floor], imports: list[hm.Import]
) -> None:
    """On the map with a name misspelt, and one module put on the ground floor.

    Compared with what the map as written gives, so that a module someone
    is adding right now does not fail this test too (the tests above do).
    """
    text = hm.DOC.read_text()
    wrong = hm.read_map(text.replace("`keys.py`", "`keys_gone.py`", 1))
    problems = sorted(set(unmapped(wrong, imports)) - set(unmapped(floors, imports)))
    assert problems == [
        "dblock/keys.py has no row in the module map of docs/internals.md: add the row "
        "`| | `keys.py` | what it holds |` to floor 1 (ground)"
    ], problems
    problems = sorted(set(missing(wrong)) - set(missing(floors)))
    assert len(problems) == 1, problems
    assert problems[0].startswith("docs/internals.md:"), problems
    assert "`keys_gone.py`, and dblock/keys_gone.py is no module" in problems[0], problems

    grounded = text.replace("`lock.py`", "`lock_gone.py`", 1).replace(
        "| 1 ground | `errors.py` |", "| 1 ground | `errors.py`, `lock.py` |", 1
    )
    problems = sorted(set(upward(hm.read_map(grounded), imports)) - set(upward(floors, imports)))
    assert problems, "lock.py on the ground floor imports the core and the store above it"
    for problem in problems:
        assert problem.startswith("dblock/lock.py:"), problem
        assert " (floor 1, ground) imports " in problem, problem
        assert "Move what it imports down to floor 1 or below" in problem, problem
