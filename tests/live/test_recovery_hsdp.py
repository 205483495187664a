"""HSDP on a 2 x 2 (replicate x shard) mesh: both dimensions' groups rebuilt and rebound, and
ranks killed in either replicate group restored from a peer's host memory, bit-identical."""

from __future__ import annotations

import pytest

from meshpact.core.recording import EventKind

from _recovery import assert_recovered, recoveries_told, trial

pytestmark = [pytest.mark.live, pytest.mark.slow]

_RUN = dict(ranks=4, steps=6, checkpoint_every=3, baselines=False, workload="llama_hsdp")


def test_llama_hsdp_recovers_in_memory_bit_identical_with_every_group_replaced():
    result = trial(faults=2, fault_kind="collective", **_RUN)
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


# llama_hsdp with a data loader that takes a moment: every commit's copy has reached its holder before
# the next step starts, so a killed rank's newest copy is held and the survivors keep their state in
# memory (no roll back to their own snapshot), even though the failed step ran forward on some of them
_SLOW_LOADER = """
import time

from meshpact.scenarios.workloads import llama_hsdp

MESH = {"shape": [2, 2], "names": ["replicate", "shard"]}


def build(mesh):
    return llama_hsdp.build(mesh)


def batch(step, rank):
    time.sleep(0.5)
    return llama_hsdp.batch(step, rank)


def train_step(model, optimizer, batch):
    return llama_hsdp.train_step(model, optimizer, batch)
"""


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Kills of ranks 0, 1 and 2 at steps 1, 2 and 3: 0 and 1 in replicate group 0, 2 in group 1."""
    path = tmp_path_factory.mktemp("hsdp-slow-loader") / "llama_hsdp_slow_loader.py"
    path.write_text(_SLOW_LOADER)
    # a killed rank's sockets close, so the survivors hear of it at once: the data-path timeout
    # does not bound detection here, and at the trial's 1 s a slow first step of a replacement
    # under the suite's load could time out and add a recovery this test does not count on
    result = trial(
        ranks=4,
        steps=4,
        checkpoint_every=3,
        baselines=False,
        workload=str(path),
        faults=3,
        fault_kind="kill",
        peer_copies=1,
        data_timeout_s=5.0,
    )
    assert [(f.rank, f.step) for f in result.faults] == [(0, 1), (1, 2), (2, 3)]
    return result


def test_llama_hsdp_kills_are_restored_from_peers_without_storage_bit_identical(killed):
    s = assert_recovered(killed, "peer_restore")
    assert s["policy_counts"]["peer_restore"] == 3 and s["policy_counts"]["checkpoint_restore"] == 0, recoveries_told(
        killed
    )
    assert s["replacement_processes"] == 3 and s["storage_bytes_read"] == 0 and s["final_world_size"] == 4
    actions = [ev.data["action"] for ev in killed.events() if ev.event in (EventKind.RELOADED, EventKind.RETAINED)]
    assert "reload_checkpoint" not in actions and actions.count("peer_recover") == 3  # only the replacements


def test_llama_hsdp_a_kill_in_either_replicate_group_leaves_the_other_group_its_state(killed):
    peer = {r["step"]: r for r in killed.recoveries() if r["policy"] == "peer_restore"}
    for f in killed.faults:  # each from the rank the ring placed its copy on; nobody rolled back
        assert f"rank {f.rank} <- rank {f.rank + 1}" in peer[f.step]["reason"], peer[f.step]
        assert "roll back" not in peer[f.step]["reason"], (
            f"the killed rank's newest copy had not reached its holder within the loader's 0.5 s: {peer[f.step]}"
        )
    # the survivors that kept their state at each kill: every rank but the killed one, the other
    # replicate group's included (ranks 2 and 3 for the kills of 0 and 1, ranks 0 and 1 for the kill of 2)
    kept: dict[int, set[int]] = {}
    for ev in killed.events():
        if ev.event == EventKind.RETAINED and "checkpoint_step" in ev.data:
            kept.setdefault(ev.data["checkpoint_step"], set()).add(ev.rank)
    assert kept == {1: {1, 2, 3}, 2: {0, 2, 3}, 3: {0, 1, 3}}, kept


def test_llama_hsdp_losing_a_rank_goes_on_on_the_other_replica_bit_identical_to_the_excising_reference():
    """A kill with no replacement: the killed rank's replica leaves whole (its other rank too),
    the other replica goes on with its shards unmoved on a 1 x 2 mesh (the shard group keeps
    its size), the same global batch shared over it, equal bit for bit to the excising
    reference (no fault, the same replica leaving at the same step, the same smaller world)."""
    result = trial(faults=1, fault_kind="kill", peer_copies=1, on_rank_loss="excise", **_RUN)  # _RUN's reference
    s = result.summary()
    assert s["bit_identical"], (s["mismatches"], recoveries_told(result))
    exc = s["excision"]
    assert exc["equal_to_excising_reference"] and exc["refused"] is None, exc
    assert s["policy_counts"]["excise"] == 1 and s["faults_recovered"] == 1 and s["storage_bytes_read"] == 0
    killed = result.faults[0].rank
    replica = {2 * (killed // 2), 2 * (killed // 2) + 1}
    assert sorted(o.rank for o in result.faulted) == sorted(set(range(4)) - replica)
    assert s["final_world_size"] == 2
    for o in result.faulted:
        (rec,) = o.excisions
        assert set(rec.lost) == replica and (rec.old_world, rec.new_world) == (4, 2) and rec.bytes_moved == 0, rec
        bases = {g.rsplit("_g", 1)[0] for g in o.current_groups}
        # the smaller world's own mesh: one replica of the same two-rank shard group
        assert bases == {"meshpact_data", "meshpact_replicate_0", "meshpact_replicate_1", "meshpact_shard_0-1"} - {
            f"meshpact_replicate_{1 - o.alive.index(o.rank)}"
        }, o.current_groups
    # the rank that lived through it left with its replica, and said why in one line
    (partner,) = replica - {killed}
    left = [
        e.data["left_with_replica"]
        for e in result.events()
        if e.event == EventKind.REBUILT and "left_with_replica" in e.data
    ]
    assert left == [
        f"rank {partner} leaves the job with its replica {sorted(replica)} (rank(s) [{killed}] lost): the "
        "HSDP job goes on on the other 1 replica(s)"
    ], left
