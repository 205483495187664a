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
    user.reload()  # a reload opens on the same source, scenario and failures (all in the link)
    wait_title(user, "Replay")
    assert wait_metric(user, "failed ranks") == "5 ranks"
    # another scenario: the failed ranks that come along are announced, those outside its mesh too
    user.set_viewport_size({"width": 1024, "height": 768})
    pick_scenario(user, "default")
    notice = user.locator('[data-testid="stAlertContentInfo"]', has_text="Failed ranks carried over from whatif_1024")
    notice.wait_for(timeout=30_000)
    assert "600-603 dropped" in notice.inner_text()


def _drawn_with_shipped_fonts(page, label: str) -> None:  # noqa: ANN001 (a playwright Page)
    """The play/pause button reads ``label`` in plain characters, its symbol drawn by the icon font the
    app ships (Material Symbols), not by a system font that may lack it (a missing-glyph box)."""
    page.wait_for_function(
        "(l) => { const b = document.querySelector('.st-key-replay_play button');"
        " return b && b.innerText.trim().endsWith(l); }",
        arg=label,
        timeout=20_000,
    )
    drawn = page.evaluate("""() => { const b = document.querySelector('.st-key-replay_play button');
        const icon = b.querySelector('[data-testid="stIconMaterial"]');
        const text = [...b.querySelectorAll('p')].map(e => e.innerText).join('');
        return [text, icon ? getComputedStyle(icon).fontFamily : null]; }""")
    assert drawn[0] == label and all(ord(ch) < 128 for ch in drawn[0]), drawn
    assert drawn[1] is not None and "Material Symbols" in drawn[1], drawn


def test_play_advances_the_replay(server, page):
    page.goto(f"{server}/replay")
    _settle(page)
    ARTIFACTS.mkdir(exist_ok=True)

    def event_no() -> int:
        text = page.locator("strong", has_text="Event ").first.inner_text()  # "Event 7/28:"
        return int(text.split()[1].split("/")[0])

    before = event_no()
    _drawn_with_shipped_fonts(page, "play")
    page.locator(".st-key-replay_play button").first.click()
    page.wait_for_function(
        r"""(before) => [...document.querySelectorAll('strong')].some(e => {
        const m = e.innerText.match(/^Event (\d+)\//);
        return m && parseInt(m[1]) > before + 1;
    })""",
        arg=before,
        timeout=20_000,
    )
    _drawn_with_shipped_fonts(page, "pause")
    page.locator(".st-key-replay_play button").first.click()
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


def test_a_path_that_is_no_recording_is_one_line_saying_what_it_is(server, browser, tmp_path):
    """Replay given a folder, an empty file and a JSON object that is no event: each is one error naming
    the path and what it is (at 1,024 x 768, the narrower width), never a traceback."""
    import json

    empty, obj = tmp_path / "empty.jsonl", tmp_path / "obj.jsonl"
    empty.write_text("")
    obj.write_text(json.dumps({"name": "not a recording"}) + "\n")
    pg = browser.new_page(viewport={"width": 1024, "height": 768})
    pg.goto(f"{server}/replay")
    settle(pg)
    pg.get_by_text("recording", exact=True).first.click()
    pg.locator(".st-key-replay_recording input").click()
    pg.get_by_role("option", name="another file…", exact=True).click()
    for path, said in (
        (tmp_path, "is a folder, not a recording"),
        (empty, "the file is empty"),
        (obj, "line 1 is not an event"),
    ):
        box = pg.get_by_label("path of a recording (.jsonl)")
        box.fill(str(path))
        box.press("Enter")
        alert = pg.locator('[data-testid="stAlertContentError"]', has_text=said)
        alert.wait_for(timeout=20_000)
        assert str(path) in alert.inner_text() and "expected a .jsonl file" in alert.inner_text()
        assert pg.locator('[data-testid="stException"]').count() == 0
    pg.close()
