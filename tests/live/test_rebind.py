"""Rebinding reaches every cached process-group reference; the old group gets no operations."""

from __future__ import annotations

import ast
import functools
import gc
import sys
import types
import weakref
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from meshpact.live.launch.forkserver import ForkServer
from meshpact.live.launch.launcher import host_store, launch
from meshpact.live.recovery.rebind import (
    SITES,
    TORCH_IMPORT_DEFAULTS,
    ModuleScan,
    find_references,
    held_in_frames,
    python_bindings,
    rebind_all,
)


class _Group:
    """Stands in for a ProcessGroup in the graph-walk tests."""


class _Slotted:
    __slots__ = ("held",)

    def __init__(self, held):
        self.held = held


def test_find_references_follows_dicts_closures_slots_partials_and_weakrefs():
    g = _Group()

    def closure():
        return g

    holder = type("Holder", (), {})()
    holder.cache = {"x": [_Slotted(g)]}
    only_weak = type("Weak", (), {})()
    only_weak.group = g
    roots = {"a": holder, "b": closure, "c": functools.partial(print, g), "d": [weakref.ref(only_weak)]}
    paths = sorted(p for p, obj in find_references(roots, targets=(_Group,)) if obj is g)
    assert "a.cache['x'][0].held" in paths
    assert "b.<closure 0>" in paths
    assert "c.args[0]" in paths
    assert "d[0]().group" in paths


def _group(name: str = "user_pg") -> dist.ProcessGroup:
    """A real one-rank gloo ProcessGroup, named, in this process: what the rebind sites hold."""
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


@pytest.fixture
def user_module(tmp_path):
    """A module of the user's (a file outside any installed package), registered like any
    imported one, and removed after."""
    module = types.ModuleType("meshpact_test_user_groups")
    module.__file__ = str(tmp_path / "user_groups.py")
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def test_a_group_in_a_namespace_package_of_the_users_is_rebound(tmp_path):
    """Installed packages are judged once per top-level package; a namespace package (no
    ``__file__`` at its top) is judged module by module, so the user's code in it is reached."""
    top = types.ModuleType("meshpact_test_ns")  # a namespace package: no __file__
    sub = types.ModuleType("meshpact_test_ns.models")
    sub.__file__ = str(tmp_path / "models.py")
    old, new = _group("ns_pg_g0"), _group("ns_pg_g1")
    sub.PG = old
    sys.modules.update({top.__name__: top, sub.__name__: sub})
    try:
        report = rebind_all([(old, new)], torch.nn.Linear(2, 2), meshes=[], only=("python.bindings",))
        assert report.counts["python.bindings"] == 1 and sub.PG is new
    finally:
        del sys.modules[sub.__name__], sys.modules[top.__name__]


def test_a_kept_module_scan_walks_sys_modules_again_only_when_it_changed_and_misses_no_new_global(
    user_module, tmp_path, monkeypatch
):
    """A job keeps one scan between recoveries: a global assigned since, a module imported
    since, a module replaced under its name and a torch function patched by hand are all
    reached; nothing else walks again."""
    scan = ModuleScan()
    g0, g1, g2, g3 = (_group(f"kept_pg_g{i}") for i in range(4))
    user_module.PG = g0
    rebind_all([(g0, g1)], torch.nn.Linear(2, 2), meshes=[], only=("python.bindings",), scan=scan)
    assert user_module.PG is g1 and scan.walks == 1
    user_module.LATE = g1  # assigned after the walk, in a module it already knew: one group under two names
    user_module.PAIR = (g1, 0)  # and a tuple under two names, each rebuilt on its own
    user_module.PAIR_TOO = user_module.PAIR
    report = rebind_all([(g1, g2)], torch.nn.Linear(2, 2), meshes=[], only=("python.bindings",), scan=scan)
    assert (user_module.PG, user_module.LATE, user_module.PAIR[0], user_module.PAIR_TOO[0]) == (g2, g2, g2, g2)
    assert (report.counts["python.bindings"], scan.walks) == (4, 1)

    later = types.ModuleType("meshpact_test_imported_later")  # imported since the walk
    later.__file__ = str(tmp_path / "later.py")
    later.PG = g2
    sys.modules[later.__name__] = later
    try:
        rebind_all([(g2, g3)], torch.nn.Linear(2, 2), meshes=[], only=("python.bindings",), scan=scan)
        assert later.PG is g3 and user_module.PG is g3 and scan.walks == 2
        swapped = types.ModuleType(later.__name__)  # the same name, another module object (a reload by hand)
        swapped.__file__ = later.__file__
        swapped.PG = g3
        sys.modules[later.__name__] = swapped
        rebind_all([(g3, g0)], torch.nn.Linear(2, 2), meshes=[], only=("python.bindings",), scan=scan)
        assert swapped.PG is g0 and scan.walks == 3
    finally:
        del sys.modules[later.__name__]

    import torch.distributed.nn.functional as tdnf

    def patched(tensor, group=g0):  # a torch function with an import-time default, patched in by hand
        return tensor, group

    monkeypatch.setattr(tdnf, "all_reduce", patched)
    rebind_all([(g0, g1)], torch.nn.Linear(2, 2), meshes=[], only=("python.bindings",), scan=scan)
    assert patched(1)[1] is g1 and scan.walks == 4


