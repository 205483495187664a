"""Checkpoint baselines start only once the fault itself has cleared, as a real restore would."""

from __future__ import annotations

import pytest

from meshpact.live.recovery.faults import FaultKind
from meshpact.live.trials.trial import TrialConfig, TrialResult


def _result(kind: str) -> TrialResult:
    cfg = TrialConfig(
        ranks=2,
        steps=8,
        faults=1,
        checkpoint_every=4,
        fault_kind=FaultKind(kind),
        data_timeout_s=0.5,
        stall_s=1.5,
        down_s=2.0,
    )
    return TrialResult(cfg, (), [], [], None, {}, True, [], 0, "")


@pytest.mark.parametrize(
    "kind, in_job, cold",
    [
        ("collective", 0.2, 0.2),  # nothing to wait for beyond detection
        ("partition", 2.0, 2.0),  # every policy needs the data link back
        ("stall", 1.5, 0.2),  # an in-job restore waits for the stalled rank; a cold restart kills it
        ("kill", 0.2, 0.2),
    ],
)
def test_baseline_outage_is_detection_or_the_faults_own_duration(kind, in_job, cold):
    r = _result(kind)
    assert r.outage_s(0.2, restart=False) == pytest.approx(in_job)
    assert r.outage_s(0.2, restart=True) == pytest.approx(cold)
    assert r.outage_s(3.0, restart=False) == pytest.approx(3.0)  # a slower detection dominates


def _restored(
    policy: str, rank_t: list[tuple[int, float]], injected: float, step: int = 6, lost: int = 2
) -> tuple[tuple, list, dict]:
    """The events of one recovery at ``step`` that every rank ended at its time, the fault injected at ``injected``."""
    from meshpact.core.recording import Event, EventKind
    from meshpact.live.recovery.faults import Fault, FaultKind
    from meshpact.live.trials.outcome import FaultRecord

    events = [
        Event(
            t,
            EventKind.RECOVERY_DONE,
            rank,
            None,
            {
                "step": step,
                "t_detect_wall": injected + 0.1,
                "t_first_collective_wall": t - 0.01,
                "t_resumed_wall": t,
                "policy": policy,
                "reason": "r",
                "generation": 1,
                "lost_steps": lost,
                "rebind_s": 0.0,
                "action": "rebuild",
                "drill": False,
            },
        )
        for rank, t in rank_t
    ]
    return (Fault(0, FaultKind.KILL, step, 1),), events, {0: FaultRecord(1, step, "kill", injected)}


def test_a_kill_trials_checkpoint_figure_is_the_same_loss_restored_from_the_checkpoint_and_says_so():
    from meshpact.live.trials.analysis import ReplacementStart
    from meshpact.live.trials.outcome import Drill, RankOutcome

    cfg = TrialConfig(ranks=2, steps=8, faults=1, checkpoint_every=4, fault_kind="kill")
    assert cfg.loses_process
    faults, peer_events, peer_records = _restored("peer_restore", [(0, 103.0), (1, 103.5)], 100.0)
    _, ckpt_events, ckpt_records = _restored("checkpoint_restore", [(0, 204.0), (1, 204.2)], 200.0)
    baseline = TrialResult(cfg, faults, [], [], None, ckpt_records, True, [], 1, "", faulted_events=ckpt_events)
    # a drill in the faulted run would say 0.5 s: it must not be the figure of a trial that lost a process
    drilled = [RankOutcome(0, drill=Drill(300.0, 300.5, 4, 2))]
    r = TrialResult(
        cfg,
        faults,
        [],
        drilled,
        None,
        peer_records,
        True,
        [],
        1,
        "",
        faulted_events=peer_events,
        checkpoint_baseline=baseline,
        replacement_start=ReplacementStart.WARM_SPARE,
    )
    down, includes = r.downtime(), r.downtime_includes()
    assert down["peer_restore"] == pytest.approx(3.5) and down["checkpoint_restore"] == pytest.approx(4.2)
    spare = ReplacementStart.WARM_SPARE.value
    assert spare in includes["peer_restore"] and spare in includes["checkpoint_restore"]
    assert includes["checkpoint_restore"].startswith("the same loss as peer restore")
    assert "2 lost step(s)" in includes["checkpoint_restore"]
    assert includes["in_memory"] is None and includes["cold_restart"] is None  # no figure, nothing to explain
    assert set(r.summary()["downtime_includes"]) == set(r.summary()["downtime_s"])


