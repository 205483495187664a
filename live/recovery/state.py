"""A rank's state: parameter shards, optimizer state, every random-number generator and the
optimizer's schedule (param group settings, LR schedulers: :class:`Schedule`).

:func:`local_state` lists every tensor a rank holds (its parameter shards, then optimizer
state) in one fixed order; checkpoints, the final comparison and the commit check all read
it. The optimizer state is read where the optimizer keeps it (:func:`optimizer_parts`): its
own ``state``, its inner optimizers' where it is a container (torchtitan's
``OptimizersContainer``), or its ``state_dict()`` where it keeps torch's layout nowhere; what
cannot be read is refused (:class:`OptimizerStateError`), never left out.

Random-number generators are state too: a step with dropout re-run from a different
generator state ends with different parameters, so :class:`RngState` captures every
generator a step can draw from (torch's CPU default generator, each accelerator's device
generators where that accelerator is present and initialised, Python's ``random`` and
NumPy's global state) and :func:`restore_rng` puts it back before a step is re-run.

Commits must cost nothing at real sizes, so :func:`commit_check` hashes O(1) bytes: the
committed step plus a fixed sample of elements spread over the tensors (at most
``_SAMPLE_TENSORS`` tensors, their first, middle and last ``_SAMPLE_ELEMS`` elements),
gathered on the tensors' device into one buffer per dtype and copied to the host once; on
CUDA on a side stream (:func:`~.device.on_side_stream`), so neither a commit nor a detection
queues behind the training stream (a detection's read would wait forever behind a hung kernel).
:func:`digest` hashes everything and is for final comparisons only.

A recovery must not pay for listing the state again either. :class:`CommitMark` keeps, from
the commit, which tensor objects held the state (and where their storage was) and views of the
sampled elements; :meth:`CommitMark.changed` then proves the state untouched by walking the
owners (no ``.data``, no ``to_local``) and hashing the views, which alias the live storage. A
tensor replaced or re-pointed since (lazy optimizer state, a storage swapped) sends it back to
the full listing. Tensor version counters are no proof here: an in-place ``foreach`` update of
FSDP2's sharded parameters (torch's default ``SGD``/``Adam``) leaves a ``DTensor``'s counter
and its local tensor's unchanged. What neither check sees is a write through ``.data`` that
misses every sampled element.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import math
import numbers
import random
import sys
from array import array
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.nn as nn
from torch.amp import GradScaler
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from .device import DeviceOps, Event, HostOps, on_side_stream, training_now

__all__ = [
    "shard_rows",
    "local_state",
    "OptimizerParts",
    "OptimizerStateError",
    "optimizer_parts",
    "param_groups_of",
    "check_optimizer",
    "load_local_state",
    "digest",
    "commit_check",
    "CommitMark",
    "StateCheck",
    "RngState",
    "capture_rng",
    "restore_rng",
    "rng_tensors",
    "rng_from_tensors",
    "job_state",
    "load_job_state",
    "ACCELERATORS",
    "Schedule",
    "capture_schedule",
    "restore_schedule",
    "schedulers_of",
    "SCHEDULE_KEY",
    "saved_objects",
    "model_buffers",
    "load_buffers",
    "Chunk",
    "global_chunks",
    "check_stateful",
    "capture_objects",
    "restore_objects",
    "ScheduleError",
]

ACCELERATORS = ("cuda", "npu", "xpu")  # torch.<name> modules with per-device generators
_SAMPLE_TENSORS = 64
_SAMPLE_ELEMS = 2


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``, detached, sharing its storage. A DTensor's local tensor is read
    directly: ``p.data.to_local()`` costs two dispatches through DTensor (about 35 us a
    parameter, 1.7 ms to list a 116-tensor state; this way 0.1 ms)."""
    local = getattr(t, "_local_tensor", None)
    if isinstance(local, torch.Tensor):
        return local.detach()
    return t.to_local().detach() if hasattr(t, "to_local") else t.detach()


def model_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's persistent buffers by name (what its ``state_dict`` holds besides parameters:
    BatchNorm's running statistics and batch count...); non-persistent ones (caches a module
    rebuilds) are not state."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


# -- what an optimizer says its state is ----------------------------------------------------
class OptimizerStateError(TypeError):
    """An optimizer whose state cannot be read whole: the one line names the optimizer and why."""


@dataclass(frozen=True)
class OptimizerParts:
    """The optimizers that hold an optimizer's state, as it says so itself.

    ``by_param`` keep torch's layout: ``state`` keyed by parameter, settings in ``param_groups``.
    That is the optimizer itself and, for a *container* (an optimizer that holds others:
    torchtitan's ``OptimizersContainer`` keeps one per model part and optimizer kind in
    ``.optimizers``, its own ``state`` empty), the inner optimizers found in its attributes (an
    optimizer, or a list, tuple or dict of them), in attribute order, depth first, after it.
    ``by_state_dict`` are optimizers that override ``state_dict`` and hold no inner optimizer:
    their state is read through ``state_dict()`` and put back with ``load_state_dict()``. The
    parts of an optimizer do not change as it trains (state made lazily changes no part)."""

    by_param: tuple[torch.optim.Optimizer, ...]
    by_state_dict: tuple[torch.optim.Optimizer, ...] = ()

    @property
    def all(self) -> tuple[torch.optim.Optimizer, ...]:
        return self.by_param + self.by_state_dict


def _inner_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers ``optimizer``'s own attributes hold (an optimizer, or a list, tuple or dict of them)."""
    out: list[torch.optim.Optimizer] = []
    for name, value in vars(optimizer).items():
        if name in ("state", "param_groups", "defaults"):
            continue
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else (value,)
        out += [x for x in items if isinstance(x, torch.optim.Optimizer) and x is not optimizer]
    return out


def optimizer_parts(optimizer: torch.optim.Optimizer) -> OptimizerParts:
    """The :class:`OptimizerParts` of ``optimizer`` (a container's inner optimizers need no registration)."""
    by_param: list[torch.optim.Optimizer] = []
    by_state_dict: list[torch.optim.Optimizer] = []
    seen: set[int] = set()

    def visit(o: torch.optim.Optimizer) -> None:
        if id(o) in seen:
            return
        seen.add(id(o))
        inner = [x for x in _inner_optimizers(o) if id(x) not in seen]  # a reference back to a container is none
        if not inner:
            own_layout = type(o).state_dict is torch.optim.Optimizer.state_dict
            (by_param if own_layout else by_state_dict).append(o)
            return
        by_param.append(o)  # a container: its own state (torchtitan's is empty), then its inner optimizers'
        for x in inner:
            visit(x)

    visit(optimizer)
    return OptimizerParts(tuple(by_param), tuple(by_state_dict))


