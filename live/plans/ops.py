"""Step ops in torch: the live twin of the numeric reference interpreter's semantics.

Every op here has the meaning that :mod:`meshpact.core.interpreter` gives it (its table is
the definition; argument names, chunk bounds, tie rules and float32 statistics follow it
line by line) and this module carries it out on real tensors and real process groups. A
buffer value is one tensor. The same functions run every rank's part in one process
(:func:`collective_result`), which is how :func:`meshpact.live.plans.executor.simulate` learns every
buffer's shape before a plan runs.

One deliberate difference: the interpreter models a vendor's unspecified reduction order
for sums over three or more ranks; here the vendor's own collective does the reducing.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from meshpact.core.errors import PlanError
from meshpact.core.placement import shard_bounds
from meshpact.core.plan import Collective, Projection, Step

__all__ = [
    "nbytes",
    "fold",
    "chunk",
    "collective_result",
    "chunk_problems",
    "run_collective",
    "project",
    "reference_logprob",
]


def nbytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s elements: what a rank contributes to a call, or sends over a bridge."""
    return t.numel() * t.element_size()


# -- collectives ------------------------------------------------------------------------------
_REDUCE = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def fold(values: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    """The reference reduction: a left fold in the given order (avg = sum / count)."""
    acc = values[0].clone()
    for v in values[1:]:
        if op in ("sum", "avg"):
            acc = acc + v
        elif op == "max":
            acc = torch.maximum(acc, v)
        elif op == "min":
            acc = torch.minimum(acc, v)
        else:
            raise PlanError(f"unknown reduce op {op!r}; expected sum, max, min or avg")
    return (acc / len(values)).to(values[0].dtype) if op == "avg" else acc


def chunk(x: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Chunk ``index`` of ``parts`` along ``dim``, with the plan's ``shard_bounds``."""
    lo, hi = shard_bounds(x.shape[dim], parts, index)
    return x.narrow(dim, lo, hi - lo)


def _held(x: torch.Tensor | None) -> torch.Tensor:
    """A tensor the plan's simulation guarantees is there (an input of every participant, the
    root's of a broadcast or scatter, an output's shape)."""
    assert x is not None, "a participant holds no tensor where the plan's simulation put one"
    return x


def collective_result(op: Collective, inputs: Sequence[torch.Tensor | None], s: Step) -> list[torch.Tensor | None]:
    """What each participant (in ``s.ranks`` order) holds after collective ``op``."""
    n = len(s.ranks)
    root = s.ranks.index(s.arg("root")) if s.arg("root") is not None else 0
    red = str(s.arg("op", "sum"))
    dim = int(s.arg("dim", 0))
    if op in (Collective.ALL_GATHER, Collective.GATHER):
        out = torch.cat([_held(x) for x in inputs], dim=dim)
        return [out.clone() if op is Collective.ALL_GATHER or i == root else None for i in range(n)]
    if op in (Collective.ALL_REDUCE, Collective.REDUCE):
        out = fold([_held(x) for x in inputs], red)
        return [out.clone() if op is Collective.ALL_REDUCE or i == root else None for i in range(n)]
    if op is Collective.BROADCAST:
        return [_held(inputs[root]).clone() for _ in range(n)]
    if op is Collective.SCATTER:
        return [chunk(_held(inputs[root]), dim, n, i).clone() for i in range(n)]
    if op is Collective.REDUCE_SCATTER:
        out = fold([_held(x) for x in inputs], red)
        return [chunk(out, dim, n, i).clone() for i in range(n)]
    if op is Collective.ALL_TO_ALL:
        sd, cd = int(s.arg("split_dim", 0)), int(s.arg("concat_dim", 0))
        return [torch.cat([chunk(_held(x), sd, n, j) for x in inputs], dim=cd) for j in range(n)]
    raise PlanError(f"collective {op.value!r} has no live implementation")


def _equal_parts(parts: Sequence[torch.Tensor], what: str) -> None:
    if len({tuple(p.shape) for p in parts}) > 1:
        raise PlanError(
            f"{what}: chunks of different shapes {[list(p.shape) for p in parts]}; the process-group "
            "backends need equal chunks (choose sizes divisible by the number of ranks)"
        )


def chunk_problems(s: Step, inputs: Sequence[torch.Tensor | None]) -> list[str]:
    """Why collective ``s`` cannot run on a process group with these participant inputs.

    gloo, NCCL and HCCL exchange equal-sized chunks; a plan over uneven shards (which the
    interpreter runs) is refused before any rank makes a call.
    """
    op = Collective(s.op)
    n = len(s.ranks)
    dim = int(s.arg("dim", 0))
    present = [x for x in inputs if x is not None]
    if op in (Collective.ALL_GATHER, Collective.GATHER):
        groups = [present]
    elif op in (Collective.SCATTER, Collective.REDUCE_SCATTER):
        groups = [[chunk(x, dim, n, i) for i in range(n)] for x in present]
    elif op is Collective.ALL_TO_ALL:
        sd = int(s.arg("split_dim", 0))
        groups = [[chunk(x, sd, n, j) for j in range(n)] for x in present]
    else:
        groups = [present]  # reductions and broadcast need one shape on every rank
    out = []
    for parts in groups:
        try:
            _equal_parts(parts, f"{op.value} of {s.inputs[0]!r} over ranks {list(s.ranks)}")
        except PlanError as exc:
            out.append(str(exc))
    return out


def run_collective(
    op: Collective,
    s: Step,
    value: torch.Tensor | None,
    out_shape: torch.Tensor | None,
    group: dist.ProcessGroup,
    device: torch.device,
) -> torch.Tensor | None:
    """Run collective ``op`` of step ``s`` on ``group``: one call, this rank's part of it.

    ``value`` is this rank's input (``None`` for non-roots of broadcast/scatter),
    ``out_shape`` a tensor shaped like its output, from the plan's simulation (``None``: no
    output). Chunks are equal (:func:`chunk_problems` refused the plan otherwise). The
    backend's lists are in group-rank order (ascending global rank); the plan's in
    ``s.ranks`` order.
    """
    order = sorted(s.ranks)
    me = dist.get_rank()
    root = s.arg("root")
    red = str(s.arg("op", "sum"))
    dim = int(s.arg("dim", 0))
    n = len(order)

    def empty(m: torch.Tensor) -> torch.Tensor:
        return torch.empty(m.shape, dtype=m.dtype, device=device)

    def step_order(by_group: list[torch.Tensor]) -> list[torch.Tensor]:
        return [by_group[order.index(r)] for r in s.ranks]

    def group_order(by_step: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [by_step[s.ranks.index(r)].contiguous() for r in order]

    if op in (Collective.ALL_GATHER, Collective.GATHER):
        value = _held(value)
        bufs = [torch.empty_like(value) for _ in range(n)]
        if op is Collective.ALL_GATHER:
            dist.all_gather(bufs, value.contiguous(), group=group)
        else:
            dist.gather(value.contiguous(), bufs if me == root else None, dst=root, group=group)
            if me != root:
                return None
        return torch.cat(step_order(bufs), dim=dim)
    if op in (Collective.ALL_REDUCE, Collective.REDUCE):
        value = _held(value)
        out = value.clone()
        if op is Collective.ALL_REDUCE:
            dist.all_reduce(out, op=_REDUCE[red], group=group)
        else:
            dist.reduce(out, dst=root, op=_REDUCE[red], group=group)
            if me != root:
                return None
        return (out / n).to(value.dtype) if red == "avg" else out
    if op is Collective.BROADCAST:
        out = _held(value).clone() if me == root else empty(_held(out_shape))
        dist.broadcast(out, src=root, group=group)
        return out
    if op is Collective.SCATTER:
        out = empty(_held(out_shape))
        parts = None
        if me == root:
            parts = group_order([chunk(_held(value), dim, n, i) for i in range(n)])
        dist.scatter(out, parts, src=root, group=group)
        return out
    if op is Collective.REDUCE_SCATTER:
        value = _held(value)
        parts = group_order([chunk(value, dim, n, i) for i in range(n)])
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, op=_REDUCE[red], group=group)
        return (out / n).to(value.dtype) if red == "avg" else out
    if op is Collective.ALL_TO_ALL:
        sd, cd = int(s.arg("split_dim", 0)), int(s.arg("concat_dim", 0))
        parts = group_order([chunk(_held(value), sd, n, j) for j in range(n)])
        outs = [torch.empty_like(parts[0]) for _ in range(n)]
        dist.all_to_all(outs, parts, group=group)
        return torch.cat(step_order(outs), dim=cd)
    raise PlanError(f"collective {op.value!r} has no live implementation")


# -- local projections ----------------------------------------------------------------------
def reference_logprob(x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Single-device log-softmax over the last dim, read at ``ids``, in float32."""
    x = x.float()
    m = x.max(dim=-1, keepdim=True).values
    lse = m[:, 0] + torch.log(torch.exp(x - m).sum(dim=-1))
    return x[torch.arange(x.shape[0], device=x.device), ids.to(x.device)] - lse


def _per_rank(s: Step, name: str, i: int, default: Any = None) -> Any:
    value = s.arg(name)
    if value is None:
        return default
    if not isinstance(value, tuple) or len(value) != len(s.ranks):
        raise PlanError(f"{s.op}: args.{name} must list one entry per participant ({len(s.ranks)})")
    return value[i]


def project(s: Step, xs: Sequence[torch.Tensor], rank: int, ids: torch.Tensor | None) -> torch.Tensor:
    """Apply projection ``s.op`` on ``rank`` (participant ``s.ranks.index(rank)``) to ``xs``."""
    op = Projection(s.op)
    i = s.ranks.index(rank)
    x = xs[0]
    f32 = torch.float32
    if op is Projection.ARGMAX:
        return torch.argmax(x, dim=-1)
    if op is Projection.LOCAL_MAX_ARG:  # pairs as meshpact.core.interpreter.local_max_arg makes them
        pair = torch.float64 if x.is_floating_point() else torch.int64
        if x.shape[-1] == 0:
            low = -float("inf") if pair is torch.float64 else torch.iinfo(torch.int64).min
            return torch.tensor([low, 2**62], dtype=pair, device=x.device).repeat(x.shape[0], 1)
        idx = torch.argmax(x, dim=-1)  # the first NaN, else the first maximum
        val = x.gather(1, idx[:, None])[:, 0]
        return torch.stack([val.to(pair), (idx + int(_per_rank(s, "offsets", i, 0))).to(pair)], dim=-1)
    if op is Projection.COMBINE_MAX_ARG:  # as meshpact.core.interpreter.combine_max_arg
        vals, idx = x[:, 0::2], x[:, 1::2].to(torch.int64)
        none = torch.full_like(idx, torch.iinfo(torch.int64).max)
        nan = torch.isnan(vals) if vals.is_floating_point() else torch.zeros_like(idx, dtype=torch.bool)
        vals = torch.where(nan, torch.full_like(vals, -float("inf")), vals) if vals.is_floating_point() else vals
        first_nan = torch.where(nan, idx, none).min(dim=1).values
        winner = torch.where(vals == vals.max(dim=1, keepdim=True).values, idx, none).min(dim=1).values
        return torch.where(nan.any(dim=1), first_nan, winner)
    if op is Projection.LOGSOFTMAX_AT:
        off = int(_per_rank(s, "row_offsets", i, 0))
        if ids is None:
            raise PlanError("logsoftmax_at needs target ids; the contract's request is not logprob")
        return reference_logprob(x, ids[off : off + x.shape[0]])
    if op is Projection.LOCAL_LSE_STATS:
        if ids is None:
            raise PlanError("local_lse_stats needs target ids; the contract's request is not logprob")
        off = int(_per_rank(s, "offsets", i, 0))
        roff = int(_per_rank(s, "row_offsets", i, 0))
        rid = ids[roff : roff + x.shape[0]].to(x.device) - off
        x = x.to(f32)
        if x.shape[-1] == 0:
            m = torch.full((x.shape[0],), -float("inf"), dtype=f32, device=x.device)
            sexp = torch.zeros(x.shape[0], dtype=f32, device=x.device)
        else:
            m = x.max(dim=-1).values
            sexp = torch.exp(x - m[:, None]).sum(dim=-1)
        inside = (rid >= 0) & (rid < x.shape[-1])
        t = torch.where(
            inside,
            x.gather(1, rid.clamp(0, max(x.shape[-1] - 1, 0))[:, None])[:, 0] if x.shape[-1] else m,
            torch.full_like(m, -float("inf")),
        )
        return torch.stack([m, sexp, t], dim=-1)
    if op is Projection.COMBINE_LSE_STATS:
        m, sexp, t = x[:, 0::3], x[:, 1::3], x[:, 2::3]
        big = m.max(dim=1).values
        total = torch.zeros(x.shape[0], dtype=f32, device=x.device)
        for k in range(m.shape[1]):
            term = torch.where(torch.isfinite(m[:, k]), sexp[:, k] * torch.exp(m[:, k] - big), torch.zeros_like(big))
            total = total + term
        return t.max(dim=1).values - big - torch.log(total)
    if op is Projection.SLICE:
        dim = int(s.arg("dim", 0))
        index = _per_rank(s, "index", i)
        if index is not None:
            return x.index_select(dim, torch.tensor(list(index), dtype=torch.int64, device=x.device))
        bounds = _per_rank(s, "bounds", i)
        lo, hi = bounds if bounds is not None else (s.arg("start"), s.arg("stop"))
        if lo is None or hi is None:
            raise PlanError("slice needs args start/stop, bounds or index")
        return x.narrow(dim, int(lo), int(hi) - int(lo)).clone()
    if op is Projection.CHUNK:
        return chunk(x, int(s.arg("dim", 0)), int(s.arg("parts")), int(_per_rank(s, "index", i))).clone()
    if op is Projection.SUM:
        parts = s.arg("parts")
        if parts is not None and len(xs) == 1:
            xs = [chunk(x, int(s.arg("dim", 0)), int(parts), k) for k in range(int(parts))]
        return fold(xs, str(s.arg("op", "sum")))
    if op is Projection.CONCAT:
        return torch.cat(list(xs), dim=int(s.arg("dim", 0)))
    return x.clone()
