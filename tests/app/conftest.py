"""What the browser tests share: the dashboard served on loopback and one headless Chromium,
each once per test module."""

from __future__ import annotations

import pytest

from meshpact.app.serve import chromium_path, dashboard_server


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
