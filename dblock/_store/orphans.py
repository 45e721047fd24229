"""Rows of acquisitions whose outcome the caller never learned, and their
clean-up: a collaborator of every store (``Store.orphans``).

An acquisition cut off with its statement sent (a cancelled task, a signal
handler's exception, a connection lost mid-statement) may have committed
although its caller was told it failed: its row is deleted by its token as
soon as the database answers. A statement given up on may still run on the
server after that DELETE, so the orphans wait for it to end first.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from typing import Any, ClassVar, Protocol

import sqlalchemy.exc as sa_exc

from .. import _threads
from ..errors import BackendError, DBLockError, SchemaMissing
from ..errors import ConnectionLost as Interrupted
from ..errors import DatabaseUnreachable as Unreachable

#: A statement sequence settling an orphan (``Steps[bool]``, dblock._store.base).
Settle = Callable[[], Generator[Any, Any, bool]]


class Runs(Protocol):
    """What the orphans' look for a server thread needs of the executor."""

    @property
    def closed(self) -> bool: ...

    def run(self, sql: str, params: Any, fetch: bool = False, lastrowid: bool = False) -> Any: ...


class OrphanHost(Protocol):
    """What the orphans need of their store (``dblock._store.base.Store``)."""

    @property
    def executor(self) -> Runs: ...

    wake_cleaner: Callable[[], None]
    #: The dialect's SQL finding a connection's server thread (None: none).
    alive_sql: ClassVar[str | None]

    def server_thread(self, dbapi_connection: Any) -> int: ...

    def drive(self, steps: Generator[Any, Any, bool]) -> bool: ...

    def release(self, key: str, token: str) -> bool: ...


__all__ = ["ORPHAN_ATTEMPTS", "SETTLE_WAIT", "OrphanHost", "Orphans", "Settle"]

log = logging.getLogger("dblock")

# Answers with an error the DELETE of an orphan may get before it is dropped.
ORPHAN_ATTEMPTS = 3

#: How long the orphans wait for a statement interrupted after it was sent
#: to end on the server (see Orphans.settle_later): past a lock wait
#: (innodb_lock_wait_timeout, 50 s by default), which it may be in.
SETTLE_WAIT = 60.0


