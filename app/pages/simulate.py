"""Simulate page: what-if knobs for training with faults and serving spillover."""

from __future__ import annotations

import streamlit as st

from meshpact.app.context import require_engines, require_scenario

choice = require_scenario()
st.title("Simulate")
require_engines("The simulator", ("simulator.training", "simulator.serving"))