def param_groups_of(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group of the optimizers holding ``optimizer``'s state, in :class:`OptimizerParts` order."""
    return [g for o in optimizer_parts(optimizer).all for g in o.param_groups]


def _param_slots(parts: OptimizerParts) -> dict[int, Mapping[str, Any]]:
    """Each parameter's optimizer state by the parameter's id, over every ``by_param`` optimizer. A
    parameter held by two of them is refused: one of its states would be in no copy."""
    by_id: dict[int, Mapping[str, Any]] = {}
    held = 0
    for o in parts.by_param:
        held += len(o.state)
        by_id.update((id(k), v) for k, v in o.state.items())
    if len(by_id) != held:
        raise OptimizerStateError(
            f"{held - len(by_id)} parameter(s) have state in two of the optimizers "
            f"{[type(o).__qualname__ for o in parts.by_param]}; give each parameter to one"
        )
    return by_id


_PLAIN = (bool, int, float, str, type(None))


def _walk_state_dict(o: torch.optim.Optimizer) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, Any]]]:
    """The tensors and the plain values of ``o.state_dict()``, each with its path (keys and list
    indices joined by ``/``); anything else in it is refused."""
    kind = type(o).__qualname__
    try:
        sd = o.state_dict()
    except Exception as exc:  # noqa: BLE001 - the user's own optimizer: any failure is reported in one line
        raise OptimizerStateError(
            f"{kind}.state_dict() failed ({type(exc).__name__}: {exc}); Meshpact reads that "
            "optimizer's state only through it"
        ) from None
    if not isinstance(sd, Mapping):
        raise OptimizerStateError(
            f"{kind}.state_dict() returned {type(sd).__name__}, not a dict: its state cannot be read"
        )
    tensors: list[tuple[str, torch.Tensor]] = []
    values: list[tuple[str, Any]] = []

    def walk(x: Any, path: str) -> None:
        if isinstance(x, torch.Tensor):
            tensors.append((path, x))
        elif isinstance(x, Mapping):
            for k in sorted(x, key=str):
                walk(x[k], f"{path}/{k}" if path else str(k))
        elif type(x) in (list, tuple):
            if all(isinstance(v, _PLAIN) for v in x):
                values.append((path, x))
            else:
                for i, v in enumerate(x):
                    walk(v, f"{path}/{i}")
        elif isinstance(x, _PLAIN):
            values.append((path, x))
        else:
            raise OptimizerStateError(
                f"{kind}.state_dict() holds a {type(x).__name__} at {path!r}: only tensors, "
                "numbers, strings and lists or dicts of them can be copied and compared"
            )

    walk(sd, "")
    return tensors, values


def check_optimizer(optimizer: torch.optim.Optimizer) -> OptimizerParts:
    """``optimizer``'s parts, each one's state read once, so a state that cannot be read is refused
    when training starts (one line, :class:`OptimizerStateError`), not at the first copy."""
    parts = optimizer_parts(optimizer)
    for o in parts.by_state_dict:
        _walk_state_dict(o)
    return parts


def _put(sd: Any, path: str, value: Any, kind: str) -> None:
    """Set the entry of ``sd`` (a state dict as ``state_dict()`` gives it) at ``path`` to ``value``."""
    keys = path.split("/")
    node = sd
    for depth, key in enumerate(keys):
        if isinstance(node, dict):
            match = next((k for k in node if str(k) == key), None)
        elif type(node) is list and key.isdigit() and int(key) < len(node):
            match = int(key)
        else:
            match = None
        if match is None:
            raise OptimizerStateError(
                f"the saved state of {kind} has {path!r}, which {kind}.state_dict() does not "
                "have (now): make its state before training, the same on every rank"
            )
        if depth == len(keys) - 1:
            node[match] = value
        else:
            node = node[match]


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer, buffers: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor this rank holds, parameter shards, optimizer state (``optim/<param>/<key>``, from
    each optimizer of :func:`optimizer_parts` that keeps torch's layout; ``optim_sd/<i>/<path>``,
    from the ``state_dict()`` of each that does not), then (``buffers``) the model's persistent
    buffers, in a fixed order."""
    out: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    parts = optimizer_parts(optimizer)
    by_id = _param_slots(parts)
    for name, p in params.items():
        out[f"param/{name}"] = _local(p)
    for name, p in params.items():
        for key, value in sorted(by_id.get(id(p), {}).items()):
            if isinstance(value, torch.Tensor):
                out[f"optim/{name}/{key}"] = _local(value)
    for i, o in enumerate(parts.by_state_dict):
        for path, value in _walk_state_dict(o)[0]:
            out[f"optim_sd/{i}/{path}"] = _local(value)
    if buffers:
        for name, buf in model_buffers(model).items():
            out[f"buffer/{name}"] = _local(buf)
    return out


@dataclass(frozen=True)
class Chunk:
    """Where a rank's local tensor lies in the whole one: the whole tensor's shape and the
    local tensor's offset in each dimension (DCP's chunk metadata)."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


def global_chunks(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Chunk]:
    """The :class:`Chunk` of every sharded tensor :func:`local_state` lists (a ``DTensor``
    parameter and the optimizer state shaped like it), keyed as there; tensors left out are
    whole on every rank. A checkpoint writes these so that a loop of any other world size
    reads the model and the optimizer back (DCP re-shards by chunk)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    out: dict[str, Chunk] = {}
    named = dict(model.named_parameters())
    by_id = _param_slots(optimizer_parts(optimizer))
    for name, p in named.items():
        if not isinstance(p, DTensor):
            continue
        _, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        chunk = Chunk(tuple(p.shape), tuple(int(o) for o in offsets))
        out[f"param/{name}"] = chunk
        for key, value in by_id.get(id(p), {}).items():
            if isinstance(value, DTensor) and tuple(value.shape) == chunk.global_shape:
                out[f"optim/{name}/{key}"] = chunk
    return out


def load_buffers(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy the ``buffer/...`` entries of ``state`` into the model's buffers in place (those it has)."""
    with torch.no_grad():
        for name, buf in model_buffers(model).items():
            saved = state.get(f"buffer/{name}")
            if saved is not None:
                _local(buf).copy_(saved)


