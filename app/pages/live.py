"""Live page: a local gloo cluster, training, fault injection, events as they happen."""

from __future__ import annotations

import streamlit as st

from meshpact.app.context import require_engines, require_scenario

choice = require_scenario()
st.title("Live")
require_engines("Live recovery", ("live.recover",))
