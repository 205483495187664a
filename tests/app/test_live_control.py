"""Live control: finding, faulting and stopping a job's processes; following its recording.

The runner here is a small real process tree shaped like a live trial: it writes a
recording as it goes and starts two "rank" processes in their own sessions (as the
launcher does), which keep running until something stops them.
"""

from __future__ import annotations

import gc
import textwrap
import time

import pytest

from meshpact.app.live_control import LiveJob, job_processes, tail_events
from meshpact.core.recording import RecordingWriter, partial_path

RUNNER = textwrap.dedent("""
    import argparse, os, subprocess, sys, time
    from meshpact.core.recording import RecordingWriter
    ap = argparse.ArgumentParser()
    ap.add_argument("--record"); ap.add_argument("--result")
    a = ap.parse_args()
    w = RecordingWriter(a.record, "live", kind="test")
    for r in range(2):
        env = {**os.environ, "RANK": str(r), "MESHPACT_RUN_ID": "faulted"}
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env, start_new_session=True)
    w.emit("cluster_started", data={"ranks": 2})
    for i in range(600):
        w.emit("tick", rank=i % 2, data={"i": i})
        time.sleep(0.1)
""")


def _wait(cond, timeout=15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def job(tmp_path):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    j = LiveJob(tmp_path / "rec.jsonl", [], runner=[str(script)], world_size=2)
    yield j
    j.stop()


def test_ranks_are_found_faulted_and_everything_stops(job):
    assert _wait(lambda: len(job.ranks()) == 2), job.log_tail()
    assert job.status == "running"
    assert [(r.rank, r.phase) for r in job.ranks()] == [(0, "faulted"), (1, "faulted")]
    job.stall_rank(0, 0.4)
    assert _wait(lambda: any(r.rank == 0 and r.stalled for r in job.ranks()), 3)
    assert _wait(lambda: not any(r.stalled for r in job.ranks()), 5)
    killed = job.kill_rank(1)
    assert _wait(lambda: [r.rank for r in job.ranks()] == [0], 5)
    assert (job.injected[-1].kind.value, job.injected[-1].rank) == ("kill", 1)
    assert '"pid": %d' % killed.pid in (job.work / "injected.jsonl").read_text().splitlines()[-1]
    with pytest.raises(LookupError, match="rank 1 has no running process in the faulted run"):
        job.kill_rank(1)
    job.stop()
    assert not job.running
    assert job.status == "stopped"  # asked for, so never read as a failure whatever the exit status
    assert job.ranks() == [] and job.phases_seen == {"faulted"}  # a stopped run keeps the run its table showed
    assert _wait(lambda: not job_processes(job.token), 5)  # the rank in its own session is gone too


FORKED_RUNNER = textwrap.dedent("""
    import argparse, json, os, subprocess, sys, time
    from meshpact.core.recording import RecordingWriter
    ap = argparse.ArgumentParser()
    ap.add_argument("--record"); ap.add_argument("--result"); ap.add_argument("--work-dir")
    a = ap.parse_args()
    w = RecordingWriter(a.record, "live", kind="test")
    env = {k: v for k, v in os.environ.items() if k != "RANK"}  # as a fork server's: the token, no RANK
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env, start_new_session=True)
             for _ in range(3)]
    trial = os.path.join(a.work_dir, "trial")
    os.makedirs(trial, exist_ok=True)
    with open(os.path.join(trial, "processes.jsonl"), "a") as fh:  # the third one stays unnamed (a fork server)
        for r, p in enumerate(procs[:2]):
            fh.write(json.dumps({"pid": p.pid, "rank": r, "incarnation": r, "run_id": "faulted"}) + "\\n")
        fh.write(json.dumps({"pid": 1, "rank": 7, "incarnation": 0, "run_id": "faulted"}) + "\\n")  # no token
        fh.write('{"pid": 12, "ra')  # a line still being written
    w.emit("cluster_started", data={"ranks": 2})
    time.sleep(120)
""")


def test_ranks_forked_warm_are_named_by_the_launchers_list_and_only_with_the_token(tmp_path):
    """A forked rank's /proc environment is its fork server's: the page names it from the
    launcher's processes.jsonl, and only a process carrying the job's token is taken for one."""
    from meshpact.live.trials.trialconfig import Pace

    script = tmp_path / "forked.py"
    script.write_text(FORKED_RUNNER)
    job = LiveJob(tmp_path / "rec.jsonl", [], runner=[str(script)], world_size=2, pace=Pace())
    try:
        assert _wait(lambda: len(job.ranks()) == 2), job.log_tail()
        ranks = job.ranks()
        assert [(r.rank, r.phase, r.incarnation) for r in ranks] == [(0, "faulted", 0), (1, "faulted", 1)]
        assert all(r.pid != 1 for r in ranks)
        assert len(job_processes(job.token)) == 4  # the runner and the three children carry the token
        killed = job.kill_rank(1)
        assert _wait(lambda: [r.rank for r in job.ranks()] == [0], 5)
        assert job.injected[-1].rank == killed.rank == 1 and killed.pid == ranks[1].pid
    finally:
        job.stop()
    assert _wait(lambda: not job_processes(job.token), 5)  # the unnamed one is stopped too


def test_recording_is_followed_while_it_is_written(job):
    assert _wait(lambda: partial_path(job.recording).exists())
    events: list = []
    offset = 0

    def more() -> bool:
        nonlocal offset
        new, offset = tail_events(job.recording, offset)
        events.extend(new)
        return len(events) >= 4

    assert _wait(more)
    assert [e.event for e in events[:3]] == ["recording_start", "cluster_started", "tick"]
    assert [e.data["i"] for e in events[2:4]] == [0, 1]  # each event read once, in order
    again, _ = tail_events(job.recording, 0)
    assert again[0].event == "recording_start"


def test_dropping_the_job_with_the_session_stops_its_processes(tmp_path):
    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    j = LiveJob(tmp_path / "rec.jsonl", [], runner=[str(script)])
    token = j.token
    assert _wait(lambda: len(job_processes(token)) >= 3)
    del j
    gc.collect()
    assert _wait(lambda: not job_processes(token), 8)


def test_tail_events_leaves_an_unfinished_line_for_later(tmp_path):
    path = tmp_path / "r.jsonl"
    w = RecordingWriter(path, "live")
    w.emit("a")
    with open(partial_path(path), "a") as fh:
        fh.write('{"t": 1.0, "event": "b", "rank"')  # a writer caught mid-line
    events, offset = tail_events(path, 0)
    assert [e.event for e in events] == ["recording_start", "a"]
    with open(partial_path(path), "a") as fh:
        fh.write(': null, "stage": null, "data": {}}\n')
    more, _ = tail_events(path, offset)
    assert [e.event for e in more] == ["b"]
    w._fh.close()


FAILING_RUNNER = textwrap.dedent("""
    import argparse, json, sys
    from meshpact.core.recording import RecordingWriter
    ap = argparse.ArgumentParser()
    ap.add_argument("--record"); ap.add_argument("--result")
    a = ap.parse_args()
    w = RecordingWriter(a.record, "live", kind="test", ranks=2)
    w.emit("session_start", rank=0)
    w.emit("fault_injected", rank=1, data={"fault": "kill"})
    w.emit("detected", rank=0, stage="detection", data={"seconds": 0.5})
    json.dump({"ok": False, "error": "Traceback (most recent call last):\\n  File \\"trial.py\\", line 9\\n"
               "FileNotFoundError: no complete checkpoint at or before step 0"}, open(a.result, "w"))
    sys.exit(2)
""")


def test_failure_sentence_reads_the_reason_not_the_traceback():
    from meshpact.app.live_control import failure_sentence

    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nKeyError: 'rank'\n"
    assert failure_sentence(tb) == "'rank' (KeyError)."
    assert failure_sentence("meshpact.core.errors.LiveError: rank 1 timed out") == "Rank 1 timed out (LiveError)."
    assert failure_sentence("warming up\nthe launcher gave up") == "The launcher gave up."
    assert "without saying why" in failure_sentence("")


@pytest.mark.timeout(60)
def test_a_run_that_fails_by_itself_is_a_sentence_with_its_partial_recording(tmp_path):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    script = tmp_path / "runner.py"
    script.write_text(FAILING_RUNNER)
    job = LiveJob(tmp_path / "failed.jsonl", [], runner=[str(script)], world_size=2)
    assert _wait(lambda: not job.running)
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app" / "main.py"), default_timeout=60).run()
    at.switch_page("views/live.py").run()
    at.session_state["live_job"] = job
    at.run()
    assert not at.exception
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and "No complete checkpoint at or before step 0 (FileNotFoundError)" in errors[0]
    assert "Traceback" not in errors[0] and not at.code
    kept = [p for p in (job.recording, partial_path(job.recording)) if p.exists()]
    assert kept and str(kept[0]) in errors[0]
    start = next(b for b in at.button if "Start" in b.proto.label)
    assert not start.disabled  # the run is over: a new one can start
    assert next(b for b in at.button if b.proto.label == "Stop").disabled
    next(b for b in at.button if "Replay what it recorded" in b.proto.label).click().run()
    assert not at.exception
    assert at.title[0].value == "Replay" and at.radio(key="replay_source").value == "recording"
    assert [e.value for e in at.error] == [], [e.value for e in at.error]
    assert any(m.value.startswith("**Event 3/3:** detection rank 0") for m in at.markdown)  # that recording
    job.stop()


@pytest.mark.timeout(60)
def test_a_stopped_run_reads_stopped_never_failed(job):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    assert _wait(lambda: len(job.ranks()) == 2), job.log_tail()
    job.stop()  # SIGTERM: the runner exits with a status, which is not a failure
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app" / "main.py"), default_timeout=60).run()
    at.switch_page("views/live.py").run()
    at.session_state["live_job"] = job
    at.run()
    assert not at.exception
    assert [e.value for e in at.error] == []
    assert any(i.value.startswith("**The run was stopped.**") for i in at.info), [i.value for i in at.info]
    assert next(m for m in at.metric if m.label == "run").value == "stopped"


def test_rank_rows_follow_each_ranks_newest_incarnation_in_its_own_run():
    from meshpact.app.live_control import RankEvent, RankProcess, rank_rows
    from meshpact.core.recording import Event, EventKind
    from meshpact.core.recovery import Stage

    procs = [
        RankProcess(100, 0, "faulted", 0, False),
        RankProcess(105, 1, "faulted", 1, True),
        RankProcess(90, 2, "reference", 0, False),
    ]

    def ev(phase, inc, t, kind, rank, stage=None, **data):
        return RankEvent(phase, inc, Event(t, kind, rank, stage, data))

    events = [  # written out of order, two runs, rank 1 replaced, rank 2 not (yet) in the faulted run
        ev("faulted", 0, 12.0, EventKind.STEP, 0, step=7, generation=0, group="meshpact_data_g0", seq=41),
        ev("faulted", 0, 11.0, EventKind.STEP, 0, step=6, generation=0, group="meshpact_data_g0", seq=35),
        ev("faulted", 0, 13.0, EventKind.DETECTED, 0, Stage.DETECTION, step=7, generation=0),
        ev("faulted", 0, 10.0, EventKind.STEP, 1, step=6, generation=0, group="meshpact_data_g0", seq=35),
        ev("faulted", 1, 14.0, EventKind.SESSION_START, 1, incarnation=1),
        ev("reference", 0, 5.0, EventKind.STEP, 2, step=39, generation=0, group="meshpact_data_g0", seq=240),
        ev("faulted", 0, 9.0, EventKind.HELD, 3, step=0),
    ]
    rows = rank_rows(procs, events, "faulted", now=15.0, world_size=4)
    got = [
        (r.rank, r.pid, r.incarnation, r.state, r.step, r.generation, r.collective, r.last_event, r.silent_s)
        for r in rows
    ]
    assert got == [
        (0, 100, 0, "recovering: detection", 7, 0, "meshpact_data_g0 #41", "detected", 2.0),
        (1, 105, 1, "stalled", None, None, "", "session_start", 1.0),  # the replacement: its own log only
        (2, None, 0, "—", None, None, "", "", None),  # its reference step is not the faulted run's
        (3, None, 0, "dead", 0, None, "", "held", 6.0),  # held, then its process went away
    ]
    assert [r.can_fault for r in rows] == [False, False, False, False]
    held = rank_rows([RankProcess(7, 3, "faulted", 0, False)], events, "faulted", now=15.0, world_size=4)
    assert [r.can_fault for r in held] == [False, False, False, True]
    assert [r.step for r in rank_rows(procs, events, "reference", 15.0, 4)] == [None, None, 39, None]


def test_rank_logs_are_followed_per_file_a_line_at_a_time(tmp_path):
    import json

    from meshpact.app.live_control import RankLogs

    (tmp_path / "faulted").mkdir()
    (tmp_path / "reference").mkdir()
    a, b = tmp_path / "faulted" / "events-rank0-0.jsonl", tmp_path / "faulted" / "events-rank0-1.jsonl"

    def line(t, kind):
        return json.dumps({"t": t, "event": kind, "rank": 0, "stage": None, "data": {}}) + "\n"

    a.write_text(line(1.0, "session_start") + line(2.0, "step")[:-9])  # the second line not yet ended
    (tmp_path / "reference" / "events-rank0-0.jsonl").write_text(line(0.5, "step"))
    logs = RankLogs(tmp_path)
    first = logs.poll()
    assert sorted((e.phase, e.incarnation, e.event.event) for e in first) == [
        ("faulted", 0, "session_start"),
        ("reference", 0, "step"),
    ]
    with open(a, "a") as fh:
        fh.write(line(2.0, "step")[-9:])
    b.write_text(line(3.0, "session_start"))
    assert [(e.incarnation, e.event.event, e.event.t) for e in logs.poll()] == [
        (0, "step", 2.0),
        (1, "session_start", 3.0),
    ]
    assert logs.poll() == []


@pytest.mark.timeout(60)
def test_the_live_page_serves_prometheus_metrics_only_when_asked(tmp_path):
    import urllib.request
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    script = tmp_path / "runner.py"
    script.write_text(FAILING_RUNNER)
    job = LiveJob(tmp_path / "m.jsonl", [], runner=[str(script)], world_size=2)
    assert _wait(lambda: not job.running)
    at = AppTest.from_file(str(Path(__file__).resolve().parents[2] / "app" / "main.py"), default_timeout=60).run()
    at.switch_page("views/live.py").run()
    at.session_state["live_job"] = job
    at.run()
    assert at.toggle(key="live_metrics_on").value is False  # off by default
    assert "live_metrics_endpoint" not in at.session_state
    at.toggle(key="live_metrics_on").set_value(True).run()
    endpoint = at.session_state["live_metrics_endpoint"]
    assert endpoint.addr == "127.0.0.1" and any(endpoint.url in c.value for c in at.caption)
    with urllib.request.urlopen(endpoint.url, timeout=5) as r:
        text = r.read().decode()
    assert 'meshpact_rank_stage_seconds_count{stage="detection"} 1.0' in text
    at.toggle(key="live_metrics_on").set_value(False).run()
    assert "live_metrics_endpoint" not in at.session_state
    with pytest.raises(OSError):
        urllib.request.urlopen(endpoint.url, timeout=2)
    job.stop()


def test_pace_round_trips_and_refuses_what_a_rank_could_not_keep(tmp_path):
    from meshpact.core.errors import MeshpactError
    from meshpact.live.trials.trialconfig import Pace

    assert Pace.read(tmp_path) is None  # no file: full speed, as before
    Pace(2.5, frozenset({"faulted", "cold"})).write(tmp_path)
    assert Pace.read(tmp_path) == Pace(2.5, frozenset({"cold", "faulted"}))
    with pytest.raises(MeshpactError, match="cannot hold warmup; the runs are reference, faulted, cold"):
        Pace(None, frozenset({"warmup"}))
    with pytest.raises(MeshpactError, match="steps per second must be above 0"):
        Pace(0.0)
    (tmp_path / "pace.json").write_text("{not json")
    with pytest.raises(MeshpactError, match="unreadable pace"):
        Pace.read(tmp_path)


def test_a_held_rank_waits_records_it_once_and_goes_when_released(tmp_path):
    import threading

    from meshpact.live.trials.rankworker import keep_pace
    from meshpact.live.trials.trialconfig import Pace

    Pace(None, frozenset({"faulted"})).write(tmp_path)
    seen: list = []
    release = threading.Timer(0.6, lambda: Pace(4.0).write(tmp_path))
    release.start()
    t0 = time.monotonic()
    start = keep_pace(tmp_path, "faulted", 3, t0, 0.5, lambda kind, **data: seen.append((str(kind), data)))
    assert start - t0 >= 0.55 and seen == [("held", {"step": 3})]
    # released at 4 steps/s: the next step starts a period (0.25 s) after this one, not before
    nxt = keep_pace(tmp_path, "faulted", 4, start, 0.5, lambda *a, **k: seen.append(a))
    assert nxt - start >= 0.24 and len(seen) == 1
    # a slow pace is capped below the data-path timeout; another run is never held
    Pace(0.1, frozenset({"faulted"})).write(tmp_path)
    t1 = time.monotonic()
    assert keep_pace(tmp_path, "cold", 0, t1, 0.3, lambda *a, **k: seen.append(a)) - t1 < 0.5 and len(seen) == 1


def test_a_held_rank_leaves_the_hold_for_one_step_once_a_peer_is_gone_for_good(tmp_path):
    """An excising job's held survivors: a killed peer gets no replacement, so no recovery round opens for
    them to join; once the launcher marks it gone the rank runs the step (its collectives meet the loss) and
    the next step holds again."""
    import threading

    from meshpact.live.trials.rankworker import keep_pace
    from meshpact.live.trials.trialconfig import Pace

    Pace(None, frozenset({"faulted"})).write(tmp_path)
    marked = threading.Event()
    threading.Timer(0.4, marked.set).start()
    seen: list = []
    t0 = time.monotonic()
    keep_pace(tmp_path, "faulted", 0, t0, 0.5, lambda kind, **data: seen.append(str(kind)), lambda: None, marked.is_set)
    assert 0.35 <= time.monotonic() - t0 < 3.0 and seen == ["held"]  # held, then left while the pace still holds
    assert Pace.read(tmp_path).holds("faulted")


def test_the_faults_sent_from_the_page_read_on_the_event_streams_clock():
    from meshpact.app.live_control import FaultFromPage, SentFault, sent_caption

    wall0 = 1_000_000.0  # the recording began here; the job started 1.6 s earlier
    line = sent_caption(
        [SentFault(FaultFromPage.KILL, 3, wall0 + 29.39), SentFault(FaultFromPage.STALL, 1, wall0 + 61.0)], wall0
    )
    assert line == "Sent from this page: kill rank 3 at 0:00:29.4; stall rank 1 at 0:01:01.0"


def test_every_cell_of_the_event_table_is_filled_the_trials_own_first_events_included():
    from meshpact.app.live_control import RankEvent, job_stream, stream_rows
    from meshpact.core.recording import Event, EventKind

    wall0 = 500.0
    parent = [Event(0.0, EventKind.RECORDING_START, data={"wall_time": wall0})]
    ranked = [RankEvent("reference", 0, Event(wall0 + 1.5, EventKind.STEP, 0, data={"step": 0}))]
    rows = stream_rows(job_stream(ranked, parent, wall0))
    assert rows == [
        {"time": "0:00:00.0", "run": "trial", "event": "recording_start", "rank": "", "stage": "", "step": ""},
        {"time": "0:00:01.5", "run": "reference", "event": "step", "rank": "0", "stage": "", "step": "0"},
    ]


def test_faults_sent_from_the_page_land_in_the_recording_and_its_summary(tmp_path):
    import json

    from meshpact.app.live_job import add_injected, injected_faults
    from meshpact.core.recording import EventKind, read_recording

    path = tmp_path / "r.jsonl"
    with RecordingWriter(path, "live", ranks=4) as w:
        wall0 = json.loads(open(partial_path(path)).readline())["data"]["wall_time"]
        w.emit(EventKind.DETECTED, rank=0, stage="detection", t=2.0)
        w.emit(EventKind.SUMMARY, data={"faults_injected": 2, "bit_identical": True}, t=9.0)
    (tmp_path / "injected.jsonl").write_text(
        json.dumps({"t_wall": wall0 + 1.5, "kind": "kill", "rank": 3, "pid": 42})
        + "\n"
        + json.dumps({"t_wall": wall0 + 4.0, "kind": "stall", "rank": 1, "pid": 43, "seconds": 3.0})
        + "\n"
        + '{"t_wall": 1'
    )  # a line torn by a crash is left out
    faults = injected_faults(tmp_path)
    assert [f["rank"] for f in faults] == [3, 1]
    assert add_injected(path, faults) == 2
    events = read_recording(path)
    added = [e for e in events if e.event == EventKind.FAULT_INJECTED]
    assert [(e.rank, e.data["kind"], e.data["source"], round(e.t, 3)) for e in added] == [
        (3, "kill", "dashboard", 1.5),
        (1, "stall", "dashboard", 4.0),
    ]
    summary = events[-1]
    assert summary.event == EventKind.SUMMARY
    assert summary.data["faults_injected"] == 4 and summary.data["faults_from_page"] == 2
    assert add_injected(tmp_path / "missing.jsonl", faults) == 0


def test_partition_is_refused_with_the_reason_when_ranks_share_one_network(job):
    assert _wait(lambda: len(job.ranks()) == 2), job.log_tail()
    why = job.partition_why_not(0)
    assert why is not None and "network namespaces" in why
    with pytest.raises(LookupError, match="network namespaces"):
        job.partition_rank(0, 1.0)
    assert job.injected == [] and not (job.work / "injected.jsonl").exists()  # nothing sent, nothing recorded
    assert "no running process" in job.partition_why_not(5)


def test_a_rank_the_survivors_excised_reads_excised_not_gone_and_only_in_that_run():
    from meshpact.app.live_control import RankEvent, RankProcess, rank_rows
    from meshpact.core.recording import Event, EventKind
    from meshpact.core.recovery import Stage

    def ev(phase, t, kind, rank, stage=None, **data):
        return RankEvent(phase, 0, Event(t, kind, rank, stage, data))

    procs = [RankProcess(100 + r, r, "faulted", 0, False) for r in (0, 2)]
    events = [ev("faulted", 1.0, EventKind.STEP, r, step=3, generation=0) for r in range(4)] + [
        # ranks 1 and 3 killed; the survivors decided to go on without them (an in-memory round decides nothing)
        ev("faulted", 2.0, EventKind.DECIDED, 0, Stage.CONSENSUS, policy="excise", lost=[1, 3], round=1),
        ev("faulted", 2.1, EventKind.DECIDED, 2, Stage.CONSENSUS, policy="excise", lost=[1, 3], round=1),
        ev("faulted", 3.0, EventKind.DECIDED, 0, Stage.CONSENSUS, policy="in_memory", lost=[], round=2),
        ev("reference", 0.5, EventKind.DECIDED, 1, Stage.CONSENSUS, policy="excise", lost=[2], round=1),
    ]
    states = [r.state for r in rank_rows(procs, events, "faulted", now=4.0, world_size=4)]
    assert states[1] == states[3] == "excised"
    assert states[0] != "excised" and states[2] != "excised"  # alive: a process, whatever the decision says
    # a rank that died without an excision decision (a replacement is coming) is dead, not excised
    only_kill = [e for e in events if e.event.event != EventKind.DECIDED]
    assert [r.state for r in rank_rows(procs, only_kill, "faulted", 4.0, 4)][1] == "dead"


def test_the_start_form_is_checked_in_the_pages_own_words():
    from meshpact.app.live_control import form_problem

    assert form_problem(4, 0, "kill", "excise") is None and form_problem(4, 2, "collective", "replace") is None
    wrong_kind = form_problem(4, 1, "collective", "excise")
    assert "planned fault kind" in wrong_kind and "kill" in wrong_kind and "--" not in wrong_kind
    too_many = form_problem(4, 4, "kill", "excise")
    assert "at most 3 **planned faults**" in too_many and "--" not in too_many


def test_the_excise_form_starts_from_its_own_defaults():
    """The form's defaults (4 ranks, 40 steps, no planned fault, kind collective) with excise picked
    pass the page's check and the trial's own: with no planned fault the kind plays no part."""
    from meshpact.app.live_control import form_problem, planned_fault_kind
    from meshpact.live.trials.trialconfig import TrialConfig

    assert form_problem(4, 0, "collective", "excise") is None
    kind = planned_fault_kind(0, "collective", "excise")
    TrialConfig(ranks=4, steps=40, faults=0, fault_kind=kind, checkpoint_every=10, on_rank_loss="excise")
    assert planned_fault_kind(2, "collective", "replace") == "collective"
    assert planned_fault_kind(1, "stall", "excise") == "stall"  # refused by form_problem, never rewritten


# --- the page's figures from the run's records -------------------------------------------------------------------


def _rank_ev(phase, inc, t, kind, rank, stage=None, **data):
    from meshpact.app.live_control import RankEvent
    from meshpact.core.recording import Event

    return RankEvent(phase, inc, Event(t, kind, rank, stage, data))


def test_an_excise_run_counts_the_survivors_step_and_marks_only_the_excised_rank():
    """Rank 3 killed while held at step 0; the survivors excise it and train to step 12: the
    committed step is theirs (12, not the dead rank's 0) and only rank 3 is drawn failed."""
    from meshpact.app.live_control import RankProcess, committed_step, down_ranks, rank_rows
    from meshpact.core.recording import EventKind
    from meshpact.core.recovery import Stage

    events = [_rank_ev("faulted", 0, 1.0, EventKind.HELD, r, step=0, generation=0) for r in range(4)]
    recovering = events + [
        _rank_ev("faulted", 0, 2.0, EventKind.DETECTED, r, Stage.DETECTION, step=0) for r in range(3)
    ]
    alive = [RankProcess(100 + r, r, "faulted", 0, False) for r in range(3)]
    rows = rank_rows(alive, recovering, "faulted", now=3.0, world_size=4, steps=12)
    assert [r.state for r in rows] == ["recovering: detection"] * 3 + ["dead"]
    assert down_ranks(rows) == [3]  # the survivors recovering are not failed
    decided = recovering + [
        _rank_ev("faulted", 0, 3.0, EventKind.DECIDED, r, Stage.CONSENSUS, policy="excise", lost=[3], round=1, step=0)
        for r in range(3)
    ]
    trained = decided + [
        _rank_ev("faulted", 0, 4.0 + s, EventKind.STEP, r, step=s, generation=1) for s in range(1, 13) for r in range(3)
    ]
    rows = rank_rows(alive, trained, "faulted", now=20.0, world_size=4, steps=12)
    assert [r.state for r in rows] == ["training"] * 3 + ["excised"]
    assert committed_step(rows) == 12 and down_ranks(rows) == [3]
    ended = rank_rows([], trained, "faulted", now=30.0, world_size=4, steps=12)  # every process exited
    assert [r.state for r in ended] == ["done"] * 3 + ["excised"]
    assert committed_step(ended) == 12 and down_ranks(ended) == [3]


def test_a_clean_finish_marks_no_rank_failed_and_a_replaced_rank_reads_its_replacement():
    from meshpact.app.live_control import RankProcess, committed_step, down_ranks, rank_rows
    from meshpact.core.recording import EventKind

    events = [
        _rank_ev("faulted", 0, 1.0 + s, EventKind.STEP, r, step=s, generation=0) for s in range(1, 5) for r in range(4)
    ]
    # rank 2 killed at step 4; its replacement (incarnation 1) restored and went on to the last step
    events += [_rank_ev("faulted", 1, 9.0, EventKind.SESSION_START, 2, incarnation=1)]
    procs = [RankProcess(100 + r, r, "faulted", 0, False) for r in (0, 1, 3)]
    waiting = rank_rows(
        procs + [RankProcess(200, 2, "faulted", 1, False)], events, "faulted", now=9.5, world_size=4, steps=8
    )
    assert [r.state for r in waiting][2] == "starting" and down_ranks(waiting) == []
    lost = rank_rows(procs, [e for e in events if e.incarnation == 0], "faulted", now=9.5, world_size=4, steps=8)
    assert lost[2].state == "dead" and down_ranks(lost) == [2] and committed_step(lost) == 4
    events += [
        _rank_ev("faulted", 1 if r == 2 else 0, 10.0 + s, EventKind.STEP, r, step=s, generation=1)
        for s in range(5, 9)
        for r in range(4)
    ]
    done = rank_rows([], events, "faulted", now=30.0, world_size=4, steps=8)
    assert [r.state for r in done] == ["done"] * 4 and down_ranks(done) == []
    assert committed_step(done) == 8 and done[2].incarnation == 1
    # a run stopped early: without its last step and without a good end, a rank with no process is dead
    early = [e for e in events if e.event.data.get("step", 0) < 6]
    assert [r.state for r in rank_rows([], early, "faulted", 30.0, 4, steps=8)] == ["dead"] * 4
    assert [r.state for r in rank_rows([], early, "faulted", 30.0, 4, steps=8, finished=True)] == ["done"] * 4


def test_the_generation_is_the_one_a_rank_trains_in_not_the_checkpoint_baselines_drill_after_the_last_step():
    from meshpact.app.live_control import rank_rows
    from meshpact.core.recording import EventKind
    from meshpact.core.recovery import Stage

    events = [
        _rank_ev("faulted", 0, 1.0 + s, EventKind.STEP, r, step=s, generation=0 if s < 3 else 1)
        for s in range(1, 9)
        for r in range(2)
    ]
    # the in-job checkpoint baseline: a drill's recovery after the last step builds generation 2
    events += [
        _rank_ev("faulted", 0, 20.0, EventKind.DECIDED, r, Stage.CONSENSUS, policy="checkpoint_restore", generation=2)
        for r in range(2)
    ]
    rows = rank_rows([], events, "faulted", now=30.0, world_size=2, steps=8)
    assert [r.generation for r in rows] == [1, 1] and [r.state for r in rows] == ["done", "done"]


def test_a_run_stopped_from_the_page_reads_stopped_with_each_ranks_last_step_never_as_lost():
    from meshpact.app.live_control import RankProcess, committed_step, down_ranks, rank_rows
    from meshpact.core.recording import EventKind

    events = [
        _rank_ev("faulted", 0, 1.0 + s, EventKind.STEP, r, step=s, generation=0)
        for s in range(1, 8)
        for r in range(4)
        if not (r == 3 and s == 7)
    ]  # rank 3 one step behind
    events += [_rank_ev("faulted", 0, 0.5, EventKind.DECIDED, 0, policy="excise", lost=[2])]
    stopped = rank_rows([], events, "faulted", now=30.0, world_size=4, steps=40, stopped=True)
    assert [r.state for r in stopped] == ["stopped", "stopped", "excised", "stopped"]
    assert [r.step for r in stopped] == [7, 7, 7, 6]
    assert down_ranks(stopped) == [2]  # the excised rank only: a stop loses no rank
    assert committed_step(stopped) == 6  # the least over the ranks still in the job
    # a stalled rank (SIGSTOPped from the page) is marked failed while it lasts; the stop leaves it stopped
    stalled = rank_rows(
        [RankProcess(100 + r, r, "faulted", 0, r == 1) for r in (0, 1, 3)],
        events,
        "faulted",
        now=9.0,
        world_size=4,
        steps=40,
    )
    assert [r.state for r in stalled] == ["training", "stalled", "excised", "training"]
    assert down_ranks(stalled) == [1, 2]


def _recording_line(t, event, rank=None, stage=None, **data):
    import json

    return json.dumps({"t": t, "event": event, "rank": rank, "stage": stage, "data": data}) + "\n"


def test_the_event_count_never_drops_when_the_run_ends_and_every_row_names_its_run(tmp_path):
    """While the run goes the stream is the rank logs and the parent's own events; the finished
    recording adds copies of the rank logs, which are not counted again."""
    import json
    import os

    from meshpact.app.live_control import JobEvents, job_stream

    rec, trial = tmp_path / "live.jsonl", tmp_path / "trial"
    for phase in ("reference", "faulted"):
        (trial / phase).mkdir(parents=True)
    wall0 = 1000.0
    partial = partial_path(rec)
    partial.write_text(_recording_line(0.0, "recording_start", wall_time=wall0))
    logs = {
        ("reference", 0): [(1.0, "session_start"), (2.0, "step")],
        ("faulted", 0): [(3.0, "session_start"), (4.0, "step")],
        ("faulted", 1): [(3.1, "session_start"), (4.1, "detected")],
    }
    for (phase, rank), evs in logs.items():
        (trial / phase / f"events-rank{rank}-0.jsonl").write_text(
            "".join(_recording_line(wall0 + t, kind, rank) for t, kind in evs)
        )
    with open(partial, "a") as fh:
        fh.write(_recording_line(4.5, "replacement_started", 1, "restart", returncode=-9))
    events = JobEvents(rec, trial)
    events.poll()
    running = job_stream(events.rank_events, events.parent_events, events.wall0)
    assert len(running) == 8
    assert [(e.run, str(e.event.event)) for e in running][-2:] == [
        ("faulted", "detected"),
        ("faulted", "replacement_started"),
    ]
    assert all(e.run for e in running[1:])  # only the recording's start precedes every run
    # the run ends: the parent copies the faulted run's rank logs into the recording, adds its own, renames it
    with open(partial, "a") as fh:
        for (phase, rank), evs in logs.items():
            if phase == "faulted":
                fh.writelines(_recording_line(t, kind, rank) for t, kind in evs)
        fh.write(_recording_line(5.0, "recovered", step=1))
        fh.write(_recording_line(5.0, "summary", faults_injected=0))
    os.replace(partial, rec)
    _, new = events.poll()
    assert [str(e.event) for e in new] == ["recovered", "summary"]
    ended = job_stream(events.rank_events, events.parent_events, events.wall0)
    assert len(ended) == 10 and all(e.run for e in ended[1:])
    # the finished recording rewritten with a fault sent from the page: only that one is new
    lines = rec.read_text().splitlines(keepends=True)
    lines.insert(-2, _recording_line(3.5, "fault_injected", 1, kind="kill", phase="faulted", source="dashboard"))
    rec.write_text("".join(lines))
    os.utime(rec, ns=(rec.stat().st_atime_ns, rec.stat().st_mtime_ns + 1_000_000))
    _, new = events.poll()
    assert [str(e.event) for e in new] == ["fault_injected"]
    assert len(job_stream(events.rank_events, events.parent_events, events.wall0)) == 11
    assert json.loads(rec.read_text().splitlines()[0])["event"] == "recording_start"


def _recovery_done(rank, t_detect, t_resumed, step, generation, policy="peer_restore"):
    return {
        "step": step,
        "t_detect_wall": t_detect,
        "t_first_collective_wall": t_resumed - 0.1,
        "t_resumed_wall": t_resumed,
        "policy": policy,
        "reason": "rank lost",
        "generation": generation,
        "lost_steps": 0,
        "rebind_s": 0.001,
        "action": "rebuild",
        "drill": False,
    }


def test_a_fault_sent_from_the_page_gets_its_recovery_s_downtime_in_the_trials_own_summary():
    """The trial knows only its planned faults; a kill sent from the page is handed to its analysis
    as the fault of the next recovery detected after it, so downtime and recovered faults count it."""
    from meshpact.app.live_job import attribute_page_faults
    from meshpact.core.recording import Event, EventKind
    from meshpact.live.recovery.faults import Fault, FaultKind
    from meshpact.live.trials.analysis import TrialResult
    from meshpact.live.trials.outcome import FaultRecord
    from meshpact.live.trials.trialconfig import TrialConfig

    cfg = TrialConfig(ranks=3, steps=12, faults=1, fault_kind="kill", baselines=False, on_rank_loss="excise")
    events = []
    for gen, (t_detect, t_resumed, step) in enumerate([(100.4, 101.5, 0), (110.2, 111.0, 6)], start=1):
        for r in (0, 1):
            events.append(Event(t_detect + 0.05 * r, EventKind.DETECTED, r, None, {}))
            events.append(
                Event(
                    t_resumed,
                    EventKind.RECOVERY_DONE,
                    r,
                    None,
                    _recovery_done(r, t_detect + 0.05 * r, t_resumed, step, gen, "excise"),
                )
            )
    planned = (Fault(0, FaultKind.KILL, 6, 2),)
    result = TrialResult(
        cfg, planned, [], [], None, {0: FaultRecord(2, 6, "kill", 110.0)}, True, [], 0, "", faulted_events=events
    )
    assert result.recoveries()[0]["downtime_s"] is None  # the page's kill is unknown to the trial
    assert result.summary()["faults_recovered"] == 1
    page = [
        {"t_wall": 100.0, "kind": "kill", "rank": 1, "phase": "faulted"},
        {"t_wall": 120.0, "kind": "stall", "rank": 0, "phase": "faulted"},
    ]  # no recovery followed this one
    assert attribute_page_faults(result, page) == 1
    recs = result.recoveries()
    assert abs(recs[0]["downtime_s"] - 1.5) < 1e-9 and abs(recs[0]["stages_s"]["detection"] - 0.45) < 1e-9
    assert abs(recs[1]["downtime_s"] - 1.0) < 1e-9  # the planned fault keeps its own recovery
    summary = result.summary()
    assert summary["faults_recovered"] == 2 and summary["faults_injected"] == 2
    assert abs(summary["downtime_s"]["excise"] - 1.25) < 1e-9  # the median of both


def _zombies_of(parent: int) -> list[int]:
    from pathlib import Path

    out = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[1]) == parent:
            out.append(int(entry.name))
    return out


