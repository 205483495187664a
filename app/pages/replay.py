"""Replay page: a scenario or a recording replayed on the mesh, stage by stage."""

from __future__ import annotations

import streamlit as st

from meshpact.app.context import require_scenario

choice = require_scenario()
st.title("Replay")
