"""Django views whose locked responses stream their bodies (see streaming.py)."""

from __future__ import annotations

from django.db import transaction
from django.http import HttpRequest, HttpResponse, StreamingHttpResponse
from django.urls import path

from dblock.contrib.django import locked_view
from tests.support.streaming import async_body, body


def ready(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


@locked_view("{key}", blocking=False)
def streamed(request: HttpRequest, key: str) -> StreamingHttpResponse:
    return StreamingHttpResponse(body(key), content_type="text/plain")


@locked_view("{key}", blocking=False)
def streamed_async(request: HttpRequest, key: str) -> StreamingHttpResponse:
    return StreamingHttpResponse(async_body(key), content_type="text/plain")


urlpatterns = [
    path("ready", ready),
    path("stream/<str:key>", streamed),
    path("stream-async/<str:key>", streamed_async),
]


@transaction.non_atomic_requests  # Django refuses ATOMIC_REQUESTS for async views
@locked_view("{key}", blocking=False)
async def streamed_by_async_view(request: HttpRequest, key: str) -> StreamingHttpResponse:
    return StreamingHttpResponse(async_body(key), content_type="text/plain")


urlpatterns.append(path("async-view-stream/<str:key>", streamed_by_async_view))
