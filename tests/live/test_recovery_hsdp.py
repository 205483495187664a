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
        # groups built by a recovery are released outright once retired (the generation-0 group
        # over all ranks is still held from torch's side once FSDP has run: see the README)
        assert not any(r.alive for r in rank.retired if not r.group.endswith("_g0")), rank.retired
        assert not any(r.alive for r in rank.retired if r.group.startswith(("meshpact_replicate",
                                                                                         "meshpact_shard")))
