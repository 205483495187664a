"""Plans page: an edge's contract, the three planners' plans, the checker's verdicts."""

from __future__ import annotations

import streamlit as st

from meshpact.app.context import require_engines, require_scenario

choice = require_scenario()
st.title("Plans")
require_engines("Planning", ("core.contract", "core.lowerer", "core.checker", "core.baselines", "core.edges"))
