"""Plans page: an edge's contract, every planner's plan, the checker's verdicts."""

from __future__ import annotations

import streamlit as st

from meshpact.app.context import mesh_of, message_markdown, require_scenario
from meshpact.app.figures import cost_figure, plan_figure
from meshpact.app.planning import edge_from_facts, facet_summaries, judge, real_edges, steps_rows
from meshpact.core.catalog import CATALOG
from meshpact.core.errors import MeshpactError
from meshpact.core.facts import Request
from meshpact.core.units import human_bytes

choice = require_scenario()
mesh = mesh_of(choice)
st.title("Plans")
st.caption("What a consumer must observe (the contract), how each planner would deliver it, and whether the "
           "symbolic checker accepts the plan, before anything runs.")

edges = real_edges()
source = st.radio("edge", ["a real edge", "build an edge from facts"], horizontal=True, label_visibility="collapsed",
                  key="plans_source")

try:
    if source == "a real edge":
        name = st.selectbox("edge", list(edges), key="plans_edge")
        real = edges[name]
        edge = real.edge
        st.caption(f"**{real.model}** · {edge.description} · dimensions: {real.dims}"
                   + (f" · source: {edge.source}" if edge.source else ""))
    else:
        names = [d.name for d in mesh.domains]
        k = st.columns(4)
        pdom = k[0].selectbox("producer domain", names, index=0, key="plans_pdom")
        cdom = k[1].selectbox("consumer domain", names, index=min(1, len(names) - 1), key="plans_cdom")
        placement = k[2].selectbox("producer placement", ["Shard(1)", "Shard(0)", "Replicate()", "Partial(sum)"],
                                   key="plans_placement")
        request = k[3].selectbox("consumer request", [r.value for r in Request], index=list(Request).index(Request.TOKEN),
                                 key="plans_request")
        def _model_columns() -> None:
            m = CATALOG[st.session_state["plans_model"]]
            logits = st.session_state.get("plans_request") in ("token", "logprob", "owner_token")
            st.session_state["plans_cols"] = m.vocab_size if logits else m.hidden_size

        k = st.columns(5)
        k[0].selectbox("model (sets the columns)", list(CATALOG), key="plans_model", on_change=_model_columns,
                       help="vocab_size for logits requests, hidden_size otherwise, from the model's config.json")
        rows = k[1].number_input("rows (tokens)", 1, 65536, 8, key="plans_rows")
        cols = k[2].number_input("columns (vocabulary or hidden)", 1, 1_000_000, CATALOG["Qwen/Qwen3-14B"].vocab_size,
                                 key="plans_cols")
        dtype = k[3].selectbox("dtype", ["bfloat16", "float32", "float16"], key="plans_dtype")
        consumers = k[4].number_input("consumer ranks", 1, mesh.domain(cdom).size, min(2, mesh.domain(cdom).size),
                                      key="plans_consumers")
        edge = edge_from_facts(mesh, producer_domain=pdom, consumer_domain=cdom, placement=placement,
                               shape=(int(rows), int(cols)), dtype=dtype, request=request,
                               consumer_ranks=int(consumers), shard_dim=1)
    result = judge(edge)
except MeshpactError as exc:
    st.error("**These facts do not make an edge.**\n\n" + message_markdown(str(exc)))
    st.stop()

contract = result.contract
st.subheader("Contract")
facets = contract.to_dict()
summaries = facet_summaries(contract)
for tab, (facet, value) in zip(st.tabs(list(facets)), facets.items()):
    with tab:
        st.markdown(summaries.get(facet, ""))
        with st.expander("every field"):
            st.json(value, expanded=2)

st.subheader("Planners, judged by the checker")
columns = st.columns(len(result.outcomes))
for col, out in zip(columns, result.outcomes):
    with col:
        st.markdown(f"#### {out.planner}")
        if out.ok:
            st.success("**verdict: passes** — the plan keeps every obligation of the contract")
        else:
            st.error("**verdict: rejected**\n\n" + "\n".join(f"- {r}" for r in out.reasons[:8])
                     + (f"\n- … {len(out.reasons) - 8} more" if len(out.reasons) > 8 else ""))
        if out.plan is not None and out.cost is not None:
            st.markdown(f"**{out.cost.startups}** startups · **{human_bytes(out.cost.payload_bytes)}** payload · "
                        f"**{out.cost.time_s * 1e3:.3g} ms** α-β time",
                        help=f"{out.cost.payload_bytes:,} payload bytes; by link: "
                             + ", ".join(f"{k} {v:,} B" for k, v in out.cost.bytes_by_link.items()))
            with st.expander(f"{len(out.plan.steps)} steps"):
                st.dataframe(steps_rows(out.plan), hide_index=True)
plotted = [o for o in result.outcomes if o.plan is not None]
for tab, out in zip(st.tabs([f"diagram: {o.planner}" for o in plotted]), plotted):
    with tab:
        st.plotly_chart(plan_figure(out.plan, edge.mesh), key=f"plan_{out.planner}")
if plotted:
    st.plotly_chart(cost_figure({o.planner: o.cost for o in plotted if o.cost is not None}), key="plan_costs")
