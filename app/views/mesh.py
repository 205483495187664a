"""Mesh page: the communicator mesh, failures by click or multiselect, what recovery costs."""

from __future__ import annotations

import streamlit as st

from meshpact.app.context import mesh_of, positions_of, require_scenario
from meshpact.app.figures import mesh_figure, recovery_figure
from meshpact.app.policies import compare_policies
from meshpact.app.state import SelectionState, apply_selection, clamp_failed
from meshpact.core.mesh import health
from meshpact.core.recovery import Policy

FAILED_KEY, CHART_KEY, MEMO_KEY = "failed_ranks", "mesh_chart", "mesh_selection_state"

choice = require_scenario()
mesh = mesh_of(choice)
st.title("Communicator mesh")
st.caption(choice.scenario.description or choice.source)

# Apply a new click on the chart to the multiselect's value before the widget is drawn.
memo: SelectionState = st.session_state.get(MEMO_KEY, SelectionState())
current = clamp_failed(st.session_state.get(FAILED_KEY, []), mesh.ranks)
memo = apply_selection(memo, current, st.session_state.get(CHART_KEY))
st.session_state[MEMO_KEY] = memo
st.session_state[FAILED_KEY] = clamp_failed(memo.failed, mesh.ranks)

left, right = st.columns([3, 2], gap="large")
with left:
    failed = st.multiselect(
        "Failed ranks (or click a rank on the chart; drag a box to fail several)",
        options=list(mesh.ranks), key=FAILED_KEY, placeholder="no rank failed",
    )
    state = health(mesh, failed)
    st.plotly_chart(
        mesh_figure(mesh, failed, positions_of(choice)), key=CHART_KEY, on_select="rerun",
        selection_mode=("points", "box", "lasso"),
    )

with right:
    a, b, c = st.columns(3)
    a.metric("healthy ranks", state.label)
    b.metric("communicators", f"{len(state.surviving)}/{len(state.communicators)}")
    c.metric("hosts", len(mesh.hosts))
    st.dataframe(
        [{"intact": "yes" if cm.intact(state.failed) else "NO",
          "communicator": cm.name.removeprefix("bridge ").replace(" <-> ", " ↔ "),
          "backend": cm.backend,
          "ranks": len(cm.ranks)}
         for cm in state.communicators],
        hide_index=True,
    )
    for dom, rank in state.bridges.items():
        if rank is None:
            st.warning(f"Every rank of **{dom}** failed: the domain is lost.")
        elif rank != mesh.domain(dom).bridge_rank:
            st.info(f"The bridge rank of **{dom}** failed: rank {rank} takes over the bridge.")

st.subheader("Recovery by policy")
if not state.failed:
    st.info("Fail a rank (click it on the chart or pick it above) to see what each recovery policy would cost.")
else:
    k1, k2, k3 = st.columns(3)
    rank_loss = k1.toggle("the failed ranks' processes are gone", value=False,
                          help="Off: a collective failed and every process is alive. On: the ranks are lost.")
    since = k2.slider("steps since the last checkpoint", 0, 500, 50, step=10)
    step_s = k3.slider("seconds per training step", 0.1, 10.0, 1.0, step=0.1)
    cmp = compare_policies(mesh, state.failed, rank_loss=rank_loss, steps_since_checkpoint=since, step_s=step_s)
    m1, m2, m3 = st.columns(3)
    m1.metric("downtime reduction (cold restart ÷ in-memory)", f"{cmp.downtime_reduction:.1f}×")
    m2.metric("in-memory rebind downtime", f"{cmp.total_s(Policy.IN_MEMORY):.2f} s",
              delta=f"{cmp.total_s(Policy.IN_MEMORY) - cmp.total_s(Policy.COLD_RESTART):.1f} s vs cold restart",
              delta_color="inverse")
    m3.metric("state retained in memory", f"{cmp.retained_ranks}/{mesh.world_size} ranks",
              help=f"{cmp.retained_bytes / 1e9:,.0f} GB kept in memory; a checkpoint restore reads "
                   f"{cmp.reloaded_bytes / 1e9:,.0f} GB back")
    st.plotly_chart(recovery_figure(cmp.breakdowns))
    st.caption("Durations come from the recovery cost model (`core/recovery.py`), whose defaults name their "
               "source or say they are assumptions. The Live page measures the same stages on real process groups.")
