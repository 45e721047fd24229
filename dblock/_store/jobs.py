"""The job lock's statements, one class per dialect (see :mod:`dblock.jobs`).

Two things a job needs beyond the exclusive lock:

* **Keeping the key after a short run** (``at_least``): instead of the
  DELETE of a release, one UPDATE moves the row's lease end to
  ``acquired_at + at_least``, both on the database's clock, when that is
  still in the future; otherwise the row is deleted as by any release.
* **The record of runs** (``<table>_runs``, revision 0003): one row per run,
  unique per ``(job, fire_time)``. Its INSERT decides whether a fire time
  runs; the job's lock is held around it, so two runners of one job never
  race for the row, and the unique key is the arbiter if a lock was lost.

Every statement runs alone in its own autocommit transaction, as the lock's
do (:mod:`dblock._store.base`), written once as :data:`Steps` for the
blocking and the asyncio drivers.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ..schema import RUNNING, to_utc
from .base import Steps

if TYPE_CHECKING:
    from .base import Store

__all__ = ["KEPT", "JobSQL", "RunRow", "statements"]

#: The end of a kept row's owner: its run ended, ``at_least`` keeps the key.
KEPT = " [run ended; kept for at_least]"

_UTC = timezone.utc
_RUN_COLUMNS = (
    "run_id, job, fire_time, runner, token, started_at, finished_at, outcome, detail, "
    "attempt, next_fire"
)


@dataclasses.dataclass(frozen=True, slots=True)
class RunRow:
    """One row of the record of runs, as read (times are database time, UTC)."""

    run_id: str
    job: str
    fire_time: datetime | None
    runner: str
    token: str
    started_at: datetime
    finished_at: datetime | None
    outcome: str
    detail: str | None
    attempt: int
    next_fire: datetime | None
    #: The database's time when the row was read.
    now: datetime

    @property
    def duration(self) -> float | None:
        """Seconds from start to finish; for a run still marked running, so far."""
        end = self.finished_at or (self.now if self.outcome == RUNNING else None)
        return None if end is None else (end - self.started_at).total_seconds()

    def as_json(self) -> dict[str, Any]:
        def iso(value: datetime | None) -> str | None:
            return None if value is None else value.isoformat()

        return {
            "job": self.job,
            "fire_time": iso(self.fire_time),
            "run_id": self.run_id,
            "runner": self.runner,
            "started_at": iso(self.started_at),
            "finished_at": iso(self.finished_at),
            "outcome": self.outcome,
            "detail": self.detail,
            "attempt": self.attempt,
            "duration": self.duration,
            "next_fire": iso(self.next_fire),
        }


def _row(row: tuple[Any, ...]) -> RunRow:
    (run_id, job, fire, runner, token, started, finished, outcome, detail, attempt, nxt, now) = row
    started_at, now_at = to_utc(started), to_utc(now)
    assert started_at is not None
    assert now_at is not None
    return RunRow(
        str(run_id),
        str(job),
        to_utc(fire),
        str(runner),
        str(token),
        started_at,
        to_utc(finished),
        str(outcome),
        None if detail is None else str(detail),
        int(attempt),
        to_utc(nxt),
        now_at,
    )


def statements(store: Store) -> JobSQL:
    """The job statements of ``store``'s dialect, built once per store."""
    return store.kind_sql(_for_dialect)


def _for_dialect(store: Store) -> JobSQL:
    cls: type[JobSQL] = store.dialect.pick(postgresql=_Postgres, mysql=_MySQL, sqlite=_SQLite)
    return cls(store)


