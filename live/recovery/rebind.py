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
  ``_reduce_scatter_comm``);
- Python bindings: the globals of the job's own modules (any module outside ``site-packages``
  and the standard library: a user's ``PG = dist.new_group(...)``, a ``new_subgroups`` result,
  lists, tuples, dicts and sets of groups), their functions' defaults and closure cells, the
  closure of the step function the runtime was given, and the defaults torch evaluates at
  import (:data:`TORCH_IMPORT_DEFAULTS`: ``torch.distributed.nn.functional``'s
  ``group=group.WORLD`` holds whatever group was c10d's default when it was first imported,
  the generation-0 group). Installed packages' globals are not scanned (judged once per
  top-level package), nor Meshpact's own modules (their groups live in the session): either
  would cost every recovery milliseconds for nothing.

A group held where no code can reach it, a plain local variable of a running function (its
frame), cannot be rebound: :func:`held_in_frames` names each such variable so the runtime can
say so in one line, and the group stays alive (and broken) until that variable is dropped.

:func:`find_references` walks the object graph from the model, the optimizer, FSDP's
states and c10d's world and returns the path of every process group it meets; the tests
assert that after :func:`rebind` no path leads to the old group, by object or by name, and
that c10d no longer resolves the old name, so a torch upgrade that caches a group somewhere
new fails a test instead of leaving a stale reference.
"""

from __future__ import annotations

import functools
import operator
import sys
import sysconfig
import time
import types
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .communicator import base_name

__all__ = [
    "SITES",
    "Site",
    "RebindReport",
    "rebind",
    "rebind_all",
    "find_references",
    "fsdp_states",
    "meshes_of",
    "default_roots",
    "python_bindings",
    "held_in_frames",
    "TORCH_IMPORT_DEFAULTS",
    "ModuleScan",
    "ObjectScan",
    "ObjectWalk",
    "walk_objects",
    "UnreachableGroupWarning",
    "module_groups",
    "function_key",
]

_WORLD_MAPS = (
    "pg_map",
    "pg_names",
    "pg_group_ranks",
    "pg_backend_config",
    "pg_to_tag",
    "tags_to_pg",
    "pg_coalesce_state",
)
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
    functions: tuple[Callable[..., Any], ...] = ()  # the step function(s) the runtime was given
    scan: "ModuleScan | None" = None  # which modules to read, kept between recoveries (None: found now)
    _bindings: "list[_Slot] | None" = None  # Python places holding a group, found once per rebind_all
    _states: list[Any] | None = None  # the model's FSDP states, found once per rebind_all

    def states(self) -> list[Any]:
        if self._states is None:
            self._states = fsdp_states(self.model)
        return self._states

    def bindings(self) -> "list[_Slot]":
        if self._bindings is None:
            self._bindings = _python_slots(self.functions, self.scan or ModuleScan())
        return self._bindings


@dataclass(frozen=True)
class RebindReport:
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    unrebound: tuple[str, ...] = ()  # retired groups still held where no rebind can reach (frame locals)
    site_s: dict[str, float] = field(default_factory=dict)  # seconds per site (and "frames": the frame walk)

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def fsdp_states(model: torch.nn.Module) -> list[Any]:
    """The FSDP2 state of every ``fully_shard``-ed module in ``model``, root first. Where
    ``model`` is the FSDP root and has run (lazily initialized), that is the list the root
    keeps of its tree's states (``_state_ctx.all_states``, walked by FSDP in this order) and
    no module is walked; otherwise the modules are."""
    from torch.distributed._composable_state import _get_module_state
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    root = _get_module_state(model)
    if isinstance(root, FSDPState) and root._is_root:
        known = getattr(getattr(root, "_state_ctx", None), "all_states", None)
        if known:
            return list(known)
    return _walk_states(model)


def _walk_states(model: torch.nn.Module) -> list[Any]:
    """:func:`fsdp_states` by walking every module (any model, lazily initialized or not)."""
    from torch.distributed._composable_state import _get_module_state
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    out = []
    for module in model.modules():
        state = _get_module_state(module)
        if isinstance(state, FSDPState) and state not in out:
            out.append(state)
    return out


def _param_groups(states: list[Any]) -> Iterator[Any]:
    for state in states:
        yield from state._fsdp_param_groups


def _mesh_infos(states: list[Any]) -> list[Any]:
    seen: dict[int, Any] = {}
    for group in _param_groups(states):
        holders = [group, *group.fsdp_params]
        for holder in holders:
            for attr in ("mesh_info", "post_forward_mesh_info"):
                info = getattr(holder, attr, None)
                if info is not None:
                    seen[id(info)] = info
    return list(seen.values())


def meshes_of(
    model: torch.nn.Module,
    optimizer: Any = None,
    states: list[Any] | None = None,
    params: Iterable[torch.nn.Parameter] | None = None,
    tensor_meshes: Iterable[Any] | None = None,
) -> list[Any]:
    """Every DeviceMesh the model's FSDP state and DTensors refer to, with root and flattened
    meshes (``states`` and ``params``: the model's FSDP states and parameters when the caller
    has them; ``tensor_meshes``: the meshes of the parameters and of their optimizer state where
    the caller knows them, as a recovery does from its state check: those are not walked, only
    optimizer state of parameters the model does not hold)."""
    from torch.distributed.device_mesh import DeviceMesh

    found: dict[int, Any] = {}
    seen: set[int] = set()  # ids asked already: most parameters share one mesh

    def add(mesh: Any) -> None:
        if mesh is None or id(mesh) in seen:
            return
        seen.add(id(mesh))
        if isinstance(mesh, DeviceMesh):
            found[id(mesh)] = mesh
            add(getattr(mesh, "_root_mesh", None))
            for sub in getattr(mesh, "_flatten_mapping", {}).values():
                add(sub)

    for info in _mesh_infos(fsdp_states(model) if states is None else states):
        add(info.mesh)
        add(getattr(info, "spmd_mesh", None))
    params = list(model.parameters() if params is None else params)
    known: set[int] = set()  # parameters whose optimizer state's meshes are in tensor_meshes
    if tensor_meshes is not None:
        for mesh in tensor_meshes:
            add(mesh)
        known = {id(p) for p in params}
    else:
        for p in params:
            add(getattr(p, "device_mesh", None))
    if optimizer is not None:
        from .state import optimizer_parts

        for o in optimizer_parts(optimizer).all:  # a container's state lies in its inner optimizers
            for held, slot in o.state.items():
                if id(held) not in known:
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
    for info in _mesh_infos(ctx.states()):
        for attr in _MESH_INFO_FIELDS:
            if getattr(info, attr, None) is old:
                setattr(info, attr, new)
                n += 1
    return n


def _fsdp_comms(old: dist.ProcessGroup, new: dist.ProcessGroup, ctx: _Context) -> int:
    n = 0
    for group in _param_groups(ctx.states()):
        for attr in _COMM_FIELDS:
            comm = getattr(group, attr, None)
            if comm is not None and getattr(comm, "_group", None) is old:
                comm._group = new
                n += 1
    return n


# -- Python bindings ------------------------------------------------------------------------
_C10D_MODULE = c10d.__name__  # its maps are the c10d sites' (kept apart so each site's audit is its own)
# torch 2.13's modules whose functions or methods default to ``dist.group.WORLD``, evaluated when
# the module is first imported: whatever group was c10d's default then stays referenced
# (distributed_c10d's own such defaults were evaluated before any group existed: None)
TORCH_IMPORT_DEFAULTS = frozenset(
    {
        "torch.distributed.nn.functional",
        "torch.distributed.optim.zero_redundancy_optimizer",
        "torch.distributed.fsdp.sharded_grad_scaler",
    }
)
_LIBRARY_DIRS = ("/site-packages/", "/dist-packages/")
_STDLIB = sysconfig.get_paths()["stdlib"]
_MAX_ITEMS = 4096  # containers larger than this are registries, not where a job keeps its groups
_DEPTH = 3  # nesting followed inside a container (new_subgroups: a tuple holding a list of groups)
# the live runtime's frames (recovery, launcher, fork server) hold retired groups on purpose or hold none
_OWN_DIR = str(Path(__file__).parents[1])


def _group_matcher() -> Callable[[Any], bool]:
    """``x`` is a ProcessGroup, judged by its type once per type (``isinstance`` against torch's
    opaque types runs Python code; a scan of every global asks it tens of thousands of times)."""
    by_type: dict[type, bool] = {}

    def match(x: Any) -> bool:
        t = type(x)
        known = by_type.get(t)
        if known is None:
            known = by_type[t] = issubclass(t, dist.ProcessGroup)
        return known

    return match


def _is_group(x: Any) -> bool:
    return isinstance(x, dist.ProcessGroup)


_ATOMS = frozenset({int, float, complex, bool, str, bytes, type(None)})  # never a group, never holding one


def _holds(value: Any, match: Callable[[Any], bool], depth: int = _DEPTH) -> bool:
    """``value`` is, or contains (lists, tuples, sets, dict keys and values), something ``match``es
    (``match`` is never asked of a number, a string or None: none is a group)."""
    if match(value):
        return True
    if depth == 0 or not isinstance(value, (list, tuple, set, frozenset, dict)) or len(value) > _MAX_ITEMS:
        return False
    for items in (value.keys(), value.values()) if isinstance(value, dict) else (value,):
        for x in items:
            if type(x) not in _ATOMS and _holds(x, match, depth - 1):
                return True
    return False


def _swap(value: Any, old: Any, new: Any, depth: int = _DEPTH) -> tuple[Any, int]:
    """``value`` with ``old`` replaced by ``new`` (lists, dicts and sets changed in place, tuples
    rebuilt): the value to store back and how many references were replaced."""
    if value is old:
        return new, 1
    if depth == 0 or not isinstance(value, (list, tuple, set, dict)) or len(value) > _MAX_ITEMS:
        return value, 0
    n = 0
    if isinstance(value, list):
        for i, x in enumerate(value):
            y, k = _swap(x, old, new, depth - 1)
            if k:
                value[i], n = y, n + k
        return value, n
    if isinstance(value, dict):
        for key in list(value):
            y, k = _swap(value[key], old, new, depth - 1)
            if k:
                value[key], n = y, n + k
            if key is old:
                value[new] = value.pop(old)
                n += 1
        return value, n
    if isinstance(value, set):
        if old in value:
            value.discard(old)
            value.add(new)
            n += 1
        return value, n
    items = [_swap(x, old, new, depth - 1) for x in value]  # a tuple: rebuilt if anything changed
    n = sum(k for _, k in items)
    if not n:
        return value, 0
    fresh = [y for y, _ in items]
    make = getattr(type(value), "_make", None)  # a named tuple's
    return (make(fresh) if make is not None else type(value)(fresh)), n


@dataclass(frozen=True)
class _Slot:
    """One Python place that holds a group (directly or in a container): read it, write it back."""

    path: str
    get: Callable[[], Any]
    set: Callable[[Any], None]


def _function_slots(
    fn: types.FunctionType,
    path: str,
    out: list[_Slot],
    seen: set[int],
    is_group: Callable[[Any], bool] = _is_group,
    depth: int = 4,
) -> None:
    """``fn``'s defaults, keyword defaults and closure cells that hold a group; functions in its
    closure are followed (a step function closing over the user's)."""
    if id(fn) in seen:
        return
    seen.add(id(fn))
    if fn.__defaults__ and _holds(fn.__defaults__, is_group):
        out.append(
            _Slot(
                f"{path}.__defaults__",
                functools.partial(getattr, fn, "__defaults__"),
                functools.partial(setattr, fn, "__defaults__"),
            )
        )
    if fn.__kwdefaults__ and _holds(fn.__kwdefaults__, is_group):
        out.append(
            _Slot(
                f"{path}.__kwdefaults__",
                functools.partial(getattr, fn, "__kwdefaults__"),
                functools.partial(setattr, fn, "__kwdefaults__"),
            )
        )
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if _holds(value, is_group):
            out.append(
                _Slot(
                    f"{path}.<closure {name}>",
                    functools.partial(getattr, cell, "cell_contents"),
                    functools.partial(setattr, cell, "cell_contents"),
                )
            )
        target = value.__func__ if type(value) is types.MethodType else value  # (neither type has subclasses)
        if type(target) is types.FunctionType and depth > 0:
            _function_slots(target, f"{path}.<closure {name}>", out, seen, is_group, depth - 1)
        elif depth > 0 and hasattr(value, "__dict__") and not isinstance(value, (types.ModuleType, type)):
            # a holder object (e.g. a dataclass of functions)
            for attr, v in [(a, v) for a, v in vars(value).items() if type(v) is types.FunctionType]:
                _function_slots(v, f"{path}.<closure {name}>.{attr}", out, seen, is_group, depth - 1)


def _python_slots(functions: Iterable[Callable[..., Any]], scan: "ModuleScan") -> list[_Slot]:
    """Every module global that is or holds a group, and every default and closure cell (of
    module functions and of ``functions``) that does."""
    with warnings.catch_warnings():  # reading every global touches deprecated ones (dist.reduce_op)
        warnings.simplefilter("ignore")
        return _scan_python_slots(functions, scan)


def _library(module: types.ModuleType) -> bool:
    """An installed package or the standard library (not the job's own code)."""
    path = getattr(module, "__file__", None)
    return not path or _library_path(path)


def _library_path(path: str) -> bool:
    return any(part in path for part in _LIBRARY_DIRS) or path.startswith((_STDLIB, "<frozen "))


@functools.lru_cache(maxsize=4096)
def _user_file(path: str) -> bool:
    """Code from ``path`` is the user's: neither the live runtime's own nor an installed
    package's or the standard library's (a pure function of the name, remembered: the frame walk
    of every recovery asks it of the same few dozen files)."""
    return not path.startswith(_OWN_DIR) and not _library_path(path)


def _runtime_module(name: str) -> bool:
    """Meshpact's own code: it keeps its groups in the session, never in a module global, so a
    scan of its many modules would find nothing (a workload loaded from a path is named
    ``meshpact_workload_*`` and is scanned)."""
    return name == "meshpact" or name.startswith("meshpact.")


def _default_slots(fn: Any, path: str, out: list[_Slot], is_group: Callable[[Any], bool]) -> None:
    if isinstance(fn, types.FunctionType) and (fn.__defaults__ or fn.__kwdefaults__):
        _function_slots(fn, path, out, set(), is_group, depth=0)


class UnreachableGroupWarning(UserWarning):
    """A process group c10d knows that no place rebinding reads holds: after a recovery, whatever
    holds it keeps the old, broken group."""


_MAX_OBJECTS = 200_000  # objects one walk reads at most (a graph larger than this is cut, and said so)


@dataclass(frozen=True)
class ObjectWalk:
    """What one walk of the job's objects found: the slots holding a group, where each group
    (by name) was seen, and whether the walk stopped at :data:`_MAX_OBJECTS`."""

    slots: tuple[_Slot, ...]
    seen: dict[str, str]  # group name -> the first path that holds it
    objects: int
    cut: bool


def _walked_type(t: type) -> bool:
    """Instances of ``t`` are followed into their attributes: the job's own classes, and classes
    made from one (``fully_shard`` gives a module the class ``FSDP<its class>``, made in torch). A
    library's instances are read one level (a ``PipelineStage.group``) but not followed: their
    internals hold no group of the job's but in the places :data:`SITES` know."""
    return any(_user_type(c) for c in t.__mro__[:-1])


def _groups_in(value: Any, match: Callable[[Any], bool]) -> list[Any]:
    """The groups ``value`` is or holds (in containers, as :func:`_holds` looks)."""
    found: list[Any] = []

    def collect(x: Any) -> bool:
        if match(x):
            found.append(x)
        return False

    _holds(value, collect)
    return found


@functools.lru_cache(maxsize=4096)
def _user_type(t: type) -> bool:
    module = sys.modules.get(t.__module__)
    path = getattr(module, "__file__", None)
    if t.__module__ == "__main__" or (path is None and module is not None and t.__module__ != "builtins"):
        return True
    return bool(path) and not _library_path(str(path)) and not _runtime_module(t.__module__)


def _attr_slot(holder: dict[str, Any], key: str, path: str) -> _Slot:
    return _Slot(
        path, functools.partial(operator.getitem, holder, key), functools.partial(operator.setitem, holder, key)
    )


def _slot_attr(obj: Any, name: str, path: str) -> _Slot:
    return _Slot(path, functools.partial(getattr, obj, name), functools.partial(object.__setattr__, obj, name))


def walk_objects(
    roots: Iterable[tuple[str, Any]], is_group: Callable[[Any], bool] | None = None, most: int = _MAX_OBJECTS
) -> ObjectWalk:
    """Every attribute (``__dict__`` entry or ``__slots__`` member) of an object reachable from
    ``roots``, and every closure cell and defaults tuple of a function of the job's reachable so,
    that is, or holds in a list, tuple, dict or set, a process group, as slots rebinding reads
    and writes. Followed, as deep as they go: containers, functions (closure cells and
    defaults), bound methods, ``functools.partial`` and instances of the job's own classes; an
    installed library's instance (a ``torch.nn.Linear``, a ``PipelineStage``) is read one level
    and not followed, nor is a tensor. Bounded: each object once, ``most`` objects in all."""
    match = is_group or _group_matcher()
    slots: list[_Slot] = []
    seen_groups: dict[str, str] = {}
    visited: set[int] = set()
    stack: list[tuple[str, Any]] = list(roots)
    stack.reverse()
    cut = False

    def note(value: Any, path: str) -> None:
        for g in _groups_in(value, match):
            seen_groups.setdefault(g.group_name, path)

    while stack:
        path, obj = stack.pop()
        t = type(obj)
        if t in _ATOMS or id(obj) in visited or isinstance(obj, (types.ModuleType, type, torch.Tensor)) or match(obj):
            continue
        if len(visited) >= most:
            cut = True
            break
        visited.add(id(obj))
        if isinstance(obj, (list, tuple, set, frozenset)) or t.__name__ == "deque":
            if len(obj) <= _MAX_ITEMS:
                stack.extend((f"{path}[{i}]", x) for i, x in enumerate(list(obj)))
            continue
        if isinstance(obj, dict):
            if len(obj) <= _MAX_ITEMS:
                stack.extend((f"{path}[{k!r}]", v) for k, v in list(obj.items()))
            continue
        if t is types.MethodType:
            stack.append((f"{path}.__self__", obj.__self__))
            stack.append((path, obj.__func__))
            continue
        if t is types.FunctionType:
            if _user_file(obj.__code__.co_filename):
                for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
                    if not _filled(cell):
                        continue
                    where = f"{path}.<closure {name}>"
                    if _holds(cell.cell_contents, match):  # a reducer made as a closure over its group
                        slots.append(
                            _Slot(
                                where,
                                functools.partial(getattr, cell, "cell_contents"),
                                functools.partial(setattr, cell, "cell_contents"),
                            )
                        )
                        note(cell.cell_contents, where)
                    stack.append((where, cell.cell_contents))
                if obj.__defaults__ and _holds(obj.__defaults__, match):
                    slots.append(
                        _Slot(
                            f"{path}.__defaults__",
                            functools.partial(getattr, obj, "__defaults__"),
                            functools.partial(setattr, obj, "__defaults__"),
                        )
                    )
                    note(obj.__defaults__, f"{path}.__defaults__")
                stack.extend((f"{path}.__defaults__[{i}]", x) for i, x in enumerate(obj.__defaults__ or ()))
            continue
        if isinstance(obj, functools.partial):
            stack.append((f"{path}.func", obj.func))
            stack.extend((f"{path}.args[{i}]", x) for i, x in enumerate(obj.args))
            stack.extend((f"{path}.keywords[{k!r}]", v) for k, v in obj.keywords.items())
            continue
        deeper = _walked_type(t)
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict):
            for key, value in list(d.items()):
                if type(value) in _ATOMS:
                    continue
                if _holds(value, match):
                    slots.append(_attr_slot(d, key, f"{path}.{key}"))
                    note(value, f"{path}.{key}")
                if deeper:
                    stack.append((f"{path}.{key}", value))
        if deeper:
            for cls in t.__mro__:
                for name in getattr(cls, "__slots__", ()) or ():
                    if isinstance(name, str) and name not in ("__dict__", "__weakref__"):
                        value = getattr(obj, name, None)
                        if type(value) in _ATOMS:
                            continue
                        if _holds(value, match):
                            slots.append(_slot_attr(obj, name, f"{path}.{name}"))
                            note(value, f"{path}.{name}")
                        stack.append((f"{path}.{name}", value))
    return ObjectWalk(tuple(slots), seen_groups, len(visited), cut)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def function_key(fn: Callable[..., Any] | None) -> tuple[int, ...]:
    """What a step function reaches, for telling whether an object walk from it is current: its code
    and the objects its closure, defaults and ``self`` hold (a ``functools.partial``: what it wraps
    and the objects its arguments are). A loop that passes a new lambda or partial each step
    (``rt.step(lambda b: train_step(model, b), batch)``) reaches the same objects each time."""
    if fn is None:
        return ()
    if isinstance(fn, functools.partial):  # a partial made anew each step: what it wraps and holds
        held = [*fn.args, *fn.keywords.values()]
        return (*function_key(fn.func), -1, *(id(x) for x in held if type(x) not in _ATOMS))
    target = getattr(fn, "__func__", fn)
    code = getattr(target, "__code__", None)
    held = [c.cell_contents for c in (getattr(target, "__closure__", None) or ()) if _filled(c)]
    held += list(getattr(target, "__defaults__", None) or ())
    return (
        id(code) if code is not None else id(target),
        id(getattr(fn, "__self__", None)),
        *(id(x) for x in held if type(x) not in _ATOMS),
    )


