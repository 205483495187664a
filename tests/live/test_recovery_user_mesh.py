"""A model sharded on a mesh the user built: its groups are found, replaced and rebound by name.

The workload makes its own 2-D mesh with ``init_device_mesh`` (a singleton ``rep`` dimension,
so torch creates a group of its own for it, and a ``mine`` dimension over every rank that
reuses the default group by name) and calls ``full_tensor()`` every step, which resolves the
mesh's group names through c10d: a name left pointing at a retired group fails the step.
"""

from __future__ import annotations

import textwrap

import pytest

from _recovery import assert_recovered, trial

pytestmark = [pytest.mark.live, pytest.mark.slow]

USER_MESH_WORKLOAD = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build(mesh):
        own = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("rep", "mine"))
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 8))
        fully_shard(model, mesh=own)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def batch(step, rank):
        return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))

    def train_step(model, optimizer, batch):
        loss = model(batch).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss) + 0.0 * float(model[0].weight.full_tensor().sum())
""")


def test_a_users_own_mesh_and_its_groups_are_replaced_and_rebound(tmp_path):
    path = tmp_path / "user_mesh.py"
    path.write_text(USER_MESH_WORKLOAD)
    result = trial(
        ranks=2, steps=6, faults=2, fault_kind="collective", checkpoint_every=3, baselines=False, workload=str(path)
    )
    assert_recovered(result, "in_memory")
    for rank in result.faulted:
        retired = [r.group for r in rank.retired]
        # two recoveries: the group over all ranks and torch's own group for the user's mesh, twice
        assert len(retired) == 4 and sum(not g.startswith("meshpact_data") for g in retired) == 2, retired
        assert not any(r.alive for r in rank.retired), rank.retired
