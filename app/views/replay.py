"""Replay page: a simulated run or a recording replayed on the mesh, stage by stage."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import streamlit as st

from meshpact.app.context import mesh_of, message_markdown, positions_of, require_scenario
from meshpact.app.figures import mesh_figure, recovery_figure
from meshpact.app.replay import (
    ReplayEvent, find_recordings, first_recovery_index, frame_breakdown, from_recording, from_timeline, recording_mesh,
    replay_frame,
)
from meshpact.app.state import clamp_failed
from meshpact.core.errors import MeshpactError
from meshpact.core.recording import read_recording
from meshpact.core.recovery import Policy

IDX, PLAY = "replay_index", "replay_playing"
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
def recorded(path: str, mtime: float) -> tuple[list[ReplayEvent], dict]:
    events = read_recording(path)
    return from_recording(events), dict(events[0].data)


source = st.radio("replay", ["simulated run of this scenario", "recording"], horizontal=True, key="replay_source",
                  label_visibility="collapsed")
policy = Policy.IN_MEMORY
positions = positions_of(choice)
try:
    if source == "recording":
        found = find_recordings(RECORDING_ROOTS)
        options = [str(p) for p in found] + ["another file…"]
        pick = st.selectbox("recording", options, key="replay_recording",
                            help="Finished recordings: live runs under recordings/, those shipped in scenarios/recordings/")
        path = st.text_input("path of a recording (.jsonl)", key="replay_path") if pick == "another file…" else pick
        if not path:
            st.info("No recording chosen. Live runs save theirs under `recordings/`; give a path to replay another.")
            st.stop()
        p = Path(path).expanduser()
        if not p.is_file():
            raise MeshpactError(f"{p}: no such recording; expected a .jsonl file written by a live or simulated run")
        events, meta = recorded(str(p), p.stat().st_mtime)
        st.caption(f"{p.name} · source: {meta.get('source', 'unknown')} · {len(events)} events")
        run_mesh = recording_mesh(meta, mesh)
        if run_mesh is not mesh:
            mesh, positions = run_mesh, None
    else:
        policy = Policy(st.selectbox("policy", [p.value for p in Policy], index=2,
                                     format_func=lambda v: Policy(v).label))
        events = simulated(choice.text, choice.source, policy.value)
        st.caption(f"{choice.scenario.name}: {len(events)} fault and recovery events in the simulated run")
except MeshpactError as exc:
    st.error("**Cannot replay this.**\n\n" + message_markdown(str(exc)))
    st.stop()

if not events:
    st.info("Nothing to replay: this run has no faults or recovery stages.")
    st.stop()

replay_key = (source, policy.value, len(events), events[0].t)
if st.session_state.get("replay_key") != replay_key or st.session_state.get(IDX, 0) >= len(events):
    st.session_state["replay_key"] = replay_key  # a new replay opens on its first recovery, all stages shown
    st.session_state[IDX] = first_recovery_index(events)
playing = bool(st.session_state.get(PLAY))
if st.button("⏸ pause" if playing else "▶ play", type="primary"):
    st.session_state[PLAY] = not playing
    if not playing and st.session_state.get(IDX, 0) >= len(events) - 1:
        st.session_state[IDX] = 0
    st.rerun()


@st.fragment(run_every=0.8 if playing else None)
def player() -> None:
    if st.session_state.get(PLAY):
        nxt = st.session_state.get(IDX, 0) + 1
        if nxt >= len(events):
            st.session_state[PLAY] = False
            st.rerun(scope="app")
        st.session_state[IDX] = nxt
    idx = st.slider("event", 0, len(events) - 1, key=IDX)
    frame = replay_frame(events, idx)
    failed = clamp_failed(frame.failed, mesh.ranks)
    left, right = st.columns([3, 2], gap="large")
    with left:
        st.plotly_chart(mesh_figure(mesh, failed, positions), key="replay_mesh")
    with right:
        a, b = st.columns(2)
        t = frame.event.t
        a.metric("time", f"{t / 3600:,.2f} h" if t >= 3600 else f"{t:,.2f} s", help=f"{t:,.3f} s from the start")
        b.metric("stage", frame.stage.value if frame.stage else "—")
        c, d = st.columns(2)
        c.metric("failed ranks", ", ".join(map(str, sorted(frame.failed))) or "none")
        d.metric("recoveries before this one", frame.recoveries_before)
        st.markdown(f"**Event {idx + 1}/{len(events)}:** {frame.event.label}")
        if frame.stages_so_far:
            st.plotly_chart(recovery_figure([frame_breakdown(frame, frame.policy or policy)]),
                            key="replay_stages")
    lo = max(0, idx - 3)
    st.dataframe([{"#": i + 1, "t (s)": round(e.t, 3), "event": e.label, "now": "◀" if i == idx else ""}
                  for i, e in enumerate(events[lo: lo + 8], start=lo)], hide_index=True)


player()