class ObjectScan:
    """The attributes of the job's objects that hold a group (:func:`walk_objects`), kept between
    recoveries: a recovery reads and writes these slots and walks no object graph. The runtime
    refreshes it at commits; it walks again only when what it walked from may have changed: a
    group was made or dropped (c10d's groups), or the step function, the model or the registered
    objects are other objects. Each walk also names, in one :class:`UnreachableGroupWarning` per
    group, the groups c10d knows that nothing rebinding reads holds."""

    def __init__(self) -> None:
        self.slots: list[_Slot] = []
        self.walks = 0
        self.last_seen: dict[str, str] = {}  # base group name -> where a walk last found it
        self.warned: set[str] = set()  # base names warned of (once each)
        self.cut = False
        self._key: Any = None

    def refresh(
        self, key: Any, roots: Callable[[], list[tuple[str, Any]]], known: Callable[[], tuple[dict[str, Any], set[str]]]
    ) -> list[str]:
        """Walk ``roots()`` again if ``key`` changed since the last walk. ``known()`` gives the
        groups c10d knows (name -> group, the session's own left out) and the names reached by
        the other sites (meshes, FSDP, module globals): those none reaches are warned of. Returns
        the warnings made now."""
        if key == self._key:
            return []
        walk = walk_objects(roots())
        self.slots, self.cut, self._key = list(walk.slots), walk.cut, key
        self.walks += 1
        for name, path in walk.seen.items():
            self.last_seen[base_name(name)] = path
        groups, reached = known()
        lines = []
        for name, pg in sorted(groups.items()):
            base = base_name(name)
            if name in walk.seen or name in reached or base in self.warned:
                continue
            self.warned.add(base)
            where = self.last_seen.get(base)
            lines.append(
                f"process group {name!r} ({pg.size()} ranks) is held nowhere a recovery rebinds (module "
                "globals, closures, the model's modules, the objects registered with state=, the step "
                "function, and the attributes of the objects they reach): "
                + (f"last seen at {where}; " if where else "never seen there; ")
                + "whatever holds it keeps the old, broken group after a recovery"
            )
        for line in lines:
            warnings.warn(line, UnreachableGroupWarning, stacklevel=2)
        return lines


