"""The management commands that are the shell's ``dblock`` commands, run on
the project's database and lock table (``dblock.cli.Face``): the same
options, output and exit statuses as ``dblock jobs``, ``dblock stats`` and
``dblock top``. From ``manage.py`` their arguments go to the shell's parser
untouched (``--help`` included); from ``call_command`` give them as strings."""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from django.core.management.base import BaseCommand, CommandParser

from ... import get_manager


class ShellCommand(BaseCommand):
    #: The shell's command this one runs.
    name: ClassVar[str]

    @property
    def help(self) -> str:
        return f"`dblock {self.name}` on the project's lock table (`-- --help`: its options)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("argv", nargs="*", help=f"the arguments of `dblock {self.name}`")

    def run_from_argv(self, argv: list[str]) -> None:
        # Not Django's parser: the shell's own, for its options and errors
        # (manage.py has set Django up by now).
        sys.exit(self._run(argv[2:]))

    def handle(self, *args: Any, **options: Any) -> None:
        status = self._run(list(options["argv"]))
        if status:
            raise SystemExit(status)

    def _run(self, argv: list[str]) -> int:
        from .....cli import Face, main

        manager = get_manager()
        return main(
            [self.name, *argv], face=Face(url=manager.engine.url, table=manager.config.table)
        )
