"""Signal storm: real SIGALRM timers at random microseconds against acquire and release (issue 43).

    .venv/bin/python scripts/signal_storm.py --db sqlite                 # smoke size (300)
    .venv/bin/python scripts/signal_storm.py --db postgresql --ops 20000 --json out.json
    .venv/bin/python scripts/signal_storm.py --url mysql+pymysql://root@127.0.0.1:3306/test
    kill -USR1 <pid>    # end the loop now; the checks and the report follow

Run from the repository root. The main thread loops: pick a kind of lock
(exclusive fail-fast, exclusive waiting, exclusive in ``with``, fair,
read, write, a semaphore permit) and one of its keys, acquire it and release
it. Before each of the two calls a real ``setitimer(ITIMER_REAL, d)`` is
armed, ``d`` a random number of microseconds from 1 to 1.25 times what that
call usually takes, so the SIGALRM lands anywhere inside acquire and release
(and, when it comes late, in this loop right after the call). The handler
raises a new exception each time (a subclass of :class:`Storm` out of a
cycle of 256 distinct classes, carrying its serial number) and counts it.

Some keys are contended: a second thread of the same manager and a thread of
another manager (another process, as far as dblock can tell) take them
with short holds, so hand-offs, local queues and waiting paths run too.
An interrupted release keeps its handle now and then (``--keep-share``),
as an application holding the handle in a variable would; otherwise the
handle is dropped, as an exception unwinding the caller drops it.

Counted (each must be 0 for the run to pass; exit code 1 otherwise):

* ``swallowed``: raised by the handler but never seen by the loop as that
  operation's exception (caught by dblock, printed by a weakref callback, or
  turned into another exception: ``wrapped`` counts those apart; ``stale``
  counts a storm exception surfacing in a later operation than its own);
* ``stranded_now``: right after an interrupted operation whose handle was
  dropped, the key (not one of the contended ones) still has a row in the
  table or an entry in this process's registry after ``--settle`` seconds:
  each is reported with where the exception landed (``--no-check-each``
  skips this);
* after the run, handles dropped and threads stopped: ``local_left`` (keys
  still in this process's registries or watched by a renewer),
  ``rows_left`` (rows in the table), ``stranded_own`` (keys this manager
  cannot take fail-fast within the lease plus a second) and
  ``stranded_other`` (the same for another manager);
* ``pool_checked_out``: connections of the manager's pool still checked
  out at the end (SQLAlchemy ``pool.checkedout()``); ``errors``: exceptions
  other than the storm's, LockBusy and LockTimeout (PoolExhausted ends
  the loop); ``thread_errors``: exceptions that ended a thread;
  ``ran_late``: renewal warnings "ran late" logged; ``close_s`` (must be
  under ``--close-limit``, 1 s); ``hung``: the watchdog found no progress
  for ``--hang`` seconds (it dumps every thread's stack with faulthandler,
  writes the JSON and exits 3).

Every run works in a lock table of its own (``dblock_storm_<hex>``),
dropped at the end unless ``--keep``. The shared servers are only used,
never restarted.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import gc
import io
import json
import logging
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from dblock import (  # noqa: E402
    LockBusy,
    LockManager,
    LockTimeout,
    PoolExhausted,
)

URLS = {
    "postgresql": os.environ.get(
        "DBLOCK_TEST_POSTGRESQL_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    ),
    "mariadb": os.environ.get("DBLOCK_TEST_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"),
}
URLS["mysql"] = URLS["mariadb"]

#: The loop's ways to take a lock: (family of keys, style).
STYLES = (
    ("x", "fast"),  # manager.acquire(key, blocking=False)
    ("x", "wait"),  # manager.acquire(key, timeout=...)
    ("x", "with"),  # manager.lock(key).__enter__ / __exit__
    ("f", "fair"),  # manager.acquire(key, fair=True, timeout=...)
    ("rw", "read"),  # manager.read_lock(key)
    ("rw", "write"),  # manager.write_lock(key)
    ("sem", "sem"),  # manager.semaphore(key, permits=2)
)
PERMITS = 2
CONTENDED = 2  # the first keys of each family are also taken by the contenders


# -- the storm ---------------------------------------------------------------


class Storm(Exception):
    """The signal handler's exception; ``serial`` says which raise it was."""

    serial = 0


#: A cycle of distinct classes: each raise is a new class as well as a new object.
STORM_CLASSES = tuple(type(f"Storm{i}", (Storm,), {}) for i in range(256))


class Timer:
    """One-shot SIGALRM armed around a call; its handler raises at most once per arming."""

    def __init__(self, land_in: str = "anywhere") -> None:
        # "dblock": raise only where the signal finds dblock's own code
        # running (its innermost frame); elsewhere (SQLAlchemy's pool, a
        # driver, threading) the arming passes unraised, counted apart.
        self.land_in = land_in
        self.foreign = 0  # signals that found other code running, not raised (land_in dblock)
        self.armed = False
        self.raised = 0  # handler raises
        self.fired_idle = 0  # signals that came when disarmed (nothing raised)
        self.serial_of_op = 0  # the serial the current arming raised, 0 if none
        self.raise_stack: list[str] = []

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if not self.armed:
            self.fired_idle += 1
            return
        self.armed = False  # one raise per arming, whatever comes next
        if self.land_in == "dblock" and (
            frame is None or "/dblock/" not in frame.f_code.co_filename.replace("\\", "/")
        ):
            self.foreign += 1
            return
        self.raised += 1
        self.serial_of_op = self.raised
        # Where it lands, innermost first (a swallowed one leaves no traceback).
        stack: list[str] = []
        f = frame
        while f is not None and len(stack) < 24:
            code = f.f_code
            stack.append(f"{code.co_name} ({code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno})")
            f = f.f_back
        self.raise_stack = stack
        exc = STORM_CLASSES[self.raised % len(STORM_CLASSES)](f"storm #{self.raised}")
        exc.serial = self.raised
        raise exc

    def arm(self, micros: int) -> None:
        self.serial_of_op = 0
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, micros / 1e6)

    def disarm(self) -> None:
        self.armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)


