"""A dashboard server for tests and benchmarks: ``streamlit run app/main.py`` on loopback.

:func:`dashboard_server` starts the app headless on 127.0.0.1 (a free port unless one is
given), waits for ``/_stcore/health``, yields the base URL and stops the server's whole
process group on exit. :func:`chromium_path` finds Debian's Chromium for Playwright; the
functions after it drive the app in a Playwright page the way a person does (open a
page from the sidebar, pick a scenario, click a rank) and wait until Streamlit has
finished the run and plotly has drawn every chart, so tests and the benchmark time and
check what a user sees.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Iterator

from meshpact.live.trials.ports import unclaimed_port

if TYPE_CHECKING:
    from playwright.sync_api import Page

__all__ = [
    "dashboard_server",
    "chromium_path",
    "ROOT",
    "SETTLED_JS",
    "CLIPPED_JS",
    "MESH_READABLE_JS",
    "LEGEND_OVER_AXIS_JS",
    "settle",
    "metric",
    "wait_metric_is",
    "wait_metric_change",
    "click_rank",
    "pick_scenario",
    "go_to",
    "wait_title",
]

ROOT = Path(__file__).resolve().parents[1]


def chromium_path() -> str | None:
    """Chromium to drive: ``$MESHPACT_CHROMIUM``, Debian's ``/usr/lib/chromium/chromium``, or one on PATH."""
    for candidate in (
        os.environ.get("MESHPACT_CHROMIUM"),
        "/usr/lib/chromium/chromium",
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
    ):
        if candidate and Path(candidate).exists():
            return candidate
    return None


