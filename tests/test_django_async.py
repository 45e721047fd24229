"""Django async views and functions under dblock.contrib.django (issue 11):
``locked`` / ``locked_view`` on ``async def`` (same options, same busy
response), ``alock``, one level 1 for the process's threads and tasks, a
streamed body under ASGI, and two real uvicorn processes serving the example
project's ASGI application to concurrent requests, its ledger checked."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.test import AsyncClient, override_settings

import dblock.contrib.django as dj
from dblock import AsyncLockManager, LockBusy, LockManager, LockTimeout
from dblock.contrib.django import conf
from tests.support import ledger, web

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "django_project"

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _fresh_manager() -> Iterator[None]:
    dj.reset_manager()
    yield
    dj.reset_manager()


@pytest.fixture
def accounts() -> None:
    from accounts.models import Account

    for user_id in (1, 2):
        Account.objects.update_or_create(id=user_id, defaults={"balance": 1000})


def other_manager() -> LockManager:
    """Another process's view of the lock table (its own registry)."""
    return LockManager(conf.url_for("default"))


@pytest.fixture
def ledger_path(tmp_path: Path) -> Iterator[Path]:
    """The example's critical sections watched in this process (and in the
    servers started with ``$DBLOCK_TEST_LEDGER``): tests/support/ledger.py."""
    path = tmp_path / "ledger"
    for module in ledger.django_modules():
        ledger.watch(module, path)
    yield path
    for module in ledger.django_modules():
        ledger.unwatch(module)


async def closing_django_connections(main: Any) -> Any:
    """Run ``main``, then close the connections Django's async ORM opened on
    asgiref's worker thread (the test client keeps them open after a request,
    and the test database could not be dropped)."""
    from asgiref.sync import sync_to_async
    from django.db import connections

    try:
        return await main
    finally:
        await sync_to_async(connections.close_all)()


def _held_elsewhere(key: str) -> bool:
    with other_manager() as other:
        try:
            with other.lock(key, blocking=False):
                return False
        except LockBusy:
            return True


# -- the decorators on async def ------------------------------------------------------


def test_async_views_withdraw_and_answer_409_through_the_async_client(
    accounts: None, ledger_path: Path
) -> None:
    async def main() -> None:
        client = AsyncClient()
        r = await client.post(
            "/async/users/1/withdraw", {"amount": 5}, content_type="application/json"
        )
        assert (r.status_code, r.json()) == (200, {"user_id": 1, "balance": 995})
        r = await client.post(
            "/async/users/1/withdraw", {"amount": 5000}, content_type="application/json"
        )
        assert r.status_code == 400
        r = await client.get("/async/users/1/balance")
        assert r.json()["balance"] == 995
        r = await client.get("/async/users/9/balance")
        assert r.status_code == 404  # as in every example
        r = await client.post(
            "/async/users/9/withdraw", {"amount": 5}, content_type="application/json"
        )
        assert r.status_code == 404
        with other_manager() as other, other.lock("user:1"):
            as_json = await client.get(
                "/async/users/1/balance", headers={"Accept": "application/json"}
            )
            as_problem = await client.get("/async/users/1/balance", headers={"Accept": "*/*"})
            as_text = await client.get("/async/users/1/balance", headers={"Accept": "text/html"})
            free = await client.get("/async/users/2/balance")
            with override_settings(DBLOCK={"BUSY_STATUS": 423}):
                status_423 = (await client.get("/async/users/1/balance")).status_code
        assert as_json.status_code == 409
        assert as_json.json()["error"] == "locked"
        assert as_problem.headers["Content-Type"] == "application/problem+json"
        assert as_problem.json()["status"] == 409
        assert as_text.content.decode().startswith("409 Conflict: Another request holds")
        assert free.status_code == 200
        assert status_423 == 423
        # Ten concurrent withdrawals for one user from one event loop: tasks
        # queue at level 1, the ledger shows them one at a time.
        rs = await asyncio.gather(
            *(
                client.post(
                    "/async/users/2/withdraw", {"amount": 1}, content_type="application/json"
                )
                for _ in range(10)
            )
        )
        assert [r.status_code for r in rs] == [200] * 10

    asyncio.run(closing_django_connections(main()))
    rows = ledger.rows(ledger_path)
    assert web.ledger_problems(rows) == []
    assert len(rows) == 2 * 11  # the refused withdrawal paid nothing
    from accounts.models import Account

    assert dict(Account.objects.values_list("id", "balance")) == {1: 995, 2: 990}


