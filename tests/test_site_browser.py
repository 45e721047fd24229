"""The documentation site as a reader sees it: built (``scripts/docs DIR``),
served over HTTP on loopback, and opened in a real headless Chromium
(Debian's ``chromium`` and ``chromium-driver``, as for the Django admin test)
at a laptop's width (1280 px) and a phone's (390 px, in a desktop window).

On every page checked:

* a code block whose content is wider than the block scrolls, and shows it:
  ``overflow-x`` is ``auto`` or ``scroll`` and a scrollbar takes room under
  the text (a reader once saw the front page's diagram end at "critical s"
  with nothing saying there was more);
* every picture (the hand-drawn SVGs under docs/img/) loads: ``naturalWidth
  > 0``, and it is no wider than the page.

* the page loads nothing from anywhere but the site itself (mkdocs.yml: no
  web fonts, no Mermaid from a CDN).
Screenshots go to ``$DBLOCK_SCREENSHOTS`` when it is set, to look at them.
"""

from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from selenium.webdriver.remote.webdriver import WebDriver

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")

WIDTHS = {"laptop": (1280, 800), "phone": (390, 844)}
#: page -> the pictures it must show (the front page is README.md).
PAGES = {
    "": ["two-levels.svg"],
    "internals/": ["handoff.svg"],
    "leases/": ["lease.svg"],
    "high-availability/": ["failover.svg"],
    "benchmarks/": [],
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The built site, served on a free port of 127.0.0.1."""
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "docs"), str(out)],
        env={**os.environ, "DBLOCK_DOCS_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(out))
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.fail(
            "the site test needs Debian's chromium and chromium-driver "
            "(apt-get install chromium chromium-driver; .ci/run installs them)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


def show(driver: WebDriver, url: str, width: int, height: int) -> None:
    """Open ``url`` with a viewport of exactly ``width`` x ``height`` CSS px."""
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        # mobile False even at a phone's width: a phone's browser draws
        # overlay scrollbars only while scrolling, whatever the CSS says; a
        # desktop window that narrow shows what the stylesheet asks for.
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )
    driver.get(url)
    driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "const imgs = [...document.images];"
        "Promise.all(imgs.map(i => i.complete ? null : new Promise(r => {"
        "  i.onload = i.onerror = r; })).concat([document.fonts.ready]))"
        # Two frames after the fonts: a block that a late font made wider
        # is laid out again, scrollbar included, before it is measured.
        ".then(() => requestAnimationFrame(() => requestAnimationFrame(() => done(null))));"
    )


CODE_BLOCKS = """
return [...document.querySelectorAll('.md-content pre > code')].map(c => {
  const style = getComputedStyle(c);
  return {
    text: c.innerText.split('\\n')[0].slice(0, 60),
    scrollWidth: c.scrollWidth,
    clientWidth: c.clientWidth,
    overflowX: style.overflowX,
    scrollbar: c.offsetHeight - c.clientHeight
      - parseFloat(style.borderTopWidth) - parseFloat(style.borderBottomWidth),
  };
});
"""

PICTURES = """
const content = document.querySelector('.md-content').getBoundingClientRect();
return [...document.querySelectorAll('.md-content img')].map(i => ({
  src: i.getAttribute('src'),
  complete: i.complete,
  naturalWidth: i.naturalWidth,
  right: i.getBoundingClientRect().right,
  contentRight: content.right,
}));
"""


@pytest.mark.parametrize("width", list(WIDTHS))
def test_code_blocks_scroll_visibly_and_pictures_load(
    width: str, site: str, browser: WebDriver
) -> None:
    w, h = WIDTHS[width]
    shots = os.environ.get("DBLOCK_SCREENSHOTS")
    problems: list[str] = []
    overflowing = 0
    for page, pictures in PAGES.items():
        show(browser, site + page, w, h)
        where = f"/{page} at {w} px"
        blocks = browser.execute_script(CODE_BLOCKS)
        for block in blocks:
            if block["scrollWidth"] <= block["clientWidth"] + 1:
                continue
            overflowing += 1
            if block["overflowX"] not in ("auto", "scroll"):
                clipped = f"clipped (overflow-x {block['overflowX']})"
                problems.append(f"{where}: {block['text']!r} {clipped}")
            elif block["scrollbar"] <= 0:
                problems.append(f"{where}: {block['text']!r} scrolls without a visible scrollbar")
        seen = browser.execute_script(PICTURES)
        for picture in seen:
            if not (picture["complete"] and picture["naturalWidth"] > 0):
                problems.append(f"{where}: {picture['src']} did not load")
            if picture["right"] > picture["contentRight"] + 1:
                problems.append(f"{where}: {picture['src']} is wider than the page")
        elsewhere = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
            ".filter(n => !n.startsWith(location.origin) && !n.startsWith('data:'))"
        )
        problems += [f"{where}: loads {url} from elsewhere" for url in elsewhere]
        names = [Path(p["src"]).name for p in seen]
        problems += [f"{where}: {name} is not shown" for name in pictures if name not in names]
        if shots:
            Path(shots).mkdir(parents=True, exist_ok=True)
            name = (page.strip("/") or "index") + f"-{w}.png"
            browser.save_screenshot(str(Path(shots) / name))
    assert not problems, "\n".join(problems)
    # Not vacuous: the front page's shell block and the internals page's SQL
    # are wider than a phone, and the front page's at 1280 px too.
    assert overflowing > 0, f"no code block overflows at {w} px: the check saw nothing"


def test_searching_per_user_finds_the_service_layer_first(site: str, browser: WebDriver) -> None:
    """A newcomer's first search: the pages that show how to lock per user
    (their headings say "per user") come before Semaphore and Operations."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    w, h = WIDTHS["laptop"]
    show(browser, site, w, h)
    browser.execute_script("document.querySelector('input.md-search__input').focus()")
    browser.find_element(By.CSS_SELECTOR, "input.md-search__input").send_keys("per user")

    def pages(driver: Any) -> list[str]:
        links = driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item > a")
        found = []
        for link in links:
            page = (link.get_attribute("href") or "").removeprefix(site).split("?")[0]
            if page not in found:
                found.append(page)
        return found

    first = WebDriverWait(browser, 20).until(lambda d: pages(d)[:2] if len(pages(d)) >= 2 else None)
    assert set(first) == {"service-layer/", "getting-started/"}, pages(browser)
