"""Step ops in torch: the live twin of the numeric reference interpreter's semantics.

A buffer value is a tensor, or a list of tensors (what a gather or all-gather leaves: one
entry per participant, in participant order). Every op here has the meaning that
:mod:`meshpact.core.interpreter` gives it; the interpreter defines it, this module mirrors it
on real tensors and real process groups. Each function also runs on ``meta`` tensors, which
is how :func:`meshpact.live.executor.simulate` learns every buffer's shape before a plan runs.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from meshpact.core.errors import PlanError
from meshpact.core.plan import Collective, Projection, Step

__all__ = [
    "nbytes",
    "to_meta",
    "to_device",
    "clone_value",
    "pack",
    "unpack",
    "packed_shape",
    "packed_dtype",
    "collective_result",
    "run_collective",
    "project",
]

Value = Any  # torch.Tensor | list[torch.Tensor]


# -- values ---------------------------------------------------------------------------------
def _parts(v: Value) -> list[torch.Tensor]:
    return list(v) if isinstance(v, (list, tuple)) else [v]


def nbytes(v: Value) -> int:
    return sum(t.numel() * t.element_size() for t in _parts(v))


def to_meta(v: Value) -> Value:
    if isinstance(v, (list, tuple)):
        return [t.to("meta") for t in v]
    return v.to("meta")


def to_device(v: Value, device: torch.device) -> Value:
    if isinstance(v, (list, tuple)):
        return [t.to(device) for t in v]
    return v.to(device)


def clone_value(v: Value) -> Value:
    if isinstance(v, (list, tuple)):
        return [t.clone() for t in v]
    return v.clone()


def pack(v: Value) -> torch.Tensor:
    """The bytes of ``v`` as one flat ``uint8`` tensor: one bridge message, no header."""
    flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in _parts(v)]
    return flat[0] if len(flat) == 1 else torch.cat(flat)


def packed_shape(meta: Value) -> tuple[int]:
    return (nbytes(meta),)


def packed_dtype(meta: Value) -> torch.dtype:
    return torch.uint8


def unpack(buf: torch.Tensor, meta: Value) -> Value:
    out, at = [], 0
    for t in _parts(meta):
        n = t.numel() * t.element_size()
        out.append(buf[at:at + n].view(t.dtype).reshape(t.shape).clone())
        at += n
    return out if isinstance(meta, (list, tuple)) else out[0]


# -- collectives ------------------------------------------------------------------------------
_REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _reduce_pair(a: torch.Tensor, b: torch.Tensor, op: str) -> torch.Tensor:
    if op == "sum":
        return a + b
    if op == "max":
        return torch.maximum(a, b)
    if op == "min":
        return torch.minimum(a, b)
    raise PlanError(f"reduction op {op!r} is not one of sum, max, min")


def _reduce_all(values: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    acc = values[0]
    for v in values[1:]:
        acc = _reduce_pair(acc, v, op)
    return acc


def _chunks(t: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    parts = list(torch.chunk(t, n, dim=dim))
    if len(parts) != n or len({p.shape for p in parts}) != 1:
        raise PlanError(f"cannot split dim {dim} of size {t.shape[dim]} into {n} equal chunks")
    return parts


def collective_result(op: Collective, inputs: Sequence[Value | None], s: Step) -> list[Value | None]:
    """What each participant (in ``s.ranks`` order) holds after collective ``op``."""
    n = len(s.ranks)
    root = s.ranks.index(s.arg("root")) if s.arg("root") is not None else 0
    red = str(s.arg("op", "sum"))
    dim = int(s.arg("dim", 0))
    if op is Collective.ALL_GATHER:
        return [list(inputs) for _ in range(n)]
    if op is Collective.GATHER:
        return [list(inputs) if i == root else None for i in range(n)]
    if op is Collective.ALL_REDUCE:
        total = _reduce_all(inputs, red)
        return [total.clone() for _ in range(n)]
    if op is Collective.REDUCE:
        return [_reduce_all(inputs, red) if i == root else None for i in range(n)]
    if op is Collective.BROADCAST:
        return [clone_value(inputs[root]) for _ in range(n)]
    if op is Collective.SCATTER:
        src = inputs[root]
        parts = src if isinstance(src, list) else _chunks(src, n, dim)
        return [p.clone() for p in parts]
    if op is Collective.REDUCE_SCATTER:
        return [p.clone() for p in _chunks(_reduce_all(inputs, red), n, dim)]
    if op is Collective.ALL_TO_ALL:
        split = [_chunks(v, n, dim) for v in inputs]
        return [[split[j][i].clone() for j in range(n)] for i in range(n)]
    raise PlanError(f"collective {op.value!r} has no live implementation")


def run_collective(op: Collective, s: Step, value: Value | None, out_meta: Value | None,
                   group: dist.ProcessGroup, device: torch.device) -> Value | None:
    """Run collective ``op`` of step ``s`` on ``group``: one call, this rank's part of it.

    ``value`` is this rank's input (``None`` for non-roots of broadcast/scatter),
    ``out_meta`` the shape of its output from the plan's simulation (``None``: no output).
    """
    order = sorted(s.ranks)
    me = dist.get_rank()
    root = s.arg("root")
    red = str(s.arg("op", "sum"))
    dim = int(s.arg("dim", 0))
    n = len(order)

    def empty(m: torch.Tensor) -> torch.Tensor:
        return torch.empty(m.shape, dtype=m.dtype, device=device)

    def in_step_order(by_rank: list[torch.Tensor]) -> list[torch.Tensor]:
        return [by_rank[order.index(r)] for r in s.ranks]

    if op is Collective.ALL_GATHER:
        bufs = [torch.empty_like(value) for _ in range(n)]
        dist.all_gather(bufs, value.contiguous(), group=group)
        return in_step_order(bufs)
    if op is Collective.GATHER:
        bufs = [torch.empty_like(value) for _ in range(n)] if me == root else None
        dist.gather(value.contiguous(), bufs, dst=root, group=group)
        return in_step_order(bufs) if me == root else None
    if op is Collective.ALL_REDUCE:
        out = value.clone()
        dist.all_reduce(out, op=_REDUCE[red], group=group)
        return out
    if op is Collective.REDUCE:
        out = value.clone()
        dist.reduce(out, dst=root, op=_REDUCE[red], group=group)
        return out if me == root else None
    if op is Collective.BROADCAST:
        out = value.clone() if me == root else empty(out_meta)
        dist.broadcast(out, src=root, group=group)
        return out
    if op is Collective.SCATTER:
        out = empty(out_meta)
        parts = None
        if me == root:
            src = value if isinstance(value, list) else _chunks(value, n, dim)
            by_step = {r: p for r, p in zip(s.ranks, src)}
            parts = [by_step[r].contiguous() for r in order]
        dist.scatter(out, parts, src=root, group=group)
        return out
    if op is Collective.REDUCE_SCATTER:
        parts = _chunks(value, n, dim)
        by_step = {r: p for r, p in zip(s.ranks, parts)}
        out = torch.empty_like(by_step[me])
        dist.reduce_scatter(out, [by_step[r].contiguous() for r in order], op=_REDUCE[red], group=group)
        return out
    if op is Collective.ALL_TO_ALL:
        parts = _chunks(value, n, dim)
        by_step = {r: p.contiguous() for r, p in zip(s.ranks, parts)}
        outs = [torch.empty_like(by_step[me]) for _ in range(n)]
        dist.all_to_all(outs, [by_step[r] for r in order], group=group)
        return in_step_order(outs)
    raise PlanError(f"collective {op.value!r} has no live implementation")


# -- local projections ----------------------------------------------------------------------
def project(s: Step, inputs: Sequence[Value], rank: int) -> Value:
    """Apply projection ``s.op`` to this rank's ``inputs``."""
    op = Projection(s.op)
    x = inputs[0] if inputs else None
    if op is Projection.COPY:
        return clone_value(x)
    if op is Projection.CONCAT:
        return torch.cat(_parts(x), dim=int(s.arg("dim", 0)))
    if op is Projection.SUM:
        return _reduce_all(_parts(x), "sum")
    if op is Projection.ARGMAX:
        return torch.argmax(x, dim=-1)
    raise PlanError(f"projection {op.value!r} has no live implementation yet")