class ModuleScan:
    """Which modules the ``python.bindings`` site reads: the job's own modules (every global,
    in depth, at each rebind) and the functions of :data:`TORCH_IMPORT_DEFAULTS` that have
    defaults (each one's defaults read at each rebind). Finding them walks all of
    ``sys.modules`` (thousands of entries, most of a recovery's rebinding time); a job keeps
    one scan, and it walks again when ``sys.modules`` gained or lost entries since its last
    walk, one of the modules it reads is no longer the module under its name, or one of those
    torch modules gained, lost or replaced a function. Telling so never touches the other
    modules (asking each of thousands whether it is the same object reads each one's memory: a
    tenth of a millisecond of every recovery, the caches cold from training). Not seen: a
    module put by hand under the name of one that is not read (an installed package's) while
    another left ``sys.modules``."""

    def __init__(self) -> None:
        self.objects = ObjectScan()  # the attributes of the job's objects that hold a group
        self._count = -1  # len(sys.modules) at the walk
        self.walks = 0  # how often sys.modules was walked (a test reads it)
        self._own: list[tuple[str, dict[str, Any]]] = []
        self._defaults: list[tuple[str, dict[str, Any], str, types.FunctionType]] = []
        self._sizes: list[tuple[dict[str, Any], int]] = []  # each defaults holder's size at the walk
        self._read: list[tuple[str, dict[str, Any]]] = []  # every module read: its name and its globals

    def _current(self) -> bool:
        modules = sys.modules
        return (
            len(modules) == self._count
            and all(getattr(modules.get(name), "__dict__", None) is d for name, d in self._read)
            and all(len(d) == n for d, n in self._sizes)
            and all(holder.get(key) is fn for _, holder, key, fn in self._defaults)
        )

    def refresh(self) -> None:
        """Walk ``sys.modules`` now if it changed since the last walk (or none was made), else
        nothing (a few microseconds). A job calls it at each commit, off the recovery's path: the
        first walk, otherwise made by the first recovery's rebinding, costs milliseconds (more on a
        loaded host); where a step imported modules (torch imports lazily while the first steps
        run), the walk they call for is made at the next commit too."""
        if not self._current():
            self._count = len(sys.modules)
            self._own, self._defaults, self._sizes = _walk_modules()
            self._read = [(name, d) for name, d in self._own]
            self._read += [
                (name, sys.modules[name].__dict__)
                for name in sorted(TORCH_IMPORT_DEFAULTS)
                if isinstance(getattr(sys.modules.get(name), "__dict__", None), dict)
            ]
            self.walks += 1

    def modules(self) -> tuple[list[tuple[str, dict[str, Any]]], list[tuple[str, types.FunctionType]]]:
        """(the job's modules as (name, globals), the torch functions with import-time defaults
        as (path, function)), walking ``sys.modules`` again first if it changed (:meth:`refresh`)."""
        self.refresh()
        return self._own, [(path, fn) for path, _, _, fn in self._defaults]


