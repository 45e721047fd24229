"""``manage.py dblock_sweep``: ``dblock sweep`` on the project's lock table (see _shell)."""

from __future__ import annotations

from ._shell import ShellCommand


class Command(ShellCommand):
    name = "sweep"
