"""Celery: tasks that run once across the workers, and a doubled beat made harmless.

::

    from celery import Celery
    from dblock.contrib.celery import OnceTask, use_locks

    app = Celery("proj", broker="amqp://...")
    use_locks(app, "postgresql+psycopg://...")     # or a LockManager, or a function making one

    @app.task(base=OnceTask, once_at_most=600, once_at_least=240)
    def nightly_report(): ...                      # a beat entry every 300 s

    @app.task(base=OnceTask, once_at_most=60, once_key="args")
    def resize(image_id: int): ...                 # one run per image at a time, as celery-once

Each call of a task whose base is :class:`OnceTask` goes through
:meth:`LockManager.run_job <dblock.LockManager.run_job>` in the worker that
received it, named after the task (``once_key=None``) or after the task and
its arguments (``once_key="args"``, or a function of ``(args, kwargs)``
returning a string). A call that finds its name taken returns ``None``
without running (``once_on_skip="raise"``: fails with
:class:`~dblock.JobSkipped`).

**A doubled beat.** Two ``celery beat`` processes (a deploy that started a
second one, a failover that did not stop the first) each send every periodic
task. Beat messages carry no fire time, and two beats of an interval
schedule do not even share their phases, so the defence keys by task name:
with ``once_at_least`` a little under the period, the first message of a
period runs and keeps the name for ``once_at_least`` seconds from its start;
the other beat's copy, arriving within that time, is skipped; the next
period's first message finds the name free again. It holds while the beats'
sending times differ by less than ``once_at_least`` and a run's start is not
delayed past ``period - once_at_least`` (keep the workers' queue short for
these tasks, or give them a queue of their own).

Or at the source: :class:`LeaderScheduler` (``celery beat -S
dblock.contrib.celery:LeaderScheduler``) sends only while it holds a dblock
lock; a second beat waits as a standby and takes over when the first one's
lease ends. Both together make a doubled beat harmless whatever the tasks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from celery import Celery, Task
from celery.beat import PersistentScheduler

from .. import SKIPPED
from ..errors import DBLockError, LockArgumentError, LockNotAcquired
from ..lock import HeldLock
from ..manager import LockManager

__all__ = ["LeaderScheduler", "OnceTask", "locks_of", "use_locks"]

_log = logging.getLogger("dblock.contrib.celery")
_CONF = "dblock_locks"
_made: dict[int, LockManager] = {}
_making = threading.Lock()

KeyFunction = Callable[[tuple[Any, ...], dict[str, Any]], str]


def use_locks(app: Celery, locks: LockManager | str | Callable[[], LockManager]) -> None:
    """The lock manager of ``app``'s :class:`OnceTask` tasks: a
    :class:`~dblock.LockManager`, a database URL, or a function making one.
    A URL or a function is turned into a manager in each worker process on
    first use (after the pool forked), never in the process that imports
    the app. Without this, ``app.conf.dblock_url`` is the URL."""
    app.conf[_CONF] = locks


def locks_of(app: Celery) -> LockManager:
    """``app``'s lock manager (see :func:`use_locks`), made on first use."""
    given = app.conf.get(_CONF) or app.conf.get("dblock_url")
    if isinstance(given, LockManager):
        return given
    if given is None:
        raise LockArgumentError(
            "dblock: this Celery app has no lock manager: call "
            "dblock.contrib.celery.use_locks(app, url_or_manager), or set app.conf.dblock_url"
        )
    with _making:
        found = _made.get(id(app))
        if found is None:
            found = LockManager(given) if isinstance(given, str) else given()
            _made[id(app)] = found
        return found


