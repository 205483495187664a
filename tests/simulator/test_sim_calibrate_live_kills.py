"""Calibration and replay on recordings made by real kill trials (4 ranks, the decoder, gloo on loopback).

``data/live-kill-peer-restore-4-ranks.jsonl``: ``meshpact live recover --ranks 4 --steps 12
--faults 2 --fault-kind kill --no-baselines --record ...`` (two kills, each answered by a
replacement restored from a peer's copy). ``data/live-kill-excise-4-ranks.jsonl``: the same with
``--on-rank-loss excise`` (4 -> 3 -> 2 ranks). Both from a 2-core machine at load average 2.6-6.7.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from meshpact.core.recording import EventKind, iter_events
from meshpact.core.recovery import Policy, Stage
from meshpact.core.recovery_costs import FaultImpact, estimate_recovery
from meshpact.simulator.calibrate import Provenance, calibration_from_recording
from meshpact.simulator.replay import replay_live

DATA = Path(__file__).parent / "data"
PEER = DATA / "live-kill-peer-restore-4-ranks.jsonl"
EXCISE = DATA / "live-kill-excise-4-ranks.jsonl"


def _summary(path: Path) -> dict:
    return dict(next(e for e in iter_events(path) if e.event == EventKind.SUMMARY).data)


@pytest.mark.parametrize("path,policy", [(PEER, Policy.PEER_RESTORE), (EXCISE, Policy.EXCISE)])
def test_every_recorded_rank_loss_recovery_is_calibrated_under_its_policy(path, policy):
    cal = calibration_from_recording(path)
    summary = _summary(path)
    assert cal.recoveries.get(policy) == summary["policy_counts"][policy.value] == 2
    measured = cal.measured[policy]
    for stage in (Stage.DETECTION, Stage.CONSENSUS, Stage.COMMUNICATOR, Stage.STATE):
        assert measured[stage] > 0 and cal.provenance(policy)[stage] is Provenance.RECORDING
    # the whole recovery is no longer than the downtime it measured (the stages tile it, at most)
    assert sum(measured.values()) <= summary["downtime_s"][policy.value] * 1.5


def test_a_peer_fetch_moves_one_ranks_shipped_copy():
    """Two counts of the same payload: the bytes the replacement fetched from its holder, and the
    bytes a rank ships per commit (the shipper's count)."""
    cal = calibration_from_recording(PEER)
    fetched = cal.state_bytes[Policy.PEER_RESTORE].bytes
    shipped = cal.peer_copy.measured.bytes_per_commit
    assert fetched == pytest.approx(shipped, rel=0.25)
    assert cal.provenance(Policy.PEER_RESTORE)[Stage.RESTART] is Provenance.MODEL


def test_an_excision_gathers_every_shard():
    """The re-shard gather moves the whole old world's state: every rank's shard."""
    cal = calibration_from_recording(EXCISE)
    gathered = cal.state_bytes[Policy.EXCISE].bytes
    per_rank = calibration_from_recording(PEER).peer_copy.measured.bytes_per_commit
    assert gathered == pytest.approx(4 * per_rank, rel=0.25)
    assert cal.peer_copy.measured.ranks == _summary(EXCISE)["final_world_size"] == 2


def test_the_calibrated_peer_restore_reproduces_its_stages_at_the_recorded_scale_and_grows_with_the_shard():
    cal = calibration_from_recording(PEER)
    fetched = cal.state_bytes[Policy.PEER_RESTORE].bytes
    for factor in (1.0, 8.0):
        costs = replace(cal.costs, state_bytes_per_rank=fetched * factor)
        modelled = estimate_recovery(Policy.PEER_RESTORE, 4, costs, impact=FaultImpact.RANK_LOSS).durations_s
        out = cal.adjust(Policy.PEER_RESTORE, 4, modelled)
        assert out[Stage.STATE] == pytest.approx(cal.measured[Policy.PEER_RESTORE][Stage.STATE] * factor)
        assert out[Stage.CONSENSUS] == pytest.approx(cal.measured[Policy.PEER_RESTORE][Stage.CONSENSUS])


@pytest.mark.parametrize("path,policy", [(PEER, Policy.PEER_RESTORE), (EXCISE, Policy.EXCISE)])
def test_replaying_a_kill_run_predicts_its_downtime_within_20_percent(path, policy):
    replay = replay_live(path)
    assert replay.policy is policy
    assert len(replay.faults) == 2
    assert abs(replay.downtime_error) < 0.20, replay.to_dict()["downtime_per_fault_s"]
    assert abs(replay.total_error) < 0.20, replay.to_dict()["total_s"]


def test_the_cli_reports_provenance_and_the_peer_copy_model():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshpact.cli",
            "simulate",
            "training",
            "--policy",
            "peer_restore",
            "--days",
            "0.1",
            "--calibrate-from",
            str(PEER),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    cal = doc["calibration"]
    assert cal["provenance"]["peer_restore"]["restart"] == "model"
    assert cal["provenance"]["peer_restore"]["state"] == "recording"
    pc = cal["peer_copy"]
    assert pc["peer_bytes_per_s"] == pytest.approx(pc["measured"]["bytes_per_commit"] / pc["measured"]["ship_s"])
    assert pc["s_per_step"]["measured"] == pytest.approx(pc["measured"]["snapshot_s"])
    assert doc["live_replay"]["policy"] == "peer_restore"
