"""FastAPI (and any Starlette app): a busy lock answers 409.

::

    from dblock import AsyncLockManager
    from dblock.contrib.fastapi import add_busy_handler

    alocks = AsyncLockManager(url)
    app = FastAPI()
    add_busy_handler(app)            # LockBusy / LockTimeout -> 409 (or 423)

    @app.get("/users/{user_id}/balance")
    @alocks.locked("user:{user_id}", blocking=False)
    async def balance(user_id: int) -> dict[str, int]: ...

The body is the one the Flask and Django integrations answer with
(:mod:`dblock.contrib._http`): RFC 9457 problem+json for clients that accept
it, the older JSON for ``application/json``, plain text otherwise; it names
neither the key nor the holder (both are logged).
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from ..errors import LockNotAcquired
from ._http import busy_body, check_busy_status, log_busy, negotiate

__all__ = ["add_busy_handler", "busy_response"]


def busy_response(request: Request, exc: LockNotAcquired, *, status: int = 409) -> Response:
    """The busy response for ``request``, negotiated from its Accept header."""
    log_busy(exc, f"{request.method} {request.url.path}")
    form = negotiate(request.headers.get("accept"), request.headers.get("content-type"))
    body, mime = busy_body(exc, status, form)
    return Response(body, status_code=status, media_type=mime)


def add_busy_handler(app: Any, *, status: int = 409) -> None:
    """Answer ``status`` (409 or 423) when a lock is busy anywhere under an
    endpoint of ``app`` (a FastAPI or Starlette application)."""
    status = check_busy_status(status, "status")

    async def handler(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, LockNotAcquired)
        return busy_response(request, exc, status=status)

    app.add_exception_handler(LockNotAcquired, handler)
