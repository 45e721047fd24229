"""``manage.py dblock_release KEY --force`` (or ``--prefix P`` / ``--owner O``):
take locks from gone holders."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from .... import _admin
from ._base import run


class Command(BaseCommand):
    help = (
        "Force-release dblock locks: delete the rows of KEY, or every row whose key starts "
        "with --prefix and/or that --owner holds, whoever holds them. The holders are not "
        "told and go on without mutual exclusion; only for holders known to be gone."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("key", nargs="?", default=None)
        parser.add_argument(
            "--prefix", help="every row whose key starts with this (taken literally)"
        )
        parser.add_argument(
            "--owner",
            help="every row held by this owner, as dblock_list shows it: exactly, or every "
            "thread under HOST:PID, or every process under HOST",
        )
        parser.add_argument("--force", action="store_true", help="required")

    def handle(self, *args: Any, **options: Any) -> str:
        return run(
            lambda m: _admin.release_report(
                m,
                options["key"],
                force=options["force"],
                prefix=options["prefix"],
                owner=options["owner"],
            )
        )
