"""The dashboard in a real browser, driven as a person would.

Starts ``streamlit run app/main.py`` headless on a free loopback port
(:func:`meshpact.app.serve.dashboard_server`), drives Debian's Chromium through
Playwright, opens every page (a screenshot each under ``test-artifacts/``), and checks
the flows end to end: the scenario and failures follow the user from page to page (the
Mesh chart's click, box, typed ranks and drill-down are in ``test_browser_mesh.py``; what
is cut at 1,024 and 1,400 px, on every page, at 1,024 and 16,384 ranks, in
``test_browser_layout.py``).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from meshpact.app.serve import (
    CLIPPED_JS, go_to, metric, pick_scenario, settle, wait_metric, wait_metric_change, wait_title,
)

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
# The first request to the fresh server goes straight to a page URL: it must still be routed
# by app/main.py's navigation (the page set, the wide layout), not run as a bare script.
PAGES = {"replay": "replay", "mesh": "", "plans": "plans", "simulate": "simulate", "live": "live"}
NAV = ["Mesh", "Plans", "Simulate", "Replay", "Live"]
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
    if name == "simulate":  # numbers as the charts beside them write them, not "2000.00" hours
        assert page.get_by_label("per-rank MTBF (hours)").input_value() == "2000"
        assert page.get_by_label("days", exact=True).input_value() == "7.0"


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


# every metric and button, and besides them the widget labels and the rank table's cells
LIVE_CLIPPED_JS = CLIPPED_JS.replace("'[data-testid=\"stMetricValue\"] div,", "'[data-testid=\"stWidgetLabel\"] p, "
                                     "[class*=\"st-key-live_row_\"] p, [data-testid=\"stMetricValue\"] div,")
assert LIVE_CLIPPED_JS != CLIPPED_JS, "the selector list of CLIPPED_JS changed: widen LIVE_CLIPPED_JS again"


def _row(pg, rank: int) -> list[str]:  # noqa: ANN001
    """The cells of ``rank``'s row in the Live rank table (rank, pid, incarnation, state, step, generation, ...)."""
    box = pg.locator(f".st-key-live_row_{rank}")  # .first: a fragment's rerun may briefly show the last one too
    return [c.strip() for c in box.first.inner_text().split("\n") if c.strip()] if box.count() else []


def _click(pg, key: str) -> None:  # noqa: ANN001
    button = pg.locator(f".st-key-{key} button").first  # a fragment's rerun may briefly show the last one too
    button.wait_for(timeout=60_000)
    pg.wait_for_function("(k) => { const b = document.querySelector(`.st-key-${k} button`); return b && !b.disabled; }",
                         arg=key, timeout=60_000)
    button.click()


