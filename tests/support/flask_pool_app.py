"""A Flask app whose requests hold a connection of the app's pool (through
the Flask-SQLAlchemy session) while they take a lock, run by the tests as
``flask --app tests.support.flask_pool_app run --with-threads``.

The app's pool has two connections and no overflow; ``POST /hold/<key>``
waits until two requests hold both of them, then takes ``key``. If dblock
took its connections from the app's pool, every lock statement would wait
for a connection no request gives back.

Environment: ``DATABASE_URL``; ``DBLOCK_ENGINE_OPTIONS`` (JSON, optional).
"""

from __future__ import annotations

import json
import os
import threading
import time

import sqlalchemy as sa
from flask import Flask
from flask_sqlalchemy import SQLAlchemy

from dblock.contrib.flask import DBLock

db = SQLAlchemy()
dblock = DBLock()

# Both connections of the app's pool are held once two requests meet here.
both_held = threading.Barrier(2)


def create_app() -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = os.environ["DATABASE_URL"]
    app.config["SQLALCHEMY_ENGINE_OPTIONS"] = {
        "pool_size": 2,
        "max_overflow": 0,
        "pool_timeout": 3,
    }
    if os.environ.get("DBLOCK_ENGINE_OPTIONS"):
        app.config["DBLOCK_ENGINE_OPTIONS"] = json.loads(os.environ["DBLOCK_ENGINE_OPTIONS"])
    db.init_app(app)
    dblock.init_app(app)

    @app.get("/ready")
    def ready() -> str:
        return "ok"

    @app.post("/hold/<key>")
    def hold(key: str) -> str:
        db.session.execute(sa.text("SELECT 1"))  # the session now holds a pooled connection
        both_held.wait(60)
        with dblock.lock(key, timeout=8):
            db.session.execute(sa.text("SELECT 1"))
            time.sleep(0.1)  # long enough that the other request waits for the lock
        db.session.commit()
        return "ok"

    return app
