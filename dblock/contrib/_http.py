"""What a web request gets when its lock is busy: 409 Conflict (or 423
Locked) with a short body in the form the client asks for:

* ``application/problem+json`` (RFC 9457) for clients that accept it,
  ``*/*`` or ``application/*`` included: ``type`` (``about:blank``),
  ``title`` (the status phrase), ``status`` and ``detail``;
* the older ``application/json`` body (``error``, ``status``, ``message``,
  ``retryable``) for clients that ask for ``application/json`` itself, or
  send JSON without an Accept header;
* plain text otherwise: browsers (``text/html``), ``text/plain`` and
  clients sending no Accept header.

The body names neither the lock key nor the holder: keys can carry user ids
and other identifiers, and the owner names hosts and processes, none of
which is the client's business. Both are logged instead.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from ..errors import LockArgumentError, LockNotAcquired, LockTimeout

__all__ = [
    "BUSY_REASONS",
    "PROBLEM_JSON",
    "Form",
    "busy_body",
    "busy_message",
    "check_busy_status",
    "log_busy",
    "negotiate",
]

log = logging.getLogger("dblock")

BUSY_REASONS = {409: "Conflict", 423: "Locked"}
PROBLEM_JSON = "application/problem+json"

Form = Literal["problem", "json", "text"]

# What each form answers to in Accept, most specific first (text/html is
# answered with text: dblock renders no pages). On equal quality the first
# form listed wins.
_FORMS: tuple[tuple[Form, tuple[str, ...]], ...] = (
    ("problem", (PROBLEM_JSON,)),
    ("json", ("application/json",)),
    ("text", ("text/plain", "text/html")),
)


def check_busy_status(value: object, name: str) -> int:
    if isinstance(value, bool) or value not in BUSY_REASONS:
        raise LockArgumentError(f"{name} must be 409 or 423, got {value!r}")
    assert isinstance(value, int)
    return value


def _accepted(accept: str) -> dict[str, float]:
    """Accept's media ranges (lower case) and their quality."""
    quality: dict[str, float] = {}
    for part in accept.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        q = 1.0
        for param in params:
            if param.replace(" ", "").lower().startswith("q="):
                try:
                    q = min(max(float(param.split("=", 1)[1]), 0.0), 1.0)
                except ValueError:
                    q = 0.0
        if media:
            quality[media.lower()] = max(q, quality.get(media.lower(), 0.0))
    return quality


def _quality(quality: dict[str, float], media: str) -> float:
    """The quality Accept gives ``media``: its most specific matching range's."""
    kind = media.split("/", maxsplit=1)[0]
    for candidate in (media, f"{kind}/*", "*/*"):
        if candidate in quality:
            return quality[candidate]
    return 0.0


def negotiate(accept: str | None, content_type: str | None) -> Form:
    """Which body a client gets, from its Accept header and the type of the
    body it sent."""
    if not accept or not accept.strip():
        sent_json = (content_type or "").split(";")[0].strip().lower() == "application/json"
        return "json" if sent_json else "text"
    quality = _accepted(accept)
    best: Form = "text"
    best_q = 0.0
    for form, media in _FORMS:
        q = max(_quality(quality, m) for m in media)
        if q > best_q:
            best, best_q = form, q
    return best


def busy_message(exc: LockNotAcquired) -> str:
    if isinstance(exc, LockTimeout):
        return (
            f"Another request held the lock for this resource for longer than "
            f"{exc.timeout:g} s. Try again shortly."
        )
    return "Another request holds the lock for this resource. Try again shortly."


def busy_body(exc: LockNotAcquired, status: int, form: Form) -> tuple[str, str]:
    """(body, content type) for the busy response."""
    message = busy_message(exc)
    if form == "problem":
        problem: dict[str, Any] = {
            "type": "about:blank",
            "title": BUSY_REASONS[status],
            "status": status,
            "detail": message,
        }
        return json.dumps(problem), PROBLEM_JSON
    if form == "json":
        payload: dict[str, Any] = {
            "error": "locked",
            "status": status,
            "message": message,
            "retryable": True,
        }
        return json.dumps(payload), "application/json"
    return f"{status} {BUSY_REASONS[status]}: {message}\n", "text/plain; charset=utf-8"


def log_busy(exc: LockNotAcquired, where: str) -> None:
    log.info("dblock: %s answered busy for %r: %s", where, exc.key, exc)
