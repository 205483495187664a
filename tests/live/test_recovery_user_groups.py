"""Groups the user makes after ``start_session`` are rebuilt and rebound with the job's, and a
replacement's script joins them.

The workload, written here as a user would, makes its own groups in ``build`` (after the
session started) and keeps them where Python code keeps things: a module global holding
``new_subgroups``' result (this rank's pair and the list of every pair), a module global
``new_group`` over every rank, a dict by name, a closure, and a 2 x 2 ``DeviceMesh`` of its own.
``train_step`` all-reduces a metric over the pair, over every rank and over a dimension of its
mesh and scales the loss by it, so a step that reached a retired group would fail or change
the numbers. Its model is two parts (pipeline parallel's list), each sharded on its own.

Ranks are killed under ``meshpact launch`` with peer copies: the survivors rebuild every
group while the replacement, running the same script, builds the session's groups and then
the user's at start-up, matched by creation order; the run must end bit-identical. The
survivors must rebind each variable, release every retired group (the generation-0 group over
all ranks included) and leave the retired groups without a single operation.
"""

from __future__ import annotations

import textwrap

import pytest

from meshpact.core.recording import EventKind

from _recovery import assert_recovered, trial

pytestmark = [pytest.mark.live, pytest.mark.slow]

USER_GROUPS_WORKLOAD = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    PAIRS = None      # dist.new_subgroups(2): (this rank's pair, [every pair])
    EVERYONE = None   # dist.new_group over every rank
    BY_NAME = {}      # groups by a name of the user's
    REDUCE = None     # a closure over the pair
    OWN_MESH = None   # a DeviceMesh of the user's own (its groups made through new_group)


    def _mean_over(group):
        def reduce(x):
            dist.all_reduce(x, group=group)
            return x / dist.get_world_size(group)
        return reduce


    def build(mesh):
        global PAIRS, EVERYONE, REDUCE, OWN_MESH
        PAIRS = dist.new_subgroups(group_size=2)
        EVERYONE = dist.new_group(list(range(dist.get_world_size())))
        BY_NAME["pair"] = PAIRS[0]
        REDUCE = _mean_over(PAIRS[0])
        OWN_MESH = init_device_mesh("cpu", (2, 2), mesh_dim_names=("across", "within"))
        torch.manual_seed(5)
        first = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.GELU())
        second = torch.nn.Linear(32, 16)
        fully_shard(first, mesh=mesh)
        fully_shard(second, mesh=mesh)
        parts = [first, second]
        return parts, torch.optim.AdamW([p for part in parts for p in part.parameters()], lr=1e-2)


    def batch(step, rank):
        return torch.randn(8, 16, generator=torch.Generator().manual_seed(97 * step + rank))


    def train_step(model, optimizer, batch):
        first, second = model  # the runtime keeps the parts as one list (rt.model)
        loss = second(first(batch)).pow(2).mean()
        pair = REDUCE(loss.detach().clone())
        everyone = loss.detach().clone()
        dist.all_reduce(everyone, group=EVERYONE)
        ranks = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(ranks, group=BY_NAME["pair"])
        across = loss.detach().clone()
        dist.all_reduce(across, group=OWN_MESH.get_group("across"))
        (loss / (1.0 + pair + 0.1 * everyone + 0.01 * ranks + 0.001 * across)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)
""")


def test_a_replacement_joins_the_groups_its_script_makes_after_start_session_bit_identical(tmp_path):
    path = tmp_path / "user_groups.py"
    path.write_text(USER_GROUPS_WORKLOAD)
    result = trial(
        ranks=4,
        steps=6,
        faults=2,
        fault_kind="kill",
        peer_copies=1,
        checkpoint_every=3,
        baselines=False,
        workload=str(path),
    )
    s = assert_recovered(result, "peer_restore")
    assert s["replacement_processes"] == 2 and s["storage_bytes_read"] == 0
    assert s["old_group_ops_after_rebind"] == 0
    # each replacement built the session's groups and the user's six (two pairs, everyone, the own
    # mesh's four slices) ahead of its script, at the generation the survivors rebuilt
    joined = [e for e in result.events() if e.event == EventKind.REBUILT and "user_groups" in e.data]
    assert len(joined) == 2 and all(e.data["user_groups"] == 7 for e in joined), [e.data for e in joined]
    survivors = [rank for rank in result.faulted if rank.incarnation == 0 and len(rank.recoveries) == 2]
    assert survivors, [(r.rank, r.incarnation, len(r.recoveries)) for r in result.faulted]
    for rank in survivors:
        retired = [r.group for r in rank.retired]
        users = [g for g in retired if not g.startswith("meshpact_")]
        # two recoveries, each replacing the group over all ranks and the user's pair, everyone and
        # own-mesh groups (this rank in one slice of each of its two dimensions)
        assert len(retired) == 10 and len(users) == 8, retired
        # named by creation order on every rank: pairs 0-1, everyone 2, the mesh's "across" slices 3-4
        # and its "within" slices 5-6; generation 0's and their replacements'
        mine = {f"user{rank.rank // 2}", "user2", f"user{3 + rank.rank % 2}", f"user{5 + rank.rank // 2}"}
        assert {g.rsplit("_g", 1)[0] for g in users} == mine, users
        assert sum(g.endswith("_g0") for g in users) == 4, users
        # released: nothing holds a retired group any more, generation 0 included
        assert [r.group for r in rank.retired if r.alive] == []
        assert all(r.seq_ops_after == 0 for r in rank.retired), rank.retired
