"""The user's groups matched by creation order, the order every member builds a generation's
groups in, the replica an HSDP excision takes out, and the model parts ``resilient()`` takes:
pure functions and one process (a fake default group of four ranks, real one-rank gloo groups)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from meshpact.core.recovery import Policy
from meshpact.live.recovery import communicator as comm
from meshpact.live.recovery.reshard import replica_of
from meshpact.live.recovery.runtime import ModelParts, Resilient, model_of
from meshpact.live.recovery.usergroups import UserGroupMismatch, UserGroups, plan_key, route_group_creation


class _Control:
    """The control channel's values, in memory."""

    def __init__(self, values: dict[str, object] | None = None) -> None:
        self.values = dict(values or {})
        self.sets: list[str] = []

    def get(self, key: str, default: object = None) -> object:
        return self.values.get(key, default)

    def set(self, key: str, value: object) -> None:
        self.sets.append(key)
        self.values[key] = value


class _Default:
    """c10d's default group as the routed creation reads it: four ranks, this one rank 0."""

    def size(self) -> int:
        return 4

    def rank(self) -> int:
        return 0


@pytest.fixture
def four_ranks(monkeypatch):
    monkeypatch.setattr(c10d, "_get_default_group", lambda: _Default())
    spec = comm.GroupSpec("gloo", "cpu", 0, 4, 5.0, connect_timeout_s=5.0, run_id="matching")
    return spec, dist.HashStore()


def test_build_order_puts_the_sessions_groups_first_then_the_users_by_creation_then_any_other():
    groups = ["user10", "meshpact_shard_0-1", "7", "user2", "meshpact_data", "user9", "meshpact_replicate_0-2"]
    first = ["meshpact_data", "meshpact_replicate_0-2", "meshpact_shard_0-1"]
    assert comm.build_order(groups, first) == [
        "meshpact_data",
        "meshpact_replicate_0-2",
        "meshpact_shard_0-1",
        "user2",
        "user9",
        "user10",
        "7",
    ]
    assert [comm.user_ordinal(b) for b in ("user0", "user12", "users", "user", "meshpact_data")] == [
        0,
        12,
        None,
        None,
        None,
    ]
    assert comm.base_name(comm.group_name(3, comm.user_base(12))) == "user12"


def test_a_replacement_is_handed_the_group_built_for_its_place_in_the_creation_order(four_ranks):
    spec, store = four_ranks
    # the job made three groups: a pair without this rank, this rank alone, and a pair this rank is not in
    control = _Control({plan_key(0): [2, 3], plan_key(1): [0], plan_key(2): [1, 2]})
    groups = UserGroups(lambda: (spec, store, control, 3))
    assert groups.prebuild(spec, store, control, 3) == 3
    assert groups.create([3, 2], None) is c10d.GroupMember.NON_GROUP_MEMBER  # torch sorts the ranks
    mine = groups.create([0], "metrics")
    assert mine.group_name == "user1_g3" and mine.size() == 1
    assert groups.create([1, 2], None) is c10d.GroupMember.NON_GROUP_MEMBER
    # a fourth group is the job's new one: built now, its ranks written by its first member (this rank)
    fresh = groups.create([0], None)
    assert fresh.group_name == "user3_g3" and fresh is not mine
    assert control.sets == [plan_key(3)] and control.values[plan_key(3)] == [0]
    # one past it, without this rank: not this rank's to write
    assert groups.create([1, 2, 3], None) is c10d.GroupMember.NON_GROUP_MEMBER and control.sets == [plan_key(3)]
    assert [g.base for g in groups.made] == ["user0", "user1", "user2", "user3", "user4"]


def test_a_replacement_whose_script_asks_for_other_ranks_is_refused_in_one_line(four_ranks):
    spec, store = four_ranks
    control = _Control({plan_key(0): [2, 3]})
    groups = UserGroups(lambda: (spec, store, control, 1))
    groups.prebuild(spec, store, control, 1)
    with pytest.raises(UserGroupMismatch) as err:
        groups.create([1, 3], None)
    assert "\n" not in str(err.value) and "ranks [1, 3], the job's has [2, 3]" in str(err.value)
    with pytest.raises(ValueError, match=r"must be distinct ranks of 0..3"):
        UserGroups(lambda: (spec, store, control, 1)).create([0, 4], None)


