"""The recovery cost model in core: stage durations as a function of ranks and policy."""

from __future__ import annotations

import pytest

from meshpact.core.recovery import Policy, Stage
from meshpact.core.recovery_costs import (
    DEFAULT_RECOVERY_COSTS,
    FaultImpact,
    RecoveryCosts,
    communicator_seconds,
    estimate_recovery,
)


@pytest.mark.parametrize("ranks", [8, 32, 1024, 16384])
def test_policies_order_by_cost_at_every_scale(ranks):
    total = {p: estimate_recovery(p, ranks, replay_steps=100, step_s=2.0).total_s for p in Policy}
    assert total[Policy.COLD_RESTART] > total[Policy.CHECKPOINT_RESTORE] > total[Policy.IN_MEMORY]


def test_cost_grows_with_log_of_ranks():
    c = DEFAULT_RECOVERY_COSTS
    grow = communicator_seconds(2048, c) - communicator_seconds(1024, c)
    assert grow == pytest.approx(c.rendezvous_per_log2_rank_s + c.comm_init_per_log2_rank_s)
    # the rendezvous at 16,384 ranks is the published 0.5 s
    assert c.rendezvous_per_log2_rank_s * 14 == pytest.approx(0.5)


def test_stage_names_per_policy():
    stages = {p: set(estimate_recovery(p, 64).durations_s) for p in Policy}
    assert Stage.RESTART in stages[Policy.COLD_RESTART]
    assert Stage.RESTART not in stages[Policy.IN_MEMORY]
    assert Stage.STATE not in stages[Policy.EXCISE]
    assert estimate_recovery(Policy.IN_MEMORY, 64).durations_s[Stage.STATE] == 0.0


def test_replay_and_reload_follow_their_inputs():
    costs = RecoveryCosts(state_bytes_per_rank=4e9, checkpoint_read_bytes_per_s=1e9)
    b = estimate_recovery("checkpoint_restore", 64, costs, replay_steps=30, step_s=1.5)
    assert b.durations_s[Stage.REPLAY] == pytest.approx(45.0) and b.lost_steps == 30
    assert b.durations_s[Stage.STATE] == pytest.approx(4.0)
    # in_memory keeps no peer copies: a lost rank means a checkpoint reload and a re-wrap
    lost = estimate_recovery("in_memory", 64, costs, impact=FaultImpact.RANK_LOSS)
    assert lost.durations_s[Stage.RESTART] == costs.replacement_s
    assert lost.durations_s[Stage.STATE] == pytest.approx(4.0)
    assert lost.durations_s[Stage.REBINDING] == costs.rewrap_s
    # peer_restore fetches the shard from a peer's copy and only rebinds
    peer = estimate_recovery("peer_restore", 64, costs, impact=FaultImpact.RANK_LOSS, replacement_s=30.0)
    assert peer.durations_s[Stage.RESTART] == 30.0
    assert peer.durations_s[Stage.STATE] == pytest.approx(4e9 / costs.peer_bytes_per_s)
    assert peer.durations_s[Stage.REBINDING] == costs.rebind_s


def test_negative_costs_are_refused():
    with pytest.raises(ValueError, match="must be finite and >= 0"):
        RecoveryCosts(detection_s=-1)
