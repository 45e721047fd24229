"""``manage.py dblock_sweep``: delete rows nobody released."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from .... import _admin
from ._base import run


class Command(BaseCommand):
    help = "Delete dblock rows whose lease ended (and, with --max-age, rows held too long)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--max-age", type=float, default=None, help="also delete rows held longer (s)"
        )

    def handle(self, *args: Any, **options: Any) -> str:
        return run(lambda m: _admin.sweep_report(m, max_age=options["max_age"]))
