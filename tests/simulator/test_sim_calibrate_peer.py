"""Calibration of the rank-loss policies (peer restore, excise) and of the peer-copy model from recordings."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from meshpact.core.errors import RecordingError
from meshpact.core.recording import RecordingWriter
from meshpact.core.recovery import Policy, Stage
from meshpact.core.recovery_costs import DEFAULT_RECOVERY_COSTS, FaultImpact, estimate_recovery
from meshpact.simulator.calibrate import Provenance, calibration_from_recording

PEER_STAGES = {"detection": 0.5, "consensus": 2.0, "communicator": 0.3, "state": 0.6, "rebinding": 0.001, "replay": 0.9}
EXCISE_STAGES = {"detection": 0.4, "consensus": 0.2, "communicator": 0.05, "state": 0.7, "rebinding": 0.0}


def _kill_recording(path, *, overhead=None, ranks=4):
    """What a kill trial writes: each rank's decision and reload, then the parent's summaries.
    Generation 1 is a peer restore (the replacement fetches 400 kB, a survivor rolls back to
    its own snapshot and moves nothing), generation 2 the in-memory round that follows it,
    generation 3 an excision (the survivors gather 1.2 MB), generation 4 a peer restore of 600 kB."""
    with RecordingWriter(path, "live", kind="recovery_trial", ranks=ranks, steps=12, checkpoint_every=10) as w:
        for gen, policy in ((1, "peer_restore"), (2, "in_memory"), (3, "excise"), (4, "peer_restore")):
            for rank in range(ranks):
                w.emit("decided", rank=rank, stage="consensus", data={"round": gen, "policy": policy, "seconds": 0.1})
            if policy == "peer_restore":
                fetched = 400_000 if gen == 1 else 600_000
                w.emit(
                    "reloaded",
                    rank=0,
                    stage="state",
                    data={
                        "action": "peer_recover",
                        "bytes": fetched,
                        "holder": 1,
                        "checkpoint_step": gen,
                        "seconds": 0.6,
                    },
                )
                w.emit(
                    "reloaded",
                    rank=2,
                    stage="state",
                    data={"action": "peer_recover", "bytes": 0, "holder": None, "checkpoint_step": gen, "seconds": 0.1},
                )
            elif policy == "excise":
                for rank in (1, 2, 3):
                    w.emit(
                        "reloaded",
                        rank=rank,
                        stage="state",
                        data={
                            "action": "peer_recover",
                            "checkpoint_step": 5,
                            "seconds": 0.7,
                            "excision": {"step": 5, "lost": [0], "bytes_moved": 1_200_000, "gather_s": 0.2},
                        },
                    )
            else:
                w.emit("retained", rank=0, stage="state", data={"action": "retain", "seconds": 0.001})
        stages = {
            1: PEER_STAGES,
            2: {"detection": 9.0, "state": 0.001},
            3: EXCISE_STAGES,
            4: {**PEER_STAGES, "consensus": 4.0},
        }
        for gen, policy in ((1, "peer_restore"), (2, "in_memory"), (3, "excise"), (4, "peer_restore")):
            w.emit("recovered", data={"generation": gen, "step": gen + 1, "policy": policy, "stages_s": stages[gen]})
        w.emit("summary", data={"peer_copy_overhead": overhead})
    return path


def test_peer_restore_and_excise_stages_come_from_the_recording(tmp_path):
    cal = calibration_from_recording(_kill_recording(tmp_path / "kill.jsonl"))
    assert cal.recoveries == {Policy.PEER_RESTORE: 2, Policy.IN_MEMORY: 1, Policy.EXCISE: 1}
    peer = cal.measured[Policy.PEER_RESTORE]
    assert peer[Stage.CONSENSUS] == pytest.approx(3.0) and peer[Stage.STATE] == pytest.approx(0.6)
    assert Stage.REPLAY not in peer  # derived from lost steps by the simulator
    assert cal.measured[Policy.EXCISE][Stage.STATE] == pytest.approx(0.7)
    # the slowest rank's transfer per recovery: the replacement's fetch, the excision's gather
    assert cal.state_bytes[Policy.PEER_RESTORE].bytes == pytest.approx(500_000)
    assert cal.state_bytes[Policy.PEER_RESTORE].recoveries == 2
    assert cal.state_bytes[Policy.EXCISE].bytes == pytest.approx(1_200_000)
    assert Policy.IN_MEMORY not in cal.state_bytes


def test_provenance_names_what_stayed_a_default(tmp_path):
    cal = calibration_from_recording(_kill_recording(tmp_path / "kill.jsonl"))
    peer = cal.provenance(Policy.PEER_RESTORE)
    assert peer[Stage.RESTART] is Provenance.MODEL  # a replacement's wait: not a stage live mode times
    assert {s for s, v in peer.items() if v is Provenance.RECORDING} == {
        Stage.DETECTION,
        Stage.CONSENSUS,
        Stage.COMMUNICATOR,
        Stage.STATE,
        Stage.REBINDING,
    }
    assert cal.provenance(Policy.EXCISE)[Stage.STATE] is Provenance.RECORDING  # the model has no state stage there
    assert set(cal.provenance(Policy.CHECKPOINT_RESTORE).values()) == {Provenance.MODEL}
    doc = cal.to_dict()
    assert doc["provenance"]["peer_restore"]["restart"] == "model"
    assert doc["state_bytes"]["excise"]["bytes"] == 1_200_000


def test_peer_state_stage_scales_with_the_shard_over_the_recorded_bytes(tmp_path):
    cal = calibration_from_recording(_kill_recording(tmp_path / "kill.jsonl"))
    recorded = cal.state_bytes[Policy.PEER_RESTORE].bytes
    for ranks, factor in ((4, 1.0), (4, 3.0), (2048, 0.25)):
        costs = replace(DEFAULT_RECOVERY_COSTS, state_bytes_per_rank=recorded * factor)
        modelled = estimate_recovery(Policy.PEER_RESTORE, ranks, costs, impact=FaultImpact.RANK_LOSS).durations_s
        out = cal.adjust(Policy.PEER_RESTORE, ranks, modelled)
        assert out[Stage.STATE] == pytest.approx(0.6 * factor)
        assert out[Stage.RESTART] == modelled[Stage.RESTART]  # not measured: the model's wait stays
    at_recorded = estimate_recovery(
        Policy.PEER_RESTORE,
        4,
        replace(DEFAULT_RECOVERY_COSTS, state_bytes_per_rank=recorded),
        impact=FaultImpact.RANK_LOSS,
    ).durations_s
    out = cal.adjust(Policy.PEER_RESTORE, 4, at_recorded)
    for stage, seconds in cal.measured[Policy.PEER_RESTORE].items():  # the recorded scale gives the measurement
        assert out[stage] == pytest.approx(seconds)
    # a transient fault under peer_restore moves no state: no kill's fetch is charged to it
    transient = estimate_recovery(Policy.PEER_RESTORE, 4, impact=FaultImpact.TRANSIENT).durations_s
    assert cal.adjust(Policy.PEER_RESTORE, 4, transient)[Stage.STATE] == 0.0


def _overhead(**over):
    base = {
        "copies": 1,
        "network_bytes_per_step": 4 * 3_000_000,
        "ship_ms_mean": 300.0,
        "snapshot_ms_per_commit": 100.0,
        "step_ms_with": 500.0,
        "step_ms_without": 480.0,
        "step_latency": 500 / 480 - 1,
    }
    return {**base, **over}


def test_peer_copy_model_is_calibrated_from_the_measured_shipping(tmp_path):
    cal = calibration_from_recording(_kill_recording(tmp_path / "kill.jsonl", overhead=_overhead()))
    pc = cal.peer_copy
    m = pc.measured
    assert m.bytes_per_commit == 3_000_000 and m.ship_s == pytest.approx(0.3)
    assert pc.costs.peer_bytes_per_s == pytest.approx(1e7)  # one rank's bytes per commit over its shipping time
    assert m.compute_s == pytest.approx(0.4)  # the step less the training thread's time in the copy
    # the training thread's 0.1 s (all host copy in a summary without its parts); the 0.3 s ship hides in the step
    assert pc.predicted_s_per_step == pytest.approx(0.1)
    assert pc.error == pytest.approx(0.1 / 0.1 - 1.0)
    assert pc.predicted_overhead == pytest.approx(0.25) and pc.measured_overhead == pytest.approx(0.25)
    other = calibration_from_recording(
        _kill_recording(tmp_path / "k2.jsonl", overhead=_overhead(ship_ms_mean=100.0, snapshot_ms_per_commit=30.0))
    )
    # the ship hides behind the step; the host copy (all this older summary times) never does
    assert other.peer_copy.predicted_s_per_step == pytest.approx(0.03)
    assert other.peer_copy.error == pytest.approx(0.0)
    assert cal.to_dict()["peer_copy"]["s_per_step"]["measured"] == pytest.approx(0.1)


def test_a_run_without_copies_has_no_peer_copy_model(tmp_path):
    assert calibration_from_recording(_kill_recording(tmp_path / "none.jsonl")).peer_copy is None
    nothing = calibration_from_recording(
        _kill_recording(tmp_path / "zero.jsonl", overhead=_overhead(network_bytes_per_step=0))
    )
    assert nothing.peer_copy is None  # every copy failed: nothing to calibrate from


@pytest.mark.parametrize(
    "field,value",
    [("ship_ms_mean", "fast"), ("network_bytes_per_step", -1), ("snapshot_ms_per_commit", math.nan), ("copies", None)],
)
def test_a_malformed_peer_copy_summary_is_refused_by_name(tmp_path, field, value):
    path = _kill_recording(tmp_path / "bad.jsonl", overhead=_overhead(**{field: value}))
    with pytest.raises(RecordingError, match=f"peer_copy_overhead.{field} must be a number"):
        calibration_from_recording(path)


def test_malformed_reloaded_bytes_are_refused(tmp_path):
    with RecordingWriter(tmp_path / "b.jsonl", "live", ranks=2) as w:
        w.emit("decided", rank=0, stage="consensus", data={"round": 1, "policy": "peer_restore"})
        w.emit("reloaded", rank=0, stage="state", data={"bytes": "lots", "seconds": 0.1})
        w.emit("recovered", data={"generation": 1, "policy": "peer_restore", "stages_s": {"state": 0.1}})
    with pytest.raises(RecordingError, match="reloaded bytes must be a number"):
        calibration_from_recording(tmp_path / "b.jsonl")


def test_a_kill_answered_by_two_rounds_keeps_the_first_policy_and_the_last_end(tmp_path):
    """A kill's peer restore may be followed by an in-memory round at the same step: the fault
    was answered by the peer restore, and its downtime runs to the end of the last round."""
    from meshpact.simulator.replay import live_run_from_recording

    path = tmp_path / "k.jsonl"
    with RecordingWriter(
        path, "live", kind="recovery_trial", ranks=2, steps=6, checkpoint_every=3, fault_kind="kill"
    ) as w:
        w.emit("checkpoint", rank=0, t=0.5, data={"step": 2, "seconds": 0.05})
        for rank in range(2):
            w.emit(
                "trained",
                rank=rank,
                t=9.0,
                data={"first_step": 0, "step_s": [0.5, 0.2, 0.2, 0.2, 0.2, 0.2], "incarnation": 0},
            )
        w.emit("fault_injected", rank=1, t=1.0, data={"index": 0, "step": 3, "kind": "kill"})
        w.emit(
            "recovered",
            data={
                "generation": 1,
                "step": 3,
                "policy": "peer_restore",
                "downtime_s": 4.0,
                "stages_s": {"consensus": 3.0},
            },
        )
        w.emit(
            "recovered",
            data={"generation": 2, "step": 3, "policy": "in_memory", "downtime_s": 6.5, "stages_s": {"consensus": 0.5}},
        )
    (fault,) = live_run_from_recording(path).faults
    assert fault.policy is Policy.PEER_RESTORE and fault.downtime_s == 6.5
    assert fault.impact is FaultImpact.RANK_LOSS
