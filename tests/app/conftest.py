"""What the browser tests share: the dashboard served on loopback and one headless Chromium,
each once per test module, and a fresh page per test."""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path

import pytest

from meshpact.app.serve import chromium_path, dashboard_server, settle

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"  # screenshots, and a failed test's recordings


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Marks a test whose own call failed (``item.call_failed``): its fixtures keep what explains it."""
    report = yield
    if report.when == "call":
        item.call_failed = report.failed  # type: ignore[attr-defined]
    return report


@pytest.fixture(scope="module")
def server():
    with dashboard_server() as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    exe = chromium_path()
    if exe is None:
        pytest.skip("no Chromium found: install Debian's chromium (apt-get install chromium) or set MESHPACT_CHROMIUM")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def user(browser, server):
    """A fresh session at a first-time user's window size (1400x900), the page drawn."""
    ARTIFACTS.mkdir(exist_ok=True)
    pg = browser.new_page(viewport={"width": 1400, "height": 900})
    pg.goto(server)
    settle(pg)
    yield pg
    pg.close()
