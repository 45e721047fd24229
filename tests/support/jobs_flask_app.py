"""A Flask app for ``flask dblock run`` (``flask --app tests.support.jobs_flask_app``):
the DBLock extension on ``$DBLOCK_URL``, and a ``work`` command that takes
a while and says it ran."""

from __future__ import annotations

import time

import click
from flask import Flask

from dblock.contrib.flask import DBLock

app = Flask(__name__)
dblock = DBLock(app)


@app.cli.command("work")
@click.option("--seconds", type=float, default=1.0)
@click.argument("label")
def work(seconds: float, label: str) -> None:
    time.sleep(seconds)
    click.echo(f"ran {label}")


@app.cli.command("fail")
def fail() -> None:
    raise click.ClickException("failed on purpose")
