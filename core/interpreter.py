"""Numeric reference interpreter: run any plan on small random tensors over simulated ranks.

:func:`interpret` executes a :class:`~meshpact.core.plan.Plan` step by step with numpy,
keeping every rank's buffers, and returns what each consumer rank observes. Its
semantics are the definition of the plan IR; the live executor mirrors them with
``torch.distributed``. :func:`reference` computes what each consumer *should* observe on
one device, :func:`equivalent` compares under the contract's equivalence, and
:func:`leaks` finds ranks that hold rows they do not own. :func:`judge` bundles them
into a numeric verdict that knows nothing of the symbolic checker.

Semantics of each step (``ranks`` in the order the step lists them; buffers are per
rank). Data keeps the producer's dtype: every sum, max or average of raw values is
rounded to that dtype after each operation (:mod:`meshpact.core.numerics`: float16 in
NumPy's float16, bfloat16 as float32 storage rounded to bfloat16 after every operation,
integers exact); log-softmax statistics and log-probabilities are float32; token ids and
indices are int64. NaN and -inf follow torch: ``argmax`` gives the index of the first NaN
of a row (NaN counts as the largest value), and a row holding NaN, or only -inf, has NaN
log-probabilities.

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
project ``local_max_arg``     ``[rows, 2]`` of (max value, max index + ``offsets[i]``) over the last dim, as
                              int64 pairs for integer logits and float64 pairs otherwise (every float32,
                              bfloat16 or float16 value and every index below 2**53 exact); the first NaN
                              wins as in argmax; an empty shard gives (lowest value, 2**62), which no
                              real entry loses to
project ``combine_max_arg``   ``[rows, 2k]`` pairs -> int64 index of the largest value, lowest index on ties;
                              a row with a NaN pair gives the lowest index among its NaN pairs
project ``logsoftmax_at``     float32 ``log_softmax(x)[row, id[row]]`` computed as :func:`reference_logprob`;
                              ids are the target ids of rows ``row_offsets[i]..`` (default 0)
project ``local_lse_stats``   ``[rows, 3]`` float32 of (max, sum exp(x - max), x at the target id if the
                              id falls in ``[offsets[i], offsets[i] + width)`` else -inf)
project ``combine_lse_stats`` ``[rows, 3k]`` -> ``t - M - log(sum_i s_i exp(m_i - M))`` with ``M = max m_i``,
                              ``t = max t_i``, summed in shard order
project ``topk``              full rows -> float64 ``[rows, 2k]``: the ``args.k`` ids of the largest logits
                              (NaN first, then larger values, lower index on ties), then their float32
                              log-probabilities (:func:`log_softmax_rows`)
project ``token_logprob``     full rows -> float64 ``[rows, 2]``: (argmax id, its log-probability)
project ``local_sample_max_arg`` float64 (max, global index) pairs of a shard's perturbed logits
                              ``x / temperature - log(-log(u))`` (``u`` as in :func:`sample_tokens`, for
                              columns ``offsets[i]..`` and rows ``row_offsets[i]..``); ``combine_max_arg``
                              of every shard's pairs is the sample of the full rows, bitwise
project ``sample``            full rows -> int64 ids: :func:`sample_tokens`, Gumbel-max over
                              ``rows / temperature`` with noise hashed from (seed, global row, column)
(any projection of logits) with ``args.valid``: the columns at and past ``valid`` are padding; full
                              rows are cut to ``valid`` columns, a shard's padding is set to the lowest value
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

from .contract import Contract, Equivalence, Form, Observation
from .region import Region
from .errors import PlanError
from .facts import Consumer, DType
from .numerics import round_to, storage
from .placement import Partial, shard_bounds
from .plan import MASKED_PROJECTIONS, Collective, Plan, Projection, Step, StepKind

_SHARD_LOCAL = frozenset({Projection.LOCAL_MAX_ARG, Projection.LOCAL_SAMPLE_MAX_ARG, Projection.LOCAL_LSE_STATS})

__all__ = [
    "Inputs",
    "Execution",
    "Verdict",
    "make_inputs",
    "interpret",
    "reference",
    "reference_logprob",
    "equivalent",
    "magnitudes",
    "leaks",
    "judge",
    "judge_inputs",
    "local_max_arg",
    "combine_max_arg",
    "log_softmax_rows",
    "topk_logprobs",
    "token_logprob",
    "sample_tokens",
    "fold",
    "native_reduce",
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


NO_INDEX = 2**62  # the index an empty shard reports: larger than any real column, exact in float64


def make_inputs(contract: Contract, seed: int = 0, specials: bool = False) -> Inputs:
    """Small random producer data in the producer's dtype. Logits rows get distinct planted
    argmax ids (when V >= T), and partial addends are large and noisy, so that projecting one
    addend gives a wrong answer. With ``specials`` (floating dtypes), the last row holds a
    NaN, the one before only -inf, and the one before that some -inf entries."""
    prov = contract.provenance
    dtype = prov.dtype
    rng = np.random.default_rng(seed)
    shape = prov.shape
    floating = dtype.is_floating
    if floating:
        value = round_to(rng.standard_normal(shape), dtype)
    else:
        value = rng.integers(-50, 50, size=shape).astype(storage(dtype))
    if len(shape) == 2 and shape[0] <= contract.edge.producer.columns:
        cols = rng.permutation(contract.edge.producer.columns)[: shape[0]]
        rows = np.arange(shape[0])
        value[rows, cols] = round_to(value.max(axis=1) + (3 if floating else 100), dtype)
    ranks = prov.ranks
    n = len(ranks)
    local: dict[int, np.ndarray] = {}
    addends: tuple[np.ndarray, ...] = ()
    columns = contract.edge.producer.columns if len(shape) == 2 else shape[-1]
    ids = rng.integers(0, columns, size=shape[0]).astype(np.int64) if contract.demand.reads_target_ids else None
    if columns < shape[-1]:  # padding holds the largest values: a plan that does not mask it goes wrong
        value[:, columns:] = round_to(np.full((shape[0], shape[-1] - columns), np.abs(value).max() + 10), dtype)
    placement = prov.placement
    if specials and floating and not isinstance(placement, Partial):
        _plant_specials([value], shape, rng)
    if isinstance(placement, Partial):
        op = placement.op
        if op in ("sum", "avg"):
            target = value * n if op == "avg" else value
            parts = [
                round_to(rng.standard_normal(shape) * 4, dtype)
                if floating
                else rng.integers(-50, 50, size=shape).astype(value.dtype)
                for _ in range(n - 1)
            ]
            rest = target.astype(np.float64) if floating else target.copy()
            for a in parts:
                rest = rest - a
            parts.append(round_to(rest, dtype))
        else:
            holder = rng.integers(0, n, size=shape)
            sign = 1 if op == "max" else -1
            parts = []
            for k in range(n):
                gap = np.abs(rng.standard_normal(shape)) * 8 + 0.05 if floating else 1 + rng.integers(0, 40, size=shape)
                parts.append(round_to(np.where(holder == k, value, value - sign * gap), dtype))
        if specials and floating:
            _plant_specials(parts, shape, rng)
        addends = tuple(parts)
        value = fold(list(addends), op, dtype)
        local = {r: a for r, a in zip(ranks, addends)}
    else:
        for h in prov.holdings:  # each rank's region (a 2-D layout's row block and shard included)
            local[h.rank] = region_of(value, h.region).copy()
    return Inputs(value=value, local=local, ids=ids, addends=addends)


def region_of(x: np.ndarray, region: Region) -> np.ndarray:
    """The part of ``x`` a region covers (one interval, or none, per dim)."""
    return x[tuple(slice(iv[0][0], iv[0][1]) if iv else slice(0, 0) for iv in region)]


def _plant_specials(arrays: Sequence[np.ndarray], shape: tuple[int, ...], rng: np.random.Generator) -> None:
    """Write NaN / -inf rows into ``arrays`` (all of them for -inf, the first for NaN), in place."""
    rows = shape[0]
    if rows >= 1:
        arrays[0][rows - 1, ..., int(rng.integers(0, shape[-1]))] = np.nan
    if rows >= 2:
        for a in arrays:
            a[rows - 2] = -np.inf
    if rows >= 3 and shape[-1] >= 2:
        for a in arrays:
            a[rows - 3, ..., : shape[-1] // 2] = -np.inf


def _combine(acc: np.ndarray, a: np.ndarray, op: str, dtype: DType | None) -> np.ndarray:
    if op in ("sum", "avg"):
        out = acc + a
    elif op == "max":
        out = np.maximum(acc, a)
    elif op == "min":
        out = np.minimum(acc, a)
    else:
        raise PlanError(f"unknown reduce op {op!r}; expected sum, max, min or avg")
    return out if dtype is None else round_to(out, dtype)


def fold(arrays: Sequence[np.ndarray], op: str, dtype: DType | None = None) -> np.ndarray:
    """The reference reduction: a left fold in the given order (avg = sum / count), each
    result rounded to ``dtype`` (default: the arrays' own NumPy type)."""
    acc = arrays[0].copy()
    for a in arrays[1:]:
        acc = _combine(acc, a, op, dtype)
    if op == "avg":
        acc = round_to(acc / len(arrays), dtype) if dtype is not None else (acc / len(arrays)).astype(acc.dtype)
    return acc


def native_reduce(arrays: Sequence[np.ndarray], op: str, dtype: DType | None = None) -> np.ndarray:
    """A vendor collective's reduction: ring order per element for sums over >= 3 participants."""
    n = len(arrays)
    shapes = {a.shape for a in arrays}
    if len(shapes) != 1:
        raise PlanError(f"reduction over buffers of different shapes {sorted(shapes)}")
    if op in ("max", "min") or n <= 2 or not np.issubdtype(arrays[0].dtype, np.floating):
        return fold(arrays, op, dtype)
    flat = [a.reshape(-1) for a in arrays]
    out = np.empty_like(flat[0])
    pos = np.arange(flat[0].size) % n
    for s in range(n):
        sel = pos == s
        acc = flat[s][sel].copy()
        for j in range(1, n):
            acc = _combine(acc, flat[(s + j) % n][sel], op, dtype)
        out[sel] = acc
    if op == "avg":
        out = round_to(out / n, dtype) if dtype is not None else (out / n).astype(out.dtype)
    return out.reshape(arrays[0].shape)


def log_softmax_rows(x: np.ndarray) -> np.ndarray:
    """Single-device log-softmax over the last dim in float32 (NaN / all -inf rows give NaN, as torch)."""
    x = x.astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = x.max(axis=-1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=-1, dtype=np.float32))
        return (x - lse[:, None]).astype(np.float32)