def test_a_scan_refreshed_at_each_commit_walks_only_when_sys_modules_changed_and_leaves_rebinding_no_walk(
    user_module, tmp_path
):
    """A job refreshes its scan at each commit: the first walk, and one called for by a module a
    step imported, happen there; the recovery's rebinding that follows walks nothing and still
    reaches the new module's group."""
    scan = ModuleScan()
    scan.refresh()
    scan.refresh()
    assert scan.walks == 1
    g0, g1 = _group("refreshed_pg_g0"), _group("refreshed_pg_g1")
    later = types.ModuleType("meshpact_test_imported_by_a_step")
    later.__file__ = str(tmp_path / "step_import.py")
    later.PG = g0
    sys.modules[later.__name__] = later
    try:
        scan.refresh()
        assert scan.walks == 2
        rebind_all([(g0, g1)], torch.nn.Linear(2, 2), meshes=[], only=("python.bindings",), scan=scan)
        assert later.PG is g1 and scan.walks == 2
    finally:
        del sys.modules[later.__name__]


def test_groups_a_user_keeps_in_globals_defaults_and_closures_are_rebound_and_the_old_one_released(user_module):
    old, other, new = _group("user_pg_g0"), _group("other_pg_g0"), _group("user_pg_g1")
    ref = weakref.ref(old)

    def metric(x, group=old):  # a default evaluated at definition, like torch.distributed.nn.functional's
        return x, group

    def make_step(pg):
        def inner(batch):
            return batch, pg

        return inner

    step = make_step(old)  # only the runtime knows this one: it is the step function it was given
    user_module.PG = old
    user_module.SUBGROUPS = (old, [old, other, None])  # what dist.new_subgroups returns
    user_module.BY_NAME = {"pair": old, old: "key"}
    user_module.SEEN = {old}
    user_module.metric = metric
    found = {p for p, v in find_references({"python": python_bindings((step,))}) if v is old}
    assert {
        "python['meshpact_test_user_groups.PG']",
        "python['meshpact_test_user_groups.metric.__defaults__'][0]",
        "python['step function 0 (test_groups_a_user_keeps_in_globals_defaults_and_closures_are_rebound_and_"
        "the_old_one_released.<locals>.make_step.<locals>.inner).<closure pg>']",
    } <= found, found

    report = rebind_all([(old, new)], torch.nn.Linear(2, 2), meshes=[], only=("python.bindings",), functions=(step,))

    assert report.counts["python.bindings"] == 8
    assert user_module.PG is new
    assert user_module.SUBGROUPS[0] is new and user_module.SUBGROUPS[1][:2] == [new, other]
    assert user_module.BY_NAME["pair"] is new and user_module.BY_NAME[new] == "key" and old not in user_module.BY_NAME
    assert user_module.SEEN == {new}
    assert metric(1)[1] is new and step(1)[1] is new
    assert not [p for p, v in find_references({"python": python_bindings((step,))}) if v is old]
    del old
    gc.collect()
    assert ref() is None, [type(r).__name__ for r in gc.get_referrers(ref())]


