"""What a web request gets when its lock is busy: 409 Conflict (or 423
Locked) with a short body, JSON when the client asks for JSON.

The body names neither the lock key nor the holder: keys can carry
identifiers and the owner names hosts and processes, neither of which is the
client's business. Both are logged instead.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ..errors import LockArgumentError, LockNotAcquired, LockTimeout

__all__ = ["BUSY_REASONS", "busy_body", "check_busy_status", "log_busy", "wants_json"]

log = logging.getLogger("dblock")

BUSY_REASONS = {409: "Conflict", 423: "Locked"}


def check_busy_status(value: object, name: str) -> int:
    if isinstance(value, bool) or value not in BUSY_REASONS:
        raise LockArgumentError(f"{name} must be 409 or 423, got {value!r}")
    assert isinstance(value, int)
    return value


def wants_json(accept: str | None, content_type: str | None) -> bool:
    """JSON if the client lists ``application/json`` at least as high as
    ``text/html`` in Accept, or sent JSON and did not ask for HTML."""
    quality: dict[str, float] = {}
    for part in (accept or "").split(","):
        media, *params = (p.strip() for p in part.split(";"))
        q = 1.0
        for param in params:
            if param.startswith("q="):
                try:
                    q = float(param[2:])
                except ValueError:
                    q = 0.0
        if media:
            quality[media.lower()] = max(q, quality.get(media.lower(), 0.0))
    json_q = quality.get("application/json", 0.0)
    html_q = quality.get("text/html", 0.0)
    if json_q > 0:
        return json_q >= html_q
    sent_json = (content_type or "").split(";")[0].strip().lower() == "application/json"
    return sent_json and html_q == 0


def busy_message(exc: LockNotAcquired) -> str:
    if isinstance(exc, LockTimeout):
        return (
            f"Another request held the lock for this resource for longer than "
            f"{exc.timeout:g} s. Try again shortly."
        )
    return "Another request holds the lock for this resource. Try again shortly."


def busy_body(exc: LockNotAcquired, status: int, *, as_json: bool) -> tuple[str, str]:
    """(body, content type) for the busy response."""
    message = busy_message(exc)
    if as_json:
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
