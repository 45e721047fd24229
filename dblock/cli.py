"""The ``dblock`` command line: the admin side of dblock.

Every command takes the database from ``--url`` or ``$DBLOCK_URL`` (default:
the SQLite file ``./dblock.sqlite3``, except for ``dblock run``, which
coordinates hosts and so requires one) and the lock table from ``--table``.
URLs are printed and logged with the password masked. User mistakes and
unreachable databases end in one clear line on stderr and a non-zero exit
code, never a traceback:

* 0: done; 1: the database refused or failed (unreachable, no lock table, a
  check failed, nothing to release); 2: bad arguments.
* ``dblock run`` exits with its command's status, or 75 when skipped (see
  :mod:`dblock.runner` for the full list).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import functools
import getpass
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import NoReturn, TypeAlias

from sqlalchemy import URL

from . import __version__, migrations
from ._engine import ENV_URL, check_url, file_database, mask, mask_text, resolve_url
from ._store.admin import LockRow, LockStats, TableHealth, filter_phrase, rows_json
from ._store.jobs import RunRow
from .config import Config, check_lease
from .errors import DBLockError, JobSkipped, LockArgumentError, SchemaMissing, install_hint
from .keys import MAX_KEY_LENGTH, check_filter, check_key
from .manager import LockManager
from .schema import RUNNING, TableNames
from .sweeper import Sweeper, SweeperConfig

__all__ = ["Face", "main", "parse_args", "parse_duration"]

log = logging.getLogger("dblock.cli")

Command = Callable[[argparse.Namespace], int]

_LIST_LIMIT = 1000


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is one line (and exit code 2), not usage + error."""

    def error(self, message: str) -> NoReturn:
        # argparse quotes the arguments it refuses, a --url among them, and
        # may quote a long one: shortened (see quoted()).
        message = shortened(mask_text(message))
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# argparse's subcommand action has no public name; the one reference to it
# (for type checking only: it is generic in typeshed, not at run time).
_Subcommands: TypeAlias = "argparse._SubParsersAction[_Parser]"


@dataclasses.dataclass(frozen=True)
class Face:
    """Another command line that runs these commands on its application's
    database (``flask dblock``, ``manage.py dblock_*``): its manager's URL
    (password included), lock table and index name are what ``--url``,
    ``--table`` and ``--index`` default to; the commands, their options,
    output and exit statuses are the shell's own.

    ``prog``: how the face names the command in its usage and refusals
    (``flask dblock list``, ``manage.py dblock_list``). ``run``: what
    ``run`` runs after ``--`` in that face, a command of the application's
    own run in this process instead of a program: given the command's words,
    a callable that runs it and returns its exit status, or
    :class:`~dblock.runner.CommandError` (before anything is taken) when the
    application has no such command."""

    url: URL
    table: str
    index: str | None = None
    prog: str | None = None
    run: Callable[[list[str]], Callable[[], int]] | None = None


#: The commands the other faces have, with the shell's options, output and
#: exit statuses (``lead`` and ``demo`` are the shell's alone: a supervisor
#: of programs and a self-check of a clone).
FACE_COMMANDS = ("migrate", "list", "stats", "release", "sweep", "top", "run", "jobs")


def command_help() -> dict[str, str]:
    """Each command's one line of help, as ``dblock --help`` lists it."""
    return {name: text for name, (_, text, _) in commands(build_parser()).items()}


def commands(
    parser: argparse.ArgumentParser,
) -> dict[str, tuple[argparse.ArgumentParser, str, list[argparse.Action]]]:
    """``parser``'s subcommands: name -> (its parser, its one line of help,
    its options and arguments). The one place argparse's internals are read:
    it has no public way to list a parser's subcommands, their help or
    their actions, which the faces need (their help, ``call_command``'s
    keywords) and the unknown-option check reads beside ``option_strings``."""
    found: dict[str, tuple[argparse.ArgumentParser, str, list[argparse.Action]]] = {}
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        helps = {c.dest: c.help or "" for c in getattr(action, "_choices_actions", ())}
        for name, sub in getattr(action, "choices", {}).items():
            found[name] = (sub, helps.get(name, ""), list(sub._actions))
    return found