def _walk_modules() -> tuple[
    list[tuple[str, dict[str, Any]]],
    list[tuple[str, dict[str, Any], str, types.FunctionType]],
    list[tuple[dict[str, Any], int]],
]:
    own: list[tuple[str, dict[str, Any]]] = []
    defaults: list[tuple[str, dict[str, Any], str, types.FunctionType]] = []
    sizes: list[tuple[dict[str, Any], int]] = []
    package_is_library: dict[str, bool | None] = {}  # by top-level package; None: judge each module
    for mod_name, module in list(sys.modules.items()):
        top = mod_name.partition(".")[0]
        if package_is_library.get(top) and mod_name not in TORCH_IMPORT_DEFAULTS:
            continue  # most of sys.modules: a package already judged installed
        d = getattr(module, "__dict__", None)
        # a module run with ``python -m`` is __main__ under its own name (its __spec__'s)
        own_name = getattr(getattr(module, "__spec__", None), "name", None) or mod_name
        if not isinstance(d, dict) or mod_name == _C10D_MODULE or _runtime_module(own_name):
            continue
        if mod_name in TORCH_IMPORT_DEFAULTS:
            sizes.append((d, len(d)))
            for key, value in list(d.items()):
                if isinstance(value, types.FunctionType) and (value.__defaults__ or value.__kwdefaults__):
                    defaults.append((f"{mod_name}.{key}", d, key, value))
                elif isinstance(value, type) and value.__module__ == mod_name:
                    attrs = vars(value)
                    sizes.append((attrs, len(attrs)))  # type: ignore[arg-type]  # a class's mappingproxy, read like a dict
                    defaults += [
                        (f"{mod_name}.{key}.{attr}", attrs, attr, m)  # type: ignore[misc]  # (as above)
                        for attr, m in list(attrs.items())
                        if isinstance(m, types.FunctionType) and (m.__defaults__ or m.__kwdefaults__)
                    ]
            continue
        if top not in package_is_library:
            package = sys.modules.get(top)
            located = package is not None and getattr(package, "__file__", None)
            package_is_library[top] = _library(package) if package is not None and located else None
        library = package_is_library[top]
        if library or (library is None and _library(module)):
            continue
        own.append((mod_name, d))
    return own, defaults, sizes


