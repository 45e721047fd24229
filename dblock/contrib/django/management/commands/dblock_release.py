"""``manage.py dblock_release KEY --force``: take a lock from a gone holder."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from .... import _admin
from ._base import run


class Command(BaseCommand):
    help = (
        "Force-release a dblock lock: delete its row whoever holds it. The holder is not "
        "told and goes on without mutual exclusion; only for holders known to be gone."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("key")
        parser.add_argument("--force", action="store_true", help="required")

    def handle(self, *args: Any, **options: Any) -> str:
        return run(lambda m: _admin.release_report(m, options["key"], force=options["force"]))
