"""Every timeout is derived from a few inputs; an ordering that cannot work is refused."""

from __future__ import annotations

import pytest

from meshpact.cli import main
from meshpact.live.recovery.config import RecoveryConfig, TimeoutOrderError
from meshpact.live.trials.trialconfig import TrialConfig


def test_derived_values_follow_their_formulas_for_inputs_other_than_the_defaults():
    c = RecoveryConfig(
        data_timeout_s=45.0,
        heartbeat_interval_s=0.07,
        heartbeat_misses=5,
        process_start_s=7.0,
        group_create_s=11.0,
        max_rounds=3,
        step_s=2.0,
        warmup_s=9.0,
        heartbeat=True,
    )
    assert c.heartbeat_detect_s == pytest.approx(0.07 * 6)
    assert c.detection_bound_s == pytest.approx(0.42)  # the heartbeat, not the 45 s data path
    assert c.consensus_round_s == c.control_timeout_s == 11.0
    assert c.connect_timeout_s == 11.0 and c.store_connect_s == 18.0
    assert c.rank_loss_bound_s == 33.0
    assert c.recovery_bound_s == pytest.approx(0.42 + 11 + 11)
    assert c.replacement_bound_s == (3 + 2) * 11.0 and c.peer_copy_timeout_s == 11.0
    assert c.launcher_deadline_s(steps=10, faults=2, per_fault_s=1.5) == pytest.approx(
        18 + 9 + 20 + 2 * (22.42 + 1.5) + 55
    )
    assert not c.notes
    assert [row[0] for row in c.table()][0] == "heartbeat detection bound"


def test_without_the_heartbeat_the_data_path_bounds_detection():
    c = RecoveryConfig(data_timeout_s=45.0, heartbeat=False)
    assert c.detection_bound_s == 45.0 and not c.notes
    with pytest.raises(Exception, match=r"stall \(1.5 s\) must outlast the data-path timeout \(45"):
        TrialConfig(fault_kind="stall", stall_s=1.5, data_timeout_s=45.0, heartbeat=False)
    ok = TrialConfig(fault_kind="stall", stall_s=1.5, data_timeout_s=45.0)  # the heartbeat is on by default
    assert ok.recovery().heartbeat and ok.recovery().detection_bound_s == pytest.approx(0.2)


def test_a_process_start_longer_than_group_creation_sets_the_round():
    c = RecoveryConfig(process_start_s=40.0, group_create_s=3.0)
    assert c.consensus_round_s == 40.0 and c.rank_loss_bound_s == 160.0


def test_a_consensus_round_shorter_than_group_creation_is_refused_naming_both():
    with pytest.raises(TimeoutOrderError) as info:
        RecoveryConfig(process_start_s=2.0, group_create_s=12.5, consensus_round_s_override=4.0)
    msg = str(info.value)
    assert "consensus round (4 s)" in msg and "group creation (12.5 s)" in msg and "\n" not in msg


def test_a_consensus_round_shorter_than_a_process_start_is_refused():
    with pytest.raises(TimeoutOrderError, match=r"consensus round \(5 s\).*process start \(9 s\)"):
        RecoveryConfig(process_start_s=9.0, group_create_s=1.0, consensus_round_s_override=5.0)


@pytest.mark.parametrize(
    "kw",
    [
        {"heartbeat_interval_s": 0.0},
        {"data_timeout_s": -1.0},
        {"heartbeat_misses": 0},
        {"max_rounds": 0},
        {"group_create_s": float("nan")},
    ],
)
def test_non_positive_or_nan_inputs_are_refused(kw):
    name = next(iter(kw))
    with pytest.raises(TimeoutOrderError, match=name):
        RecoveryConfig(**kw)


def test_a_heartbeat_slower_than_the_data_path_is_allowed_but_reported():
    c = RecoveryConfig(data_timeout_s=0.3, heartbeat_interval_s=0.2, heartbeat_misses=2, heartbeat=True)
    assert c.detection_bound_s == 0.3
    assert len(c.notes) == 1 and "(0.6 s)" in c.notes[0] and "(0.3 s)" in c.notes[0]


def test_a_launcher_deadline_shorter_than_the_rank_loss_bound_is_refused():
    with pytest.raises(TimeoutOrderError, match=r"deadline \(50 s\).*rank-loss bound \(120 s"):
        TrialConfig(timeout_s=50.0)  # 4 rounds x 30 s
    assert TrialConfig(timeout_s=120.0).deadline_s == 120.0


def test_the_trial_deadline_grows_with_steps_faults_and_stalls():
    short = TrialConfig(steps=10, faults=1, checkpoint_every=5)
    longer = TrialConfig(steps=40, faults=10)
    stall = TrialConfig(steps=40, faults=10, fault_kind="stall", stall_s=3.0)
    assert short.deadline_s < longer.deadline_s < stall.deadline_s
    assert stall.deadline_s - longer.deadline_s == pytest.approx(10 * 3.0)
    assert short.deadline_s >= short.recovery().rank_loss_bound_s


def test_the_cli_refuses_a_deadline_below_the_rank_loss_bound_in_one_line(capsys):
    assert main(["live", "recover", "--ranks", "2", "--steps", "5", "--checkpoint-every", "5", "--timeout", "30"]) == 2
    err = capsys.readouterr().err
    assert "rank-loss bound" in err and "(30 s)" in err and "Traceback" not in err