def test_a_group_held_by_a_local_variable_is_named_since_no_rebind_can_reach_it():
    held, free = _group("metrics_pg_g0"), _group("free_pg_g0")
    lines = held_in_frames([held])
    assert len(lines) == 1, lines
    assert "metrics_pg_g0" in lines[0] and "local variable 'held'" in lines[0] and "cannot be rebound" in lines[0]
    assert "free_pg_g0" not in lines[0]
    del free
    nobody = _lines_for_a_group_no_variable_holds()
    assert nobody == [], nobody


def _lines_for_a_group_no_variable_holds() -> list[str]:
    return held_in_frames([_group("nobody_holds_it")])


def _modules_with_world_defaults() -> set[str]:
    """torch.distributed's modules with a function or method parameter defaulting to
    ``...WORLD`` (read from the installed source, so a torch upgrade that adds one shows)."""
    root = Path(dist.__file__).parent
    out = set()
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        if ".WORLD" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defaults = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
                if any(isinstance(d, ast.Attribute) and d.attr == "WORLD" for d in defaults):
                    rel = path.relative_to(root.parent.parent).with_suffix("")
                    out.add(".".join(rel.parts))
    return out


def test_every_torch_module_with_an_import_time_world_default_is_scanned():
    found = _modules_with_world_defaults()
    assert "torch.distributed.nn.functional" in found  # the reader works
    # distributed_c10d's own defaults are evaluated before any group exists (None)
    assert found - {"torch.distributed.distributed_c10d"} == set(TORCH_IMPORT_DEFAULTS)


def test_the_import_time_default_group_of_torch_distributed_nn_is_found_and_rebound():
    """torch.distributed.nn.functional binds ``group=group.WORLD`` when first imported: the
    default group of that moment stays referenced for the life of the process."""
    import torch.distributed.nn.functional as fn

    old, new = _group("meshpact_data_g0"), _group("meshpact_data_g1")
    saved = fn.all_reduce.__defaults__
    try:
        fn.all_reduce.__defaults__ = (*saved[:-1], old)  # as if imported while ``old`` was c10d's default
        assert "torch.distributed.nn.functional.all_reduce.__defaults__" in python_bindings()
        report = rebind_all([(old, new)], torch.nn.Linear(2, 2), meshes=[], only=("python.bindings",))
        assert report.counts["python.bindings"] == 1 and fn.all_reduce.__defaults__[-1] is new
    finally:
        fn.all_reduce.__defaults__ = saved


@pytest.fixture(scope="module")
def torch_only():
    """The probes' ranks, forked from a server that imported torch and nothing else (1.8 s of CPU
    a rank, paid once here). Not the rank fork server's preload: it imports modules that torch
    imports only after the group exists (torch.distributed.nn.functional, whose defaults then
    hold it) before any group, and those references are what these tests look for."""
    with ForkServer(("torch",)) as server:
        yield server


@pytest.mark.live
@pytest.mark.slow
def test_after_rebind_no_reference_leads_to_the_old_group_and_it_gets_zero_operations(torch_only):
    control = host_store("127.0.0.1", 0, 2)
    results = launch(
        "meshpact.live.trials.probe:rebind_probe",
        2,
        {"rounds": 2},
        timeout_s=120,
        env=lambda r: {"MESHPACT_CONTROL_PORT": str(control.port)},
        forkserver=torch_only,
    )
    for res in results:
        for audit in res.value["audits"]:
            before = audit["references_before"]
            # the walk finds the caches torch 2.13 keeps (so it would find a new one too) ...
            assert any(p.endswith("mesh_info.shard_process_group") for p in before), before
            assert "c10d._world._default_pg" in before
            assert any("_pg_registry" in p for p in before), before
            # ... and after the rebind none of them leads to the old group
            assert audit["references_after"] == [], audit["references_after"]
            assert audit["old_ops_after"] == 0 and audit["old_seq_ops_after"] == 0 and audit["new_ops"] > 0
            assert not audit["old_name_resolvable"]
            assert audit["rebound"]["fsdp.mesh_info"] >= 1 and audit["rebound"]["device_mesh.pg_registry"] == 1
        # every retired group is released once rebound, the generation-0 group included (torch's
        # import-time default arguments held it until they were rebound too)
        assert all(a["old_released"] for a in res.value["audits"]), res.value["audits"]


