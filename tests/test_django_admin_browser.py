"""The Django admin page of locks, used as an operator uses it: a real headless
Chromium (Debian's ``chromium`` and ``chromium-driver``) against a running
server of the example project (pytest-django's ``live_server``), with locks
held by another manager on the same database."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from django.contrib.auth.models import Permission, User

import dblock.contrib.django as dj
from dblock import LockLost, LockManager
from dblock.contrib.django import conf
from tests.support.rows import insert_expired

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

pytestmark = pytest.mark.django_db(transaction=True)

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail(
            "the admin browser test needs Debian's chromium and chromium-driver "
            "(apt-get install chromium chromium-driver; .ci/run installs them)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    # The driver given explicitly: Selenium must not try to download one.
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.implicitly_wait(10)
    yield driver
    driver.quit()


@pytest.fixture
def holder() -> Iterator[LockManager]:
    """Another process's manager on the same lock table (its own registry)."""
    dj.reset_manager()
    with LockManager(conf.url_for("default"), renew=False) as m:
        yield m
    dj.reset_manager()


def _staff(name: str, *codenames: str) -> None:
    user = User.objects.create_user(name, password="pw-" + name, is_staff=True)
    for codename in codenames:
        user.user_permissions.add(Permission.objects.get(codename=codename))


def _log_in(driver: WebDriver, base: str, name: str) -> None:
    from selenium.webdriver.common.by import By

    d = driver
    d.get(f"{base}/admin/login/?next=/admin/dblock/lock/")
    d.find_element(By.NAME, "username").send_keys(name)
    d.find_element(By.NAME, "password").send_keys("pw-" + name)
    d.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    d.find_element(By.ID, "result_list")


def _rows(driver: WebDriver) -> dict[str, str]:
    """The result list: key -> the text of its row."""
    from selenium.webdriver.common.by import By

    found: dict[str, str] = {}
    for tr in driver.find_elements(By.CSS_SELECTOR, "#result_list tbody tr"):
        key = tr.find_element(By.CSS_SELECTOR, "th").text
        found[key] = tr.text
    return found


def test_operator_sees_filters_and_force_releases_in_a_browser(
    live_server: object, browser: WebDriver, holder: LockManager
) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    base = str(live_server)
    tag = uuid.uuid4().hex[:6]
    live, crashed, order = f"user:{tag}:1", f"user:{tag}:crashed", f"order{tag}:9001"
    held = holder.acquire(live, ttl=600)
    insert_expired(holder, [crashed], ago=7200)
    order_held = holder.acquire(order, ttl=600)  # kept: a dropped lock is released
    _staff("operator", "view_lock", "force_release_lock")

    _log_in(browser, base, "operator")
    rows = _rows(browser)
    assert {live, crashed, order} <= rows.keys()
    assert "expired" in rows[crashed]
    assert "expired" not in rows[live]

    # Expired only: the crashed holder's row, nothing live.
    browser.find_element(By.LINK_TEXT, "expired (not released)").click()
    assert set(_rows(browser)) == {crashed}
    # Held for over an hour, whatever the lease: the same row (acquired 2 h ago).
    browser.get(f"{base}/admin/dblock/lock/?held=1h")
    assert set(_rows(browser)) == {crashed}
    # One namespace of keys, from the prefix filter's own links.
    browser.get(f"{base}/admin/dblock/lock/")
    browser.find_element(By.LINK_TEXT, f"order{tag}:").click()
    assert set(_rows(browser)) == {order}

    # Force-release the live row with the action.
    browser.get(f"{base}/admin/dblock/lock/?prefix=user:")
    browser.find_element(By.CSS_SELECTOR, f"input[name=_selected_action][value='{live}']").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value("force_release")
    browser.find_element(By.NAME, "index").click()
    # The action posts, then follows a redirect: a message list found as the
    # next page replaces it goes stale (seen once in a full run); look again.
    message = WebDriverWait(
        browser, 10, ignored_exceptions=(StaleElementReferenceException,)
    ).until(lambda b: b.find_element(By.CSS_SELECTOR, "ul.messagelist").text)
    assert f"Released 1 lock(s): {live}" in message
    assert live not in _rows(browser)
    with pytest.raises(LockLost):
        held.release()
    assert order_held.release()


def test_viewer_without_the_permission_is_refused_in_a_browser(
    live_server: object, browser: WebDriver, holder: LockManager
) -> None:
    from selenium.webdriver.common.by import By

    base = str(live_server)
    key = f"user:{uuid.uuid4().hex[:6]}:viewer"
    held = holder.acquire(key, ttl=600)
    _staff("viewer", "view_lock")

    _log_in(browser, base, "viewer")
    assert key in _rows(browser)
    # No action to offer: Django drops the whole action bar. The page is loaded
    # (its result list was read above), so look without the implicit wait,
    # which an absent element would otherwise sit out in full (10 s).
    browser.implicitly_wait(0)
    assert not browser.find_elements(By.NAME, "action")
    browser.implicitly_wait(10)
    # A forged POST of the action, from the page's own session and CSRF token.
    browser.execute_script(
        """
        const form = document.createElement("form");
        form.method = "post";
        form.action = "/admin/dblock/lock/";
        for (const [name, value] of [
            ["csrfmiddlewaretoken", document.querySelector("[name=csrfmiddlewaretoken]")?.value
                || document.cookie.match(/csrftoken=([^;]+)/)[1]],
            ["action", "force_release"],
            ["_selected_action", arguments[0]],
            ["index", "0"],
        ]) {
            const input = document.createElement("input");
            input.name = name; input.value = value; form.appendChild(input);
        }
        document.body.appendChild(form);
        form.submit();
        """,
        key,
    )
    browser.find_element(By.ID, "content")
    assert "Released" not in browser.page_source
    browser.get(f"{base}/admin/dblock/lock/")
    assert key in _rows(browser)
    assert held.release()
