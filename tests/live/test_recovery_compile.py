"""A torch.compile'd workload recovers bit-identically and keeps running compiled graphs."""

from __future__ import annotations

import pytest

from _recovery import assert_recovered, trial

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_compiled_blocks_run_compiled_before_and_after_an_in_memory_recovery():
    # operations are counted by the backends' sequence numbers, which leave dynamo alone
    result = trial(ranks=2, steps=6, faults=1, fault_kind="collective", checkpoint_every=3, baselines=False,
                   workload="compiled", data_timeout_s=20.0)
    assert_recovered(result, "in_memory")
    for rank in result.faulted:
        assert rank.compiled_graphs >= 1
        assert rank.compiled_regions["before_first_fault"] > 0, rank.compiled_regions
        assert rank.compiled_regions["after_last_recovery"] > 0, rank.compiled_regions
