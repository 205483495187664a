"""Groups held on objects: attributes of instances the job reaches are rebound; a group nobody
reaches is named once."""

from __future__ import annotations

import argparse
import functools
import sys
import types
import warnings
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from meshpact.live.recovery.rebind import ModuleScan, UnreachableGroupWarning, rebind_all, walk_objects


def _group(name: str) -> dist.ProcessGroup:
    """A real one-rank gloo ProcessGroup, named, in this process."""
    store = dist.HashStore()
    pg = dist.ProcessGroup(store, 0, 1)
    pg._register_backend(
        torch.device("cpu"),
        dist.ProcessGroup.BackendType.GLOO,
        dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=5)),
    )
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._set_group_name(name)  # type: ignore[arg-type]  # c10d's GroupName is a NewType of str
    return pg


class MetricsReducer:
    """A user's reducer: its group on ``self.pg``, as torchtitan-style trainers keep them."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg = pg
        self.history: list[float] = []


class Trainer:
    def __init__(self, reducer: MetricsReducer, dp: dist.ProcessGroup) -> None:
        self.parts = {"metrics": [reducer]}  # an object inside a dict inside a list inside an object
        self.dp_group = dp


class Slotted:
    __slots__ = ("group", "__weakref__")

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group


@dataclass(frozen=True)
class FrozenHolder:
    group: dist.ProcessGroup


class Block(torch.nn.Module):
    def __init__(self, pg: dist.ProcessGroup) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.tp_group = pg


class Chain:
    def __init__(self, nxt: object) -> None:
        self.nxt = nxt


@pytest.fixture
def user_module(tmp_path):
    module = types.ModuleType("meshpact_test_object_groups")
    module.__file__ = str(tmp_path / "object_groups.py")
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def _rebind(scan: ModuleScan, model: torch.nn.Module, old, new, roots, functions=()):
    scan.objects.refresh(object(), lambda: roots, lambda: ({}, set()))
    return rebind_all([(old, new)], model, meshes=[], only=("python.bindings",), functions=functions, scan=scan)


def test_attributes_of_objects_reached_from_globals_closures_the_model_state_and_the_step_are_rebound(user_module):
    old, new = _group("held_pg_g0"), _group("held_pg_g1")
    deep = Chain(Chain(Chain(Chain(Slotted(old)))))  # deeper than any container depth
    user_module.TRAINER = Trainer(MetricsReducer(old), old)
    user_module.DEEP = deep
    frozen = FrozenHolder(old)
    library = argparse.Namespace(group=old, inner=MetricsReducer(old))  # a stdlib instance: read one level

    def make_step(holder):
        def step(batch):
            return batch, holder

        return step

    step = make_step(frozen)
    model = torch.nn.Sequential(Block(old), torch.nn.ReLU())  # the user's module inside a library container
    state = {"sampler": functools.partial(print, MetricsReducer(old))}
    scan = ModuleScan()
    own, _ = scan.modules()
    roots = [
        *own,
        *[(f"model.{n}", m) for n, m in model.named_modules()],
        *[(f"state[{k!r}]", v) for k, v in state.items()],
        ("step function", step),
        ("lib", library),
    ]
    report = _rebind(scan, model, old, new, roots, functions=(step,))

    assert user_module.TRAINER.dp_group is new and user_module.TRAINER.parts["metrics"][0].pg is new
    assert deep.nxt.nxt.nxt.nxt.group is new
    assert frozen.group is new and model[0].tp_group is new and state["sampler"].args[0].pg is new
    assert library.group is new
    assert library.inner.pg is old  # a library instance is not followed past its own attributes
    assert report.counts["python.bindings"] == 7


def test_the_walk_is_cached_between_recoveries_and_a_slot_reads_the_attribute_as_it_stands(user_module):
    g0, g1, g2 = (_group(f"cached_pg_g{i}") for i in range(3))
    reducer = MetricsReducer(g0)
    user_module.REDUCER = reducer
    scan = ModuleScan()
    own, _ = scan.modules()
    key = ("groups", 1)
    walked = []

    def roots():
        walked.append(1)
        return list(own)

    scan.objects.refresh(key, roots, lambda: ({}, set()))
    scan.objects.refresh(key, roots, lambda: ({}, set()))  # nothing changed: no walk
    assert (scan.objects.walks, len(walked)) == (1, 1)
    rebind_all([(g0, g1)], torch.nn.Linear(2, 2), meshes=[], only=("python.bindings",), scan=scan)
    reducer.pg = g1  # set again by the user between recoveries: the slot reads it anew
    rebind_all([(g1, g2)], torch.nn.Linear(2, 2), meshes=[], only=("python.bindings",), scan=scan)
    assert reducer.pg is g2 and scan.objects.walks == 1


def test_a_cycle_ends_the_walk_and_a_graph_over_the_bound_is_cut_and_says_so():
    a, b = Chain(None), Chain(None)
    a.nxt, b.nxt = b, a
    walk = walk_objects([("a", a)])
    assert not walk.cut and walk.objects == 2
    long = Chain(None)
    for _ in range(50):
        long = Chain(long)
    assert walk_objects([("long", long)], most=10).cut


def test_a_group_no_place_reaches_is_warned_once_with_where_it_was_last_seen(user_module):
    seen_then_lost, never = _group("reducer_pg_g0"), _group("hidden_pg_g0")
    reducer = MetricsReducer(seen_then_lost)
    user_module.REDUCER = reducer
    scan = ModuleScan()
    own, _ = scan.modules()
    groups = {"reducer_pg_g0": seen_then_lost, "hidden_pg_g0": never}
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        first = scan.objects.refresh(1, lambda: list(own), lambda: (groups, set()))
    assert len(first) == 1 and "'hidden_pg_g0'" in first[0] and "never seen there" in first[0]
    assert [type(w.message) for w in got] == [UnreachableGroupWarning]

    del user_module.REDUCER  # the reducer now lives where no walk goes (a library's global)
    argparse._meshpact_test_reducer = reducer
    try:
        second = scan.objects.refresh(2, lambda: list(scan.modules()[0]), lambda: (groups, set()))
        assert len(second) == 1 and "'reducer_pg_g0'" in second[0]
        assert "last seen at meshpact_test_object_groups['REDUCER'].pg" in second[0]
        # a later generation of either group, still unreached, is not warned of again
        later = {"reducer_pg_g1": _group("reducer_pg_g1"), "hidden_pg_g1": _group("hidden_pg_g1")}
        assert scan.objects.refresh(3, lambda: [], lambda: (later, set())) == []
        # a group another site reaches (a mesh names it) is not warned of
        assert scan.objects.refresh(4, lambda: [], lambda: ({"mesh_pg_g0": never}, {"mesh_pg_g0"})) == []
    finally:
        del argparse._meshpact_test_reducer


def test_a_new_lambda_each_step_over_the_same_objects_keeps_the_walk_current():
    from meshpact.live.recovery.rebind import function_key

    reducer, other = MetricsReducer.__new__(MetricsReducer), MetricsReducer.__new__(MetricsReducer)
    keys = {function_key(lambda batch, step=step: (reducer, batch, step)) for step in range(5)}
    assert len(keys) == 1  # the loop's usual rt.step(lambda b: ..., batch): no walk per step

    def step_over(holder):
        return lambda batch: (holder, batch)

    assert function_key(step_over(reducer)) == function_key(step_over(reducer))
    assert function_key(step_over(other)) != function_key(step_over(reducer))  # another object: walk again


def test_a_closure_over_a_group_kept_on_an_object_is_rebound_and_counts_as_reached(user_module):
    old, new = _group("closure_pg_g0"), _group("closure_pg_g1")

    def make_reduce(group):
        def reduce(x, group_default=group):
            return x, group

        return reduce

    holder = MetricsReducer(_group("other_pg_g0"))
    holder.reduce = make_reduce(old)  # a reducer made as a closure, kept on an object
    user_module.HOLDER = holder
    scan = ModuleScan()
    own, _ = scan.modules()
    groups = {"closure_pg_g0": old}
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        scan.objects.refresh(1, lambda: list(own), lambda: (groups, set()))
    assert not [w for w in got if issubclass(w.category, UnreachableGroupWarning)]
    report = rebind_all([(old, new)], torch.nn.Linear(2, 2), meshes=[], only=("python.bindings",), scan=scan)
    assert holder.reduce(1)[1] is new and holder.reduce.__defaults__[0] is new
    assert report.counts["python.bindings"] == 2


def test_a_new_partial_or_bound_method_each_step_over_the_same_objects_keeps_the_walk_current():
    """``rt.step(functools.partial(train_step, model, optimizer), batch)`` each step, or a bound
    method looked up anew: the same objects reached, so no walk of the job's objects per step."""
    from meshpact.live.recovery.rebind import function_key

    reducer, other = MetricsReducer.__new__(MetricsReducer), MetricsReducer.__new__(MetricsReducer)

    def train_step(holder, batch, scale=1.0):
        return holder, batch, scale

    keys = {function_key(functools.partial(train_step, reducer, scale=float(step))) for step in range(5)}
    assert len(keys) == 1
    assert function_key(functools.partial(train_step, other)) != function_key(functools.partial(train_step, reducer))
    nested = {function_key(functools.partial(functools.partial(train_step, reducer), scale=2.0)) for _ in range(3)}
    assert len(nested) == 1