def reference_logprob(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Single-device log-softmax over the last dim, read at ``ids``, in float32."""
    x = x.astype(np.float32)
    with np.errstate(invalid="ignore", divide="ignore"):  # NaN / all -inf rows give NaN, as torch does
        m = x.max(axis=-1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(x - m).sum(axis=-1, dtype=np.float32))
        return (x[np.arange(x.shape[0]), ids] - lse).astype(np.float32)


def topk_logprobs(x: np.ndarray, k: int) -> np.ndarray:
    """float64 ``[rows, 2k]``: the ids of the ``k`` largest entries of each row (NaN first, then larger
    values, the lower index on ties), then their log-probabilities."""
    v = x.astype(np.float64)
    nan = np.isnan(v)
    cols = np.broadcast_to(np.arange(v.shape[-1]), v.shape)
    order = np.lexsort((cols, -np.where(nan, 0.0, v), ~nan), axis=-1)[:, :k]
    lp = np.take_along_axis(log_softmax_rows(x), order, axis=-1)
    return np.concatenate([order.astype(np.float64), lp.astype(np.float64)], axis=-1)


def token_logprob(x: np.ndarray) -> np.ndarray:
    """float64 ``[rows, 2]``: each row's argmax id and its log-probability."""
    ids = np.argmax(x, axis=-1)
    lp = log_softmax_rows(x)[np.arange(x.shape[0]), ids]
    return np.stack([ids.astype(np.float64), lp.astype(np.float64)], axis=-1)


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _uniform(seed: int, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """Uniform (0, 1) float64 per (row, column), a splitmix64 hash of (seed, row, column)."""
    with np.errstate(over="ignore"):
        z = (
            np.uint64(seed) * _MIX[0]
            + rows.astype(np.uint64)[:, None] * _MIX[1]
            + cols.astype(np.uint64)[None, :] * _MIX[2]
        )
        z = (z ^ (z >> np.uint64(30))) * _MIX[1]
        z = (z ^ (z >> np.uint64(27))) * _MIX[2]
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def perturbed(x: np.ndarray, seed: int, temperature: float, row_offset: int = 0, col_offset: int = 0) -> np.ndarray:
    """float64 ``x / temperature - log(-log(u))``: the Gumbel-perturbed logits of rows and
    columns starting at the given global offsets."""
    rows = np.arange(x.shape[0]) + row_offset
    gumbel = -np.log(-np.log(_uniform(seed, rows, np.arange(x.shape[-1]) + col_offset)))
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(np.float64) / temperature + gumbel


def sample_tokens(x: np.ndarray, seed: int, temperature: float, row_offset: int = 0) -> np.ndarray:
    """int64 ids sampled from ``softmax(x / temperature)`` per row by the Gumbel-max rule:
    ``argmax(x / temperature - log(-log(u)))`` with ``u`` hashed from (seed, global row, column),
    so the same seed gives the same token wherever the full row is sampled."""
    return np.argmax(perturbed(x, seed, temperature, row_offset), axis=-1).astype(np.int64)


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


def _pair_type(x: np.ndarray) -> type:
    return np.int64 if np.issubdtype(x.dtype, np.integer) else np.float64


def local_max_arg(x: np.ndarray, offset: int) -> np.ndarray:
    """Per-row (max value, global index) pairs of ``x``, int64 or float64 (see the table)."""
    pair = _pair_type(x)
    if x.shape[-1] == 0:
        low = np.iinfo(np.int64).min if pair is np.int64 else -np.inf
        return np.tile(np.array([low, NO_INDEX], pair), (x.shape[0], 1))
    idx = np.argmax(x, axis=-1)  # the first NaN, else the first maximum: torch.argmax's rule
    val = x[np.arange(x.shape[0]), idx].astype(pair)
    return np.stack([val, (idx.astype(np.int64) + offset).astype(pair)], axis=-1)


def combine_max_arg(x: np.ndarray) -> np.ndarray:
    """The int64 winner of each row's gathered pairs: lowest index among NaN pairs if any,
    else lowest index among the largest values."""
    vals, idx = x[:, 0::2], x[:, 1::2].astype(np.int64)
    none = np.iinfo(np.int64).max
    if np.issubdtype(vals.dtype, np.floating):
        nan = np.isnan(vals)
        vals = np.where(nan, -np.inf, vals)
        first_nan = np.where(nan, idx, none).min(axis=1)
    else:
        nan = np.zeros(vals.shape, bool)
        first_nan = np.full(vals.shape[0], none)
    best = vals.max(axis=1, keepdims=True)
    winner = np.where(vals == best, idx, none).min(axis=1)
    return np.where(nan.any(axis=1), first_nan, winner).astype(np.int64)


def mask_padding(x: np.ndarray, offset: int, valid: int) -> np.ndarray:
    """``x`` with its columns at global index ``valid`` and past set to the lowest value."""
    cols = np.arange(x.shape[-1]) + offset
    if not (cols >= valid).any():
        return x
    low = -np.inf if np.issubdtype(x.dtype, np.floating) else np.iinfo(x.dtype).min
    return np.where(cols >= valid, np.asarray(low, x.dtype), x)


def _project(step: Step, i: int, xs: list[np.ndarray], ids: np.ndarray | None, dtype: DType) -> np.ndarray:
    op = Projection(step.op)
    x = xs[0]
    valid = step.arg("valid")
    if valid is not None and op in MASKED_PROJECTIONS:
        if op in _SHARD_LOCAL:  # a shard's columns start at its offset: mask the padding among them
            x = mask_padding(x, int(_per_rank(step, "offsets", i, 0)), int(valid))
        else:  # full rows: the real columns are the first ``valid`` (the same sums as on unpadded logits)
            x = x[..., : int(valid)]
    if op is Projection.ARGMAX:
        return np.argmax(x, axis=-1).astype(np.int64)
    if op is Projection.LOCAL_MAX_ARG:
        return local_max_arg(x, int(_per_rank(step, "offsets", i, 0)))
    if op is Projection.COMBINE_MAX_ARG:
        return combine_max_arg(x)
    if op is Projection.LOGSOFTMAX_AT:
        off = int(_per_rank(step, "row_offsets", i, 0))
        if ids is None:
            raise PlanError("logsoftmax_at needs target ids; the contract's request is not logprob")
        return reference_logprob(x, ids[off : off + x.shape[0]])
    if op is Projection.LOCAL_LSE_STATS:
        if ids is None:
            raise PlanError("local_lse_stats needs target ids; the contract's request is not logprob")
        off = int(_per_rank(step, "offsets", i, 0))
        roff = int(_per_rank(step, "row_offsets", i, 0))
        rid = ids[roff : roff + x.shape[0]] - off
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
        for k in range(m.shape[-1]):
            with np.errstate(invalid="ignore"):
                term = np.where(np.isfinite(m[:, k]), s[:, k] * np.exp(m[:, k] - big), 0).astype(np.float32)
            total = (total + term).astype(np.float32)
        return (t.max(axis=1) - big - np.log(total)).astype(np.float32)
    if op is Projection.LOCAL_SAMPLE_MAX_ARG:
        scores = perturbed(
            x,
            int(step.arg("seed", 0)),
            float(step.arg("temperature", 1.0)),
            int(_per_rank(step, "row_offsets", i, 0)),
            int(_per_rank(step, "offsets", i, 0)),
        )
        return local_max_arg(scores, int(_per_rank(step, "offsets", i, 0)))
    if op is Projection.TOPK:
        return topk_logprobs(x, int(step.arg("k", 1)))
    if op is Projection.TOKEN_LOGPROB:
        return token_logprob(x)
    if op is Projection.SAMPLE:
        return sample_tokens(
            x, int(step.arg("seed", 0)), float(step.arg("temperature", 1.0)), int(_per_rank(step, "row_offsets", i, 0))
        )
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
        return fold(xs, str(step.arg("op", "sum")), dtype if xs[0].dtype == storage(dtype) else None)
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
        except (IndexError, ValueError, TypeError, KeyError) as exc:
            raise PlanError(f"step {k} ({step.op}): cannot run: {exc!r}") from None
    return ex


def _run(k: int, step: Step, contract: Contract, inputs: Inputs, ex: Execution, read: Any, write: Any) -> None:
    mesh = contract.edge.mesh
    dtype = contract.provenance.dtype
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
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):  # NaN/inf as torch gives them
                write(k, r, step.output, _project(step, i, xs, inputs.ids, dtype))
        return
    domains = {mesh.domain_of(r).name for r in step.ranks}
    if len(domains) > 1:
        raise PlanError(f"step {k} ({step.op}): no native communicator spans domains {sorted(domains)}")
    op = Collective(step.op)
    ranks = step.ranks
    name = step.inputs[0]
    root = step.arg("root")
    rooted = op in (Collective.GATHER, Collective.REDUCE, Collective.BROADCAST, Collective.SCATTER)
    if rooted and root not in ranks:
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
    red = dtype if xs and xs[0].dtype == storage(dtype) else None
    if op in (Collective.ALL_GATHER, Collective.GATHER):
        out = np.concatenate(xs, axis=int(step.arg("dim", 0)))
        for r in ranks if op is Collective.ALL_GATHER else (root,):
            write(k, r, step.output, out.copy())
    elif op in (Collective.ALL_REDUCE, Collective.REDUCE):
        out = native_reduce(xs, rop, red)
        for r in ranks if op is Collective.ALL_REDUCE else (root,):
            write(k, r, step.output, out.copy())
    elif op is Collective.REDUCE_SCATTER:
        out = native_reduce(xs, rop, red)
        for i, r in enumerate(ranks):
            write(k, r, step.output, _chunk(out, int(step.arg("dim", 0)), len(ranks), i))
    elif op is Collective.ALL_TO_ALL:
        sd, cd = int(step.arg("split_dim", 0)), int(step.arg("concat_dim", 0))
        for j, r in enumerate(ranks):
            write(k, r, step.output, np.concatenate([_chunk(x, sd, len(ranks), j) for x in xs], axis=cd))


def _observe(
    obs: Observation,
    value: np.ndarray,
    ids: np.ndarray | None,
    consumer: Consumer,
    columns: int,
    magnitude: bool = False,
) -> np.ndarray:
    """What ``obs`` sees of ``value`` (with ``magnitude``: the row-wise error scale of it)."""
    if obs.form is Form.RAW:
        sl = tuple(slice(iv[0][0], iv[0][1]) if iv else slice(0, 0) for iv in obs.region)
        return value[sl]
    rows = [r for a, b in obs.region[0] for r in range(a, b)]
    value = value[:, :columns]  # a padded vocabulary's real columns
    if magnitude:
        row_max = value.max(axis=-1)[rows] if value.shape[-1] else np.zeros(len(rows))
        return np.broadcast_to(row_max[:, None], (len(rows),) + obs.shape[1:]) if len(obs.shape) > 1 else row_max
    if obs.form is Form.TOKEN:
        return np.argmax(value, axis=-1).astype(np.int64)[rows]
    if obs.form is Form.SAMPLE:
        return sample_tokens(value, int(consumer.seed or 0), float(consumer.temperature or 1.0))[rows]
    if obs.form is Form.TOPK:
        return topk_logprobs(value, int(consumer.k or 1))[rows]
    if obs.form is Form.TOKEN_LOGPROB:
        return token_logprob(value)[rows]
    assert ids is not None
    return reference_logprob(value, ids)[rows]


def reference(contract: Contract, inputs: Inputs) -> dict[int, np.ndarray]:
    """What each consumer rank should observe, computed on one device from ``inputs.value``."""
    cons, cols = contract.edge.consumer, contract.edge.producer.columns
    return {obs.rank: _observe(obs, inputs.value, inputs.ids, cons, cols) for obs in contract.demand.observations}


def magnitudes(contract: Contract, inputs: Inputs) -> dict[int, np.ndarray]:
    """Per consumer rank, the magnitude a tolerance scales with (see :class:`Tolerance`):
    the sum of the addends' magnitudes, non-finite entries as 0; per row for log-probabilities."""
    parts = inputs.addends or (inputs.value,)
    total = np.zeros(inputs.value.shape, np.float64)
    for a in parts:
        a64 = np.asarray(a, np.float64)
        total += np.where(np.isfinite(a64), np.abs(a64), 0.0)
    cons, cols = contract.edge.consumer, contract.edge.producer.columns
    return {
        obs.rank: _observe(obs, total, inputs.ids, cons, cols, magnitude=True) for obs in contract.demand.observations
    }


def equivalent(
    observed: np.ndarray | None, expected: np.ndarray, contract: Contract, magnitude: np.ndarray | None = None
) -> Verdict:
    """Compare one observation with the reference under the contract's equivalence.

    NaN equals NaN (both sides follow torch's rules); under a tolerance, non-finite
    reference values must be matched exactly and finite ones within the stated bound.
    """
    if observed is None:
        return Verdict(False, "nothing observed")
    if observed.shape != expected.shape:
        return Verdict(False, f"shape {list(observed.shape)} instead of {list(expected.shape)}")
    sub = contract.substitutability
    floating = np.issubdtype(expected.dtype, np.floating)
    if sub.equivalence is Equivalence.BITWISE or not floating:
        if observed.dtype != expected.dtype or not np.array_equal(observed, expected, equal_nan=floating):
            same = (
                (observed == expected) | (np.isnan(observed) & np.isnan(expected)) if floating else observed == expected
            )
            bad = int(np.sum(~same)) if observed.dtype == expected.dtype else observed.size
            return Verdict(False, f"not bitwise equal ({bad} of {expected.size} elements differ)")
        return Verdict(True, "bitwise equal")
    tol = sub.tolerance
    assert tol is not None
    obs64, exp64 = observed.astype(np.float64), expected.astype(np.float64)
    special = ~np.isfinite(exp64) | ~np.isfinite(obs64)
    if not np.array_equal(obs64[special], exp64[special], equal_nan=True):
        return Verdict(False, f"non-finite values differ ({int(special.sum())} NaN/inf positions)")
    scale = np.zeros_like(exp64) if magnitude is None else np.asarray(magnitude, np.float64)
    bound = tol.atol + tol.rtol * np.abs(exp64) + tol.scaled * scale
    with np.errstate(invalid="ignore"):
        err = np.where(special, 0.0, np.abs(obs64 - exp64))
    if np.any(err > bound):
        worst = int(np.argmax(err - bound))
        return Verdict(
            False,
            f"outside the stated tolerance at {int(np.sum(err > bound))} of {err.size} elements "
            f"(error {err.flat[worst]:.3g} > bound {bound.flat[worst]:.3g}; {tol.why})",
        )
    return Verdict(True, f"within the stated tolerance (rtol={tol.rtol:g}, atol={tol.atol:g}, scaled={tol.scaled:g})")


def leaks(ex: Execution, contract: Contract, inputs: Inputs) -> list[tuple[int, int]]:
    """(rank, row) pairs where a rank outside the owner scope held data of a row it does not own.

    Found numerically: a float buffer that contains any of the row's logits or addends, or
    an integer buffer that contains the row's (planted, distinct) token id where none of the
    rank's own rows has that id.
    """
    auth = contract.authority
    if auth.owner_of_row is None:
        return []
    value = inputs.value
    tokens = np.argmax(value[:, : contract.edge.producer.columns], axis=-1)
    row_values = [
        np.unique(np.concatenate([value[r].astype(np.float64)] + [a[r].astype(np.float64) for a in inputs.addends]))
        for r in range(value.shape[0])
    ]
    found: list[tuple[int, int]] = []
    for rank, items in ex.held.items():
        if rank in auth.unrestricted:
            continue
        foreign = [r for r, o in enumerate(auth.owner_of_row) if o != rank]
        own_tokens = {int(tokens[r]) for r, o in enumerate(auth.owner_of_row) if o == rank}
        for r in foreign:
            for _, _, arr in items:
                if np.issubdtype(arr.dtype, np.integer):
                    # a token id tells only when no own row has the same id
                    hit = int(tokens[r]) not in own_tokens and bool(np.isin(tokens[r], arr))
                else:
                    hit = bool(np.isin(arr.astype(np.float64), row_values[r]).any())
                if hit:
                    found.append((rank, r))
                    break
    return found


def judge(plan: Plan, contract: Contract, seed: int = 0, specials: bool = False) -> Verdict:
    """Numeric ground truth: does ``plan`` give every consumer exactly its demand, and nothing
    to anyone who may not see it? Always a verdict: a plan that cannot run is a wrong plan."""
    inputs = make_inputs(contract, seed, specials)
    return judge_inputs(plan, contract, inputs)


def judge_inputs(plan: Plan, contract: Contract, inputs: Inputs) -> Verdict:
    """:func:`judge` on given producer data."""
    try:
        ex = interpret(plan, contract, inputs)
    except PlanError as exc:
        return Verdict(False, f"cannot execute: {exc}")
    expected = reference(contract, inputs)
    scale = magnitudes(contract, inputs)
    for rank in sorted(ex.observed):
        if rank not in expected:
            why = "a non-owner" if rank in contract.demand.silent else "not a consumer rank"
            return Verdict(False, f"rank {rank} observes data but is {why}")
    for rank, exp in sorted(expected.items()):
        v = equivalent(ex.observed.get(rank), exp, contract, scale[rank])
        if not v.ok:
            return Verdict(False, f"rank {rank}: {v.reason}")
    bad = leaks(ex, contract, inputs)
    if bad:
        rank, row = bad[0]
        return Verdict(False, f"rank {rank} holds data of row {row}, owned by another rank")
    return Verdict(True, "every consumer observes its demand")
