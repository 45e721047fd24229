"""The busy response both web integrations share: which body a client gets
from its Accept header (RFC 9457 problem+json, the older JSON, plain text)."""

from __future__ import annotations

import json

import pytest

from dblock import LockBusy, LockTimeout
from dblock.contrib._http import busy_body, negotiate


@pytest.mark.parametrize(
    ("accept", "content_type", "form"),
    [
        ("*/*", None, "problem"),
        ("application/problem+json", None, "problem"),
        ("application/*", None, "problem"),
        ("application/problem+json, application/json", None, "problem"),
        ("application/json", None, "json"),
        ("application/json, text/html", None, "json"),
        ("application/json;q=0.5, */*;q=0.9", None, "problem"),
        ("text/html,application/xhtml+xml,*/*;q=0.8", None, "text"),  # a browser
        ("text/html, application/json;q=0.9", None, "text"),
        ("text/plain", None, "text"),
        ("text/*", None, "text"),
        ("image/png", None, "text"),  # nothing it accepts: text rather than a 406
        ("*/*;q=0, text/plain", None, "text"),
        ("application/problem+json;q=0, */*", None, "json"),
        (None, None, "text"),  # curl without -H, scripts
        ("", "application/json", "json"),  # sent JSON, said nothing else
        (None, "application/json; charset=utf-8", "json"),
        ("*/*", "application/json", "problem"),
        ("APPLICATION/PROBLEM+JSON; Q=1", None, "problem"),
    ],
)
def test_negotiate(accept: str | None, content_type: str | None, form: str) -> None:
    assert negotiate(accept, content_type) == form


def test_problem_json_body() -> None:
    body, content_type = busy_body(LockBusy("user:42", level=2, holder="web-1:99"), 409, "problem")
    assert content_type == "application/problem+json"
    assert json.loads(body) == {
        "type": "about:blank",
        "title": "Conflict",
        "status": 409,
        "detail": "Another request holds the lock for this resource. Try again shortly.",
    }
    timeout, _ = busy_body(LockTimeout("user:42", timeout=2.5, level=2), 423, "problem")
    problem = json.loads(timeout)
    assert (problem["title"], problem["status"]) == ("Locked", 423)
    assert "longer than 2.5 s" in problem["detail"]
    for text in (body, timeout):  # neither the key nor the holder reaches the client
        assert "user:42" not in text
        assert "web-1" not in text
