"""The management commands that are the shell's ``dblock`` commands, run on
the project's database, lock table and index (``dblock.cli.Face``): the same
options, confirmations, output and exit statuses as ``dblock list``,
``dblock release``, ``dblock sweep``, ``dblock run``, ``dblock jobs``,
``dblock stats`` and ``dblock top``. From ``manage.py`` their arguments go to
the shell's parser untouched (``--help`` included); ``call_command`` takes
them as strings (``call_command("dblock_release", "KEY", "--force",
"--yes")``) or as keywords named as the options (``call_command("dblock_sweep",
once=True, grace="0")``). A status other than 0 ends the command with
``SystemExit``, as it ends ``manage.py``.

There is no ``dblock_migrate``: ``manage.py migrate`` creates and upgrades
dblock's table (its app's migrations), as for every other app."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any, ClassVar

from django.core.management.base import BaseCommand, CommandParser

from ... import get_manager

#: Django's own options of every command (``BaseCommand.create_parser``),
#: which ``manage.py`` has acted on before a command runs.
_DJANGO_VALUED = ("--settings", "--pythonpath")


class ShellCommand(BaseCommand):
    #: The shell's command this one runs.
    name: ClassVar[str]

    @property
    def help(self) -> str:
        from .....cli import command_help

        return f"{command_help()[self.name]} (the shell's {self.name}, on the project's lock table)"

    @property
    def stealth_options(self) -> tuple[str, ...]:
        # call_command's keywords: the shell command's options, by dest.
        return tuple(_actions(self.name))

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("argv", nargs="*", help=f"the arguments of the shell's {self.name}")

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        # call_command parses its strings here: every one of them goes to the
        # shell's parser as it is, options included (Django's would refuse
        # --force); Django's own options keep their defaults.
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        defaults = parser.parse_args

        def parse_args(args: Any = None, namespace: Any = None) -> argparse.Namespace:
            parsed: argparse.Namespace = defaults([], namespace)
            parsed.argv = [] if args is None else list(args)
            return parsed

        parser.parse_args = parse_args
        return parser

    def print_help(self, prog_name: str, subcommand: str) -> None:
        # (`manage.py help dblock_list`: the shell's help, as --help shows it.)
        self._run(["--help"], prog=f"{prog_name} {subcommand}")

    def run_from_argv(self, argv: list[str]) -> None:
        # Not Django's parser: the shell's own, for its options and errors
        # (manage.py has set Django up by now, and acted on --settings and
        # --pythonpath: dropped here).
        prog = os.path.basename(argv[0])
        prog = "python -m django" if prog == "__main__.py" else prog
        raise SystemExit(self._run(_without_django(argv[2:]), prog=f"{prog} {argv[1]}"))

    def handle(self, *args: Any, **options: Any) -> None:
        argv = list(options["argv"]) + _keywords(self.name, options)
        status = self._run(argv, prog=f"manage.py dblock_{self.name}")
        if status:
            raise SystemExit(status)

    def _run(self, argv: list[str], *, prog: str) -> int:
        from .....cli import Face, main

        manager = get_manager()
        face = Face(
            url=manager.engine.url,
            table=manager.names.table,
            index=manager.names.index,
            prog=prog,
            run=self.runs(prog.rsplit(" ", 1)[0]),
        )
        return main([self.name, *argv], face=face)

    def runs(self, prog: str) -> Callable[[list[str]], Callable[[], int]] | None:
        """What ``run`` runs after ``--`` (only ``dblock_run`` runs anything)."""
        return None


def _without_django(argv: list[str]) -> list[str]:
    out: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "--":
            out.append(word)
            out.extend(words)
            break
        if word in _DJANGO_VALUED:
            next(words, None)
            continue
        if word.startswith(tuple(f"{name}=" for name in _DJANGO_VALUED)):
            continue
        out.append(word)
    return out


def _actions(name: str) -> dict[str, argparse.Action]:
    """The options and arguments of ``dblock NAME``, by dest."""
    from .....cli import build_parser, commands

    found = commands(build_parser()).get(name)
    if found is None:
        return {}
    return {a.dest: a for a in found[2] if a.dest not in ("help", "argv")}


def _keywords(name: str, options: dict[str, Any]) -> list[str]:
    """call_command's keywords as the shell's words (``once=True`` -> ``--once``,
    ``grace="0"`` -> ``--grace 0``, ``key="k"`` -> ``k``)."""
    words: list[str] = []
    for dest, action in _actions(name).items():
        if dest not in options or options[dest] is None or options[dest] is False:
            continue
        value = options[dest]
        if not action.option_strings:
            words.append(str(value))
        elif value is True:
            words.append(max(action.option_strings, key=len))
        else:
            words += [max(action.option_strings, key=len), str(value)]
    return words
