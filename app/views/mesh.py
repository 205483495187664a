"""Mesh page: the communicator mesh, failures by click, box or typed ranges, what recovery costs.

Everything under the title is one ``st.fragment``: a click, a box, typed ranks or a
recovery knob re-run only that part (not the router, the sidebar or the title). The mesh
is drawn by the canvas component (``app/components/``), which paints a click or a box at
once and sends back only the ranks now failed; its scene (positions, colours, labels) is
built once per scenario, and the policy comparison is cached per scenario, failed ranks
and knobs (``st.cache_resource``, a few entries each), so a selection seen before
rebuilds nothing.
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd
import streamlit as st

from meshpact.app.components import Ack, apply_pick, mesh_canvas, read_pick
from meshpact.app.context import keep_in_link, mesh_for, mesh_of, positions_for, require_scenario
from meshpact.app.figures import MeshScene, Node, mesh_scene, node_scene, nodes_of, recovery_bars_html
from meshpact.app.format import count, duration
from meshpact.app.policies import POLICY_EXPLAINED, PolicyComparison, compare_policies, comparison_rows
from meshpact.app.state import FAILED_KEY, clamp_failed, format_ranks, parse_ranks
from meshpact.core.facts import Domain, Mesh
from meshpact.core.mesh import health
from meshpact.core.recovery import Policy

TEXT_KEY, TEXT_ERROR = "failed_ranks_text", "failed_ranks_error"
CANVAS_KEY, NODES_KEY, DRILL_KEY = "mesh_canvas", "mesh_nodes_canvas", "mesh_drill_canvas"
ACKS_KEY = "mesh_canvas_acks"  # the last pick applied, per canvas
PICKED_KEY = "mesh_drill_nodes"  # the nodes drawn rank by rank, once the user picked them or failed ranks there
AGGREGATE_ABOVE = 4096  # ranks: above this the chart shows one cell per node, and a drill-down
NODE_RANKS = 8  # ranks per node in the aggregated view (an 8-accelerator server)
DRILL_MAX_NODES = 128  # at most 1,024 ranks in the drill-down chart

CACHED = 24  # scenes and comparisons kept per kind, shared by the server's sessions


def _drill_mesh(mesh: Mesh, nodes: Sequence[Node]) -> Mesh:
    picked = {r for n in nodes for r in n.ranks}
    doms = []
    for d in mesh.domains:
        rs = tuple(r for r in d.ranks if r in picked)
        if rs:
            doms.append(Domain(d.name, d.vendor, d.host, rs, d.backend, d.bridge_rank if d.bridge_rank in rs else None))
    return Mesh(domains=tuple(doms))


@st.cache_resource(show_spinner=False, max_entries=CACHED)
def _scene(text: str, source: str) -> MeshScene:
    return mesh_scene(mesh_for(text, source), positions_for(text, source))


@st.cache_resource(show_spinner=False, max_entries=CACHED)
def _nodes(text: str, source: str) -> tuple[tuple[Node, ...], MeshScene]:
    m = mesh_for(text, source)
    nodes = nodes_of(m, NODE_RANKS)
    return nodes, node_scene(m, nodes)


@st.cache_resource(show_spinner=False, max_entries=CACHED)
def _drill(text: str, source: str, picked: tuple[int, ...]) -> tuple[Mesh, MeshScene]:
    nodes, _ = _nodes(text, source)
    drill = _drill_mesh(mesh_for(text, source), [nodes[i] for i in picked])
    return drill, mesh_scene(drill)


@st.cache_resource(show_spinner=False, max_entries=CACHED)
def _comparison(
    text: str, source: str, failed: tuple[int, ...], rank_loss: bool, since: int, step_s: float
) -> tuple[PolicyComparison, str]:
    cmp = compare_policies(
        mesh_for(text, source), frozenset(failed), rank_loss=rank_loss, steps_since_checkpoint=since, step_s=step_s
    )
    return cmp, recovery_bars_html(cmp.breakdowns)


choice = require_scenario()
mesh = mesh_of(choice)
st.title("Communicator mesh")
st.caption(choice.scenario.description or choice.source)


def _typed() -> None:
    """The text box changed: read it exactly, or keep the failed ranks and say what was wrong."""
    try:
        ranks = parse_ranks(st.session_state.get(TEXT_KEY, ""), mesh.ranks)
    except ValueError as exc:
        st.session_state[TEXT_ERROR] = str(exc)
        return
    st.session_state[TEXT_ERROR] = None
    st.session_state[FAILED_KEY] = sorted(ranks)
    st.session_state.pop(PICKED_KEY, None)  # the drill-down opens on the nodes of the ranks typed


def _new_pick(key: str, scene: MeshScene) -> frozenset[int] | None:
    """The ids a canvas picked since the last run, once (the acknowledgement is kept per canvas)."""
    acks: dict[str, Ack] = dict(st.session_state.get(ACKS_KEY, {}))
    pick = read_pick(st.session_state.get(key))
    ids = apply_pick(acks.get(key), pick, scene.key)
    if ids is not None and pick is not None:
        acks[key] = pick.ack
        st.session_state[ACKS_KEY] = acks
    return ids


def _ack(key: str) -> Ack | None:
    return st.session_state.get(ACKS_KEY, {}).get(key)


@st.fragment
def _selection_and_recovery() -> None:
    """The part of the page a selection changes: re-run alone on a click, a box, typed ranks or a knob."""
    # Apply a new click or box on a canvas to the failed ranks before anything is drawn.
    before = clamp_failed(st.session_state.get(FAILED_KEY, []), mesh.ranks)
    failed = set(before)
    aggregated = mesh.world_size > AGGREGATE_ABOVE
    if aggregated:
        nodes, nodes_scene = _nodes(choice.text, choice.source)
        picked_now = _new_pick(NODES_KEY, nodes_scene)
        if picked_now:
            st.session_state[PICKED_KEY] = sorted(picked_now)[:DRILL_MAX_NODES]
        picked = [i for i in st.session_state.get(PICKED_KEY, []) if 0 <= i < len(nodes)]
        if not picked:  # open on the nodes that hold failed ranks, else the first of each domain
            hit = [n.index for n in nodes if not failed.isdisjoint(n.ranks)]
            picked = hit[:DRILL_MAX_NODES] or [next(n.index for n in nodes if n.domain == d.name) for d in mesh.domains]
        drill, scene = _drill(choice.text, choice.source, tuple(picked))
        chart_key = DRILL_KEY
    else:
        scene, chart_key = _scene(choice.text, choice.source), CANVAS_KEY
    shown = set(scene.ids)
    picked_ranks = _new_pick(chart_key, scene)
    if picked_ranks is not None:
        failed = (failed - shown) | set(picked_ranks)
        if aggregated:  # keep the drill-down on these nodes while ranks there are failed and healed
            st.session_state[PICKED_KEY] = picked
    failed_list = clamp_failed(failed, mesh.ranks)
    if failed_list != before:  # a click or a box replaces whatever was mistyped
        st.session_state[TEXT_ERROR] = None
    st.session_state[FAILED_KEY] = failed_list
    keep_in_link(choice, failed_list)  # a reload or a shared link opens on these failures
    if not st.session_state.get(TEXT_ERROR):
        st.session_state[TEXT_KEY] = format_ranks(failed_list)
    state = health(mesh, failed_list)

    m = st.columns(4)
    m[0].metric("healthy ranks", f"{count(state.healthy)}/{count(mesh.world_size)}")
    m[1].metric("failed", count(len(state.failed)), help="how many ranks are marked failed")
    m[2].metric("communicators intact", f"{len(state.surviving)}/{len(state.communicators)}")
    m[3].metric("hosts", count(len(mesh.hosts)))

    left, right = st.columns([3, 2], gap="large")
    with left:
        st.text_input(
            "Failed ranks: type rank ids and ranges (5-9, 12), or pick them on the chart",
            key=TEXT_KEY,
            on_change=_typed,
            placeholder="no rank failed",
        )
        if st.session_state.get(TEXT_ERROR):
            st.error(st.session_state[TEXT_ERROR])
        st.caption(
            "On the chart: click a rank to fail it and again to heal it, drag a box to fail every rank inside, "
            "hover to see its domain and host."
        )
        if aggregated:
            marks = {n.index: k for n in nodes if (k := len(state.failed.intersection(n.ranks)))}
            mesh_canvas(
                nodes_scene,
                picked,
                key=NODES_KEY,
                ack=_ack(NODES_KEY),
                marks=marks,
                height=540,
                caption=f"{count(mesh.world_size)} ranks as {count(len(nodes))} nodes of {NODE_RANKS}: click a "
                "node, or drag a box over nodes, to draw their ranks below.",
            )
            st.caption(f"Drill-down: {count(drill.world_size)} ranks ({format_ranks(drill.ranks)})")
            mesh_canvas(scene, state.failed.intersection(shown), key=DRILL_KEY, ack=_ack(DRILL_KEY), height=440)
        else:
            mesh_canvas(scene, state.failed, key=CANVAS_KEY, ack=_ack(CANVAS_KEY), height=560)

    with right:
        table = pd.DataFrame(
            [
                {
                    "communicator": cm.name.removeprefix("bridge "),
                    "state": "intact" if cm.intact(state.failed) else "broken",
                    "backend": cm.backend,
                    "ranks": count(len(cm.ranks)),
                }
                for cm in state.communicators
            ]
        )
        st.dataframe(  # as wide as its columns (the grid sizes each to its longest cell): beside the chart
            table,
            hide_index=True,
            width="content",  # where it fits, below it where not
        )
        for dom, rank in state.bridges.items():
            if rank is None:
                st.warning(f"Every rank of **{dom}** failed: the domain is lost.")
            elif rank != mesh.domain(dom).bridge_rank:
                st.info(f"The bridge rank of **{dom}** failed: rank {rank} takes over the bridge.")
        if state.failed:
            st.markdown("**Take these failures to another page**")
            st.page_link("views/simulate.py", label="Simulate these failures", icon=":material/monitoring:")
            if st.button("Replay these failures", icon=":material/replay:"):
                st.session_state["replay_source"] = "failures picked on Mesh"
                st.switch_page("views/replay.py")

    st.subheader("Recovery by policy")
    if not state.failed:
        st.info(
            "Fail a rank (click it on the chart, drag a box, or type it above) to see what each recovery policy "
            "would cost."
        )
    else:
        k1, k2, k3 = st.columns(3)
        rank_loss = k1.toggle(
            "the failed ranks' processes are gone",
            value=False,
            help="Off: a collective failed and every process is alive. On: the ranks are lost.",
        )
        since = k2.slider("steps since the last checkpoint", 0, 500, 50, step=10)
        step_s = k3.slider("seconds per training step", 0.1, 10.0, 1.0, step=0.1)
        st.session_state["mesh_recovery_knobs"] = (
            rank_loss,
            since,
            step_s,
        )  # Replay and Simulate cost the same failure
        cmp, recovery_bars = _comparison(
            choice.text, choice.source, tuple(sorted(state.failed)), rank_loss, since, step_s
        )
        if cmp.shape.lost_hosts and not rank_loss:
            st.info(
                f"Every rank of host **{', '.join(cmp.shape.lost_hosts)}** failed: its processes are gone with it, "
                "so the figures count a rank loss."
            )
        m1, m2, m3 = st.columns(3)
        fast = cmp.total_s(Policy.IN_MEMORY)
        cold = cmp.total_s(Policy.COLD_RESTART) or 0.0
        if cmp.downtime_reduction is not None and fast is not None:
            m1.metric("downtime reduction (cold restart ÷ in-memory)", f"{cmp.downtime_reduction:.1f}×")
            m2.metric(
                "in-memory rebind downtime",
                duration(fast),
                delta=f"{duration(fast - cold)} vs cold restart",
                delta_color="inverse",
            )
        else:
            best = min(cmp.breakdowns, key=lambda b: b.total_s)
            m1.metric("in-memory rebind", "cannot apply", help=cmp.unavailable.get(Policy.IN_MEMORY, ""))
            m2.metric(f"fastest: {best.policy.label}", duration(best.total_s))
        m3.metric(
            "state retained in memory",
            f"{count(cmp.retained_ranks)}/{count(mesh.world_size)} ranks",
            help=f"{cmp.retained_bytes / 1e9:,.0f} GB kept in memory; a checkpoint restore reads "
            f"{cmp.reloaded_bytes / 1e9:,.0f} GB back",
        )
        for policy, why in cmp.unavailable.items():
            st.warning(f"**{policy.label} cannot apply:** {why}.")
        # plain HTML bars: a click redraws them, and a chart library's redraw doubled a click's time
        st.markdown(recovery_bars, unsafe_allow_html=True)
        st.markdown("\n".join(f"- **{p.label}**: {POLICY_EXPLAINED[p]}" for p in Policy))
        st.caption(
            f"In-memory rebind rebuilds the communicators the failed ranks belonged to "
            f"({count(cmp.shape.rebuild_ranks)} ranks); the restores rebuild all {count(mesh.world_size)}. "
            "Durations come from the recovery cost model (`core/recovery.py`), whose defaults name their source "
            "or say they are assumptions. The Live page measures the same stages on real process groups."
        )
        st.download_button(
            "recovery comparison CSV",
            data=pd.DataFrame(comparison_rows(cmp)).to_csv(index=False),
            file_name=f"{choice.scenario.name}-recovery-{len(state.failed)}-failed.csv",
            mime="text/csv",
        )


_selection_and_recovery()
