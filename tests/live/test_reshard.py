"""Excision: FSDP2's Shard(0) cut reproduced exactly, the same global batch, and one process
excising its partner. The live runs (a real fault excised by the runtime, bitwise equal to the
excising reference) are in test_recovery_excise.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshpact.core.recovery import CommunicatorAction
from meshpact.live.recovery.reshard import (
    ExcisionError,
    ExcisionRecord,
    GradientWeight,
    Membership,
    _pack,
    _unpack,
    assemble_full,
    max_abs_diff,
    shard_of,
    shard_rows,
    share_batch,
)

ODD_DIM0 = (1, 2, 3, 5, 7, 13)


def _fake_world(world: int, rank: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,))


@pytest.mark.parametrize("world", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shard_of_cuts_exactly_the_rows_fully_shard_gives_each_rank(world, dtype):
    """fully_shard over a fake world of ``world`` ranks (one process plays each rank in turn):
    every local shard equals shard_of of the full parameter, bit for bit, including empty
    shards (dim 0 smaller than the world) and one-element parameters."""
    from torch.distributed.fsdp import fully_shard

    for rank in range(world):
        mesh = _fake_world(world, rank)
        try:
            torch.manual_seed(3)
            model = torch.nn.Sequential(*(torch.nn.Linear(3, n) for n in ODD_DIM0), torch.nn.Embedding(11, 2))
            model.to(dtype)
            full = {n: p.detach().clone() for n, p in model.named_parameters()}
            fully_shard(model, mesh=mesh)
            for name, p in model.named_parameters():
                local = p.to_local()
                expected = shard_of(full[name], world, rank)
                assert local.dtype == dtype
                assert local.shape == expected.shape, (name, world, rank)
                assert torch.equal(
                    local.view(torch.uint8) if local.numel() else local,
                    expected.view(torch.uint8) if expected.numel() else expected,
                ), (name, world, rank)
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_shard_rows_agree_with_dtensors_own_layout_of_shard0(world):
    """DTensor's own computation of a Shard(0) local shape and offset, for odd row counts."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for rank in range(world):
        mesh = _fake_world(world, rank)
        try:
            for dim0 in (0, 1, 2, 3, 5, 6, 13, 64, 65):
                shape, offset = compute_local_shape_and_global_offset((dim0, 3), mesh, [Shard(0)])
                start, rows = shard_rows(dim0, world, rank)
                assert rows == shape[0], (dim0, world, rank)
                if rows:
                    assert start == offset[0], (dim0, world, rank)
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32, torch.float64])
@pytest.mark.parametrize("dim0", [1, 2, 5, 13])
def test_shards_of_any_world_assemble_back_to_the_whole_tensor(dtype, dim0):
    full = (torch.arange(dim0 * 3) - 7).reshape(dim0, 3).to(dtype)
    for old, new in ((4, 3), (3, 2), (5, 4), (2, 1), (7, 3)):
        states = [{"param/w": shard_of(full, old, r), "optim/w/step": torch.tensor(4.0)} for r in range(old)]
        whole = assemble_full(states)
        assert torch.equal(whole["param/w"], full)
        assert torch.equal(whole["optim/w/step"], torch.tensor(4.0))
        again = [shard_of(whole["param/w"], new, r) for r in range(new)]
        assert sum(s.shape[0] for s in again) == dim0
        assert torch.equal(torch.cat(again), full)


def test_assemble_refuses_shards_that_are_not_a_shard0_cut_and_ranks_that_disagree_on_the_step():
    full = torch.arange(10.0).reshape(5, 2)
    skewed = [{"param/w": full[:1]}, {"param/w": full[1:3]}, {"param/w": full[3:]}]
    with pytest.raises(ExcisionError, match="Shard\\(0\\)"):
        assemble_full(skewed)
    with pytest.raises(ExcisionError, match="disagree"):
        assemble_full([{"optim/w/step": torch.tensor(3.0)}, {"optim/w/step": torch.tensor(4.0)}])


