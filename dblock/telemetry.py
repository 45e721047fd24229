"""Metrics and traces through OpenTelemetry's API (dblock's ``otel`` extra).

dblock only *reports* through the API; the application decides where the
data goes by installing the SDK and an exporter (Prometheus, OTLP, ...), as
with any instrumented library. Without ``opentelemetry-api`` installed, or
with ``telemetry=False``, the lock keeps ``None`` in place of a
:class:`Telemetry` and the hot path pays one ``is None`` test per event.

Metrics (attributes in brackets; all low-cardinality, never a key):

=================================  =========  ==========================================
``dblock.lock.acquisitions``       counter    [outcome, level, kind]: granted, busy,
                                              timeout, error
``dblock.lock.wait``               histogram  seconds from the request to its outcome,
                                              for requests that had to wait [outcome, kind]
``dblock.lock.hold``               histogram  seconds from grant to release [kind]
``dblock.lock.lost``               counter    locks lost while held [kind]
``dblock.lock.renewals``           counter    [outcome]: renewed, failed (per lock)
``dblock.lock.renewal.lateness``   histogram  seconds a renewal pass ran after its most
                                              overdue lock was due (0: on time); past a
                                              third of the lease it is also a WARNING
``dblock.lock.handoffs``           counter    rows passed to a local waiter without a
                                              round trip through the table
``dblock.sweeper.deleted``         counter    rows the sweeper deleted [reason]
``dblock.job.runs``                counter    job runs [outcome]: success, failed,
                                              skipped (with [reason]: running, kept,
                                              done, failed)
``dblock.leader.elections``        counter    terms this process began [role]
``dblock.leader.wait``             histogram  seconds from standing to elected [role]:
                                              how long the role went without this
                                              process leading it
``dblock.leader.terms``            counter    terms this process ended [role, reason]:
                                              stepped_down, lost
``dblock.leader.leading``          up-down    1 while this process leads [role]: the
                                              sum over processes is the role's leaders
=================================  =========  ==========================================

Every instrument also carries ``dblock.table``, so two managers on two tables
can be told apart.

Traces: one span ``dblock.acquire`` per acquisition that waits (a request
granted at once has none: that is the uncontended hot path), a child of the
caller's current span, with ``dblock.key.prefix`` (the key up to its first
``:``, e.g. ``user``), ``dblock.key.hash`` (a SHA-256 prefix: keys often carry
user ids, which do not belong in a trace backend; ``key_attribute="raw"``
puts the key itself), ``dblock.level``, ``dblock.outcome`` and, when granted,
``dblock.fence``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from .errors import LockArgumentError, LockBusy, LockTimeout, install_hint

if TYPE_CHECKING:
    from opentelemetry.metrics import MeterProvider
    from opentelemetry.trace import Span, TracerProvider

__all__ = [
    "KeyAttribute",
    "Recorder",
    "Telemetry",
    "Watch",
    "available",
    "outcome_of",
    "recorder_for",
]

KeyAttribute = Literal["hash", "raw", "none"]

_monotonic = time.monotonic

#: Acquisition outcomes, as the ``dblock.outcome`` attribute says them.
GRANTED, BUSY, TIMEOUT, ERROR = "granted", "busy", "timeout", "error"


def outcome_of(exc: BaseException) -> tuple[str, None, int | None]:
    """How a request that raised ``exc`` ended: (outcome, fence, level)."""
    if isinstance(exc, LockBusy):
        return BUSY, None, exc.level
    if isinstance(exc, LockTimeout):
        return TIMEOUT, None, exc.level
    return ERROR, None, None


def available() -> bool:
    """Is OpenTelemetry's API installed?"""
    return importlib.util.find_spec("opentelemetry") is not None


def _version() -> str:
    from ._version import __version__

    return __version__


@dataclasses.dataclass(frozen=True, kw_only=True)
class Telemetry:
    """How a manager reports: the ``telemetry=`` option of :class:`~dblock.LockManager`.

    ``telemetry=True`` (the default when ``opentelemetry-api`` is installed)
    means ``Telemetry()``: the global meter and tracer providers, whatever
    the application sets with ``metrics.set_meter_provider`` (before or after
    the manager is made). Pass providers to report elsewhere (tests do).
    """

    meter_provider: MeterProvider | None = None
    tracer_provider: TracerProvider | None = None
    key_attribute: KeyAttribute = "hash"

    def __post_init__(self) -> None:
        if self.key_attribute not in ("hash", "raw", "none"):
            raise LockArgumentError(
                f"key_attribute must be 'hash', 'raw' or 'none', got {self.key_attribute!r}"
            )