def test_without_a_lost_process_the_checkpoint_figure_is_the_drill_and_says_no_process_was_lost():
    from meshpact.live.trials.outcome import Drill, RankOutcome

    cfg = TrialConfig(ranks=2, steps=8, faults=1, checkpoint_every=4, fault_kind="collective")
    assert not cfg.loses_process
    faults, events, records = _restored("in_memory", [(0, 100.3), (1, 100.4)], 100.0)
    r = TrialResult(
        cfg,
        faults,
        [],
        [RankOutcome(0, drill=Drill(300.0, 300.5, 4, 3))],
        None,
        records,
        True,
        [],
        0,
        "",
        faulted_events=events,
    )
    includes = r.downtime_includes()
    assert r.downtime()["checkpoint_restore"] == pytest.approx(0.1 + 0.5)  # detection, then the drill
    assert "no process lost" in includes["checkpoint_restore"] and "3 lost step(s)" in includes["checkpoint_restore"]
    assert includes["peer_restore"] is None


def test_the_cold_restart_is_timed_to_the_step_the_checkpoint_restore_caught_up_to():
    from meshpact.live.trials.outcome import RankOutcome

    cfg = TrialConfig(ranks=2, steps=8, faults=1, checkpoint_every=4, fault_kind="kill")
    cold = [RankOutcome(r, step_s=(1.0, 1.0, 1.0, 1.0), t_loaded_wall=10.0 + r, t_caught_up_wall=20.0) for r in (0, 1)]
    kw = dict(cold_launch_wall=5.0)
    ends = TrialResult(cfg, (), [], [], cold, {}, True, [], 0, "", **kw).downtime()["cold_restart"]
    two = TrialResult(cfg, (), [], [], cold, {}, True, [], 0, "", cold_replays=2, **kw).downtime()["cold_restart"]
    assert ends == pytest.approx(0.0 + 20.0 - 5.0)  # to the end of the run (the drill's replay)
    assert two == pytest.approx(11.0 + 2.0 - 5.0)  # the slower rank loaded, then replayed two steps


@pytest.mark.live
@pytest.mark.slow
def test_in_a_kill_trial_every_baseline_loses_the_same_process():
    from _recovery import recoveries_told, trial

    from meshpact.live.trials.analysis import ReplacementStart

    result = trial(ranks=2, steps=6, faults=1, fault_kind="kill", checkpoint_every=2)
    s = result.summary()
    assert s["bit_identical"], s["mismatches"]  # the faulted run, the checkpoint baseline and the cold restart
    baseline = result.checkpoint_baseline
    assert baseline is not None and all(o.drill is None for o in result.faulted)
    assert baseline.replacements == result.replacements == 1  # the same rank lost, a replacement started for it
    # (a data-path timeout under load may add an in-memory recovery to either run: no process is lost in it)
    lossy = [r for r in baseline.recoveries() if r["policy"] != "in_memory"]
    assert [r["policy"] for r in lossy] == ["checkpoint_restore"], recoveries_told(baseline)
    assert [r["step"] for r in lossy] == [r["step"] for r in result.recoveries() if r["policy"] == "peer_restore"]
    assert {o.incarnation for o in baseline.faulted} == {o.incarnation for o in result.faulted} == {0, 1}
    down, includes = s["downtime_s"], s["downtime_includes"]
    assert down["peer_restore"] and down["checkpoint_restore"] and down["cold_restart"]
    assert includes["checkpoint_restore"].startswith("the same loss as peer restore")
    assert ReplacementStart.FORKED.value in includes["checkpoint_restore"]
    assert ReplacementStart.FORKED.value in includes["peer_restore"]