def test_async_views_served_under_wsgi_get_a_loop_per_request(
    accounts: None, ledger_path: Path
) -> None:
    """Django's sync test client (as a WSGI server) runs each async view in an
    event loop of its own: the async manager's connections of a loop that
    closed are replaced, request after request."""
    from django.test import Client

    client = Client()
    for balance in (990, 980, 970):
        r = client.post("/async/users/1/withdraw", {"amount": 10}, content_type="application/json")
        assert (r.status_code, r.json()) == (200, {"user_id": 1, "balance": balance})
    assert client.get("/async/users/1/balance").json()["balance"] == 970
    assert web.ledger_problems(ledger.rows(ledger_path)) == []
    assert len(ledger.rows(ledger_path)) == 2 * 3


def test_the_async_decorator_takes_the_sync_ones_options() -> None:
    key = f"svc:{uuid.uuid4().hex}"

    @dj.locked(lambda n: f"{key}:{n}", blocking=False, on_busy=lambda e, n: f"busy {n}")
    async def report(n: int) -> str:
        return f"report {n}"

    @dj.locked(lambda: key, timeout=0.2)
    async def waits() -> str:
        return "never"

    class Service:
        @dj.locked("{self.name}", blocking=False)
        async def run(self) -> str:
            return "ran"

        def __init__(self, name: str) -> None:
            self.name = name

    async def main() -> None:
        assert await report(1) == "report 1"
        with other_manager() as other:
            with other.lock(f"{key}:2"):
                assert await report(2) == "busy 2"
            with other.lock(key), pytest.raises(LockTimeout, match=r"0\.2"):
                await waits()
        assert await Service(f"{key}:svc").run() == "ran"

    asyncio.run(main())


def test_threads_and_tasks_of_the_process_share_one_level_1(accounts: None) -> None:
    """A key held by a thread of the process (a sync view) refuses an async
    view's fail-fast request at level 1, without a statement."""
    manager = dj.get_manager()
    amanager = dj.get_async_manager()
    assert isinstance(amanager, AsyncLockManager)
    assert amanager.sync is manager
    assert dj.get_async_manager() is amanager

    async def ask() -> int:
        return (await AsyncClient().get("/async/users/1/balance")).status_code

    with manager.lock("user:1"):
        assert asyncio.run(closing_django_connections(ask())) == 409
    assert asyncio.run(closing_django_connections(ask())) == 200


def test_alock_and_alock_many(accounts: None) -> None:
    key = f"alock:{uuid.uuid4().hex}"

    async def main() -> None:
        async with dj.alock(key) as held:
            assert held.key == key
            assert await asyncio.to_thread(_held_elsewhere, key)
        assert not await asyncio.to_thread(_held_elsewhere, key)
        async with dj.alock_many([f"{key}:b", f"{key}:a"]) as both:
            assert sorted(both) == [f"{key}:a", f"{key}:b"]

        async def another_task() -> None:
            async with dj.alock(f"{key}:a", blocking=False):
                pytest.fail("another task of this loop must be refused")

        async with dj.alock(f"{key}:a", blocking=False):
            async with dj.alock(f"{key}:a", blocking=False):
                pass  # this task re-enters its own key
            with pytest.raises(LockBusy):
                await asyncio.create_task(another_task())

    asyncio.run(main())


def test_reset_manager_drops_the_async_manager() -> None:
    first = dj.get_async_manager()
    dj.reset_manager()
    second = dj.get_async_manager()
    assert second is not first
    assert second.sync is dj.get_manager()