def _rebuilt(value: Any) -> bool:
    """A value rebinding replaces rather than changes in place (a group, a tuple): every name
    holding it needs its own slot."""
    return isinstance(value, tuple) or not isinstance(value, (list, dict, set, types.FunctionType))


def _scan_python_slots(functions: Iterable[Callable[..., Any]], scan: ModuleScan, objects: bool = True) -> list[_Slot]:
    """The job's own modules (not installed packages) in depth, the defaults of
    :data:`TORCH_IMPORT_DEFAULTS`' functions and methods, and the step functions' closures."""
    out: list[_Slot] = []
    seen: set[int] = set()
    is_group = _group_matcher()
    own, defaults = scan.modules()
    for path, fn in defaults:
        _default_slots(fn, path, out, is_group)
    for mod_name, d in own:
        for key, value in list(d.items()):
            # __builtins__ and the like; a function or a list, dict or set seen under another name (one
            # in-place swap serves every name). A group or a tuple held twice (``from m import PG``) is
            # a slot per name: each name is set
            if key.startswith("__") or (id(value) in seen and not _rebuilt(value)):
                continue
            if isinstance(value, types.FunctionType):
                if value.__defaults__ or value.__kwdefaults__ or value.__closure__:
                    _function_slots(value, f"{mod_name}.{key}", out, seen, is_group)
            elif _holds(value, is_group):
                seen.add(id(value))
                out.append(
                    _Slot(
                        f"{mod_name}.{key}",
                        functools.partial(operator.getitem, d, key),
                        functools.partial(operator.setitem, d, key),
                    )
                )
    for i, step_fn in enumerate(functions):
        target = step_fn.__func__ if isinstance(step_fn, types.MethodType) else step_fn
        if isinstance(target, types.FunctionType):
            _function_slots(target, f"step function {i} ({target.__qualname__})", out, seen, is_group)
    if objects:
        out += scan.objects.slots  # attributes of the objects the job holds, found at a commit (ObjectScan)
    return out


