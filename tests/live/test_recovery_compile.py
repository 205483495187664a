"""Recovery works on a torch.compile'd model (FSDP2 collectives stay outside compiled graphs)."""

from __future__ import annotations

import pytest

from _recovery import trial

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_compiled_model_recovers_in_memory_bit_identical():
    # the dispatcher-level counter would keep dynamo from compiling; the backends' own
    # sequence numbers still count the operations each retired group receives
    result = trial(ranks=2, steps=4, faults=1, fault_kind="collective", checkpoint_every=2, baselines=False,
                   compile=True, count_ops=False, data_timeout_s=20.0)
    s = result.summary()
    assert s["bit_identical"], s["mismatches"]
    assert s["faults_recovered"] == 1 and s["policy_counts"]["in_memory"] >= 1
    assert s["old_group_ops_after_rebind"] == 0
    assert all(r.get("compiled_graphs", 0) >= 1 for r in result.faulted)