@pytest.mark.live
@pytest.mark.timeout(600)
def test_live_console_hold_kill_from_a_row_watch_recovery_then_replay_and_perfetto(user):
    """The issue's done-when, as a person does it: 4 ranks, held before the faulted run, rank 2
    killed from its row, the replacement and the new generation show in the table while the
    run is still held, Resume, the verdict counts the fault, and the same run opens in Replay
    and as a Perfetto trace."""
    import json

    pg = user
    go_to(pg, "Live", "Live")
    form = pg.locator('[data-testid="stForm"]')
    form.get_by_label("training steps").fill("8")
    form.get_by_label("checkpoint every (steps)").fill("4")
    form.get_by_text("checkpoint baselines", exact=True).click()  # baselines off: shorter
    pg.locator(".st-key-live_pace_start input").click()
    pg.get_by_role("option", name="5 steps/s", exact=True).click()
    form.get_by_role("button", name="Start cluster and train").click()
    # every rank of the faulted run waits before its first step; the reference ran first
    pg.get_by_text("The faulted run is held before its first step").wait_for(timeout=300_000)
    # the page says so only when its rows say held; a fragment's rerun may still show an older
    # copy of a row for a moment (under load it showed rank 3 "starting" once): read until settled
    deadline = time.monotonic() + 30
    while True:
        rows = {r: _row(pg, r) for r in range(4)}
        settled = all(len(cells) > 3 and cells[3] == "held" and cells[2] == "0" for cells in rows.values())
        if settled or time.monotonic() > deadline:
            break
        pg.wait_for_timeout(250)
    assert settled, rows
    killed_pid = rows[2][1]
    pg.wait_for_timeout(300)  # fonts and layout settle
    clipped = pg.evaluate(LIVE_CLIPPED_JS)
    assert clipped == [], f"Live console: cut off: {clipped}"
    pg.screenshot(path=str(ARTIFACTS / "live-console-held.png"), full_page=True)
    _click(pg, "live_kill_2")
    pg.wait_for_function("() => document.body.innerText.includes('Sent from this page: kill rank 2')",
                         timeout=60_000)
    # the held ranks recover with the replacement before anyone presses Resume (Resilient.join_recovery):
    # rank 2 comes back as a new process, every rank held again on generation 1
    deadline = time.monotonic() + 240
    while True:
        rows = {r: _row(pg, r) for r in range(4)}
        settled = (all(len(cells) > 5 and cells[3] == "held" and cells[5] == "1" for cells in rows.values())
                   and rows[2][2] == "1")
        if settled or time.monotonic() > deadline:
            break
        pg.wait_for_timeout(500)
    assert settled, rows
    assert rows[2][1] != killed_pid
    pg.screenshot(path=str(ARTIFACTS / "live-console-recovered-while-held.png"), full_page=True)
    _click(pg, "live_resume")
    verdict = pg.locator('[data-testid="stAlertContentSuccess"]', has_text="Bit-identical")
    verdict.wait_for(timeout=300_000)
    assert "1 of them sent from this page" in verdict.inner_text()
    assert pg.locator('[data-testid="stException"]').count() == 0
    # every rank on generation 1; a fragment's rerun may still show an older copy of a row for a
    # moment: read until settled, and name the rows if they never do
    deadline = time.monotonic() + 30
    while True:
        rows = {r: _row(pg, r) for r in range(4)}
        settled = all(len(cells) > 5 and cells[5] == "1" for cells in rows.values())
        if settled or time.monotonic() > deadline:
            break
        pg.wait_for_timeout(250)
    assert settled, rows
    assert pg.locator(".st-key-live_kill_1 button").first.is_disabled()  # the buttons follow the run: it is over
    pg.screenshot(path=str(ARTIFACTS / "live-console-after-recovery.png"), full_page=True)
    saved = pg.locator("p", has_text="Recording saved:").locator("code").first.inner_text().strip()
    try:
        with pg.expect_download(timeout=60_000) as dl:
            pg.locator(".st-key-live_perfetto button").first.click()
        trace = json.loads(Path(dl.value.path()).read_text())["traceEvents"]
        tracks = {e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
        assert {"rank 0", "rank 1", "rank 2", "rank 3"} <= tracks
        tid2 = next(e["tid"] for e in trace if e.get("name") == "thread_name" and e["args"]["name"] == "rank 2")
        assert any(e["name"] == "fault_injected" and e["tid"] == tid2 and e["args"].get("source") == "dashboard"
                   for e in trace)
        assert {e["name"] for e in trace if e.get("cat") == "recovery"} >= {"consensus", "communicator", "state"}

        _click(pg, "live_replay")
        wait_title(pg, "Replay")
        assert Path(saved).name in pg.locator(".st-key-replay_recording input").first.input_value()
        with pg.expect_download(timeout=60_000) as dl2:
            pg.get_by_role("button", name="Perfetto trace (a track per rank)").click()
        again = json.loads(Path(dl2.value.path()).read_text())["traceEvents"]
        assert [e for e in again if e["name"] == "fault_injected"] == [e for e in trace if e["name"] == "fault_injected"]
        assert pg.locator('[data-testid="stException"]').count() == 0
    finally:
        (ROOT / saved).unlink(missing_ok=True)
