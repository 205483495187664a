"""Checkpoint baselines start only once the fault itself has cleared, as a real restore would."""

from __future__ import annotations

import pytest

from meshpact.live.trials.trial import TrialConfig, TrialResult


def _result(kind: str) -> TrialResult:
    cfg = TrialConfig(ranks=2, steps=8, faults=1, checkpoint_every=4, fault_kind=kind, data_timeout_s=0.5, stall_s=1.5, down_s=2.0)
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