def test_the_byte_exchange_keeps_every_bit_of_every_dtype():
    states = [
        {
            "param/a": torch.tensor([[-0.0, float("nan")], [1e-40, -3.5]]),
            "param/b": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
            "param/c": torch.tensor([2**62, -1], dtype=torch.int64),
            "param/d": torch.zeros(0, 4),
            "optim/a/step": torch.tensor(7.0),
        }
    ]
    keys = list(states[0])
    layout = [(k, str(v.dtype), tuple(v.shape)) for k, v in states[0].items()]
    back = _unpack(_pack(states, keys), layout)
    for k, v in states[0].items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape
        assert torch.equal(back[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


def test_membership_refuses_to_excise_a_rank_not_in_the_job():
    m = Membership.full(4).without([2])
    assert m.alive == (0, 1, 3) and m.departed == (2,) and m.group_rank(3) == 2
    with pytest.raises(ExcisionError, match="job's ranks are \\[0, 1, 3\\]"):
        m.without([2])
    with pytest.raises(ExcisionError):
        m.without([])


def _batch(step: int, rank: int) -> torch.Tensor:
    n = 3 + rank % 2  # ranks hold different numbers of samples
    return (torch.arange(n) + 100 * rank + 10_000 * step).unsqueeze(1).float()


@pytest.mark.parametrize("lost", [(2,), (0, 3), (1, 2, 4)])
def test_the_survivors_shares_are_the_whole_global_batch_once_each_own_samples_kept(lost):
    world = 5
    m = Membership.full(world).without(list(lost))
    global_batch = torch.cat([_batch(6, r) for r in range(world)])
    shares = [share_batch(_batch, 6, m, r) for r in m.alive]
    got = torch.cat([s.batch for s in shares])
    assert sorted(got.reshape(-1).tolist()) == sorted(global_batch.reshape(-1).tolist())
    for r, s in zip(m.alive, shares):
        assert torch.equal(s.batch[: _batch(6, r).shape[0]], _batch(6, r))
        assert s.weight == pytest.approx(s.batch.shape[0] * m.world / global_batch.shape[0])
    assert sum(s.weight for s in shares) == pytest.approx(m.world)
    assert max(s.batch.shape[0] for s in shares) - min(s.batch.shape[0] for s in shares) <= 2


def test_weighted_gradients_averaged_over_the_survivors_are_the_global_mean_gradient():
    """What FSDP2 does with the survivors' gradients (an average over the group), done by hand:
    with the weights it equals the gradient of the mean loss over the whole global batch;
    without them it does not."""
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 2)
    m = Membership.full(4).without([2])
    global_batch = torch.cat([_batch(1, r) for r in range(4)])

    def grads(batch: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        model(batch).pow(2).mean().backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    want = grads(global_batch)
    hook = GradientWeight(model)
    weighted, plain = [], []
    for r in m.alive:
        share = share_batch(_batch, 1, m, r)
        hook.weight = share.weight
        weighted.append(grads(share.batch))
        hook.weight = 1.0
        plain.append(grads(share.batch))
    hook.remove()
    assert torch.allclose(sum(weighted) / m.world, want, rtol=1e-6)
    assert not torch.allclose(sum(plain) / m.world, want, rtol=1e-3)


def test_a_record_survives_a_trip_through_json():
    rec = ExcisionRecord(5, (2,), 4, 3, CommunicatorAction.REBUILD, 1234, 0.1, 0.2, 0.3, 1e-6)
    assert ExcisionRecord.from_dict(rec.to_dict()) == rec
    assert max_abs_diff({"a": torch.ones(2)}, {"a": torch.tensor([1.0, 1.5]), "b": torch.ones(1)}) == 0.5


# -- one process: the survivor of a world of two ----------------------------------------------------------
def _two_rank_states(model: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """What each rank of a 2-rank FSDP2 world holds of ``model`` after some AdamW steps (the
    cut is shard_of's, which the tests above pin to fully_shard's)."""
    gen = torch.Generator().manual_seed(9)
    full: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        full[f"param/{name}"] = p.detach().clone()
        full[f"optim/{name}/exp_avg"] = torch.randn(p.shape, generator=gen)
        full[f"optim/{name}/exp_avg_sq"] = torch.rand(p.shape, generator=gen)
        full[f"optim/{name}/step"] = torch.tensor(3.0)
    return [{k: shard_of(v, 2, r) if v.dim() else v.clone() for k, v in full.items()} for r in range(2)]


def _one_rank_build(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(11)  # build reseeds, as the shipped workloads do: excise must keep the generators
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 1))
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.fixture
def lone_survivor():
    """The spec and store of rank 0 of a world of two whose rank 1 is gone; c10d's default
    group and the groups excise builds are undone afterwards."""
    import torch.distributed.distributed_c10d as c10d

    from meshpact.live.recovery.communicator import GroupSpec

    before = (c10d._world.default_pg, set(c10d._world.pg_map))
    yield GroupSpec("gloo", "cpu", 0, 2, timeout_s=10.0), dist.HashStore()
    c10d._world.default_pg = before[0]
    for pg in set(c10d._world.pg_map) - before[1]:
        if pg in c10d._world.pg_map:
            dist.destroy_process_group(pg)


def test_the_lone_survivor_rebuilds_the_whole_model_and_adam_state_from_its_shard_and_the_copy(lone_survivor):
    from meshpact.live.recovery.reshard import excise
    from meshpact.live.recovery.state import local_state

    spec, store = lone_survivor
    torch.manual_seed(2)
    source = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 1))
    own, copy = _two_rank_states(source)
    own["rng/torch_cpu"] = torch.zeros(3, dtype=torch.uint8)  # kept out of the exchange
    torch.manual_seed(77)
    draw_before = torch.get_rng_state()
    whole = assemble_full([own, copy])
    held = {1: copy}
    out = excise(
        own, held, Membership.full(2), [1], step=3, spec=spec, store=store, generation=1, build=_one_rank_build
    )
    assert torch.equal(torch.get_rng_state(), draw_before)
    assert (out.membership.alive, out.spec.rank, out.spec.world_size, out.group.size()) == ((0,), 0, 1, 1)
    assert out.record.action is CommunicatorAction.REBUILD and out.record.new_world == 1
    # the old shards' memory went back once the new model held them, the copy was let go
    assert {
        k: n for k in own if k.startswith(("param/", "optim/")) for n in [own[k].untyped_storage().nbytes()] if n
    } == {}
    assert own["rng/torch_cpu"].untyped_storage().nbytes() == 3 and held == {}
    got = local_state(out.model, out.optimizer)
    assert got.keys() == whole.keys()
    for k in whole:
        assert torch.equal(got[k], whole[k]), k
    assert out.record.bytes_moved == 0  # the survivor held every row it takes: none crossed the group