def load_local_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, torch.Tensor], take: bool = False
) -> None:
    """Copy ``state`` (as :func:`local_state` gives it) back into the model and optimizer in place.
    ``take``: ``state``'s tensors are the caller's to give away (an excision's new shards): each
    entry leaves ``state`` once loaded, and optimizer slots the optimizer does not have yet are
    the given tensors themselves, not copies, so loading never holds the state twice."""
    params = dict(model.named_parameters())
    parts = optimizer_parts(optimizer)
    # a parameter's optimizer: the innermost one listing it (a container lists every parameter too)
    owner = {id(p): o for o in parts.by_param for g in o.param_groups for p in g["params"]}
    holder = {id(p): o for o in parts.by_param for p in o.state}  # a frozen parameter's state: where it is
    load_buffers(model, state)
    get = state.pop if take else state.__getitem__
    with torch.no_grad():
        for name, p in params.items():
            _local(p.data).copy_(get(f"param/{name}"))
            p.grad = None
        for name, p in params.items():
            prefix = f"optim/{name}/"
            keys = [k[len(prefix) :] for k in state if k.startswith(prefix)]
            o = holder.get(id(p), owner.get(id(p)))
            if not keys:
                if o is not None:
                    o.state.pop(p, None)
                continue
            if o is None:
                raise OptimizerStateError(
                    f"the saved state has optimizer state for parameter {name!r}, which no "
                    "optimizer of this job optimizes"
                )
            slot = o.state.setdefault(p, {})
            for key in keys:
                value = get(prefix + key)
                if key in slot and isinstance(slot[key], torch.Tensor):
                    _local(slot[key]).copy_(value)
                elif p.data.__class__ is not torch.Tensor and value.dim() > 0:
                    slot[key] = _like(p.data, value, copy=not take)
                else:
                    slot[key] = value if take else value.clone()
    for i, o in enumerate(parts.by_state_dict):
        prefix = f"optim_sd/{i}/"
        saved = {k[len(prefix) :]: k for k in state if k.startswith(prefix)}
        if saved:
            sd = o.state_dict()
            for path, key in saved.items():
                _put(sd, path, get(key), type(o).__qualname__)
            o.load_state_dict(sd)


