"""Rebinding reaches every cached process-group reference; the old group gets no operations."""

from __future__ import annotations

import functools
import weakref

import pytest

from meshpact.live.launcher import host_store, launch
from meshpact.live.recovery.rebind import SITES, find_references


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


@pytest.mark.live
@pytest.mark.slow
def test_after_rebind_no_reference_leads_to_the_old_group_and_it_gets_zero_operations():
    control = host_store("127.0.0.1", 0, 2)
    results = launch("meshpact.live.recovery.probe:rebind_probe", 2, {"rounds": 2}, timeout_s=120,
                     env=lambda r: {"MESHPACT_CONTROL_PORT": str(control.port)})
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
        # a group built by a rebuild is released outright once rebound
        assert res.value["audits"][-1]["old_released"]


@pytest.mark.live
@pytest.mark.slow
def test_a_missed_site_is_caught_by_the_counters_even_though_training_still_works():
    """An old gloo group that was never rebound keeps working and gives the same numbers;
    only the per-group counts and the reference walk show the rebind did not take."""
    control = host_store("127.0.0.1", 0, 2)
    results = launch("meshpact.live.recovery.probe:rebind_probe", 2, {"rounds": 1, "skip_sites": ["fsdp.mesh_info"]},
                     timeout_s=120, env=lambda r: {"MESHPACT_CONTROL_PORT": str(control.port)})
    audit = results[0].value["audits"][0]
    assert audit["old_ops_after"] > 0 and audit["old_seq_ops_after"] > 0
    assert any(p.endswith("mesh_info.shard_process_group") for p in audit["references_after"])


@pytest.mark.live
@pytest.mark.slow
@pytest.mark.parametrize("ranks, mesh", [(2, {}), (4, {"mesh_shape": [2, 2], "mesh_names": ["replicate", "shard"]})],
                         ids=["1-D", "2-D HSDP"])
def test_skipping_any_site_that_holds_a_reference_is_caught_by_object_or_by_name(ranks, mesh):
    control = host_store("127.0.0.1", 0, ranks)
    results = launch("meshpact.live.recovery.probe:site_audit", ranks, mesh, timeout_s=240,
                     env=lambda r: {"MESHPACT_CONTROL_PORT": str(control.port)})
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
