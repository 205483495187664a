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

st.set_page_config(page_title="Meshpact", page_icon=":material/hub:", layout="wide")
carry_widget_state(st.session_state)  # the scenario and replay pickers follow the user from page to page

PAGES = [
    st.Page("views/mesh.py", title="Mesh", icon=":material/hub:", default=True),
    st.Page("views/plans.py", title="Plans", icon=":material/route:"),
    st.Page("views/simulate.py", title="Simulate", icon=":material/monitoring:"),
    st.Page("views/replay.py", title="Replay", icon=":material/replay:"),
    st.Page("views/live.py", title="Live", icon=":material/bolt:"),
]

st.navigation(PAGES).run()
