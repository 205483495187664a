"""Training with faults, checked against arithmetic done by hand, not against the simulator."""

from __future__ import annotations

import math

import pytest

from meshpact.core.recovery import Policy, Stage
from meshpact.core.recovery_costs import FaultImpact, RecoveryCosts, estimate_recovery
from meshpact.simulator.faults import cluster_rate_per_s, fault_trace
from meshpact.simulator.training import simulate_training

STEP, K, C = 2.0, 50, 7.0  # step seconds, steps per checkpoint, checkpoint seconds


def _base(make_scenario, faults=None, mode="sync", days=None, every=K, **workload):
    return make_scenario(
        workload={
            "model": "qwen3-14b",
            "step_seconds": STEP,
            "parallelism": {"tensor": 4},
            "days": days or 1.0,
            **workload,
        },
        faults=faults or {},
        checkpointing={"every_steps": every, "mode": mode, "seconds": C},
    )


def test_no_faults_goodput_is_one_minus_checkpoint_overhead_exactly(make_scenario):
    cycles = 1000
    days = cycles * (K * STEP + C) / 86400.0
    r = simulate_training(_base(make_scenario, days=days))
    for p in Policy:
        res = r.policies[p]
        assert res.faults == 0 and res.lost_steps == 0
        # peer copies stretch every step (their host copy never hides); no other policy pays per step
        extra = res.peer_copy_s_per_step
        assert (extra > 0) == (p is Policy.PEER_RESTORE)
        # the analytic value (the horizon is whole cycles of unstretched steps: the stretched end one cycle short)
        assert res.goodput == pytest.approx(K * STEP / (K * (STEP + extra) + C), rel=1e-3 if extra else 1e-12)
        if extra:
            continue
        assert res.goodput + res.checkpoint_fraction == pytest.approx(1.0, abs=1e-12)
        assert res.step_latency_overhead == pytest.approx(C / (K * STEP), rel=1e-9)
        assert sum(res.downtime_s.values()) == 0.0


def test_async_checkpoint_blocks_for_the_snapshot_and_holds_a_shard_in_host_memory(make_scenario):
    def sc(days: float):
        return make_scenario(
            workload={"model": "qwen3-14b", "step_seconds": STEP, "days": days},
            checkpointing={
                "every_steps": K,
                "mode": "async",
                "snapshot_gbyte_per_s_per_rank": 10.0,
                "write_gbyte_per_s_per_rank": 1.0,
            },
        )

    state = simulate_training(sc(0.01)).workload.state_bytes
    shard = state / 32
    snapshot_s = shard / 10e9
    cycles = 500
    days = cycles * (K * STEP + snapshot_s) / 86400.0
    r = simulate_training(sc(days)).policies[Policy.IN_MEMORY]
    assert r.host_memory_bytes_per_rank == pytest.approx(shard)
    assert r.step_latency_overhead == pytest.approx(snapshot_s / (K * STEP), rel=1e-9)
    assert r.goodput == pytest.approx(K * STEP / (K * STEP + snapshot_s), rel=1e-9)
    # every write (7.4 s) ends long before the next checkpoint: one whole state per checkpoint
    assert r.checkpoints == cycles - 1  # the last write is still running at the end
    assert r.storage_bytes_per_hour == pytest.approx((cycles - 1) * state / (days * 24.0))