def test_excision_without_a_copy_of_the_lost_rank_is_refused_by_name(lone_survivor):
    from meshpact.live.recovery.reshard import excise

    spec, store = lone_survivor
    own, _ = _two_rank_states(torch.nn.Sequential(torch.nn.Linear(4, 5)))
    with pytest.raises(ExcisionError, match=r"no survivor holds a copy of the state of rank\(s\) \[1\]"):
        excise(own, {}, Membership.full(2), [1], step=3, spec=spec, store=store, generation=1, build=_one_rank_build)


def test_below_min_ranks_the_survivor_and_the_copy_become_one_complete_checkpoint(lone_survivor, tmp_path):
    from meshpact.live.recovery.checkpoint import Checkpointer
    from meshpact.live.recovery.reshard import ExcisionRefused, excise

    spec, store = lone_survivor
    own, copy = _two_rank_states(torch.nn.Sequential(torch.nn.Linear(4, 5)))
    copy["rng/torch_cpu"] = torch.arange(4, dtype=torch.uint8)  # a peer copy carries the generators too
    with pytest.raises(
        ExcisionRefused,
        match=r"^excising rank\(s\) \[1\] would leave 1 rank\(s\), below "
        r"--min-ranks 2: stopped, the state of step 3 is flushed to ",
    ) as info:
        excise(
            own,
            {1: copy},
            Membership.full(2),
            [1],
            step=3,
            spec=spec,
            store=store,
            generation=1,
            build=_one_rank_build,
            min_ranks=2,
            checkpoint_dir=str(tmp_path),
        )
    assert "\n" not in str(info.value)
    ckpt = Checkpointer(tmp_path, 0, 2, 1)
    assert ckpt.latest(10) == 3 and Path(info.value.checkpoint) == ckpt.path(3).parent
    for rank, state in ((0, own), (1, copy)):
        saved = Checkpointer(tmp_path, rank, 2, 1).load(3)
        assert saved.keys() == state.keys() and all(torch.equal(saved[k], state[k]) for k in state)
    with pytest.raises(ExcisionError, match="no checkpoint directory"):
        excise(
            own,
            {1: copy},
            Membership.full(2),
            [1],
            step=3,
            spec=spec,
            store=store,
            generation=2,
            build=_one_rank_build,
            min_ranks=2,
        )


