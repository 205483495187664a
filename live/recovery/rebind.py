"""Rebinding: every cached reference to the data-path group, pointed at its replacement.

This module is the one place that knows where torch keeps process-group references. The
list :data:`SITES` was read off torch 2.13's source (``distributed_c10d.py``,
``device_mesh.py``, ``fsdp/_fully_shard/_fsdp_common.py``, ``_fsdp_param.py``,
``_fsdp_param_group.py``, ``_fsdp_collectives.py``):

- c10d's ``_world``: ``default_pg`` and the maps keyed by group (``pg_map``, ``pg_names``,
  ``pg_group_ranks``, ``pg_backend_config``, ``pg_to_tag``/``tags_to_pg``,
  ``pg_coalesce_state``), plus the C++ name registry (``_register_process_group``);
- each ``DeviceMesh``: ``_dim_group_names`` (names resolved through the registry on every
  ``get_group``) and ``_pg_registry`` (name -> group objects, which torch.compile reads
  while tracing), also on the root mesh of a submesh and on flattened meshes;
- FSDP2: every ``FSDPMeshInfo`` (``shard_process_group``, ``reduce_scatter_process_group``,
  ``replicate_process_group``) reachable as a param group's ``mesh_info`` and
  ``post_forward_mesh_info`` and each ``FSDPParam``'s, and the ``_group`` of
  process-group-allocating collective helpers (``_all_gather_comm``,
  ``_reduce_scatter_comm``).

:func:`find_references` walks the object graph from the model, the optimizer, FSDP's
states and c10d's world and returns the path of every process group it meets; the tests
assert that after :func:`rebind` no path leads to the old group, by object or by name, and
that c10d no longer resolves the old name, so a torch upgrade that caches a group somewhere
new fails a test instead of leaving a stale reference.
"""

from __future__ import annotations

import time
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

__all__ = ["SITES", "Site", "RebindReport", "rebind", "find_references", "fsdp_states", "meshes_of",
           "default_roots"]

_WORLD_MAPS = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "pg_to_tag", "tags_to_pg",
               "pg_coalesce_state")
_MESH_INFO_FIELDS = ("shard_process_group", "reduce_scatter_process_group", "replicate_process_group")
_COMM_FIELDS = ("_all_gather_comm", "_reduce_scatter_comm")


@dataclass(frozen=True)
class Site:
    name: str
    source: str  # where torch 2.13 keeps it
    apply: Callable[[dist.ProcessGroup, dist.ProcessGroup, "_Context"], int]  # returns references rebound


@dataclass
class _Context:
    model: Any
    optimizer: Any
    meshes: list[Any]


@dataclass(frozen=True)
class RebindReport:
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def fsdp_states(model: torch.nn.Module) -> list[Any]:
    """The FSDP2 state of every ``fully_shard``-ed module in ``model``, root first."""
    from torch.distributed._composable_state import _get_module_state
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    out = []
    for module in model.modules():
        state = _get_module_state(module)
        if isinstance(state, FSDPState) and state not in out:
            out.append(state)
    return out


def _param_groups(model: torch.nn.Module) -> Iterator[Any]:
    for state in fsdp_states(model):
        yield from state._fsdp_param_groups


def _mesh_infos(model: torch.nn.Module) -> list[Any]:
    seen: dict[int, Any] = {}
    for group in _param_groups(model):
        holders = [group, *group.fsdp_params]
        for holder in holders:
            for attr in ("mesh_info", "post_forward_mesh_info"):
                info = getattr(holder, attr, None)
                if info is not None:
                    seen[id(info)] = info
    return list(seen.values())


def meshes_of(model: torch.nn.Module, optimizer: Any = None) -> list[Any]:
    """Every DeviceMesh the model's FSDP state and DTensors refer to, with root and flattened meshes."""
    from torch.distributed.device_mesh import DeviceMesh

    found: dict[int, Any] = {}

    def add(mesh: Any) -> None:
        if isinstance(mesh, DeviceMesh) and id(mesh) not in found:
            found[id(mesh)] = mesh
            add(getattr(mesh, "_root_mesh", None))
            for sub in getattr(mesh, "_flatten_mapping", {}).values():
                add(sub)

    for info in _mesh_infos(model):
        add(info.mesh)
        add(getattr(info, "spmd_mesh", None))
    for p in model.parameters():
        add(getattr(p, "device_mesh", None))
    if optimizer is not None:
        for slot in optimizer.state.values():
            for v in slot.values():
                add(getattr(v, "device_mesh", None))
    return list(found.values())