class OnceTask(Task):  # type: ignore[misc]
    """A task base class: each call runs through ``locks.run_job``.

    Options, as ``app.task(base=OnceTask, once_...=...)`` keywords or
    attributes of a subclass: ``once_at_most`` (seconds, required: the lease
    of a run; a worker that dies in a run blocks the name this long),
    ``once_at_least`` (keep the name this long after a run starts, against
    a doubled beat), ``once_key`` (``None``: per task name; ``"args"``: per
    task name and arguments; or a function ``(args, kwargs) -> str``),
    ``once_name`` (the job's name, the task's name by default),
    ``once_retry_failed`` and ``once_on_skip`` (``"return"``: ``None``;
    ``"raise"``: :class:`~dblock.JobSkipped`).
    """

    once_at_most: float | None = None
    once_at_least: float = 0
    once_key: str | KeyFunction | None = None
    once_name: str | None = None
    once_retry_failed: bool = False
    once_on_skip: str = "return"

    def once_job_name(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The name this call runs under."""
        base = self.once_name or self.name
        key = self.once_key
        if key is None:
            return str(base)
        if key == "args":
            return f"{base}:{_digest(args, kwargs)}"
        if callable(key):
            return f"{base}:{key(args, kwargs)}"
        raise LockArgumentError(
            f"task {self.name}: once_key must be None, 'args' or a function, got {key!r}"
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.once_at_most or self.once_at_most <= 0:
            raise LockArgumentError(
                f"task {self.name}: OnceTask needs once_at_most (seconds), got "
                f"{self.once_at_most!r}"
            )
        if self.once_on_skip not in ("return", "raise"):
            raise LockArgumentError(
                f"task {self.name}: once_on_skip must be 'return' or 'raise', "
                f"got {self.once_on_skip!r}"
            )
        name = self.once_job_name(args, kwargs)
        run = super().__call__

        # The task's own arguments are bound here, so a task keyword named
        # like one of run_job's options cannot be taken for it.
        def call() -> Any:
            return run(*args, **kwargs)

        result = locks_of(self.app).run_job(
            name,
            call,
            at_most=self.once_at_most,
            at_least=self.once_at_least,
            retry_failed=self.once_retry_failed,
            on_skip=self.once_on_skip,
        )
        if result is SKIPPED:
            # SKIPPED is not something a result backend can store: a skipped
            # call's result is None.
            self.on_once_skipped(name, args, kwargs)
            return None
        return result

    def on_once_skipped(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Called in the worker when a call was skipped (its name was taken);
        logs it. Override to count skips."""
        _log.info("task %s [%s]: skipped, %s runs elsewhere", self.name, self.request.id, name)


def _digest(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A short stable name for a call's arguments (the same in every worker:
    JSON with sorted keys, hashed; repr for what JSON cannot say)."""
    text = json.dumps([list(args), kwargs], sort_keys=True, default=repr, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class LeaderScheduler(PersistentScheduler):  # type: ignore[misc]
    """A beat scheduler that sends only while it holds the lock
    ``celery-beat:<app name>`` (``app.conf.dblock_beat_key`` to choose
    another), with a lease of ``app.conf.dblock_beat_lease`` seconds (30 by
    default) that dblock renews while the beat lives.

    Any number of beats may run: one leads, the others try the lock every
    ``lease / 6`` seconds (at most 5 s) and send nothing. A leader killed
    with ``kill -9`` is replaced once its lease ends; a leader whose lease
    was lost (a pause longer than it, the database gone) stops sending at its
    next tick. A standby's schedule has not moved while it waited, so on
    taking over it may send at once what the old leader had just sent: give
    tasks that must not run twice :class:`OnceTask` as well.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._held: HeldLock | None = None
        super().__init__(*args, **kwargs)
        conf = self.app.conf
        self._beat_key = str(conf.get("dblock_beat_key") or f"celery-beat:{self.app.main}")
        self._lease = float(conf.get("dblock_beat_lease") or 30.0)
        if self._lease <= 0:
            raise LockArgumentError(f"dblock_beat_lease must be positive, got {self._lease!r}")

    def is_leader(self) -> bool:
        """Whether this beat holds the lock now (taking it if it is free)."""
        held = self._held
        if held is not None and not held.lost and not held.released:
            return True
        if held is not None:
            _log.warning("beat: lost the lead (%s); standing by", held.lost_reason)
            self._held = None
        try:
            self._held = locks_of(self.app).acquire(
                self._beat_key, blocking=False, ttl=self._lease, renew=True
            )
        except LockNotAcquired:
            return False
        except DBLockError as exc:  # the database is away: send nothing, try again
            _log.warning("beat: cannot take the lead: %s", exc)
            return False
        _log.info("beat: leading (%s)", self._beat_key)
        return True

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if not self.is_leader():
            return min(self._lease / 6, 5.0)
        return float(super().tick(*args, **kwargs))

    def close(self) -> None:
        held, self._held = self._held, None
        try:
            super().close()
        finally:
            if held is not None and not held.released:
                try:
                    held.release()
                except DBLockError as exc:  # its lease ends it anyway
                    _log.warning("beat: could not give the lead back: %s", exc)
