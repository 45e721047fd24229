"""Every error dblock raises, in one tree.

::

    DBLockError
     ├── LockNotAcquired          the lock was not granted
     │    ├── LockBusy            fail-fast request, someone else holds it
     │    ├── LockTimeout         a waiting request ran out of time
     │    └── JobSkipped          a job run skipped: running elsewhere, kept by at_least,
     │                            or its fire time already ran (``on_skip="raise"``)
     ├── LockLost                 we held it, but the row is gone or someone else's
     │    └── LeadershipLost      a leader's term is over (``check()``, a term's ``guard()``)
     ├── LockNotHeld              release of a lock that is not held, or not by this
     │                            thread / task (also RuntimeError)
     ├── LockArgumentError        bad key or option, refused before any SQL (also ValueError)
     │    └── KindMismatch        a key used as another kind of lock (or semaphore size)
     ├── UpgradeRefused           a read lock's holder asked for the write lock of its key
     │                            (also RuntimeError)
     ├── BackendError             the database failed a statement (the driver's error chained)
     │    ├── DatabaseUnreachable     no connection could be had: nothing was sent or written
     │    │    ├── AuthenticationFailed  the server refused the user, password or role
     │    │    └── PoolExhausted     every pooled connection was checked out, none came free
     │    ├── ConnectionLost          the connection broke mid-statement: its outcome is unknown
     │    └── PoolerMismatch          a transaction-mode pooler used without ``pooler=True``
     ├── SchemaMissing            the lock table does not exist: run ``dblock migrate``
     ├── DowngradeRefused         a schema downgrade would drop live rows of other kinds
     └── ManagerClosed            the LockManager was closed (new requests and waiters)

The classes live here and are re-exported from :mod:`dblock`; they report
themselves as ``dblock.X`` so tracebacks and logs show the name users import.
"""

from __future__ import annotations

__all__ = [
    "AuthenticationFailed",
    "BackendError",
    "ConnectionLost",
    "DBLockError",
    "DatabaseUnreachable",
    "DowngradeRefused",
    "JobSkipped",
    "KindMismatch",
    "LeadershipLost",
    "LockArgumentError",
    "LockBusy",
    "LockLost",
    "LockNotAcquired",
    "LockNotHeld",
    "LockTimeout",
    "ManagerClosed",
    "PoolExhausted",
    "PoolerMismatch",
    "SchemaMissing",
    "UpgradeRefused",
]


class DBLockError(Exception):
    """Root of every error raised by dblock."""

    __module__ = "dblock"


class LockNotAcquired(DBLockError):
    """The lock was not granted. ``level`` says which filter refused it (1 or 2)."""

    __module__ = "dblock"

    def __init__(self, message: str, *, key: str, level: int) -> None:
        super().__init__(message)
        self.key = key
        self.level = level


class LockBusy(LockNotAcquired):
    """A fail-fast request found the lock held.

    ``level == 1``: another thread (or asyncio task) of this process holds or is acquiring it (no
    SQL was sent). ``level == 2``: another process holds the row; ``holder`` is its
    owner string when the database told us.
    """

    __module__ = "dblock"

    def __init__(self, key: str, *, level: int, holder: str | None = None) -> None:
        here = "another thread or task of this process"
        where = here if level == 1 else (holder or "another process")
        super().__init__(f"lock {key!r} is held by {where}", key=key, level=level)
        self.holder = holder


class LockTimeout(LockNotAcquired):
    """A waiting request did not get the lock within its timeout."""

    __module__ = "dblock"

    def __init__(self, key: str, *, timeout: float, level: int, holder: str | None = None) -> None:
        by = f" (held by {holder})" if holder else ""
        super().__init__(
            f"lock {key!r} not acquired within {timeout:g} s{by}", key=key, level=level
        )
        self.timeout = timeout
        self.holder = holder


class JobSkipped(LockNotAcquired):
    """A job run did not run (``once(..., on_skip="raise")``): another process
    runs it, its key is kept after a recent run (``at_least``), or its fire
    time already has a run. ``job`` is the job's name, ``reason`` one of
    ``"running"``, ``"kept"`` (the last run ended less than ``at_least``
    after it began), ``"done"`` (its fire time ran), ``"failed"`` (its fire
    time's run failed or died, and ``retry_failed`` is off); ``holder`` names
    who holds the key when known, ``level`` as for :class:`LockBusy` (0: the
    record of runs decided, the key was free)."""

    __module__ = "dblock"

    def __init__(
        self,
        job: str,
        *,
        key: str,
        reason: str,
        detail: str,
        level: int = 2,
        holder: str | None = None,
    ) -> None:
        super().__init__(f"job {job!r} skipped: {detail}", key=key, level=level)
        self.job = job
        self.reason = reason
        self.detail = detail
        self.holder = holder


class LockLost(DBLockError):
    """We held the lock but no longer do: the lease ran out and the row was taken
    over or swept. Work done since then ran without mutual exclusion."""

    __module__ = "dblock"

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"lock {key!r} was lost: {reason}")
        self.key = key
        self.reason = reason