def recorder_for(option: bool | Telemetry | None, table: str) -> Recorder | None:
    """The recorder a manager keeps for its ``telemetry`` option (``None``: report nothing)."""
    if option is False or (option is None and not available()):
        return None
    if option is None or option is True:
        option = Telemetry()
    if not available():
        raise LockArgumentError(
            f"telemetry needs OpenTelemetry's API, dblock's otel extra: {install_hint('otel')}"
        )
    return Recorder(option, table=table)


class Recorder:
    """The instruments of one lock manager. Every method records one event."""

    def __init__(self, options: Telemetry, *, table: str, kind: str = "exclusive") -> None:
        from opentelemetry import metrics, trace

        meter = metrics.get_meter("dblock", _version(), meter_provider=options.meter_provider)
        self._tracer = trace.get_tracer(
            "dblock", _version(), tracer_provider=options.tracer_provider
        )
        self._key_attribute = options.key_attribute
        self._acquisitions = meter.create_counter(
            "dblock.lock.acquisitions", unit="{acquisition}", description="lock requests by outcome"
        )
        self._wait = meter.create_histogram(
            "dblock.lock.wait", unit="s", description="time waited by requests that waited"
        )
        self._hold = meter.create_histogram(
            "dblock.lock.hold", unit="s", description="time from grant to release"
        )
        self._lost = meter.create_counter(
            "dblock.lock.lost", unit="{lock}", description="locks lost while held"
        )
        self._renewals = meter.create_counter(
            "dblock.lock.renewals", unit="{renewal}", description="lease renewals by outcome"
        )
        self._lateness = meter.create_histogram(
            "dblock.lock.renewal.lateness",
            unit="s",
            description="how long after it was due a renewal pass ran",
        )
        self._handoffs = meter.create_counter(
            "dblock.lock.handoffs", unit="{handoff}", description="rows passed to a local waiter"
        )
        self._swept = meter.create_counter(
            "dblock.sweeper.deleted", unit="{row}", description="rows deleted by the sweeper"
        )
        self._jobs = meter.create_counter(
            "dblock.job.runs", unit="{run}", description="job runs by outcome (skipped included)"
        )
        self._elections = meter.create_counter(
            "dblock.leader.elections", unit="{term}", description="terms this process began"
        )
        self._election_wait = meter.create_histogram(
            "dblock.leader.wait", unit="s", description="time from standing to elected"
        )
        self._terms = meter.create_counter(
            "dblock.leader.terms", unit="{term}", description="terms this process ended"
        )
        self._leading = meter.create_up_down_counter(
            "dblock.leader.leading", unit="{leader}", description="1 while this process leads"
        )
        # Attribute sets built once: recording reuses them (no dict per event).
        base = {"dblock.table": table}
        self._base = base
        self._kind = {**base, "dblock.kind": kind}
        self._outcomes = {
            (outcome, level): {**self._kind, "dblock.outcome": outcome, "dblock.level": level}
            for outcome in (GRANTED, BUSY, TIMEOUT, ERROR)
            for level in (1, 2)
        }
        self._waits = {o: {**self._kind, "dblock.outcome": o} for o in (GRANTED, TIMEOUT, ERROR)}
        # The level-1 refusal is the cheapest path dblock has (no SQL, a few
        # hundred nanoseconds): its event is one pre-bound call.
        self.refused_locally: Callable[[], None] = functools.partial(
            self._acquisitions.add, 1, self._outcomes[BUSY, 1]
        )
        # A request granted at its first try, without waiting (the lock's
        # fast path, which makes no Watch): also one pre-bound call.
        self.granted_at_once: Callable[[], None] = functools.partial(
            self._acquisitions.add, 1, self._outcomes[GRANTED, 2]
        )
        self._renewal = {
            ok: {**base, "dblock.outcome": "renewed" if ok else "failed"} for ok in (True, False)
        }

    # -- acquisitions -----------------------------------------------------------

    def watch(self, key: str) -> Watch:
        """Follow one request from here to its outcome."""
        return Watch(self, key)

    def acquired(self, outcome: str, level: int, waited: float | None = None) -> None:
        """One request ended: ``outcome`` at ``level``; ``waited`` seconds if it waited."""
        self._acquisitions.add(1, self._outcomes[outcome, level])
        if waited is not None:
            self._wait.record(waited, self._waits.get(outcome, self._kind))

    def wait_span(self, key: str, level: int) -> Span:
        """Start the span of a request that has to wait; end it with :meth:`end_wait`."""
        attributes: dict[str, Any] = {
            **self._kind,
            "dblock.key.prefix": key.split(":", 1)[0],
            "dblock.level": level,
        }
        if self._key_attribute == "hash":
            attributes["dblock.key.hash"] = hashlib.sha256(key.encode()).hexdigest()[:16]
        elif self._key_attribute == "raw":
            attributes["dblock.key"] = key
        return self._tracer.start_span("dblock.acquire", attributes=attributes)

    @staticmethod
    def end_wait(span: Span, outcome: str, level: int, fence: int | None = None) -> None:
        span.set_attribute("dblock.outcome", outcome)
        span.set_attribute("dblock.level", level)
        if fence is not None:
            span.set_attribute("dblock.fence", fence)
        if outcome == ERROR:
            from opentelemetry.trace import StatusCode

            span.set_status(StatusCode.ERROR)
        span.end()

    # -- held locks -------------------------------------------------------------

    def released(self, held_for: float) -> None:
        self._hold.record(held_for, self._kind)

    def lost(self) -> None:
        self._lost.add(1, self._kind)

    def renewals(self, count: int, *, ok: bool) -> None:
        self._renewals.add(count, self._renewal[ok])

    def renewal_lateness(self, seconds: float) -> None:
        self._lateness.record(seconds, self._base)

    def handoff(self) -> None:
        self._handoffs.add(1, self._base)

    def job_run(self, outcome: str, reason: str | None) -> None:
        """A job ran (``success``, ``failed``) or was skipped (and why)."""
        attributes = {**self._base, "dblock.outcome": outcome}
        if reason is not None:
            attributes["dblock.reason"] = reason
        self._jobs.add(1, attributes)

    def elected(self, role: str, waited: float) -> None:
        """This process began a term of ``role`` after standing ``waited`` seconds."""
        attributes = {**self._base, "dblock.role": role}
        self._elections.add(1, attributes)
        self._election_wait.record(waited, attributes)
        self._leading.add(1, attributes)

    def term_ended(self, role: str, reason: str) -> None:
        """A term of ``role`` this process led ended (``stepped_down``, ``lost``)."""
        attributes = {**self._base, "dblock.role": role}
        self._terms.add(1, {**attributes, "dblock.reason": reason})
        self._leading.add(-1, attributes)

    def swept(self, reason: str, count: int) -> None:
        if count:
            self._swept.add(count, {**self._base, "dblock.reason": reason})


