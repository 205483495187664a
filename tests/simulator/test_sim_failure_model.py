"""The failure model: node and rack failures, hangs, stragglers, spares and what each policy pays.

Expectations are worked out by hand from the scenario's numbers, not read back from the
simulator.
"""

from __future__ import annotations

import numpy as np
import pytest

from meshpact.core.recovery import Policy, Stage
from meshpact.core.recovery_costs import (
    POLICY_MODELS,
    RecoveryCosts,
    estimate_recovery,
    peer_copy_seconds_per_step,
)
from meshpact.simulator.faults import fault_trace
from meshpact.simulator.training import simulate_training
from meshpact.simulator.workload import expected_max_of_normals

STEP, K, C = 2.0, 50, 7.0


def _sc(make_scenario, faults=None, policies=None, **workload):
    return make_scenario(
        workload={"model": "qwen3-14b", "step_seconds": STEP, "parallelism": {"tensor": 4}, "days": 0.05, **workload},
        faults=faults or {},
        checkpointing={"every_steps": K, "mode": "sync", "seconds": C},
        recovery={"policies": policies or [p.value for p in Policy]},
    )


def test_every_policy_names_its_assumption_and_has_a_record():
    assert set(POLICY_MODELS) == set(Policy)
    assert all(m.assumes and m.policy is p for p, m in POLICY_MODELS.items())
    # only the policy that keeps peer copies is charged for them
    assert [p for p, m in POLICY_MODELS.items() if m.peer_copies] == [Policy.PEER_RESTORE]


def test_node_and_rack_failures_take_whole_failure_domains(make_scenario):
    faults = {
        "rank_loss_mtbf_hours": 50.0,
        "node_fraction": 0.5,
        "rack_fraction": 0.25,
        "ranks_per_node": 8,
        "nodes_per_rack": 4,
        "seed": 4,
    }
    sc = _sc(make_scenario, faults=faults)
    ranks, horizon = 4096, 30 * 86400.0
    trace = fault_trace(sc.faults, ranks, horizon)
    spans = np.array([f.span for f in trace])
    assert set(spans) == {1, 8, 32}
    assert (spans == 8).mean() == pytest.approx(0.5, abs=0.02)
    assert (spans == 32).mean() == pytest.approx(0.25, abs=0.02)
    assert all(f.rank % f.span == 0 and f.rank + f.span <= ranks for f in trace)
    # without node or rack failures the trace is the one drawn before they existed
    plain = fault_trace(sc.faults.model_copy(update={"node_fraction": 0.0, "rack_fraction": 0.0}), ranks, horizon)
    assert [(f.t, f.span) for f in plain] == [(f.t, 1) for f in trace]


def test_a_hang_is_found_by_the_heartbeat_or_by_the_watchdog(make_scenario):
    sc = _sc(
        make_scenario,
        faults={"scripted": [{"at_s": 500.0, "rank": 3, "impact": "hang"}]},
        policies=["checkpoint_restore", "in_memory"],
    )
    r = simulate_training(sc)
    costs = RecoveryCosts()
    assert r.policies[Policy.IN_MEMORY].downtime_s[Stage.DETECTION] == pytest.approx(costs.heartbeat_timeout_s)
    assert r.policies[Policy.CHECKPOINT_RESTORE].downtime_s[Stage.DETECTION] == pytest.approx(costs.watchdog_timeout_s)
    assert r.policies[Policy.IN_MEMORY].lost_steps == 0  # a hang leaves memory intact


def test_peer_restore_survives_a_node_loss_but_not_a_rack_loss(make_scenario):
    def run(scope: str):
        faults = {
            "scripted": [{"at_s": 500.0, "rank": 9, "impact": "rank_loss", "scope": scope}],
            "ranks_per_node": 8,
            "nodes_per_rack": 2,
        }
        # copies that cost next to no time (the host copy is never free): both policies step almost alike
        return simulate_training(
            _sc(make_scenario, faults=faults, ranks=32),
            policies=["peer_restore", "in_memory"],
            overrides={"recovery.costs.host_copy_bytes_per_s": 1e15},
        ).policies

    node = run("node")
    # 500 s is 20 steps past the checkpoint at 457 s (durable: 200 steps)
    assert node[Policy.PEER_RESTORE].lost_steps == 0
    assert node[Policy.IN_MEMORY].lost_steps > 0  # no peer copies: the checkpoint
    rack = run("rack")  # the copies of node 1 were on node 2, in the same rack
    # both back to the checkpoint: the steps since it agree but for the copies' microseconds per step
    assert rack[Policy.PEER_RESTORE].lost_steps > 0 and rack[Policy.IN_MEMORY].lost_steps > 0
    assert abs(rack[Policy.PEER_RESTORE].lost_steps - rack[Policy.IN_MEMORY].lost_steps) <= 1


def test_peer_copies_are_paid_every_step(make_scenario):
    sc = _sc(make_scenario, days=1.0, policies=["in_memory", "peer_restore"], step_seconds=0.2)
    r = simulate_training(sc)
    shard = r.workload.state_bytes_per_rank
    costs = RecoveryCosts()
    # the host copy on the training thread, then whatever of the ship outlasts the step (cores to spare)
    extra = shard / costs.host_copy_bytes_per_s + max(0.0, shard / costs.peer_bytes_per_s - 0.2)
    assert extra > 0 and peer_copy_seconds_per_step(shard, 0.2) == pytest.approx(extra)
    mem, peer = r.policies[Policy.IN_MEMORY], r.policies[Policy.PEER_RESTORE]
    assert peer.peer_copy_s_per_step == pytest.approx(extra)
    # without faults, goodput falls by the step's stretch (checkpoints cost both the same)
    assert peer.goodput / mem.goodput == pytest.approx((K * 0.2 + C) / (K * (0.2 + extra) + C), rel=2e-3)
    assert peer.host_memory_bytes_per_rank == pytest.approx(mem.host_memory_bytes_per_rank + shard)