# -- the sites ------------------------------------------------------------------------------
def _c10d_world(old: dist.ProcessGroup, new: dist.ProcessGroup, ctx: _Context) -> int:
    n = 0
    w = c10d._world
    if w.default_pg is old:
        w.default_pg = new
        n += 1
    for mapping in (getattr(w, m) for m in _WORLD_MAPS if m != "tags_to_pg"):
        if old in mapping:
            value = mapping.pop(old)
            if mapping is not w.pg_names and mapping is not w.pg_coalesce_state:
                mapping.setdefault(new, value)
            n += 1
    for tag, groups in list(w.tags_to_pg.items()):
        if old in groups:
            groups[:] = [g for g in groups if g is not old]
            if new not in groups:
                groups.append(new)
            n += 1
    return n


def _c10d_registry(old: dist.ProcessGroup, new: dist.ProcessGroup, ctx: _Context) -> int:
    n = 0
    if new not in c10d._world.pg_names:
        c10d._world.pg_names[new] = new.group_name
    try:
        if c10d._resolve_process_group(new.group_name) is not new:
            raise LookupError
    except (LookupError, RuntimeError, ValueError):
        c10d._register_process_group(new.group_name, new)
        n += 1
    try:
        c10d._unregister_process_group(old.group_name)
        n += 1
    except (LookupError, RuntimeError, ValueError):
        pass
    return n


def _mesh_names(old: dist.ProcessGroup, new: dist.ProcessGroup, ctx: _Context) -> int:
    n = 0
    for mesh in ctx.meshes:
        names = getattr(mesh, "_dim_group_names", None)
        if names and old.group_name in names:
            mesh._dim_group_names = [new.group_name if x == old.group_name else x for x in names]
            n += 1
    return n


def _mesh_pg_registry(old: dist.ProcessGroup, new: dist.ProcessGroup, ctx: _Context) -> int:
    n = 0
    for mesh in ctx.meshes:
        registry = getattr(mesh, "_pg_registry", None)
        if not registry:
            continue
        for key in [k for k, g in registry.items() if g is old or k == old.group_name]:
            del registry[key]
            registry[new.group_name] = new
            n += 1
    return n


def _fsdp_mesh_infos(old: dist.ProcessGroup, new: dist.ProcessGroup, ctx: _Context) -> int:
    n = 0
    for info in _mesh_infos(ctx.model):
        for attr in _MESH_INFO_FIELDS:
            if getattr(info, attr, None) is old:
                setattr(info, attr, new)
                n += 1
    return n


def _fsdp_comms(old: dist.ProcessGroup, new: dist.ProcessGroup, ctx: _Context) -> int:
    n = 0
    for group in _param_groups(ctx.model):
        for attr in _COMM_FIELDS:
            comm = getattr(group, attr, None)
            if comm is not None and getattr(comm, "_group", None) is old:
                comm._group = new
                n += 1
    return n


SITES: tuple[Site, ...] = (
    Site("c10d.world", "distributed_c10d._World: default_pg, pg_map, pg_names, pg_group_ranks, "
         "pg_backend_config, pg_to_tag, tags_to_pg, pg_coalesce_state", _c10d_world),
    Site("c10d.registry", "distributed_c10d._register_process_group / _resolve_process_group (C++)", _c10d_registry),
    Site("device_mesh.dim_group_names", "DeviceMesh._dim_group_names (resolved by name on get_group)", _mesh_names),
    Site("device_mesh.pg_registry", "DeviceMesh._pg_registry (read while torch.compile traces)", _mesh_pg_registry),
    Site("fsdp.mesh_info", "FSDPMeshInfo.shard/reduce_scatter/replicate_process_group via "
         "FSDPParamGroup and FSDPParam mesh_info, post_forward_mesh_info", _fsdp_mesh_infos),
    Site("fsdp.comm", "FSDPParamGroup._all_gather_comm/_reduce_scatter_comm._group", _fsdp_comms),
)


