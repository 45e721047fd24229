"""The busy response, for the view decorator and the middleware."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from django.http import HttpRequest, HttpResponse

from ...errors import LockNotAcquired
from .._http import busy_body, log_busy, negotiate
from . import conf

__all__ = ["LockBusyMiddleware", "busy_response", "find_request"]


def find_request(args: Sequence[Any]) -> HttpRequest | None:
    """The request among a view's positional arguments (after ``self`` for a
    method of a class-based view)."""
    return next((a for a in args[:2] if isinstance(a, HttpRequest)), None)


def busy_response(request: HttpRequest | None, exc: LockNotAcquired) -> HttpResponse:
    status = conf.read().busy_status
    accept = request.headers.get("Accept") if request is not None else None
    content_type = request.content_type if request is not None else None
    where = f"{request.method} {request.path}" if request is not None else "a view"
    log_busy(exc, where)
    body, mime = busy_body(exc, status, negotiate(accept, content_type))
    return HttpResponse(body, status=status, content_type=mime)


class LockBusyMiddleware:
    """Answers 409 (or 423) when a lock is busy anywhere under a view."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        return self.get_response(request)

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if isinstance(exception, LockNotAcquired):
            return busy_response(request, exception)
        return None
