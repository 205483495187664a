"""Live page: a local gloo cluster trains, faults are injected, recovery is watched and judged."""

from __future__ import annotations

import time
from pathlib import Path

import streamlit as st

from meshpact.app.context import message_markdown, require_scenario
from meshpact.app.exports import perfetto_json
from meshpact.app.figures import mesh_figure, recovery_figure
from meshpact.app.format import clock, count, duration
from meshpact.app.live_control import LiveJob, failure_sentence, rank_rows, tail_events
from meshpact.app.replay import find_recordings, local_mesh
from meshpact.core.errors import MeshpactError
from meshpact.core.recording import partial_path
from meshpact.core.recovery import Policy, RecoveryBreakdown
from meshpact.live.recovery.faults import FaultKind  # torch-free

JOB, EVENTS, OFFSET, WAS_RUNNING = "live_job", "live_events", "live_offset", "live_was_running"
METRICS, METRICS_ON = "live_metrics_endpoint", "live_metrics_on"
RECORDINGS = Path("recordings")

require_scenario()
st.title("Live")
st.caption("Real `torch.distributed` ranks on this machine (gloo on CPU, every socket on 127.0.0.1). The run trains a "
           "fault-free reference, then the same run with faults recovered in memory, then the checkpoint baselines, "
           "and compares every rank's parameters and optimizer state bit for bit.")

job: LiveJob | None = st.session_state.get(JOB)
running = job is not None and job.running
st.session_state[WAS_RUNNING] = running

with st.form("live_start"):
    k = st.columns(5)
    ranks = k[0].number_input("ranks", 2, 8, 4)
    steps = k[1].number_input("training steps", 4, 400, 40, step=4)
    faults = k[2].number_input("planned faults", 0, 20, 2)
    kind = k[3].selectbox("planned fault kind", [f.value for f in FaultKind],
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
        endpoint = st.session_state.pop(METRICS, None)
        if endpoint is not None:
            endpoint.close()
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


def _inject(target: LiveJob, rank: int, what: str) -> None:
    """SIGKILL a rank, or SIGSTOP it for 3 s, in the faulted run; say so, or say why not."""
    try:
        if what == "kill":
            target.kill_rank(rank)
        else:
            target.stall_rank(rank, 3.0)
        st.toast(f"{what} sent to rank {rank}")
    except LookupError as exc:
        st.warning(f"{exc}. Faults go to the faulted run; wait until it is running.")


if c[3].button("Inject fault into the faulted run", disabled=not running):
    _inject(job, int(rank_to_fault), "kill" if fault_kind.startswith("kill") else "stall")


def _metrics_toggle() -> None:
    """Serve the run's metrics for Prometheus while the toggle is on (127.0.0.1, a free port)."""
    from meshpact.app.metrics import MetricsEndpoint

    endpoint = st.session_state.get(METRICS)
    if st.session_state.get(METRICS_ON) and endpoint is None:
        st.session_state[METRICS] = MetricsEndpoint(job.recording)
    elif not st.session_state.get(METRICS_ON) and endpoint is not None:
        endpoint.close()
        st.session_state.pop(METRICS, None)


st.toggle("serve Prometheus metrics for this run (127.0.0.1)", key=METRICS_ON, on_change=_metrics_toggle,
          help="Recoveries by policy, stage-duration histograms and per-rank event ages, read from the recording "
               "as it grows. Off by default; bound to loopback.")
if st.session_state.get(METRICS) is not None:
    st.caption(f"Scrape `{st.session_state[METRICS].url}`")


def _open_in_replay(path: Path) -> None:
    """Point the Replay page at ``path`` (the pickers follow the user there)."""
    st.session_state["replay_source"] = "recording"
    if str(path) in {str(p) for p in find_recordings([path.parent])}:
        st.session_state["replay_recording"] = str(path)
    else:
        st.session_state["replay_recording"] = "another file…"
        st.session_state["replay_path"] = str(path)


@st.fragment(run_every=1.0 if running else None)
def panel() -> None:
    assert job is not None
    if st.session_state.get(WAS_RUNNING) and not job.running:
        st.session_state[WAS_RUNNING] = False
        st.rerun(scope="app")  # the run ended by itself: Start comes back, Stop and Inject go grey
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
    d.metric("events recorded", count(len(events)))
    rows = rank_rows(procs, events, phase) if job.running else []
    if rows:
        head = st.columns([1, 1.4, 1.2, 1.3, 1.3, 2.4, 1, 1.2])
        for col, name in zip(head, ["rank", "pid", "incarnation", "phase", "state", "last event", "fault"]):
            col.markdown(f"**{name}**")
        for row in rows:
            cells = st.columns([1, 1.4, 1.2, 1.3, 1.3, 2.4, 1, 1.2])
            for col, value in zip(cells, [row.rank, row.pid, row.incarnation, row.phase, row.state,
                                          f"{row.last_event} at {clock(row.last_event_t)}"
                                          if row.last_event_t is not None else "—"]):
                col.write(str(value))
            if cells[6].button("kill", key=f"live_kill_{row.rank}", disabled=row.phase != "faulted"):
                _inject(job, row.rank, "kill")
            if cells[7].button("stall 3 s", key=f"live_stall_{row.rank}", disabled=row.phase != "faulted"):
                _inject(job, row.rank, "stall")
    left, right = st.columns([2, 3], gap="large")
    with left:
        down = sorted(set(range(world)) - alive) if job.running and procs else []
        st.plotly_chart(mesh_figure(mesh, down), key="live_mesh")
    with right:
        st.dataframe([{"time": clock(e.t), "event": str(e.event), "rank": "" if e.rank is None else str(e.rank),
                       "stage": e.stage.value if e.stage else ""}
                      for e in sorted(events, key=lambda e: e.t)[-12:]], hide_index=True, width="stretch")
        if job.injected:
            st.caption("Injected from this page: " + "; ".join(f"{i['kind']} rank {i['rank']} at {clock(i['t'])}"
                                                            for i in job.injected))
        if events:
            st.download_button("Perfetto trace of the events so far", data=perfetto_json(events, job.recording.stem),
                               file_name=f"{job.recording.stem}.perfetto.json", mime="application/json",
                               key="live_perfetto")
    if job.running:
        return
    kept = job.recording if job.recording.exists() else partial_path(job.recording)
    result = job.result()
    if result is None or not result.get("ok"):
        why = failure_sentence(result.get("error", "") if result else job.log_tail())
        stopped = result is None and job.returncode is not None and job.returncode < 0
        head = "The run was stopped." if stopped else "The run failed."
        where = f" What it recorded is in `{kept}`." if kept.exists() else " It left no recording."
        st.error(f"**{head}** {why}{where}")
        if kept.exists():
            if st.button("Replay what it recorded", icon=":material/replay:"):
                _open_in_replay(kept)
                st.switch_page("views/replay.py")
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
        col.metric(f"downtime: {Policy(pol).label}", "—" if secs is None else duration(secs))
    recs = result.get("recoveries") or []
    if recs:
        bars = [RecoveryBreakdown(Policy(r["policy"]), {k: v for k, v in r["stages_s"].items() if v is not None})
                for r in recs[:6]]
        st.plotly_chart(recovery_figure(bars), key="live_stages")
        st.caption("Measured stage durations of each recovery (max over ranks).")
    st.markdown(f"Recording saved: `{kept}`.")
    if st.button("Replay this run", icon=":material/replay:"):
        _open_in_replay(kept)
        st.switch_page("views/replay.py")


panel()