def module_groups(scan: "ModuleScan", functions: Iterable[Callable[..., Any]] = ()) -> list[Any]:
    """The groups the job's module globals, module functions' defaults and closures and
    ``functions``' closures hold (what the ``python.bindings`` site reads, the object slots apart)."""
    match = _group_matcher()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        slots = _scan_python_slots(functions, scan, objects=False)
    return [g for slot in slots for g in _groups_in(slot.get(), match)]


def python_bindings(functions: Iterable[Callable[..., Any]] = ()) -> dict[str, object]:
    """The Python places that hold a process group, path -> what they hold (an audit root)."""
    return {slot.path: slot.get() for slot in _python_slots(functions, ModuleScan())}


def _python_bindings(old: dist.ProcessGroup, new: dist.ProcessGroup, ctx: _Context) -> int:
    n = 0
    for slot in ctx.bindings():
        value, k = _swap(slot.get(), old, new)
        if k:
            slot.set(value)
            n += k
    return n


def held_in_frames(groups: Iterable[dist.ProcessGroup]) -> list[str]:
    """One line per local variable of a function running in this thread (the runtime's own
    frames excepted) that holds one of ``groups``: no rebind reaches a frame's locals."""
    targets = {id(g): g for g in groups}
    out: list[str] = []
    if not targets:
        return out

    def match(x: Any) -> bool:
        return id(x) in targets

    f: types.FrameType | None = sys._getframe(1)
    while f is not None:
        code = f.f_code
        if _user_file(code.co_filename):
            for name, value in list(f.f_locals.items()):
                if _holds(value, match):
                    held = [g.group_name for g in targets.values() if _holds(value, functools.partial(operator.is_, g))]
                    out.append(
                        f"retired group {', '.join(held)} is held by local variable {name!r} of "
                        f"{code.co_name} ({code.co_filename}:{f.f_lineno}) and cannot be rebound; "
                        "keep groups in a module global, a closure or session.groups"
                    )
        f = f.f_back
    del f
    return out


