"""Excision: continue training on the survivors of a lost rank, its state re-sharded over them.

When a rank is lost and no replacement comes, the survivors build a smaller world and carry
on. Nothing is reloaded from storage: each survivor holds its own FSDP2 shards (parameters
and optimizer state), and the lost rank's shards come from a peer's host-memory copy of its
:func:`~meshpact.live.recovery.state.local_state`. :func:`excise` runs the stages:

1. *communicator* — the survivors' group: ``dist.shrink_group`` where the backend can shrink
   (:func:`~meshpact.live.recovery.communicator.can_shrink`: NCCL >= 2.27), otherwise a new
   group over the survivors (gloo always). Either way the survivors are renumbered
   ``0..W'-1`` in their old order and the group becomes c10d's default, so the smaller job
   looks like any job of ``W'`` ranks; :class:`Membership` keeps each survivor's original
   rank (the data follows the original rank, the group rank does not).
2. *redistribute* — shard to shard, never a whole tensor on any rank. The old shards lie
   in rank order along dim 0 (FSDP2's ``Shard(0)`` cut, :func:`shard_rows`: ``torch.chunk``
   rows, the last shards short or empty; FSDP2 pads them only in its communication buffers,
   never in the local tensor); the new world's cut of the same rows says which rows each
   survivor needs. Every survivor sends, from its own shards and the copies it provides of
   lost ranks (one provider per lost rank: the first survivor holding it), exactly the rows
   each other survivor's new shard takes from them, in ``all_to_all_single`` rounds of byte
   buffers after a small exchange of the layouts (:func:`plan_rounds`: consecutive tensors
   share a round while no survivor sends and receives more than ``ROUND_BYTES`` in it). Each
   arriving piece is copied into its place in the new shard, which is made once, empty, and
   filled first with the rows the survivor holds already. A survivor's memory for it is its
   new shard and one round's buffers: never a whole tensor, nor a second copy of its shard.
3. *rebuild* — the workload's ``build(mesh)`` on the survivors' 1-D mesh, its shapes checked
   against the old shards', and the new shards loaded, Adam's
   ``exp_avg``/``exp_avg_sq``/``step`` included. The generators are left as they were:
   ``build`` may reseed them. The old shards' memory is freed (:func:`release_shards`) before
   ``build`` runs, once the new shards hold every row (``gpt100m``'s build makes the model whole
   before sharding it: 1.4 shards of the old world on every rank, for a moment): the old model
   lingers (the caller's references, cycles among FSDP's modules) but holds none of it.

Same global batch (:func:`share_batch`): the global batch of a step is the concatenation of
``batch(step, r)`` over the *original* world's ranks. After excision every survivor keeps
its own original samples and takes a share of the departed ranks' samples: those are
concatenated in original rank order and cut with ``torch.tensor_split`` into ``W'``
contiguous parts, part ``j`` to the survivor of group rank ``j`` (so the first ``n mod W'``
survivors take one more). Shares can then be unequal while FSDP2 averages gradients over
the group, so survivor ``j`` holding ``n_j`` of ``N`` samples weights its gradient by
``n_j * W' / N`` (:class:`GradientWeight`, a hook on the model's output gradient): the
group average is then the mean over all ``N`` samples, as before. This holds for a loss
that is a mean over samples of equal weight (the shipped workloads).

Below ``min_ranks`` survivors nothing is trained: every survivor writes its own state, and
the provider of each lost rank's copy writes that copy, as one complete checkpoint of the
world before the excision (:class:`~meshpact.live.recovery.checkpoint.Checkpointer`
layout, a file per group rank), and :class:`ExcisionRefused` says so in one line.

Only a 1-D FSDP2 mesh is re-sharded (every parameter a ``Shard(0)`` DTensor). An HSDP mesh
(2-D: ``replicate`` x ``shard``, dimension 0 the replicas) is not re-sharded at all: every
replica holds the whole state, so a lost rank takes its whole replica out of the job
(:func:`replica_of`; its other ranks leave, :class:`LeftWithReplica`) and the other replicas
go on as they are, each shard group its size, the mesh one replica shorter: the survivors
build the smaller mesh's groups, ``build(mesh)`` on it, and load their own shards unmoved.
Anything else is refused by name. Buffers and learning-rate schedulers are not in a rank's
local state and come back as ``build`` makes them.

The excising reference a trial compares against (:mod:`meshpact.live.trials.drills`) runs
these same functions with no fault.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from meshpact.core.errors import MeshpactError
from meshpact.core.jsonform import JsonObject
from meshpact.core.recovery import CommunicatorAction

from . import communicator as comm
from .checkpoint import Checkpointer
from .state import (
    SCHEDULE_KEY,
    capture_rng,
    load_buffers,
    load_local_state,
    restore_objects,
    restore_rng,
    saved_objects,
    shard_rows,
)

__all__ = [
    "Membership",
    "ExcisionRecord",
    "Excised",
    "ExcisionError",
    "ExcisionRefused",
    "LeftWithReplica",
    "replica_of",
    "BatchShare",
    "GradientWeight",
    "shard_rows",
    "shard_of",
    "assemble_full",
    "sharded_keys",
    "share_batch",
    "excise",
    "plan_rounds",
    "release_shards",
    "adopt_objects",
    "max_abs_diff",
]

_SHARDED = ("param/", "optim/")  # keys of local_state that are FSDP2 shards (or replicated scalars)
ROUND_BYTES = 32 << 20  # what one survivor sends and receives in one round of the redistribution, at most


class ExcisionError(MeshpactError):
    """Excision cannot go on (a lost rank's state held by no survivor, a mesh it cannot re-shard)."""


class ExcisionRefused(ExcisionError):
    """Excision would leave fewer ranks than allowed; the state was flushed to a checkpoint."""

    def __init__(self, message: str, checkpoint: str) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


class LeftWithReplica(ExcisionError):
    """This rank is alive but its HSDP replica lost a rank: it leaves the job with its replica,
    and the other replicas go on (raised on this rank only; nothing is wrong with the job)."""


def replica_of(shape: Sequence[int], ranks: Sequence[int]) -> tuple[int, ...]:
    """Every rank (group ranks of a mesh of ``shape``, dimension 0 the replicas) in a replica
    that holds one of ``ranks``, sorted: what an HSDP excision of ``ranks`` takes out."""
    size = 1
    for n in shape[1:]:
        size *= int(n)
    replicas = sorted({int(r) // size for r in ranks})
    return tuple(q for i in replicas for q in range(i * size, (i + 1) * size))


# -- who is in the job -----------------------------------------------------------------------
@dataclass(frozen=True)
class Membership:
    """The ranks of the original world still in the job, in group-rank order."""

    original_world: int
    alive: tuple[int, ...]

    @classmethod
    def full(cls, world: int) -> "Membership":
        return cls(world, tuple(range(world)))

    @property
    def world(self) -> int:
        return len(self.alive)

    @property
    def departed(self) -> tuple[int, ...]:
        return tuple(r for r in range(self.original_world) if r not in self.alive)

    def group_rank(self, original: int) -> int:
        return self.alive.index(original)

    def without(self, lost: Sequence[int]) -> "Membership":
        bad = sorted(set(lost) - set(self.alive))
        if bad or not lost:
            raise ExcisionError(f"cannot excise ranks {sorted(lost)}: the job's ranks are {list(self.alive)}")
        return Membership(self.original_world, tuple(r for r in self.alive if r not in set(lost)))


# -- FSDP2's Shard(0) cut ----------------------------------------------------------------------
def shard_of(full: torch.Tensor, world: int, rank: int) -> torch.Tensor:
    """``rank``'s ``Shard(0)`` piece of ``full`` (a copy: the whole tensor can be freed)."""
    start, rows = shard_rows(full.shape[0], world, rank)
    return full.narrow(0, start, rows).clone()


def sharded_keys(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The keys of a local state that excision re-shards: parameters and optimizer state
    (generators and anything else stay with their rank)."""
    return [k for k in state if k.startswith(_SHARDED)]


def assemble_full(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Whole tensors from every rank's local state (group-rank order): shards concatenated on
    dim 0, each checked to be the rows :func:`shard_rows` gives; 0-d tensors (Adam's ``step``)
    are replicated and must be equal on every rank."""
    world = len(states)
    out: dict[str, torch.Tensor] = {}
    for key in sharded_keys(states[0]):
        parts = [s[key] for s in states]
        if parts[0].dim() == 0:
            if any(not torch.equal(p, parts[0]) for p in parts):
                raise ExcisionError(f"{key}: the ranks disagree on a replicated value ({[p.item() for p in parts]})")
            out[key] = parts[0].clone()
            continue
        full = torch.cat(parts)
        for r, p in enumerate(parts):
            if p.shape[0] != shard_rows(full.shape[0], world, r)[1]:
                raise ExcisionError(
                    f"{key}: rank {r} holds {p.shape[0]} rows, but a Shard(0) cut of "
                    f"{full.shape[0]} rows over {world} ranks gives it "
                    f"{shard_rows(full.shape[0], world, r)[1]}; only 1-D FSDP2 states are re-sharded"
                )
        out[key] = full
    return out


def max_abs_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The largest absolute difference over the floating-point tensors two states share."""
    worst = 0.0
    for key in a.keys() & b.keys():
        if a[key].is_floating_point() and a[key].shape == b[key].shape:
            worst = max(worst, float((a[key].double() - b[key].double()).abs().max()) if a[key].numel() else 0.0)
    return worst


# -- the record ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExcisionRecord:
    """One excision seen by one survivor."""

    step: int  # the committed step the states are from (the next step runs on the new world)
    lost: tuple[int, ...]  # original ranks
    old_world: int
    new_world: int
    action: CommunicatorAction  # SHRINK (dist.shrink_group) or REBUILD (a new group of the survivors)
    bytes_moved: int  # payload of the redistribution: the rows that change rank, lost ranks' from their copies
    communicator_s: float
    gather_s: float  # the redistribution (layouts exchanged, rows sent shard to shard)
    rebuild_s: float  # build(mesh), re-cut, load
    max_abs_diff_from_unfailed: float | None = None  # filled in where a never-failed run is known

    def to_dict(self) -> JsonObject:
        return {**asdict(self), "lost": list(self.lost), "action": self.action.value}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ExcisionRecord":
        return cls(**{**d, "lost": tuple(d["lost"]), "action": CommunicatorAction(d["action"])})


@dataclass(frozen=True)
class Excised:
    """What a survivor continues with: the smaller world's model, optimizer, group and mesh."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    group: dist.ProcessGroup
    mesh: Any
    spec: comm.GroupSpec  # this rank in the smaller world (rank = its group rank)
    membership: Membership
    record: ExcisionRecord
    # every group of the smaller world by base name (the world group and, on an HSDP mesh, each dimension's)
    groups: Mapping[str, dist.ProcessGroup] = field(default_factory=dict)
    shape: tuple[int, ...] = ()  # the smaller world's mesh
    # each lost rank's committed schedule (its registered objects: a data loader's position), on
    # every survivor: the survivors draw the lost ranks' samples from those objects from now on
    departed: Mapping[int, torch.Tensor] = field(default_factory=dict)


# -- same global batch ---------------------------------------------------------------------------
@dataclass(frozen=True)
class BatchShare:
    """One survivor's samples of a step and the weight of its gradient (``n_j * W' / N``)."""

    batch: torch.Tensor
    weight: float


def share_batch(
    batch: Callable[[int, int], torch.Tensor],
    step: int,
    membership: Membership,
    original_rank: int,
    drawn_once: bool = False,
) -> BatchShare:
    """This survivor's share of the original world's global batch of ``step`` (see the module
    docstring for the rule). Batches are tensors with samples on dim 0. The gradient's weight
    needs every survivor's sample count: drawn again from ``batch`` (a pure function of the step
    may give ranks batches of other sizes), or with ``drawn_once`` (a stateful source, such as a
    data loader, whose batches cannot be drawn twice) taken to be this rank's; each rank's batch
    and each lost rank's are then drawn exactly once per step."""
    own = batch(step, original_rank)
    if not isinstance(own, torch.Tensor):
        raise ExcisionError(
            f"batch({step}, {original_rank}) returned {type(own).__name__}; excision splits "
            "batches by sample and needs a tensor with samples on dim 0"
        )
    if not membership.departed:
        return BatchShare(own, 1.0)
    j, world = membership.group_rank(original_rank), membership.world
    pool = torch.cat([batch(step, r) for r in membership.departed])
    extra = torch.tensor_split(pool, world)
    counts = (
        [own.shape[0]] * world if drawn_once else [batch(step, r).shape[0] for r in membership.alive]
    )  # drawn again: sizes may vary per rank
    mine = own.shape[0] + extra[j].shape[0]
    total = sum(counts) + pool.shape[0]
    return BatchShare(torch.cat([own, extra[j]]), mine * world / total)


class GradientWeight:
    """Multiplies the gradient flowing into the model's outputs by :attr:`weight` (so every
    parameter gradient, before FSDP2 reduces it); ``remove()`` takes the hook off."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.weight = 1.0
        self._handle = model.register_forward_hook(self._on_output)

    def _on_output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.weight == 1.0:
            return
        w = self.weight
        for t in torch.utils._pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g, w=w: g * w)

    def remove(self) -> None:
        self._handle.remove()


# -- the stages ----------------------------------------------------------------------------------
def _survivor_group(
    old_group: dist.ProcessGroup | None,
    spec: comm.GroupSpec,
    store: Any,
    generation: int,
    before: Membership,
    after: Membership,
) -> tuple[dist.ProcessGroup, comm.GroupSpec, CommunicatorAction]:
    from .session import c10d_default

    new_rank = after.group_rank(before.alive[spec.rank])
    new_spec = replace(spec, rank=new_rank, world_size=after.world)
    if old_group is not None and comm.can_shrink(old_group, spec.device):
        lost = [before.group_rank(r) for r in before.alive if r not in after.alive]
        pg = dist.shrink_group(lost, group=old_group)
        action = CommunicatorAction.SHRINK
    else:
        pg = comm.build_group(new_spec, store, generation)
        action = CommunicatorAction.REBUILD
    c10d_default(pg)
    return pg, new_spec, action


Layout = list[tuple[str, str, tuple[int, ...]]]  # (key, dtype name, shape) of each tensor of a packed state


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def _nbytes(layout: Layout) -> int:
    return sum(torch.Size(shape).numel() * _dtype(dtype).itemsize for _, dtype, shape in layout)


def _pack(states: Sequence[Mapping[str, torch.Tensor]], keys: Sequence[str]) -> torch.Tensor:
    """The bytes of ``keys`` of each state, in order, as one flat uint8 tensor (every bit kept)."""
    parts = [s[k].detach().reshape(-1).contiguous().view(torch.uint8) for s in states for k in keys]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def _unpack(buf: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for key, dtype, shape in layout:
        n = _nbytes([(key, dtype, shape)])
        out[key] = buf[offset : offset + n].clone().view(_dtype(dtype)).reshape(shape)
        offset += n
    return out


def plan_rounds(costs: Sequence[Sequence[int]], bound: int) -> list[list[int]]:
    """The rounds of a redistribution: ``costs[k][i]`` is what rank ``i`` sends and receives of
    key ``k`` (bytes); consecutive keys share a round while no rank's sum for the round passes
    ``bound``, and a key costing more than ``bound`` on some rank is a round of its own. Returns
    the keys' indices, round by round. Pure: every rank computes the same rounds."""
    rounds: list[list[int]] = []
    load: list[int] = []
    for k, cost in enumerate(costs):
        if rounds and all(x + c <= bound for x, c in zip(load, cost)):
            rounds[-1].append(k)
            load = [x + c for x, c in zip(load, cost)]
        else:
            rounds.append([k])
            load = list(cost)
    return rounds


def _redistribute(
    own: Mapping[str, torch.Tensor],
    provided: Mapping[int, Mapping[str, torch.Tensor]],
    providers: Mapping[int, int],
    before: Membership,
    after: Membership,
    group: dist.ProcessGroup,
    me: int,
    round_bytes: int = ROUND_BYTES,
) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]], int]:
    """This survivor's (group rank ``me`` in ``before``) shards in the new world (every sharded key), the whole tensors' shapes,
    and the payload bytes the redistribution carried over the group (module docstring). The rows
    go in rounds (:func:`plan_rounds`): a round's send and receive buffers take at most
    ``round_bytes`` on any rank (or one key's rows, where those are more), and each arriving
    piece is copied straight into its place in the new shard."""
    import hashlib

    keys = sharded_keys(own)
    mine = {before.alive[me]: own, **provided}
    me = after.group_rank(before.alive[me])  # from here on: the rank in the new world
    replicated = [k for k in keys if own[k].dim() == 0]
    rows_keys = [k for k in keys if own[k].dim() > 0]
    # hashed from copies: numpy over a tensor's own storage would pin it (no longer resizable or freed)
    scalar_bytes = hashlib.blake2b(
        b"".join(own[k].detach().reshape(-1).clone().view(torch.uint8).numpy().tobytes() for k in replicated),
        digest_size=16,
    ).hexdigest()
    layout = {r: [(k, str(mine[r][k].dtype), tuple(mine[r][k].shape)) for k in rows_keys] for r in sorted(mine)}
    layouts: list[Any] = [None] * group.size()
    dist.all_gather_object(layouts, (layout, scalar_bytes), group=group)
    if len({digest for _, digest in layouts}) > 1:
        raise ExcisionError(
            f"the survivors disagree on the replicated values {replicated[:4]} (Adam's step): "
            "their states are not of one committed step"
        )
    holder = {r: after.group_rank(r) for r in before.alive if r in after.alive}
    holder.update(providers)
    shapes: dict[int, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for per_src, _ in layouts:
        for r, lay in per_src.items():
            shapes[int(r)] = {k: (dtype, shape) for k, dtype, shape in lay}
    # where each old rank's rows lie in the whole tensor, and each new rank's
    offsets: dict[str, list[int]] = {}
    totals: dict[str, int] = {}
    for k in rows_keys:
        at, offs = 0, []
        for i, r in enumerate(before.alive):
            rows = shapes[r][k][1][0]
            total_rows = sum(shapes[q][k][1][0] for q in before.alive)
            if rows != shard_rows(total_rows, before.world, i)[1]:
                raise ExcisionError(
                    f"{k}: rank {r} holds {rows} rows, but a Shard(0) cut of {total_rows} rows over "
                    f"{before.world} ranks gives it {shard_rows(total_rows, before.world, i)[1]}; "
                    "only 1-D FSDP2 states are re-sharded"
                )
            offs.append(at)
            at += rows
        offsets[k], totals[k] = offs, at

    def piece(r: int, k: str, j: int) -> tuple[int, int]:
        """Rows ``[a, b)`` of old rank ``r``'s local tensor ``k`` that new rank ``j`` takes."""
        start, n = shard_rows(totals[k], after.world, j)
        off = offsets[k][before.alive.index(r)]
        a, b = max(start, off), min(start + n, off + shapes[r][k][1][0])
        return (a - off, b - off) if a < b else (0, 0)

    def nbytes(r: int, k: str, rows: int) -> int:
        dtype, shape = shapes[r][k]
        return rows * torch.Size(shape[1:]).numel() * _dtype(dtype).itemsize

    world = after.world
    order = list(before.alive)  # sources in old rank order: a new shard's rows come in this order

    def row_count(p: tuple[int, int]) -> int:
        return p[1] - p[0]

    def first_row(k: str, j: int) -> int:
        return shard_rows(totals[k], world, j)[0]

    # the new shards, filled in place: the rows this rank holds now first, then each round's
    out: dict[str, torch.Tensor] = {}
    for k in rows_keys:
        dtype, shape = shapes[order[0]][k]
        out[k] = torch.empty((shard_rows(totals[k], world, me)[1], *shape[1:]), dtype=_dtype(dtype))
    for r in order:
        if holder[r] != me:
            continue
        for k in rows_keys:
            a, b = piece(r, k, me)
            if b > a:
                at = offsets[k][before.alive.index(r)] + a - first_row(k, me)
                out[k].narrow(0, at, b - a).copy_(mine[r][k].detach().narrow(0, a, b - a))
    # every rank's round buffers per key (what it sends plus what it receives), the same table on every rank
    costs = [
        [
            sum(
                nbytes(r, k, row_count(piece(r, k, j))) for r in order if holder[r] == i for j in range(world) if j != i
            )
            + sum(nbytes(r, k, row_count(piece(r, k, i))) for r in order if holder[r] != i)
            for i in range(world)
        ]
        for k in rows_keys
    ]
    for round_keys in plan_rounds(costs, round_bytes):
        batch = [rows_keys[x] for x in round_keys]
        send_parts: list[torch.Tensor] = []
        send_sizes = [0] * world
        for j in range(world):
            for r in order:
                if holder[r] != me or j == me:  # rows that stay on this rank were copied above
                    continue
                for k in batch:
                    a, b = piece(r, k, j)
                    if b > a:
                        send_parts.append(
                            mine[r][k].detach().narrow(0, a, b - a).contiguous().reshape(-1).view(torch.uint8)
                        )
                        send_sizes[j] += send_parts[-1].numel()
        recv_sizes = [
            0
            if i == me
            else sum(nbytes(r, k, row_count(piece(r, k, me))) for r in order if holder[r] == i for k in batch)
            for i in range(world)
        ]
        send = torch.cat(send_parts) if send_parts else torch.zeros(0, dtype=torch.uint8)
        del send_parts
        recv = torch.empty(sum(recv_sizes), dtype=torch.uint8)
        dist.all_to_all_single(recv, send, output_split_sizes=recv_sizes, input_split_sizes=send_sizes, group=group)
        del send
        at_by_sender = [sum(recv_sizes[:i]) for i in range(world)]
        for r in order:  # each sender's pieces in (source, key) order, as it packed them
            i = holder[r]
            if i == me:
                continue
            for k in batch:
                a, b = piece(r, k, me)
                n = nbytes(r, k, b - a)
                if n:
                    dtype, shape = shapes[r][k]
                    at = offsets[k][before.alive.index(r)] + a - first_row(k, me)
                    out[k].narrow(0, at, b - a).copy_(
                        recv[at_by_sender[i] : at_by_sender[i] + n].view(_dtype(dtype)).reshape(b - a, *shape[1:])
                    )
                    at_by_sender[i] += n
        del recv  # the round's buffers go before the next round's are made
    for k in replicated:
        out[k] = own[k].detach().clone()
    moved = sum(
        nbytes(r, k, (lambda p: p[1] - p[0])(piece(r, k, j)))
        for r in order
        for k in rows_keys
        for j in range(world)
        if holder[r] != j
    )
    whole = {k: (totals[k], *shapes[order[0]][k][1][1:]) for k in rows_keys}
    whole.update({k: () for k in replicated})
    return out, whole, moved


def _rebuild(
    build: Callable[[Any], tuple[torch.nn.Module, torch.optim.Optimizer]],
    mesh: Any,
    shards: dict[str, torch.Tensor],
    whole: Mapping[str, tuple[int, ...]],
    unmoved: bool = False,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The smaller world's model and optimizer from ``build``, loaded from ``shards``, which
    are given away: the dict is empty after, and no shard is held twice while loading.
    ``unmoved``: an HSDP excision's shards, each parameter's local shard as it was (checked)."""
    from torch.distributed.tensor import DTensor, Shard

    rng = capture_rng()
    model, optimizer = build(mesh)
    restore_rng(rng)
    for name, p in model.named_parameters():
        if unmoved:
            local = tuple(p.to_local().shape) if isinstance(p, DTensor) else tuple(p.shape)
            if local != tuple(shards[f"param/{name}"].shape):
                raise ExcisionError(
                    f"parameter {name}: the smaller mesh's shard has shape {local}, this rank held "
                    f"{tuple(shards[f'param/{name}'].shape)}; an HSDP excision keeps every shard as it is"
                )
            continue
        if not isinstance(p, DTensor) or tuple(p.placements) != (Shard(0),):
            raise ExcisionError(
                f"parameter {name} is {type(p).__name__} placed {getattr(p, 'placements', None)}; "
                "excision re-shards only a 1-D FSDP2 mesh (every parameter Shard(0))"
            )
        if tuple(p.shape) != tuple(whole[f"param/{name}"]):
            raise ExcisionError(
                f"parameter {name}: the rebuilt model has shape {tuple(p.shape)}, the old shards "
                f"make {tuple(whole[f'param/{name}'])}"
            )
    load_local_state(model, optimizer, shards, take=True)  # each shard leaves ``shards`` as it is loaded
    return model, optimizer


def release_shards(state: Mapping[str, torch.Tensor]) -> int:
    """Free the memory of the old world's shards (``state``'s parameters and optimizer state, as
    :func:`excise` got them) once the new model holds them; returns the bytes freed. The old
    model may outlive the excision (the caller's references to it, which refuse any forward, or
    reference cycles among its modules that a frozen garbage collector never visits): it keeps
    none of its shards' memory, so a survivor never holds the old world's shards beside the new."""
    freed = 0
    for key in sharded_keys(state):
        storage = state[key].untyped_storage()
        if storage.nbytes() and storage.resizable():
            freed += storage.nbytes()
            storage.resize_(0)
    return freed


def carry_schedule(schedule: Any, optimizer: torch.optim.Optimizer) -> list[Any]:
    """Give a rebuilt optimizer (an excision's) the schedule the survivor committed: its param
    groups' settings and its LR schedulers' state, the schedulers ``build`` made for it found
    anew. Returns those schedulers."""
    from .state import restore_schedule, schedulers_of

    schedulers = schedulers_of(optimizer)
    restore_schedule(optimizer, schedulers, schedule)
    return schedulers


def _flush(
    own: Mapping[str, torch.Tensor],
    provided: Mapping[int, Mapping[str, torch.Tensor]],
    before: Membership,
    me: int,
    step: int,
    directory: str,
    group: dist.ProcessGroup,
) -> str:
    """Write the world-before-excision's state of ``step`` as one complete checkpoint."""
    Checkpointer(directory, me, before.world, 1).save(step, own)
    for r, state in provided.items():
        Checkpointer(directory, before.group_rank(r), before.world, 1).save(step, state)
    dist.barrier(group=group)
    ckpt = Checkpointer(directory, me, before.world, 1)
    if not ckpt.complete(step):
        raise ExcisionError(f"the checkpoint of step {step} in {directory} is incomplete after the flush")
    return str(ckpt.path(step).parent)


def excise(
    own: Mapping[str, torch.Tensor],
    held: dict[int, Mapping[str, torch.Tensor]],
    before: Membership,
    lost: Sequence[int],
    *,
    step: int,
    spec: comm.GroupSpec,
    store: Any,
    generation: int,
    build: Callable[[Any], tuple[torch.nn.Module, torch.optim.Optimizer]],
    old_group: dist.ProcessGroup | None = None,
    min_ranks: int = 1,
    checkpoint_dir: str | None = None,
    shape: tuple[int, ...] = (),
    names: tuple[str, ...] | None = None,
) -> Excised:
    """Every survivor calls this with its own committed state (``local_state``; other keys such
    as generators are kept out of the exchange; its parameters' and optimizer state's memory is
    freed once the new shards hold them, before the new model is built, :func:`release_shards`) and the copies it holds of other ranks, keyed
    by original rank (``held``, possibly empty; emptied once re-sharded, so the copies can be
    freed before the new model is built). ``before`` is the job's membership,
    ``spec.rank`` this rank's group rank in it, ``lost`` original ranks, ``generation`` the
    new group's generation (fresh store namespace). Returns the smaller world's model and
    optimizer; raises :class:`ExcisionRefused` below ``min_ranks`` (after the flush) and
    :class:`ExcisionError` when a lost rank's state is held by no survivor or the states are
    not of one committed step (the optimizer's replicated ``step`` disagrees). ``shape`` (and
    ``names``): the job's mesh; a 2-D one is HSDP's, excised by whole replicas
    (:func:`_excise_replicas`)."""
    if len(shape) == 2:
        return _excise_replicas(
            own,
            before,
            lost,
            step=step,
            spec=spec,
            store=store,
            generation=generation,
            build=build,
            min_ranks=min_ranks,
            checkpoint_dir=checkpoint_dir,
            shape=shape,
            names=names,
        )
    if len(shape) > 2:
        raise ExcisionError(
            f"excision re-shards a 1-D FSDP mesh or drops replicas of a 2-D HSDP one; this job's mesh is {list(shape)}"
        )
    after = before.without(lost)
    me = spec.rank
    if before.alive[me] in lost:
        raise ExcisionError(f"rank {before.alive[me]} is being excised and cannot take part in its own excision")
    t0 = time.perf_counter()
    group, new_spec, action = _survivor_group(old_group, spec, store, generation, before, after)
    communicator_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    # what each survivor holds of the lost ranks, with each lost rank's committed schedule (small:
    # the param groups' settings and its registered objects), which every survivor takes
    holdings: list[Any] = [None] * group.size()
    dist.all_gather_object(holdings, {r: _schedule_bytes(held[r]) for r in sorted(held) if r in lost}, group=group)
    providers: dict[int, int] = {}
    departed: dict[int, torch.Tensor] = {}
    for src, rs in enumerate(holdings):
        for r, schedule in rs.items():
            providers.setdefault(r, src)
            if schedule is not None:
                departed.setdefault(r, torch.frombuffer(bytearray(schedule), dtype=torch.uint8))
    missing = sorted(set(lost) - set(providers))
    if missing:
        raise ExcisionError(
            f"no survivor holds a copy of the state of rank(s) {missing}: excision needs a peer copy "
            "(restore from a checkpoint instead)"
        )
    provided = {r: held[r] for r in lost if providers[r] == new_spec.rank}
    if after.world < min_ranks:
        if not checkpoint_dir:
            raise ExcisionError(
                f"excising rank(s) {sorted(lost)} would leave {after.world} rank(s), below "
                f"--min-ranks {min_ranks}, and no checkpoint directory is set to flush the state to"
            )
        where = _flush(own, provided, before, me, step, checkpoint_dir, group)
        raise ExcisionRefused(
            f"excising rank(s) {sorted(lost)} would leave {after.world} rank(s), below --min-ranks "
            f"{min_ranks}: stopped, the state of step {step} is flushed to {where}",
            where,
        )
    shards, whole, moved = _redistribute(own, provided, providers, before, after, group, me)
    # the lost ranks' copies are in the new shards now: let them go before the new model is built
    # (the caller's dict too; its holder forgets them), so the rebuild never holds them and the shards at once
    provided.clear()
    held.clear()
    gather_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    from .session import mesh_from_groups

    mesh = mesh_from_groups({comm.WORLD: group}, spec.device.split(":")[0], (after.world,), None)
    # the new shards hold every row now: the old world's go before ``build`` allocates the new model (a
    # workload's build may make it whole before sharding it), so the rebuild never holds old shards beside new
    release_shards(own)
    model, optimizer = _rebuild(build, mesh, shards, whole)
    load_buffers(model, own)  # buffers are each rank's own (BatchNorm's statistics): the survivor keeps its
    del shards
    rebuild_s = time.perf_counter() - t0
    record = ExcisionRecord(
        step, tuple(sorted(lost)), before.world, after.world, action, moved, communicator_s, gather_s, rebuild_s
    )
    return Excised(
        model,
        optimizer,
        group,
        mesh,
        new_spec,
        after,
        record,
        groups={comm.WORLD: group},
        shape=(after.world,),
        departed=departed,
    )


def _excise_replicas(
    own: Mapping[str, torch.Tensor],
    before: Membership,
    lost: Sequence[int],
    *,
    step: int,
    spec: comm.GroupSpec,
    store: Any,
    generation: int,
    build: Callable[[Any], tuple[torch.nn.Module, torch.optim.Optimizer]],
    min_ranks: int,
    checkpoint_dir: str | None,
    shape: tuple[int, ...],
    names: tuple[str, ...] | None,
) -> Excised:
    """HSDP: the replicas holding a ``lost`` rank leave whole, the others go on with their own
    shards unmoved, on a mesh one replica shorter per replica lost (module docstring). A rank
    of a leaving replica gets :class:`LeftWithReplica`; the state of a replica is every
    replica's, so no copy is needed and none is moved."""
    from .session import build_groups, c10d_default, mesh_from_groups

    if before.world != shape[0] * shape[1]:
        raise ExcisionError(f"an HSDP mesh {list(shape)} needs {shape[0] * shape[1]} ranks, the job has {before.world}")
    leaving = tuple(before.alive[q] for q in replica_of(shape, [before.group_rank(r) for r in lost]))
    me = before.alive[spec.rank]
    if me in lost:
        raise ExcisionError(f"rank {me} is being excised and cannot take part in its own excision")
    if len(leaving) == before.world:  # a rank lost in every replica: none goes on, whichever rank this is
        raise ExcisionError(
            f"losing rank(s) {sorted(lost)} leaves no whole replica of the HSDP mesh {list(shape)}: "
            "each replica lost a rank, so no replica can go on (restore a checkpoint)"
        )
    if me in leaving:
        raise LeftWithReplica(
            f"rank {me} leaves the job with its replica {list(leaving)} (rank(s) {sorted(lost)} "
            f"lost): the HSDP job goes on on the other {shape[0] - len(leaving) // shape[1]} "
            "replica(s)"
        )
    after = before.without(leaving)
    new_shape = (after.world // shape[1], shape[1])
    new_spec = replace(spec, rank=after.group_rank(me), world_size=after.world)
    t0 = time.perf_counter()
    groups = build_groups(new_spec, store, generation, new_shape, names)
    group = groups[comm.WORLD]
    c10d_default(group)
    communicator_s = time.perf_counter() - t0
    if after.world < min_ranks:
        if not checkpoint_dir:
            raise ExcisionError(
                f"excising rank(s) {sorted(lost)} with their replica would leave {after.world} "
                f"rank(s), below --min-ranks {min_ranks}, and no checkpoint directory is set"
            )
        where = _flush(own, {}, after, new_spec.rank, step, checkpoint_dir, group)
        raise ExcisionRefused(
            f"excising rank(s) {sorted(lost)} with their replica would leave {after.world} rank(s), "
            f"below --min-ranks {min_ranks}: stopped, the state of step {step} is flushed to "
            f"{where}",
            where,
        )
    t0 = time.perf_counter()
    mesh = mesh_from_groups(groups, spec.device.split(":")[0], new_shape, names)
    shards = {k: own[k] for k in sharded_keys(own)}
    whole = {k: tuple(v.shape) for k, v in shards.items()}
    model, optimizer = _rebuild(build, mesh, shards, whole, unmoved=True)
    load_buffers(model, own)
    rebuild_s = time.perf_counter() - t0
    record = ExcisionRecord(
        step, leaving, before.world, after.world, CommunicatorAction.REBUILD, 0, communicator_s, 0.0, rebuild_s
    )
    return Excised(model, optimizer, group, mesh, new_spec, after, record, groups=groups, shape=new_shape)


def adopt_objects(
    objects: dict[str, Any], departed: Mapping[int, torch.Tensor], state_of: Callable[[int], Mapping[str, Any]]
) -> None:
    """Add each lost rank's registered objects to a survivor's ``objects``: made here by
    ``state_of(rank)``, put at the positions its committed schedule (``departed``, by original
    rank) holds, registered as ``<name>@rank<r>``. A lost rank's own adopted objects pass on
    under their first owner's rank. Every survivor adopts every lost rank's objects: each draws
    the lost ranks' samples of a step (:func:`share_batch`) and keeps its part."""
    for r in sorted(departed):
        adopted: dict[str, Any] = {}
        saved = []
        for name, state in saved_objects(departed[r], f"rank {r}'s held copy"):
            base, _, origin = name.partition("@rank")
            owner = int(origin) if origin else r
            adopted[f"{base}@rank{owner}"] = state_of(owner)[base]
            saved.append((f"{base}@rank{owner}", state))
        restore_objects(adopted, tuple(sorted(saved)))
        objects.update(adopted)


def _schedule_bytes(state: Mapping[str, torch.Tensor]) -> bytes | None:
    """A held copy's committed schedule as bytes (None for a copy without one)."""
    t = state.get(SCHEDULE_KEY)
    return None if t is None else t.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