@pytest.mark.live
@pytest.mark.slow
def test_a_missed_site_is_caught_by_the_counters_even_though_training_still_works(torch_only):
    """An old gloo group that was never rebound keeps working and gives the same numbers;
    only the per-group counts and the reference walk show the rebind did not take."""
    control = host_store("127.0.0.1", 0, 2)
    results = launch(
        "meshpact.live.trials.probe:rebind_probe",
        2,
        {"rounds": 1, "skip_sites": ["fsdp.mesh_info"]},
        timeout_s=120,
        env=lambda r: {"MESHPACT_CONTROL_PORT": str(control.port)},
        forkserver=torch_only,
    )
    audit = results[0].value["audits"][0]
    assert audit["old_ops_after"] > 0 and audit["old_seq_ops_after"] > 0
    assert any(p.endswith("mesh_info.shard_process_group") for p in audit["references_after"])


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.parametrize(
    "ranks, mesh", [(2, {}), (4, {"mesh_shape": [2, 2], "mesh_names": ["replicate", "shard"]})], ids=["1-D", "2-D HSDP"]
)
def test_skipping_any_site_that_holds_a_reference_is_caught_by_object_or_by_name(ranks, mesh, torch_only):
    control = host_store("127.0.0.1", 0, ranks)
    results = launch(
        "meshpact.live.trials.probe:site_audit",
        ranks,
        mesh,
        timeout_s=240,
        env=lambda r: {"MESHPACT_CONTROL_PORT": str(control.port)},
        forkserver=torch_only,
    )
    for res in results:
        sites = res.value["sites"]
        assert set(sites) == {s.name for s in SITES}
        holding = {name for name, a in sites.items() if a["applied"] > 0}
        # every cache torch 2.13 keeps on this path holds the group here; FSDP's comm helpers
        # hold one only with process-group-allocated buffers, which gloo does not offer
        assert holding == {s.name for s in SITES} - {"fsdp.comm"}, sites
        for name in holding:
            assert sites[name]["missed"], f"skipping {name} went unnoticed"
            assert sites[name]["clean"] == [], (name, sites[name]["clean"])
            assert sites[name]["old_ops_after"] == 0 and sites[name]["new_ops"] > 0, (name, sites[name])
        assert any("_dim_group_names" in p for p in sites["device_mesh.dim_group_names"]["missed"])
        assert any("c10d resolves" in p for p in sites["c10d.registry"]["missed"])


def test_a_module_run_with_dash_m_is_judged_by_its_own_name(tmp_path):
    """``python -m meshpact.live.launch.launcher`` makes the runtime's module ``__main__``: it is the
    runtime's (skipped), while a user's script run as ``__main__`` (no spec) is scanned."""
    import importlib.machinery

    g0, g1 = _group("main_pg_g0"), _group("main_pg_g1")
    runtime_main = types.ModuleType("meshpact_test_main_runtime")
    runtime_main.__file__ = str(tmp_path / "launcher.py")
    runtime_main.__spec__ = importlib.machinery.ModuleSpec("meshpact.live.launch.launcher", None)
    user_main = types.ModuleType("meshpact_test_main_user")
    user_main.__file__ = str(tmp_path / "train.py")
    runtime_main.PG = user_main.PG = g0
    sys.modules.update({runtime_main.__name__: runtime_main, user_main.__name__: user_main})
    try:
        rebind_all([(g0, g1)], torch.nn.Linear(2, 2), meshes=[], only=("python.bindings",))
        assert user_main.PG is g1 and runtime_main.PG is g0
    finally:
        del sys.modules[runtime_main.__name__], sys.modules[user_main.__name__]
