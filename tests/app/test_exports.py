"""Recordings as Perfetto traces: a track per rank, stages as slices that end at their event."""

from __future__ import annotations

import json
from importlib import resources

import pytest

from meshpact.app.exports import perfetto_json, perfetto_trace
from meshpact.core.recording import Event, read_recording
from meshpact.core.recovery import Stage


def test_stages_become_slices_on_their_rank_track_and_the_rest_instants():
    events = [
        Event(0.0, "recording_start", data={"source": "live", "ranks": 3}),
        Event(2.0, "fault_injected", rank=2, data={"fault": "kill"}),
        Event(2.5, "detected", rank=0, stage=Stage.DETECTION, data={"seconds": 0.5}),
        Event(2.75, "detected", rank=2, stage=Stage.DETECTION, data={"seconds": 0.25}),
        Event(4.0, "decided", rank=0, stage=Stage.CONSENSUS, data={"seconds": 1.5, "policy": "in_memory"}),
        Event(5.0, "summary", data={"ok": True}),
    ]
    trace = perfetto_trace(events)
    names = {(e["tid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {(0, "job"), (1, "rank 0"), (3, "rank 2")}  # a track per rank that appears, and the job
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(s["tid"], s["name"], s["ts"], s["dur"]) for s in slices] == [
        (1, "detection", 2.0e6, 0.5e6),
        (3, "detection", 2.5e6, 0.25e6),
        (1, "consensus", 2.5e6, 1.5e6),
    ]
    assert slices[2]["args"]["policy"] == "in_memory"
    instants = {(e["tid"], e["name"]) for e in trace["traceEvents"] if e["ph"] == "i"}
    assert instants == {(0, "recording_start"), (3, "fault_injected"), (0, "summary")}


def test_steps_of_a_paced_run_are_training_slices_named_for_the_step_they_ran():
    from meshpact.core.recording import EventKind

    events = [
        Event(3.0, EventKind.STEP, rank=1, data={"step": 7, "seconds": 0.5, "seq": 41}),
        Event(3.2, EventKind.STEP, rank=1, data={"step": 8, "seconds": 4.0}),  # longer than the recording so far
        Event(3.3, EventKind.HELD, rank=1, data={"step": 8}),
    ]
    trace = perfetto_trace(events)["traceEvents"]
    steps = [(e["name"], e["cat"], e["ts"], e["dur"]) for e in trace if e["ph"] == "X"]
    assert steps == [("step 6", "training", 2.5e6, 0.5e6), ("step 7", "training", 0.0, 3.2e6)]
    assert [e["name"] for e in trace if e["ph"] == "i"] == ["held"]


def test_a_stage_without_a_duration_is_a_zero_length_slice_not_a_negative_one():
    trace = perfetto_trace(
        [
            Event(1.0, "rebuilt", rank=0, stage=Stage.COMMUNICATOR, data={"seconds": "bad"}),
            Event(0.1, "x", rank=0, stage=Stage.STATE, data={"seconds": 5.0}),
        ]
    )
    for s in (e for e in trace["traceEvents"] if e["ph"] == "X"):
        assert s["ts"] >= 0 and s["dur"] >= 0


def test_the_shipped_live_recording_exports_as_json_perfetto_reads():
    path = resources.files("meshpact.scenarios").joinpath("recordings/live-trial-2-ranks.jsonl")
    events = read_recording(str(path))
    doc = json.loads(perfetto_json(events))
    slices = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    stage_events = [e for e in events if e.stage is not None]
    assert len(slices) == len(stage_events) > 0
    assert {s["tid"] for s in slices} == {e.rank + 1 for e in stage_events}
    assert sum(s["dur"] for s in slices) == pytest.approx(sum(e.data["seconds"] for e in stage_events) * 1e6, rel=1e-6)
