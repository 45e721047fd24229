"""The FastAPI example in examples/fastapi_app (AsyncLockManager, issue 11):
in process through httpx's ASGI transport, and as two real uvicorn servers
taking concurrent requests, whose ledger shows no two requests for one user
inside at once and whose balances are exact."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import httpx
import pytest
import sqlalchemy as sa

from dblock import AsyncLockManager, LockArgumentError
from dblock.contrib.fastapi import add_busy_handler
from tests.support import ledger, web
from tests.support.db import private_database

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "fastapi_app"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dblock_fastapi_example", EXAMPLE / "app.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


example = load_example()


@pytest.fixture
def private_url(db: str, tmp_path: Path) -> Iterator[str]:
    """A database of its own, set up with the example's ``init-db``."""
    with private_database(db, tmp_path) as url:
        asyncio.run(example.init_db(url))
        yield url


@pytest.fixture
def ledger_path(tmp_path: Path) -> Iterator[Path]:
    """The example's critical section watched in this process (and in the
    servers started with ``$DBLOCK_TEST_LEDGER``): tests/support/ledger.py."""
    path = tmp_path / "ledger"
    ledger.watch(example, path)
    yield path
    ledger.unwatch(example)


def balances(url: str) -> dict[int, int]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            return dict(conn.execute(sa.text("SELECT id, balance FROM account")).all())  # type: ignore[arg-type]
    finally:
        engine.dispose()


async def _in_process(url: str) -> None:
    app = example.create_app(url)
    alocks: AsyncLockManager = app.state.alocks
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        r = await client.post("/users/1/withdraw", json={"amount": 30})
        assert (r.status_code, r.json()) == (200, {"user_id": 1, "balance": 970})
        r = await client.post("/users/1/withdraw", json={"amount": 5000})
        assert r.status_code == 400
        r = await client.get("/users/1/balance")
        assert (r.status_code, r.json()) == (200, {"user_id": 1, "balance": 970})
        r = await client.get("/users/9/balance")
        assert r.status_code == 404  # as in every example
        r = await client.post("/users/9/withdraw", json={"amount": 5})
        assert r.status_code == 404
        # Another process holds user 2: the fail-fast balance view answers 409.
        async with AsyncLockManager(example.locks_url(url)) as other:
            async with other.lock("user:2"):
                r = await client.get(
                    "/users/2/balance", headers={"Accept": "application/problem+json"}
                )
                assert r.status_code == 409
                assert r.headers["content-type"] == "application/problem+json"
                problem = r.json()
                assert problem["status"] == 409
                assert "user:2" not in r.text  # the key is logged, never answered
                r = await client.get("/users/2/balance", headers={"Accept": "text/plain"})
                assert r.status_code == 409
                assert r.text.startswith("409 Conflict")
            r = await client.get("/users/2/balance")
            assert r.status_code == 200
        # Concurrent withdrawals from one loop: tasks queue at level 1.
        rs = await asyncio.gather(
            *(client.post("/users/2/withdraw", json={"amount": 1}) for _ in range(10))
        )
        assert [r.status_code for r in rs] == [200] * 10
        assert sorted(r.json()["balance"] for r in rs) == list(range(990, 1000))
    await alocks.close()
    await app.state.engine.dispose()


def test_the_example_in_process(private_url: str, ledger_path: Path) -> None:
    asyncio.run(_in_process(private_url))
    rows = ledger.rows(ledger_path)
    assert web.ledger_problems(rows) == []
    assert len(rows) == 2 * 11  # the refused withdrawal paid nothing
    assert balances(private_url) == {1: 970, 2: 990}


def test_a_waiting_request_that_times_out_answers_409(db_url: str, key: str) -> None:
    from fastapi import FastAPI

    async def main() -> None:
        alocks = AsyncLockManager(db_url)
        app = FastAPI()
        add_busy_handler(app, status=423)

        @app.get("/slow")
        @alocks.locked(lambda: key, timeout=0.2)
        async def slow() -> str:
            return "never"

        transport = httpx.ASGITransport(app=app)
        async with (
            httpx.AsyncClient(transport=transport, base_url="http://app") as client,
            AsyncLockManager(db_url) as other,
            other.lock(key),
        ):
            r = await client.get("/slow", headers={"Accept": "application/json"})
        assert r.status_code == 423
        assert json.loads(r.text)["error"] == "locked"
        assert "0.2 s" in r.json()["message"]
        await alocks.close()

    asyncio.run(main())


def test_the_busy_status_must_be_409_or_423() -> None:
    from fastapi import FastAPI

    with pytest.raises(LockArgumentError, match="409 or 423"):
        add_busy_handler(FastAPI(), status=500)


@pytest.mark.slow
def test_two_uvicorn_servers_let_one_request_per_user_in(
    private_url: str, ledger_path: Path
) -> None:
    """Two uvicorn processes (one event loop each, so requests of one process
    contend as tasks at level 1, and across processes at level 2) on one
    database; many concurrent withdrawals for two users. The ledger shows no
    two requests for one user inside at once, and no update was lost."""
    env = {"DATABASE_URL": private_url, "PYTHONPATH": str(ROOT), ledger.ENV: str(ledger_path)}
    ports = [web.free_port(), web.free_port()]
    watched = "tests.support.ledger:fastapi_app"  # the example's app, its pay_out watched
    command = [sys.executable, "-m", "uvicorn", "--factory", watched]
    per_user = 30
    with (
        web.serving(
            [*command, "--port", str(ports[0])],
            cwd=EXAMPLE,
            env=env,
            port=ports[0],
            ready_path="/users/2/balance",
        ) as one,
        web.serving(
            [*command, "--port", str(ports[1])],
            cwd=EXAMPLE,
            env=env,
            port=ports[1],
            ready_path="/users/2/balance",
        ) as two,
    ):
        calls = [
            ("POST", f"{(one, two)[i % 2]}/users/{1 + (i // 2) % 2}/withdraw", {"amount": 1})
            for i in range(per_user * 2)
        ]
        statuses = web.concurrently(calls, threads=16)
    assert statuses == [200] * len(calls)
    rows = ledger.rows(ledger_path)
    assert web.ledger_problems(rows) == []
    assert len(rows) == 2 * len(calls)
    assert balances(private_url) == {1: 1000 - per_user, 2: 1000 - per_user}
