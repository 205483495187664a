"""A recovery walks the model once: the FSDP states come from the root's own list once it ran,
the parameters from the step reset, and both are the ones a full walk finds."""

from __future__ import annotations

import torch
import torch.distributed as dist


def test_the_roots_list_of_states_and_the_resets_parameters_are_what_a_full_walk_finds():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshpact.live.recovery.rebind import _walk_states, fsdp_states, meshes_of
    from meshpact.live.recovery.stepreset import reset_step_state

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert fsdp_states(model) == _walk_states(model)  # before the first step: walked
        assert len(fsdp_states(model)) == 3
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        states = fsdp_states(model)
        assert states == _walk_states(model) and states[0] is _walk_states(model)[0]  # root first
        model(torch.randn(2, 4)).sum().backward()  # a step cut short: gradients left behind
        params = reset_step_state(model, states)
        assert params == list(model.parameters()) and all(p.grad is None for p in params)
        assert meshes_of(model, opt, states, params) == meshes_of(model, opt) == [mesh]
    finally:
        dist.destroy_process_group()