def test_closing_the_session_ends_the_job_and_reaps_the_runner(tmp_path):
    """The session watcher: once the browser session says it is gone (past the grace), the
    runner and every process carrying the token stop, and the runner is reaped (no zombie)."""
    import os
    import threading

    script = tmp_path / "runner.py"
    script.write_text(RUNNER)
    connected = threading.Event()
    connected.set()
    job = LiveJob(
        tmp_path / "rec.jsonl", [], runner=[str(script)], world_size=2, session_alive=connected.is_set, grace_s=0.5
    )
    try:
        assert _wait(lambda: len(job.ranks()) == 2), job.log_tail()
        time.sleep(1.0)
        assert job.running  # connected: nothing stops it
        pids = [job.proc.pid] + [r.pid for r in job.ranks()]
        connected.clear()
        t0 = time.monotonic()
        assert _wait(lambda: not job_processes(job.token), 10)
        assert time.monotonic() - t0 < 8
        job.watcher.join(5)
        assert not job.watcher.is_alive()
        with pytest.raises(FileNotFoundError):  # the runner reaped: no zombie under this process
            open(f"/proc/{pids[0]}/stat").read()
        assert not _zombies_of(os.getpid())
    finally:
        job.stop()


LEASED_RUNNER = textwrap.dedent("""
    import argparse, os, subprocess, sys, time
    from meshpact.app.live_job import stop_when_parent_goes
    ap = argparse.ArgumentParser()
    ap.add_argument("--record"); ap.add_argument("--result")
    a = ap.parse_args()
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
    def end(signum, frame):  # as the launcher's clean-up does
        rank.kill(); rank.wait(); sys.exit(128 + signum)
    import signal; signal.signal(signal.SIGTERM, end)
    if os.environ.get("MESHPACT_DASHBOARD_LEASE") == "stdin":
        stop_when_parent_goes(sys.stdin.fileno())
    print("RANK", rank.pid, flush=True)
    time.sleep(120)
""")

