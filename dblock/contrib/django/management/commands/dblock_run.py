"""``manage.py dblock_run NAME [options] -- COMMAND [ARGS...]``: run another
management command as one run of the job NAME, once across the hosts that
all run the same line from cron (the others skip: exit status 75, as
``dblock run``, unless ``--skip-status``). Options as ``dblock run``'s, plus
``--per``.

::

    # every host's crontab
    0 3 * * *  ./manage.py dblock_run clearsessions --per 1d --at-most 30m -q -- clearsessions
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError, CommandParser

from .....errors import DBLockError
from .... import _jobrun as jobrun
from ... import get_manager


def _duration(text: str) -> float:
    try:
        return jobrun.duration(text)
    except DBLockError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class Command(BaseCommand):
    help = (
        "Run a management command once across the hosts: NAME is the job's name, "
        "the command and its arguments follow --."
    )
    # What follows -- on the command line (run_from_argv); None when the
    # command is called otherwise (call_command: the command is in options).
    _after: list[str] | None = None

    def add_arguments(self, parser: CommandParser) -> None:
        help_ = jobrun.HELP
        parser.add_argument("name", help="the job's name (its key, and its row in dblock jobs)")
        parser.add_argument("--at-most", type=_duration, default=None, help=help_["at_most"])
        parser.add_argument("--at-least", type=_duration, default=0.0, help=help_["at_least"])
        parser.add_argument("--fire-time", default=None, help=help_["fire_time"])
        parser.add_argument("--per", type=_duration, default=None, help=help_["per"])
        parser.add_argument("--retry-failed", action="store_true", help=help_["retry_failed"])
        parser.add_argument("--wait", type=_duration, default=None, help=help_["wait"])
        parser.add_argument(
            "--skip-status", type=int, default=jobrun.SKIP_STATUS, help=help_["skip_status"]
        )
        parser.add_argument("-q", "--quiet", action="store_true", help=help_["quiet"])
        parser.add_argument("command", nargs="*", help="-- COMMAND [ARGS...]")

    def run_from_argv(self, argv: list[str]) -> None:
        # Everything after the first -- is the command's, options included:
        # argparse alone would give `-c` of `-- shell -c CODE` to this parser.
        self._after = None
        if "--" in argv:
            cut = argv.index("--")
            argv, self._after = argv[:cut], argv[cut + 1 :]
        super().run_from_argv(argv)

    def handle(self, *args: Any, **options: Any) -> None:
        after = self._after
        command = list(options["command"]) + (after or [])
        if not command:
            raise CommandError("dblock_run: give the command to run after --")
        run = jobrun.RunOptions(
            at_most=options["at_most"],
            at_least=options["at_least"],
            fire_time=options["fire_time"],
            per=options["per"],
            retry_failed=options["retry_failed"],
            wait=options["wait"],
            skip_status=options["skip_status"],
            quiet=options["quiet"],
        )
        try:
            status = jobrun.run_command(
                get_manager(),
                options["name"],
                run,
                lambda: call_command(command[0], *command[1:]),
                self.stderr.write,
            )
        except DBLockError as exc:  # LockArgumentError too: a usage error
            raise CommandError(str(exc)) from exc
        if status:
            sys.exit(status)
