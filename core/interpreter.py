"""Numeric reference interpreter: run any plan on small random tensors over simulated ranks.

:func:`interpret` executes a :class:`~meshpact.core.plan.Plan` step by step with numpy,
keeping every rank's buffers, and returns what each consumer rank observes. Its
semantics are the definition of the plan IR; the live executor mirrors them with
``torch.distributed``. :func:`reference` computes what each consumer *should* observe on
one device, :func:`equivalent` compares under the contract's equivalence, and
:func:`leaks` finds ranks that hold rows they do not own. :func:`judge` bundles them
into a numeric verdict that knows nothing of the symbolic checker.

Semantics of each step (``ranks`` in the order the step lists them; buffers are per
rank; floating data is float32, token ids int64):

============================  =====================================================================
step                          effect
============================  =====================================================================
collective ``all_gather``     every participant gets ``concat([x[r] for r in ranks], dim)``
collective ``gather``         ``args.root`` gets the same concatenation; others get nothing
collective ``all_reduce``     every participant gets ``native_reduce([x[r] ...], op)``
collective ``reduce``         ``args.root`` gets ``native_reduce``
collective ``reduce_scatter`` participant *i* gets chunk *i* (``shard_bounds``) along ``dim`` of ``native_reduce``
collective ``broadcast``      every participant gets the root's ``x`` (only the root needs ``x``)
collective ``scatter``        participant *i* gets chunk *i* along ``dim`` of the root's ``x``
collective ``all_to_all``     participant *j* gets ``concat([chunk_j(x[r], split_dim) for r], concat_dim)``
``send`` (src, dst)           ``dst.output = src.inputs[0]`` (a host-staged bridge message)
project ``argmax``            int64 index of the max along the last dim, lowest index on ties
project ``local_max_arg``     float32 ``[rows, 2]`` of (max value, max index + ``offsets[i]``) over the last
                              dim (indices are exact in float32 below 2**24); an empty shard gives (-inf, -1)
project ``combine_max_arg``   ``[rows, 2k]`` pairs -> int64 index of the largest value, lowest index on ties
project ``logsoftmax_at``     float32 ``log_softmax(x)[row, id[row]]`` computed as :func:`reference_logprob`;
                              ids are the target ids of rows ``row_offsets[i]..`` (default 0)
project ``local_lse_stats``   ``[rows, 3]`` float32 of (max, sum exp(x - max), x at the target id if the
                              id falls in ``[offsets[i], offsets[i] + width)`` else -inf)
project ``combine_lse_stats`` ``[rows, 3k]`` -> ``t - M - log(sum_i s_i exp(m_i - M))`` with ``M = max m_i``,
                              ``t = max t_i``, summed in shard order
project ``slice``             along ``dim``: ``start:stop``, or per rank ``bounds[i]`` or ``index[i]`` (a list)
project ``chunk``             along ``dim``: chunk ``index[i]`` of ``parts``
project ``sum``               left fold of the inputs in order with ``op`` (sum, max, min, avg = sum/count);
                              a single input with ``parts`` is first split into that many chunks along ``dim``
project ``concat``            ``concat(inputs, dim)``
project ``copy``              ``output = inputs[0]``
``deliver``                   the consumer on each rank observes a copy of ``inputs[0]``
============================  =====================================================================

``native_reduce`` stands for a vendor collective whose reduction order is unspecified.
For ``sum``/``avg`` over three or more participants it adds element *e* starting at
participant ``e mod n`` and going round the ring, so its result differs in the last bits
from the reference left fold, as real ring all-reduces do; over one or two participants,
and for ``max``/``min``, it is exact. A collective whose participants span two native
domains cannot run (no native communicator covers them): :class:`~meshpact.core.errors.PlanError`.
A step that reads a buffer its rank does not hold raises the same error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from .contract import Contract, Equivalence, Form
from .errors import PlanError
from .placement import Partial, Shard, shard_bounds
from .plan import Collective, Plan, Projection, Step, StepKind

__all__ = [
    "Inputs",
    "Execution",
    "Verdict",
    "make_inputs",
    "interpret",
    "reference",
    "reference_logprob",
    "equivalent",
    "leaks",
    "judge",
]


@dataclass(frozen=True)
class Inputs:
    """Random producer data for one contract: the value, each rank's local tensor, target ids."""

    value: np.ndarray  # what a single device would hold (the reduction of the addends, for Partial)
    local: Mapping[int, np.ndarray]
    ids: np.ndarray | None  # target id per row (logprob requests)
    addends: tuple[np.ndarray, ...] = ()