DASHBOARD = textwrap.dedent("""
    import sys, time
    from meshpact.app.live_control import LiveJob
    job = LiveJob(sys.argv[1], [], runner=[sys.argv[2]], world_size=1)
    print(job.token, job.work, flush=True)
    time.sleep(120)
""")


def test_a_runner_ends_what_it_started_when_the_dashboard_process_dies(tmp_path):
    """The app's process killed outright (no finalizer, no watcher runs): the runner's lease ends,
    and the runner stops its ranks itself."""
    import os
    import shutil
    import signal
    import subprocess
    import sys

    (tmp_path / "runner.py").write_text(LEASED_RUNNER)
    (tmp_path / "dash.py").write_text(DASHBOARD)
    dash = subprocess.Popen(
        [sys.executable, str(tmp_path / "dash.py"), str(tmp_path / "r.jsonl"), str(tmp_path / "runner.py")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        token, work = dash.stdout.readline().split()
        assert _wait(lambda: len(job_processes(token)) == 2), "the runner and its rank"
        dash.kill()
        dash.wait()
        assert _wait(lambda: not job_processes(token), 10), job_processes(token)
    finally:
        if dash.poll() is None:
            dash.kill()
        for pid, _ in job_processes(token if "token" in locals() else "-"):
            os.kill(pid, signal.SIGKILL)
        if "work" in locals():  # the job's scratch directory, which the killed process could not remove
            shutil.rmtree(work, ignore_errors=True)


def test_a_reloaded_live_page_says_what_became_of_the_run_its_tab_started(tmp_path):
    from meshpact.app.live_control import earlier_run_notice

    name = "live-20261206-230931"
    assert earlier_run_notice(None, tmp_path) is None
    assert earlier_run_notice("../../etc/passwd", tmp_path) is None and earlier_run_notice("live-x", tmp_path) is None
    assert "It had recorded nothing yet" in earlier_run_notice(name, tmp_path)
    partial_path(tmp_path / f"{name}.jsonl").write_text('{"event": "recording_start"}\n')
    said = earlier_run_notice(name, tmp_path)
    assert "was stopped when the page was reloaded" in said and f"{name}.jsonl.partial" in said
    (tmp_path / f"{name}.jsonl").write_text('{"event": "recording_start"}\n{"event": "summary"}\n')
    assert "has finished" in earlier_run_notice(name, tmp_path)


def test_runs_started_in_the_same_second_get_recordings_of_their_own(tmp_path):
    """Two tabs (or two servers sharing the folder) starting runs in one second: each claims a name
    of its own at once, and a reloaded page still knows either by its link."""
    import threading

    from meshpact.app.live_control import claim_recording, earlier_run_notice

    now = 1796659200.0
    claimed: list[object] = []
    threads = [threading.Thread(target=lambda: claimed.append(claim_recording(tmp_path, now))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({str(p) for p in claimed}) == 8  # no name given twice
    assert all(partial_path(p).is_file() for p in claimed)  # each claimed on disk before its run writes
    second = sorted(p.stem for p in claimed)[1]
    assert second.endswith("-2") and earlier_run_notice(second, tmp_path) is not None
    first = sorted(p.stem for p in claimed)[0]
    assert claim_recording(tmp_path, now).name == f"{first}-9.jsonl"  # the next takes the next count
