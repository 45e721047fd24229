"""Withdrawals serialised per user with dblock, in a FastAPI app.

export DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1/test
python app.py init-db                  # the example's tables, two accounts, dblock's table
uvicorn --factory app:create_app       # or several processes, --workers N
curl -X POST localhost:8000/users/1/withdraw --json '{"amount": 5}'
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel
from sqlalchemy import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from dblock import AsyncLockManager
from dblock.contrib.fastapi import add_busy_handler

#: The app's database, a SQLAlchemy URL with its usual (blocking) driver.
DEFAULT_URL = "sqlite:///example.sqlite3"
ASYNC_DRIVERS = {"postgresql": "psycopg", "mysql": "aiomysql", "mariadb": "aiomysql"}


class Base(DeclarativeBase):
    pass


class Account(Base):
    __tablename__ = "account"
    id: Mapped[int] = mapped_column(primary_key=True)
    balance: Mapped[int]


class Withdrawal(BaseModel):
    amount: int


async def pay_out(user_id: int, amount: int) -> None:
    """The slow part of a withdrawal: a payment provider's API, say."""
    await asyncio.sleep(0.02)


def app_engine(url: str) -> AsyncEngine:
    """The app's own async engine (aiosqlite, psycopg 3, aiomysql)."""
    parsed = make_url(url)
    backend = parsed.get_backend_name()
    driver = ASYNC_DRIVERS.get(backend, "aiosqlite")
    connect_args = {"timeout": 30} if backend == "sqlite" else {}
    async_url = parsed.set(drivername=f"{backend}+{driver}")
    return create_async_engine(async_url, connect_args=connect_args)


def locks_url(url: str) -> str:
    """dblock's table: in the app's database, except for a SQLite file (one
    writer per file: a lock row would queue behind the app's own write
    transactions), where it gets a file of its own beside the app's."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database:
        return url  # the app's database has room for dblock's table
    app_file = Path(parsed.database)  # db.sqlite3 -> db.dblock.sqlite3
    lock_file = app_file.with_name(f"{app_file.stem}.dblock{app_file.suffix}")
    return parsed.set(database=str(lock_file)).render_as_string(hide_password=False)


def create_app(url: str | None = None) -> FastAPI:
    url = url or os.environ.get("DATABASE_URL", DEFAULT_URL)
    engine = app_engine(url)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    alocks = AsyncLockManager(locks_url(url), ttl=30)  # a crashed worker blocks a user 30 s

    @alocks.locked("user:{user_id}", timeout=30)
    async def withdraw(user_id: int, amount: int) -> int | None:
        """Read, check and write a balance: right only if one request per
        user runs it at a time. Returns the new balance, or None if too low."""
        async with sessions.begin() as session:
            account = await session.get(Account, user_id)
            if account is None:
                raise HTTPException(404, "no such account")
            if amount > account.balance:
                return None
            await pay_out(user_id, amount)
            account.balance -= amount
            return account.balance

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await alocks.close()
        await engine.dispose()

    app = FastAPI(lifespan=lifespan)
    app.state.alocks, app.state.engine = alocks, engine
    add_busy_handler(app)  # LockBusy / LockTimeout anywhere below: 409

    @app.post("/users/{user_id}/withdraw")
    async def withdraw_view(user_id: int, body: Withdrawal) -> dict[str, int]:
        balance = await withdraw(user_id, body.amount)
        if balance is None:
            raise HTTPException(400, "insufficient funds")
        return {"user_id": user_id, "balance": balance}

    @app.get("/users/{user_id}/balance")
    @alocks.locked("user:{user_id}", blocking=False)  # busy: 409 at once
    async def balance_view(user_id: int) -> dict[str, int]:
        async with sessions() as session:
            account = await session.get(Account, user_id)
        if account is None:
            raise HTTPException(404, "no such account")
        return {"user_id": user_id, "balance": account.balance}

    return app


async def init_db(url: str | None = None) -> None:
    """Create the example's tables, accounts 1 and 2 with 1000 each, and dblock's table."""
    url = url or os.environ.get("DATABASE_URL", DEFAULT_URL)
    engine = app_engine(url)
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)
    async with async_sessionmaker(engine).begin() as session:
        for user_id in (1, 2):
            if await session.get(Account, user_id) is None:
                session.add(Account(id=user_id, balance=1000))
    await engine.dispose()
    async with AsyncLockManager(locks_url(url)) as alocks:
        await alocks.create_schema()


if __name__ == "__main__":
    if sys.argv[1:] != ["init-db"]:
        sys.exit("usage: python app.py init-db")
    asyncio.run(init_db())
