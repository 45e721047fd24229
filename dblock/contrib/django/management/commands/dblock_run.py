"""``manage.py dblock_run NAME [options] -- COMMAND [ARGS...]``: ``dblock run``
(its options, skip line and exit statuses; see _shell) where COMMAND is
another management command, run in this process as ``manage.py COMMAND
ARGS`` runs it: once across the hosts that all run the same line from cron
(the others skip: exit status 75, unless ``--skip-status``).

::

    # every host's crontab
    0 3 * * *  ./manage.py dblock_run clearsessions --per 1d --at-most 30m -q -- clearsessions
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from django.core.management import get_commands, load_command_class
from django.core.management.base import BaseCommand

from ._shell import ShellCommand


class Command(ShellCommand):
    name = "run"

    def runs(self, prog: str) -> Callable[[list[str]], Callable[[], int]]:
        def find(argv: list[str]) -> Callable[[], int]:
            from .....runner import EX_NOTFOUND, CommandError

            name, args = argv[0], argv[1:]
            app = get_commands().get(name)
            if app is None:
                raise CommandError(f"no such management command: {name!r}", EX_NOTFOUND)
            command = app if isinstance(app, BaseCommand) else load_command_class(app, name)

            def invoke() -> int:
                # As manage.py runs it: its parser, its messages (CommandError
                # on stderr, exit status 1), its exit status.
                try:
                    command.run_from_argv([prog, name, *args])
                except SystemExit as exc:
                    if exc.code is None or isinstance(exc.code, int):
                        return exc.code or 0
                    print(exc.code, file=sys.stderr)
                    return 1
                return 0

            return invoke

        return find
