"""Live page: a local gloo cluster trains, faults are injected, recovery is watched and judged."""

from __future__ import annotations

import time
from pathlib import Path

import streamlit as st

from meshpact.app.context import message_markdown, require_engines, require_scenario
from meshpact.app.figures import mesh_figure, recovery_figure
from meshpact.app.replay import local_mesh
from meshpact.core.errors import MeshpactError
from meshpact.core.recovery import Policy, RecoveryBreakdown

JOB, EVENTS, OFFSET = "live_job", "live_events", "live_offset"
RECORDINGS = Path("recordings")

require_scenario()
st.title("Live")
require_engines("Live recovery", ("live.trial", "live.runtime", "live.launcher"))
st.caption("Real `torch.distributed` ranks on this machine (gloo on CPU, every socket on 127.0.0.1). The run trains a "
           "fault-free reference, then the same run with faults recovered in memory, then the checkpoint baselines, "
           "and compares every rank's parameters and optimizer state bit for bit.")

from meshpact.app.live_control import LiveJob, tail_events  # noqa: E402  (after the engine check)

job: LiveJob | None = st.session_state.get(JOB)
running = job is not None and job.running

with st.form("live_start"):
    k = st.columns(5)
    ranks = k[0].number_input("ranks", 2, 8, 4)
    steps = k[1].number_input("training steps", 4, 400, 40, step=4)
    faults = k[2].number_input("planned faults", 0, 20, 2)
    kind = k[3].selectbox("planned fault kind", ["collective", "stall", "kill", "partition"],
                          help="collective: a collective raises; stall: a rank sleeps past the timeout; kill: SIGKILL; "
                               "partition: link down between network namespaces (needs root and iproute2)")
    every = k[4].number_input("checkpoint every (steps)", 1, 400, 10)
    baselines = st.toggle("also measure a checkpoint restore and a cold restart", value=True, key="live_baselines")
    start = st.form_submit_button("Start cluster and train", type="primary", disabled=running)

if start:
    try:
        from meshpact.live.recovery.trial import TrialConfig

        TrialConfig(ranks=int(ranks), steps=int(steps), faults=int(faults), fault_kind=kind,
                    checkpoint_every=int(every))  # readable errors before anything starts
        if job is not None:
            job.stop()
        stamp = time.strftime("%Y%m%d-%H%M%S")
        job = LiveJob(RECORDINGS / f"live-{stamp}.jsonl",
                      ["--ranks", str(ranks), "--steps", str(steps), "--faults", str(faults), "--fault-kind", kind,
                       "--checkpoint-every", str(every), "--baselines" if baselines else "--no-baselines"],
                      world_size=int(ranks))
        st.session_state[JOB], st.session_state[EVENTS], st.session_state[OFFSET] = job, [], 0
        st.rerun()
    except (MeshpactError, ValueError) as exc:
        st.error("**Cannot start this run.**\n\n" + message_markdown(str(exc)))

if job is None:
    st.info("Start a cluster to watch a recovery happen. Processes started here stop when you press **Stop** "
            "or when this browser session ends.")
    st.stop()

c = st.columns([1, 1, 1, 2])
if c[0].button("Stop", disabled=not running, type="secondary"):
    job.stop()
    st.rerun()
rank_to_fault = c[1].selectbox("rank", list(range(job.world_size)), key="live_fault_rank", disabled=not running)
fault_kind = c[2].selectbox("inject", ["kill (SIGKILL)", "stall (SIGSTOP 3 s)"], key="live_fault_kind",
                            disabled=not running)
if c[3].button("Inject fault into the faulted run", disabled=not running):
    try:
        if fault_kind.startswith("kill"):
            job.kill_rank(int(rank_to_fault))
        else:
            job.stall_rank(int(rank_to_fault), 3.0)
        st.toast(f"{fault_kind.split()[0]} sent to rank {rank_to_fault}")
    except LookupError as exc:
        st.warning(f"{exc}. Faults go to the faulted run; wait until it is running.")


@st.fragment(run_every=1.0 if running else None)
def panel() -> None:
    assert job is not None
    new, offset = tail_events(job.recording, st.session_state.get(OFFSET, 0))
    st.session_state[OFFSET] = offset
    events = st.session_state.setdefault(EVENTS, [])
    events.extend(new)
    procs = job.ranks()
    phase = procs[-1].phase if procs else ("finished" if not job.running else "starting")
    world = max([p.rank for p in procs] + [job.world_size - 1]) + 1
    mesh = local_mesh(world)
    alive = {p.rank for p in procs if p.phase == phase and not p.stopped}
    a, b, c_, d = st.columns(4)
    a.metric("run", "running" if job.running else f"ended ({job.returncode})")
    b.metric("phase", phase)
    c_.metric("rank processes", f"{len(alive)}/{world}" if job.running else "—")
    d.metric("events recorded", len(events))
    left, right = st.columns([2, 3], gap="large")
    with left:
        down = sorted(set(range(world)) - alive) if job.running and procs else []
        st.plotly_chart(mesh_figure(mesh, down, height=320), key="live_mesh")
    with right:
        st.dataframe([{"t (s)": round(e.t, 3), "event": str(e.event), "rank": e.rank, "stage": e.stage.value if e.stage else ""}
                      for e in sorted(events, key=lambda e: e.t)[-12:]], hide_index=True)
        if job.injected:
            st.caption("Injected from this page: " + "; ".join(f"{i['kind']} rank {i['rank']} at {i['t']:.1f} s"
                                                            for i in job.injected))
    if job.running:
        return
    result = job.result()
    if result is None:
        st.warning("The run ended without a result (stopped, or it failed before writing one).")
        st.code(job.log_tail(), language="text")
        return
    if not result.get("ok"):
        st.error(f"**The run failed.**\n\n```\n{result.get('error', '')[-2500:]}\n```")
        return
    summary = result["summary"]
    if summary.get("bit_identical"):
        st.success(f"**Bit-identical:** after {summary.get('faults_injected')} fault(s), every rank's parameters and "
                   "optimizer state equal the fault-free reference.")
    else:
        st.error("**Not bit-identical:** " + "; ".join(summary.get("mismatches") or ["states differ"]))
    down_s = summary.get("downtime_s") or {}
    cols = st.columns(len(down_s) or 1)
    for col, (pol, secs) in zip(cols, down_s.items()):
        col.metric(f"downtime: {Policy(pol).label}", "—" if secs is None else f"{secs:.2f} s")
    recs = result.get("recoveries") or []
    if recs:
        bars = [RecoveryBreakdown(Policy(r["policy"]), {k: v for k, v in r["stages_s"].items() if v is not None})
                for r in recs[:6]]
        st.plotly_chart(recovery_figure(bars), key="live_stages")
        st.caption("Measured stage durations of each recovery (max over ranks).")
    st.markdown(f"Recording saved: `{job.recording}`. Open it on the Replay page.")
    st.page_link("views/replay.py", label="Replay this run", icon=":material/replay:")


panel()