def test_spares_replace_lost_ranks_in_seconds_and_refill_after_repair(make_scenario):
    losses = [
        {"at_s": t, "rank": 8 * i, "impact": "rank_loss", "scope": "node"}
        for i, t in enumerate((500.0, 2000.0, 3500.0))
    ]
    faults = {"scripted": losses, "spare_ranks": 8, "repair_hours": 2000.0 / 3600}
    sc = _sc(make_scenario, faults=faults, ranks=32, policies=["in_memory"], days=0.06)
    r = simulate_training(sc).policies[Policy.IN_MEMORY]
    costs = RecoveryCosts()
    # 500 s: the spare node joins; it is back in the pool at 2,500 s, so the loss at 2,000 s
    # waits for the scheduler; the loss at 3,500 s finds the repaired node
    assert (r.spares_used, r.scheduler_replacements) == (16, 8)
    assert r.downtime_s[Stage.RESTART] == pytest.approx(2 * costs.spare_join_s + costs.replacement_s)


def test_stragglers_stretch_every_step_by_the_expected_slowest_rank(make_scenario):
    n = 64
    draws = np.random.default_rng(1).standard_normal((4000, n)).max(axis=1).mean()
    assert expected_max_of_normals(n) == pytest.approx(draws, rel=0.01)
    assert expected_max_of_normals(2) == pytest.approx(1 / np.sqrt(np.pi), rel=1e-4)
    cv = 0.05
    r = simulate_training(_sc(make_scenario, ranks=n, step_time_cv=cv, days=0.5, policies=["in_memory"]))
    factor = 1 + cv * expected_max_of_normals(n)
    assert r.workload.straggler_factor == pytest.approx(factor)
    steady = K * STEP / (K * STEP * factor + C)
    assert r.policies[Policy.IN_MEMORY].goodput == pytest.approx(steady, rel=2e-3)


def test_fixed_work_ends_when_the_steps_are_committed(make_scenario):
    sc = _sc(
        make_scenario,
        work_steps=1000,
        days=10.0,
        policies=["checkpoint_restore", "in_memory"],
        faults={"scripted": [{"at_s": 254.0, "rank": 5}]},
    )
    r = simulate_training(sc)
    ck, mem = r.policies[Policy.CHECKPOINT_RESTORE], r.policies[Policy.IN_MEMORY]
    checkpoints = 1000 // K - 1  # the run ends at the last step, before its checkpoint
    for p, res in r.policies.items():
        want = (
            1000 * STEP
            + checkpoints * C
            + estimate_recovery(
                p,
                32,
                RecoveryCosts(state_bytes_per_rank=r.workload.state_bytes_per_rank),
                replay_steps=res.lost_steps,
                step_s=STEP,
            ).total_s
        )
        assert res.finished and res.committed_steps == 1000
        assert res.time_to_finish_s == pytest.approx(want + (254.0 - 214.0 - 20 * STEP), abs=1e-6)
    assert ck.time_to_finish_s > mem.time_to_finish_s
    short = simulate_training(sc, days=0.01).policies[Policy.IN_MEMORY]
    assert short.finished is False and short.time_to_finish_s is None


def test_faults_by_checkpoint_age_strike_at_that_age_under_every_policy(make_scenario):
    sc = _sc(
        make_scenario,
        work_steps=10 * K,
        days=1.0,
        policies=["checkpoint_restore", "in_memory"],
        faults={"at_checkpoint_age": {"steps": 7, "count": 4}},
    )
    r = simulate_training(sc)
    ck, mem = r.policies[Policy.CHECKPOINT_RESTORE], r.policies[Policy.IN_MEMORY]
    assert ck.faults == mem.faults == 4
    assert ck.lost_steps == 4 * 7 and mem.lost_steps == 0
    faults = [e for e in ck.timeline if e.kind == "fault"]
    # the k-th fault is 7 steps into the k-th interval; each earlier one cost a recovery and a replay
    ck_stall = estimate_recovery(
        "checkpoint_restore",
        32,
        RecoveryCosts(state_bytes_per_rank=r.workload.state_bytes_per_rank),
        replay_steps=7,
        step_s=STEP,
    ).total_s
    want = [k * (K * STEP + C) + 7 * STEP + k * ck_stall for k in range(4)]
    assert [e.t for e in faults] == pytest.approx(want)


def test_accelpact_ratio_grows_linearly_with_checkpoint_age_from_one():
    from meshpact.core.scenario import builtin_scenario_path, load_scenario

    sc = load_scenario(builtin_scenario_path("accelpact_checkpoint_age"))
    ages = [3, 9, 15, 21]
    ratios = []
    for a in ages:
        r = simulate_training(sc, overrides={"faults.at_checkpoint_age.steps": a}).policies
        assert r[Policy.CHECKPOINT_RESTORE].lost_steps == 10 * a
        ratios.append(r[Policy.CHECKPOINT_RESTORE].time_to_finish_s / r[Policy.IN_MEMORY].time_to_finish_s)
    slope, intercept = np.polyfit(ages, ratios, 1)
    assert np.allclose(ratios, intercept + slope * np.array(ages), rtol=1e-3)  # a line
    assert intercept == pytest.approx(1.0, abs=0.01)  # measured stage costs are alike: the line starts at 1
    assert slope > 0