class JobSQL:
    """What a job asks the database, beyond the exclusive lock's statements."""

    #: The database's current time.
    now = "CURRENT_TIMESTAMP"

    def __init__(self, store: Store) -> None:
        self.store = store
        quote = store.quoted
        self.t = quote(store.names.table)
        self.runs = quote(store.names.runs_table)
        self.runs_name = store.names.runs_table
        b = self.bind
        self._keep_sql = (
            f"UPDATE {self.t} SET expires_at = {self.plus('acquired_at', 'keep')}, "
            f"owner = {b('owner')} "
            f"WHERE lock_key = {b('key')} AND slot = '' AND token = {b('token')} "
            f"AND {self.plus('acquired_at', 'keep')} > {self.now}"
        )
        self._read_sql = (
            f"SELECT {_RUN_COLUMNS}, {self.now} FROM {self.runs} "
            f"WHERE job = {b('job')} AND fire_time = {b('fire_time')}"
        )
        self._retake_sql = (
            f"UPDATE {self.runs} SET run_id = {b('run_id')}, runner = {b('runner')}, "
            f"token = {b('token')}, started_at = {self.now}, finished_at = NULL, "
            f"outcome = '{RUNNING}', detail = NULL, attempt = attempt + 1, "
            f"next_fire = {b('next_fire')} "
            f"WHERE job = {b('job')} AND fire_time = {b('fire_time')} AND run_id = {b('old')}"
        )
        self._finish_sql = (
            f"UPDATE {self.runs} SET finished_at = {self.now}, outcome = {b('outcome')}, "
            f"detail = {b('detail')} WHERE run_id = {b('run_id')} AND outcome = '{RUNNING}'"
        )

    # -- dialect idioms ---------------------------------------------------------

    @staticmethod
    def bind(name: str) -> str:
        return f"%({name})s"

    def plus(self, column: str, seconds: str) -> str:
        """SQL for ``column`` plus the parameter ``seconds`` (a float)."""
        raise NotImplementedError

    def time(self, value: datetime | None) -> Any:
        """A time as the dialect's driver binds it for our columns."""
        return value

    def insert_prefix(self) -> str:
        raise NotImplementedError

    def insert_suffix(self) -> str:
        return ""

    # -- at_least ---------------------------------------------------------------

    def keep_steps(self, key: str, token: str, keep: float, owner: str) -> Steps[bool]:
        """End our row's lease at ``acquired_at + keep`` if that is still to
        come (the key stays taken until then, its owner marked with
        :data:`KEPT`, so whoever finds it sees that the run ended); else
        release it as usual. False if the row was not ours any more."""
        marked = owner[: 255 - len(KEPT)] + KEPT
        params = {"key": key, "token": token, "keep": keep, "owner": marked}
        kept = (yield self._keep_sql, params, False, False).rowcount
        if kept > 0:
            return True
        return (yield from self.store.release_steps(key, token))

    # -- the record of runs -----------------------------------------------------

    def insert_steps(
        self,
        *,
        run_id: str,
        job: str,
        fire_time: datetime | None,
        runner: str,
        token: str,
        next_fire: datetime | None,
    ) -> Steps[bool]:
        """Record a run as started (database time); False if ``(job,
        fire_time)`` has a row already (never for ``fire_time=None``)."""
        b = self.bind
        sql = (
            f"{self.insert_prefix()} {self.runs} "
            "(run_id, job, fire_time, runner, token, started_at, outcome, attempt, next_fire) "
            f"VALUES ({b('run_id')}, {b('job')}, {b('fire_time')}, {b('runner')}, "
            f"{b('token')}, {self.now}, '{RUNNING}', 1, {b('next_fire')}){self.insert_suffix()}"
        )
        params = {
            "run_id": run_id,
            "job": job,
            "fire_time": self.time(fire_time),
            "runner": runner,
            "token": token,
            "next_fire": self.time(next_fire),
        }
        return (yield sql, params, False, False).rowcount > 0

    def read_steps(self, job: str, fire_time: datetime) -> Steps[RunRow | None]:
        params = {"job": job, "fire_time": self.time(fire_time)}
        rows = (yield self._read_sql, params, True, False).rows
        return _row(rows[0]) if rows else None

    def retake_steps(
        self,
        *,
        old: str,
        run_id: str,
        job: str,
        fire_time: datetime,
        runner: str,
        token: str,
        next_fire: datetime | None,
    ) -> Steps[bool]:
        """Start the fire time's run again (``retry_failed``) in place of run
        ``old``; False if that row changed meanwhile."""
        params = {
            "old": old,
            "run_id": run_id,
            "job": job,
            "fire_time": self.time(fire_time),
            "runner": runner,
            "token": token,
            "next_fire": self.time(next_fire),
        }
        return (yield self._retake_sql, params, False, False).rowcount > 0

    def forget_steps(self, run_id: str) -> Steps[bool]:
        """Delete the row of a run that never started its job (its start was
        interrupted), so its fire time is not taken for a run that died."""
        sql = (
            f"DELETE FROM {self.runs} "
            f"WHERE run_id = {self.bind('run_id')} AND outcome = '{RUNNING}'"
        )
        return (yield sql, {"run_id": run_id}, False, False).rowcount > 0

    def finish_steps(self, run_id: str, outcome: str, detail: str | None) -> Steps[bool]:
        """Record how run ``run_id`` ended (database time)."""
        params = {"run_id": run_id, "outcome": outcome, "detail": detail}
        return (yield self._finish_sql, params, False, False).rowcount > 0

    # -- admin: dblock jobs, the sweeper ---------------------------------------

    def latest(self, job: str | None = None, *, limit: int = 20) -> list[RunRow]:
        """The latest run of every job (``job=None``), or the ``limit``
        latest runs of ``job``, newest first."""
        b = self.bind
        if job is not None:
            sql = (
                f"SELECT {_RUN_COLUMNS}, {self.now} FROM {self.runs} WHERE job = {b('job')} "
                f"ORDER BY started_at DESC, run_id LIMIT {int(limit)}"
            )
            return [_row(r) for r in self.store.run(sql, {"job": job}, fetch=True).rows]
        columns = ", ".join(f"r.{c.strip()}" for c in _RUN_COLUMNS.split(","))
        sql = (
            f"SELECT {columns}, {self.now} FROM {self.runs} r "
            f"JOIN (SELECT job, max(started_at) AS last FROM {self.runs} GROUP BY job) m "
            f"ON r.job = m.job AND r.started_at = m.last ORDER BY r.job, r.run_id"
        )
        seen: dict[str, RunRow] = {}
        for r in self.store.run(sql, {}, fetch=True).rows:
            row = _row(r)
            seen.setdefault(row.job, row)
        return list(seen.values())

    def prune(self, older_than: float, limit: int) -> int:
        """Delete at most ``limit`` runs started more than ``older_than``
        seconds ago (database time); how many went."""
        raise NotImplementedError