def test_a_rank_cannot_take_part_in_its_own_excision(lone_survivor):
    from meshpact.live.recovery.reshard import excise

    spec, store = lone_survivor
    with pytest.raises(ExcisionError, match="rank 0 is being excised"):
        excise({}, {}, Membership.full(2), [0], step=0, spec=spec, store=store, generation=1, build=_one_rank_build)


def test_shrink_is_chosen_where_the_backend_can_shrink_and_is_told_group_ranks(monkeypatch):
    """A backend that shrinks (NCCL >= 2.27; none here) gets ``shrink_group`` with the lost
    ranks' group ranks, which after an earlier excision are not their original ranks."""
    import torch.distributed.distributed_c10d as c10d

    from meshpact.live.recovery import communicator as comm
    from meshpact.live.recovery import reshard

    calls = []
    shrunk = object()
    monkeypatch.setattr(comm, "can_shrink", lambda pg, device: True)
    monkeypatch.setattr(
        dist, "shrink_group", lambda ranks, group=None: calls.append((ranks, group)) or shrunk, raising=False
    )
    monkeypatch.setattr(c10d._world, "default_pg", c10d._world.default_pg)
    old = object()
    before = Membership(4, (0, 1, 3))
    spec = comm.GroupSpec("nccl", "cuda:0", 1, 3, timeout_s=1.0)  # original rank 1, group rank 1
    pg, new_spec, action = reshard._survivor_group(old, spec, None, 2, before, before.without([3]))
    assert (pg, action, calls) == (shrunk, CommunicatorAction.SHRINK, [([2], old)])
    assert (new_spec.rank, new_spec.world_size) == (1, 2)


# -- the redistribution in rounds ------------------------------------------------------------------
def test_rounds_group_consecutive_keys_while_no_rank_passes_the_bound():
    from meshpact.live.recovery.reshard import plan_rounds

    costs = [[10, 0, 5], [10, 30, 0], [0, 15, 5], [50, 0, 0], [1, 1, 1], [0, 0, 0]]
    rounds = plan_rounds(costs, 40)
    assert rounds == [[0, 1], [2], [3], [4, 5]]  # 2 would put rank 1 at 30 + 15; 3 alone: 50 passes the bound
    for keys in rounds:
        if len(keys) > 1:
            assert all(sum(costs[k][i] for k in keys) <= 40 for i in range(3))
    assert [k for keys in rounds for k in keys] == list(range(len(costs)))  # every key once, in order
    assert plan_rounds([], 40) == []


