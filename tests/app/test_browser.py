"""The dashboard in a real browser: every page renders without an exception element.

Starts ``streamlit run app/main.py`` headless on a free loopback port, waits for
``/_stcore/health``, drives Debian's Chromium through Playwright, opens every page,
saves a screenshot per page under ``test-artifacts/`` and clicks a rank on the mesh
chart to check the click path end to end.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
# The first request to the fresh server goes straight to a page URL: it must still be routed
# by app/main.py's navigation (the page set, the wide layout), not run as a bare script.
PAGES = {"replay": "replay", "mesh": "", "plans": "plans", "simulate": "simulate", "live": "live"}
NAV = ["Mesh", "Plans", "Simulate", "Replay", "Live"]


def _chromium() -> str | None:
    for candidate in (os.environ.get("MESHPACT_CHROMIUM"), "/usr/lib/chromium/chromium",
                      shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    streamlit = Path(sys.executable).with_name("streamlit")
    proc = subprocess.Popen(
        [str(streamlit), "run", "app/main.py", "--server.address", "127.0.0.1", "--server.port", str(port),
         "--server.headless", "true", "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
                pytest.fail(f"streamlit did not answer /_stcore/health within 60 s:\n{out[-3000:]}")
            time.sleep(0.3)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def page():
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium found: install Debian's chromium (apt-get install chromium) or set MESHPACT_CHROMIUM")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        pg = browser.new_page(viewport={"width": 1440, "height": 2000})
        yield pg
        browser.close()


def _settle(pg) -> None:  # noqa: ANN001 (a playwright Page)
    pg.wait_for_selector("h1", timeout=30_000)
    # The script is done when the status widget stops showing "Running".
    pg.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')", timeout=30_000)
    # Elements arrive before they are drawn: wait for the skeletons and for every chart to plot.
    pg.wait_for_function("""() => !document.querySelector('[data-testid="stSkeleton"]') &&
        [...document.querySelectorAll('[data-testid="stPlotlyChart"]')].every(c => c.querySelector('.main-svg'))""",
                         timeout=30_000)
    pg.wait_for_timeout(800)


@pytest.mark.parametrize("name", list(PAGES))
def test_page_renders_without_exception(server, page, name):
    page.goto(f"{server}/{PAGES[name]}")
    _settle(page)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"page-{name}.png"), full_page=True)
    assert page.locator('[data-testid="stException"]').count() == 0
    assert page.locator("h1").first.inner_text().strip()
    links = [t.split("\n")[-1] for t in page.locator('[data-testid="stSidebarNavLink"]').all_inner_texts()]
    assert links == NAV


def test_clicking_a_rank_on_the_chart_fails_it(server, page):
    page.goto(server)
    _settle(page)
    page.wait_for_selector(".js-plotly-plot .scatterlayer", timeout=30_000)
    # Pixel position of rank 5's marker, from plotly's own axes.
    xy = page.evaluate("""() => {
        const gd = document.querySelector('.js-plotly-plot');
        const L = gd._fullLayout;
        for (const tr of gd._fullData) {
            const cd = tr.customdata || [];
            for (let i = 0; i < cd.length; i++) {
                if (cd[i] && cd[i][0] === 5) {
                    const box = gd.getBoundingClientRect();
                    return [box.left + L._size.l + L.xaxis.d2p(tr.x[i]), box.top + L._size.t + L.yaxis.d2p(tr.y[i])];
                }
            }
        }
        return null;
    }""")
    assert xy is not None, "rank 5 is not drawn on the mesh chart"
    page.mouse.click(xy[0], xy[1])
    page.wait_for_function(
        "() => [...document.querySelectorAll('[data-testid=\"stMetricValue\"]')].some(e => e.innerText.includes('31/32'))",
        timeout=20_000,
    )
    _settle(page)
    page.screenshot(path=str(ARTIFACTS / "page-mesh-rank5-failed.png"), full_page=True)
    assert page.locator('[data-testid="stException"]').count() == 0


def test_play_advances_the_replay(server, page):
    page.goto(f"{server}/replay")
    _settle(page)

    def event_no() -> int:
        text = page.locator("strong", has_text="Event ").first.inner_text()  # "Event 7/28:"
        return int(text.split()[1].split("/")[0])

    before = event_no()
    page.get_by_role("button", name="▶ play").click()
    page.wait_for_function(r"""(before) => [...document.querySelectorAll('strong')].some(e => {
        const m = e.innerText.match(/^Event (\d+)\//);
        return m && parseInt(m[1]) > before + 1;
    })""", arg=before, timeout=20_000)
    page.get_by_role("button", name="⏸ pause").click()
    _settle(page)
    assert event_no() > before + 1
    assert page.locator('[data-testid="stException"]').count() == 0


def test_uploading_a_bad_scenario_shows_a_readable_error(server, page, tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text("name: typo\ncluster:\n  domains:\n    - {name: a, vendor: cuda, host: h, rankz: 4}\n")
    page.goto(server)
    _settle(page)
    page.locator('[data-testid="stSidebar"]').get_by_text("upload", exact=True).click()
    page.locator('[data-testid="stSidebar"] input[type="file"]').set_input_files(str(bad))
    alert = page.locator('[data-testid="stAlertContentError"]').first
    alert.wait_for(timeout=20_000)
    text = alert.inner_text()
    assert "typo.yaml" in text and "rankz" in text and "unknown field" in text
    assert page.locator('[data-testid="stException"]').count() == 0
    page.screenshot(path=str(ARTIFACTS / "scenario-upload-error.png"), full_page=True)
