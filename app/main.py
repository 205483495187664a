"""Meshpact dashboard entry point (``make app``)."""

from __future__ import annotations

import streamlit as st

from meshpact.core.scenario import default_scenario

st.set_page_config(page_title="Meshpact", layout="wide")


def overview() -> None:
    scenario = default_scenario()
    mesh = scenario.mesh()
    st.title("Meshpact")
    st.caption(scenario.description)
    cols = st.columns(3)
    cols[0].metric("ranks", mesh.world_size)
    cols[1].metric("native domains", len(mesh.domains))
    cols[2].metric("hosts", len(mesh.hosts))
    st.dataframe(
        [{"domain": d.name, "vendor": d.vendor.value, "backend": d.backend.value, "host": d.host,
          "ranks": f"{d.ranks[0]}..{d.ranks[-1]}", "bridge rank": d.bridge_rank} for d in mesh.domains],
        hide_index=True,
    )


st.navigation([st.Page(overview, title="Overview", default=True)]).run()
