"""Meshpact dashboard entry point (``make app``): page routing (each page draws the scenario picker)."""

from __future__ import annotations

import streamlit as st

st.set_page_config(page_title="Meshpact", page_icon=":material/hub:", layout="wide")

PAGES = [
    st.Page("pages/mesh.py", title="Mesh", icon=":material/hub:", default=True),
    st.Page("pages/plans.py", title="Plans", icon=":material/route:"),
    st.Page("pages/simulate.py", title="Simulate", icon=":material/monitoring:"),
    st.Page("pages/replay.py", title="Replay", icon=":material/replay:"),
    st.Page("pages/live.py", title="Live", icon=":material/bolt:"),
]

st.navigation(PAGES).run()
