"""A rank's state: generators captured and restored exactly; the commit check costs O(1) bytes;
the commit mark proves the state untouched without listing it again, and is fooled by nothing a
step does to it (optimizers of every kind, lazily created state, ``.data`` writes on a sampled
element, replaced parameters, non-contiguous storage, FSDP2's sharded DTensors)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from meshpact.live.recovery.state import (
    CommitMark,
    capture_rng,
    commit_check,
    local_state,
    restore_rng,
    rng_from_tensors,
    rng_tensors,
)


def _draws() -> tuple:
    return (
        torch.rand(3).tolist(),
        torch.nn.functional.dropout(torch.ones(8), 0.5).tolist(),
        random.random(),
        np.random.rand(2).tolist(),
        random.gauss(0, 1),
    )


def test_restoring_the_generators_replays_every_draw_bit_for_bit():
    random.gauss(0, 1)  # leaves a cached gaussian in Python's state: it must be kept too
    saved = capture_rng()
    first = _draws()
    assert _draws() != first  # the generators moved on
    restore_rng(saved)
    assert _draws() == first


def test_the_generators_survive_a_trip_through_tensors_as_a_checkpoint_stores_them():
    random.gauss(0, 1)
    np.random.standard_normal()
    saved = rng_tensors(capture_rng())
    first = _draws()
    restore_rng(rng_from_tensors({k: v.clone() for k, v in saved.items()}))
    assert _draws() == first
    assert all(k.startswith("rng/") for k in saved)


def test_commit_check_sees_a_written_tensor_and_the_committed_step():
    state = {f"param/w{i}": torch.arange(100, dtype=torch.float32) + i for i in range(5)}
    state["optim/w0/step"] = torch.tensor(3.0)
    check = commit_check(7, state)
    assert commit_check(7, {k: v.clone() for k, v in state.items()}) == check
    assert commit_check(8, state) != check
    state["param/w3"].add_(1.0)  # an optimizer step that ran part-way writes whole tensors
    assert commit_check(7, state) != check


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.float64])
def test_commit_check_hashes_a_bounded_sample_whatever_the_state_size(monkeypatch, dtype):
    hashed: list[int] = []
    import hashlib

    real = hashlib.blake2b

    class Counting:
        def __init__(self, *a, **kw):
            self.h = real(*a, **kw)

        def update(self, data):
            hashed.append(len(memoryview(data).cast("B")))
            self.h.update(data)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(hashlib, "blake2b", Counting)
    small = {f"t{i}": torch.zeros(10, dtype=dtype) for i in range(3)}
    big = {f"t{i}": torch.zeros(50_000, dtype=dtype) for i in range(600)}
    commit_check(1, small)
    small_bytes = sum(hashed)
    hashed.clear()
    commit_check(1, big)
    assert sum(hashed) <= 64 * 3 * 2 * 8 + 64  # at most 64 tensors x 3 x 2 elements x 8 bytes, plus markers
    assert small_bytes < sum(hashed)


# -- the commit mark -----------------------------------------------------------------------------------
def _model() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))


def _backward(model: torch.nn.Module) -> None:
    model(torch.randn(4, 6)).square().sum().backward()


OPTIMIZERS = {
    "sgd-foreach-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "sgd-loop": lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False),
    "adam-foreach": lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=True),
    "adamw-loop": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=False),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.1),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_mark_sees_an_optimizer_step_after_the_commit_and_nothing_before_it(name):
    model = _model()
    opt = OPTIMIZERS[name](model.parameters())
    _backward(model)
    opt.step()  # optimizer state exists: the commit after a full step
    opt.zero_grad()
    mark = CommitMark.take(1, model, opt)
    assert mark.changed(1, model, opt) == ""
    _backward(model)  # the failed step got this far: gradients only
    assert mark.changed(1, model, opt) == ""
    opt.step()  # ... or further: the optimizer wrote the state
    assert mark.changed(1, model, opt) != ""
    assert mark.changed(2, model, opt) != ""  # another step is never the committed one


def test_state_created_lazily_after_the_commit_is_a_change():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    mark = CommitMark.take(0, model, opt)  # before the first step: no optimizer state yet
    _backward(model)
    with torch.no_grad():  # the optimizer's first step began, created its state, wrote nothing else
        for p in model.parameters():
            opt.state[p]["exp_avg"] = torch.zeros_like(p)
    assert "changed since the commit" in mark.changed(0, model, opt)


def test_a_data_write_on_a_sampled_element_is_seen_and_a_replaced_parameter_is_judged_by_content():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mark = CommitMark.take(3, model, opt)
    first = model[0].weight
    kept = first.detach()[0, 0].item()
    first.data.view(-1)[0] = 1000.0  # through .data: no version counter moves
    assert mark.changed(3, model, opt) == "a sampled element of the state was written since the commit"
    first.data.view(-1)[0] = kept
    assert mark.changed(3, model, opt) == ""
    model[0].weight = torch.nn.Parameter(first.detach().clone())  # other object, same values
    assert mark.changed(3, model, opt) == ""
    model[0].weight = torch.nn.Parameter(first.detach() + 1.0)
    assert "changed since the commit" in mark.changed(3, model, opt)


def test_the_next_mark_reuses_the_listing_while_the_same_tensors_hold_the_state():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _backward(model)
    opt.step()
    first = CommitMark.take(1, model, opt)
    _backward(model)
    opt.step()
    second = CommitMark.take(2, model, opt, first)
    assert second.samples is first.samples and second.check != first.check
    assert second.check == commit_check(2, local_state(model, opt))  # the same hash as a full listing


def test_a_non_contiguous_parameter_is_listed_again_so_its_writes_are_never_missed():
    model = _model()
    model[0].weight = torch.nn.Parameter(torch.randn(6, 7).t())  # a transposed view: reshape copies
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mark = CommitMark.take(1, model, opt)
    assert not mark.aliased
    _backward(model)
    opt.step()
    assert mark.changed(1, model, opt) != ""


@pytest.mark.parametrize("name", ["sgd-foreach-momentum", "adam-foreach", "adamw-loop"])
def test_fsdp2_sharded_parameters_updated_in_place_by_foreach_optimizers_are_seen(name):
    """torch's foreach updates leave a DTensor's version counter where it was: the mark must
    not rely on it."""
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist_ = torch.distributed
    dist_.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
        model = _model()
        fully_shard(model, mesh=mesh)
        opt = OPTIMIZERS[name](model.parameters())
        _backward(model)
        opt.step()
        opt.zero_grad()
        versions = [p._version for p in model.parameters()]
        mark = CommitMark.take(1, model, opt)
        _backward(model)
        assert mark.changed(1, model, opt) == ""
        opt.step()
        assert mark.changed(1, model, opt) != ""
        if name != "adamw-loop":  # the reason the counters are not used
            assert [p._version for p in model.parameters()] == versions
    finally:
        dist_.destroy_process_group()


def test_a_check_hands_a_recovery_the_meshes_only_while_the_commits_own_tensors_hold_the_state():
    """Rebinding needs every mesh the state's DTensors live on; the check already walked those
    tensors, so it hands the commit's meshes on while the very tensors of the commit hold the
    state (its meshes: the same objects), and nothing once one was replaced: the recovery then
    walks the state for them. What it hands on is what the full walk finds."""
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from meshpact.live.recovery.rebind import meshes_of

    dist_ = torch.distributed
    dist_.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        from torch.distributed.tensor import Shard, distribute_tensor

        mesh, other = init_device_mesh("cpu", (2,)), init_device_mesh("cpu", (2,))
        assert other is not mesh
        model = _model()
        fully_shard(model, mesh=mesh)
        # the optimizer also steps a parameter the model does not hold, on a mesh of its own
        extra = torch.nn.Parameter(distribute_tensor(torch.ones(4, 3), other, [Shard(0)]))
        opt = torch.optim.Adam([*model.parameters(), extra], lr=0.1)
        _backward(model)
        extra.grad = distribute_tensor(torch.ones(4, 3), other, [Shard(0)])
        opt.step()
        first = CommitMark.take(1, model, opt)
        _backward(model)
        opt.step()
        mark = CommitMark.take(2, model, opt, first)  # the same tensors: the listing and its meshes kept
        assert mark.samples is first.samples and mark.meshes == (mesh,)
        checked = mark.verify(2, model, opt)
        assert checked.changed == "" and checked.meshes == (mesh,)
        handed = meshes_of(model, opt, params=list(model.parameters()), tensor_meshes=checked.meshes)
        assert {id(m) for m in handed} == {id(m) for m in meshes_of(model, opt)} and other in handed
        _backward(model)
        opt.step()  # the same tensors, written: changed, and still the commit's meshes
        checked = mark.verify(2, model, opt)
        assert checked.changed != "" and checked.meshes == (mesh,)
        first = model[0].weight
        model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())  # another tensor holds a parameter
        assert mark.verify(2, model, opt).meshes is None
        assert mark.verify(3, model, opt).meshes is None  # another step: nothing is known of it
    finally:
        dist_.destroy_process_group()


def test_the_mark_sees_a_write_in_any_dtype_of_a_mixed_precision_model():
    """bf16 layers beside a float32 one and an int64 buffer-like parameter: each dtype is sampled
    in its own buffer, and a write in any one of them is seen."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7).to(torch.bfloat16), torch.nn.Linear(7, 3))
    model.register_parameter("counts", torch.nn.Parameter(torch.arange(10, dtype=torch.int64), requires_grad=False))
    opt = torch.optim.SGD([p for p in model.parameters() if p.dtype.is_floating_point], lr=0.1)
    mark = CommitMark.take(4, model, opt)
    assert {dtype for dtype, _ in mark.samples} == {torch.bfloat16, torch.float32, torch.int64}
    assert mark.changed(4, model, opt) == ""
    for p in (model[0].weight, model[1].bias, model.counts):
        kept = p.detach().reshape(-1)[-1].clone()
        with torch.no_grad():
            p.reshape(-1)[-1] += 1  # the last element: sampled in every tensor
        assert mark.changed(4, model, opt) != "", p.dtype
        with torch.no_grad():
            p.reshape(-1)[-1] = kept
        assert mark.changed(4, model, opt) == ""


def test_gradients_carried_past_a_commit_are_told_from_zeroed_ones():
    """What the runtime refuses at a commit (gradients left for the next step without an optimizer
    step) against what it must let pass: gradients zeroed in place or set to None."""
    from meshpact.live.recovery.runtime import _carried_gradients

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert _carried_gradients(model) == []
    model(torch.randn(5, 4)).sum().backward()
    assert _carried_gradients(model) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    opt.zero_grad(set_to_none=False)
    assert _carried_gradients(model) == []
    model(torch.randn(5, 4)).sum().backward()
    opt.zero_grad()
    assert _carried_gradients(model) == []
