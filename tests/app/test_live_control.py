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
