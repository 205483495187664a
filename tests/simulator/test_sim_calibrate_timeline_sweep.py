"""Calibration from recordings, Chrome trace export and sweeps."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from meshpact.core.errors import MeshpactError, RecordingError, ScenarioError
from meshpact.core.recording import RecordingWriter
from meshpact.core.recovery import Policy, Stage
from meshpact.core.recovery_costs import estimate_recovery
from meshpact.simulator.calibrate import calibration_from_recording
from meshpact.simulator.sweep import parse_param, run_sweep, save_frame
from meshpact.simulator.timeline import chrome_trace
from meshpact.simulator.training import simulate_training


def _recording(path, finish=True):
    """Per-stage events the way live mode writes them: rank by rank, recovery after recovery."""
    w = RecordingWriter(path, source="live", ranks=4)
    for rank in range(4):
        slow = 1.0 + rank / 10  # rank 3 is the slowest: the stage's critical path
        for gen, (det, comm) in enumerate([(0.4, 0.20), (0.6, 0.30)]):
            w.emit("detected", rank=rank, stage="detection", data={"seconds": det * slow, "generation": gen})
            w.emit("decided", rank=rank, stage="consensus", data={"seconds": 0.01, "policy": "in_memory"})
            w.emit("rebuilt", rank=rank, stage="communicator", data={"seconds": comm * slow, "generation": gen + 1})
            w.emit("replayed", rank=rank, stage="replay", data={"seconds": 9.0})
    w.emit("note", data={"text": "no stage here"})
    if finish:
        w.close()
    return w


def test_calibration_prefers_per_recovery_summaries(tmp_path):
    with RecordingWriter(tmp_path / "s.jsonl", source="live", ranks=8) as w:
        w.emit("detected", rank=0, stage="detection", data={"seconds": 99.0})
        w.emit("recovered", data={"policy": "in_memory", "stages_s": {"detection": 1.0, "rebinding": 0.02}})
        w.emit("recovered", data={"policy": "in_memory", "stages_s": {"detection": 3.0, "replay": 5.0}})
        w.emit("recovered", data={"policy": "checkpoint_restore", "stages_s": {"state": 4.0}})
    cal = calibration_from_recording(tmp_path / "s.jsonl")
    assert cal.ranks == 8
    assert cal.measured[Policy.IN_MEMORY] == {Stage.DETECTION: 2.0, Stage.REBINDING: 0.02}
    assert cal.measured[Policy.CHECKPOINT_RESTORE] == {Stage.STATE: 4.0}
    assert cal.recoveries == {Policy.IN_MEMORY: 2, Policy.CHECKPOINT_RESTORE: 1}


def test_calibration_takes_the_slowest_rank_and_averages_recoveries(tmp_path):
    cal = calibration_from_recording(_recording(tmp_path / "rec.jsonl").path)
    m = cal.measured[Policy.IN_MEMORY]
    assert cal.ranks == 4 and cal.recoveries[Policy.IN_MEMORY] == 2
    assert m[Stage.DETECTION] == pytest.approx((0.4 + 0.6) / 2 * 1.3)
    assert m[Stage.COMMUNICATOR] == pytest.approx((0.2 + 0.3) / 2 * 1.3)
    assert Stage.REPLAY not in m


def test_calibration_reads_a_recording_still_being_written(tmp_path):
    w = _recording(tmp_path / "live.jsonl", finish=False)
    try:
        cal = calibration_from_recording(tmp_path / "live.jsonl")  # reads live.jsonl.partial
        assert cal.recoveries[Policy.IN_MEMORY] == 2
    finally:
        w.close()


def test_calibrated_simulation_reproduces_measurements_at_the_recorded_scale(tmp_path, make_scenario):
    cal = calibration_from_recording(_recording(tmp_path / "rec.jsonl").path)
    sc = make_scenario(
        workload={"step_seconds": 1.0, "days": 0.05, "ranks": 4}, faults={"scripted": [{"at_s": 600.0, "rank": 1}]}
    )
    r = simulate_training(sc, adjust=cal.adjust, policies=["in_memory"]).policies[Policy.IN_MEMORY]
    assert r.downtime_s[Stage.DETECTION] == pytest.approx(0.65)
    assert r.downtime_s[Stage.COMMUNICATOR] == pytest.approx(0.325)
    # at 1,024 ranks the measured stage scales like the model
    at_1024 = cal.adjust(Policy.IN_MEMORY, 1024, estimate_recovery("in_memory", 1024).durations_s)
    ratio = (
        estimate_recovery("in_memory", 1024).durations_s[Stage.COMMUNICATOR]
        / estimate_recovery("in_memory", 4).durations_s[Stage.COMMUNICATOR]
    )
    assert at_1024[Stage.COMMUNICATOR] == pytest.approx(0.325 * ratio)


def test_recording_without_stage_durations_is_refused(tmp_path):
    with RecordingWriter(tmp_path / "empty.jsonl", source="live") as w:
        w.emit("step", rank=0, data={"loss": 1.0})
    with pytest.raises(RecordingError, match="no stage durations found"):
        calibration_from_recording(tmp_path / "empty.jsonl")


def test_chrome_trace_is_a_valid_trace_event_document(make_scenario, tmp_path):
    sc = make_scenario(
        workload={"step_seconds": 1.0, "days": 0.1},
        checkpointing={"every_steps": 600, "seconds": 5},
        faults={"scripted": [{"at_s": 2000.0, "rank": 3}]},
    )
    result = simulate_training(sc)
    doc = json.loads(json.dumps(chrome_trace(result)))
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {p.value for p in Policy}
    assert all(e["dur"] > 0 and e["ts"] >= 0 for e in spans)
    faults = [e for e in doc["traceEvents"] if e["ph"] == "i" and e["name"] == "fault"]
    assert len(faults) == len(Policy) and all(e["ts"] == 2000.0 * 1e6 for e in faults)
    cold = [e for e in spans if e["pid"] == 1 and e["cat"] == "stage"]
    assert [e["name"] for e in cold][:2] == ["detection", "restart"]
    assert cold[0]["dur"] == pytest.approx(estimate_recovery("cold_restart", 32).durations_s[Stage.DETECTION] * 1e6)


def test_parse_param():
    assert parse_param("checkpoint_every=100,200") == ("checkpointing.every_steps", [100, 200])
    assert parse_param("checkpointing.mode=sync,async") == ("checkpointing.mode", ["sync", "async"])
    with pytest.raises(MeshpactError, match="expected NAME=V1,V2"):
        parse_param("checkpoint_every")


@pytest.mark.slow
def test_sweep_runs_points_in_parallel_processes_and_saves(make_scenario, tmp_path):
    sc = make_scenario(workload={"step_seconds": 2.0, "days": 1.0}, faults={"rank_mtbf_hours": 100.0})
    seen = []
    frame = run_sweep(
        sc,
        {"checkpoint_every": [100, 400], "checkpointing.mode": ["sync", "async"]},
        processes=2,
        progress=lambda done, total: seen.append((done, total)),
    )
    assert len(frame) == 4 * len(Policy)  # points x policies
    assert seen[-1] == (4, 4)
    assert set(frame["checkpointing.mode"]) == {"sync", "async"}
    for suffix in (".csv", ".parquet"):
        path = save_frame(frame, tmp_path / f"out{suffix}")
        back = pd.read_csv(path) if suffix == ".csv" else pd.read_parquet(path)
        assert back["goodput"].tolist() == pytest.approx(frame["goodput"].tolist())


def test_sweep_refuses_an_unknown_parameter_before_running(make_scenario):
    sc = make_scenario()
    with pytest.raises(ScenarioError, match="checkpointing.every_stepz: unknown field"):
        run_sweep(sc, {"checkpointing.every_stepz": [1, 2]}, processes=1)
    with pytest.raises(MeshpactError, match=r"\.txt: expected a \.csv or \.parquet"):
        save_frame(pd.DataFrame({"a": [1]}), "out.txt")