def _like(param: torch.Tensor, local: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """A DTensor with ``param``'s mesh and placements holding ``local`` (a copy of it unless ``copy`` is off)."""
    from torch.distributed.tensor import DTensor

    mesh, placements = param.device_mesh, param.placements  # type: ignore[attr-defined]  # a sharded parameter's data (a DTensor, or a subclass that has both)
    return DTensor.from_local(
        local.clone() if copy else local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def digest(state: dict[str, torch.Tensor]) -> str:
    """A content digest of every byte of a rank's tensors (names, dtypes, shapes and bytes)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in state.items():
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        # a copy: exporting a tensor's own storage to numpy would make it non-resizable,
        # which breaks FSDP's freeing of unsharded buffers
        h.update(t.detach().reshape(-1).to("cpu", copy=True).view(torch.uint8).numpy())  # type: ignore[arg-type]  # an ndarray exports the buffer protocol; numpy's stubs omit __buffer__
    return h.hexdigest()


def commit_check(step: int, state: dict[str, torch.Tensor]) -> str:
    """The committed-step marker and a fixed sample of the state: O(1) bytes hashed, whatever
    the state's size (see the module docstring). Equal before and after a failed step unless
    the step wrote to the sampled state (an optimizer step writes whole tensors, so their
    first, middle and last elements show it)."""
    return _hash_samples(step, len(state), _sample_views(state))


_Samples = tuple[tuple[torch.dtype, tuple[torch.Tensor, ...]], ...]


def _sample_views(state: dict[str, torch.Tensor]) -> _Samples:
    """Views (aliasing the state's storage) of the elements :func:`commit_check` hashes, per dtype."""
    names = list(state)
    stride = max(1, -(-len(names) // _SAMPLE_TENSORS))
    by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for name in names[::stride]:
        flat = state[name].detach().reshape(-1)
        n = flat.numel()
        if n == 0:
            continue
        mid = n // 2
        parts = by_dtype.setdefault((flat.dtype, flat.device), [])
        parts += [flat[:_SAMPLE_ELEMS], flat[mid : mid + _SAMPLE_ELEMS], flat[-_SAMPLE_ELEMS:]]
    return tuple((dtype, tuple(parts)) for (dtype, _), parts in sorted(by_dtype.items(), key=lambda kv: str(kv[0])))


def _aliased(state: dict[str, torch.Tensor], samples: _Samples) -> bool:
    """Whether every sample view shares its tensor's storage (a non-contiguous tensor's
    ``reshape`` copies: such a view would keep showing the committed values)."""
    storages = {t.untyped_storage().data_ptr() for t in state.values()}
    return all(v.untyped_storage().data_ptr() in storages for _, parts in samples for v in parts)


def _hash_samples(step: int, count: int, samples: _Samples) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"step={step}|n={count}".encode())
    for dtype, parts in samples:
        h.update(str(dtype).encode())
        h.update(torch.cat(parts).cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _listing(
    model: nn.Module, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """Every tensor :func:`local_state` lists, as objects (parameters, then each one's optimizer
    state), read without building any view (``params``: ``model.parameters()`` listed already
    by the caller)."""
    params = list(model.parameters()) if params is None else params
    parts = optimizer_parts(optimizer)
    by_id = _param_slots(parts)
    out = list(params)
    for p in params:
        for _, value in sorted(by_id.get(id(p), {}).items()):
            if isinstance(value, torch.Tensor):
                out.append(value)
    for o in parts.by_state_dict:
        out += [t for _, t in _walk_state_dict(o)[0]]
    return out


def _owners(tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, int, int], ...]:
    """(object id, storage address, element count) of each tensor of a :func:`_listing`."""
    out = []
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        out.append((id(t), local.data_ptr(), local.numel()))
    return tuple(out)


def _meshes(tensors: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    """The DeviceMeshes that the DTensors among ``tensors`` live on, each once."""
    found: dict[int, Any] = {}
    for t in tensors:
        mesh = getattr(t, "device_mesh", None)
        if mesh is not None:
            found.setdefault(id(mesh), mesh)
    return tuple(found.values())


@dataclass(frozen=True)
class StateCheck:
    """What :meth:`CommitMark.verify` found: why the state is not the committed one ("" when it
    is), and, where the very tensors of the commit still hold it, the meshes they live on (a
    recovery's rebinding reads them instead of walking the state again; None: walk it)."""

    changed: str
    meshes: tuple[Any, ...] | None = None


@dataclass(frozen=True)
class CommitMark:
    """What proves, at a recovery, that a rank's state is the one it committed at ``step``:
    the commit check, the tensors that held the state (id, storage address, size), the meshes
    they live on, and views of the sampled elements (see the module docstring). The views keep
    the committed storages alive, so an address cannot be reused by a new tensor while the mark
    exists."""

    step: int
    check: str  # commit_check of the state at the commit
    owners: tuple[tuple[int, int, int], ...]
    samples: _Samples
    count: int  # tensors in local_state
    aliased: bool  # the views alias the live storage (else every check lists the state again)
    meshes: tuple[
        Any, ...
    ] = ()  # the DeviceMeshes of the listed tensors (the model's parameters and their optimizer state)

    @classmethod
    def take(
        cls,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        previous: "CommitMark | None" = None,
        ops: DeviceOps | None = None,
        after: Event | None = None,
    ) -> "CommitMark":
        """The mark of the state now, committed at ``step``. The views and the meshes are reused
        from ``previous`` when the same tensors, at the same storage, hold the state. ``ops``: the
        device's (:func:`~.device.on_side_stream`: on CUDA the samples are read on a side stream,
        after ``after``, the step's fence, or where none is given after all the host enqueued)."""
        ops = ops or HostOps()
        with on_side_stream(ops, after if after is not None or ops.kind != "cuda" else training_now(ops)):
            return cls._take(step, model, optimizer, previous)

    @classmethod
    def _take(
        cls, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, previous: CommitMark | None
    ) -> CommitMark:
        tensors = _listing(model, optimizer)
        owners = _owners(tensors)
        if previous is not None and previous.aliased and previous.owners == owners:
            samples, count, aliased, meshes = previous.samples, previous.count, True, previous.meshes
        else:
            state = local_state(model, optimizer, buffers=False)
            samples, count = _sample_views(state), len(state)
            aliased, meshes = _aliased(state, samples), _meshes(tensors)
        return cls(step, _hash_samples(step, count, samples), owners, samples, count, aliased, meshes)

    def changed(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.Tensor] | None = None,
    ) -> str:
        """Why the state differs from the committed one ("" when it does not): a tensor replaced,
        added or moved since the commit, or a sampled element written, or another step
        (``params``: the model's parameters as ``model.parameters()`` lists them now, where the
        caller has them)."""
        return self.verify(step, model, optimizer, params).changed

    def verify(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        params: Sequence[torch.Tensor] | None = None,
        ops: DeviceOps | None = None,
    ) -> StateCheck:
        """:meth:`changed`, and the meshes where the tensors of the commit hold the state still.
        ``ops``: the device's; on CUDA every read is on a side stream (a detection runs after the
        data path's abort, and the training stream may still hold the failed step's kernels)."""
        with on_side_stream(ops or HostOps()):
            return self._verify(step, model, optimizer, params)

    def _verify(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor] | None
    ) -> StateCheck:
        if step != self.step:
            return StateCheck(f"the committed step is {step}, the mark's {self.step}")
        owners = _owners(_listing(model, optimizer, params))
        if owners != self.owners or not self.aliased:
            check = commit_check(step, local_state(model, optimizer, buffers=False))
            if check == self.check:
                return StateCheck("")  # other objects, or storage moved, holding what was committed
            if owners == self.owners:
                return StateCheck("a sampled element of the state was written since the commit")
            return StateCheck(
                f"tensors holding the state changed since the commit ({len(self.owners)} then, "
                f"{len(owners)} now) and the sampled elements differ"
            )
        if _hash_samples(step, self.count, self.samples) != self.check:
            return StateCheck("a sampled element of the state was written since the commit", self.meshes)
        return StateCheck("", self.meshes)


# -- random-number generators ---------------------------------------------------------------
@dataclass(frozen=True)
class RngState:
    """Every generator a step can draw from, as it was at one moment."""

    torch_cpu: torch.Tensor
    devices: tuple[tuple[str, tuple[torch.Tensor, ...]], ...]  # ("cuda", one state per device)
    python: tuple[Any, ...]
    numpy: tuple[Any, ...] | None  # None where NumPy was never imported


def _accelerators() -> list[tuple[str, Any]]:
    """Accelerator modules whose device generators exist in this process (never initialises one)."""
    out = []
    for name in ACCELERATORS:
        mod = getattr(torch, name, None)
        if mod is None or not hasattr(mod, "get_rng_state_all"):
            continue
        try:
            ready = mod.is_available() and (mod.is_initialized() if hasattr(mod, "is_initialized") else True)
        except RuntimeError:
            ready = False
        if ready:
            out.append((name, mod))
    return out


def capture_rng() -> RngState:
    devices = tuple((name, tuple(mod.get_rng_state_all())) for name, mod in _accelerators())
    np_state = sys.modules["numpy"].random.get_state() if "numpy" in sys.modules else None
    return RngState(torch.get_rng_state(), devices, random.getstate(), np_state)


def restore_rng(state: RngState) -> None:
    torch.set_rng_state(state.torch_cpu)
    for name, states in state.devices:
        getattr(torch, name).set_rng_state_all(list(states))
    random.setstate(state.python)
    if state.numpy is not None:
        sys.modules["numpy"].random.set_state(state.numpy)


def rng_tensors(state: RngState) -> dict[str, torch.Tensor]:
    """The generators as tensors (for checkpoints and bit-identity checks), keys ``rng/...``."""
    version, words, gauss = state.python
    # array('q') and astype convert the 625 words in C: torch.tensor over a list of ints took
    # half a millisecond a commit. Cloned: the tensor owns its memory, nothing shares the array's
    words_q = array("q", (version, *words))
    out = {
        "rng/torch_cpu": state.torch_cpu.clone(),
        "rng/python": torch.frombuffer(words_q, dtype=torch.int64).clone(),
        "rng/python_gauss": torch.tensor([gauss is not None, gauss or 0.0], dtype=torch.float64),
    }
    for name, states in state.devices:
        for i, s in enumerate(states):
            out[f"rng/{name}/{i}"] = s.clone()
    if state.numpy is not None:
        kind, keys, pos, has_gauss, cached = state.numpy
        np = sys.modules["numpy"]
        out["rng/numpy"] = torch.from_numpy(
            np.concatenate([np.asarray(keys, dtype=np.int64), [pos, has_gauss]])
        ).clone()
        out["rng/numpy_gauss"] = torch.tensor([cached], dtype=torch.float64)
    return out


def rng_from_tensors(tensors: dict[str, torch.Tensor]) -> RngState:
    py = tensors["rng/python"].tolist()
    has_gauss, gauss = tensors["rng/python_gauss"].tolist()
    devices: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, t in tensors.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "rng":
            devices.setdefault(parts[1], []).append((int(parts[2]), t))
    np_state = None
    if "rng/numpy" in tensors:
        import numpy as np

        words = tensors["rng/numpy"].tolist()
        np_state = (
            "MT19937",
            np.array(words[:-2], dtype=np.uint32),
            int(words[-2]),
            int(words[-1]),
            float(tensors["rng/numpy_gauss"][0]),
        )
    return RngState(
        tensors["rng/torch_cpu"].clone(),
        tuple((name, tuple(t for _, t in sorted(v, key=lambda x: x[0]))) for name, v in devices.items()),
        (int(py[0]), tuple(int(w) for w in py[1:]), gauss if has_gauss else None),
        np_state,
    )


# -- the optimizer's schedule ----------------------------------------------------------------
SCHEDULE_KEY = "schedule/state"  # in a job state: the Schedule, in its data-only encoding (_Wire)
_SCHEDULE_PAD = 256  # its bytes are padded to a multiple of this: a peer copy's layout stays put


@dataclass(frozen=True)
class Schedule:
    """What changes an optimizer's hyperparameters as the steps go by, as it was at one moment:
    every param group's settings (all but its parameters: ``lr``, ``betas``, a scheduler's
    ``initial_lr``...) of every optimizer holding the state (:func:`optimizer_parts`: a
    container's inner ones), the state of each LR scheduler on them and of each gradient
    scaler (its loss scale and growth tracker), as their ``state_dict`` has it; the optimizer
    state that is no tensor (a step count kept as a number, LBFGS's counters), which
    :func:`local_state` leaves out; and the state of every object the job registered by name
    (``resilient(..., state={"data": loader})``: anything with DCP's ``Stateful`` protocol,
    ``state_dict``/``load_state_dict``), so it is committed, copied to peers, checkpointed and
    restored wherever the schedule is."""

    groups: tuple[dict[str, Any], ...]
    schedulers: tuple[tuple[str, dict[str, Any]], ...]  # (type name, state_dict), in schedulers_of order
    objects: tuple[tuple[str, Any], ...] = ()  # (name, state_dict) of each registered object, by name
    # (where, value) of each optimizer state entry that is no tensor: "<part>/<param>/<key>" for a part
    # keeping torch's layout (the parameter's place in its param groups), "sd/<part>/<path>" for the others
    values: tuple[tuple[str, Any], ...] = ()


def instances_of(*classes: type, objects: Sequence[Any] | None = None) -> list[Any]:
    """Every object of one of ``classes`` or of a subclass of one, among ``objects`` (default: every
    object the garbage collector tracks and has not frozen), in the collector's order.

    Without ``objects`` the search is done in C: an instance of a class defined in Python refers to
    its class, so the collector's referrers of the classes hold every instance (and a few other
    holders, dropped here). On the heap of a process that imported torch and built a small model
    (300,000 objects), the two Python loops over ``gc.get_objects()`` a rank's start ran (meshes,
    then schedulers and scalers) took 0.21 s of CPU; this takes 0.05 s for all four classes.
    The type is read with type(), never isinstance: isinstance asks a weakref.proxy its
    __class__, and a dead proxy in the heap raises ReferenceError (a stranger's process had one)."""
    wanted: set[type] = set()
    todo = list(classes)
    while todo:  # the classes and every subclass they have now
        cls = todo.pop()
        if cls not in wanted:
            wanted.add(cls)
            todo.extend(cls.__subclasses__())
    return [o for o in (gc.get_referrers(*wanted) if objects is None else objects) if type(o) in wanted]


# what :func:`schedulers_of` finds: the LR schedulers and the gradient scalers, each with a state that
# goes back with a step
SCHEDULE_CLASSES: tuple[type, ...] = (LRScheduler, ReduceLROnPlateau, GradScaler)


def schedulers_of(optimizer: torch.optim.Optimizer, objects: Sequence[Any] | None = None) -> list[Any]:
    """The LR schedulers stepping ``optimizer`` or one of its :func:`optimizer_parts` (a container's
    inner optimizers: torchtitan's ``LRSchedulersContainer`` holds a ``LambdaLR`` per inner
    optimizer) and the gradient scalers (``torch.amp.GradScaler``, which
    ``scaler.step(optimizer)`` takes as an argument: every one found) among ``objects`` (default:
    :func:`instances_of` the collector's, done when training starts), each once: a
    scheduler inside a ``SequentialLR`` or ``ChainedScheduler`` is restored by it. Ordered by
    type name, then by the place of the optimizer it steps, then as found, so every process
    pairs the same scheduler with the same saved state."""
    place = {id(optimizer): 0}
    for i, o in enumerate(optimizer_parts(optimizer).all):
        place.setdefault(id(o), i + 1)
    found = [
        o
        for o in instances_of(*SCHEDULE_CLASSES, objects=objects)
        if issubclass(type(o), GradScaler) or id(getattr(o, "optimizer", None)) in place
    ]
    inner = {id(x) for o in found for x in getattr(o, "_schedulers", ())}
    return sorted(
        (o for o in found if id(o) not in inner),
        key=lambda o: (type(o).__qualname__, place.get(id(getattr(o, "optimizer", None)), 0)),
    )


def check_stateful(objects: Mapping[str, Any]) -> dict[str, Any]:
    """The objects a job registers as state, checked: each has ``state_dict`` and
    ``load_state_dict`` (DCP's ``Stateful`` protocol); one line names any that has not."""
    bad = [
        f"{name!r} ({type(o).__name__})"
        for name, o in objects.items()
        if not (callable(getattr(o, "state_dict", None)) and callable(getattr(o, "load_state_dict", None)))
    ]
    if bad:
        raise TypeError(
            f"state={{...}} takes objects with state_dict() and load_state_dict() (DCP's Stateful); "
            f"{', '.join(bad)} has not"
        )
    return dict(objects)


def _state_values(parts: OptimizerParts) -> tuple[tuple[str, Any], ...]:
    """The :attr:`Schedule.values` of ``parts`` now."""
    out: list[tuple[str, Any]] = []
    for i, o in enumerate(parts.by_param):
        plain = [
            (p, key, value)
            for p, slot in o.state.items()
            for key, value in slot.items()
            if not isinstance(value, torch.Tensor)
        ]
        if not plain:  # torch's own optimizers keep tensors only (an SGD without momentum: nothing)
            continue
        place = {id(p): j for j, p in enumerate(p for g in o.param_groups for p in g["params"])}
        out += sorted((f"{i}/{place[id(p)]}/{key}", copy.deepcopy(value)) for p, key, value in plain if id(p) in place)
    for i, o in enumerate(parts.by_state_dict):
        out += [(f"sd/{i}/{path}", copy.deepcopy(v)) for path, v in _walk_state_dict(o)[1]]
    return tuple(out)


def capture_schedule(
    optimizer: torch.optim.Optimizer, schedulers: Sequence[Any] = (), objects: Mapping[str, Any] | None = None
) -> Schedule:
    parts = optimizer_parts(optimizer)
    return Schedule(
        tuple(copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for o in parts.all for g in o.param_groups),
        tuple((type(s).__qualname__, copy.deepcopy(s.state_dict())) for s in schedulers),
        capture_objects(objects or {}),
        _state_values(parts),
    )


@dataclass(frozen=True)
class _Raw:
    """A tensor inside an object's state, as its bytes: equal tensors give equal bytes in the
    encoded schedule (a tensor's own pickle does not: two equal generator states pickled
    differently), and it comes back as the tensor it was (:func:`_decode`)."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes


def _encode(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        t = x.detach().to("cpu").contiguous()
        return _Raw(
            str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    if isinstance(x, dict):
        return {k: _encode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        return type(x)(_encode(v) for v in x)
    return copy.deepcopy(x)


def _decode(x: Any) -> Any:
    if isinstance(x, _Raw):
        flat = torch.frombuffer(bytearray(x.data), dtype=torch.uint8) if x.data else torch.empty(0, dtype=torch.uint8)
        return flat.view(getattr(torch, x.dtype)).reshape(x.shape)
    if isinstance(x, dict):
        return {k: _decode(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        return type(x)(_decode(v) for v in x)
    return copy.deepcopy(x)


def capture_objects(objects: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """(name, a copy of its ``state_dict()``, tensors as their bytes) of each registered object, by name."""
    return tuple((name, _encode(o.state_dict())) for name, o in sorted(objects.items()))


def saved_objects(schedule: torch.Tensor, source: str = "the committed state") -> tuple[tuple[str, Any], ...]:
    """The registered objects' states a committed schedule (a job state's ``SCHEDULE_KEY``) holds,
    as :func:`capture_objects` gives them (``source``: where the schedule came from, for an error)."""
    return _schedule_from(schedule, source).objects


def restore_objects(objects: Mapping[str, Any], saved: tuple[tuple[str, Any], ...]) -> None:
    """Put each registered object back as ``saved`` (:func:`capture_objects`) has it; a record of
    other names is refused."""
    if tuple(sorted(objects)) != tuple(name for name, _ in saved):
        raise ValueError(
            f"the committed state holds objects {[n for n, _ in saved]}; this job registered {sorted(objects)}"
        )
    for name, state in saved:
        objects[name].load_state_dict(_decode(state))


def restore_schedule(
    optimizer: torch.optim.Optimizer,
    schedulers: Sequence[Any],
    schedule: Schedule,
    objects: Mapping[str, Any] | None = None,
) -> None:
    """Put the param groups' settings, the schedulers and (unless ``objects`` is None) the
    registered objects back as ``schedule`` has them; a schedule of other groups, schedulers or
    objects (a replacement built another optimizer) is refused."""
    kinds = tuple(type(s).__qualname__ for s in schedulers)
    parts = optimizer_parts(optimizer)
    groups = [g for o in parts.all for g in o.param_groups]
    if len(schedule.groups) != len(groups) or kinds != tuple(k for k, _ in schedule.schedulers):
        raise ValueError(
            f"the committed schedule has {len(schedule.groups)} param group(s) and schedulers "
            f"{[k for k, _ in schedule.schedulers]}; this optimizer has {len(groups)} "
            f"and {list(kinds)}"
        )
    for group, saved in zip(groups, schedule.groups):
        group.update(copy.deepcopy(saved))
    _restore_values(parts, schedule.values)
    for sched, (_, saved) in zip(schedulers, schedule.schedulers):
        sched.load_state_dict(copy.deepcopy(saved))
        per_optimizer = getattr(sched, "_per_optimizer_states", None)  # a GradScaler's, reset by its update()
        if per_optimizer is not None:  # an attempt that failed after unscale_ would refuse the re-run's
            per_optimizer.clear()
    if objects is not None:
        restore_objects(objects, schedule.objects)


_SCHEDULE_MAGIC = b"MPSCHED1"
_DEPTH = 64  # nesting a schedule may have; deeper is refused, never recursed into
_TAGS = ("$d", "$t", "$f", "$b", "$tensor", "$raw")


class ScheduleError(ValueError):
    """A committed schedule that cannot be saved (a value of a kind the data-only encoding does
    not carry) or read back (not Meshpact's encoding, or malformed): the message names where."""


class _Wire:
    """The data-only encoding of a :class:`Schedule`: JSON in which dicts, tuples, non-finite
    floats, bytes and tensors are tagged objects, and the bytes of tensors (and of ``bytes``)
    follow in one blob. Nothing in it names a type to build or a function to call: decoding
    makes only dicts, lists, tuples, numbers, strings, bytes and tensors.

    | value | JSON |
    |---|---|
    | None, bool, int, str, finite float, list | itself |
    | dict (any hashable keys, order kept) | ``{"$d": [[key, value], ...]}`` |
    | tuple | ``{"$t": [...]}`` |
    | inf, -inf, nan | ``{"$f": "inf"}`` ... |
    | bytes | ``{"$b": [offset, length]}`` into the blob |
    | tensor | ``{"$tensor": [dtype, shape, offset, length]}`` |
    | a registered object's tensor (:class:`_Raw`) | ``{"$raw": [dtype, shape, offset, length]}`` |
    """

    def __init__(self) -> None:
        self.blob = bytearray()

    def _put(self, data: bytes) -> list[int]:
        at = len(self.blob)
        self.blob += data
        return [at, len(data)]

    def encode(self, x: Any, where: str, depth: int = 0) -> Any:
        if depth > _DEPTH:
            raise ScheduleError(f"the schedule nests deeper than {_DEPTH} levels at {where}")
        if x is None or type(x) in (bool, int, str):
            return x
        if isinstance(x, numbers.Integral) and not isinstance(x, bool):  # NumPy's ints too: the int they equal
            return int(x)
        if isinstance(x, numbers.Real):  # NumPy's floats too: the float they equal
            return float(x) if math.isfinite(x) else {"$f": repr(float(x))}
        if isinstance(x, str):
            return str(x)
        if type(x) is bytes:
            return {"$b": self._put(x)}
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu").contiguous()
            return {
                "$tensor": [
                    str(t.dtype).removeprefix("torch."),
                    list(t.shape),
                    *self._put(t.reshape(-1).view(torch.uint8).numpy().tobytes()),
                ]
            }
        if type(x) is _Raw:
            return {"$raw": [x.dtype, list(x.shape), *self._put(x.data)]}
        if type(x) is list:
            return [self.encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(x)]
        if type(x) is tuple:
            return {"$t": [self.encode(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(x)]}
        if isinstance(x, dict):
            return {
                "$d": [
                    [self.encode(k, f"{where} key {k!r}", depth + 1), self.encode(v, f"{where}[{k!r}]", depth + 1)]
                    for k, v in x.items()
                ]
            }
        raise ScheduleError(
            f"the schedule holds a {type(x).__qualname__} at {where}: only None, bool, int, float, str, "
            "bytes, list, tuple, dict and tensors are saved with the state; give its state_dict() "
            "plain values"
        )

    def decode(self, x: Any, source: str, depth: int = 0) -> Any:
        if depth > _DEPTH:
            raise ScheduleError(f"{source}: its schedule nests deeper than {_DEPTH} levels")
        if x is None or type(x) in (bool, int, str, float):
            return x
        if type(x) is list:
            return [self.decode(v, source, depth + 1) for v in x]
        if type(x) is not dict or len(x) != 1 or next(iter(x)) not in _TAGS:
            raise ScheduleError(
                f"{source}: its schedule holds {str(x)[:80]!r}, expected a value or one of the "
                f"tagged objects {list(_TAGS)}"
            )
        ((tag, v),) = x.items()
        if tag == "$d" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
            out = {}
            for k, val in v:
                key = self.decode(k, source, depth + 1)
                try:
                    out[key] = self.decode(val, source, depth + 1)
                except TypeError:
                    raise ScheduleError(
                        f"{source}: its schedule has a dict key {str(k)[:80]} that is not hashable"
                    ) from None
            return out
        if tag == "$t" and type(v) is list:
            return tuple(self.decode(e, source, depth + 1) for e in v)
        if tag == "$f" and v in ("inf", "-inf", "nan"):
            return float(v)
        if tag == "$b" and type(v) is list and len(v) == 2:
            return bytes(self._span(v[0], v[1], source))
        if tag in ("$tensor", "$raw") and type(v) is list and len(v) == 4:
            dtype, shape, at, n = v
            kind = getattr(torch, dtype, None) if type(dtype) is str else None
            if not isinstance(kind, torch.dtype):
                raise ScheduleError(f"{source}: its schedule names {str(dtype)[:40]!r} as a dtype: not a torch dtype")
            if type(shape) is not list or len(shape) > _DEPTH or not all(type(d) is int and d >= 0 for d in shape):
                raise ScheduleError(
                    f"{source}: its schedule gives a tensor the shape {str(shape)[:80]}: expected "
                    "a list of non-negative ints"
                )
            data = self._span(at, n, source)
            if math.prod(shape) * kind.itemsize != len(data):
                raise ScheduleError(f"{source}: its schedule gives a {dtype} tensor of shape {shape} {len(data)} bytes")
            if tag == "$raw":
                return _Raw(dtype, tuple(shape), bytes(data))
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            return flat.view(kind).reshape(shape)
        raise ScheduleError(f"{source}: its schedule's {tag} holds {str(v)[:80]!r}, not what that tag carries")

    def _span(self, at: Any, n: Any, source: str) -> memoryview:
        if type(at) is not int or type(n) is not int or at < 0 or n < 0 or at + n > len(self.blob):
            raise ScheduleError(f"{source}: its schedule points at bytes {at!r}+{n!r} of a {len(self.blob)}-byte blob")
        return memoryview(self.blob)[at : at + n]


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"the JSON constant {name} (non-finite floats are tagged)")


def _restore_values(parts: OptimizerParts, values: tuple[tuple[str, Any], ...]) -> None:
    """Put :attr:`Schedule.values` back into ``parts``' state."""
    by_sd: dict[int, list[tuple[str, Any]]] = {}
    listed: dict[int, list[torch.Tensor]] = {}
    for where, value in values:
        head, _, rest = where.partition("/")
        if head == "sd":
            index, _, path = rest.partition("/")
            by_sd.setdefault(int(index), []).append((path, value))
            continue
        i, j, key = int(head), *rest.split("/", 1)
        o = parts.by_param[i] if i < len(parts.by_param) else None
        if o is None:
            raise ValueError(
                f"the committed schedule has optimizer state {where!r}; this optimizer has "
                f"{len(parts.by_param)} part(s)"
            )
        params = listed.setdefault(i, [p for g in o.param_groups for p in g["params"]])
        slot = o.state.get(params[int(j)]) if int(j) < len(params) else None
        if slot:  # a slot made here would stop the optimizer's own lazy initialisation of the rest
            slot[key] = copy.deepcopy(value)
    for sd_index, saved in by_sd.items():
        o = parts.by_state_dict[sd_index]
        sd = o.state_dict()
        for path, value in saved:
            _put(sd, path, copy.deepcopy(value), type(o).__qualname__)
        o.load_state_dict(sd)


def _schedule_tensor(schedule: Schedule) -> torch.Tensor:
    """``schedule`` in the data-only encoding (:class:`_Wire`): a magic, the JSON's length, the
    JSON, the blob; padded so a peer copy's layout stays put from commit to commit."""
    wire = _Wire()
    doc = {
        "groups": wire.encode(list(schedule.groups), "param_groups"),
        "schedulers": [[k, wire.encode(sd, f"scheduler {k}")] for k, sd in schedule.schedulers],
        "objects": [[k, wire.encode(st, f"state[{k!r}]")] for k, st in schedule.objects],
        "values": [[k, wire.encode(v, f"optimizer state {k}")] for k, v in schedule.values],
    }
    raw = json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()
    size = len(_SCHEDULE_MAGIC) + 16 + len(raw) + len(wire.blob)
    buf = bytearray(size + (-size) % _SCHEDULE_PAD)
    at = len(_SCHEDULE_MAGIC)
    buf[:at] = _SCHEDULE_MAGIC
    buf[at : at + 16] = len(raw).to_bytes(8, "little") + len(wire.blob).to_bytes(8, "little")
    buf[at + 16 : size] = raw + wire.blob
    return torch.frombuffer(buf, dtype=torch.uint8).clone()


def _schedule_from(t: torch.Tensor, source: str = "the committed state") -> Schedule:
    """The :class:`Schedule` a :func:`_schedule_tensor` made; anything else (a pickle, a torn or
    forged encoding) raises :class:`ScheduleError` in one line naming ``source`` (where the
    bytes came from: a peer copy, a checkpoint). Decoding runs no code and builds no type it names."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        raise ScheduleError(f"{source}: its schedule is not a uint8 tensor")
    raw = t.detach().reshape(-1).numpy().tobytes()
    at = len(_SCHEDULE_MAGIC)
    if raw[:at] != _SCHEDULE_MAGIC:
        raise ScheduleError(
            f"{source}: its schedule starts {raw[:at]!r}, not {_SCHEDULE_MAGIC!r} (Meshpact's data-only "
            "encoding); refused unread"
        )
    n_doc, n_blob = int.from_bytes(raw[at : at + 8], "little"), int.from_bytes(raw[at + 8 : at + 16], "little")
    if at + 16 + n_doc + n_blob > len(raw):
        raise ScheduleError(f"{source}: its schedule claims {n_doc + n_blob} bytes, {len(raw) - at - 16} follow")
    wire = _Wire()
    wire.blob = bytearray(raw[at + 16 + n_doc : at + 16 + n_doc + n_blob])
    try:
        doc = json.loads(raw[at + 16 : at + 16 + n_doc], parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise ScheduleError(f"{source}: its schedule is not valid JSON ({str(exc)[:120]})") from None
    if type(doc) is not dict or set(doc) != {"groups", "schedulers", "objects", "values"}:
        raise ScheduleError(
            f"{source}: its schedule has fields {sorted(doc) if type(doc) is dict else type(doc).__name__}, "
            "expected groups, schedulers, objects and values"
        )
    groups = wire.decode(doc["groups"], source)

    def named(entries: Any, what: str) -> tuple[tuple[str, Any], ...]:
        if type(entries) is not list or not all(type(e) is list and len(e) == 2 and type(e[0]) is str for e in entries):
            raise ScheduleError(f"{source}: its schedule's {what} are not [name, state] pairs")
        return tuple((k, wire.decode(v, source)) for k, v in entries)

    if type(groups) is not list or not all(type(g) is dict for g in groups):
        raise ScheduleError(f"{source}: its schedule's param groups are not a list of dicts")
    return Schedule(
        tuple(groups),
        named(doc["schedulers"], "schedulers"),
        named(doc["objects"], "objects"),
        named(doc["values"], "optimizer state values"),
    )


def job_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rng: RngState | None = None,
    *,
    schedule: Schedule | None = None,
    schedulers: Sequence[Any] = (),
    objects: Mapping[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """What a checkpoint holds and bit-identity compares: :func:`local_state`, the generators
    (``rng``: as the caller captured them a moment ago, nothing drawn since; default: now) and
    the optimizer's schedule with the registered objects (``schedule``, likewise; default:
    now, with ``schedulers`` and ``objects``)."""
    sched = capture_schedule(optimizer, schedulers, objects) if schedule is None else schedule
    return {
        **local_state(model, optimizer),
        **rng_tensors(capture_rng() if rng is None else rng),
        SCHEDULE_KEY: _schedule_tensor(sched),
    }


def load_job_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, torch.Tensor],
    schedulers: Sequence[Any] = (),
    objects: Mapping[str, Any] | None = None,
    source: str = "the committed state",
) -> None:
    """Put ``state`` (:func:`job_state`'s) back; ``source`` names where it came from (a peer copy,
    a checkpoint) in the one line a schedule that is not Meshpact's encoding is refused with."""
    load_local_state(model, optimizer, {k: v for k, v in state.items() if not k.startswith(("rng/", "schedule/"))})
    if "rng/torch_cpu" in state:
        restore_rng(rng_from_tensors(state))
    if SCHEDULE_KEY in state:
        restore_schedule(optimizer, schedulers, _schedule_from(state[SCHEDULE_KEY], source), objects)


def shard_rows(dim0: int, world: int, rank: int) -> tuple[int, int]:
    """``(first row, rows)`` of ``rank``'s shard of a tensor with ``dim0`` rows over ``world``
    ranks, as FSDP2 and DTensor's ``Shard(0)`` cut it (``torch.chunk``: chunks of
    ``ceil(dim0 / world)`` rows, the last ones short or empty)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    chunk = -(-dim0 // world)
    start = min(rank * chunk, dim0)
    return start, max(0, min(chunk, dim0 - start))