class LeadershipLost(LockLost):
    """A leader's term is over (its lock lost, or stepped down) or never began:
    raised by ``Leader.check()``, by a term's ``guard()`` in the application's
    transaction (roll it back: a successor may lead), and as an ``async with
    leader`` block's exit when the loss cancelled it. ``fence`` is the term's
    (None if there was none)."""

    __module__ = "dblock"

    def __init__(self, role: str, fence: int | None, reason: str) -> None:
        DBLockError.__init__(
            self,
            f"not leading {role!r}"
            + ("" if fence is None else f" (term {fence} is over)")
            + f": {reason}",
        )
        self.key = f"leader:{role}"
        self.role = role
        self.fence = fence
        self.reason = reason


class LockNotHeld(DBLockError, RuntimeError):
    """``release()`` on a lock this holder no longer holds (already released), or
    by a thread or task other than the one that acquired it (as ``threading.RLock``
    refuses; ``release(force=True)`` hands the release over explicitly)."""

    __module__ = "dblock"


class LockArgumentError(DBLockError, ValueError):
    """A bad key or option. Raised before any statement is sent."""

    __module__ = "dblock"


class KindMismatch(LockArgumentError):
    """A key is used with one kind of lock (exclusive, rw, semaphore of N
    permits); a request of another kind for it, or a semaphore request with
    another N, is refused. ``requested`` and ``existing`` name both, as
    ``"exclusive"``, ``"rw"`` or ``"semaphore(N)"``."""

    __module__ = "dblock"

    def __init__(self, key: str, *, requested: str, existing: str, where: str = "") -> None:
        at = f" {where}" if where else ""
        super().__init__(
            f"lock {key!r} is used as {existing}{at}; a request for it as {requested} "
            f"is refused (a key is used with one kind of lock)"
        )
        self.key = key
        self.requested = requested
        self.existing = existing


class UpgradeRefused(DBLockError, RuntimeError):
    """A holder of a key's read lock asked for its write lock. Two readers
    upgrading at once would each wait for the other to leave, so dblock refuses
    at once (no SQL) instead: release the read lock first, or take the write
    lock from the start (a writer may take its own key's read lock)."""

    __module__ = "dblock"


class BackendError(DBLockError):
    """The database could not be reached or failed a statement.

    The original driver or SQLAlchemy exception is chained as ``__cause__``.
    """

    __module__ = "dblock"


class DatabaseUnreachable(BackendError):
    """No statement was sent: the database could not be reached, or no
    connection could be had. Nothing was written; trying again may work."""

    __module__ = "dblock"


class AuthenticationFailed(DatabaseUnreachable):
    """The server answered but refused to log in: a wrong password, an unknown
    user or role, a role not permitted to log in, or no access to the database
    (PostgreSQL SQLSTATE 28P01 / 28000; MySQL and MariaDB errors 1044, 1045,
    1698). Trying again will not help until the credentials or grants change.
    The message carries the server's reason; the URL's password is masked."""

    __module__ = "dblock"


class PoolExhausted(DatabaseUnreachable):
    """Every connection of the engine's pool is checked out, and none came
    free in time. Nothing was sent."""

    __module__ = "dblock"


class PoolerMismatch(BackendError):
    """PostgreSQL answered that a statement psycopg prepared on this
    connection is missing, already there, or takes other parameters: the
    server connection changed under the client between transactions, as
    behind a transaction-mode pooler (pgbouncer) used without
    ``pooler=True``. The server is reachable; it is a configuration mistake,
    not an outage, and retrying does not cure it."""

    __module__ = "dblock"


class ConnectionLost(BackendError):
    """The connection broke while a statement was in flight: it may or may not
    have been committed. dblock resolves what it can (an acquire reads its row
    back; a release is retried once the database answers) before raising this."""

    __module__ = "dblock"


class SchemaMissing(DBLockError):
    """The lock table (or its sequence) does not exist in the database."""

    __module__ = "dblock"

    def __init__(self, table: str, url: str, *, missing: str | None = None) -> None:
        option = "" if table == "dblock_locks" else f" --table {table}"
        # ``missing``: another of the schema's tables (the record of job runs).
        what = f"the lock table {table!r}" if missing is None else missing
        super().__init__(
            f"{what} does not exist in {url}; "
            f"run `dblock migrate{option}` (or LockManager.create_schema()) first"
        )
        self.table = table
        self.url = url


class DowngradeRefused(DBLockError):
    """A schema downgrade to a revision without multi-row kinds found live
    rows it would have to drop (semaphore permits, read-write or queued
    rows): ``keys`` lists them. Release them, or let their leases run out."""

    __module__ = "dblock"

    def __init__(self, table: str, revision: str, keys: list[str]) -> None:
        shown = ", ".join(repr(k) for k in keys[:10]) + (" …" if len(keys) > 10 else "")
        super().__init__(
            f"cannot downgrade {table!r} to revision {revision}: it holds live rows of "
            f"kinds that revision cannot store, for the keys {shown}; release them "
            f"(`dblock release --force KEY`) or wait for their leases to end, then retry"
        )
        self.table = table
        self.revision = revision
        self.keys = keys


class ManagerClosed(DBLockError):
    """The :class:`~dblock.LockManager` was closed: refused to new requests, and
    raised in every thread still waiting for a lock of that manager."""

    __module__ = "dblock"


def install_hint(extra: str) -> str:
    """How to install dblock's ``extra``, said the same way in every message
    and page: dblock is installed from its clone (or a wheel built from it),
    not from a package index, so the form naming the package would look for
    it there."""
    return (
        f"pip install '.[{extra}]' in dblock's clone "
        f"(or pip install 'dblock-<version>-py3-none-any.whl[{extra}]')"
    )