class Orphans:
    """The orphaned rows of one store, deleted by :meth:`clean` (the lock
    facade's renewal thread, or the next acquisition) once the database
    answers; what settles each, and the statements they wait for."""

    __slots__ = ("lock", "queue", "running", "settles", "store")

    def __init__(self, store: OrphanHost, *, running: set[object] | None = None) -> None:
        #: Whose statements delete them (its drive, release, executor, and
        #: the dialect's look for a server thread: alive_sql, server_thread).
        self.store = store
        # (key, token, failures, owed) of acquisitions that may have committed
        # although the caller was told they failed; deleted as soon as the
        # database answers.
        self.queue: deque[tuple[str, str, int, bool]] = deque()
        # Orphans settled otherwise than by the exclusive lock's DELETE, by
        # token: the statement to send instead (a fair-queue request's rows
        # all go, a job's released row is kept for its at_least).
        self.settles: dict[str, Settle] = {}
        self.lock = threading.RLock()
        # Statements whose caller gave up on them while they may still be
        # on their way to, or running in, the server (see unsettled()); a
        # semaphore's permit store shares its base store's.
        self.running: set[object] = set() if running is None else running

    def add(
        self,
        key: str,
        token: str,
        *,
        released: bool = False,
        unreachable: bool = False,
        settle: Settle | None = None,
    ) -> None:
        """Delete the row of ``(key, token)`` once the database answers: an
        acquisition whose outcome we never learned, or (``released``) a
        release that could not reach the database. ``settle``: what to send
        instead of the DELETE (a fair-queue request leaves its queue whole;
        a job's release was to keep its row, see ``JobSQL.keep_steps``).

        An acquisition cut off by its caller (a cancelled task, Ctrl-C) is
        ordinary: it is logged at DEBUG, and the WARNING that it "may have
        committed while the database was unreachable" comes only if the
        database is in fact unreachable: at once when the caller saw the
        connection fail (``unreachable``), else when the DELETE cannot reach
        it. A storm of cancellations on a healthy database logs no warning."""
        if not released:
            if unreachable:
                self._warn_unreachable(key)
            else:
                log.debug(
                    "dblock: acquisition of %r was interrupted with its statement sent; "
                    "its row, if written, is deleted by its token",
                    key,
                )
        if settle is not None:
            self.settles[token] = settle
        # The last field: a WARNING is still owed if the database turns out
        # unreachable (an acquisition not yet reported as such).
        self.queue.append((key, token, 0, not released and not unreachable))

    @staticmethod
    def _warn_unreachable(key: str) -> None:
        log.warning(
            "dblock: acquisition of %r may have committed while the database was "
            "unreachable; its row will be deleted once the database answers",
            key,
        )

    def is_orphan(self, key: str, token: str) -> bool:
        return any(k == key and t == token for k, t, _, _ in self.queue)

    def __bool__(self) -> bool:
        return bool(self.queue)

    def settle_later(self, dbapi_connection: Any) -> None:
        """A statement was interrupted after it was sent (a signal handler's
        exception, gevent's timeout, an asyncio task's cancellation; on the
        blocking or the asyncio driver's connection), and its connection is
        dropped. That does not stop it: the server runs what it was sent,
        maybe after the DELETE that settles an interrupted acquisition by
        its token, whose row then holds the key for its lease. So the
        orphans wait until the server's thread (or process) of that
        connection is gone, its statement ended (:attr:`alive_sql`). Behind
        a balancer or a pooler the look may reach another node or find the
        pooler's id: then the wait is capped (:data:`SETTLE_WAIT`) or cut
        short, as before."""
        try:
            thread_id = self.store.server_thread(dbapi_connection)
        except Exception:  # another driver, or a connection already gone
            return
        marker = object()
        self.unsettled(marker)
        try:
            _threads.start(
                threading.Thread(
                    target=self._await_server_thread,
                    args=(thread_id, marker),
                    name="dblock-settle",
                    daemon=True,
                )
            )
        except RuntimeError:  # at interpreter exit: no new thread
            self.settled(marker)

    def _await_server_thread(self, thread_id: int, marker: object) -> None:
        alive_sql = self.store.alive_sql
        assert alive_sql is not None
        deadline = time.monotonic() + SETTLE_WAIT
        pause = 0.005
        try:
            while time.monotonic() < deadline and not self.store.executor.closed:
                try:
                    if not self.store.executor.run(alive_sql, {"id": thread_id}, True).rows:
                        return
                except (Unreachable, Interrupted):
                    # Unreachable: say so of the orphans waiting here, as
                    # their DELETE would; look again until it answers.
                    if self.lock.acquire(blocking=False):
                        try:
                            self._report_unreachable()
                        finally:
                            self.lock.release()
                except Exception as exc:  # look again
                    log.debug("dblock: looking for server thread %d: %r", thread_id, exc)
                time.sleep(pause)
                pause = min(pause * 2, 0.25)
        finally:
            self.settled(marker)

    def unsettled(self, statement: object) -> None:
        """``statement`` was given up on by its caller but still runs on a
        connection of its own: closing a connection does not stop a
        statement the server was already sent, which may then run after a
        DELETE of its token. Orphans wait until :meth:`settled`."""
        self.running.add(statement)

    def settled(self, statement: object) -> None:
        self.running.discard(statement)
        if self.queue:
            self.store.wake_cleaner()

    def clean(self) -> None:  # noqa: PLR0912 - one branch per outcome
        """Delete rows left by acquisitions whose outcome we never learned.

        While the database does not answer, every orphan waits for it. An
        orphan whose DELETE the database answers with an error is tried again
        later, after the others, and dropped (with an ERROR line) after
        :data:`ORPHAN_ATTEMPTS` such answers; one whose DELETE cannot even be
        sent (say, a value the driver cannot encode) is dropped at once. Either
        way its row, if it exists, is left to its lease and the sweeper, and
        no orphan ever holds up the others or the caller. While a statement
        given up on still runs (:meth:`unsettled`), they all wait for it."""
        if not self.queue or self.running:
            return
        lock = self.lock
        try:
            if not lock.acquire(blocking=False):
                return
        except BaseException:
            # A signal handler's exception as acquire() returned: if it took
            # the lock, give it back (an RLock: only its owner can), or no
            # orphan of this process was ever deleted again.
            with contextlib.suppress(RuntimeError):
                lock.release()
            raise
        try:
            for _ in range(len(self.queue)):
                key, token, failures, owed = self.queue[0]
                try:
                    settle = self.settles.get(token)
                    if settle is not None:
                        self.store.drive(settle())
                    else:
                        self.store.release(key, token)
                except (Unreachable, Interrupted):
                    self._report_unreachable()
                    return  # still unreachable; try again next time
                except SchemaMissing:
                    pass  # no table, so no row to delete
                except BackendError as exc:
                    self.queue.popleft()
                    if failures + 1 < ORPHAN_ATTEMPTS:
                        self.queue.append((key, token, failures + 1, owed))
                    else:
                        self.settles.pop(token, None)
                        self._give_up(key, exc)
                    continue
                except Exception as exc:
                    if _callers_own(exc):
                        # Not the statement's failure but the caller's own
                        # exception (a signal handler's: a SIGALRM request
                        # timeout, Celery's soft time limit) landing while
                        # the DELETE ran: it is the caller's to see, and
                        # the orphan stays for the renewal thread's next try.
                        self.store.wake_cleaner()
                        raise
                    self.queue.popleft()
                    self.settles.pop(token, None)
                    self._give_up(key, exc)
                    continue
                self.queue.popleft()
                self.settles.pop(token, None)
                # Quiet when nothing was said of it (a cancellation resolved cleanly).
                log.log(
                    logging.DEBUG if owed else logging.INFO,
                    "dblock: removed the row of %r left by an unanswered statement",
                    key,
                )
        finally:
            lock.release()

    def _report_unreachable(self) -> None:
        """The database does not answer: say so, once, of every acquisition
        that was cut off quietly and may have committed."""
        if not any(owed for _, _, _, owed in self.queue):
            return
        for i, (key, token, failures, owed) in enumerate(list(self.queue)):
            if owed:
                self._warn_unreachable(key)
                self.queue[i] = (key, token, failures, False)

    @staticmethod
    def _give_up(key: str, exc: BaseException) -> None:
        log.error(
            "dblock: cannot delete the row of an unconfirmed acquisition of %r (%s: %s); "
            "giving up: the row, if it was written, stays until its lease ends or the "
            "sweeper removes it",
            key,
            type(exc).__name__,
            exc,
        )

    def after_fork(self) -> None:
        """In a forked child: none of the parent's (its lock perhaps held by
        a parent's thread at the fork)."""
        self.queue.clear()
        self.settles = {}
        self.lock = threading.RLock()
        self.running.clear()  # in place: a semaphore's store shares it


#: What a statement itself raises when it cannot be sent or answered: the
#: driver's errors (wrapped by SQLAlchemy, or dblock's own), and what a
#: driver raises encoding a value it cannot send.
_STATEMENT_ERRORS = (
    DBLockError,
    sa_exc.SQLAlchemyError,
    UnicodeError,
    TypeError,
    ValueError,
    OverflowError,
)


def _callers_own(exc: BaseException) -> bool:
    """Is ``exc``, raised while an orphan's statement ran, the caller's own
    (a signal handler's, which CPython runs only on the main thread) rather
    than the statement's failure?"""
    return (
        not isinstance(exc, _STATEMENT_ERRORS)
        and threading.current_thread() is threading.main_thread()
    )
