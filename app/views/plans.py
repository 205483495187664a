"""Plans page: an edge's contract, every planner's plan, the checker's verdicts."""

from __future__ import annotations

from typing import Sequence

import pandas as pd
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

from meshpact.app.context import mesh_of, message_markdown, require_scenario
from meshpact.app.figures import cost_figure, plan_figure
from meshpact.app.planning import (
    edge_from_facts,
    facet_summaries,
    judge,
    real_edges,
    run_uploaded,
    steps_rows,
    violation_groups,
)
from meshpact.core.catalog import CATALOG
from meshpact.core.errors import MeshpactError
from meshpact.core.facts import Request
from meshpact.core.units import human_bytes

choice = require_scenario()
mesh = mesh_of(choice)
st.title("Plans")
st.caption(
    "What a consumer must observe (the contract), how each planner would deliver it, and whether the "
    "symbolic checker accepts the plan, before anything runs."
)

edges = real_edges()
source = st.radio(
    "edge",
    ["a real edge", "build an edge from facts"],
    horizontal=True,
    label_visibility="collapsed",
    key="plans_source",
)

try:
    if source == "a real edge":
        name = st.selectbox("edge", list(edges), key="plans_edge")
        real = edges[name]
        edge = real.edge
        st.caption(
            f"**{real.model}** · {edge.description} · dimensions: {real.dims}"
            + (f" · source: {edge.source}" if edge.source else "")
        )
    else:
        names = [d.name for d in mesh.domains]

        def _model_columns() -> None:  # the columns follow the request: vocabulary for logits, else hidden
            m = CATALOG[st.session_state.get("plans_model", "Qwen/Qwen3-14B")]
            logits = Request(st.session_state.get("plans_request", Request.TOKEN.value)).reads_logits
            st.session_state["plans_cols"] = m.vocab_size if logits else m.hidden_size

        k: Sequence[DeltaGenerator] = st.columns(4)
        pdom = k[0].selectbox("producer domain", names, index=0, key="plans_pdom")
        cdom = k[1].selectbox("consumer domain", names, index=min(1, len(names) - 1), key="plans_cdom")
        placement = k[2].selectbox(
            "producer placement",
            ["Shard(1)", "Shard(0)", "Replicate()", "Partial(sum)", "Partial(max)"],
            key="plans_placement",
        )
        request = k[3].selectbox(
            "consumer request",
            [r.value for r in Request],
            index=list(Request).index(Request.TOKEN),
            key="plans_request",
            on_change=_model_columns,
        )
        k = st.columns(6)
        k[0].selectbox(
            "model (sets the columns)",
            list(CATALOG),
            key="plans_model",
            on_change=_model_columns,
            help="vocab_size for logits requests, hidden_size otherwise, from the model's config.json",
        )
        rows = k[1].number_input("rows (tokens)", 1, 65536, 8, key="plans_rows")
        cols = k[2].number_input(
            "columns (vocabulary or hidden)", 1, 1_000_000, CATALOG["Qwen/Qwen3-14B"].vocab_size, key="plans_cols"
        )
        dtype = k[3].selectbox("dtype", ["bfloat16", "float32", "float16", "int64"], key="plans_dtype")
        psize = mesh.domain(pdom).size
        tp = k[4].number_input(
            "producer TP degree",
            1,
            psize,
            psize,
            key="plans_tp",
            help="the producer is laid out over the first ranks of its domain",
        )
        consumers = k[5].number_input(
            "consumer ranks", 1, mesh.domain(cdom).size, min(2, mesh.domain(cdom).size), key="plans_consumers"
        )
        req = Request(request)
        st.caption(
            f"shape [{int(rows)}, {int(cols)}]: "
            + ("[tokens, vocabulary] logits" if req.reads_logits else "[tokens, hidden] activations")
        )
        extra: dict = {}
        if req.reads_logits:
            extra["pad_vocab"] = st.checkbox(
                "pad the vocabulary to a multiple of TP × 128 (padding masked)",
                key="plans_pad",
                help="as Megatron and vLLM pad the embedding",
            )
        if req is Request.TOPK:
            extra["k"] = int(st.number_input("k (ids per row)", 1, max(1, int(cols)), min(5, int(cols)), key="plans_k"))
        if req is Request.SAMPLE:
            s1, s2 = st.columns(2)
            extra["seed"] = int(s1.number_input("seed", 0, 2**62, 0, key="plans_seed"))
            extra["temperature"] = float(s2.number_input("temperature", 0.01, 100.0, 1.0, key="plans_temperature"))
        edge = edge_from_facts(
            mesh,
            producer_domain=pdom,
            consumer_domain=cdom,
            placement=placement,
            shape=(int(rows), int(cols)),
            dtype=dtype,
            request=request,
            consumer_ranks=int(consumers),
            shard_dim=1,
            producer_ranks=int(tp),
            **extra,
        )
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
            groups = violation_groups(out.violations)
            lines = (
                [
                    f"- **{g.kind}** × {g.count}: {g.examples[0]}" + (" (and more)" if g.count > 1 else "")
                    for g in groups
                ]
                if groups
                else [f"- {r}" for r in out.reasons[:8]]
            )
            st.error(f"**verdict: rejected** ({len(out.reasons)} violation(s))\n\n" + "\n".join(lines))
        if out.plan is not None and out.cost is not None:
            st.markdown(
                f"**{out.cost.startups}** startups · **{human_bytes(out.cost.payload_bytes)}** payload · "
                f"**{out.cost.time_s * 1e3:.3g} ms** α-β time",
                help=f"{out.cost.payload_bytes:,} payload bytes; by link: "
                + ", ".join(f"{k} {v:,} B" for k, v in out.cost.bytes_by_link.items()),
            )
plotted = [o for o in result.outcomes if o.plan is not None]
for out in plotted:  # the page's width, a cell wrapping where it must: every column of a step shows
    assert out.plan is not None
    with st.expander(f"{out.planner}: {len(out.plan.steps)} steps"):
        st.table(pd.DataFrame(steps_rows(out.plan)).set_index("#"))
for tab, out in zip(st.tabs([f"diagram: {o.planner}" for o in plotted]), plotted):
    with tab:
        assert out.plan is not None
        st.plotly_chart(plan_figure(out.plan, edge.mesh), key=f"plan_{out.planner}")
if plotted:
    st.plotly_chart(cost_figure({o.planner: o.cost for o in plotted if o.cost is not None}), key="plan_costs")

st.subheader("Run the lowerer's plan on your values")
st.caption(
    "As `meshpact plan --run VALUES`: the producer's whole tensor (a Partial producer: one addend per rank), "
    "rounded to its dtype and split as its placement says; per consumer rank, what it observes, the "
    "reference and the verdict under the contract's equivalence."
)
upload = st.file_uploader("values (.npy or .json)", type=["npy", "json"], key="plans_values")
if upload is not None:
    try:
        run = run_uploaded(edge, upload.name, upload.getvalue())
    except MeshpactError as exc:
        st.error(message_markdown(str(exc)))
    else:
        if run.error:
            st.error(run.error)
        st.dataframe(
            [
                {
                    "rank": r.rank,
                    "observed": str(r.observed),
                    "reference": str(r.reference),
                    "verdict": "right" if r.ok else "wrong",
                    "why": r.reason,
                }
                for r in run.ranks
            ],
            hide_index=True,
        )
        (st.success if run.ok else st.error)(f"**run: {'every rank right' if run.ok else 'a rank is wrong'}**")