def option_strings(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """``parser``'s own options by each spelling (argparse's, read here: see
    :func:`commands`)."""
    return dict(parser._option_string_actions)


def main(argv: Sequence[str] | None = None, *, face: Face | None = None) -> int:
    if not faulthandler.is_enabled():
        # A crash in native code (the interpreter, a driver) says where, on
        # stderr, instead of a bare exit status -11 for whoever runs the job.
        with contextlib.suppress(Exception):  # (stderr closed: nothing to say it on)
            faulthandler.enable()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv, face=face)
    if face is not None:
        if args.url is None:
            args.url = face.url
        if not _given("--table", argv):
            args.table = face.table
        if face.index is not None and getattr(args, "index", None) is None:
            args.index = face.index
    bad = _undecodable(args)
    if bad is not None:
        print(f"dblock: error: {bad}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("dblock").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    command: Command = args.command
    args.face = face
    try:
        return command(args)
    except LockArgumentError as exc:
        print(f"dblock: error: {shortened(str(exc))}", file=sys.stderr)
        return 2
    except DBLockError as exc:
        print(f"dblock: error: {shortened(str(exc))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("dblock: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `dblock list | head`: the reader left, nothing to report
        sys.stdout = None  # no flush (and error) at exit
        return 1


def _given(option: str, argv: Sequence[str]) -> bool:
    head = list(argv)[: list(argv).index("--")] if "--" in argv else argv
    return any(a == option or a.startswith(f"{option}=") for a in head)


def parse_args(argv: Sequence[str], *, face: Face | None = None) -> argparse.Namespace:
    """The ``dblock`` command line ``argv`` parsed (exits 2 on a mistake, as
    argparse does). For ``dblock run … -- COMMAND …`` everything after the
    first ``--`` is the command, untouched: argparse alone would give options
    written after KEY to no one. In another ``face``, its help and refusals
    name the command as that face does, and the defaults it gives."""
    parser = build_parser()
    if face is not None and argv:
        _in_face(parser, argv[0], face)
    argv = _negative_values(list(argv))
    unknown = _unknown_option(parser, argv)
    if unknown is not None:
        parser.error(f"unrecognized option {unknown!r} before the command")
    if "--" in argv:
        cut = argv.index("--")
        head, tail = argv[:cut], argv[cut + 1 :]
        if "run" in head or "lead" in head:
            args = parser.parse_args(head)
            if args.command is cmd_run or args.command is cmd_lead:
                args.argv = [*args.argv, *tail]
                return args
    return parser.parse_args(argv)


def _in_face(parser: argparse.ArgumentParser, name: str, face: Face) -> None:
    """Command ``name``'s help and refusals as ``face`` shows them."""
    found = commands(parser).get(name)
    if found is not None:
        sub, _, actions = found
        if face.prog is not None:
            # (Its mistakes are said by the subcommand's parser or, for
            # arguments left over, by the top one: both named so.)
            parser.prog = sub.prog = face.prog
        for option in actions:
            if "--url" in option.option_strings:
                option.help = "database URL (default: the application's)"
            elif "--table" in option.option_strings:
                option.help = f"lock table name (default: the application's, {face.table})"


#: The options whose value is a duration: a value written negative (``--at-most
#: -5s``) is taken as their value, and refused as negative by its type, rather
#: than taken by argparse for an option of its own ("expected one argument").
_DURATION_OPTIONS = frozenset(
    (
        "--at-most",
        "--at-least",
        "--wait",
        "--per",
        "--every",
        "--grace",
        "--max-hold",
        "--lock-ttl",
        "--runs-retention",
        "--interval",
    )
)
_NEGATIVE = re.compile(r"-\s*[\d.]")


def _negative_values(argv: list[str]) -> list[str]:
    """``--at-most -5s`` as ``--at-most=-5s`` (up to a ``--``: the command's
    arguments are its own)."""
    out: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "--":
            out.append(word)
            out.extend(words)
            break
        if word in _DURATION_OPTIONS:
            value = next(words, None)
            if value is not None and _NEGATIVE.match(value):
                out.append(f"{word}={value}")
                continue
            out.append(word)
            if value == "--":  # (no value: argparse says so) the command's, untouched
                out.append(value)
                out.extend(words)
                break
            if value is not None:
                out.append(value)
            continue
        out.append(word)
    return out


def _unknown_option(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """An option before the command that ``dblock`` does not have (``dblock
    --tabel x list``): argparse would take its value for the command and
    say "invalid choice: 'x'"."""
    known = option_strings(parser)
    words = iter(argv)
    for word in words:
        if word == "--" or not word.startswith("-") or word == "-":
            return None  # the command (or a positional argparse refuses itself)
        name, _, value = word.partition("=")
        # argparse takes an unambiguous prefix (--ur for --url), so do we.
        matches = [o for o in known if o == name]
        if not matches and name.startswith("--"):
            matches = [o for o in known if o.startswith(name)]
        if not matches:
            return name
        if len(matches) > 1:
            return None  # ambiguous: argparse says so
        if known[matches[0]].nargs != 0 and not value:
            next(words, None)  # its value
    return None


def _add_common(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """``--url``, ``--table`` and ``-v``: accepted before the command (``dblock
    --url U list``, as git and alembic do) and after it. After it, they have no
    default of their own, so they never overwrite a value given before."""

    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument(
        "--url",
        default=default(None),
        help=f"database URL (default: ${ENV_URL}, else sqlite:///dblock.sqlite3; "
        "dblock run has no default)",
    )
    parser.add_argument(
        "--table", default=default("dblock_locks"), help="lock table name (default: dblock_locks)"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        default=default(False),
        help="log debug messages; list and stats: also acquired and expiry times; release: who",
    )


def build_parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    _add_common(common, defaults=False)

    parser = _Parser(prog="dblock", description="Distributed locks in your relational database.")
    parser.add_argument("--version", action="version", version=f"dblock {__version__}")
    _add_common(parser, defaults=True)
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", required=True)

    _add_tables(sub, common)
    _add_release(sub, common)
    _add_sweep(sub, common)
    _add_top(sub, common)
    _add_jobs(sub, common)
    _add_demo(sub, common)
    return parser


def _add_tables(sub: _Subcommands, common: _Parser) -> None:
    """``migrate``, ``list`` and ``stats``: the table and what it holds."""
    migrate = sub.add_parser(
        "migrate", parents=[common], help="create or upgrade the lock table (alembic)"
    )
    migrate.add_argument(
        "--index",
        default=None,
        help="name of the expires_at index (default: <table>_expires_at_idx)",
    )
    migrate.add_argument(
        "--sql",
        action="store_true",
        help="print the DDL for a DBA instead of running it: from the revision the database "
        "is at (read from it) to the latest",
    )
    migrate.add_argument(
        "--from",
        dest="from_revision",
        metavar="REV",
        help="with --sql: from this revision instead, without connecting (offline, as "
        "alembic's REV:head; 'base' for an empty database)",
    )
    migrate.set_defaults(command=cmd_migrate)

    listing = sub.add_parser(
        "list", parents=[common], help="the lock rows: key, owner, age, lease left, fence"
    )
    listing.add_argument("--json", action="store_true", help="a JSON array, for scripts")
    listing.add_argument("--prefix", help="only keys starting with this (taken literally)")
    listing.add_argument(
        "--limit",
        type=_positive_int,
        default=_LIST_LIMIT,
        help=f"show at most this many rows, oldest first (default {_LIST_LIMIT})",
    )
    listing.set_defaults(command=cmd_list)

    stats = sub.add_parser("stats", parents=[common], help="rows held, expired, the oldest")
    stats.add_argument("--json", action="store_true", help="a JSON object, for scripts")
    stats.set_defaults(command=cmd_stats)


def _add_release(sub: _Subcommands, common: _Parser) -> None:
    release = sub.add_parser(
        "release", parents=[common], help="delete a lock row, whoever holds it (--force)"
    )
    release.add_argument(
        "key", metavar="KEY", nargs="?", help="the lock key (or --prefix / --owner instead)"
    )
    _add_release_many(release)
    release.add_argument(
        "--force", action="store_true", help="required: the holder is not asked and gets LockLost"
    )
    release.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    release.set_defaults(command=cmd_release)


def _add_sweep(sub: _Subcommands, common: _Parser) -> None:
    sweep = sub.add_parser(
        "sweep", parents=[common], help="delete rows whose lease expired (once, or every N)"
    )
    when = sweep.add_mutually_exclusive_group(required=True)
    when.add_argument("--once", action="store_true", help="one run, then exit")
    when.add_argument(
        "--every",
        type=_positive_duration,
        metavar="DURATION",
        help="run every DURATION (30s, 5m, ...) until SIGTERM or Ctrl-C",
    )
    sweep.add_argument(
        "--grace", type=parse_duration, help="delete a row this long after its lease ended (5s)"
    )
    sweep.add_argument(
        "--max-hold",
        type=parse_duration,
        help="also delete rows held longer than this, live or not, with a warning (off)",
    )
    sweep.add_argument("--batch-size", type=_positive_int, help="rows per DELETE (500)")
    sweep.add_argument(
        "--lock-ttl", type=parse_duration, help="lease of the sweeper's own lock (10s)"
    )
    sweep.add_argument(
        "--runs-retention",
        type=parse_duration,
        help="delete job runs (dblock jobs) started longer ago than this (30d)",
    )
    sweep.add_argument(
        "--vacuum-dead",
        type=_vacuum_dead,
        help="PostgreSQL: VACUUM the table after a run once it has this many dead rows "
        "(1000; 'off': leave it to autovacuum)",
    )
    sweep.set_defaults(command=cmd_sweep)


def _add_top(sub: _Subcommands, common: _Parser) -> None:
    top = sub.add_parser(
        "top",
        parents=[common],
        help="the lock rows, refreshing in the terminal (needs the top extra: rich)",
        description="A live view of the lock table. Keys: a/l/k/f sort by age, lease, key, "
        "fence; x expired only; / key prefix; r refresh; q quit.",
    )
    top.add_argument("--prefix", default="", help="only keys starting with this")
    top.add_argument(
        "--sort",
        default="age",
        choices=["age", "lease", "key", "fence"],
        help="initial order (default: age, oldest first)",
    )
    top.add_argument("--expired", action="store_true", help="start with expired rows only")
    top.add_argument(
        "--interval", type=parse_duration, default=1.0, help="refresh every DURATION (1s)"
    )
    top.add_argument("--limit", type=_positive_int, default=200, help="rows read per refresh (200)")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.set_defaults(command=cmd_top)


def _add_demo(sub: _Subcommands, common: _Parser) -> None:
    demo = sub.add_parser(
        "demo",
        parents=[common],
        help="several processes x threads contending for a few users; checks exclusion",
        description="Starts PROCESSES processes of THREADS threads; each thread makes REQUESTS "
        "requests for the lock of one of USERS users (some fail-fast, some waiting) and "
        "checks that no two holders of a user's lock ever overlapped. Prints how many "
        "requests were granted, refused at level 1 (in the process, no SQL) or level 2 (by "
        "the database), and the SQL statements sent. Exit 0 if exclusion held. Runs on the "
        "SQLite file ./dblock.sqlite3 unless --url (or $DBLOCK_URL) says otherwise.",
    )
    demo.add_argument(
        "--processes", type=_positive_int, default=4, help="worker processes (default 4)"
    )
    demo.add_argument(
        "--threads", type=_positive_int, default=4, help="threads per process (default 4)"
    )
    demo.add_argument(
        "--users", type=_positive_int, default=5, help="distinct lock keys, user:N (default 5)"
    )
    demo.add_argument(
        "--requests", type=_positive_int, default=50, help="requests per thread (default 50)"
    )
    demo.set_defaults(command=cmd_demo)


def _add_release_many(release: _Parser) -> None:
    release.add_argument(
        "--prefix", help="every row whose key starts with this (taken literally, case-sensitive)"
    )
    release.add_argument(
        "--owner",
        help="every row held by this owner, as `dblock list` shows it: exactly, or every "
        "thread under HOST:PID, or every process under HOST",
    )


def _add_run(sub: _Subcommands, common: _Parser) -> None:
    """``run``: a command as one run of a job (dblock.runner)."""
    from .runner import EX_TEMPFAIL

    run = sub.add_parser(
        "run",
        parents=[common],
        help="run a command on one host of the cluster at a time (a cluster-wide flock)",
        description="Run COMMAND as one run of the job KEY (lock job:KEY): if another host "
        "runs it, or ran it less than --at-least ago, skip it and exit with the skip "
        f"status ({EX_TEMPFAIL}). Signals are passed on to the command; the lease is "
        "renewed while it runs; the exit status is the command's. The database every "
        f"host shares is required: --url or ${ENV_URL} (no default; an explicit "
        "sqlite:///FILE for one host). For cron: "
        "`dblock run nightly-cleanup --at-least 5m -- /usr/local/bin/cleanup`, with "
        f"{ENV_URL}=... set in the crontab.",
        epilog=f"Exit status: the command's (128+N if signal N ended it); {EX_TEMPFAIL} "
        "skipped (--skip-status); 2 bad arguments and 127/126 command not found/not "
        "executable, before anything is taken; 1 the database failed; 128+N signal N "
        "before the command started.",
    )
    run.add_argument("key", metavar="KEY", help="the job's name (its lock key is job:KEY)")
    run.add_argument(
        "--at-most",
        type=_signed_duration,
        metavar="DURATION",
        help="lease of the job's lock, renewed while the command runs: how long a host "
        "that dies mid-run keeps the job from running elsewhere (default: the lock ttl, 30s, "
        "or --at-least if that is longer)",
    )
    run.add_argument(
        "--at-least",
        type=_signed_duration,
        default=0.0,
        metavar="DURATION",
        help="keep the job's key this long after the run began, however soon the command "
        "ends, so a late firing elsewhere skips (database time; default 0)",
    )
    run.add_argument(
        "--wait",
        type=_signed_duration,
        default=None,
        metavar="DURATION",
        help="wait this long for the key before skipping (default: skip at once; with "
        "--fire-time or --per, wait up to --at-most for a run of another fire time)",
    )
    run.add_argument(
        "--fire-time",
        type=_fire_time,
        metavar="ISO8601",
        help="run once per this scheduled time (e.g. 2026-11-25T03:00Z): a fire time that "
        "already ran anywhere is skipped",
    )
    run.add_argument(
        "--per",
        type=_period,
        metavar="DURATION",
        help="run once per period of this long: the fire time is this host's clock rounded "
        "down to a multiple of it (for a cron line: its period, e.g. 1d; see docs/jobs.md)",
    )
    run.add_argument(
        "--retry-failed",
        action="store_true",
        help="with --fire-time or --per: run a fire time again whose run failed or died",
    )
    run.add_argument(
        "--skip-status",
        type=_status,
        default=EX_TEMPFAIL,
        metavar="N",
        help=f"exit status when skipped (default {EX_TEMPFAIL}, EX_TEMPFAIL; as flock -E)",
    )
    run.add_argument(
        "-q", "--quiet", action="store_true", help="say nothing when skipped (cron mails output)"
    )
    run.add_argument("argv", nargs="*", metavar="-- COMMAND", help="what to run, after --")
    run.set_defaults(command=cmd_run)


def _add_lead(sub: _Subcommands, common: _Parser) -> None:
    """``lead``: a command run while this host leads a role (dblock.leader)."""
    lead = sub.add_parser(
        "lead",
        parents=[common],
        help="run a command while this host leads a role (one leader across the cluster)",
        description="Stand for election as leader of ROLE (lock leader:ROLE) and run COMMAND "
        "while leading, in a process group of its own, with DBLOCK_LEADER_ROLE, "
        "DBLOCK_LEADER_FENCE (the term's fence: greater than every earlier term's) and "
        "DBLOCK_LEADER_TOKEN in its environment. If leadership is lost, the group gets "
        "SIGTERM, then SIGKILL after --grace, and this host stands again. When the command "
        "ends by itself, leadership is given up at once (a standby takes over without "
        "waiting for the lease) and its exit status is returned. Signals are passed on to "
        "the command; on Linux its whole group dies with dblock lead, even by kill -9. "
        f"The database every host shares is required: --url or ${ENV_URL}. For a systemd unit or a "
        "container sidecar: `dblock lead outbox-relay -- /usr/local/bin/relay`.",
        epilog="Exit status: the command's (128+N if signal N ended it); 2 bad arguments and "
        "127/126 command not found/not executable, before standing; 1 the database failed; "
        "128+N signal N while standing by (nothing ran).",
    )
    lead.add_argument("role", metavar="ROLE", help="the role's name (its lock key is leader:ROLE)")
    lead.add_argument(
        "--ttl",
        type=_signed_duration,
        default=None,
        metavar="DURATION",
        help="the term's lease, renewed while this host leads: how long a leader that dies "
        "keeps the role from a standby (default: the lock ttl, 30s)",
    )
    lead.add_argument(
        "--grace",
        type=_signed_duration,
        default=5.0,
        metavar="DURATION",
        help="seconds between SIGTERM and SIGKILL to the command's group once leadership is "
        "lost (default 5s; keep it well under --ttl)",
    )
    lead.add_argument("argv", nargs="*", metavar="-- COMMAND", help="what to run, after --")
    lead.set_defaults(command=cmd_lead)


def _add_jobs(sub: _Subcommands, common: _Parser) -> None:
    _add_run(sub, common)
    _add_lead(sub, common)
    jobs = sub.add_parser(
        "jobs",
        parents=[common],
        help="the jobs' runs: last run, who ran it, outcome, duration, next fire",
    )
    jobs.add_argument("job", nargs="?", metavar="JOB", help="the recent runs of this job only")
    jobs.add_argument("--json", action="store_true", help="a JSON array, for scripts")
    jobs.add_argument(
        "--limit", type=_positive_int, default=20, help="with JOB: this many runs (20)"
    )
    jobs.set_defaults(command=cmd_jobs)


# -- argument types ------------------------------------------------------------

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\Z")


def parse_duration(text: str) -> float:
    """Seconds from ``"30"``, ``"30s"``, ``"500ms"``, ``"5m"``, ``"2h"``, ``"1d"``."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"a duration cannot be negative: {text!r}")
    match = _DURATION.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"not a duration: {text!r} (write e.g. 30s, 500ms, 5m, 2h)"
        )
    return float(match.group(1)) * _UNITS[match.group(2) or "s"]


def _positive_duration(text: str) -> float:
    """A duration more than zero: refused by argparse, as a malformed one is,
    so ``--every 0`` and ``--every 5x`` are named the same way."""
    seconds = parse_duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0: {text!r}")
    return seconds


def _signed_duration(text: str) -> float:
    """A duration that may be written negative (``--at-most -5s``, see
    :func:`_negative_values`), so the job's own check names what is wrong
    with it, as the API does (``at_most must be a duration > 0``)."""
    text = text.strip()
    return -parse_duration(text[1:]) if text.startswith("-") else parse_duration(text)


def _period(text: str) -> float:
    """``--per``: a period of at least a second (see dblock.runner.period_fire_time)."""
    seconds = parse_duration(text)
    if seconds < 1:
        raise argparse.ArgumentTypeError(f"a period must be at least 1s, got {text!r}")
    return seconds


def _fire_time(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not an ISO 8601 time: {text!r} (write e.g. 2026-11-25T03:00Z)"
        ) from None
    if value.tzinfo is None:
        raise argparse.ArgumentTypeError(
            f"a fire time needs its UTC offset: {text!r} (e.g. 2026-11-25T03:00Z or +01:00)"
        )
    return value


def _status(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value <= 255:
        raise argparse.ArgumentTypeError(f"an exit status is 0 to 255, got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _names(args: argparse.Namespace) -> TableNames:
    # Config validates the names before they get near any SQL.
    return TableNames.of(Config(table=args.table, index=getattr(args, "index", None)))


def _manager(args: argparse.Namespace) -> LockManager:
    """A manager for a command that reads or changes existing rows: it never
    creates the database (an SQLite file, or its directories)."""
    table = _names(args).table
    url = resolve_url(args.url)
    if file_database(url):
        database = url.database or ""
        if database and not database.startswith("file:") and database != ":memory:":
            path = Path(database).expanduser()
            if not path.is_file():
                raise DBLockError(
                    f"the SQLite database {mask(url)} does not exist (no file {str(path)!r}); "
                    "`dblock migrate` creates it"
                )
    return LockManager(url, table=table)


def _undecodable(args: argparse.Namespace) -> str | None:
    """Why an argument is unusable, if it is: the shell passed bytes that are
    not UTF-8 (Python keeps them as lone surrogates, which no database takes)."""
    for name, value in vars(args).items():
        if not isinstance(value, str):
            continue
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raw = os.fsencode(value)
            text = mask_text(raw.decode("utf-8", "backslashreplace"))
            what = name.upper() if name == "key" else f"--{name.replace('_', '-')}"
            return f"{what} is not valid UTF-8 text: {quoted(text, escaped=True)}"
    return None


# -- commands ------------------------------------------------------------------


def cmd_migrate(args: argparse.Namespace) -> int:
    names = _names(args)
    url = resolve_url(args.url)
    if args.from_revision is not None and not args.sql:
        raise LockArgumentError("--from goes with --sql (the script from that revision)")
    if args.sql:
        check_url(url)
        return _migrate_sql(url, names, args.from_revision)
    with LockManager(url, table=names.table, index=names.index) as manager:
        before = migrations.current(manager.engine, names)
        migrations.upgrade(manager.engine, names)
        after = migrations.current(manager.engine, names)
        shown = manager.url  # (as every command names it: its engine's, masked)
    if before == after:
        print(f"{names.table} on {shown} is up to date (revision {after})")
    else:
        print(f"migrated {names.table} on {shown}: {before or 'empty'} -> {after}")
    return 0


def _migrate_sql(url: URL, names: TableNames, start: str | None) -> int:
    """``dblock migrate --sql [--from REV]``: the script from the database's
    revision (read from it: an unreachable database is an error, as for
    ``dblock migrate``), or from ``start`` offline, to the latest."""
    from alembic import command

    latest = migrations.head()
    if start is None:
        at, shown = _current_revision(url, names)
        start = at or "base"
        if start == latest:
            print(f"-- {names.table} on {shown} is at revision {latest}, the latest: no SQL")
            return 0
    elif start != "base" and not migrations.known_revision(start):
        raise LockArgumentError(
            f"--from {quoted(start)}: not a revision of dblock's (base, 0001 ... {latest})"
        )
    cfg = migrations.alembic_config(names, offline_url=url)
    cfg.output_buffer = sys.stdout
    command.upgrade(cfg, f"{start}:head", sql=True)
    return 0


def _current_revision(url: URL, names: TableNames) -> tuple[str | None, str]:
    """The revision the database at ``url`` is at (None: dblock was never
    migrated there, or the SQLite file does not exist: it is not made), and
    the URL as the commands show it."""
    if file_database(url):
        database = url.database or ""
        if database in ("", ":memory:") or (
            not database.startswith("file:") and not Path(database).expanduser().is_file()
        ):
            return None, mask(url)
    with LockManager(url, table=names.table, index=names.index) as manager:
        at = migrations.current(manager.engine, names)
        shown = manager.url
    if at is not None and not migrations.known_revision(at):
        raise DBLockError(
            f"{names.table} on {shown} is at revision {at}, newer than this dblock "
            f"knows (latest {migrations.head()}): no SQL to give"
        )
    return at, shown


def cmd_list(args: argparse.Namespace) -> int:
    prefix = None if args.prefix is None else check_filter("--prefix", args.prefix)
    with _manager(args) as manager:
        rows = manager.store.rows(prefix=prefix, limit=args.limit + 1)
        shown = rows[: args.limit]
        if args.json:
            print(rows_json(shown))
            return 0
        stats = manager.store.stats() if len(rows) > args.limit else None
        print(f"{manager.config.table} on {manager.url}: {_rows_summary(shown, stats)}")
    if shown:
        print()
        print(_table(shown, verbose=args.verbose))
    if stats is not None:
        print(f"\n... {stats.rows - len(shown)} more, not shown (--limit)")
    return 0


def _rows_summary(rows: list[LockRow], stats: LockStats | None) -> str:
    total = stats.rows if stats is not None else len(rows)
    expired = stats.expired if stats is not None else sum(row.expired for row in rows)
    return f"{total} row{'s' if total != 1 else ''}, {expired} expired"


def _table(rows: list[LockRow], *, verbose: bool = False) -> str:
    """The rows as columns; ``verbose`` (``-v``) adds what ``--json`` has
    beside: when each was acquired and expires (database time). Never the
    token: it is the holder's, as ``--json`` says."""
    lines: list[tuple[str, ...]] = [("KEY", "KIND", "OWNER", "AGE", "LEASE LEFT", "FENCE")]
    if verbose:
        lines[0] += ("ACQUIRED (UTC)", "EXPIRES (UTC)")
    for row in rows:
        line: tuple[str, ...] = (
            _cut(row.key, _KEY_COLUMN),
            row.kind_label,
            row.owner,
            span(row.age),
            _lease(row.lease_left),
            str(row.fence),
        )
        if verbose:
            line += (_utc(row.acquired_at), _utc(row.expires_at))
        lines.append(line)
    last = len(lines[0]) - 1
    widths = [max(len(line[i]) for line in lines) for i in range(last)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line[:last], widths, strict=True))
        + "  "
        + line[last]
        for line in lines
    )


#: The KEY column's width in ``dblock list``: a longer key is cut there with
#: an ellipsis, so one long key does not widen every row (``--json``, and
#: ``dblock release KEY``, show it whole).
_KEY_COLUMN = 60


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _utc(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _lease(left: float) -> str:
    return span(left) if left > 0 else f"expired {span(-left)} ago"


def span(seconds: float) -> str:
    """A duration for people: ``0.25s``, ``12.3s``, ``5m03s``, ``2h05m``, ``3d04h``."""
    if seconds < 10:
        return f"{seconds:.2f}s"
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def cmd_stats(args: argparse.Namespace) -> int:
    from .leader import LEADER_PREFIX, leaders_of

    with _manager(args) as manager:
        stats = manager.store.stats(storage=True)
        leaders = leaders_of(manager.store.rows(prefix=LEADER_PREFIX, limit=100))
        where = {"table": manager.config.table, "url": manager.url}
    if args.json:
        roles = [
            {
                "role": row.key[len(LEADER_PREFIX) :],
                "leader": row.owner,
                "term": row.fence,
                "for_s": round(row.age, 3),
                "lease_left_s": round(row.lease_left, 3),
            }
            for row in leaders
        ]
        print(json.dumps({**where, **stats.as_json(), "leaders": roles}, indent=2))
        return 0
    oldest = stats.oldest
    print(f"{where['table']} on {where['url']}")
    print(f"  rows     {stats.rows:>8}")
    print(f"  live     {stats.live:>8}")
    print(f"  expired  {stats.expired:>8}")
    if oldest is not None:
        print(
            f"  oldest   {quoted(oldest.key)}, held by {oldest.owner} for {span(oldest.age)} "
            f"(lease: {_lease(oldest.lease_left)})"
        )
        if args.verbose:  # what --json has beside
            print(
                f"           acquired {_utc(oldest.acquired_at)} UTC, expires "
                f"{_utc(oldest.expires_at)} UTC (database time), fence {oldest.fence}"
            )
    for i, row in enumerate(leaders):
        print(
            f"  {'leaders' if i == 0 else '':8} {quoted(row.key[len(LEADER_PREFIX) :])}: "
            f"{row.owner}, term {row.fence}, for {span(row.age)} (lease: {_lease(row.lease_left)})"
        )
    if stats.table is not None:
        _print_storage(stats.table)
    return 0


def _print_storage(table: TableHealth) -> None:
    """The storage lines of ``dblock stats``: what vacuum (PostgreSQL) or purge
    (MariaDB/MySQL) has to keep up with; see docs/operations.md, Vacuum and bloat."""
    if table.size_bytes is not None:
        size = table.size_bytes
        amount = f"{size / 2**20:>8.1f} MB" if size >= 2**20 else f"{size / 1024:>8.0f} kB"
        print(f"  size     {amount} (table and indexes)")
    if table.dead_rows is not None:
        print(f"  dead     {table.dead_rows:>8} (rows deleted, not yet vacuumed)")
    if table.autovacuum is not None:

        def when(at: datetime | None, count: int | None) -> str:
            runs = f"{count} run{'' if count == 1 else 's'}"
            return "never" if at is None else f"{at:%Y-%m-%d %H:%M:%S} UTC ({runs})"

        state = "on" if table.autovacuum else "OFF"
        print(f"  autovacuum {state}; last {when(table.last_autovacuum, table.autovacuum_count)}")
        print(f"  vacuum   last {when(table.last_vacuum, table.vacuum_count)}")
    if table.purge_lag is not None:
        print(f"  purge lag {table.purge_lag:>7} undo records (history list length, server-wide)")
    for warning in table.warnings:
        print(f"warning: {warning}")


def cmd_release(args: argparse.Namespace) -> int:
    # Everything is checked before any database is opened.
    if args.key is not None and (args.prefix is not None or args.owner is not None):
        raise LockArgumentError("give KEY, or --prefix and/or --owner, not both")
    if args.key is None and args.prefix is None and args.owner is None:
        raise LockArgumentError("name what to release: KEY, --prefix PREFIX or --owner OWNER")
    key = None if args.key is None else check_key(args.key)
    prefix = None if args.prefix is None else check_filter("--prefix", args.prefix)
    owner = None if args.owner is None else check_filter("--owner", args.owner)
    if not args.force:
        raise LockArgumentError(
            "dblock release takes a lock away from whoever holds it (the holder gets "
            "LockLost); add --force to say you mean it"
        )
    if key is None:
        return _release_many(args, prefix=prefix, owner=owner)
    with _manager(args) as manager:
        found = manager.store.rows(key=key)
        if not found:
            print(f"dblock: no lock {quoted(key)} in {manager.config.table} on {manager.url}")
            return 1
        what = "; ".join(_describe(row) for row in found)
        if len(found) > 1:
            what = f"{len(found)} rows of {quoted(key)}: {what}"
        if not args.yes and not _confirm(f"force-release {what}? [y/N] "):
            print("dblock: not released")
            return 1
        # Only the rows we showed (every row of the key: the exclusive holder,
        # each semaphore permit, read-write rows), each by its token: a row
        # that changed hands meanwhile is not what the operator agreed to take away.
        gone = manager.store.release_rows(found)
        if not gone:
            print(f"dblock: {quoted(key)} changed hands meanwhile; nothing released")
            return 1
        if len(gone) < len(found):
            kept = ", ".join(r.slot for r in found if r not in gone)
            print(f"dblock: rows {kept} of {quoted(key)} changed hands meanwhile; kept")
            what = "; ".join(_describe(row) for row in gone)
        # Once on stdout (below) is enough; who did it is said with -v.
        log.debug(
            "dblock: %s force-released %s in %s on %s",
            _who(),
            what,
            manager.config.table,
            manager.url,
        )
    print(f"released {what}; by {_who()}")
    return 0


_SHOWN_SAMPLE = 10


def _release_many(args: argparse.Namespace, *, prefix: str | None, owner: str | None) -> int:
    """``dblock release --prefix P`` / ``--owner O`` (both: rows matching
    both): every matching row, each by the token read, after one confirmation."""
    # "with keys starting with 'a:' (and held by ...)" or "held by 'web-1'".
    which = filter_phrase(prefix, owner, quoted)
    which = which if prefix is None else f"with {which}"
    with _manager(args) as manager:
        where = f"{manager.config.table} on {manager.url}"
        found = manager.store.rows(prefix=prefix, owner=owner)
        if not found:
            print(f"dblock: no lock rows {which} in {where}")
            return 1
        count = f"{len(found)} row{'s' if len(found) != 1 else ''}"
        sample = [f"  {_describe(row)}" for row in found[:_SHOWN_SAMPLE]]
        if len(found) > _SHOWN_SAMPLE:
            sample.append(f"  ... and {len(found) - _SHOWN_SAMPLE} more")
        if not args.yes:
            print(f"{count} {which} in {where}:", *sample, sep="\n")
            these = "this row" if len(found) == 1 else f"these {count}"
            if not _confirm(f"force-release {these}? [y/N] "):
                print("dblock: not released")
                return 1
        # Each row by the token read: one that changed hands meanwhile is
        # not what the operator agreed to take away.
        gone = len(manager.store.release_rows(found))
        kept = len(found) - gone
        # Who did it, for -v (the line on stdout says what was released).
        log.debug("dblock: %s force-released %d row(s) %s in %s", _who(), gone, which, where)
    moved = f" ({kept} changed hands meanwhile; kept)" if kept else ""
    print(f"released {gone} row{'s' if gone != 1 else ''} {which}{moved}; by {_who()}")
    return 0 if gone else 1


#: Keys and values longer than this are shortened when echoed: a valid key
#: (at most MAX_KEY_LENGTH) is always shown whole, as an admin must read it.
QUOTED_LENGTH = MAX_KEY_LENGTH
# A value quoted in a message (by argparse, or repr() in dblock's own),
# too long to echo whole.
_LONG_QUOTED = re.compile(rf"'([^']{{{QUOTED_LENGTH + 1},}})'|\"([^\"]{{{QUOTED_LENGTH + 1},}})\"")


def quoted(text: str, *, escaped: bool = False) -> str:
    """``text`` quoted for a message (``repr``, or as it is if ``escaped``
    already); a long one shortened with an ellipsis and its length, so a
    10,000-character argument is not echoed whole."""
    short = text[:QUOTED_LENGTH]
    shown = f"'{short}'" if escaped else repr(short)
    return shown if len(text) <= QUOTED_LENGTH else f"{shown}... ({len(text)} characters)"


def shortened(message: str) -> str:
    """``message`` with every quoted value in it longer than
    :data:`QUOTED_LENGTH` shortened as :func:`quoted` does: what every line
    the command line prints about a user's value goes through (argparse's
    refusals, dblock's errors, a skip), so no command echoes a
    10,000-character argument whole."""

    def short(match: re.Match[str]) -> str:
        single, double = match.groups()
        if single is not None:
            return quoted(single, escaped=True)
        return f'"{double[:QUOTED_LENGTH]}"... ({len(double)} characters)'

    return _LONG_QUOTED.sub(short, message)


def _describe(row: LockRow) -> str:
    kind = "" if row.kind == "exclusive" and not row.slot else f" [{row.kind_label}]"
    return (
        f"{quoted(row.key)}{kind} held by {row.owner} for {span(row.age)} "
        f"(lease: {_lease(row.lease_left)}, fence {row.fence})"
    )


def _confirm(prompt: str) -> bool:
    if not sys.stdin.isatty():
        raise LockArgumentError(
            "not asking for confirmation: standard input is not a terminal; add --yes"
        )
    try:
        answer = input(prompt)
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


def _who() -> str:
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no login name in a bare container
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def _vacuum_dead(text: str) -> int | str:
    if text == "off":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of rows or 'off', not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of rows or 'off', not {text!r}")
    return value


def cmd_sweep(args: argparse.Namespace) -> int:
    options = {
        name: getattr(args, name)
        for name in ("grace", "max_hold", "batch_size", "lock_ttl", "runs_retention")
        if getattr(args, name) is not None
    }
    if args.vacuum_dead is not None:
        options["vacuum_dead"] = None if args.vacuum_dead == "off" else args.vacuum_dead
    if args.every is not None:
        options["interval"] = args.every
    SweeperConfig.from_options(None, options)  # bad options fail before any database
    with _manager(args) as manager:
        sweeper = Sweeper(manager, **options)
        if args.once:
            if not args.verbose:  # the summary below says it once
                logging.getLogger("dblock.sweeper").setLevel(logging.WARNING)
            result = sweeper.run_once()
            print(f"{manager.config.table} on {manager.url}: {result.describe()}")
            return 0
        manager.store.rows(limit=0)  # a missing table or database fails now, not every run
        _sweep_until_signalled(sweeper)
    return 0


def _sweep_until_signalled(sweeper: Sweeper) -> None:
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info(
            "dblock sweep: %s received; finishing the batch in hand", signal.Signals(signum).name
        )
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        sweeper.start()
        stop.wait()
        sweeper.stop()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _shared_database(args: argparse.Namespace) -> None:
    """``dblock run`` coordinates hosts: it takes no default database. The
    default of the other commands, ./dblock.sqlite3, is a lock only this host
    sees: under the crontab of every host, each would run the job."""
    if args.url is None and not os.environ.get(ENV_URL):
        raise LockArgumentError(
            f"dblock run needs the database every host shares: give --url or ${ENV_URL} "
            f"(cron passes neither: set {ENV_URL}=... in the crontab); for one host alone, "
            "say so: --url sqlite:///path/to/file.sqlite3"
        )


def cmd_run(args: argparse.Namespace) -> int:  # noqa: PLR0911 - one return per exit status
    """``dblock run``: see :mod:`dblock.runner` for what it does and its exit statuses."""
    from . import jobs, runner

    argv = list(args.argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    # Everything is checked before the database is touched.
    _job_name(args.key)
    at_most = args.at_most
    options = jobs.JobOptions(
        at_most=jobs.default_at_most(Config().ttl, args.at_least) if at_most is None else at_most,
        at_least=args.at_least,
        wait=args.wait,
        retry_failed=args.retry_failed,
        on_skip="raise",
    )
    if args.fire_time is not None and args.per is not None:
        raise LockArgumentError("give --fire-time or --per, not both")
    if args.retry_failed and args.fire_time is None and args.per is None:
        raise LockArgumentError(
            "--retry-failed needs --fire-time or --per (a fire time to run again)"
        )
    _shared_database(args)
    try:
        work = _run_work(getattr(args, "face", None), argv)
    except runner.CommandError as exc:
        print(f"dblock run: error: {shortened(str(exc))}; nothing was taken", file=sys.stderr)
        return exc.status
    if not args.verbose:
        # The skip is said once, below, not also as a log line.
        logging.getLogger("dblock.jobs").setLevel(logging.WARNING)
    try:
        with runner.interruptible(), _manager(args) as manager:
            fire_time = args.fire_time if args.per is None else runner.period_fire_time(args.per)
            status = manager.run_job(
                args.key,
                work,
                fire_time=fire_time,
                at_most=options.at_most,
                at_least=options.at_least,
                wait=options.wait,
                retry_failed=options.retry_failed,
                on_skip="raise",
            )
            assert isinstance(status, int)  # on_skip="raise": a skip raises
            return status
    except JobSkipped as exc:
        if not args.quiet:
            print(f"dblock run: {shortened(str(exc))}", file=sys.stderr)
        return int(args.skip_status)
    except runner.CommandNotStarted as exc:
        print(f"dblock run: error: {shortened(str(exc))}; nothing ran", file=sys.stderr)
        return exc.status
    except runner.CommandLost as exc:
        print(f"dblock run: {shortened(exc.job_detail)}", file=sys.stderr)
        return exc.status
    except runner.CommandFailed as exc:
        return exc.status
    except runner.Interrupted as exc:
        if exc.after:
            # The command ran; its run's record or release was cut short (the
            # key is deleted as soon as the database answers, else by its lease).
            print(f"dblock run: {exc} while recording the run", file=sys.stderr)
            return exc.status if exc.status is not None else 128 + exc.signum
        print(f"dblock run: {exc} before the command started; nothing ran", file=sys.stderr)
        return 128 + exc.signum


def _run_work(face: Face | None, argv: list[str]) -> Callable[[], int]:
    """What ``dblock run`` runs under the job's lock: the program ``argv``
    names (supervised), or in another face its command of the application's
    (:attr:`Face.run`); :class:`~dblock.runner.CommandError` if there is none."""
    from . import runner

    if face is None or face.run is None:
        return functools.partial(runner.supervise, runner.resolve_command(argv))
    if not argv:
        raise LockArgumentError("dblock run needs a command after --: dblock run KEY -- command …")
    return functools.partial(runner.run_here, face.run(argv))


def cmd_lead(args: argparse.Namespace) -> int:
    """``dblock lead``: see :func:`_add_lead` for what it does and its exit statuses."""
    from . import runner
    from .leader import leader_key

    argv = list(args.argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    # Everything is checked before the database is touched.
    leader_key(args.role)
    if args.ttl is not None:
        check_lease(args.ttl, "--ttl")
    if args.grace < 0:
        raise LockArgumentError(f"--grace must be a duration >= 0, got {args.grace:g}")
    if args.url is None and not os.environ.get(ENV_URL):
        raise LockArgumentError(
            f"dblock lead needs the database every host shares: give --url or ${ENV_URL} "
            "(for one host alone, say so: --url sqlite:///path/to/file.sqlite3)"
        )
    try:
        command = runner.resolve_command(argv)
    except runner.CommandError as exc:
        print(f"dblock lead: error: {shortened(str(exc))}; nothing ran", file=sys.stderr)
        return exc.status
    try:
        with runner.interruptible(), _manager(args) as manager:
            leader = manager.leader(args.role, ttl=args.ttl)
            while True:
                term = leader.elect()
                print(
                    f"dblock lead: leading {args.role!r} (term {term.fence})",
                    file=sys.stderr,
                )
                env = {
                    **os.environ,
                    "DBLOCK_LEADER_ROLE": args.role,
                    "DBLOCK_LEADER_FENCE": str(term.fence),
                    "DBLOCK_LEADER_TOKEN": term.token,
                }
                try:
                    return runner.supervise(
                        command,
                        held=leader.held,
                        env=env,
                        group=True,
                        grace=args.grace,
                        name="dblock lead",
                    )
                except runner.CommandLost:
                    leader.step_down()
                    print(f"dblock lead: standing for {args.role!r} again", file=sys.stderr)
                except runner.CommandFailed as exc:
                    return exc.status
                finally:
                    leader.step_down()
    except runner.CommandNotStarted as exc:
        print(f"dblock lead: error: {shortened(str(exc))}; nothing ran", file=sys.stderr)
        return exc.status
    except runner.Interrupted as exc:
        print(f"dblock lead: {exc} while standing by; nothing ran", file=sys.stderr)
        return 128 + exc.signum


def _job_name(name: str) -> str:
    """A job's name as ``dblock run`` and ``dblock jobs`` take it: one that
    makes a valid lock key (``job:NAME``); anything else is a usage error
    (exit 2), echoed shortened."""
    from .jobs import JOB_PREFIX, job_key

    longest = MAX_KEY_LENGTH - len(JOB_PREFIX)
    if len(name) > longest:
        raise LockArgumentError(
            f"job name {quoted(name)} makes no valid lock key ({JOB_PREFIX}<name>): it is "
            f"{len(name)} characters long, the limit is {longest}"
        )
    job_key(name)
    return name


def cmd_jobs(args: argparse.Namespace) -> int:
    from ._store.jobs import statements
    from .jobs import JOB_PREFIX

    if args.job is not None:
        _job_name(args.job)  # a name no job can have is a mistake, not "0 runs"
    with _manager(args) as manager:
        sql = statements(manager.store)
        try:
            runs = sql.latest(args.job, limit=args.limit)
        except SchemaMissing:
            raise DBLockError(
                f"the record of job runs {sql.runs_name!r} does not exist in {manager.url}; "
                "run `dblock migrate`"
            ) from None
        held = {row.key: row for row in manager.store.rows(prefix=JOB_PREFIX)}
        where = f"{sql.runs_name} on {manager.url}"
    shown = []
    for run in runs:
        status = run.outcome
        if status == RUNNING:
            # "running" as recorded: alive only while its runner still holds the key.
            lock = held.get(JOB_PREFIX + run.job)
            alive = lock is not None and lock.token == run.token and lock.lease_left > 0
            status = RUNNING if alive else "died"
        shown.append((run, status))
    if args.json:
        print(json.dumps([{**run.as_json(), "status": status} for run, status in shown], indent=2))
        return 0
    count = len(shown)
    what = f"run{'' if count == 1 else 's'}"
    what = f"{what} of {quoted(args.job)}" if args.job else f"job{'' if count == 1 else 's'}"
    print(f"{where}: {count} {what}")
    if shown:
        print()
        print(_jobs_table(shown))
    return 0


def _jobs_table(shown: list[tuple[RunRow, str]]) -> str:
    def when(value: datetime | None) -> str:
        return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")

    lines = [("JOB", "FIRE TIME", "STATUS", "RUNNER", "STARTED", "DURATION", "NEXT FIRE", "DETAIL")]
    for run, status in shown:
        duration = run.duration
        lines.append(
            (
                run.job,
                when(run.fire_time),
                status if run.attempt == 1 else f"{status} (attempt {run.attempt})",
                run.runner,
                f"{span((run.now - run.started_at).total_seconds())} ago",
                "-" if duration is None else span(duration),
                when(run.next_fire),
                run.detail or "",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(7)]
    return "\n".join(
        (
            "  ".join(cell.ljust(width) for cell, width in zip(line[:7], widths, strict=True))
            + "  "
            + line[7]
        ).rstrip()
        for line in lines
    )


def cmd_top(args: argparse.Namespace) -> int:
    import importlib.util

    if importlib.util.find_spec("rich") is None:  # an optional extra
        raise DBLockError(f"dblock top needs rich, dblock's top extra: {install_hint('top')}")
    from . import top

    if args.interval <= 0:
        raise LockArgumentError(f"--interval must be positive, got {args.interval:g}")
    state = top.TopState(
        sort=top.Sort.named(args.sort),
        prefix=check_filter("--prefix", args.prefix) if args.prefix else "",
        expired_only=args.expired,
        limit=args.limit,
    )
    with _manager(args) as manager:
        return top.run(manager, state=state, interval=args.interval, once=args.once)


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    report = run_demo(
        args.url,
        processes=args.processes,
        threads=args.threads,
        users=args.users,
        requests=args.requests,
        progress=lambda msg: print(f"... {msg}", file=sys.stderr),
    )
    print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
