"""The Mesh page's canvas in a real browser: what a click, a box, typed ranks and the
16,384-rank drill-down do, end to end.

Debian's Chromium through Playwright (skipped without one), the app served on 127.0.0.1.
Each test reads the answer twice, from sides that do not share code: the page Streamlit
drew from Python (the metrics, the text box, the recovery comparison) and the pixels'
owner, the canvas, through the small ``window.meshpact`` handle it exposes (the ids it
paints as selected, where it draws a cell). The cells a box should catch are worked out
here from where the canvas says it drew every rank, not taken from the canvas's answer.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from meshpact.app.serve import (
    CLIPPED_JS,
    click_rank,
    metric,
    pick_scenario,
    settle,
    still_rank_xy,
    wait_metric_change,
)
from meshpact.app.state import parse_ranks

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
CANVAS = 'iframe[title$="mesh_canvas"]'


def _canvas(pg, i: int = -1):  # noqa: ANN001, ANN202 (a playwright Page and Frame)
    frames = pg.locator(CANVAS)
    handle = frames.nth(frames.count() - 1 if i < 0 else i).element_handle()
    return handle.content_frame()


def _painted(pg, i: int = -1) -> list[int]:  # noqa: ANN001
    return _canvas(pg, i).evaluate("() => window.meshpact.selected()")


def _painted_soon(pg, want: list[int], within_s: float = 5.0) -> list[int]:  # noqa: ANN001
    """The painted ranks once they are ``want`` or ``within_s`` passed: the canvas paints on the click's own
    event, which a loaded machine may deliver a moment late; the Python side is asserted after it."""
    deadline = time.monotonic() + within_s
    got = _painted(pg)
    while got != want and time.monotonic() < deadline:
        time.sleep(0.05)
        got = _painted(pg)
    return got


def _typed_failed(pg) -> frozenset[int]:  # noqa: ANN001
    """The failed ranks as the text box writes them, read back by the page's own parser."""
    return parse_ranks(pg.get_by_placeholder("no rank failed").input_value(), range(1 << 20))


def _rebuilt(pg) -> int:  # noqa: ANN001
    """How many ranks in-memory rebind rebuilds, as the comparison's caption says."""
    text = pg.get_by_text("In-memory rebind rebuilds the communicators", exact=False).inner_text()
    found = re.search(r"belonged to \(([\d,]+) ranks\)", text)
    assert found is not None, text
    return int(found.group(1).replace(",", ""))


def _page_xy(pg, i: int, ident: int, timeout_s: float = 20.0) -> tuple[float, float]:  # noqa: ANN001
    """Where canvas ``i`` draws ``ident`` on the page, once two reads 150 ms apart agree (as ``still_rank_xy``)."""

    def read() -> tuple[float, float]:
        frames = pg.locator(CANVAS)
        frame = frames.nth(frames.count() - 1 if i < 0 else i)
        frame.scroll_into_view_if_needed()
        box = frame.bounding_box()
        x, y = _canvas(pg, i).evaluate(f"() => window.meshpact.xy({ident})")
        return box["x"] + x, box["y"] + y

    deadline = time.monotonic() + timeout_s
    xy = read()
    while time.monotonic() < deadline:
        pg.wait_for_timeout(150)
        again = read()
        if again == xy:
            break
        xy = again
    return xy


def _drag(pg, a: tuple[float, float], b: tuple[float, float]) -> None:  # noqa: ANN001
    pg.mouse.move(*a)
    pg.mouse.down()
    pg.mouse.move((a[0] + b[0]) / 2, (a[1] + b[1]) / 2, steps=4)
    pg.mouse.move(*b, steps=4)
    pg.mouse.up()


def test_a_click_fails_exactly_that_rank_and_the_comparison_follows(user):
    assert "Fail a rank" in user.locator('[data-testid="stMain"]').inner_text()
    click_rank(user, 5)
    assert _painted_soon(user, [5]) == [5]  # painted by the canvas itself, before Python has answered
    assert wait_metric_change(user, "healthy ranks", "32/32") == "31/32"
    assert _typed_failed(user) == {5}
    assert metric(user, "in-memory rebind downtime") is not None  # the comparison is drawn for this failure
    one = _rebuilt(user)
    user.screenshot(path=str(ARTIFACTS / "mesh-canvas-rank5-failed.png"), full_page=True)
    click_rank(user, 16)  # the bridge rank of the other domain: two domains broken now
    assert wait_metric_change(user, "healthy ranks", "31/32") == "30/32"
    assert _painted(user) == [5, 16] and _typed_failed(user) == {5, 16}
    assert metric(user, "communicators intact") == "0/3"
    assert _rebuilt(user) > one  # in-memory rebind now rebuilds both domains' communicators
    click_rank(user, 5)  # a second click heals
    assert wait_metric_change(user, "healthy ranks", "30/32") == "31/32"
    assert _painted(user) == [16] and _typed_failed(user) == {16}
    assert user.locator('[data-testid="stException"]').count() == 0


