"""A password given as a URL query parameter is masked wherever dblock shows
the URL (issue 9, item 10), as the user-info password already is."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from dblock import BackendError, LockManager
from dblock._engine import mask, mask_text
from tests.support.cli import dblock

pytestmark = pytest.mark.filterwarnings("ignore:'passwd' is deprecated:DeprecationWarning")

SECRET = "s3cret-pw"
PARAMS = ["password", "passwd", "pwd", "sslpassword"]


@pytest.mark.parametrize("param", PARAMS)
def test_mask_hides_query_passwords(param: str) -> None:
    url = f"postgresql+psycopg://app:{SECRET}@db/app?{param}={SECRET}&sslmode=require"
    shown = mask(url)
    assert SECRET not in shown
    assert f"{param}=***" in shown
    assert "app:***@db/app" in shown
    assert "sslmode=require" in shown
    assert SECRET not in mask(sa.make_url(url))
    assert SECRET not in mask_text(f"unrecognized arguments: --url {url} list")


@pytest.mark.databases("postgresql")
@pytest.mark.parametrize("param", ["password", "sslpassword"])
def test_manager_repr_and_url_hide_a_query_password(db_url: str, key: str, param: str) -> None:
    """The server trusts local connections: the password is accepted and ignored."""
    url = sa.make_url(db_url).update_query_dict({param: SECRET}).render_as_string(False)
    with LockManager(url) as m:
        with m.lock(key, blocking=False):
            pass
        assert SECRET not in repr(m)
        assert SECRET not in m.url
        assert f"{param}=***" in m.url


@pytest.mark.databases("postgresql", "mariadb")
@pytest.mark.parametrize("param", ["password", "passwd"])
def test_backend_errors_hide_a_query_password(db_url: str, key: str, param: str) -> None:
    # A port nothing listens on: every statement fails with a BackendError.
    url = sa.make_url(db_url).set(port=1).update_query_dict({param: SECRET})
    with LockManager(url.render_as_string(False)) as m:
        assert SECRET not in repr(m) + m.url
        with pytest.raises(BackendError) as info:
            m.acquire(key)
        assert SECRET not in str(info.value)
        assert "***" in str(info.value)
        with pytest.raises(BackendError) as info:
            m.create_schema()
        assert SECRET not in str(info.value)


@pytest.mark.databases("postgresql", "mariadb")
def test_cli_never_prints_a_query_password(db_url: str) -> None:
    url = sa.make_url(db_url).set(port=1).update_query_dict({"password": SECRET})
    text = url.render_as_string(False)
    runs = [
        dblock("list", "--url", text),
        dblock("--url", text, "stats"),
        dblock("--url", text, "bogus-command"),
        dblock("list", "--url", text, "--no-such-option"),
        dblock("release", "k", "--force", "--yes", "--url", text),
        dblock("migrate", "--url", text),
    ]
    for done in runs:
        assert done.returncode != 0
        assert SECRET not in done.stdout + done.stderr, done.stderr
        assert "Traceback" not in done.stderr
