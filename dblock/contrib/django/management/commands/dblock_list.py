"""``manage.py dblock_list``: the locks held now."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandParser

from .... import _admin
from ._base import run


class Command(BaseCommand):
    help = "Show the dblock locks held now."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--prefix", default=None, help="only keys starting with this")
        parser.add_argument(
            "--json", action="store_true", help="a JSON array, as `dblock list --json`"
        )

    def handle(self, *args: Any, **options: Any) -> str:
        return run(
            lambda m: _admin.list_report(m, prefix=options["prefix"], as_json=options["json"])
        )
