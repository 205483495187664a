"""A recovery walks the model once: the FSDP states come from the root's own list once it ran,
the parameters from the step reset, and both are the ones a full walk finds. A reset on a
recovery's path frees nothing and the step run after it is bit-identical."""

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


class _Cut(RuntimeError):
    pass


def _fsdp_twin(seed: int = 0, mesh_size: int = 1):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)
    )
    mesh = init_device_mesh("cpu", (mesh_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root's own group holds model[4]
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _step(model, opt, x: torch.Tensor) -> None:
    model(x).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_a_reset_that_keeps_the_leftovers_frees_nothing_and_the_step_run_again_is_bit_identical():
    """With Leftovers the reset frees nothing: the failed attempt's gradients and collective
    buffers are held until released, the unsharded parameters' buffers stay sized behind the
    sharded parameters; the step run again writes them whole and ends bit for bit where a run
    that never failed, and one reset the freeing way, end."""
    from meshpact.live.recovery.stepreset import Leftovers

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        runs = {kind: _fsdp_twin() for kind in ("clean", "freed", "kept")}
        for model, opt in runs.values():
            _step(model, opt, xs[0])
        leftovers = Leftovers()
        for kind in ("freed", "kept"):
            model, opt = runs[kind]
            model(xs[1]).sum().backward()  # gradients of an attempt whose optimizer step never came
            kept = _cut_and_reset(model, leftovers if kind == "kept" else None)
            assert all(kept) if kind == "kept" else not any(kept)
        assert leftovers.held and leftovers.kept
        leftovers.release()
        assert not leftovers.held and not leftovers.kept
        for model, opt in runs.values():
            _step(model, opt, xs[1])
        clean = runs["clean"][0].state_dict()
        for kind in ("freed", "kept"):
            got = runs[kind][0].state_dict()
            assert all(torch.equal(got[k].to_local(), clean[k].to_local()) for k in clean), kind
        model = runs["kept"][0]  # cut again, then replaced (an excision): its kept buffers are freed too
        replaced = Leftovers()
        assert all(_cut_and_reset(model, replaced))
        replaced.release(model_replaced=True)
        assert not any(_root_buffer_sizes(model))
    finally:
        dist.destroy_process_group()


def test_the_last_all_gather_output_is_left_for_the_step_run_again_to_drop():
    """Over more than one rank FSDP keeps the last all-gather's output until the next one has
    its data; a reset with Leftovers leaves it there (the re-run's first all-gather drops it),
    and an excision's release drops it with the old model's buffers."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshpact.live.recovery.stepreset import Leftovers

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model, opt = _fsdp_twin(mesh_size=2)
        _step(model, opt, torch.ones(2, 4))
        leftovers = Leftovers()
        assert all(_cut_and_reset(model, leftovers)) and len(leftovers.contexts) == 1
        ctx = leftovers.contexts[0]
        assert ctx.all_gather_state is not None
        leftovers.release()
        assert ctx.all_gather_state is not None and not leftovers.contexts
        model(torch.ones(2, 4))  # the step run again: its first all-gather drops it, as FSDP does
        assert ctx.all_gather_state is None
        _step(model, opt, torch.ones(2, 4))
        replaced = Leftovers()
        assert all(_cut_and_reset(model, replaced)) and ctx.all_gather_state is not None
        replaced.release(model_replaced=True)
        assert ctx.all_gather_state is None and not any(_root_buffer_sizes(model))
    finally:
        dist.destroy_process_group()


def _root_buffer_sizes(model) -> list[int]:
    from meshpact.live.recovery.rebind import fsdp_states

    return [
        fp.all_gather_outputs[0].untyped_storage().size() for fp in fsdp_states(model)[0]._fsdp_param_group.fsdp_params
    ]


def _cut_and_reset(model, leftovers) -> list[int]:
    """A step failing in model[2]'s forward (the root and model[0] all-gathered), then reset;
    returns the sizes of the root's unsharded buffers after the reset."""
    from meshpact.live.recovery.rebind import fsdp_states
    from meshpact.live.recovery.stepreset import reset_step_state

    def cut(*_):
        raise _Cut("the step's collective failed")

    handle = model[2].register_forward_pre_hook(cut)
    try:
        model(torch.ones(2, 4))
    except _Cut:
        pass
    finally:
        handle.remove()
    root = fsdp_states(model)[0]._fsdp_param_group
    assert root.is_unsharded
    params = reset_step_state(model, fsdp_states(model), leftovers)
    assert all(p.grad is None for p in params) and params == list(model.parameters())
    assert root.is_sharded and model[4].weight is next(
        fp.sharded_param for fp in root.fsdp_params if fp._module_info.param_name == "weight"
    )
    return _root_buffer_sizes(model)


def test_the_resets_parameter_listing_keeps_torchs_order_and_de_duplication():
    """Tied weights, a module registered under two names, a parameter set to None and a frozen
    one: the reset lists exactly what ``model.parameters()`` does, in its order."""
    from meshpact.live.recovery.stepreset import parameters

    torch.manual_seed(0)
    shared = torch.nn.Linear(3, 3)
    model = torch.nn.Module()
    model.emb = torch.nn.Embedding(5, 3)
    model.body = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)  # one module twice
    model.again = shared  # and under another name
    model.head = torch.nn.Linear(3, 5, bias=False)
    model.head.weight = model.emb.weight  # tied
    model.register_parameter("unused", None)
    model.frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    want = list(model.parameters())
    got = parameters(model)
    assert [id(p) for p in got] == [id(p) for p in want]
    assert len(got) == 4  # emb/head weight once, the shared layer's two once, frozen once
