"""A rank killed with SIGKILL: checkpoint restore with a replacement process, nothing lost."""

from __future__ import annotations

import pytest

from _recovery import assert_recovered, trial

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_killed_rank_is_replaced_and_restored_from_checkpoint_bit_identical():
    result = trial(ranks=4, steps=16, faults=1, fault_kind="kill", checkpoint_every=4, baselines=False)
    s = assert_recovered(result, "checkpoint_restore")
    assert s["replacement_processes"] == 1
    (rec,) = result.recoveries()
    assert "hold no intact state" in rec["reason"] or "did not answer" in rec["reason"]
    # the group restores the newest checkpoint at or before the killed step and replays the rest,
    # drawing their batches again from the workload (the replacement has no buffer)
    killed_at = result.faults[0].step
    assert rec["lost_steps"] == killed_at - (killed_at // 4) * 4
    assert rec["stages_s"].get("replay") is not None