class Watch:
    """One request's acquisition, as the recorder sees it: started when the
    request reaches the registry, told when (and at which level) it starts
    to wait, and ended once with its outcome."""

    __slots__ = ("_key", "_recorder", "_span", "_start", "level")

    def __init__(self, recorder: Recorder, key: str) -> None:
        self._recorder = recorder
        self._key = key
        self._start = _monotonic()
        self._span: Span | None = None
        self.level = 2

    def waiting(self, level: int) -> None:
        """The request waits (queued at level 1, or for the row at level 2)."""
        self.level = level
        if self._span is None:
            self._span = self._recorder.wait_span(self._key, level)

    def done(self, outcome: str, fence: int | None = None, level: int | None = None) -> None:
        if self._span is None and outcome == GRANTED and level is None:
            # Granted without waiting: the uncontended hot path, one event.
            recorder = self._recorder
            recorder._acquisitions.add(1, recorder._outcomes[GRANTED, self.level])
            return
        level = self.level if level is None else level
        if outcome == TIMEOUT and self._span is None:
            self.waiting(level)  # it asked to wait and ran out of time before its first sleep
        span = self._span
        waited = None if span is None else _monotonic() - self._start
        self._recorder.acquired(outcome, level, waited)
        if span is not None:
            self._recorder.end_wait(span, outcome, level, fence)
