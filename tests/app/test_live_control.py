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
    assert [(r.rank, r.phase) for r in job.ranks()] == [(0, "faulted"), (1, "faulted")]
    job.stall_rank(0, 0.4)
    assert _wait(lambda: any(r.rank == 0 and r.stopped for r in job.ranks()), 3)
    assert _wait(lambda: not any(r.stopped for r in job.ranks()), 5)
    killed = job.kill_rank(1)
    assert _wait(lambda: [r.rank for r in job.ranks()] == [0], 5)
    assert job.injected[-1] == {**job.injected[-1], "kind": "kill", "rank": 1, "pid": killed.pid}
    with pytest.raises(LookupError, match="rank 1 has no running process in the faulted run"):
        job.kill_rank(1)
    job.stop()
    assert not job.running
    assert _wait(lambda: not job_processes(job.token), 5)  # the rank in its own session is gone too


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

    tb = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\nKeyError: \'rank\'\n'
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


def test_rank_rows_take_the_newest_incarnation_and_the_last_event_of_each_rank():
    from meshpact.app.live_control import RankProcess, rank_rows
    from meshpact.core.recording import Event

    procs = [RankProcess(100, 0, "faulted", 0, False), RankProcess(101, 1, "faulted", 0, False),
             RankProcess(105, 1, "faulted", 1, True), RankProcess(90, 0, "reference", 0, False)]
    events = [Event(1.0, "session_start", rank=0), Event(3.0, "detected", rank=0), Event(2.0, "checkpoint", rank=0),
              Event(4.0, "replacement_started", rank=1), Event(5.0, "summary")]
    rows = rank_rows(procs, events, "faulted")
    assert [(r.rank, r.pid, r.incarnation, r.state, r.last_event, r.last_event_t) for r in rows] == [
        (0, 100, 0, "running", "detected", 3.0), (1, 105, 1, "stopped", "replacement_started", 4.0)]
    assert [r.pid for r in rank_rows(procs, [], "reference")] == [90]
    assert rank_rows(procs, events, "cold") == []


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
    assert 'meshpact_stage_seconds_count{stage="detection"} 1.0' in text
    at.toggle(key="live_metrics_on").set_value(False).run()
    assert "live_metrics_endpoint" not in at.session_state
    with pytest.raises(OSError):
        urllib.request.urlopen(endpoint.url, timeout=2)
    job.stop()
