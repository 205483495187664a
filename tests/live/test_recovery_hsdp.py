"""HSDP on a 2 x 2 (replicate x shard) mesh: both dimensions' groups rebuilt and rebound."""

from __future__ import annotations

import pytest

from _recovery import assert_recovered, trial

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_llama_hsdp_recovers_in_memory_bit_identical_with_every_group_replaced():
    result = trial(ranks=4, steps=6, faults=2, fault_kind="collective", checkpoint_every=3, baselines=False,
                   workload="llama_hsdp")
    assert_recovered(result, "in_memory")
    for rank in result.faulted:
        retired = {r.group.rsplit("_g", 1)[0] for r in rank.retired}
        # the world group and this rank's replicate and shard groups, each replaced
        assert "meshpact_data" in retired
        assert any(g.startswith("meshpact_replicate_") for g in retired)
        assert any(g.startswith("meshpact_shard_") for g in retired)
        assert all(g.endswith(f"_g{rank.generation}") for g in rank.current_groups)
        # every retired group is released, the generation-0 ones included, and received nothing
        assert [r.group for r in rank.retired if r.alive] == []
        assert all(r.seq_ops_after == 0 for r in rank.retired), rank.retired
