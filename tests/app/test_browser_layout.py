"""Every page at 1,024x768 and 1,400x900 in a real browser: nothing a user must read is cut.

One Chromium, one page, both window sizes, every page of the dashboard (Live in its idle
state), each in the states that draw the most: failures on the mesh, the hand-built edge on
Plans (every planner's steps open), the serving sweep and both deployment tables on
Simulate, Mesh failures on Replay, and Mesh and Replay again at 16,384 ranks.
A page fails on an exception box, on a chart legend drawn over an axis title or tick label
(:data:`~meshpact.app.serve.LEGEND_OVER_AXIS_JS`), or on any text cut by its box (:data:`CUT_JS`): metric
values and labels, buttons and links, widget labels, select values and tags, toggles,
radios and tabs, input values, expander titles, HTML table cells, and the data grids'
headers and cells, which the grid paints on a canvas (there the text is measured with the
grid's own font against its column's width, and a grid whose columns run past its box is
cut as well). The scenario and the failed ranks come from the link, as a shared link
brings them, and a reload keeps them.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from meshpact.app.serve import LEGEND_OVER_AXIS_JS, metric, settle, wait_metric_is, wait_title

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
SIZES = ((1024, 768), (1400, 900))
LINK = "scenario=whatif_1024&failed=5,600-603"
AT_SCALE = "scenario=whatif_16384_30d&failed=5,9000-9003"  # a node per cell, a drill-down, five-digit counts

# What a person reads, cut by its box: each hit is "what: text (needed px > shown px)".
CUT_JS = r"""() => {
    const cut = [];
    const shown = e => e.offsetParent !== null || getComputedStyle(e).position === 'fixed';
    const text = e => (e.innerText || e.value || e.getAttribute('aria-label') || '').trim().replace(/\s+/g, ' ');
    const TEXT = [
        ['metric value', '[data-testid="stMetricValue"], [data-testid="stMetricValue"] *'],
        ['metric label', '[data-testid="stMetricLabel"], [data-testid="stMetricLabel"] *'],
        ['metric delta', '[data-testid="stMetricDelta"] *'],
        ['button', 'button, button *'],
        ['link', '[data-testid="stPageLink"] *, [data-testid="stSidebarNavLink"] *'],
        ['widget label', '[data-testid="stWidgetLabel"], [data-testid="stWidgetLabel"] *'],
        ['select value', '[data-baseweb="select"] *, [data-testid="stMultiSelect"] [data-tag] *'],
        ['toggle or checkbox', '[data-testid="stCheckbox"] label, [data-testid="stCheckbox"] label *'],
        ['radio', '[data-testid="stRadio"] label, [data-testid="stRadio"] label *'],
        ['tab', '[data-baseweb="tab"], [data-baseweb="tab"] *'],
        ['input', 'input[type="text"], input[type="number"], input:not([type]), textarea'],
        ['expander', '[data-testid="stExpander"] summary, [data-testid="stExpander"] summary *'],
        ['table', '[data-testid="stTable"], table th, table td, table th *, table td *'],
        ['uploader', '[data-testid="stFileUploader"] *'],
    ];
    const seen = new Set();
    for (const [what, sel] of TEXT) {
        for (const e of document.querySelectorAll(sel)) {
            if (seen.has(e) || e.closest('[data-testid="stDataFrame"]') || e.closest('.js-plotly-plot')
                || e.closest('[data-testid="stTooltipContent"]') || !shown(e)) continue;
            seen.add(e);
            const t = text(e);
            if (!t || e.closest('svg') || e.matches('input[type="file"]')) continue;
            if (e.scrollWidth > e.clientWidth + 1)  // cut, or spilling over what is beside it
                cut.push(`${what}: ${t.slice(0, 60)} (${e.scrollWidth} > ${e.clientWidth} px)`);
        }
    }
    // A word broken across two lines (the browser draws it in two boxes on two lines).
    const walker = document.createTreeWalker(document.querySelector('[data-testid="stAppViewContainer"]'),
                                             NodeFilter.SHOW_TEXT);
    const range = document.createRange();
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        const host = node.parentElement;
        if (!host || !shown(host) || host.closest('[data-testid="stDataFrame"], .js-plotly-plot, [data-testid="stCode"], svg, style, script'))
            continue;
        for (const m of node.data.matchAll(/[^\s-]+/g)) {  // a line may end after a hyphen
            range.setStart(node, m.index);
            range.setEnd(node, m.index + m[0].length);
            const boxes = [...range.getClientRects()].filter(r => r.width > 0);
            if (boxes.length > 1 && new Set(boxes.map(r => Math.round(r.top))).size > 1) {
                cut.push(`word broken: ${m[0].slice(0, 40)} in ${text(host).slice(0, 40)}`);
                break;
            }
        }
    }
    // Anything else drawn with an ellipsis and cut.
    for (const e of document.querySelectorAll('[data-testid="stAppViewContainer"] *')) {
        if (seen.has(e) || e.closest('[data-testid="stDataFrame"]') || !shown(e)) continue;
        const s = getComputedStyle(e);
        if (s.textOverflow === 'ellipsis' && e.scrollWidth > e.clientWidth + 1 && text(e))
            cut.push(`text: ${text(e).slice(0, 60)} (${e.scrollWidth} > ${e.clientWidth} px)`);
    }
    // The data grids paint on a canvas: measure each header and cell with the grid's own font.
    const ctx = document.createElement('canvas').getContext('2d');
    for (const df of document.querySelectorAll('[data-testid="stDataFrame"]')) {
        if (!shown(df)) continue;
        const canvas = df.querySelector('canvas[data-testid="data-grid-canvas"]');
        const scroller = df.querySelector('.dvn-scroller');
        if (!canvas) continue;
        let fiber = canvas[Object.keys(canvas).find(k => k.startsWith('__reactFiber'))], props = null;
        for (let i = 0; fiber && i < 60 && !props; i++, fiber = fiber.return) {
            const p = fiber.memoizedProps;
            if (p && Array.isArray(p.columns) && typeof p.getCellContent === 'function') props = p;
        }
        if (!props) { cut.push('grid: its columns cannot be read'); continue; }
        const style = getComputedStyle(df.querySelector('.stDataFrameGlideDataEditor'));
        const family = style.getPropertyValue('--gdg-font-family');
        const pad = 2 * parseFloat(style.getPropertyValue('--gdg-cell-horizontal-padding') || '8');
        const head = style.getPropertyValue('--gdg-header-font-style') + ' ' + family;
        const body = style.getPropertyValue('--gdg-base-font-style') + ' ' + family;
        const name = props.columns.map(c => c.title).join(', ');
        if (scroller && scroller.scrollWidth > scroller.clientWidth + 1)
            cut.push(`grid [${name}]: columns past its box (${scroller.scrollWidth} > ${scroller.clientWidth} px)`);
        props.columns.forEach((c, col) => {
            ctx.font = head;
            const need = ctx.measureText(c.title).width + pad;
            if (need > c.width + 1) cut.push(`grid header: ${c.title} (${Math.ceil(need)} > ${c.width} px)`);
            ctx.font = body;
            for (let row = 0; row < Math.min(props.rows, 200); row++) {
                const cell = props.getCellContent([col, row]);
                const t = String(cell.displayData ?? cell.data ?? '');
                const w = ctx.measureText(t).width + pad;
                if (t && w > c.width + 1) { cut.push(`grid cell [${c.title}]: ${t.slice(0, 60)} (${Math.ceil(w)} > ${c.width} px)`); break; }
            }
        });
    }
    // A chart's tick labels, annotations, legend and titles: inside the chart.
    for (const plot of document.querySelectorAll('.js-plotly-plot')) {
        const svg = plot.querySelector('.main-svg');
        if (!svg || !shown(plot)) continue;
        const box = svg.getBoundingClientRect();
        for (const t of plot.querySelectorAll('.main-svg text')) {
            const r = t.getBoundingClientRect(), label = (t.textContent || '').trim();
            if (label && r.width && (r.left < box.left - 1 || r.right > box.right + 1 || r.top < box.top - 1
                                     || r.bottom > box.bottom + 1))
                cut.push(`chart text: ${label.slice(0, 60)} (outside its chart)`);
        }
    }
    for (const e of document.querySelectorAll('[data-testid="stException"]'))
        cut.push(`exception: ${text(e).slice(0, 200)}`);
    return cut;
}"""


def _click_text(pg, where: str, label: str) -> None:  # noqa: ANN001 (a playwright Page)
    pg.locator(where).get_by_text(label, exact=True).first.click()
    pg.wait_for_timeout(1000)  # the click's rerun starts a moment later: a page settled at once may not have begun it
    settle(pg)


def _serving(pg) -> None:  # noqa: ANN001
    pg.get_by_role("tab", name="Serving spillover").click()
    form = pg.locator('[data-testid="stForm"]').first  # the shortest sweep: one request kind, 20 requests a run
    form.locator('span[data-tag][aria-label="full"]').press("Backspace")
    form.locator('span[data-tag][aria-label="full"]').wait_for(state="detached", timeout=10_000)
    form.get_by_label("requests per run").fill("20")
    pg.get_by_role("button", name="Run serving sweep").click()
    pg.get_by_text("serving CSV").wait_for(timeout=120_000)
    pg.get_by_role("button", name="Compare deployments").click()
    pg.get_by_text("deployments CSV").wait_for(timeout=120_000)
    settle(pg)


def _open_expanders(pg) -> None:  # noqa: ANN001
    for summary in pg.locator('[data-testid="stMain"] [data-testid="stExpander"] summary').all():
        if summary.is_visible():  # not those in a tab not shown
            summary.click()
    settle(pg)


def _facts(pg) -> None:  # noqa: ANN001
    _click_text(pg, '[data-testid="stMain"]', "build an edge from facts")
    _open_expanders(pg)


# page, link, what to do there before looking
VISITS = (
    ("mesh", f"?{LINK}", None),
    ("plans", "plans", _open_expanders),
    ("plans-facts", "plans", _facts),
    ("simulate", f"simulate?{LINK}", None),
    ("simulate-serving", "simulate", _serving),
    ("replay", "replay", None),
    ("replay-mesh", f"replay?{LINK}", lambda pg: _click_text(pg, '[data-testid="stMain"]', "failures picked on Mesh")),
    ("live", "live", None),
    ("mesh-16384", f"?{AT_SCALE}", None),
    (
        "replay-mesh-16384",
        f"replay?{AT_SCALE}",
        lambda pg: _click_text(pg, '[data-testid="stMain"]', "failures picked on Mesh"),
    ),
)


NAV = ["Mesh", "Plans", "Simulate", "Replay", "Live"]


def _routed(pg, name: str) -> list[str]:  # noqa: ANN001
    """What is wrong with a page opened straight from its link: it must still be routed by
    app/main.py's navigation (a title, the sidebar's page set), and Simulate's inputs read as
    the charts beside them write numbers (not "2000.00" hours)."""
    out = []
    links = [t.split("\n")[-1] for t in pg.locator('[data-testid="stSidebarNavLink"]').all_inner_texts()]
    if links != NAV:
        out.append(f"{name}: the sidebar lists {links}, not {NAV}")
    if not pg.locator("h1").first.inner_text().strip():
        out.append(f"{name}: no title")
    if name == "simulate":
        shown = (
            pg.get_by_label("per-rank MTBF (hours)").input_value(),
            pg.get_by_label("days", exact=True).input_value(),
        )
        if "." in shown[0] or shown[1] != "7":
            out.append(f"simulate: MTBF and days read {shown}: whole hours and whole days as typed expected")
    return out


def test_no_page_cuts_what_a_user_reads_at_1024_or_1400_px(server, browser):
    """Each page is drawn once at 1,024 px, then looked at again at 1,400 px (the layout reflows
    without a rerun). Each is opened straight from its link, the first request to its server
    included, and must be routed as from the sidebar."""
    ARTIFACTS.mkdir(exist_ok=True)
    pg = browser.new_page()
    problems = []
    try:
        for name, link, act in VISITS:
            pg.set_viewport_size({"width": SIZES[0][0], "height": SIZES[0][1]})
            pg.goto(f"{server}/{link}")
            settle(pg)
            problems += _routed(pg, name)
            if act is not None:
                act(pg)
            for width, height in SIZES:
                pg.set_viewport_size({"width": width, "height": height})
                pg.wait_for_timeout(600)  # the layout, the charts and the grids' columns follow the new width
                found = pg.evaluate(CUT_JS) + [f"legend over an axis: {t}" for t in pg.evaluate(LEGEND_OVER_AXIS_JS)]
                if found:
                    pg.screenshot(path=str(ARTIFACTS / f"cut-{name}-{width}.png"), full_page=True)
                problems += [f"{width}px {name}: {p}" for p in found]
    finally:
        pg.close()
    assert not problems, "cut at 1024 or 1400 px:\n" + "\n".join(problems)


def _params(pg) -> dict[str, list[str]]:  # noqa: ANN001
    return parse_qs(urlsplit(pg.url).query)


def test_a_reload_and_a_shared_link_keep_the_scenario_and_the_failed_ranks(server, browser):
    pg = browser.new_page(viewport={"width": 1400, "height": 900})
    try:
        pg.goto(server)
        settle(pg)
        sidebar = pg.locator('[data-testid="stSidebar"]')
        sidebar.locator('[data-testid="stSelectbox"]').first.click()
        pg.get_by_role("option", name="whatif_1024", exact=True).click()
        pg.wait_for_function("() => location.search.includes('scenario=whatif_1024')", timeout=30_000)
        settle(pg)
        box = pg.get_by_placeholder("no rank failed")
        box.fill("5, 600-603")
        box.press("Enter")
        pg.wait_for_function(
            "() => new URLSearchParams(location.search).get('failed') === '5, 600-603'", timeout=30_000
        )
        settle(pg)
        link = pg.url
        for how in ("reload", "shared link", "another page"):
            if how == "reload":
                pg.reload()
            elif how == "shared link":
                other = browser.new_page(viewport={"width": 1400, "height": 900})
                pg.close()
                pg = other
                pg.goto(link)
            else:
                pg.goto(link.replace(f"{server}/?", f"{server}/replay?"))
            settle(pg)
            if how == "another page":
                wait_title(pg, "Replay")
                _click_text(pg, '[data-testid="stMain"]', "failures picked on Mesh")
                assert wait_metric_is(pg, "failed ranks", "5 ranks") == "5 ranks", how
            else:
                pg.wait_for_function(
                    "() => { const b = document.querySelector('input[placeholder=\"no rank failed\"]');"
                    " return b && b.value === '5, 600-603'; }",
                    timeout=30_000,
                )
                assert metric(pg, "healthy ranks") == "1,019/1,024", how
            assert "whatif_1024" in pg.locator('[data-testid="stSidebar"]').inner_text(), how
            replay = {"replay": ["mesh"]} if how == "another page" else {}  # Replay keeps its source in the link
            assert _params(pg) == {"scenario": ["whatif_1024"], "failed": ["5, 600-603"], **replay}, how
            assert pg.locator('[data-testid="stException"]').count() == 0, how
    finally:
        pg.close()


def test_a_bad_link_is_one_line_and_the_defaults(server, browser):
    pg = browser.new_page(viewport={"width": 1400, "height": 900})
    try:
        pg.goto(f"{server}/?scenario=nosuch&failed=5,x-")
        settle(pg)
        warnings = pg.locator('[data-testid="stAlertContentWarning"]').all_inner_texts()
        assert any("nosuch" in w and "default" in w for w in warnings), warnings
        assert any("x-" in w for w in warnings), warnings
        assert all("\n" not in w.strip() for w in warnings), warnings
        assert metric(pg, "healthy ranks") == "32/32"
        assert pg.locator('[data-testid="stException"]').count() == 0
    finally:
        pg.close()
