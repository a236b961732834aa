"""Debian's headless Chromium, driven by Selenium through Debian's chromedriver (never a
browser or driver download)."""

from __future__ import annotations

import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
# The flags that run Chromium as root on a machine without network or display.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,1150")


def missing_reason() -> str | None:
    if not CHROMIUM.exists() or not CHROMEDRIVER.exists():
        return "Debian's chromium and chromium-driver are not installed (.ci/setup --system installs them)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    return None


@contextmanager
def chromium():
    """One headless Chromium session (skips the test where there is none); quit on the way out."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="dspark-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for f in FLAGS:
        opts.add_argument(f)
    opts.add_argument("--user-data-dir=" + profile)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    try:
        yield driver
    finally:
        driver.quit()  # ends chromedriver and every Chromium process it started
        shutil.rmtree(profile, ignore_errors=True)


# What the page shows, read in one go: every panel's value cells, the node cards, the chart.
READ_PAGE = """
const out = {panels: {}, nodes: {}, banner: null, pair: document.getElementById('pair').textContent,
             version: document.getElementById('version').textContent,
             lines: document.querySelectorAll('#chart polyline').length,
             round: document.body.dataset.round || null};
for (const p of document.querySelectorAll('[data-panel]')) {
  out.panels[p.dataset.panel] = Array.from(p.querySelectorAll('.v')).map(e => e.textContent);
}
for (const n of document.querySelectorAll('.node')) {
  const f = {};
  for (const e of n.querySelectorAll('[data-field]')) f[e.dataset.field] = e.textContent;
  out.nodes[n.dataset.node] = f;
}
const b = document.getElementById('banner');
out.banner = b.hidden ? null : b.textContent;
out.runtimeLine = document.getElementById('line').textContent;
const sw = document.getElementById('switch');
out.switching = sw.hidden ? null : sw.textContent;
out.otherLine = Array.from(document.querySelectorAll('.node.otherline')).map(n => n.dataset.node);
return out;
"""


def read_page(driver) -> dict:
    return driver.execute_script(READ_PAGE)


def wait_for(driver, predicate, timeout: float, poll: float = 0.2) -> dict:
    """Read the page until predicate(page) holds; the last reading goes into the failure."""
    deadline = time.monotonic() + timeout
    page = read_page(driver)
    while not predicate(page):
        if time.monotonic() > deadline:
            raise AssertionError(f"page did not reach the expected state in {timeout} s; last seen: {page}")
        time.sleep(poll)
        page = read_page(driver)
    return page
