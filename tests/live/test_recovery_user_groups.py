"""Groups the user keeps in their own variables are rebuilt and rebound with the job's.

The workload, written here as a user would, makes its own groups in ``build`` and keeps them
where Python code keeps things: a module global holding ``new_subgroups``' result (this
rank's pair and the list of every pair), a module global ``new_group`` over every rank, a
dict by name, and a closure. ``train_step`` all-reduces a metric over the pair and over
every rank and scales the loss by it, so a step that reached a retired group would fail or
change the numbers. A recovery must rebind each variable, release every retired group (the
generation-0 group over all ranks included) and leave the retired groups without a single
operation.
"""

from __future__ import annotations

import textwrap

import pytest

from _recovery import assert_recovered, trial

pytestmark = [pytest.mark.live, pytest.mark.slow]

USER_GROUPS_WORKLOAD = textwrap.dedent('''
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    PAIRS = None      # dist.new_subgroups(2): (this rank's pair, [every pair])
    EVERYONE = None   # dist.new_group over every rank
    BY_NAME = {}      # groups by a name of the user's
    REDUCE = None     # a closure over the pair


    def _mean_over(group):
        def reduce(x):
            dist.all_reduce(x, group=group)
            return x / dist.get_world_size(group)
        return reduce


    def build(mesh):
        global PAIRS, EVERYONE, REDUCE
        PAIRS = dist.new_subgroups(group_size=2)
        EVERYONE = dist.new_group(list(range(dist.get_world_size())))
        BY_NAME["pair"] = PAIRS[0]
        REDUCE = _mean_over(PAIRS[0])
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Dropout(0.1), torch.nn.GELU(),
                                    torch.nn.Linear(32, 16))
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


    def batch(step, rank):
        return torch.randn(8, 16, generator=torch.Generator().manual_seed(97 * step + rank))


    def train_step(model, optimizer, batch):
        loss = model(batch).pow(2).mean()
        pair = REDUCE(loss.detach().clone())
        everyone = loss.detach().clone()
        dist.all_reduce(everyone, group=EVERYONE)
        ranks = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(ranks, group=BY_NAME["pair"])
        (loss / (1.0 + pair + 0.1 * everyone + 0.01 * ranks)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)
''')


def test_groups_in_user_variables_are_rebound_and_every_retired_group_released(tmp_path):
    path = tmp_path / "user_groups.py"
    path.write_text(USER_GROUPS_WORKLOAD)
    result = trial(ranks=4, steps=6, faults=2, fault_kind="collective", checkpoint_every=3, baselines=False,
                   workload=str(path))
    s = assert_recovered(result, "in_memory")
    assert s["old_group_ops_after_rebind"] == 0
    for rank in result.faulted:
        retired = [r.group for r in rank.retired]
        users = [g for g in retired if not g.startswith("meshpact_")]
        # two recoveries, each replacing the group over all ranks and the user's pair and everyone groups
        assert len(retired) == 6 and len(users) == 4, retired
        # torch named them (no generation); their replacements carry the generation
        assert sum(g.endswith("_g1") for g in users) == 2 and sum("_g" not in g for g in users) == 2, users
        # released: nothing holds a retired group any more, generation 0 included
        assert [r.group for r in rank.retired if r.alive] == []
        assert all(r.seq_ops_after == 0 for r in rank.retired), rank.retired
