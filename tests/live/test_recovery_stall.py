"""A rank stalled past the data-path timeout: detected by the timeout, recovered in memory."""

from __future__ import annotations

import pytest

from _recovery import assert_recovered, trial

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_stalled_rank_is_detected_by_the_timeout_and_recovered_in_memory():
    result = trial(ranks=4, steps=16, faults=2, fault_kind="stall", checkpoint_every=4, baselines=False,
                   data_timeout_s=0.5, stall_s=1.0)
    assert_recovered(result, "in_memory")
    for r in result.recoveries():
        assert r["stages_s"]["detection"] >= 0.5  # bounded by the data-path timeout, not faster