def test_one_scripted_fault_loses_exactly_the_steps_since_the_last_checkpoint(make_scenario):
    # compute 0-100 s, checkpoint 100-107 (durable: 50), compute 107-207 (100 steps),
    # checkpoint 207-214 (durable: 100), fault at 254 s: 20 steps past the checkpoint.
    sc = _base(make_scenario, faults={"scripted": [{"at_s": 254.0, "rank": 5}]})
    r = simulate_training(sc, days=0.01)
    # the reload reads this job's shard (Qwen3-14B's 16 B per parameter over 32 ranks), not a default
    shard = r.workload.state_bytes / 32
    assert shard == pytest.approx(14.77e9 * 16 / 32, rel=0.01)
    costs = RecoveryCosts(state_bytes_per_rank=shard)
    for p in (Policy.COLD_RESTART, Policy.CHECKPOINT_RESTORE):
        res = r.policies[p]
        assert res.faults == 1 and res.lost_steps == 20 and res.replayed_steps == 20
        want = estimate_recovery(p, 32, costs, replay_steps=20, step_s=STEP).durations_s
        assert res.downtime_s[Stage.REPLAY] == pytest.approx(20 * STEP)
        assert res.downtime_s[Stage.STATE] == pytest.approx(shard / 2e9)
        for stage, seconds in want.items():
            assert res.downtime_s[stage] == pytest.approx(seconds)
    mem = r.policies[Policy.IN_MEMORY]
    assert mem.lost_steps == 0 and mem.downtime_s[Stage.REPLAY] == 0.0
    assert mem.downtime_total_s == pytest.approx(estimate_recovery(Policy.IN_MEMORY, 32, costs).total_s)


def test_excise_runs_degraded_until_the_replica_rejoins(make_scenario):
    rejoin = 600.0
    sc = _base(make_scenario, faults={"scripted": [{"at_s": 1000.0, "rank": 9}], "rejoin_s": rejoin}, every=10**6)
    r = simulate_training(sc, days=0.1, policies=["excise", "in_memory"])
    ex = r.policies[Policy.EXCISE]
    stall = estimate_recovery(Policy.EXCISE, 32).total_s
    grow = estimate_recovery(Policy.EXCISE, 32).durations_s[Stage.COMMUNICATOR]
    # degraded from the fault until the replica is back in: the rejoin delay, then at most
    # step boundary, then the grown communicator (no checkpoint falls in this window)
    assert rejoin + grow <= ex.degraded_s <= rejoin + 8 / 7 * STEP + grow + 1e-6
    # 8 replicas of 4 ranks, 7 left: while degraded a step takes 8/7 as long
    computing = ex.degraded_s - stall - grow
    lost_work = computing * (1 - 7 / 8) / STEP + grow / STEP
    gap = r.policies[Policy.IN_MEMORY].committed_steps - ex.committed_steps
    assert gap == pytest.approx(lost_work, abs=1)
    assert ex.downtime_s[Stage.COMMUNICATOR] == pytest.approx(2 * grow)


def test_a_fault_during_recovery_restarts_it(make_scenario):
    sc = _base(make_scenario, faults={"scripted": [{"at_s": 500.0, "rank": 1}, {"at_s": 501.0, "rank": 2}]})
    r = simulate_training(sc, days=0.05, policies=["in_memory"]).policies[Policy.IN_MEMORY]
    assert r.recoveries == 2
    assert r.downtime_s[Stage.DETECTION] == pytest.approx(1.0 + RecoveryCosts().detection_s)


def test_a_lost_rank_waits_for_its_replacement(make_scenario):
    sc = _base(make_scenario, faults={"scripted": [{"at_s": 500.0, "rank": 1, "impact": "rank_loss"}]})
    result = simulate_training(sc, days=0.05, policies=["in_memory"])
    r = result.policies[Policy.IN_MEMORY]
    shard = result.workload.state_bytes_per_rank
    assert r.downtime_s[Stage.RESTART] == pytest.approx(RecoveryCosts().replacement_s)
    # no peer copies under in_memory: the lost shard is reloaded and everyone rolls back
    assert r.downtime_s[Stage.STATE] == pytest.approx(shard / 2e9) and r.lost_steps > 0


def test_every_policy_sees_the_same_fault_trace(make_scenario):
    sc = _base(make_scenario, faults={"rank_mtbf_hours": 50.0, "seed": 3})
    r = simulate_training(sc, days=2.0, policies=["cold_restart", "checkpoint_restore", "in_memory"])
    counts = {res.faults for res in r.policies.values()}
    assert counts == {len(r.trace)} and len(r.trace) > 10
    g = {p: res.goodput for p, res in r.policies.items()}
    assert g[Policy.IN_MEMORY] > g[Policy.CHECKPOINT_RESTORE] and g[Policy.IN_MEMORY] > g[Policy.COLD_RESTART]


