"""Replay page: a simulated run, a recording, or the failures picked on Mesh, replayed on the mesh stage by stage."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import streamlit as st

from meshpact.app.context import mesh_of, message_markdown, positions_of, require_scenario
from meshpact.app.exports import perfetto_json
from meshpact.app.figures import mesh_figure, recovery_figure
from meshpact.app.format import clock, count
from meshpact.app.policies import compare_policies
from meshpact.app.replay import (
    ReplayEvent,
    find_recordings,
    first_recovery_index,
    frame_breakdown,
    from_breakdown,
    from_recording,
    from_timeline,
    recording_mesh,
    recording_problem,
    replay_frame,
)
from meshpact.app.state import (
    FAILED_KEY,
    REPLAY_LINK,
    REPLAY_SOURCES,
    clamp_failed,
    format_ranks,
    replay_link_word,
    replay_source_from_link,
)
from meshpact.core.errors import MeshpactError
from meshpact.core.recording import Event, read_recording
from meshpact.core.recovery import Policy

IDX, PLAY = "replay_index", "replay_playing"  # IDX holds the 1-based event number the slider shows
SIMULATED, RECORDING, FROM_MESH = (REPLAY_SOURCES[w] for w in ("simulated", "recording", "mesh"))
MESH_KNOBS = "mesh_recovery_knobs"  # (rank_loss, steps since checkpoint, step seconds) as last set on Mesh
ANOTHER = "another file…"
# Live runs from the Live page (relative to where the app runs), and the recordings shipped with the scenarios.
RECORDING_ROOTS = (Path("recordings"), Path(str(resources.files("meshpact.scenarios").joinpath("recordings"))))

choice = require_scenario()
mesh = mesh_of(choice)
st.title("Replay")


@st.cache_data(show_spinner="Simulating the scenario's training run…", max_entries=16)
def simulated(text: str, source: str, policy: str) -> list[ReplayEvent]:
    from meshpact.core.scenario import parse_scenario_text
    from meshpact.simulator.training import simulate_training

    result = simulate_training(parse_scenario_text(text, source), policies=[policy])
    return from_timeline(result.policies[Policy(policy)].timeline, policy)


@st.cache_data(show_spinner=False, max_entries=16)
def recorded(path: str, mtime: float) -> tuple[list[ReplayEvent], dict, list[Event]]:
    events = read_recording(path)
    return from_recording(events), dict(events[0].data), events


def _policy_picker(options: list[Policy]) -> Policy:
    if st.session_state.get("replay_policy") not in [p.value for p in options]:
        st.session_state["replay_policy"] = (Policy.IN_MEMORY if Policy.IN_MEMORY in options else options[0]).value
    return Policy(
        st.selectbox("policy", [p.value for p in options], key="replay_policy", format_func=lambda v: Policy(v).label)
    )


if "replay_source" not in st.session_state:  # a reload or a shared link: the source it names
    linked = replay_source_from_link(st.query_params.get(REPLAY_LINK))
    if linked is not None:
        st.session_state["replay_source"] = linked
source = st.radio(
    "replay", [SIMULATED, RECORDING, FROM_MESH], horizontal=True, key="replay_source", label_visibility="collapsed"
)
if st.query_params.get(REPLAY_LINK) != replay_link_word(source):  # a reload opens on this source again
    st.query_params[REPLAY_LINK] = replay_link_word(source) or ""
policy = Policy.IN_MEMORY
positions: dict[int, tuple[float, float]] | None = positions_of(choice)
raw_events: list[Event] | None = None
trace_name = choice.scenario.name
try:
    if source == RECORDING:
        found = find_recordings(RECORDING_ROOTS)
        options = [str(p) for p in found] + [ANOTHER]
        if st.session_state.get("replay_recording") not in options:  # kept from before, gone since
            st.session_state.pop("replay_recording", None)
        pick = st.selectbox(
            "recording",
            options,
            key="replay_recording",
            help="Finished recordings: live runs under recordings/, those shipped in scenarios/recordings/",
        )
        path = st.text_input("path of a recording (.jsonl)", key="replay_path") if pick == ANOTHER else pick
        if not path:
            st.info("No recording chosen. Live runs save theirs under `recordings/`; give a path to replay another.")
            st.stop()
        p = Path(path).expanduser()
        problem = recording_problem(p)
        if problem:
            raise MeshpactError(problem)
        try:
            events, meta, raw_events = recorded(str(p), p.stat().st_mtime)
        except OSError as exc:
            raise MeshpactError(f"{p}: cannot read the recording ({exc.strerror or exc})") from None
        trace_name = p.stem
        st.caption(f"{p.name} · source: {meta.get('source', 'unknown')} · {count(len(events))} events")
        run_mesh = recording_mesh(meta, mesh)
        if run_mesh is not mesh:
            mesh, positions = run_mesh, None
    elif source == FROM_MESH:
        failed = clamp_failed(st.session_state.get(FAILED_KEY, []), mesh.ranks)
        if not failed:
            st.info("No failed ranks: pick them on the Mesh page, then press **Replay these failures** there.")
            st.page_link("views/mesh.py", label="Pick failures on Mesh", icon=":material/hub:")
            st.stop()
        rank_loss, since, step_s = st.session_state.get(MESH_KNOBS, (False, 50, 1.0))
        cmp = compare_policies(mesh, failed, rank_loss=rank_loss, steps_since_checkpoint=since, step_s=step_s)
        policy = _policy_picker([b.policy for b in cmp.breakdowns])
        breakdown = next(b for b in cmp.breakdowns if b.policy is policy)
        events = from_breakdown(failed, breakdown)
        st.caption(
            f"Ranks {format_ranks(failed)} fail at once; {policy.label}'s stages from the cost model "
            f"({'rank loss' if cmp.rank_loss else 'processes alive'}, {since} steps since the checkpoint, "
            f"{step_s:g} s per step, as set on Mesh)."
        )
    else:
        policy = _policy_picker(list(Policy))
        events = simulated(choice.text, choice.source, policy.value)
        st.caption(f"{choice.scenario.name}: {count(len(events))} fault and recovery events in the simulated run")
except MeshpactError as exc:
    st.error("**Cannot replay this.**\n\n" + message_markdown(str(exc)))
    st.stop()

if not events:
    st.info("Nothing to replay: this run has no faults or recovery stages.")
    st.stop()
if raw_events is not None:
    st.download_button(
        "Perfetto trace (a track per rank)",
        data=perfetto_json(raw_events, trace_name),
        file_name=f"{trace_name}.perfetto.json",
        mime="application/json",
        help="Open it at https://ui.perfetto.dev: each rank is a track, each recovery stage a slice.",
    )

replay_key = (source, policy.value, len(events), events[0].t)
n = len(events)
if st.session_state.get("replay_key") != replay_key or not 1 <= st.session_state.get(IDX, 1) <= n:
    st.session_state["replay_key"] = replay_key  # a new replay opens on its first recovery, all stages shown
    st.session_state[IDX] = first_recovery_index(events) + 1
playing = bool(st.session_state.get(PLAY))
if st.button(
    "pause" if playing else "play",
    type="primary",
    key="replay_play",
    icon=":material/pause:" if playing else ":material/play_arrow:",
):
    st.session_state[PLAY] = not playing
    if not playing and st.session_state.get(IDX, 1) >= n:
        st.session_state[IDX] = 1
    st.rerun()


@st.fragment(run_every=0.8 if playing else None)
def player() -> None:
    if st.session_state.get(PLAY):
        nxt = st.session_state.get(IDX, 1) + 1
        if nxt > n:
            st.session_state[PLAY] = False
            st.rerun(scope="app")
        st.session_state[IDX] = nxt
    number = st.slider("event", 1, max(n, 2), key=IDX, disabled=n < 2) if n > 1 else 1
    idx = min(number, n) - 1
    frame = replay_frame(events, idx)
    failed = clamp_failed(frame.failed, mesh.ranks)
    t = frame.event.t
    a, b, c, d = st.columns([1.1, 1.2, 1.2, 1.0])  # room for "communicator" and a few rank ranges
    a.metric("time", clock(t), help=f"h:mm:ss from the start of the run ({t:,.3f} s)")
    b.metric("stage", frame.stage.value if frame.stage else "—")
    ids = format_ranks(frame.failed)
    named = (f"rank {ids}" if len(frame.failed) == 1 else f"ranks {ids}") if frame.failed else "none"
    c.metric(
        "failed ranks",
        named if len(named) <= 13 else f"{count(len(frame.failed))} ranks",
        help=f"the ranks down at this event: {named}",
    )
    d.metric("recoveries before this one", count(frame.recoveries_before))
    left, right = st.columns([3, 2], gap="large")
    with left:
        st.plotly_chart(mesh_figure(mesh, failed, positions), key="replay_mesh")
    with right:
        st.markdown(f"**Event {idx + 1}/{n}:** {frame.event.label}")
        if frame.stages_so_far:
            st.plotly_chart(recovery_figure([frame_breakdown(frame, frame.policy or policy)]), key="replay_stages")
        lo = max(0, idx - 3)
        st.dataframe(
            [
                {"#": f"» {i + 1}" if i == idx else str(i + 1), "time": clock(e.t), "event": e.label}
                for i, e in enumerate(events[lo : lo + 8], start=lo)
            ],
            hide_index=True,
            width="content",
        )


player()
