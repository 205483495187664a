"""A rank stalled past the data-path timeout: detected by the timeout, recovered in memory."""

from __future__ import annotations

import pytest

from _recovery import assert_recovered, trial
from meshpact.core.recording import EventKind

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_stalled_rank_is_detected_by_the_timeout_and_recovered_in_memory():
    result = trial(
        ranks=4,
        steps=8,
        faults=2,
        fault_kind="stall",
        checkpoint_every=4,
        baselines=False,
        data_timeout_s=0.5,
        stall_s=1.0,
    )
    assert_recovered(result, "in_memory")
    # the faults' recoveries (under heavy load a 0.5 s data path may also time out on a slow step:
    # recovered in memory too, and counted by assert_recovered, but no fault's detection)
    stalled = [r for r in result.recoveries() if r["step"] in {f.step for f in result.faults}]
    assert len(stalled) == len(result.faults)
    for r in stalled:
        assert r["stages_s"]["detection"] >= 0.5  # bounded by the data-path timeout, not faster


def test_with_a_long_data_path_timeout_the_heartbeat_finds_the_stall():
    # a 30 s data path would wait out the 2 s stall and never fault: only the heartbeat can find it
    result = trial(
        ranks=4,
        steps=8,
        faults=2,
        fault_kind="stall",
        checkpoint_every=4,
        baselines=False,
        data_timeout_s=30.0,
        stall_s=2.0,
        heartbeat=True,
    )
    assert_recovered(result, "in_memory")
    stalled = {f.step: f.rank for f in result.faults}
    found = [e for e in result.events() if e.event == EventKind.DETECTED and e.data.get("heartbeat_stalled")]
    for r in result.recoveries():
        assert r["detection_s"] < 2.0  # the first rank knew before the stalled rank woke up
        assert any(stalled[r["step"]] in e.data["heartbeat_stalled"] for e in found if e.data["step"] == r["step"])