def rebind(old: dist.ProcessGroup, new: dist.ProcessGroup, model: torch.nn.Module, optimizer: Any = None,
           meshes: Iterable[Any] | None = None, skip: tuple[str, ...] = (),
           only: tuple[str, ...] | None = None) -> RebindReport:
    """Point every site that holds ``old`` (the object or its name) at ``new``; returns what was
    rebound and how long it took.

    ``skip`` leaves the named sites alone and ``only`` applies just those: for audits that show
    a missed site is caught, and then complete the rebind.
    """
    t0 = time.perf_counter()
    ctx = _Context(model, optimizer, list(meshes) if meshes is not None else meshes_of(model, optimizer))
    counts = {site.name: site.apply(old, new, ctx) for site in SITES
              if site.name not in skip and (only is None or site.name in only)}
    return RebindReport(counts, time.perf_counter() - t0)


# -- the audit ------------------------------------------------------------------------------
_SKIP = (types.ModuleType, type, types.BuiltinFunctionType, str, bytes, int, float, bool, type(None))


def default_roots(model: torch.nn.Module, optimizer: Any = None) -> dict[str, Any]:
    """Where cached references can hide: the model, optimizer, FSDP states, meshes, c10d."""
    from torch.distributed import _composable_state

    w = c10d._world  # its maps are properties over module globals: walk each one
    roots: dict[str, Any] = {"model": model, "c10d._world": w,
                             **{f"c10d._world.{m}": getattr(w, m) for m in _WORLD_MAPS},
                             "fsdp_states": fsdp_states(model), "meshes": meshes_of(model, optimizer),
                             "composable_state": list(_composable_state._module_state_mapping.items())}
    if optimizer is not None:
        roots["optimizer"] = optimizer
    return roots


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for i, (k, v) in enumerate(list(obj.items())):
            yield f"[key {i}]", k
            yield f"[{k!r}]" if isinstance(k, (str, int)) else f"[value {i}]", v
        return
    if isinstance(obj, (list, tuple, set, frozenset)) or type(obj).__name__ == "deque":
        for i, v in enumerate(list(obj)):
            yield f"[{i}]", v
        return
    if isinstance(obj, types.MethodType):
        yield ".__self__", obj.__self__
        yield ".__func__", obj.__func__
        return
    if isinstance(obj, types.FunctionType):
        for i, cell in enumerate(obj.__closure__ or ()):
            try:
                yield f".<closure {i}>", cell.cell_contents
            except ValueError:
                pass
        return
    if hasattr(obj, "func") and hasattr(obj, "keywords") and hasattr(obj, "args"):  # functools.partial
        yield ".func", obj.func
        yield ".args", obj.args
        yield ".keywords", obj.keywords
    if isinstance(obj, weakref.ref):
        target = obj()
        if target is not None:
            yield "()", target
        return
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        for k, v in list(d.items()):
            yield f".{k}", v
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()) or ():
            if isinstance(slot, str) and slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                yield f".{slot}", getattr(obj, slot)


def find_references(roots: dict[str, Any], targets: tuple[type, ...] | None = None,
                    limit: int = 500_000, names: frozenset[str] = frozenset()) -> list[tuple[str, Any]]:
    """Paths from ``roots`` to every object of ``targets`` (default: ProcessGroup) in the graph,
    and to every string in ``names`` (group names: caches that resolve a group by name)."""
    targets = targets or (dist.ProcessGroup,)
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = list(roots.items())
    while stack and len(seen) < limit:
        path, obj = stack.pop()
        if isinstance(obj, targets) or (names and isinstance(obj, str) and obj in names):
            found.append((path, obj))
            continue
        if isinstance(obj, _SKIP) or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor) and type(obj) is torch.Tensor:
            continue
        try:
            children = list(_children(obj))
        except Exception:  # an object whose attributes cannot be read is not a cache
            continue
        stack.extend((path + step, child) for step, child in children)
    return found