@dataclass
class Execution:
    """The outcome of running a plan: observations and every rank's buffers."""

    observed: dict[int, np.ndarray] = field(default_factory=dict)
    buffers: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    held: dict[int, list[tuple[int, str, np.ndarray]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str


def _float(dtype: Any) -> bool:
    return getattr(dtype, "is_floating", True)


def make_inputs(contract: Contract, seed: int = 0) -> Inputs:
    """Small random producer data. Logits rows get distinct planted argmax ids (when V >= T),
    and partial addends are large and noisy, so that projecting one addend gives a wrong answer."""
    prov = contract.provenance
    rng = np.random.default_rng(seed)
    shape = prov.shape
    floating = _float(prov.dtype)
    if floating:
        value = rng.standard_normal(shape).astype(np.float32)
    else:
        value = rng.integers(-50, 50, size=shape).astype(np.int64)
    if len(shape) == 2 and shape[0] <= shape[1]:
        cols = rng.permutation(shape[1])[: shape[0]]
        rows = np.arange(shape[0])
        value[rows, cols] = value.max(axis=1) + (3 if floating else 100)
    ranks = prov.ranks
    n = len(ranks)
    local: dict[int, np.ndarray] = {}
    addends: tuple[np.ndarray, ...] = ()
    ids = rng.integers(0, shape[-1], size=shape[0]).astype(np.int64) if contract.demand.reads_target_ids else None
    placement = prov.placement
    if isinstance(placement, Partial):
        op = placement.op
        if op in ("sum", "avg"):
            target = value * n if op == "avg" else value
            parts = [(rng.standard_normal(shape) * 4).astype(value.dtype) if floating
                     else rng.integers(-50, 50, size=shape).astype(np.int64) for _ in range(n - 1)]
            rest = target.copy()
            for a in parts:
                rest = rest - a
            parts.append(rest.astype(value.dtype))
        else:
            holder = rng.integers(0, n, size=shape)
            sign = 1 if op == "max" else -1
            parts = []
            for k in range(n):
                gap = (np.abs(rng.standard_normal(shape)) * 8 + 0.05).astype(value.dtype) if floating else 1 + rng.integers(0, 40, size=shape)
                parts.append(np.where(holder == k, value, value - sign * gap).astype(value.dtype))
        addends = tuple(parts)
        value = fold(list(addends), op)
        local = {r: a for r, a in zip(ranks, addends)}
    else:
        for i, r in enumerate(ranks):
            if isinstance(placement, Shard):
                d = placement.dim
                lo, hi = shard_bounds(shape[d], n, i)
                local[r] = np.take(value, range(lo, hi), axis=d)
            else:
                local[r] = value.copy()
    return Inputs(value=value, local=local, ids=ids, addends=addends)


def fold(arrays: Sequence[np.ndarray], op: str) -> np.ndarray:
    """The reference reduction: a left fold in the given order (avg = sum / count)."""
    acc = arrays[0].copy()
    for a in arrays[1:]:
        if op in ("sum", "avg"):
            acc = acc + a
        elif op == "max":
            acc = np.maximum(acc, a)
        elif op == "min":
            acc = np.minimum(acc, a)
        else:
            raise PlanError(f"unknown reduce op {op!r}; expected sum, max, min or avg")
    if op == "avg":
        acc = (acc / len(arrays)).astype(arrays[0].dtype)
    return acc


def native_reduce(arrays: Sequence[np.ndarray], op: str) -> np.ndarray:
    """A vendor collective's reduction: ring order per element for sums over >= 3 participants."""
    n = len(arrays)
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise PlanError(f"reduction over buffers of different shapes {sorted(shapes)}")
    if op in ("max", "min") or n <= 2 or not np.issubdtype(arrays[0].dtype, np.floating):
        return fold(arrays, op)
    flat = [a.reshape(-1) for a in arrays]
    out = np.empty_like(flat[0])
    pos = np.arange(flat[0].size) % n
    for s in range(n):
        sel = pos == s
        acc = flat[s][sel].copy()
        for j in range(1, n):
            acc = acc + flat[(s + j) % n][sel]
        out[sel] = acc
    if op == "avg":
        out = (out / n).astype(arrays[0].dtype)
    return out.reshape(arrays[0].shape)


def reference_logprob(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Single-device log-softmax over the last dim, read at ``ids``, in float32."""
    x = x.astype(np.float32)
    m = x.max(axis=-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=-1, dtype=np.float32))
    return (x[np.arange(x.shape[0]), ids] - lse).astype(np.float32)


def _chunk(x: np.ndarray, dim: int, parts: int, index: int) -> np.ndarray:
    lo, hi = shard_bounds(x.shape[dim], parts, index)
    return np.take(x, range(lo, hi), axis=dim)


def _per_rank(step: Step, name: str, i: int, default: Any = None) -> Any:
    value = step.arg(name)
    if value is None:
        return default
    if not isinstance(value, tuple) or len(value) != len(step.ranks):
        raise PlanError(f"{step.op}: args.{name} must list one entry per participant ({len(step.ranks)})")
    return value[i]


def _project(step: Step, i: int, xs: list[np.ndarray], ids: np.ndarray | None) -> np.ndarray:
    op = Projection(step.op)
    x = xs[0]
    if op is Projection.ARGMAX:
        return np.argmax(x, axis=-1).astype(np.int64)
    if op is Projection.LOCAL_MAX_ARG:
        off = int(_per_rank(step, "offsets", i, 0))
        if x.shape[-1] == 0:
            return np.tile(np.array([-np.inf, -1.0], np.float32), (x.shape[0], 1))
        idx = np.argmax(x, axis=-1)
        val = x[np.arange(x.shape[0]), idx].astype(np.float32)
        return np.stack([val, (idx + off).astype(np.float32)], axis=-1)
    if op is Projection.COMBINE_MAX_ARG:
        vals, idx = x[:, 0::2], x[:, 1::2]
        best = vals.max(axis=1, keepdims=True)
        cand = np.where(vals == best, idx, np.inf)
        return cand.min(axis=1).astype(np.int64)
    if op is Projection.LOGSOFTMAX_AT:
        off = int(_per_rank(step, "row_offsets", i, 0))
        if ids is None:
            raise PlanError("logsoftmax_at needs target ids; the contract's request is not logprob")
        return reference_logprob(x, ids[off: off + x.shape[0]])
    if op is Projection.LOCAL_LSE_STATS:
        if ids is None:
            raise PlanError("local_lse_stats needs target ids; the contract's request is not logprob")
        off = int(_per_rank(step, "offsets", i, 0))
        roff = int(_per_rank(step, "row_offsets", i, 0))
        rid = ids[roff: roff + x.shape[0]] - off
        x = x.astype(np.float32)
        if x.shape[-1] == 0:
            m = np.full(x.shape[0], -np.inf, np.float32)
            s = np.zeros(x.shape[0], np.float32)
        else:
            m = x.max(axis=-1)
            s = np.exp(x - m[:, None]).sum(axis=-1, dtype=np.float32)
        inside = (rid >= 0) & (rid < x.shape[-1])
        t = np.full(x.shape[0], -np.inf, np.float32)
        t[inside] = x[np.nonzero(inside)[0], rid[inside]]
        return np.stack([m, s, t], axis=-1).astype(np.float32)
    if op is Projection.COMBINE_LSE_STATS:
        m, s, t = x[:, 0::3], x[:, 1::3], x[:, 2::3]
        big = m.max(axis=1)
        total = np.zeros(x.shape[0], np.float32)
        for k in range(m.shape[1]):
            with np.errstate(invalid="ignore"):
                term = np.where(np.isfinite(m[:, k]), s[:, k] * np.exp(m[:, k] - big), 0).astype(np.float32)
            total = (total + term).astype(np.float32)
        return (t.max(axis=1) - big - np.log(total)).astype(np.float32)
    if op is Projection.SLICE:
        dim = int(step.arg("dim", 0))
        index = _per_rank(step, "index", i)
        if index is not None:
            return np.take(x, list(index), axis=dim)
        bounds = _per_rank(step, "bounds", i)
        lo, hi = bounds if bounds is not None else (step.arg("start"), step.arg("stop"))
        if lo is None or hi is None:
            raise PlanError("slice needs args start/stop, bounds or index")
        return np.take(x, range(int(lo), int(hi)), axis=dim)
    if op is Projection.CHUNK:
        return _chunk(x, int(step.arg("dim", 0)), int(step.arg("parts")), int(_per_rank(step, "index", i)))
    if op is Projection.SUM:
        parts = step.arg("parts")
        if parts is not None and len(xs) == 1:
            xs = [_chunk(x, int(step.arg("dim", 0)), int(parts), k) for k in range(int(parts))]
        return fold(xs, str(step.arg("op", "sum")))
    if op is Projection.CONCAT:
        return np.concatenate(xs, axis=int(step.arg("dim", 0)))
    return x.copy()


def interpret(plan: Plan, contract: Contract, inputs: Inputs | None = None, seed: int = 0) -> Execution:
    """Execute ``plan`` numerically; raise :class:`PlanError` for a step that cannot run."""
    inputs = inputs or make_inputs(contract, seed)
    mesh = contract.edge.mesh
    ex = Execution()
    tensor = contract.provenance.tensor
    for r in mesh.ranks:
        ex.buffers[r] = {}
        ex.held[r] = []
    for r, a in inputs.local.items():
        ex.buffers[r][tensor] = a

    def read(k: int, step: Step, rank: int, name: str) -> np.ndarray:
        try:
            return ex.buffers[rank][name]
        except KeyError:
            raise PlanError(f"step {k} ({step.op}): rank {rank} holds no buffer {name!r}") from None

    def write(k: int, rank: int, name: str, value: np.ndarray) -> None:
        ex.buffers[rank][name] = value
        ex.held[rank].append((k, name, value))

    for k, step in enumerate(plan.steps):
        try:
            _run(k, step, contract, inputs, ex, read, write)
        except (IndexError, ValueError, TypeError) as exc:
            raise PlanError(f"step {k} ({step.op}): cannot run: {exc}") from None
    return ex


def _run(k, step, contract, inputs, ex, read, write) -> None:
    mesh = contract.edge.mesh
    if step.kind is StepKind.SEND:
        src, dst = step.ranks
        write(k, dst, step.output, read(k, step, src, step.inputs[0]).copy())
        return
    if step.kind is StepKind.DELIVER:
        for r in step.ranks:
            ex.observed[r] = read(k, step, r, step.inputs[0]).copy()
        return
    if step.kind is StepKind.PROJECT:
        for i, r in enumerate(step.ranks):
            xs = [read(k, step, r, n) for n in step.inputs]
            write(k, r, step.output, _project(step, i, xs, inputs.ids))
        return
    domains = {mesh.domain_of(r).name for r in step.ranks}
    if len(domains) > 1:
        raise PlanError(f"step {k} ({step.op}): no native communicator spans domains {sorted(domains)}")
    op = Collective(step.op)
    ranks = step.ranks
    name = step.inputs[0]
    root = step.arg("root")
    if root is not None and root not in ranks:
        raise PlanError(f"step {k} ({step.op}): root {root} is not a participant {list(ranks)}")
    if op is Collective.BROADCAST:
        x = read(k, step, root, name)
        for r in ranks:
            write(k, r, step.output, x.copy())
        return
    if op is Collective.SCATTER:
        x = read(k, step, root, name)
        for i, r in enumerate(ranks):
            write(k, r, step.output, _chunk(x, int(step.arg("dim", 0)), len(ranks), i))
        return
    xs = [read(k, step, r, name) for r in ranks]
    rop = str(step.arg("op", "sum"))
    if op in (Collective.ALL_GATHER, Collective.GATHER):
        out = np.concatenate(xs, axis=int(step.arg("dim", 0)))
        for r in ranks if op is Collective.ALL_GATHER else (root,):
            write(k, r, step.output, out.copy())
    elif op in (Collective.ALL_REDUCE, Collective.REDUCE):
        out = native_reduce(xs, rop)
        for r in ranks if op is Collective.ALL_REDUCE else (root,):
            write(k, r, step.output, out.copy())
    elif op is Collective.REDUCE_SCATTER:
        out = native_reduce(xs, rop)
        for i, r in enumerate(ranks):
            write(k, r, step.output, _chunk(out, int(step.arg("dim", 0)), len(ranks), i))
    elif op is Collective.ALL_TO_ALL:
        sd, cd = int(step.arg("split_dim", 0)), int(step.arg("concat_dim", 0))
        for j, r in enumerate(ranks):
            write(k, r, step.output, np.concatenate([_chunk(x, sd, len(ranks), j) for x in xs], axis=cd))


def reference(contract: Contract, inputs: Inputs) -> dict[int, np.ndarray]:
    """What each consumer rank should observe, computed on one device from ``inputs.value``."""
    value = inputs.value
    out: dict[int, np.ndarray] = {}
    for obs in contract.demand.observations:
        if obs.form is Form.RAW:
            sl = tuple(slice(iv[0][0], iv[0][1]) if iv else slice(0, 0) for iv in obs.region)
            out[obs.rank] = value[sl]
        elif obs.form is Form.TOKEN:
            rows = [r for a, b in obs.region[0] for r in range(a, b)]
            out[obs.rank] = np.argmax(value, axis=-1).astype(np.int64)[rows]
        elif obs.form is Form.LOGPROB:
            out[obs.rank] = reference_logprob(value, inputs.ids)
    return out


def equivalent(observed: np.ndarray | None, expected: np.ndarray, contract: Contract) -> Verdict:
    """Compare one observation with the reference under the contract's equivalence."""
    if observed is None:
        return Verdict(False, "nothing observed")
    if observed.shape != expected.shape:
        return Verdict(False, f"shape {list(observed.shape)} instead of {list(expected.shape)}")
    sub = contract.substitutability
    if sub.equivalence is Equivalence.BITWISE or not np.issubdtype(expected.dtype, np.floating):
        if observed.dtype != expected.dtype or not np.array_equal(observed, expected):
            bad = int(np.sum(observed != expected)) if observed.dtype == expected.dtype else observed.size
            return Verdict(False, f"not bitwise equal ({bad} of {expected.size} elements differ)")
        return Verdict(True, "bitwise equal")
    tol = sub.tolerance
    assert tol is not None
    if not np.allclose(observed, expected, rtol=tol.rtol, atol=tol.atol):
        err = float(np.max(np.abs(observed.astype(np.float64) - expected)))
        return Verdict(False, f"outside rtol={tol.rtol}, atol={tol.atol} (max abs error {err:.3g})")
    return Verdict(True, f"within rtol={tol.rtol}, atol={tol.atol}")


def leaks(ex: Execution, contract: Contract, inputs: Inputs) -> list[tuple[int, int]]:
    """(rank, row) pairs where a rank outside the owner scope held data of a row it does not own.

    Found numerically: a float buffer that contains any of the row's logits or addends, or
    an integer buffer that contains the row's (planted, distinct) token id.
    """
    auth = contract.authority
    if auth.owner_of_row is None:
        return []
    value = inputs.value
    tokens = np.argmax(value, axis=-1)
    row_values = [np.unique(np.concatenate([value[r].astype(np.float64)] +
                                           [a[r].astype(np.float64) for a in inputs.addends]))
                  for r in range(value.shape[0])]
    found: list[tuple[int, int]] = []
    for rank, items in ex.held.items():
        if rank in auth.unrestricted:
            continue
        foreign = [r for r, o in enumerate(auth.owner_of_row) if o != rank]
        for r in foreign:
            for _, _, arr in items:
                if np.issubdtype(arr.dtype, np.integer):
                    hit = bool(np.isin(tokens[r], arr))
                else:
                    hit = bool(np.isin(arr.astype(np.float64), row_values[r]).any())
                if hit:
                    found.append((rank, r))
                    break
    return found


def judge(plan: Plan, contract: Contract, seed: int = 0) -> Verdict:
    """Numeric ground truth: does ``plan`` give every consumer exactly its demand, and nothing
    to anyone who may not see it?"""
    inputs = make_inputs(contract, seed)
    try:
        ex = interpret(plan, contract, inputs)
    except PlanError as exc:
        return Verdict(False, f"cannot execute: {exc}")
    expected = reference(contract, inputs)
    for rank in sorted(ex.observed):
        if rank not in expected:
            why = "a non-owner" if rank in contract.demand.silent else "not a consumer rank"
            return Verdict(False, f"rank {rank} observes data but is {why}")
    for rank, exp in sorted(expected.items()):
        v = equivalent(ex.observed.get(rank), exp, contract)
        if not v.ok:
            return Verdict(False, f"rank {rank}: {v.reason}")
    bad = leaks(ex, contract, inputs)
    if bad:
        rank, row = bad[0]
        return Verdict(False, f"rank {rank} holds data of row {row}, owned by another rank")
    return Verdict(True, "every consumer observes its demand")

