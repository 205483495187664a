"""Meshpact dashboard entry point (``make app``): page routing (each page draws the scenario picker).

Before any page runs, the pickers that follow the user (scenario, replay source) are put
back if the last page did not draw them; the failed ranks live outside any widget.

The pages live in ``app/views/``, not ``app/pages/``: Streamlit treats a ``pages/``
folder beside the entry point as a legacy multipage app, and a fresh server whose first
request is a page URL (``/replay``) would then run that file without this router.
"""

from __future__ import annotations

import streamlit as st

from meshpact.app.state import carry_widget_state

# The layout at 1,024 px and wider: a row of columns wraps instead of cutting what it holds. A
# column holding a metric, a widget or a table is never narrower than its content (a metric's
# value is never cut, its label and a widget's label wrap between words, a select is as wide
# as the value it shows), so a row too narrow for all of them goes on below; and a narrow
# window gives the page more of its width.
LAYOUT_CSS = """
[data-testid="stHorizontalBlock"] { flex-wrap: wrap; }
[data-testid="stColumn"]:has([data-testid="stMetric"], [data-testid="stDataFrame"], [data-testid="stWidgetLabel"],
    [data-testid="stCheckbox"], [data-testid="stButton"], [data-testid="stDownloadButton"]) { min-width: min-content; }
[data-testid="stMetricValue"] > div { overflow: visible !important; text-overflow: clip !important; }
[data-testid="stMetricLabel"], [data-testid="stMetricLabel"] *, [data-testid="stWidgetLabel"],
[data-testid="stWidgetLabel"] *, [data-testid="stCheckbox"] label * {
    white-space: normal !important; overflow: visible !important; text-overflow: clip !important;
    overflow-wrap: normal !important; word-break: normal !important; }
[data-testid="stWidgetLabel"], [data-testid="stWidgetLabel"] > div { min-width: min-content !important; }
[data-baseweb="select"] input { field-sizing: content; min-width: 2ch; }
[data-testid="stHorizontalBlock"]:has(> [data-testid="stColumn"]:nth-child(9)) { flex-wrap: nowrap; }
[data-testid="stHorizontalBlock"]:has(> [data-testid="stColumn"]:nth-child(9)) > [data-testid="stColumn"] {
    min-width: 0; }
[data-testid="stHorizontalBlock"]:has(> [data-testid="stColumn"]:nth-child(9)) button {
    padding: 0.125rem 0.25rem; min-height: 2rem; }
@media (max-width: 1280px) {
    [data-testid="stMainBlockContainer"] { padding-left: 2rem; padding-right: 2rem; }
    [data-testid="stMetricValue"] { font-size: 1.75rem; }
    [data-testid="stHorizontalBlock"]:has(> [data-testid="stColumn"]:nth-child(9)) * { font-size: 0.75rem; }
}
"""

st.set_page_config(page_title="Meshpact", page_icon=":material/hub:", layout="wide")
carry_widget_state(st.session_state)  # the scenario and replay pickers follow the user from page to page
st.html(f"<style>{LAYOUT_CSS}</style>")

PAGES = [
    st.Page("views/mesh.py", title="Mesh", icon=":material/hub:", default=True),
    st.Page("views/plans.py", title="Plans", icon=":material/route:"),
    st.Page("views/simulate.py", title="Simulate", icon=":material/monitoring:"),
    st.Page("views/replay.py", title="Replay", icon=":material/replay:"),
    st.Page("views/live.py", title="Live", icon=":material/bolt:"),
]

st.navigation(PAGES).run()