SITES: tuple[Site, ...] = (
    Site(
        "c10d.world",
        "distributed_c10d._World: default_pg, pg_map, pg_names, pg_group_ranks, "
        "pg_backend_config, pg_to_tag, tags_to_pg, pg_coalesce_state",
        _c10d_world,
    ),
    Site("c10d.registry", "distributed_c10d._register_process_group / _resolve_process_group (C++)", _c10d_registry),
    Site("device_mesh.dim_group_names", "DeviceMesh._dim_group_names (resolved by name on get_group)", _mesh_names),
    Site("device_mesh.pg_registry", "DeviceMesh._pg_registry (read while torch.compile traces)", _mesh_pg_registry),
    Site(
        "fsdp.mesh_info",
        "FSDPMeshInfo.shard/reduce_scatter/replicate_process_group via "
        "FSDPParamGroup and FSDPParam mesh_info, post_forward_mesh_info",
        _fsdp_mesh_infos,
    ),
    Site("fsdp.comm", "FSDPParamGroup._all_gather_comm/_reduce_scatter_comm._group", _fsdp_comms),
    Site(
        "python.bindings",
        "module globals, function defaults (torch.distributed.nn.functional's "
        "group=group.WORLD) and closure cells of module functions and the step function",
        _python_bindings,
    ),
)