@contextlib.contextmanager
def dashboard_server(port: int = 0, timeout_s: float = 60.0, cwd: Path = ROOT) -> Iterator[str]:
    """Run the dashboard on ``http://127.0.0.1:<port>`` for the ``with`` block; yields the URL."""
    port = port or unclaimed_port()
    streamlit = Path(sys.executable).with_name("streamlit")
    proc = subprocess.Popen(
        [
            str(streamlit),
            "run",
            str(ROOT / "app" / "main.py"),
            "--server.address",
            "127.0.0.1",
            "--server.port",
            str(port),
            "--server.headless",
            "true",
            "--browser.gatherUsageStats",
            "false",
            "--server.fileWatcherType",
            "none",
        ],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                out = proc.stdout.read().decode(errors="replace") if proc.stdout and proc.poll() is not None else ""
                raise RuntimeError(
                    f"streamlit did not answer {url}/_stcore/health within {timeout_s:.0f} s"
                    + (f":\n{out[-3000:]}" if out else "")
                )
            time.sleep(0.3)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# --- driving the dashboard in a browser (a Playwright ``Page``; used by the browser tests and bench/app.py) ---

SETTLED_JS = """() => !document.querySelector('[data-testid="stStatusWidget"]')
    && !document.querySelector('[data-testid="stSkeleton"]')
    && !document.querySelector('[data-stale="true"]')
    && [...document.querySelectorAll('[data-testid="stPlotlyChart"]')].every(c => c.querySelector('.main-svg'))
    && [...document.querySelectorAll('iframe[title$="mesh_canvas"]')].every(
        f => f.contentWindow && f.contentWindow.meshpact && f.contentWindow.meshpact.drawn)"""

# Text cut off by its box: metric values and labels, button and page-link labels.
CLIPPED_JS = """() => [...document.querySelectorAll(
        '[data-testid="stMetricValue"] div, [data-testid="stMetricLabel"] p, [data-testid="stMetricValue"],'
        + ' [data-testid="stPageLink"] p, [data-testid="stBaseButton-secondary"] p, [data-testid="stBaseButton-primary"] p')]
    .filter(e => e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1)
    .map(e => e.innerText)"""

# how a drawn mesh reads, inside the element matching the selector given: the plot's width, its rank labels
# (each with its font size) and how many pairs of rank markers overlap (one drawn over another by more than 2 px)
MESH_READABLE_JS = """(root) => {
    const plot = document.querySelector(root + ' .js-plotly-plot');
    if (!plot) return null;
    const px = e => parseFloat(e.style.fontSize || getComputedStyle(e).fontSize);
    const labels = [...plot.querySelectorAll('.textpoint text')].map(e => [e.textContent, px(e)]);
    const boxes = [...plot.querySelectorAll('.scatterlayer .points path')].map(e => e.getBoundingClientRect())
        .filter(b => b.width > 0);
    let overlaps = 0;
    for (let i = 0; i < boxes.length; i++) for (let j = i + 1; j < boxes.length; j++) {
        const a = boxes[i], b = boxes[j];  // round markers: apart when their centres are a radius and a radius apart
        const dx = (a.left + a.right - b.left - b.right) / 2, dy = (a.top + a.bottom - b.top - b.bottom) / 2;
        const d = Math.hypot(dx, dy);
        if (d >= 1 && d < (a.width + b.width) / 2 - 2) overlaps++;  // d < 1: a ring drawn over its own marker
    }
    return {width: plot.getBoundingClientRect().width, labels: labels, markers: boxes.length, overlaps: overlaps};
}"""

# every chart whose legend is drawn over an axis title or tick label: "title of the chart: the text it covers"
LEGEND_OVER_AXIS_JS = """() => {
    const out = [];
    const meet = (a, b) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > 1
        && Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 1;
    for (const plot of document.querySelectorAll('.js-plotly-plot')) {
        if (plot.offsetParent === null) continue;
        const legend = plot.querySelector('.legend .bg');
        if (!legend) continue;
        const box = legend.getBoundingClientRect();
        if (box.width === 0) continue;
        const title = (plot.querySelector('.gtitle') || {}).textContent || '(untitled)';
        for (const t of plot.querySelectorAll('.g-xtitle text, .g-ytitle text, .xtick text, .ytick text')) {
            if (t.textContent.trim() && meet(box, t.getBoundingClientRect())) out.push(title + ': ' + t.textContent);
        }
    }
    return out;
}"""

RANK_XY_JS = """(rank) => {
    for (const f of [...document.querySelectorAll('iframe[title$="mesh_canvas"]')].reverse()) {  // the canvas
        const m = f.contentWindow && f.contentWindow.meshpact;
        if (m && m.kind() === 'ranks' && m.xy(rank)) {
            f.scrollIntoView({block: 'center', behavior: 'instant'});
            const box = f.getBoundingClientRect(), p = m.xy(rank);
            return [box.left + p[0], box.top + p[1]];
        }
    }
    for (const gd of [...document.querySelectorAll('.js-plotly-plot')].reverse()) {
        const L = gd._fullLayout;
        for (const tr of gd._fullData || []) {
            const cd = tr.customdata || [];
            for (let i = 0; i < cd.length; i++) {
                const id = (cd[i] !== null && typeof cd[i] === 'object') ? cd[i][0] : cd[i];  // a number or a row
                if (id === rank && tr.mode && tr.mode.includes('markers')) {
                    gd.scrollIntoView({block: 'center', behavior: 'instant'});
                    const box = gd.getBoundingClientRect();
                    return [box.left + L._size.l + L.xaxis.d2p(tr.x[i]), box.top + L._size.t + L.yaxis.d2p(tr.y[i])];
                }
            }
        }
    }
    return null;
}"""

METRIC_JS = """(label) => {
    for (const m of document.querySelectorAll('[data-testid="stMetric"]')) {
        const l = m.querySelector('[data-testid="stMetricLabel"]');
        if (l && l.innerText.trim() === label) return m.querySelector('[data-testid="stMetricValue"]').innerText.trim();
    }
    return null;
}"""


def settle(page: Page, timeout_ms: int = 60_000) -> None:
    """Wait until the app has finished its run and drawn every chart."""
    page.wait_for_selector("h1", timeout=timeout_ms)
    page.wait_for_function(SETTLED_JS, timeout=timeout_ms)


def metric(page: Page, label: str) -> str | None:
    return page.evaluate(METRIC_JS, label)


def wait_metric(page: Page, label: str, timeout_ms: int = 60_000) -> str:
    """The metric ``label`` once it is drawn (a fragment may draw it after the page's run ended)."""
    page.wait_for_function(f"() => ({METRIC_JS})({label!r}) !== null", timeout=timeout_ms)
    return str(metric(page, label))


def wait_metric_is(page: Page, label: str, want: str, timeout_ms: int = 30_000) -> str | None:
    """The metric ``label`` once it shows ``want`` and the run is over, or what it shows when ``timeout_ms`` ran out.

    A click starts the app's rerun a moment later, so a page that looks settled right after a click may still
    show the figure from before it."""
    try:
        page.wait_for_function(f"(w) => ({METRIC_JS})({label!r}) === w", arg=want, timeout=timeout_ms)
        settle(page, timeout_ms)
    except Exception:  # noqa: BLE001 (playwright's TimeoutError): the caller's assertion names what it saw
        pass
    return metric(page, label)


def wait_metric_change(page: Page, label: str, before: str | None, timeout_ms: int = 60_000) -> str:
    """Wait until the metric ``label`` shows something other than ``before`` and the run is over."""
    page.wait_for_function(f"(b) => ({METRIC_JS})({label!r}) !== b", arg=before, timeout=timeout_ms)
    settle(page, timeout_ms)
    return str(metric(page, label))


def still_rank_xy(page: Page, ranks: Iterable[int], timeout_s: float = 20.0) -> dict[int, tuple[float, float]]:
    """Where each of ``ranks`` is drawn (page pixels, its chart scrolled into view), once two reads 150 ms
    apart agree and every one is drawn: a chart still laid out (a component's frame resized, a late element
    above it) moves its markers under a pointer aimed at where they were a moment before. A rank no chart
    has drawn within ``timeout_s`` is left out. Each rank's chart is scrolled into view as it is read, so
    ranks drawn on different charts may be read before a later scroll moves them: ask for one chart's ranks."""
    wanted = list(ranks)
    read = f"(ranks) => ranks.map(r => ({RANK_XY_JS})(r))"
    deadline = time.monotonic() + timeout_s
    xy = page.evaluate(read, wanted)
    while True:
        page.wait_for_timeout(150)
        again = page.evaluate(read, wanted)
        if again == xy and None not in again or time.monotonic() > deadline:
            break
        xy = again
    return {r: (p[0], p[1]) for r, p in zip(wanted, again, strict=True) if p is not None}


def click_rank(page: Page, rank: int, timeout_s: float = 20.0) -> None:
    """Click rank ``rank``'s marker on the last chart that draws it, once the marker holds still."""
    xy = still_rank_xy(page, [rank], timeout_s).get(rank)
    if xy is None:
        raise LookupError(f"rank {rank} is not drawn on any chart")
    page.mouse.click(*xy)


def pick_scenario(page: Page, name: str, timeout_ms: int = 60_000) -> None:
    """Choose a built-in scenario in the sidebar and wait for the page to redraw."""
    sidebar = page.locator('[data-testid="stSidebar"]')
    sidebar.locator('[data-testid="stSelectbox"]').first.click()
    page.get_by_role("option", name=name, exact=True).click()
    page.wait_for_function(
        """(n) => [...document.querySelectorAll('[data-testid="stSidebar"] strong')].some(e => e.innerText === n)""",
        arg=name,
        timeout=timeout_ms,
    )
    settle(page, timeout_ms)


def wait_title(page: Page, title: str, timeout_ms: int = 60_000) -> None:
    """Wait until the page's title is ``title`` and its run is over."""
    page.wait_for_function(
        "(t) => { const h = document.querySelector('h1'); return h && h.innerText.trim() === t; }",
        arg=title,
        timeout=timeout_ms,
    )
    settle(page, timeout_ms)


def go_to(page: Page, nav: str, title: str, timeout_ms: int = 60_000) -> None:
    """Open a page from the sidebar and wait until its title shows and its run is over."""
    page.locator('[data-testid="stSidebarNavLink"]', has_text=nav).click()
    wait_title(page, title, timeout_ms)