# -- where an exception landed ---------------------------------------------------


def _site(tb: TracebackType | None) -> tuple[str, str, list[str]]:
    """(innermost dblock frame, innermost frame, the dblock part of the stack)."""
    frames = traceback.extract_tb(tb)
    ours = [f for f in frames if "/dblock/" in f.filename.replace(os.sep, "/")]

    def name(f: traceback.FrameSummary) -> str:
        return f"{f.name} ({f.filename.rsplit('/', 1)[-1]}:{f.lineno})"

    inner_ours = name(ours[-1]) if ours else "(outside dblock)"
    inner = name(frames[-1]) if frames else "?"
    return inner_ours, inner, [name(f) for f in ours]


def _storm_in(exc: BaseException) -> Storm | None:
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, Storm):
            return e
        e = e.__cause__ or e.__context__
    return None


# -- counting what dblock logs -------------------------------------------------


class LogCount(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.by_template: collections.Counter[str] = collections.Counter()
        self.ran_late = 0
        self.ran_late_keys: collections.Counter[str] = collections.Counter()
        self.first: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno < logging.WARNING:
            return
        template = str(record.msg)[:90]
        self.by_template[template] += 1
        if "ran late" in template or "ran %.2f s late" in template:
            self.ran_late += 1
            if record.args and isinstance(record.args, tuple):
                self.ran_late_keys[str(record.args[0])] += 1
        if template not in self.first:
            try:
                self.first[template] = record.getMessage()[:400]
            except Exception:
                self.first[template] = template


# -- the run --------------------------------------------------------------------


class Run:
    def __init__(self, args: argparse.Namespace, url: str) -> None:
        self.args = args
        self.url = url
        self.rng = random.Random(args.seed)
        self.table = f"dblock_storm_{uuid.uuid4().hex[:8]}"
        self.timer = Timer(args.land_in)
        self.result: dict[str, Any] = {
            "url": sa.make_url(url).render_as_string(hide_password=True),
            "table": self.table,
            "seed": args.seed,
            "ops_target": args.ops,
        }
        self.counts: collections.Counter[str] = collections.Counter()
        self.caught_serials: set[int] = set()
        self.swallow_sites: list[dict[str, Any]] = []
        self.stale: list[dict[str, Any]] = []
        self.wrapped: list[dict[str, Any]] = []
        self.errors: collections.Counter[str] = collections.Counter()
        self.error_samples: dict[str, str] = {}
        self.thread_errors: list[str] = []
        self.unraisable: list[dict[str, Any]] = []
        self.stranded_now: list[dict[str, Any]] = []
        self.landings: dict[str, collections.Counter[str]] = {
            "acquire": collections.Counter(),
            "release": collections.Counter(),
        }
        self.last_landing: dict[str, dict[str, Any]] = {}
        self.landing_of: dict[int, str] = {}
        self.pool_out: dict[int, tuple[Any, str, int]] = {}
        self.kept: list[Any] = []
        self.gens: dict[tuple[str, int], int] = {}
        self.used_keys: dict[str, str] = {}  # key -> family
        self.ema: dict[tuple[str, str], list[float]] = {}
        self.progress = time.monotonic()
        self.phase = "setup"
        self.stop = threading.Event()
        self.logs = LogCount()
        self.prefix = f"storm:{uuid.uuid4().hex[:8]}"
        self.manager: LockManager | None = None
        self.end_now = False

    # -- keys ----------------------------------------------------------------

    def key(self, family: str, i: int) -> str:
        gen = self.gens.get((family, i), 0)
        k = f"{self.prefix}:{family}:{i}" + (f":g{gen}" if gen else "")
        self.used_keys[k] = family
        return k

    def retire(self, family: str, i: int) -> None:
        """A stranded key is left as it is; later operations use a fresh name."""
        self.gens[(family, i)] = self.gens.get((family, i), 0) + 1

    # -- taking and giving back ------------------------------------------------

    def take(self, m: LockManager, family: str, style: str, key: str, wait: float) -> Any:
        """Acquire ``key`` by ``style``: the handle, and how to release it."""
        ttl = self.args.ttl
        if style == "fast":
            return m.acquire(key, blocking=False, ttl=ttl)
        if style == "wait":
            return m.acquire(key, timeout=wait, ttl=ttl)
        if style == "with":
            request = m.lock(key, timeout=wait, ttl=ttl)
            held = request.__enter__()
            return (request, held)
        if style == "fair":
            return m.acquire(key, fair=True, timeout=wait, ttl=ttl)
        if style == "read":
            return m.read_lock(key, timeout=wait, ttl=ttl).__enter__()
        if style == "write":
            return m.write_lock(key, timeout=wait, ttl=ttl).__enter__()
        if style == "sem":
            return m.semaphore(key, permits=PERMITS, timeout=wait, ttl=ttl).__enter__()
        raise AssertionError(style)

    @staticmethod
    def give(handle: Any) -> None:
        if isinstance(handle, tuple):
            handle[0].__exit__(None, None, None)
        else:
            handle.release()

    # -- contenders -------------------------------------------------------------

    def contend(self, m: LockManager, name: str, seed: int) -> None:
        rng = random.Random(seed)
        families = {f: s for f, s in STYLES if s not in ("fast", "with", "read")}
        styles = [*families.items(), ("rw", "read"), ("x", "fast")]
        while not self.stop.is_set():
            family, style = rng.choice(styles)
            key = f"{self.prefix}:{family}:{rng.randrange(CONTENDED)}"
            try:
                handle = self.take(m, family, style, key, wait=rng.uniform(0.05, 0.5))
            except (LockBusy, LockTimeout):
                self.counts[f"contender_busy_{name}"] += 1
                continue
            except Exception as exc:
                self.note_error(f"contender {name}", exc)
                time.sleep(0.05)
                continue
            try:
                time.sleep(rng.uniform(0, 0.003))
                self.give(handle)
                self.counts[f"contender_sections_{name}"] += 1
            except Exception as exc:
                self.note_error(f"contender {name} release", exc)
            del handle

    def end_loop(self, signum: int, frame: FrameType | None) -> None:
        """SIGUSR1: end the loop after its current call, then check and report."""
        self.end_now = True

    def note_error(self, where: str, exc: BaseException) -> None:
        label = f"{where}: {type(exc).__name__}"
        self.errors[label] += 1
        if label not in self.error_samples:
            self.error_samples[label] = "".join(
                traceback.format_exception(type(exc), exc, exc.__traceback__)
            )[-3000:]

    # -- one armed call ------------------------------------------------------------

    def delay_for(self, style: str, phase: str) -> int:
        """Microseconds: 1 to 1.25 times a duration this call took lately
        (one of the last 64 it took uninterrupted, at random). One call in
        ``--measure-every`` is armed late enough to run whole: interrupted
        calls teach nothing of their length, so without these the slow
        ones would drop out and the delays shrink."""
        if self.rng.random() < 1.0 / self.args.measure_every:
            return 30_000_000
        seen = self.ema.get((style, phase))
        d = self.rng.choice(seen) if seen else 0.002
        return self.rng.randint(1, max(2, int(d * 1.25e6)))

    def learn(self, style: str, phase: str, seconds: float) -> None:
        seen = self.ema.setdefault((style, phase), [])
        seen.append(seconds)
        if len(seen) > 64:
            del seen[0]

    def armed(
        self, style: str, phase: str, call: Callable[[], Any], key: str
    ) -> tuple[str, Any, str | None]:
        """Run ``call`` under an armed timer: ("ok", value, None),
        ("storm" | "busy" | "error", None, the exception's type name)."""
        timer = self.timer
        micros = self.delay_for(style, phase)
        started = time.perf_counter()
        kind, value = "ok", None
        failure: Exception | None = None
        elapsed = 0.0
        try:
            try:
                timer.arm(micros)
                value = call()
                elapsed = time.perf_counter() - started
                timer.disarm()
            finally:
                timer.armed = False  # (the handler already unset it if it raised)
        except Storm as exc:
            timer.disarm()
            kind, value, failure = "storm", None, exc
        except (LockBusy, LockTimeout) as exc:
            elapsed = time.perf_counter() - started
            timer.disarm()
            kind, value, failure = "busy", None, exc
        except Exception as exc:
            timer.disarm()
            kind, value, failure = "error", None, exc
        raised = timer.serial_of_op
        if kind in ("ok", "busy") and not timer.serial_of_op:
            self.learn(style, phase, elapsed)
        if raised:
            self.counts[f"interrupted_{phase}"] += 1
        storm = None if failure is None else _storm_in(failure)
        if storm is not None and failure is not None:
            if storm.serial in self.caught_serials:
                self.counts["caught_twice"] += 1
            self.caught_serials.add(storm.serial)
            if storm.serial != raised:
                self.stale.append(
                    {
                        "serial": storm.serial,
                        "op_serial": raised,
                        "phase": phase,
                        "style": style,
                        "site": _site(storm.__traceback__)[0],
                    }
                )
            if storm is not failure:
                self.wrapped.append(
                    {
                        "as": f"{type(failure).__name__}: {str(failure)[:200]}",
                        "phase": phase,
                        "style": style,
                        "site": _site(storm.__traceback__)[0],
                        "traceback": "".join(
                            traceback.format_exception(
                                type(failure), failure, failure.__traceback__
                            )
                        )[-4000:],
                    }
                )
                kind = "storm"
        if raised and raised not in self.caught_serials:
            # Raised while this call ran, and not seen here: swallowed
            # (unless it surfaces later, which 'stale' then reports).
            outcome = kind if failure is None else f"{kind}: {type(failure).__name__}"
            self.swallow_sites.append(
                {
                    "serial": raised,
                    "phase": phase,
                    "style": style,
                    "key": key,
                    "outcome": outcome,
                    "raised_in": timer.raise_stack,
                }
            )
        if storm is not None:
            inner_ours, inner, stack = _site(storm.__traceback__)
            self.landings[phase][inner_ours] += 1
            self.landing_of[storm.serial] = f"{phase} {style}: " + " > ".join(stack[-5:])
            self.last_landing[key] = {
                "phase": phase,
                "style": style,
                "site": inner_ours,
                "innermost": inner,
                "stack": stack,
                "raised_in": timer.raise_stack[:8],
            }
        if kind == "error" and failure is not None:
            self.note_error(f"{phase} {style}", failure)
        name = type(failure).__name__ if failure is not None else None
        # The caller is done with its exception: let its frames (and any
        # handle they hold) go now, as an application's handler would.
        e: BaseException | None = failure
        while e is not None:
            e.__traceback__ = None
            e = e.__context__
        failure = storm = None
        return kind, value, name

    # -- after an interrupted call: is the key free? ------------------------------

    def local_state(self, m: LockManager, key: str | None = None) -> dict[str, Any]:
        """What this process still keeps (of ``key``, or of every key):
        registry entries of the exclusive/fair locker, the semaphores'
        locker and the read-write locker, and locks the renewers watch."""
        out: dict[str, Any] = {}
        locker = getattr(m, "_locker", None)
        parts: list[tuple[str, Any]] = []
        if locker is not None:
            parts.append(("exclusive", locker))
        sems = getattr(m, "_semaphores", None)
        if sems is not None:
            parts.append(("semaphore", sems.locker))
        for label, lk in parts:
            reg = getattr(lk, "registry", None)
            entries = getattr(reg, "_entries", None)
            if isinstance(entries, dict):
                found = {
                    k: _describe_entry(e)
                    for k, e in list(entries.items())
                    if key is None or _real_key(k) == key
                }
                if found:
                    out[f"{label}_registry"] = found
            renewer = getattr(lk, "renewer", None)
            if renewer is not None:
                watched = [h.key for h in renewer.held_locks()]
                watched = [k for k in watched if key is None or _real_key(k) == key]
                if watched:
                    out[f"{label}_renewer"] = watched
        rw = getattr(m, "_rw", None)
        if rw is not None:
            entries = getattr(rw, "_entries", {})
            found = {
                k: _describe_entry(e) for k, e in list(entries.items()) if key is None or k == key
            }
            if found:
                out["rw_entries"] = found
            watched = [h.key for h in rw.renewer.held_locks()]
            watched = [k for k in watched if key is None or k == key]
            if watched:
                out["rw_renewer"] = watched
        return out

    def rows_of(self, key: str | None = None) -> list[tuple[Any, ...]]:
        assert self.raw is not None
        sql = f"SELECT lock_key, slot, kind, mode, owner FROM {self.table}"
        params: dict[str, Any] = {}
        if key is not None:
            sql += " WHERE lock_key = :k"
            params["k"] = key
        with self.raw.connect() as conn:
            return [tuple(r) for r in conn.execute(sa.text(sql), params)]

    def check_free(self, m: LockManager, key: str, settle: float) -> dict[str, Any] | None:
        """None once ``key`` has no row and nothing local, else what is left
        after ``settle`` seconds."""
        deadline = time.monotonic() + settle
        collected = False
        while True:
            local = self.local_state(m, key)
            rows = self.rows_of(key)
            if not local and not rows:
                if collected:
                    # A dropped handle in a reference cycle: released once
                    # the collector ran, as it would in an application.
                    self.counts["freed_by_gc"] += 1
                return None
            if time.monotonic() >= deadline:
                if collected:
                    return {"local": local, "rows": [list(map(str, r)) for r in rows]}
                gc.collect()
                collected = True
                deadline = time.monotonic() + 0.3
            time.sleep(0.01)

    # -- the loop ------------------------------------------------------------

    def loop(self, m: LockManager) -> None:
        args = self.args
        rng = self.rng
        releases = acquires = 0
        deadline = time.monotonic() + args.seconds if args.seconds else None
        while releases < args.ops:
            if deadline is not None and time.monotonic() > deadline:
                self.result["ended_early"] = f"--seconds {args.seconds} reached"
                break
            if self.end_now:
                self.result["ended_early"] = "SIGUSR1"
                break
            self.progress = time.monotonic()
            family, style = rng.choice(STYLES)
            i = rng.randrange(args.keys)
            key = self.key(family, i)
            contended = i < CONTENDED
            wait = rng.uniform(0.02, 0.3)
            self.phase = f"acquire {style} {key}"
            acquires += 1
            kind, handle, exc = self.armed(
                style, "acquire", partial(self.take, m, family, style, key, wait), key
            )
            self.counts[f"acquire_{kind}"] += 1
            if kind == "error" and exc == PoolExhausted.__name__:
                self.result["stopped"] = (
                    f"PoolExhausted after {releases} releases, {acquires} acquires"
                )
                break
            if kind == "ok":
                releases += 1
                if releases % 1000 == 0:
                    print(
                        f"... {releases} releases, {acquires} acquires, {self.timer.raised} "
                        f"raised, {len(self.stranded_now)} stranded, "
                        f"{sum(self.errors.values())} errors",
                        file=sys.stderr,
                        flush=True,
                    )
                self.phase = f"release {style} {key}"
                kind, _, exc = self.armed(style, "release", partial(self.give, handle), key)
                self.counts[f"release_{kind}"] += 1
                if kind == "error" and exc == PoolExhausted.__name__:
                    self.result["stopped"] = (
                        f"PoolExhausted after {releases} releases, {acquires} acquires"
                    )
                    break
                if kind == "storm" and not contended and rng.random() < args.keep_share:
                    # The application keeps its handle (released again at
                    # the end); the key gets a fresh name meanwhile.
                    self.kept.append(handle)
                    handle = None
                    self.retire(family, i)
                    continue
                phase = "release"
            else:
                phase = "acquire"
            del handle
            if kind == "storm" and not contended and args.check_each:
                self.phase = f"check {key}"
                left = self.check_free(m, key, args.settle)
                if left is not None:
                    landing = self.last_landing.get(key, {})
                    self.stranded_now.append({"key": key, "op": phase, **landing, **left})
                    # Left in this process (level 1, renewers) or only a row.
                    self.counts["stranded_now_local" if left["local"] else "stranded_now_row"] += 1
                    self.retire(family, i)
        self.result["acquires"] = acquires
        self.result["releases"] = releases

    # -- the end ---------------------------------------------------------------------

    def finish(self, m: LockManager, other: LockManager) -> None:
        args = self.args
        self.phase = "stopping contenders"
        self.stop.set()
        for t in self.threads:
            t.join(min(15.0, self.args.hang / 2))
            if t.is_alive():
                self.result.setdefault("contenders_stuck", []).append(
                    {"thread": t.name, "stack": _stack_of(t)}
                )
        held = _pool_mutex_locked(m)
        if held and held.startswith("held"):
            # Every other thread's statements would wait for it for ever:
            # nothing below could run. Report it as the hang it is.
            self.result["pool_mutex_locked"] = held
            self.phase = "final checks: the pool's mutex is held for good"
            self.progress = 0.0  # (the watchdog takes it from here)
            self.done.wait()
        self.result["pool_mutex_locked"] = held
        self.phase = "releasing kept handles"
        for handle in self.kept:
            try:
                self.give(handle)
                self.counts["kept_release_ok"] += 1
            except Exception as exc:
                self.counts[f"kept_release_{type(exc).__name__}"] += 1
        self.phase = "dropping handles"
        self.kept.clear()
        handle = None
        gc.collect()
        time.sleep(0.3)
        gc.collect()
        self.phase = "final checks"
        # This process's registries, and the rows, once everything is dropped.
        deadline = time.monotonic() + args.settle + 1.0
        while True:
            local = self.local_state(m)
            rows = self.rows_of()
            if (not local and not rows) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.result["local_left_detail"] = local
        self.result["local_left"] = sum(len(v) for v in local.values())
        self.result["rows_left"] = len(rows)
        self.result["rows_left_detail"] = [list(map(str, r)) for r in rows[:20]]
        # Every key, by this manager and by another, fail-fast, within the lease.
        stranded_own: dict[str, str] = {}
        stranded_other: dict[str, str] = {}
        limit = args.ttl + 1.0
        for who, mgr, out in (("own", m, stranded_own), ("other", other, stranded_other)):
            self.phase = f"final check: {who} manager takes every key"
            start = time.monotonic()
            pending = dict(self.used_keys)
            while pending:
                for key, family in list(pending.items()):
                    style = {"x": "fast", "f": "fair", "rw": "write", "sem": "sem"}[family]
                    try:
                        if family == "sem":
                            # Every permit at once: none may be left taken.
                            hs = [self.take(mgr, family, "sem", key, 0.0) for _ in range(PERMITS)]
                            for h in hs:
                                self.give(h)
                        else:
                            h = self.take(mgr, family, style, key, 0.0)
                            self.give(h)
                        del pending[key]
                        out.pop(key, None)
                    except (LockBusy, LockTimeout) as exc:
                        out[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    except Exception as exc:
                        out[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    finally:
                        hs = []
                        h = None
                if not pending or time.monotonic() - start > limit:
                    break
                time.sleep(0.1)
            self.progress = time.monotonic()
        self.result["stranded_own"] = len(stranded_own)
        self.result["stranded_other"] = len(stranded_other)
        self.result["stranded_detail"] = {
            k: {
                "own": stranded_own.get(k),
                "other": stranded_other.get(k),
                "last_landing": self.last_landing.get(k),
            }
            for k in list({**stranded_own, **stranded_other})[:20]
        }
        checked_out = _checked_out(m)
        leaks = self.pool_leaks(m)
        # dblock keeps a few connections checked out on stacks of its own
        # (one per store), idle between statements: those are not leaks.
        self.result["pool_checked_out_raw"] = checked_out
        self.result["executor"] = _executor_state(m)
        self.result["pool_accounting"] = _pool_accounting(m)
        # Leaked: records in use off dblock's idle stack, or more checked out
        # than records in use at all (a pool counter a signal left wrong).
        accounting = self.result["pool_accounting"] or {}
        phantom = accounting.get("believed_checked_out", 0) - accounting.get("records_in_use", 0)
        self.result["pool_checked_out"] = len(leaks) + max(phantom, 0)
        self.result["pool_leaks"] = leaks[:15]
        self.result["pool_status"] = _pool_status(m)
        self.result["other_pool_checked_out"] = _checked_out(other)

    # -- who holds the pool's connections ---------------------------------------------

    def track_pool(self, m: LockManager) -> None:
        """Note, for each connection checked out of the pool, what the loop
        was doing and the last storm's serial (two dict operations: the
        listener adds next to nothing where a signal may land)."""
        out = self.pool_out

        def checkout(dbapi: Any, record: Any, proxy: Any) -> None:
            out[id(record)] = (record, self.phase, self.timer.raised)

        def checkin(dbapi: Any, record: Any) -> None:
            out.pop(id(record), None)

        sa.event.listen(m.engine.pool, "checkout", checkout)
        sa.event.listen(m.engine.pool, "checkin", checkin)

    def pool_leaks(self, m: LockManager) -> list[dict[str, Any]]:
        """The connections checked out now that dblock's own idle stack does
        not keep: when each was checked out, and who refers to it."""
        leaks = []
        if self.args.track_pool:
            records = list(self.pool_out.values())
        else:
            # Without listeners (they would add points where a signal lands
            # inside the pool's checkout and checkin): the pool's records
            # in use now, found by the collector.
            pool = m.engine.pool
            records = [
                (obj, "?", 0)
                for obj in gc.get_objects()
                if type(obj).__name__ == "_ConnectionRecord"
                and getattr(obj, "_ConnectionRecord__pool", None) is pool
                and getattr(obj, "fairy_ref", None) is not None
            ]
        for record, phase, serial in records:
            fairy = record.fairy_ref() if getattr(record, "fairy_ref", None) else None
            if _idle_kept(fairy):
                continue
            landing = self.landing_of.get(serial)
            leaks.append(
                {
                    "checked_out_during": phase,
                    "last_storm": serial,
                    "storm_landed": landing,
                    "held_by": _referrers(fairy),
                }
            )
        return leaks

    def close(self, m: LockManager, other: LockManager) -> None:
        self.phase = "close()"
        self.progress = time.monotonic()
        started = time.perf_counter()
        try:
            m.close()
        except Exception as exc:
            self.note_error("close", exc)
        self.result["close_s"] = round(time.perf_counter() - started, 3)
        self.result["pool_checked_out_after_close"] = _checked_out(m)
        self.phase = "other.close()"
        started = time.perf_counter()
        other.close()
        self.result["other_close_s"] = round(time.perf_counter() - started, 3)
        left = [t.name for t in threading.enumerate() if t.name.startswith("dblock")]
        self.result["dblock_threads_after_close"] = left

    # -- the report -------------------------------------------------------------------

    def summarise(self) -> None:
        r = self.result
        t = self.timer
        caught = len(self.caught_serials)
        r["raised"] = t.raised
        r["foreign"] = t.foreign
        r["caught"] = caught
        r["swallowed"] = t.raised - caught
        r["swallowed_detail"] = [
            s for s in self.swallow_sites if s["serial"] not in self.caught_serials
        ][:20]
        r["wrapped"] = len(self.wrapped)
        r["wrapped_detail"] = self.wrapped[:10]
        r["stale"] = len(self.stale)
        r["stale_detail"] = self.stale[:10]
        r["signals_idle"] = t.fired_idle
        r["counts"] = dict(sorted(self.counts.items()))
        r["errors"] = sum(self.errors.values())
        r["errors_by_type"] = dict(self.errors)
        r["error_samples"] = self.error_samples
        r["thread_errors"] = len(self.thread_errors)
        r["thread_error_samples"] = self.thread_errors[:5]
        r["unraisable"] = len(self.unraisable)
        r["unraisable_detail"] = self.unraisable[:10]
        r["stranded_now"] = len(self.stranded_now)
        r["stranded_now_detail"] = self.stranded_now[:20]
        r["stranded_now_sites"] = dict(
            collections.Counter(
                f"{s.get('op')} {s.get('style')}: {s.get('site')}" for s in self.stranded_now
            )
        )
        r["ran_late"] = self.logs.ran_late
        r["ran_late_keys"] = dict(self.logs.ran_late_keys.most_common(5))
        r["ran_late_last_landing"] = {
            k: self.last_landing.get(k) for k in list(r["ran_late_keys"])[:5]
        }
        r["log_warnings"] = dict(self.logs.by_template)
        r["log_first"] = self.logs.first
        r["landings"] = {p: dict(c.most_common(40)) for p, c in self.landings.items()}

    def failures(self) -> dict[str, Any]:
        r = self.result
        bad: dict[str, Any] = {}
        for name in (
            "swallowed",
            "wrapped",
            "stale",
            "stranded_now",
            "local_left",
            "rows_left",
            "stranded_own",
            "stranded_other",
            "pool_checked_out",
            "errors",
            "thread_errors",
            "ran_late",
        ):
            if r.get(name):
                bad[name] = r[name]
        if r.get("hung"):
            bad["hung"] = r["hung"]
        if r.get("stopped"):
            bad["stopped"] = r["stopped"]
        if str(r.get("pool_mutex_locked") or "").startswith("held"):
            bad["pool_mutex_locked"] = r["pool_mutex_locked"]
        if r.get("contenders_stuck"):
            bad["contenders_stuck"] = len(r["contenders_stuck"])
        close = r.get("close_s")
        if close is None or close >= self.args.close_limit:
            bad["close_s"] = close
        return bad

    # -- the watchdog -------------------------------------------------------------------

    def watchdog(self) -> None:
        hang = self.args.hang
        while not self.done.wait(1.0):
            # The last resort, should even this thread never run again
            # (the GIL held for ever): faulthandler dumps and exits.
            faulthandler.dump_traceback_later(hang + 30, exit=True)
            if time.monotonic() - self.progress > hang:
                self.hung()
        faulthandler.cancel_dump_traceback_later()

    def hung(self) -> None:
        # Whatever the diagnosis below meets (a lock held for good), the
        # process ends: the JSON may then be missing, the dump above is not.
        ender = threading.Timer(30.0, os._exit, (3,))
        ender.daemon = True
        ender.start()
        buf = io.StringIO()
        for ident, frame in sys._current_frames().items():
            name = next((t.name for t in threading.enumerate() if t.ident == ident), "?")
            buf.write(f"--- thread {name} ({ident})\n")
            buf.write("".join(traceback.format_stack(frame)))
        print(f"\nHUNG in {self.phase!r}: no progress for {self.args.hang} s", file=sys.stderr)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        self.result["hung"] = f"no progress for {self.args.hang} s in {self.phase!r}"
        self.result["hung_stacks"] = buf.getvalue()[-60000:]
        self.result["hung_threads"] = threading.active_count()
        self.result["pool_mutex_locked"] = locked = _pool_mutex_locked(self.manager)
        self.result["executor"] = _executor_state(self.manager)
        self.result["pool_accounting"] = _pool_accounting(self.manager)
        if self.manager is not None and not locked:  # (status() may wait for the mutex)
            self.result["pool_status"] = _pool_status(self.manager)
            try:
                self.result["pool_leaks"] = self.pool_leaks(self.manager)[:15]
            except Exception as exc:
                self.result["pool_leaks"] = repr(exc)
        try:
            self.summarise()
            self.result["failures"] = self.failures()
            self.write()
            print(render(self.result), file=sys.stderr)
            if not self.args.keep:
                self.drop_table()  # (on an engine of its own: the run's pool is stuck)
        finally:
            os._exit(3)

    def drop_table(self) -> None:
        """Drop the run's lock table on a fresh connection, its rows first
        (a downgrade refuses live rows of the newer kinds)."""
        engine = sa.create_engine(self.url, poolclass=sa.pool.NullPool)
        try:
            with engine.begin() as conn:
                conn.execute(sa.text(f"DELETE FROM {self.table}"))
            with LockManager(engine, table=self.table) as admin:
                admin.drop_schema()
        except Exception as exc:
            print(f"could not drop {self.table}: {exc}", file=sys.stderr)
        finally:
            engine.dispose()

    def write(self) -> None:
        if self.args.json:
            Path(self.args.json).write_text(json.dumps(self.result, indent=2, default=str))

    # -- all of it ------------------------------------------------------------------------

    def go(self) -> int:
        args = self.args
        self.done = threading.Event()
        log = logging.getLogger("dblock")
        log.addHandler(self.logs)
        log.setLevel(logging.DEBUG if args.verbose else logging.WARNING)
        log.propagate = bool(args.verbose)

        def unraisable(u: Any) -> None:
            exc = u.exc_value
            entry: dict[str, Any] = {
                "type": type(exc).__name__ if exc is not None else None,
                "message": str(u.err_msg or "")[:200],
                "object": repr(u.object)[:200],
                "site": _site(u.exc_traceback)[0] if u.exc_traceback else None,
            }
            if isinstance(exc, Storm):
                entry["serial"] = exc.serial
            self.unraisable.append(entry)

        def thread_error(a: threading.ExceptHookArgs) -> None:
            self.thread_errors.append(
                f"{a.thread.name if a.thread else '?'}: "
                + "".join(traceback.format_exception(a.exc_type, a.exc_value, a.exc_traceback))[
                    -2000:
                ]
            )

        sys.unraisablehook = unraisable
        threading.excepthook = thread_error
        self.raw = sa.create_engine(self.url, pool_size=2, max_overflow=0)
        setup = LockManager(self.url, table=self.table)
        setup.create_schema()
        setup.close()
        m = LockManager(self.url, table=self.table, ttl=args.ttl)
        if args.track_pool:
            self.track_pool(m)
        self.manager = m
        other = LockManager(self.url, table=self.table, ttl=args.ttl)
        dog = threading.Thread(target=self.watchdog, name="storm-watchdog", daemon=True)
        dog.start()
        try:
            # A few unarmed rounds so each call's usual duration is known.
            self.phase = "warm-up"
            for family, style in STYLES:
                for _ in range(3):
                    key = f"{self.prefix}:warm:{family}"
                    self.used_keys[key] = family
                    started = time.perf_counter()
                    h = self.take(m, family, style, key, 1.0)
                    self.learn(style, "acquire", time.perf_counter() - started)
                    started = time.perf_counter()
                    self.give(h)
                    self.learn(style, "release", time.perf_counter() - started)
            self.threads = [
                threading.Thread(
                    target=self.contend,
                    args=(m, "same", args.seed + 1),
                    name="storm-same",
                    daemon=True,
                ),
                threading.Thread(
                    target=self.contend,
                    args=(other, "other", args.seed + 2),
                    name="storm-other",
                    daemon=True,
                ),
            ]
            for t in self.threads:
                t.start()
            signal.signal(signal.SIGALRM, self.timer.handler)
            signal.signal(signal.SIGUSR1, self.end_loop)
            started = time.monotonic()
            self.phase = "loop"
            try:
                self.loop(m)
            finally:
                self.timer.disarm()
                signal.signal(signal.SIGALRM, signal.SIG_IGN)
            self.result["loop_s"] = round(time.monotonic() - started, 2)
            self.finish(m, other)
            self.close(m, other)
        finally:
            self.done.set()
            faulthandler.cancel_dump_traceback_later()
            if not args.keep:
                self.drop_table()
            self.raw.dispose()
        self.summarise()
        self.result["failures"] = self.failures()
        self.write()
        print(render(self.result))
        if self.result.get("hung"):
            return 3
        return 1 if self.result["failures"] else 0


def _real_key(key: str) -> str:
    """A semaphore's key for one of its local permit keys (or the key itself)."""
    try:
        from dblock._store.permits import real_key
    except ImportError:  # (a private helper; the lead may move it)
        return key
    return real_key(key)


def _describe_entry(entry: Any) -> str:
    fields = []
    for name in (
        "owner",
        "depth",
        "leaving",
        "heir",
        "queue",
        "held",
        "readers",
        "writer",
        "hold",
        "busy",
        "draining",
    ):
        if hasattr(entry, name):
            value = getattr(entry, name)
            if name == "queue":
                value = len(value) if hasattr(value, "__len__") else value
            fields.append(f"{name}={str(value)[:80]}")
    return f"{type(entry).__name__}({', '.join(fields)})"


def _executor_state(m: LockManager | None) -> dict[str, Any] | None:
    """The manager's statement executor: connections idle on its own stack
    (checked out of the pool, so counted by it) and the threads it counts
    as waiting for the pool (a count left high by a signal is a leak too)."""
    try:
        assert m is not None
        ex = m.store.executor
        return {"idle": len(ex._idle), "pool_waiters": ex._pool_waiters}
    except Exception as exc:
        return {"unknown": repr(exc)[:200]}


def _pool_accounting(m: LockManager | None) -> dict[str, Any] | None:
    """What the pool believes (its overflow counter, the connections in its
    queue, read without its mutex) against the connection records the
    collector finds in use: more checked out than records in use is a
    counter a signal left wrong (a checkout that never happened)."""
    try:
        assert m is not None
        pool: Any = m.engine.pool
        in_use = sum(
            1
            for obj in gc.get_objects()
            if type(obj).__name__ == "_ConnectionRecord"
            and getattr(obj, "_ConnectionRecord__pool", None) is pool
            and getattr(obj, "fairy_ref", None) is not None
        )
        queued = len(pool._pool.queue)
        size = pool._pool.maxsize
        return {
            "overflow": pool._overflow,
            "in_queue": queued,
            "believed_checked_out": size - queued + pool._overflow,
            "records_in_use": in_use,
        }
    except Exception as exc:
        return {"unknown": repr(exc)[:200]}


def _pool_mutex_locked(m: LockManager | None) -> str | None:
    """Who holds the pool's queue mutex now, if anyone does for a second
    (SQLAlchemy's QueuePool; an RLock: a signal landing as
    ``Condition.__enter__`` returns in its ``get`` or ``put`` leaves it held
    for good by the thread it landed in, which alone can still pass it;
    every other thread's checkout and checkin then wait for ever). Empty
    when free."""
    try:
        assert m is not None
        mutex = m.engine.pool._pool.mutex  # type: ignore[attr-defined]
        for _ in range(5):
            found = re.search(r"owner=(\d+) count=(\d+)", repr(mutex))
            if found is None or found.group(1) == "0":
                return ""
            time.sleep(0.2)
        assert found is not None
        owner = int(found.group(1))
        name = next((t.name for t in threading.enumerate() if t.ident == owner), "?")
        return f"held by thread {name} ({owner}), count {found.group(2)}"
    except Exception as exc:
        return f"unknown: {exc!r}"[:200]


def _idle_kept(fairy: Any) -> bool:
    """Whether ``fairy`` sits on one of dblock's idle stacks, as an entry
    (connection, since, cursor) of a list."""
    if fairy is None:
        return False
    for ref in gc.get_referrers(fairy):
        if (
            isinstance(ref, tuple)
            and len(ref) == 3
            and ref[0] is fairy
            and isinstance(ref[1], float)
            and any(isinstance(r, list) for r in gc.get_referrers(ref))
        ):
            return True
    return False


def _referrers(obj: Any, depth: int = 2) -> list[str]:
    """Who keeps ``obj`` alive: frames by function and line, containers by
    type (and, one level up, what holds the container)."""
    if obj is None:
        return ["(collected)"]
    out = []
    for ref in gc.get_referrers(obj)[:8]:
        if isinstance(ref, FrameType):
            out.append(
                f"frame {ref.f_code.co_name} ({ref.f_code.co_filename.rsplit('/', 1)[-1]}"
                f":{ref.f_lineno})"
            )
        elif isinstance(ref, (list, dict, tuple)) and depth > 1:
            up = _referrers(ref, depth - 1)
            out.append(f"{type(ref).__name__}[{len(ref)}] <- {up[:4]}")
        else:
            out.append(f"{type(ref).__module__}.{type(ref).__qualname__}")
    return out


def _stack_of(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident or -1)
    return "".join(traceback.format_stack(frame)) if frame is not None else "(gone)"


def _checked_out(m: LockManager) -> int | None:
    try:
        return int(m.engine.pool.checkedout())  # type: ignore[attr-defined]
    except Exception:
        return None


def _pool_status(m: LockManager) -> str | None:
    try:
        return str(m.engine.pool.status())
    except Exception:
        return None


def render(r: dict[str, Any]) -> str:
    """One screen."""
    c = r.get("counts", {})
    lines = [
        f"signal storm on {r['url']} (table {r['table']}, seed {r['seed']})",
        f"  acquires {r.get('acquires')} (ok {c.get('acquire_ok', 0)}, "
        f"interrupted {c.get('interrupted_acquire', 0)}, busy {c.get('acquire_busy', 0)}), "
        f"releases {r.get('releases')} (interrupted {c.get('interrupted_release', 0)}) "
        f"in {r.get('loop_s')} s",
        f"  contenders: same manager {c.get('contender_sections_same', 0)} sections, "
        f"other manager {c.get('contender_sections_other', 0)}",
        f"  raised {r.get('raised')}  caught {r.get('caught')}  swallowed {r.get('swallowed')}"
        f"  wrapped {r.get('wrapped')}  stale {r.get('stale')}  unraisable {r.get('unraisable')}",
        f"  stranded right after the op {r.get('stranded_now')}; at the end: local entries "
        f"{r.get('local_left')}, rows {r.get('rows_left')}, keys own manager can't take "
        f"{r.get('stranded_own')}, another manager can't take {r.get('stranded_other')}",
        f"  pool checked out {r.get('pool_checked_out')} ({r.get('pool_status')}); "
        f"errors {r.get('errors')} {r.get('errors_by_type', {})}; thread errors "
        f"{r.get('thread_errors')}",
        f"  renewal 'ran late' {r.get('ran_late')} {r.get('ran_late_keys', {})}; close() "
        f"{r.get('close_s')} s, other close() {r.get('other_close_s')} s",
    ]
    if r.get("stopped"):
        lines.append(f"  STOPPED: {r['stopped']}")
    if r.get("hung"):
        lines.append(f"  HUNG: {r['hung']} ({r.get('hung_threads')} threads)")
    sites = r.get("stranded_now_sites") or {}
    if sites:
        lines.append("  stranded by landing site:")
        lines += [f"    {n:5d}  {s}" for s, n in sorted(sites.items(), key=lambda x: -x[1])[:8]]
    swallowed = r.get("swallowed_detail") or []
    if swallowed:
        where = collections.Counter(
            f"{s['phase']} {s['style']} -> {s['outcome']}" for s in swallowed
        )
        lines.append("  swallowed during: " + ", ".join(f"{k} x{n}" for k, n in where.items()))
    if r.get("pool_mutex_locked"):
        lines.append(f"  the pool's queue mutex is {r['pool_mutex_locked']} (for good)")
    raised_in = collections.Counter(
        " < ".join(s.get("raised_in", [])[:3]) for s in swallowed if s.get("raised_in")
    )
    for site, n in raised_in.most_common(4):
        lines.append(f"    swallowed x{n} raised in {site}")
    for label, sample in (r.get("error_samples") or {}).items():
        lines.append(f"  error {label} (first):")
        lines += ["    " + line for line in sample.rstrip().splitlines()[-24:]]
    unr = r.get("unraisable_detail") or []
    if unr:
        lines.append(f"  unraisable (first): {unr[0]}")
    failures = r.get("failures", {})
    lines.append("  PASS" if not failures else f"  FAIL: {failures}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--db",
        choices=("sqlite", "postgresql", "mariadb", "mysql"),
        default="sqlite",
        help="a shared server (or a temporary SQLite file)",
    )
    parser.add_argument("--url", help="a database URL (instead of --db)")
    parser.add_argument(
        "--ops",
        type=int,
        default=300,
        help="releases to run (each after an acquire); 300, 20000 for the full run",
    )
    parser.add_argument("--seconds", type=float, default=0.0, help="stop the loop after this")
    parser.add_argument("--seed", type=int, default=43)
    parser.add_argument("--keys", type=int, default=6, help="keys per kind (6; 2 contended)")
    parser.add_argument("--ttl", type=float, default=2.0, help="lease in seconds (2)")
    parser.add_argument(
        "--keep-share",
        type=float,
        default=0.25,
        help="share of interrupted releases whose handle is kept (0.25)",
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=0.5,
        help="seconds an interrupted op's key may take to come free (0.5)",
    )
    parser.add_argument(
        "--no-check-each",
        dest="check_each",
        action="store_false",
        help="do not check each interrupted op's key right after it",
    )
    parser.add_argument(
        "--hang",
        type=float,
        default=60.0,
        help="no progress for this long is a hang: dump stacks, exit 3 (60)",
    )
    parser.add_argument("--close-limit", type=float, default=1.0)
    parser.add_argument(
        "--land-in",
        choices=("anywhere", "dblock"),
        default="anywhere",
        help="raise wherever the signal lands (anywhere), or only where it finds dblock's "
        "own code running (dblock: what dblock alone can answer for; a signal inside "
        "SQLAlchemy's pool or a driver passes, counted as 'foreign')",
    )
    parser.add_argument(
        "--measure-every",
        type=float,
        default=4.0,
        help="one call in this many runs whole, to learn how long calls take (4)",
    )
    parser.add_argument(
        "--track-pool",
        action="store_true",
        help="note what the loop did as each connection was checked out (pool listeners: "
        "they add points where a signal may land inside checkout and checkin)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the run's lock table")
    parser.add_argument("--verbose", action="store_true", help="show dblock's log too")
    args = parser.parse_args(argv)
    if threading.current_thread() is not threading.main_thread():
        raise SystemExit("run from the main thread: signal handlers run there")
    faulthandler.enable()
    tmp: tempfile.TemporaryDirectory[str] | None = None
    if args.url:
        url = args.url
    elif args.db == "sqlite":
        tmp = tempfile.TemporaryDirectory(prefix="dblock-storm-")
        url = f"sqlite:///{tmp.name}/storm.sqlite3"
    else:
        url = URLS[args.db]
    try:
        return Run(args, url).go()
    finally:
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
