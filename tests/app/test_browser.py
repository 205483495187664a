"""The dashboard in a real browser, driven as a person would.

Starts ``streamlit run app/main.py`` headless on a free loopback port
(:func:`meshpact.app.serve.dashboard_server`), drives Debian's Chromium through
Playwright, and checks the flows end to end: the scenario and failures follow the user from
page to page, the replay plays, a bad scenario upload is one readable error (the Mesh chart's
click, box, typed ranks and drill-down are in ``test_browser_mesh.py``; every page opened
from its link, and what is cut at 1,024 and 1,400 px at 1,024 and 16,384 ranks, in
``test_browser_layout.py``; the Live page's runs in ``test_browser_live.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshpact.app.serve import go_to, metric, pick_scenario, settle, wait_metric, wait_metric_change, wait_title

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
TITLES = {"Mesh": "Communicator mesh", "Plans": "Plans", "Simulate": "Simulate", "Replay": "Replay", "Live": "Live"}


@pytest.fixture(scope="module")
def page(browser):
    pg = browser.new_page(viewport={"width": 1440, "height": 2000})
    yield pg
    pg.close()


def _settle(pg) -> None:  # noqa: ANN001 (a playwright Page)
    settle(pg)
    pg.wait_for_timeout(800)


def _type_ranks(pg, text: str) -> None:  # noqa: ANN001
    before = metric(pg, "healthy ranks")
    box = pg.get_by_placeholder("no rank failed")
    box.fill(text)
    box.press("Enter")
    wait_metric_change(pg, "healthy ranks", before)


def test_scenario_and_failures_follow_the_user_across_pages(user):
    pick_scenario(user, "whatif_1024")
    _type_ranks(user, "5, 600-603")
    for nav in ("Plans", "Simulate", "Replay", "Live", "Mesh"):
        go_to(user, nav, TITLES[nav])
        sidebar = user.locator('[data-testid="stSidebar"]').inner_text()
        assert "whatif_1024" in sidebar, nav
        assert user.locator('[data-testid="stException"]').count() == 0, nav
    # the Mesh fragment fills the typed ranks after the page switch has settled: wait for it, then check
    from playwright.sync_api import expect

    expect(user.get_by_placeholder("no rank failed")).to_have_value("5, 600-603", timeout=30_000)
    assert metric(user, "healthy ranks") == "1,019/1,024"
    user.get_by_role("button", name="Replay these failures").click()
    wait_title(user, "Replay")
    # the player fragment draws its metrics after the page's run: wait for it (under load it came late)
    assert wait_metric(user, "failed ranks") == "5 ranks"  # the ids are in its help; "ranks 5, 600-603" is too wide


def test_play_advances_the_replay(server, page):
    page.goto(f"{server}/replay")
    _settle(page)
    ARTIFACTS.mkdir(exist_ok=True)

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
