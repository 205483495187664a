"""A live run replayed in the simulator: faults by step, the measured inputs read back, and the
loop closed against a real live trial."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshpact.core.errors import RecordingError
from meshpact.core.recording import EventKind, RecordingWriter
from meshpact.core.recovery import Policy, Stage
from meshpact.core.recovery_costs import FaultImpact
from meshpact.core.scenario import builtin_scenario_path, load_scenario, with_overrides
from meshpact.simulator.replay import live_run_from_recording, replay_live
from meshpact.simulator.training import StepFault, simulate_training

SHIPPED = Path(__file__).resolve().parents[2] / "scenarios" / "recordings" / "live-trial-2-ranks.jsonl"


def _scenario(ranks: int, steps: int, step_s: float, every: int, ckpt_s: float, policy: Policy):
    return with_overrides(
        load_scenario(builtin_scenario_path("default")),
        {
            "workload.ranks": ranks,
            "workload.parallelism": {"tensor": 1, "pipeline": 1},
            "workload.step_seconds": step_s,
            "workload.tokens_per_step": None,
            "workload.work_steps": steps,
            "workload.days": 1.0,
            "faults.rank_mtbf_hours": None,
            "faults.rank_loss_mtbf_hours": None,
            "checkpointing.every_steps": every,
            "checkpointing.seconds": ckpt_s,
            "checkpointing.mode": "sync",
            "recovery.policies": [policy.value],
        },
    )


def _fixed(stages: dict[Stage, float]):
    def adjust(policy, ranks, modelled):
        return {s: stages.get(s, 0.0) for s in modelled}

    return adjust


def test_step_faults_strike_at_their_step_once_even_after_a_rollback():
    # 20 steps of 0.5 s, a 2 s checkpoint after 8 and 16; faults in step 3 (0.1 s in) and step 11 (9 s in: clipped)
    stages = {Stage.DETECTION: 1.0, Stage.CONSENSUS: 0.25, Stage.STATE: 3.0}
    faults = [StepFault(11, offset_s=9.0), StepFault(3, offset_s=0.1)]
    r = simulate_training(
        _scenario(3, 20, 0.5, 8, 2.0, Policy.IN_MEMORY), adjust=_fixed(stages), step_faults=faults
    ).policies[Policy.IN_MEMORY]
    rec = sum(stages.values())
    fault_t = [e.t for e in r.timeline if e.kind == "fault"]
    assert fault_t == pytest.approx([3 * 0.5 + 0.1, 0.1 + rec + 11 * 0.5 + 2.0 + 0.5])
    assert r.faults == 2 and r.lost_steps == 0 and r.committed_steps == 20
    assert r.wall_s == pytest.approx(20 * 0.5 + 2 * 2.0 + 2 * rec + 0.1 + 0.5)
    # checkpoint restore rolls step 11's fault back to step 8: step 11 runs again, the fault does not
    cr = simulate_training(
        _scenario(3, 20, 0.5, 8, 2.0, Policy.CHECKPOINT_RESTORE), adjust=_fixed(stages), step_faults=faults
    ).policies[Policy.CHECKPOINT_RESTORE]
    assert cr.faults == 2 and cr.lost_steps == 3 + 3 and cr.committed_steps == 20
    assert cr.wall_s == pytest.approx(r.wall_s + 6 * 0.5)


def test_step_fault_outside_the_job_is_refused():
    with pytest.raises(Exception, match="step fault 0: rank 7"):
        simulate_training(_scenario(3, 20, 0.5, 8, 2.0, Policy.IN_MEMORY), step_faults=[StepFault(2, rank=7)])


def _synthetic(
    path: Path,
    *,
    ranks=3,
    steps=14,
    every=4,
    step_s=0.2,
    warm=1.5,
    ckpt=(0.3, 0.5, 0.4),
    faults=((2, 0, 0.05), (9, 1, 0.12)),
    stages=None,
    skew=0.01,
    kind="collective",
    policy="in_memory",
) -> float:
    """A recording as a live trial writes it, of a run that behaves exactly as the model says:
    returns its true training-loop time (the slowest rank's)."""
    stages = stages or {"detection": 0.02, "consensus": 0.03, "communicator": 0.01, "rebinding": 0.004, "state": 0.006}
    # a lost rank rolls back to the last checkpoint and replays the steps since (slowest rank's step)
    lost = {k: k % every if kind == "kill" else 0 for k, _, _ in faults}
    down = {k: sum(stages.values()) + lost[k] * step_s for k, _, _ in faults}
    with RecordingWriter(path, "live", kind="recovery_trial", ranks=ranks, steps=steps, checkpoint_every=every) as rec:
        ckpts = {s: ckpt[i % len(ckpt)] for i, s in enumerate(range(every, steps + 1, every))}
        per_rank, t_end = [], 100.0
        for rank in range(ranks):
            secs = []
            for s in range(steps):
                x = step_s - skew * rank  # rank 0 is the slowest
                if s == 0:
                    x += warm
                for k, _, off in faults:
                    if k == s:
                        x += off + down[k]
                x += ckpts.get(s + 1, 0.0)
                secs.append(x)
            per_rank.append(secs)
        for s, sec in ckpts.items():
            for rank in range(ranks):
                rec.emit(EventKind.CHECKPOINT, rank=rank, data={"step": s, "seconds": sec - 0.01 * rank, "bytes": 10})
        for rank, secs in enumerate(per_rank):
            rec.emit(
                EventKind.TRAINED,
                rank=rank,
                t=t_end,
                data={"first_step": 0, "steps": steps, "step_s": secs, "seconds": sum(secs), "incarnation": 0},
            )
        for i, (k, rank, off) in enumerate(faults):
            t_step = t_end - sum(per_rank[rank][k:])
            rec.emit(
                EventKind.FAULT_INJECTED,
                rank=rank,
                t=t_step + off,
                data={"index": i, "kind": kind, "rank": rank, "step": k},
            )
            rec.emit(
                EventKind.RECOVERED,
                data={
                    "step": k,
                    "policy": policy,
                    "stages_s": stages,
                    "downtime_s": down[k],
                    "generation": i + 1,
                    "lost_steps": lost[k],
                },
            )
    return sum(per_rank[0])


def test_a_run_that_behaves_as_modelled_is_predicted_exactly(tmp_path):
    path = tmp_path / "run.jsonl"
    true_total = _synthetic(path)
    # a cold-restart baseline recorded after the faulted run writes checkpoints of its own: not this run's
    late = {"t": 500.0, "rank": 0, "stage": None, "event": "checkpoint", "data": {"step": 4, "seconds": 9.0}}
    path.write_text(path.read_text() + json.dumps(late) + "\n")
    run = live_run_from_recording(path)
    assert (run.ranks, run.steps, run.checkpoint_every) == (3, 14, 4)
    assert run.step_s == pytest.approx(0.2) and run.warmup_s == pytest.approx(1.5)
    assert run.checkpoint_s == pytest.approx((0.3 + 0.5 + 0.4) / 3)
    assert [(f.step, f.rank, f.impact) for f in run.faults] == [
        (2, 0, FaultImpact.TRANSIENT),
        (9, 1, FaultImpact.TRANSIENT),
    ]
    assert [f.offset_s for f in run.faults] == pytest.approx([0.05, 0.12])
    replay = replay_live(path)
    assert run.total_s == pytest.approx(true_total)
    assert [f.predicted_s for f in replay.faults] == pytest.approx([0.07, 0.07])
    assert replay.total_error == pytest.approx(0.0, abs=1e-9)
    assert replay.steady_error == pytest.approx(0.0, abs=1e-9)


def test_a_lost_rank_replayed_from_its_checkpoint_is_predicted_exactly(tmp_path):
    # killed ranks: the live runtime restores the checkpoint and replays 2 and 3 steps
    path = tmp_path / "run.jsonl"
    stages = {"detection": 0.05, "consensus": 1.7, "communicator": 0.01, "state": 0.02, "rebinding": 0.001}
    true_total = _synthetic(
        path, kind="kill", policy="checkpoint_restore", stages=stages, faults=((6, 1, 0.03), (11, 0, 0.0)), ranks=2
    )
    run = live_run_from_recording(path)
    assert [f.impact for f in run.faults] == [FaultImpact.RANK_LOSS] * 2
    replay = replay_live(path)
    assert [f.predicted_s for f in replay.faults] == pytest.approx([sum(stages.values()) + n * 0.2 for n in (2, 3)])
    assert replay.predicted_total_s == pytest.approx(true_total)
    assert any("inside the measured consensus" in n for n in replay.notes)
    # a fault that fired with no recovery at its step is named, not replayed
    evs = [json.loads(x) for x in path.read_text().splitlines()]
    path.write_text(
        "".join(json.dumps(e) + "\n" for e in evs if not (e["event"] == "recovered" and e["data"]["step"] == 11))
    )
    replay = replay_live(path)
    assert [f.step for f in replay.faults] == [6] and replay.run.unrecovered == 1
    assert any("1 injected fault(s) had no recovery" in n for n in replay.notes)


def test_a_slower_run_than_its_costs_shows_as_an_error(tmp_path):
    # downtime measured far above its stages: the comparison must say so, not hide it
    path = tmp_path / "run.jsonl"
    _synthetic(path, stages={"detection": 0.01, "consensus": 0.01}, steps=10, every=10)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for ev in lines:
        if ev["event"] == "recovered":
            ev["data"]["downtime_s"] = 0.2
    path.write_text("".join(json.dumps(ev) + "\n" for ev in lines))
    replay = replay_live(path)
    assert any("taken from the cost model: communicator, rebinding" in n for n in replay.notes)
    assert replay.downtime_error > 0.2  # the model's communicator and rebinding, far off these stages
    _synthetic(
        path,
        stages={"detection": 0.01, "consensus": 0.01, "communicator": 0.0, "rebinding": 0.0, "state": 0.0},
        steps=10,
        every=10,
    )
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    for ev in lines:
        if ev["event"] == "recovered":
            ev["data"]["downtime_s"] = 0.2
    path.write_text("".join(json.dumps(ev) + "\n" for ev in lines))
    replay = replay_live(path)
    assert not any("cost model" in n for n in replay.notes)
    assert replay.downtime_error == pytest.approx(0.02 / 0.2 - 1.0)
    assert any("checkpoint after the last step" in n for n in replay.notes)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda evs: [e for e in evs if e["event"] != "trained"], "no 'trained' events"),
        (lambda evs: [e for e in evs if e["event"] != "checkpoint"], "no checkpoint write times"),
        (
            lambda evs: [{**e, "data": {**e["data"], "step_s": "fast"}} if e["event"] == "trained" else e for e in evs],
            "is malformed",
        ),
        (
            lambda evs: [
                {**e, "data": {k: v for k, v in e["data"].items() if k != "checkpoint_every"}}
                if e["event"] == "recording_start"
                else e
                for e in evs
            ],
            "lacks checkpoint_every",
        ),
    ],
)
def test_what_a_recording_lacks_is_one_clear_line(tmp_path, change, message):
    path = tmp_path / "run.jsonl"
    _synthetic(path)
    evs = change([json.loads(x) for x in path.read_text().splitlines()])
    path.write_text("".join(json.dumps(ev) + "\n" for ev in evs))
    with pytest.raises(RecordingError, match=message) as info:
        replay_live(path)
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_cli_prints_the_comparison_or_why_there_is_none(tmp_path):
    path = tmp_path / "run.jsonl"
    _synthetic(path)
    cmd = [
        sys.executable,
        "-m",
        "meshpact.cli",
        "simulate",
        "training",
        "--policy",
        "in_memory",
        "--days",
        "1",
        "--calibrate-from",
    ]
    out = subprocess.run([*cmd, str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "measured against simulated" in out.stdout and "fault at step 9" in out.stdout
    doc = json.loads(subprocess.run([*cmd, str(path), "--json"], capture_output=True, text=True, timeout=120).stdout)
    assert doc["live_replay"]["total_s"]["error"] == pytest.approx(0.0, abs=1e-6)
    old = subprocess.run([*cmd, str(SHIPPED)], capture_output=True, text=True, timeout=120)
    assert old.returncode == 0, old.stderr
    assert "no live replay" in old.stdout and "checkpoint_every" in old.stdout


@pytest.mark.slow
@pytest.mark.live
def test_calibrated_simulation_reproduces_a_fresh_live_run(tmp_path):
    from meshpact.live.trials.trial import TrialConfig, run_trial

    path = tmp_path / "live.jsonl"
    result = run_trial(
        TrialConfig(ranks=2, steps=16, faults=2, fault_kind="collective", baselines=False),
        recording_path=path,
        work_dir=tmp_path / "work",
    )
    assert result.summary()["faults_recovered"] == 2
    replay = replay_live(path)
    assert len(replay.faults) == 2 and not any("recovered" in n for n in replay.notes)
    report = json.dumps(replay.to_dict(), default=str)
    assert abs(replay.downtime_error) <= 0.2, report
    assert abs(replay.total_error) <= 0.2, report
    assert replay.steady_error is not None and abs(replay.steady_error) <= 0.2, report
