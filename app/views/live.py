"""Live page: an operations console for a local gloo cluster that trains, is faulted by hand, and recovers.

A run here is a recovery trial (a fault-free reference, the faulted run, the checkpoint
baselines) whose ranks keep a pace set on the page: a number of steps per second, and a
hold before the faulted run's first step so a person can kill, stall or partition a rank
from its row of the rank table. Each rank's own event log is followed while it runs, so
the table and the event stream move every step; the verdict counts the faults sent from
the page, and the finished recording opens in Replay or as a Perfetto trace.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import streamlit as st

from meshpact.app.context import message_markdown, require_scenario
from meshpact.app.exports import perfetto_json
from meshpact.app.figures import live_mesh_figure, recovery_figure
from meshpact.app.format import count, duration
from meshpact.app.live_control import (
    RUN_LINK,
    FaultFromPage,
    claim_recording,
    LiveJob,
    RankEvent,
    RankRow,
    committed_step,
    down_ranks,
    earlier_run_notice,
    failure_sentence,
    form_problem,
    job_stream,
    planned_fault_kind,
    rank_rows,
    sent_caption,
    stream_rows,
)
from meshpact.app.replay import find_recordings, local_mesh
from meshpact.app.verdict import Tone, downtime_notes, run_verdict
from meshpact.app.widgets import read_number
from meshpact.core.errors import MeshpactError
from meshpact.core.recording import partial_path, read_recording
from meshpact.core.recovery import Policy, RecoveryBreakdown
from meshpact.live.recovery.faults import FaultKind  # torch-free
from meshpact.live.trials.trialconfig import ON_RANK_LOSS, PHASES, Pace

JOB, WAS_RUNNING = "live_job", "live_was_running"
METRICS, METRICS_ON, PACE = "live_metrics_endpoint", "live_metrics_on", "live_pace"
RECORDINGS = Path("recordings")
FULL_SPEED = "full speed"
PACES = [FULL_SPEED, "2 steps/s", "5 steps/s", "10 steps/s", "20 steps/s"]  # a step period under the data timeout
STALL_S, PARTITION_S = 3.0, 3.0
BOUNDS = {
    "ranks": (2, 8),
    "training steps": (4, 400),
    "planned faults": (0, 20),
    "checkpoint every (steps)": (1, 400),
}  # the start form's whole numbers, in the form's order
COLUMNS = [0.55, 0.75, 1.2, 1.5, 0.5, 1.0, 1.65, 0.75, 0.6, 0.65, 0.95]  # 8 cells, then kill, stall, partition
FAULT_HELP = {
    FaultFromPage.KILL: "SIGKILL this rank's process; the run starts a replacement",
    FaultFromPage.STALL: f"SIGSTOP this rank's process for {STALL_S:g} s, past the data-path timeout",
    FaultFromPage.PARTITION: f"take this rank's host's data link down for {PARTITION_S:g} s",
}
HEADS = ["rank", "pid", "incarnation", "state", "step", "generation", "last collective #seq", "silent for"]


def _steps_per_s(label: str) -> float | None:
    return None if label == FULL_SPEED else float(label.split()[0])


def _session_alive() -> Callable[[], bool] | None:
    """Whether this browser session is still connected, asked from any thread (None where the
    app runs without Streamlit's server, as under AppTest: nothing to watch)."""
    from streamlit.runtime import Runtime
    from streamlit.runtime.scriptrunner import get_script_run_ctx

    ctx = get_script_run_ctx()
    if ctx is None or not Runtime.exists():
        return None
    runtime, session = Runtime.instance(), ctx.session_id
    if not runtime.is_active_session(session):
        return None
    return lambda: runtime.is_active_session(session)


require_scenario()
st.title("Live")
st.caption(
    "Real `torch.distributed` ranks on this machine (gloo on CPU, every socket on 127.0.0.1). The run trains a "
    "fault-free reference, then the same run with faults recovered, then the checkpoint baselines, and "
    "compares every rank's parameters and optimizer state bit for bit."
)

job: LiveJob | None = st.session_state.get(JOB)
running = job is not None and job.running
st.session_state[WAS_RUNNING] = running

with st.form("live_start"):
    k = st.columns(5)
    typed = {
        "ranks": k[0].text_input("ranks", "4", key="live_ranks", help="2 to 8 rank processes"),
        "training steps": k[1].text_input("training steps", "40", key="live_steps", help="4 to 400"),
        "planned faults": k[2].text_input(
            "planned faults",
            "0",
            key="live_faults",
            help="0 to 20 faults the run injects by itself; those you send from a rank's row come on top.",
        ),
    }
    kind = k[3].selectbox(
        "planned fault kind",
        [f.value for f in FaultKind],
        help="collective: a collective raises; stall: a rank sleeps past the timeout; kill: SIGKILL; "
        "partition: link down between network namespaces (needs root and iproute2; also what "
        "makes the partition button of a row work)",
    )
    typed["checkpoint every (steps)"] = k[4].text_input(
        "checkpoint every (steps)", "10", key="live_every", help="1 to the number of training steps"
    )
    o = st.columns([1.1, 1, 1, 1.1, 1])
    hold = o[0].toggle(
        "hold before faulted run",
        value=True,
        key="live_hold",
        help="The faulted run's ranks wait before their first step until you press Resume, "
        "so you can inject a fault by hand first.",
    )
    pace_label = o[1].selectbox(
        "pace",
        PACES,
        index=1,
        key="live_pace_start",
        help="At most this many training steps a second in every run (change it while it runs).",
    )
    heartbeat = o[2].toggle(
        "heartbeat detector",
        value=True,
        key="live_heartbeat",
        help="Find a stalled rank, or a cut data link (gloo), by heartbeat over the control "
        "channel, not only by the data-path timeout (on by default).",
    )
    baselines = o[3].toggle(
        "checkpoint baselines",
        value=True,
        key="live_baselines",
        help="After the faulted run, also measure a checkpoint restore in the job and a cold "
        "restart, for the downtime comparison.",
    )
    on_loss = o[4].selectbox(
        "on rank loss",
        list(ON_RANK_LOSS),
        key="live_on_rank_loss",
        help="A killed rank: replace it (a new process takes its state from a peer's copy) or "
        "excise it (the survivors re-shard its state and go on with fewer ranks and the "
        "same global batch).",
    )
    start = st.form_submit_button("Start cluster and train", type="primary", disabled=running)

numbers = {name: read_number(text, name, *BOUNDS[name], whole=True) for name, text in typed.items()}
ranks, steps, faults, every = (numbers[name][0] or 0 for name in BOUNDS)
problem = None
if start:
    problem = " ".join(p for _, p in numbers.values() if p) or form_problem(int(ranks), int(faults), kind, str(on_loss))
kind = planned_fault_kind(int(faults), kind, str(on_loss))
if problem:
    st.error("**Cannot start this run.** " + problem)
elif start:
    try:
        from meshpact.live.trials.trial import TrialConfig

        TrialConfig(
            ranks=int(ranks),
            steps=int(steps),
            faults=int(faults),
            fault_kind=FaultKind(kind),
            checkpoint_every=int(every),
            heartbeat=bool(heartbeat),
        )  # readable errors before anything starts
        if job is not None:
            job.stop()
        pace = Pace(_steps_per_s(pace_label), frozenset({"faulted"}) if hold else frozenset())
        job = LiveJob(
            claim_recording(RECORDINGS),
            [
                "--ranks",
                str(ranks),
                "--steps",
                str(steps),
                "--faults",
                str(faults),
                "--fault-kind",
                kind,
                "--checkpoint-every",
                str(every),
                "--baselines" if baselines else "--no-baselines",
                "--heartbeat" if heartbeat else "--no-heartbeat",
                "--on-rank-loss",
                str(on_loss),
            ],
            world_size=int(ranks),
            pace=pace,
            steps=int(steps),
            session_alive=_session_alive(),
        )
        st.session_state[JOB] = job
        st.session_state[PACE] = pace_label
        st.query_params[RUN_LINK] = job.recording.stem  # a reload stops the run: the page that opens says so
        endpoint = st.session_state.pop(METRICS, None)
        if endpoint is not None:
            endpoint.close()
        st.rerun()
    except (MeshpactError, ValueError) as exc:
        st.error("**Cannot start this run.**\n\n" + message_markdown(str(exc)))

if job is None:
    earlier = earlier_run_notice(st.query_params.get(RUN_LINK), RECORDINGS)
    if earlier:
        st.warning(earlier)
    st.info(
        "Start a cluster to watch a recovery happen. Processes started here stop when you press **Stop** "
        "or within seconds of this browser session ending (tab closed or reloaded, or the app stopped)."
    )
    st.stop()


def _set_pace() -> None:
    """The pace picked while the run goes, sent to the ranks (they read it before each step)."""
    assert job is not None and job.pace is not None
    job.set_pace(Pace(_steps_per_s(st.session_state[PACE]), job.pace.hold))


held = job.pace is not None and bool(job.pace.hold)
c = st.columns([1, 1.3, 1.6, 4])
if c[0].button("Stop", disabled=not running, type="secondary", key="live_stop"):
    job.stop()
    st.rerun()
if c[1].button(
    "Resume",
    disabled=not (running and held),
    type="primary",
    key="live_resume",
    help="Let the held ranks start the faulted run (a stall or partition sent meanwhile hits them then; a "
    "killed rank was already recovered from while held).",
):
    assert job.pace is not None
    job.set_pace(Pace(job.pace.steps_per_s, frozenset()))
    st.rerun()
if job.pace is not None:
    c[2].selectbox("pace", PACES, key=PACE, on_change=_set_pace, disabled=not running, label_visibility="collapsed")


def _inject(target: LiveJob, rank: int, what: FaultFromPage) -> None:
    """Send a fault to a rank of the faulted run; say so, or say why not."""
    try:
        if what is FaultFromPage.KILL:
            target.kill_rank(rank)
        elif what is FaultFromPage.STALL:
            target.stall_rank(rank, STALL_S)
        else:
            target.partition_rank(rank, PARTITION_S)
        st.toast(f"{what.value} sent to rank {rank}")
    except LookupError as exc:
        st.warning(f"Not sent: {exc}.")


def _metrics_toggle() -> None:
    """Serve the run's metrics for Prometheus while the toggle is on (127.0.0.1, a free port)."""
    from meshpact.app.metrics import MetricsEndpoint

    assert job is not None
    endpoint = st.session_state.get(METRICS)
    if st.session_state.get(METRICS_ON) and endpoint is None:
        st.session_state[METRICS] = MetricsEndpoint(
            job.recording, trial_dir=job.trial_dir if job.pace is not None else None
        )
    elif not st.session_state.get(METRICS_ON) and endpoint is not None:
        endpoint.close()
        st.session_state.pop(METRICS, None)


c[3].toggle(
    "serve Prometheus metrics for this run (127.0.0.1)",
    key=METRICS_ON,
    on_change=_metrics_toggle,
    help="Each rank's committed step and generation, recoveries by policy and stage-duration histograms as "
    "they happen, and per-rank event ages, read from the ranks' own logs and the recording as they "
    "grow. Off by default; bound to loopback.",
)
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


def _current_phase(job: LiveJob, rank_events: list[RankEvent]) -> str:
    """The latest run (reference, faulted, cold) with a rank process (live now, or seen before: a
    stopped run keeps its table) or a logged event."""
    seen = {p.phase for p in job.ranks()} | job.phases_seen | {e.phase for e in rank_events}
    return max((p for p in seen if p in PHASES), key=PHASES.index, default="starting")


def _rank_table(rows: list[RankRow]) -> None:
    assert job is not None
    head = st.columns(COLUMNS, gap="xsmall")
    for col, name in zip(head, HEADS):
        col.caption(f"**{name}**")
    for row in rows:
        cells = st.container(key=f"live_row_{row.rank}").columns(COLUMNS, gap="xsmall", vertical_alignment="center")
        values = [
            row.rank,
            row.pid if row.pid is not None else "—",
            row.incarnation,
            row.state,
            "—" if row.step is None else row.step,
            "—" if row.generation is None else row.generation,
            row.collective or "—",
            "—" if row.silent_s is None else duration(row.silent_s),
        ]
        for col, value in zip(cells, values):
            col.write(str(value))
        why_not = job.partition_why_not(row.rank, pid=row.pid) if row.can_fault else None
        for col, what in zip(cells[8:], FaultFromPage):
            off = not row.can_fault or (what is FaultFromPage.PARTITION and why_not is not None)
            tip = why_not if what is FaultFromPage.PARTITION and why_not else FAULT_HELP[what]
            if col.button(what.value, key=f"live_{what.value}_{row.rank}", disabled=off, help=tip):
                _inject(job, row.rank, what)


@st.fragment(run_every=1.0 if running else None)
def panel() -> None:
    assert job is not None
    live = job.running  # read once: every part of the panel says the same of the run
    if (st.session_state.get(WAS_RUNNING) or running) and not live:  # ended by itself, this run of the page included
        st.session_state[WAS_RUNNING] = False
        st.rerun(scope="app")  # the run ended by itself: Start comes back, Stop, Resume and faults go grey
    job.events.poll()
    events, rank_events = job.events.parent_events, job.events.rank_events
    phase = _current_phase(job, rank_events)
    if not live and any(e.phase == "faulted" for e in rank_events):
        phase = "faulted"  # a run that ended: the table keeps the faulted run's last word of each rank
    now = time.time()
    result = None if live else job.result()
    finished = bool(result and result.get("ok"))
    rows = (
        rank_rows(
            job.ranks(), rank_events, phase, now, job.world_size, job.steps, finished, stopped=job.stopped and not live
        )
        if phase in PHASES
        else []
    )
    alive = sum(r.pid is not None for r in rows)
    excised = [r.rank for r in rows if r.state == "excised"]
    step = committed_step(rows)
    generations = [r.generation for r in rows if r.generation is not None]
    wall0 = job.events.wall0 if job.events.wall0 is not None else job.started
    stream = job_stream(rank_events, events, wall0)
    a, b, c_, d, g, e_ = st.columns(6)
    a.metric("run", "running" if live else job.status)
    b.metric("phase", phase if live else ("stopped" if job.stopped else "finished"))
    c_.metric(
        "rank processes",
        f"{alive}/{job.world_size - len(excised)}" if live else "—",
        help="Live rank processes over the ranks the job has (an excised rank has left it).",
    )
    d.metric(
        "committed step",
        "—" if step is None else step,
        help="The least step committed by the ranks still in the job (an excised or dead rank's is not).",
    )
    g.metric(
        "generation",
        max(generations) if generations else "—",
        help="Each recovery builds the job's groups anew, numbered by the consensus round that decided it.",
    )
    e_.metric("events", count(len(stream)), help="Every rank process's own events, in every run, and the run's own.")
    if live and job.pace is not None and job.pace.holds("faulted"):
        if phase == "faulted" and rows and all(r.state in ("held", "excised") for r in rows):
            st.info(
                "**The faulted run is held before its next step.** Kill, stall or partition a rank from its "
                "row, then press **Resume**. A killed rank is recovered from while the run is held: replaced, "
                "its replacement and the held survivors agree; excised, the survivors run one step to meet the "
                "loss, go on without it and hold again. Either way every row moves to the next generation. A "
                "stall or a partition meets the ranks once they train. The run gives up after 5 minutes held."
            )
        elif phase != "faulted":
            st.caption("The faulted run will be held before its first step (the reference run trains first).")
    if rows:
        _rank_table(rows)
    st.plotly_chart(live_mesh_figure(local_mesh(job.world_size), down_ranks(rows)), key="live_mesh")
    st.caption(
        "Marked failed: a dead rank (lost, not yet replaced), an excised one, a stalled one. A rank the "
        "Stop button ended is not failed: its row reads stopped, with its last committed step."
    )
    replaced = [f"rank {r.rank} (incarnation {r.incarnation})" for r in rows if r.incarnation > 0]
    if replaced:
        st.caption("Replaced: " + ", ".join(replaced))
    if excised:
        st.caption(
            f"Excised: rank{'s' if len(excised) > 1 else ''} {', '.join(map(str, excised))} — the job goes "
            f"on with {job.world_size - len(excised)} of {job.world_size} ranks and the same global batch "
            "(the lost ranks' state re-sharded over the survivors)."
        )
    st.dataframe(stream_rows(stream[-14:]), hide_index=True, width="content", height=300)
    if job.injected:
        st.caption(sent_caption(job.injected, wall0) + " (times since the recording began, as the events')")
    if live:
        return
    _finished(job)


def _finished(job: LiveJob) -> None:
    """The verdict of a run that ended: a sentence, the numbers, and where its recording is."""
    kept = job.recording if job.recording.exists() else partial_path(job.recording)
    result = job.result()
    if kept.exists():
        try:
            recorded = read_recording(kept)
        except MeshpactError:
            recorded = []
        if recorded:
            st.download_button(
                "Perfetto trace of this run",
                data=perfetto_json(recorded, job.recording.stem),
                file_name=f"{job.recording.stem}.perfetto.json",
                mime="application/json",
                key="live_perfetto",
                icon=":material/download:",
                help="Open it at https://ui.perfetto.dev: a track per rank, each recovery stage a slice.",
            )
    if result is None or not result.get("ok"):
        why = failure_sentence(result.get("error", "") if result else job.log_tail())
        where = f" What it recorded is in `{kept}`." if kept.exists() else " It left no recording."
        if job.stopped or (result is None and job.returncode is not None and job.returncode < 0):
            st.info(f"**The run was stopped.**{where}")
        else:
            st.error(f"**The run failed.** {why}{where}")
        if kept.exists() and st.button("Replay what it recorded", icon=":material/replay:", key="live_replay"):
            _open_in_replay(kept)
            st.switch_page("views/replay.py")
        return
    summary = result["summary"]
    total = summary.get("faults_injected")
    verdict = run_verdict(summary)
    (st.success if verdict.tone is Tone.SUCCESS else st.error)(verdict.text)
    down_s = {pol: secs for pol, secs in (summary.get("downtime_s") or {}).items() if secs is not None}
    if down_s:
        cols = st.columns(len(down_s))
        for col, (pol, secs) in zip(cols, down_s.items()):
            col.metric(f"downtime: {Policy(pol).label}", duration(secs))
    for note in downtime_notes(summary, baselines_asked="--baselines" in job.args):
        st.caption(note)
    recs = result.get("recoveries") or []
    if recs:
        st.dataframe(
            [
                {
                    "step": r["step"],
                    "generation": r["generation"],
                    "policy": Policy(r["policy"]).label,
                    "downtime": "—" if r.get("downtime_s") is None else duration(r["downtime_s"]),
                    "detection": duration(r["stages_s"].get("detection") or 0.0),
                    "recovery": duration(r["recovery_s"]),
                }
                for r in recs
            ],
            hide_index=True,
            key="live_recoveries",
        )
        st.caption(
            f"{summary.get('faults_recovered', 0)} of {total} fault(s) recovered; each recovery's downtime runs "
            "from its fault to the last rank's first collective after it."
        )
    recs = result.get("recoveries") or []
    if recs:
        bars = [
            RecoveryBreakdown(Policy(r["policy"]), {k: v for k, v in r["stages_s"].items() if v is not None})
            for r in recs[:6]
        ]
        st.plotly_chart(recovery_figure(bars), key="live_stages")
        st.caption(
            "Measured stage durations of each recovery along its critical path: each stage ends when the "
            "last rank ends it and begins where the one before ended, so the stages add up to the recovery. "
            "Prometheus's `meshpact_stage_seconds` holds these same figures; "
            "`meshpact_rank_stage_seconds` holds each rank's own."
        )
    st.markdown(f"Recording saved: `{kept}`.")
    if st.button("Replay this run", icon=":material/replay:", key="live_replay"):
        _open_in_replay(kept)
        st.switch_page("views/replay.py")


panel()