class _Postgres(JobSQL):
    now = "now()"

    def plus(self, column: str, seconds: str) -> str:
        return f"{column} + make_interval(secs => {self.bind(seconds)})"

    def insert_prefix(self) -> str:
        return "INSERT INTO"

    def insert_suffix(self) -> str:
        return " ON CONFLICT DO NOTHING"

    def prune(self, older_than: float, limit: int) -> int:
        sql = (
            f"DELETE FROM {self.runs} WHERE run_id IN (SELECT run_id FROM {self.runs} "
            f"WHERE started_at < now() - make_interval(secs => %(older)s) "
            f"ORDER BY started_at LIMIT %(limit)s FOR UPDATE SKIP LOCKED)"
        )
        return self.store.run(sql, {"older": older_than, "limit": limit}).rowcount


class _MySQL(JobSQL):
    now = "UTC_TIMESTAMP(6)"

    def plus(self, column: str, seconds: str) -> str:
        # MySQL takes no fractional seconds in INTERVAL n SECOND portably: microseconds.
        return f"{column} + INTERVAL ROUND({self.bind(seconds)} * 1000000) MICROSECOND"

    def time(self, value: datetime | None) -> Any:
        return None if value is None else value.astimezone(_UTC).replace(tzinfo=None)

    def insert_prefix(self) -> str:
        # The values are checked before (lengths, text): IGNORE can only
        # skip the duplicate (job, fire_time).
        return "INSERT IGNORE INTO"

    def prune(self, older_than: float, limit: int) -> int:
        sql = (
            f"DELETE FROM {self.runs} WHERE started_at < UTC_TIMESTAMP(6) - "
            f"INTERVAL %(older_us)s MICROSECOND ORDER BY started_at LIMIT %(limit)s"
        )
        params = {"older_us": round(older_than * 1e6), "limit": limit}
        return self.store.run(sql, params).rowcount


class _SQLite(JobSQL):
    now = "((julianday('now') - 2440587.5) * 86400.0)"

    @staticmethod
    def bind(name: str) -> str:
        return f":{name}"

    def plus(self, column: str, seconds: str) -> str:
        return f"{column} + :{seconds}"

    def time(self, value: datetime | None) -> Any:
        return None if value is None else value.timestamp()

    def insert_prefix(self) -> str:
        return "INSERT INTO"

    def insert_suffix(self) -> str:
        return " ON CONFLICT DO NOTHING"

    def prune(self, older_than: float, limit: int) -> int:
        sql = (
            f"DELETE FROM {self.runs} WHERE rowid IN (SELECT rowid FROM {self.runs} "
            f"WHERE started_at < {self.now} - :older ORDER BY started_at LIMIT :limit)"
        )
        return self.store.run(sql, {"older": older_than, "limit": limit}).rowcount
