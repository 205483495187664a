"""``meshpact simulate``: flags and JSON shapes as documented."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshpact.cli", "simulate", *args], capture_output=True, text=True, timeout=120
    )


def test_training_json_shape_and_trace(tmp_path):
    trace = tmp_path / "t.json"
    out = cli(
        "training",
        "--ranks",
        "64",
        "--days",
        "2",
        "--step-seconds",
        "3",
        "--rank-mtbf-hours",
        "500",
        "--checkpoint-every",
        "200",
        "--checkpoint-seconds",
        "20",
        "--checkpoint-mode",
        "async",
        "--policy",
        "all",
        "--seed",
        "9",
        "--json",
        "--trace",
        str(trace),
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["ranks"] == 64 and doc["step_s"] == 3.0 and doc["checkpoint_mode"] == "async"
    assert set(doc["policies"]) == {"cold_restart", "checkpoint_restore", "in_memory", "peer_restore", "excise"}
    for p in doc["policies"].values():
        assert {"goodput", "downtime_s", "faults", "lost_steps", "checkpoint_overhead"} <= set(p)
        assert set(p["downtime_s"]) == {
            "detection",
            "restart",
            "consensus",
            "communicator",
            "state",
            "rebinding",
            "replay",
        }
    assert json.loads(trace.read_text())["traceEvents"]


def test_training_one_policy_and_bad_input():
    out = cli("training", "--policy", "in_memory", "--days", "1", "--json")
    assert list(json.loads(out.stdout)["policies"]) == ["in_memory"]
    bad = cli("training", "--checkpoint-every", "5", "--step-seconds", "-2")
    assert bad.returncode == 2 and "workload.step_seconds" in bad.stderr and "Traceback" not in bad.stderr


def test_serving_json_shape():
    out = cli("serving", "--model", "moe", "--concurrency", "16", "--request", "full", "--link-gbps", "2", "--json")
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert {"throughput_tok_s", "latency_s", "result_bytes", "startups"} <= set(doc)
    assert {"p50", "p99"} <= set(doc["latency_s"])
    assert doc["params"]["model"] == "Qwen/Qwen3-30B-A3B" and doc["params"]["link_gbit_per_s"] == 2.0


def test_sweep_writes_csv(tmp_path):
    out_path = tmp_path / "r.csv"
    out = cli(
        "sweep",
        "--scenario",
        "default",
        "--param",
        "checkpoint_every=200,800",
        "--param",
        "days=1",
        "--processes",
        "1",
        "--out",
        str(out_path),
    )
    assert out.returncode == 0, out.stderr
    frame = pd.read_csv(out_path)
    assert len(frame) == 2 * 5 and sorted(set(frame["checkpointing.every_steps"])) == [200, 800]
    bad = cli("sweep", "--scenario", "default", "--param", "nonsense=1")
    assert bad.returncode == 2 and "nonsense" in bad.stderr


def test_training_calibrated_from_a_recording(tmp_path):
    from meshpact.core.recording import RecordingWriter

    with RecordingWriter(tmp_path / "rec.jsonl", source="live", ranks=32) as w:
        w.emit("recovered", data={"policy": "in_memory", "stages_s": {"detection": 0.25, "communicator": 0.5}})
    out = cli(
        "training", "--policy", "in_memory", "--days", "7", "--calibrate-from", str(tmp_path / "rec.jsonl"), "--json"
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["calibration"]["measured_s"] == {"in_memory": {"detection": 0.25, "communicator": 0.5}}
    p = doc["policies"]["in_memory"]
    assert p["faults"] > 0  # at the recorded 32 ranks the measured seconds apply as they are
    assert p["downtime_s"]["detection"] == 0.25 * p["recoveries"]
    missing = cli("training", "--calibrate-from", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
