"""Benchmark: dashboard responsiveness, in Python and in a real browser.

Time to first render of each page through Streamlit's AppTest (a fresh app session per
page, so each page's caches start cold; Python modules already imported count as a warm
server), and time to build the 1,024-rank mesh figure (two domains of 512 ranks on two
hosts) and to serialise it for the browser (and the size of that JSON).

Then what a person waits for in Chromium (Debian's, through Playwright, 1400x900, the
app served on 127.0.0.1): a page switch from the sidebar until the new page's title
shows, its script has finished and every chart is drawn (two rounds over the five pages
after a warm-up round); and a click on a rank of the mesh until the page has finished
updating, on the 1,024-rank and the 16,384-rank scenarios (rank 5 and another rank
clicked in turn, failing and healing them). Medians are reported.

Goals: every first render under 2 s, the 1,024-rank figure under 0.5 s, a page switch
under 0.8 s, a click under 0.3 s at 1,024 ranks and under 1 s at 16,384. Prints a table,
then one JSON line with the machine's load average.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

from _results import emit

MAIN = str(Path(__file__).resolve().parents[1] / "app" / "main.py")
PAGES = ("mesh", "plans", "simulate", "replay", "live")
PAGE_GOAL_S, FIGURE_GOAL_S = 2.0, 0.5
SWITCH_GOAL_S, CLICK_1024_GOAL_S, CLICK_16384_GOAL_S = 0.8, 0.3, 1.0
NAV_TITLES = (
    ("Plans", "Plans"),
    ("Simulate", "Simulate"),
    ("Replay", "Replay"),
    ("Live", "Live"),
    ("Mesh", "Communicator mesh"),
)


def page_render_s() -> dict[str, float]:
    from streamlit.testing.v1 import AppTest

    logging.getLogger("streamlit").setLevel(logging.ERROR)
    AppTest.from_file(MAIN, default_timeout=120).run()  # import streamlit and the app's modules once
    out: dict[str, float] = {}
    for name in PAGES:
        at = AppTest.from_file(MAIN, default_timeout=120)
        if name != "mesh":
            at.run()
            at.switch_page(f"views/{name}.py")
        t0 = time.perf_counter()
        at.run()
        out[name] = round(time.perf_counter() - t0, 4)
        if at.exception:
            raise SystemExit(f"page {name} raised: {at.exception[0].value}")
    return out


def mesh_1024(repeats: int = 5) -> tuple[float, float, float]:
    import plotly.io

    from meshpact.app.figures import mesh_figure
    from meshpact.core.facts import Domain, Mesh, Vendor

    mesh = Mesh(
        domains=(
            Domain("cuda@hostA", Vendor.CUDA, "hostA", tuple(range(512))),
            Domain("cann@hostB", Vendor.CANN, "hostB", tuple(range(512, 1024))),
        )
    )
    build, serialise, size = float("inf"), float("inf"), 0
    for i in range(repeats):
        t0 = time.perf_counter()
        fig = mesh_figure(mesh, failed=(3, 700 + i))
        t1 = time.perf_counter()
        size = len(plotly.io.to_json(fig, validate=False))  # what st.plotly_chart sends to the browser
        t2 = time.perf_counter()
        build, serialise = min(build, t1 - t0), min(serialise, t2 - t1)
    return round(build, 4), round(serialise, 4), round(size / 1e3, 1)


def _clicks(pg: Any, ranks: tuple[int, ...]) -> list[float]:
    from meshpact.app.serve import click_rank, metric, settle, wait_metric_change

    mode = pg.get_by_text("click ranks", exact=True)  # a plotly chart's click mode; the canvas needs none
    if mode.count():
        mode.click()
        settle(pg)
    out = []
    for rank in ranks:
        before = metric(pg, "healthy ranks")
        t0 = time.perf_counter()
        click_rank(pg, rank)
        wait_metric_change(pg, "healthy ranks", before)
        out.append(time.perf_counter() - t0)
    return out


def chromium_s() -> dict[str, float] | None:
    """Medians of a page switch and of a click at 1,024 and 16,384 ranks, in Chromium (None without one)."""
    from meshpact.app.serve import chromium_path, dashboard_server, go_to, pick_scenario, settle

    exe = chromium_path()
    if exe is None:
        print("no Chromium (apt-get install chromium, or set MESHPACT_CHROMIUM): browser timings skipped")
        return None
    from playwright.sync_api import sync_playwright

    with dashboard_server() as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=["--no-sandbox"])
        pg = browser.new_page(viewport={"width": 1400, "height": 900})
        pg.goto(url)
        settle(pg)
        switches = []
        for rnd in range(3):  # the first round fills the caches, as a person's first visit does
            for nav, title in NAV_TITLES:
                t0 = time.perf_counter()
                go_to(pg, nav, title)
                if rnd:
                    switches.append(time.perf_counter() - t0)
        pick_scenario(pg, "whatif_1024")
        c1024 = _clicks(pg, (5, 700, 5, 700, 5, 700))
        pick_scenario(pg, "whatif_16384_30d")
        c16384 = _clicks(pg, (1, 2, 1, 2, 1, 2))
        browser.close()
    return {
        "chromium_page_switch_s": round(statistics.median(switches), 3),
        "chromium_click_1024_s": round(statistics.median(c1024), 3),
        "chromium_click_16384_s": round(statistics.median(c16384), 3),
    }


def main() -> dict:
    load_start = os.getloadavg()[0]
    pages = page_render_s()
    build, serialise, kb = mesh_1024()
    browser = chromium_s()
    print(f"{'what':<34}{'seconds':>10}{'goal':>8}")
    for name, s in pages.items():
        print(f"{'first render: ' + name:<34}{s:>10.3f}{PAGE_GOAL_S:>8.1f}")
    print(f"{'1,024-rank mesh figure: build':<34}{build:>10.3f}{FIGURE_GOAL_S:>8.1f}")
    print(f"{'1,024-rank mesh figure: to JSON':<34}{serialise:>10.3f}{'':>8}   ({kb:,.0f} kB)")
    goals = {
        "chromium_page_switch_s": SWITCH_GOAL_S,
        "chromium_click_1024_s": CLICK_1024_GOAL_S,
        "chromium_click_16384_s": CLICK_16384_GOAL_S,
    }
    for key, value in (browser or {}).items():
        print(f"{key.replace('_', ' ').removesuffix(' s') + ' (median)':<34}{value:>10.3f}{goals[key]:>8.1f}")
    out: dict[str, Any] = {
        "bench": "app",
        "page_render_s": pages,
        "mesh_1024_figure_s": build,
        "mesh_1024_figure_json_s": serialise,
        "mesh_1024_figure_json_kb": kb,
        **(browser or {}),
        "goals_met": all(s < PAGE_GOAL_S for s in pages.values())
        and build < FIGURE_GOAL_S
        and browser is not None
        and all(browser[k] < goals[k] for k in goals),
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_1m_at_start": round(load_start, 2),
            "load_avg_1m_at_end": round(os.getloadavg()[0], 2),
        },
    }
    emit("app", out)
    return out


if __name__ == "__main__":
    main()