def rebind(
    old: dist.ProcessGroup,
    new: dist.ProcessGroup,
    model: torch.nn.Module,
    optimizer: Any = None,
    meshes: Iterable[Any] | None = None,
    skip: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
    functions: Iterable[Callable[..., Any]] = (),
    scan: "ModuleScan | None" = None,
) -> RebindReport:
    """Point every site that holds ``old`` (the object or its name) at ``new``; returns what was
    rebound and how long it took.

    ``skip`` leaves the named sites alone and ``only`` applies just those: for audits that show
    a missed site is caught, and then complete the rebind.
    """
    return rebind_all([(old, new)], model, optimizer, meshes, skip, only, functions, scan)


def rebind_all(
    pairs: Iterable[tuple[dist.ProcessGroup, dist.ProcessGroup]],
    model: torch.nn.Module,
    optimizer: Any = None,
    meshes: Iterable[Any] | None = None,
    skip: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
    functions: Iterable[Callable[..., Any]] = (),
    scan: ModuleScan | None = None,
    states: list[Any] | None = None,
) -> RebindReport:
    """:func:`rebind` for every ``(old, new)`` pair of one recovery, the Python bindings found
    once for all of them (``scan``: the job's :class:`ModuleScan`, kept between recoveries);
    the report's ``unrebound`` names the retired groups that local variables of running
    functions still hold (:func:`held_in_frames`)."""
    t0 = time.perf_counter()
    pairs = list(pairs)
    ctx = _Context(
        model,
        optimizer,
        list(meshes) if meshes is not None else meshes_of(model, optimizer, states),
        tuple(functions),
        scan,
        _states=states,
    )
    counts: dict[str, int] = {}
    site_s: dict[str, float] = {}
    for old, new in pairs:
        for site in SITES:
            if site.name not in skip and (only is None or site.name in only):
                t1 = time.perf_counter()
                counts[site.name] = counts.get(site.name, 0) + site.apply(old, new, ctx)
                site_s[site.name] = site_s.get(site.name, 0.0) + time.perf_counter() - t1
    t1 = time.perf_counter()
    unrebound = tuple(held_in_frames(old for old, _ in pairs)) if only is None else ()
    site_s["frames"] = time.perf_counter() - t1
    return RebindReport(counts, time.perf_counter() - t0, unrebound, site_s)


# -- the audit ------------------------------------------------------------------------------
_SKIP = (types.ModuleType, type, types.BuiltinFunctionType, str, bytes, int, float, bool, type(None))


def default_roots(
    model: torch.nn.Module, optimizer: Any = None, functions: Iterable[Callable[..., Any]] = ()
) -> dict[str, object]:
    """Where cached references can hide: the model, optimizer, FSDP states, meshes, c10d, and
    the Python bindings (module globals, defaults and closures) that hold a group."""
    from torch.distributed import _composable_state

    w = c10d._world  # its maps are properties over module globals: walk each one
    roots: dict[str, object] = {
        "model": model,
        "c10d._world": w,
        **{f"c10d._world.{m}": getattr(w, m) for m in _WORLD_MAPS},
        "fsdp_states": fsdp_states(model),
        "meshes": meshes_of(model, optimizer),
        "composable_state": list(_composable_state._module_state_mapping.items()),
        "python": python_bindings(functions),
    }
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
        if obj.__defaults__:
            yield ".__defaults__", obj.__defaults__
        if obj.__kwdefaults__:
            yield ".__kwdefaults__", obj.__kwdefaults__
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


def find_references(
    roots: dict[str, object],
    targets: tuple[type, ...] | None = None,
    limit: int = 500_000,
    names: frozenset[str] = frozenset(),
) -> list[tuple[str, Any]]:
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
