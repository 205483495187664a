"""Benchmark: dashboard responsiveness.

Time to first render of each page through Streamlit's AppTest (a fresh app session per
page, so each page's caches start cold; Python modules already imported count as a warm
server), and time to build the 1,024-rank mesh figure (two domains of 512 ranks on two
hosts) and to serialise it for the browser. Goals: every page under 2 s, the 1,024-rank
figure under 0.5 s. Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

MAIN = str(Path(__file__).resolve().parents[1] / "app" / "main.py")
PAGES = ("mesh", "plans", "simulate", "replay", "live")
PAGE_GOAL_S, FIGURE_GOAL_S = 2.0, 0.5


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


def mesh_1024(repeats: int = 5) -> tuple[float, float]:
    from meshpact.app.figures import mesh_figure
    from meshpact.core.facts import Domain, Mesh

    mesh = Mesh(domains=(Domain("cuda@hostA", "cuda", "hostA", tuple(range(512))),
                         Domain("cann@hostB", "cann", "hostB", tuple(range(512, 1024)))))
    build, serialise = float("inf"), float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        fig = mesh_figure(mesh, failed=(3, 700 + i))
        t1 = time.perf_counter()
        fig.to_json()
        t2 = time.perf_counter()
        build, serialise = min(build, t1 - t0), min(serialise, t2 - t1)
    return round(build, 4), round(serialise, 4)


def main() -> dict:
    pages = page_render_s()
    build, serialise = mesh_1024()
    print(f"{'what':<34}{'seconds':>10}{'goal':>8}")
    for name, s in pages.items():
        print(f"{'first render: ' + name:<34}{s:>10.3f}{PAGE_GOAL_S:>8.1f}")
    print(f"{'1,024-rank mesh figure: build':<34}{build:>10.3f}{FIGURE_GOAL_S:>8.1f}")
    print(f"{'1,024-rank mesh figure: to JSON':<34}{serialise:>10.3f}{'':>8}")
    out = {"bench": "app", "page_render_s": pages, "mesh_1024_figure_s": build, "mesh_1024_figure_json_s": serialise,
           "goals_met": all(s < PAGE_GOAL_S for s in pages.values()) and build < FIGURE_GOAL_S}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
