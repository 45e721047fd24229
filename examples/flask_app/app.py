"""Withdrawals serialised per user with dblock, in a Flask app.

export DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1/test
flask --app app init-db            # the example's tables and two accounts
flask --app app dblock migrate     # dblock's lock table
flask --app app run --with-threads
curl -X POST localhost:5000/users/1/withdraw --json '{"amount": 5}'
"""

from __future__ import annotations

import os
import time

from flask import Flask, abort, jsonify, request
from flask_sqlalchemy import SQLAlchemy

from dblock.contrib.flask import DBLock

db = SQLAlchemy()
dblock = DBLock()  # no app yet: decorators below resolve it per call


class Account(db.Model):
    id = db.Column(db.Integer, primary_key=True)
    balance = db.Column(db.Integer, nullable=False)


def pay_out(user_id: int, amount: int) -> None:
    """The slow part of a withdrawal: a payment provider's API, say."""
    time.sleep(0.02)


@dblock.locked("user:{user_id}", timeout=30)
def withdraw(user_id: int, amount: int) -> int | None:
    """Read, check and write a balance: right only if one request per user
    runs it at a time. Returns the new balance, or None if too low."""
    account = db.session.get(Account, user_id)
    if account is None:
        abort(404, "no such account")
    balance = account.balance
    if amount > balance:
        return None
    pay_out(user_id, amount)
    account.balance = balance - amount
    db.session.commit()
    return account.balance


def create_app(config: dict[str, object] | None = None) -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ.get(
        "DATABASE_URL", "sqlite:///example.sqlite3"
    )
    app.config["DBLOCK_TTL"] = 30  # seconds a crashed worker can block a user
    app.config.update(config or {})
    db.init_app(app)
    dblock.init_app(app)  # after db: dblock borrows Flask-SQLAlchemy's engine

    @app.post("/users/<int:user_id>/withdraw")
    def withdraw_view(user_id: int) -> object:
        amount = int(request.get_json()["amount"])
        balance = withdraw(user_id, amount)
        if balance is None:
            abort(400, "insufficient funds")
        return jsonify(user_id=user_id, balance=balance)

    @app.get("/users/<int:user_id>/balance")
    @dblock.locked("user:{user_id}", blocking=False)  # busy: 409 from the extension
    def balance_view(user_id: int) -> object:
        account = db.session.get(Account, user_id)
        if account is None:
            abort(404, "no such account")
        return jsonify(user_id=user_id, balance=account.balance)

    @app.cli.command("init-db")
    def init_db() -> None:
        """Create the example's tables and accounts 1 and 2 with 1000 each."""
        db.create_all()
        for user_id in (1, 2):
            if db.session.get(Account, user_id) is None:
                db.session.add(Account(id=user_id, balance=1000))
        db.session.commit()

    return app