def test_routing_sends_what_it_cannot_match_to_torchs_own_creation(four_ranks, monkeypatch):
    spec, store = four_ranks
    asked: list[tuple] = []
    monkeypatch.setattr(c10d, "_new_group_with_tag", lambda *a, **kw: asked.append((a, kw)) or "torch's")
    control = _Control()
    groups = UserGroups(lambda: (spec, store, control, 0))
    routed = route_group_creation(groups, "gloo")
    assert route_group_creation(groups, "gloo").original is routed.original  # routed once, not wrapped twice
    assert c10d._new_group_with_tag([2, 3], use_local_synchronization=True) == "torch's"
    assert c10d._new_group_with_tag([2, 3], backend="mpi") == "torch's"
    assert len(asked) == 2 and groups.made == []
    assert c10d._new_group_with_tag([2, 3], backend="gloo") is c10d.GroupMember.NON_GROUP_MEMBER
    assert [g.ranks for g in groups.made] == [(2, 3)]


def test_an_hsdp_excision_takes_out_every_rank_of_each_replica_that_lost_one():
    assert replica_of((2, 2), [1]) == (0, 1) and replica_of((2, 2), [3]) == (2, 3)
    assert replica_of((3, 2), [5, 2]) == (2, 3, 4, 5)
    assert replica_of((2, 4), [4, 6]) == (4, 5, 6, 7)


def test_model_parts_are_kept_as_one_module_named_by_part():
    first, second = torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)
    kept = model_of([first, second])
    assert isinstance(kept, ModelParts) and kept[0] is first and kept[1] is second
    assert [n for n, _ in kept.named_parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert model_of(first) is first


@pytest.mark.parametrize(
    "parts, why",
    [
        ([], "an empty list of model parts"),
        ([torch.nn.Linear(2, 2), "head"], "model part 1 is str, not a torch.nn.Module"),
        ("model", "got str"),
    ],
)
def test_what_is_not_a_list_of_model_parts_is_refused_in_one_line(parts, why):
    with pytest.raises((TypeError, ValueError)) as err:
        model_of(parts)
    assert why in str(err.value) and "\n" not in str(err.value)


def test_model_parts_that_share_a_parameter_are_refused():
    block = torch.nn.Linear(2, 2)
    outer = torch.nn.Sequential(block, torch.nn.ReLU())
    for parts in ([block, block], [outer, block]):
        with pytest.raises(ValueError, match=r"model parts 0 and 1 share a parameter"):
            model_of(parts)


def test_excising_model_parts_is_refused_before_anything_starts():
    parts = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    optimizer = object()  # refused before the optimizer is looked at
    with pytest.raises(ValueError, match=r"model parts are pipeline stages .* use on_rank_loss=Policy.PEER_RESTORE"):
        Resilient(parts, optimizer, None, build=lambda mesh: (parts, optimizer), on_rank_loss=Policy.EXCISE)


def test_a_group_of_another_backend_than_the_sessions_is_left_to_torch(four_ranks, monkeypatch):
    """A GPU job's CPU-side group (``new_group(backend="gloo")`` beside an NCCL session, as a
    metrics or checkpoint barrier on CPU tensors) must be a gloo group: routed, it would be built
    with the session's backend."""
    spec, store = four_ranks
    asked: list[tuple] = []
    monkeypatch.setattr(c10d, "_new_group_with_tag", lambda *a, **kw: asked.append((a, kw)) or "torch's")
    groups = UserGroups(lambda: (spec, store, _Control(), 0))
    route_group_creation(groups, "nccl")
    assert c10d._new_group_with_tag([2, 3], backend="gloo") == "torch's"
    assert c10d._new_group_with_tag([2, 3], backend=dist.Backend.GLOO) == "torch's"
    assert len(asked) == 2 and groups.made == []
    assert c10d._new_group_with_tag([2, 3], backend="nccl") is c10d.GroupMember.NON_GROUP_MEMBER  # the session's own
    assert [g.ranks for g in groups.made] == [(2, 3)]
