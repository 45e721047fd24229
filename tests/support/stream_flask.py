"""A Flask app whose locked views stream their bodies (see streaming.py)."""

from __future__ import annotations

import os

from flask import Flask, Response, stream_with_context

from dblock.contrib.flask import DBLock
from tests.support.streaming import body

dblock = DBLock()
app = Flask(__name__)
app.config["DBLOCK_URL"] = os.environ["STREAM_DBLOCK_URL"]
dblock.init_app(app)


@app.get("/ready")
def ready() -> str:
    return "ok"


@app.get("/response/<key>")
@dblock.locked("{key}", blocking=False)
def response(key: str) -> Response:
    return Response(stream_with_context(body(key)), mimetype="text/plain")


@app.get("/generator/<key>")
@dblock.locked("{key}", blocking=False)
def generator(key: str) -> object:
    return body(key), 200, {"Content-Type": "text/plain"}