def test_superposed_fault_process_has_the_cluster_rate(make_scenario):
    sc = _base(make_scenario, faults={"rank_mtbf_hours": 1000.0, "rank_loss_mtbf_hours": 4000.0, "seed": 11})
    ranks, horizon = 4096, 30 * 86400.0
    trace = fault_trace(sc.faults, ranks, horizon)
    mean = (cluster_rate_per_s(1000.0, ranks) + cluster_rate_per_s(4000.0, ranks)) * horizon
    assert abs(len(trace) - mean) < 5 * math.sqrt(mean)
    losses = sum(f.impact is FaultImpact.RANK_LOSS for f in trace)
    assert losses / len(trace) == pytest.approx(0.2, abs=0.03)
    assert all(0 <= f.rank < ranks for f in trace) and list(trace) == sorted(trace, key=lambda f: (f.t, f.rank))


def test_cost_grows_with_events_not_ranks(make_scenario):
    sc = _base(make_scenario, days=3.0)
    small = simulate_training(sc, ranks=32)
    large = simulate_training(sc, ranks=16384)
    for p in Policy:
        if p is Policy.PEER_RESTORE:  # its copy stretches each step by the shard, smaller at more ranks: more steps
            assert len(large.policies[p].timeline) >= len(small.policies[p].timeline)
            continue
        assert len(large.policies[p].timeline) == len(small.policies[p].timeline)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_wall_time_is_accounted_for_exactly(make_scenario, mode):
    # wall time = fresh compute + uncommitted partial steps + checkpoint stalls + recovery stages
    sc = _base(make_scenario, faults={"rank_mtbf_hours": 40.0, "rank_loss_mtbf_hours": 400.0, "seed": 2}, mode=mode)
    r = simulate_training(sc, days=3.0, policies=["cold_restart", "checkpoint_restore", "in_memory"])
    horizon = 3 * 86400.0
    for res in r.policies.values():
        assert res.faults > 20 and 0 <= res.replayed_steps <= res.lost_steps
        fresh = res.committed_steps - res.replayed_steps + res.lost_steps
        spent = fresh * STEP + res.lost_compute_s + res.checkpoint_fraction * horizon + res.downtime_total_s
        assert spent == pytest.approx(horizon, abs=1e-6)


def test_excise_with_a_single_replica_falls_back_to_checkpoint_restore(make_scenario):
    sc = _base(make_scenario, faults={"scripted": [{"at_s": 254.0, "rank": 5}]}, parallelism={"tensor": 32})
    r = simulate_training(sc, days=0.01, policies=["excise", "checkpoint_restore"])
    ex, ck = r.policies[Policy.EXCISE], r.policies[Policy.CHECKPOINT_RESTORE]
    assert ex.lost_steps == ck.lost_steps == 20 and ex.degraded_s == 0.0
    assert ex.downtime_s == ck.downtime_s


def test_a_transient_fault_during_a_replacement_waits_only_for_what_is_left(make_scenario):
    faults = {"scripted": [{"at_s": 500.0, "rank": 1, "impact": "rank_loss"}, {"at_s": 600.0, "rank": 2}]}
    r = simulate_training(_base(make_scenario, faults=faults), days=0.05, policies=["in_memory"])
    res = r.policies[Policy.IN_MEMORY]
    costs = RecoveryCosts()
    # the replacement is asked for once the loss is detected (505 s) and ready at 805 s; the
    # second fault does not start that wait again: its recovery waits only for what is left
    ready = 500.0 + costs.detection_s + costs.replacement_s
    restart_start = 500.0 + costs.detection_s  # stages in order: detection, then the replacement
    left = ready - (600.0 + costs.detection_s)
    assert res.downtime_s[Stage.RESTART] == pytest.approx((600.0 - restart_start) + left)
    assert res.scheduler_replacements == 1