@override_settings(ROOT_URLCONF="tests.support.stream_django_urls")
def test_an_async_views_streamed_body_is_under_the_lock_on_asgi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An async view returns a streamed response: its lock is held for every
    chunk the server sends after the view returned, and released once the
    handler closes the response."""
    from django.core.handlers.asgi import ASGIHandler

    from tests.support.streaming import CHUNKS, chunk

    monkeypatch.setenv("STREAM_GATES", str(tmp_path))
    key = f"avstream:{uuid.uuid4().hex}"
    sent: list[bytes] = []
    held_during: list[bool] = []
    received: list[bool] = []

    async def receive() -> dict[str, Any]:
        if not received:
            received.append(True)
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client never disconnects
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        if message["type"] != "http.response.body" or not message.get("body"):
            return
        sent.append(message["body"])
        held_during.append(await asyncio.to_thread(_held_elsewhere, key))
        (tmp_path / f"{key}.{len(sent)}").touch()  # let the body go on

    path = f"/async-view-stream/{key}"
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "headers": [(b"host", b"testserver")],
        "client": ("127.0.0.1", 1),
        "server": ("testserver", 80),
    }

    async def main() -> bool:
        await ASGIHandler()(scope, receive, send)
        # The release is sent on this loop once the response is closed.
        for _ in range(1000):
            if not await asyncio.to_thread(_held_elsewhere, key):
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())
    assert b"".join(sent).decode() == "".join(chunk(i) for i in range(CHUNKS))
    assert held_during == [True] * CHUNKS


def test_a_sync_view_is_still_served_by_the_sync_decorator() -> None:
    key = f"sync:{uuid.uuid4().hex}"

    @dj.locked_view(lambda request: key, blocking=False)
    def view(request: HttpRequest) -> HttpResponse:
        return HttpResponse("ok")

    assert not asyncio.iscoroutinefunction(view)
    assert view(HttpRequest()).status_code == 200


# -- two uvicorn servers, sync and async views, concurrent requests ---------------


@pytest.mark.slow
def test_two_uvicorn_servers_let_one_request_per_user_in(accounts: None, ledger_path: Path) -> None:
    """Two uvicorn processes serving the example project's ASGI application
    on the test database. Concurrent withdrawals for two users go to both
    servers, half to the async view (tasks on the server's loop) and half to
    the sync view (threads): per process one level 1 filters both, across
    processes the lock row. The ledger shows no two requests for one user
    inside at once, and the balances are exact."""
    env = {
        "EXAMPLE_DB_NAME": connection.settings_dict["NAME"],
        "DJANGO_DEBUG": "0",
        "PYTHONPATH": f"{EXAMPLE.parent.parent}{os.pathsep}{EXAMPLE}",
        "DJANGO_SETTINGS_MODULE": "tests.support.django_env_settings",
        "EXAMPLE_DBLOCK": json.dumps({}),
        ledger.ENV: str(ledger_path),
    }
    ports = [web.free_port(), web.free_port()]
    per_user = 32

    def server(port: int) -> Any:
        return web.serving(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "exampleproject.asgi:application",
                "--port",
                str(port),
            ],
            cwd=EXAMPLE,
            env=env,
            port=port,
            ready_path="/async/users/2/balance",
        )

    with server(ports[0]) as one, server(ports[1]) as two:
        calls = [
            (
                "POST",
                f"{(one, two)[i % 2]}{('/async', '')[(i // 4) % 2]}"
                f"/users/{1 + (i // 2) % 2}/withdraw",
                {"amount": 1},
            )
            for i in range(per_user * 2)
        ]
        assert sum("/async/" in url for _, url, _ in calls) == per_user
        statuses = web.concurrently(calls, threads=16)
    assert statuses == [200] * len(calls)
    rows = ledger.rows(ledger_path)
    assert web.ledger_problems(rows) == []
    assert len(rows) == 2 * len(calls)
    from accounts.models import Account

    assert dict(Account.objects.values_list("id", "balance")) == {
        1: 1000 - per_user,
        2: 1000 - per_user,
    }