class _Hub:
    """In-memory collectives for survivors running as threads of one process."""

    def __init__(self, world: int) -> None:
        import threading

        self.world = world
        self.barrier = threading.Barrier(world, timeout=20)
        self.slots: list = [None] * world
        self.round_bytes: list[int] = []  # per all_to_all_single call and rank: send + receive buffer bytes

    def exchange(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        got = list(self.slots)
        self.barrier.wait()
        return got


class _Group:
    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub, self.rank = hub, rank

    def size(self) -> int:
        return self.hub.world


def _fake_all_gather_object(out, obj, group):
    out[:] = group.hub.exchange(group.rank, obj)


def _fake_all_to_all_single(out, inp, output_split_sizes, input_split_sizes, group):
    group.hub.round_bytes.append(inp.numel() + out.numel())
    got = group.hub.exchange(group.rank, list(torch.split(inp, input_split_sizes)))
    out.copy_(torch.cat([got[i][group.rank] for i in range(group.hub.world)]))


def test_survivors_redistribute_shard_to_shard_in_bounded_rounds_bit_for_bit(monkeypatch):
    """Four ranks' states, rank 3 lost and its copy held by rank 0: three survivors (threads, with
    in-memory collectives) re-shard in rounds of at most 256 bytes each (a larger tensor alone), and
    every new shard is the Shard(0) cut of the whole tensor over three ranks, every bit kept."""
    import threading

    from meshpact.live.recovery import reshard

    gen = torch.Generator().manual_seed(5)
    whole = {
        "param/a": torch.randn(13, 7, generator=gen),
        "optim/a/exp_avg": torch.randn(13, 7, generator=gen),
        "optim/a/step": torch.tensor(4.0),
        "param/b": torch.randn(9, generator=gen).to(torch.bfloat16),
        "param/c": torch.randint(-(2**40), 2**40, (2, 3), generator=gen),  # ranks 2 and 3 hold no rows
        "param/d": torch.tensor([[-0.0, float("nan")], [1e-40, -3.5], [7.0, 8.0]]),
        "param/e": torch.randn(40, 5, generator=gen),
    }  # 800 bytes: a round of its own below
    states = [{k: shard_of(v, 4, r) if v.dim() else v.clone() for k, v in whole.items()} for r in range(4)]
    before, lost = Membership.full(4), 3
    after = before.without([lost])
    hub = _Hub(after.world)
    monkeypatch.setattr(reshard.dist, "all_gather_object", _fake_all_gather_object)
    monkeypatch.setattr(reshard.dist, "all_to_all_single", _fake_all_to_all_single)
    results: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def survivor(rank: int) -> None:
        try:
            provided = {lost: states[lost]} if rank == 0 else {}
            out, shapes, _ = reshard._redistribute(
                states[rank],
                provided,
                {lost: 0},
                before,
                after,
                _Group(hub, rank),  # type: ignore[arg-type]  # a stand-in group over threads
                rank,
                round_bytes=256,
            )
            results[rank] = out
            assert shapes["param/a"] == (13, 7) and shapes["optim/a/step"] == ()
        except BaseException as exc:  # noqa: BLE001  (reported by the test thread)
            errors.append(exc)
            hub.barrier.abort()

    threads = [threading.Thread(target=survivor, args=(r,)) for r in after.alive]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    for j in range(after.world):
        for k, v in whole.items():
            want = shard_of(v, after.world, j) if v.dim() else v
            got = results[after.alive[j]][k]
            assert got.dtype == want.dtype and got.shape == want.shape, k
            assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), (j, k)
    rounds = len(hub.round_bytes) // after.world
    assert rounds > 1  # the rows went in several rounds, not one exchange of everything
    single = max(v.numel() * v.element_size() for v in whole.values())  # one key alone may pass the bound
    assert max(hub.round_bytes) <= max(256, single)
    moved = sum(v.numel() * v.element_size() for v in states[lost].values() if v.dim())
    assert sum(hub.round_bytes) >= 2 * moved  # the lost rank's rows were all sent and received


@pytest.mark.parametrize("me", [0, 2])
def test_an_hsdp_excision_that_leaves_no_whole_replica_is_refused_on_every_survivor(me):
    """Ranks lost in every replica at once (a node holding a shard of each): no replica goes on.
    Each survivor must say so, not leave quietly 'with its replica' as if the others went on."""
    from meshpact.live.recovery.communicator import GroupSpec
    from meshpact.live.recovery.reshard import LeftWithReplica, excise

    spec = GroupSpec("gloo", "cpu", me, 4, timeout_s=10.0)
    with pytest.raises(ExcisionError) as info:
        excise(
            {},
            {},
            Membership.full(4),
            [1, 3],
            step=3,
            spec=spec,
            store=dist.HashStore(),
            generation=1,
            build=_one_rank_build,
            shape=(2, 2),
            names=("replicate", "shard"),
        )
    assert not isinstance(info.value, LeftWithReplica)
    assert "leaves no whole replica of the HSDP mesh [2, 2]" in str(info.value) and "\n" not in str(info.value)