def test_a_dragged_box_fails_exactly_the_ranks_inside(user):
    xy = still_rank_xy(user, range(32))  # the canvas scrolled into view and holding still
    assert sorted(xy) == list(range(32))
    (ax, ay), (bx, by) = xy[2], xy[4]
    x0, x1, y0, y1 = min(ax, bx) - 3, max(ax, bx) + 3, min(ay, by) - 3, max(ay, by) + 3
    inside = {r for r, (x, y) in xy.items() if x0 <= x <= x1 and y0 <= y <= y1}
    assert {2, 4} <= inside and len(inside) < 32  # a real box: not one rank, not the whole mesh
    _drag(user, (x0, y0), (x1, y1))
    assert _painted_soon(user, sorted(inside)) == sorted(inside)
    wait_metric_change(user, "healthy ranks", "32/32")
    assert metric(user, "healthy ranks") == f"{32 - len(inside)}/32"
    assert _typed_failed(user) == inside
    # a box over empty space (the canvas's top-left corner) changes nothing
    frame_box = user.locator(CANVAS).last.bounding_box()
    _drag(user, (frame_box["x"] + 2, frame_box["y"] + 2), (frame_box["x"] + 8, frame_box["y"] + 8))
    user.wait_for_timeout(500)
    settle(user)
    assert _typed_failed(user) == inside and sorted(_painted(user)) == sorted(inside)


def test_typed_ranks_are_painted_exactly(user):
    box = user.get_by_placeholder("no rank failed")
    box.fill("5")
    box.press("Enter")
    assert wait_metric_change(user, "healthy ranks", "32/32") == "31/32"
    assert _painted(user) == [5]  # not 5, 15 and 25
    box.fill("5-9, 12")
    box.press("Enter")
    assert wait_metric_change(user, "healthy ranks", "31/32") == "26/32"
    assert _painted(user) == [5, 6, 7, 8, 9, 12]
    click_rank(user, 12)  # a click after typing starts from what was typed
    assert wait_metric_change(user, "healthy ranks", "26/32") == "27/32"
    assert box.input_value() == "5-9"


def test_16384_ranks_show_nodes_and_drill_down_to_ranks(user):
    pick_scenario(user, "whatif_16384_30d")
    frames = user.locator(CANVAS)
    assert frames.count() == 2
    assert _canvas(user, 0).evaluate("() => window.meshpact.kind()") == "nodes"
    assert _canvas(user, 1).evaluate("() => window.meshpact.kind()") == "ranks"
    caption = user.get_by_text("Drill-down:", exact=False)
    first = caption.inner_text()
    user.mouse.click(*_page_xy(user, 0, 1000))  # node 1000: ranks 8000-8007 of the first pod
    user.wait_for_function(
        "(t) => [...document.querySelectorAll('p')].some(p => p.innerText.startsWith('Drill-down:')"
        " && p.innerText !== t)",
        arg=first,
        timeout=60_000,
    )
    settle(user)
    assert caption.inner_text() == "Drill-down: 8 ranks (8000-8007)"
    assert _painted(user, 0) == [1000]
    user.mouse.click(*_page_xy(user, 1, 8003))
    assert wait_metric_change(user, "healthy ranks", "16,384/16,384") == "16,383/16,384"
    assert _typed_failed(user) == {8003} and _painted(user, 1) == [8003]
    assert dict(_canvas(user, 0).evaluate("() => window.meshpact.marks()")) == {1000: 1}  # the node counts it
    # a box over two neighbouring nodes draws both, and the failure stays painted among them
    a, b = _page_xy(user, 0, 1000), _page_xy(user, 0, 1001)
    pad = 3
    before = caption.inner_text()
    _drag(user, (min(a[0], b[0]) - pad, min(a[1], b[1]) - pad), (max(a[0], b[0]) + pad, max(a[1], b[1]) + pad))
    user.wait_for_function(
        "(t) => [...document.querySelectorAll('p')].some(p => p.innerText.startsWith('Drill-down:')"
        " && p.innerText !== t)",
        arg=before,
        timeout=60_000,
    )
    settle(user)
    assert caption.inner_text() == "Drill-down: 16 ranks (8000-8015)"
    assert _painted(user, 1) == [8003] and metric(user, "healthy ranks") == "16,383/16,384"
    assert user.evaluate(CLIPPED_JS) == []
    user.screenshot(path=str(ARTIFACTS / "mesh-canvas-16384-drill.png"), full_page=True)
