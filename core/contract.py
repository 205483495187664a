"""Contracts: what a remote consumer must observe, compiled from the facts of one edge.

:func:`compile_contract` is the one place where facts become obligations. A
:class:`Contract` has six facets, each a typed value: *provenance* (which producer op,
tensor and region every rank holds, and in what reduction state), *substitutability*
(what may stand in for the raw tensor and under which equivalence), *completion* (what
must be finished before the consumer reads), *authority* (the single authoritative
sender of each piece, and who may observe owner-scoped rows), *demand* (exactly what
each consumer rank observes) and *native-domain locality* (where native collectives may
run and where a bridge hop is required). The lowerer, the checker, the interpreter and
the live executor all read the same contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from enum import Enum
from typing import Any

from .errors import FactError
from .facts import DType, Edge, LinkClass, Request
from .numerics import smallest_subnormal, unit_roundoff
from .placement import Partial, Placement, Shard
from .region import Intervals, Region, chunk_region, full_region, intervals_from_indices, region_text

__all__ = [
    "Form",
    "Equivalence",
    "Tolerance",
    "Holding",
    "Provenance",
    "Substitute",
    "Substitutability",
    "Completion",
    "Authority",
    "Observation",
    "Demand",
    "Locality",
    "Contract",
    "compile_contract",
    "REQUEST_FORM",
    "tolerance_for",
    "reduction_tolerance",
    "logsoftmax_tolerance",
]


class Form(str, Enum):
    """The form a piece of data takes (raw values or a projection of them)."""

    RAW = "raw"  # the tensor's values
    MAX_ARG = "max_arg"  # per-row (max, global index) over a column range
    SAMPLE_ARG = "sample_arg"  # per-row (max of the Gumbel-perturbed logits, global index) over a column range
    LSE_STATS = "lse_stats"  # per-row (max, sum of exp, target logit) over a column range
    TOKEN = "token"  # per-row argmax ids
    LOGPROB = "logprob"  # per-row log-probability at the target id
    TOPK = "topk"  # per-row k ids and their log-probabilities, packed as float64 [ids..., logprobs...]
    TOKEN_LOGPROB = "token_logprob"  # per-row (argmax id, its log-probability) as float64
    SAMPLE = "sample"  # per-row token sampled with the consumer's seed and temperature
    GARBAGE = "garbage"  # values that mean nothing (wrong combination of pieces)


class Equivalence(str, Enum):
    BITWISE = "bitwise"
    TOLERANCE = "tolerance"


@dataclass(frozen=True)
class Tolerance:
    """``|observed - reference| <= atol + rtol * |reference| + scaled * magnitude`` elementwise.

    ``magnitude`` is what rounding errors are proportional to: at each element the sum of
    the partial addends' magnitudes (the value's magnitude for a complete producer),
    non-finite entries counted as 0; with ``per_row``, the largest such magnitude in the
    element's row (a log-probability depends on the whole row). Non-finite reference
    values (NaN, ±inf) must be matched exactly. ``rtol``/``atol`` are a floor scaled from
    ``torch.testing.assert_close``'s defaults; ``scaled`` is derived from the dtype's unit
    roundoff and the number of addends (:func:`reduction_tolerance`,
    :func:`logsoftmax_tolerance`), and ``why`` says how.
    """

    rtol: float
    atol: float
    why: str
    scaled: float = 0.0
    per_row: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"rtol": self.rtol, "atol": self.atol, "scaled": self.scaled, "per_row": self.per_row, "why": self.why}


@lru_cache(maxsize=1024)
def tolerance_for(dtype: DType, why: str) -> Tolerance:
    """The floor tolerance of a floating-point result carried out in ``dtype``.

    Scaled from ``torch.testing.assert_close``'s defaults (float32 rtol 1.3e-6, bfloat16
    rtol 1.6e-2, float16 rtol 1e-3); it covers the last rounding of a division or a log.
    """
    rtol, atol = {
        DType.FLOAT32: (1e-5, 1e-4),
        DType.BFLOAT16: (1.6e-2, 1e-2),
        DType.FLOAT16: (1e-3, 1e-3),
    }.get(dtype, (0.0, 0.0))
    return Tolerance(rtol=rtol, atol=atol, why=why)


@lru_cache(maxsize=1024)
def reduction_tolerance(dtype: DType, addends: int, why: str) -> Tolerance:
    """A sum of ``addends`` values in ``dtype`` in an unspecified order.

    Any order of a floating sum of ``n`` addends is within ``(n - 1) u sum|a_i|`` of the
    exact sum (``u`` the unit roundoff), so two orders differ by at most twice that; the
    bound used is ``2 n u`` times the addends' magnitude, plus the dtype's floor.
    """
    floor = tolerance_for(dtype, why)
    u = unit_roundoff(dtype)
    return Tolerance(
        floor.rtol,
        floor.atol + 2 * addends * smallest_subnormal(dtype),
        f"{why}; |error| <= 2·{addends}·u·sum|addends| with u = {u:.3g} ({dtype.value})",
        scaled=2 * addends * u,
    )


@lru_cache(maxsize=1024)
def logsoftmax_tolerance(vocab: int, why: str, dtype: DType = DType.FLOAT32, addends: int = 0) -> Tolerance:
    """A log-probability over ``vocab`` columns computed in float32 in another order.

    Each side's sum of ``vocab`` exponentials is within ``(vocab - 1) u`` relatively of the
    exact one, so the logs differ by at most ``2 vocab u`` (plus a few roundings of the row's
    magnitude for ``x - max``); when the logits themselves come from a native reduction of
    ``addends`` values in ``dtype``, each logit may differ by the reduction's bound and the
    log-probability by twice that.
    """
    u32 = unit_roundoff(DType.FLOAT32)
    floor = tolerance_for(DType.FLOAT32, why)
    scaled = 8 * u32 + (4 * addends * unit_roundoff(dtype) if addends else 0.0)
    extra = (
        f"; logits reduced natively over {addends} addends in {dtype.value}: + 4·{addends}·u·row magnitude"
        if addends
        else ""
    )
    return Tolerance(
        floor.rtol,
        max(floor.atol, (2 * vocab + 64) * u32),
        f"{why}; |error| <= (2·{vocab}+64)·u + 8·u·row magnitude with u = {u32:.3g} (float32)" + extra,
        scaled=scaled,
        per_row=True,
    )


@dataclass(frozen=True)
class Holding:
    """What one producer rank holds at the start: a region, complete or one partial addend."""

    rank: int
    region: Region
    partial: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "region": region_text(self.region),
            "state": "partial" if self.partial else "complete",
        }


@dataclass(frozen=True)
class Provenance:
    op: str
    tensor: str
    shape: tuple[int, ...]
    dtype: DType
    domain: str
    placement: Placement
    holdings: tuple[Holding, ...]

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        return tuple(h.rank for h in self.holdings)

    def to_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "tensor": self.tensor,
            "shape": list(self.shape),
            "dtype": self.dtype.value,
            "domain": self.domain,
            "placement": repr(self.placement),
            "holdings": [h.to_dict() for h in self.holdings],
        }


@dataclass(frozen=True)
class Substitute:
    """Something that may (or may not) stand in for the raw tensor, and its equivalence."""

    name: str
    allowed: bool
    equivalence: Equivalence
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "allowed": self.allowed,
            "equivalence": self.equivalence.value,
            "reason": self.reason,
        }


@dataclass(frozen=True)
class Substitutability:
    """The equivalence the consumer's observation is judged under, and the substitutes."""

    equivalence: Equivalence
    tolerance: Tolerance | None
    substitutes: tuple[Substitute, ...]

    def allows(self, name: str) -> bool:
        return any(s.name == name and s.allowed for s in self.substitutes)

    def to_dict(self) -> dict[str, Any]:
        return {
            "equivalence": self.equivalence.value,
            "tolerance": self.tolerance.to_dict() if self.tolerance else None,
            "substitutes": [s.to_dict() for s in self.substitutes],
        }


@dataclass(frozen=True)
class Completion:
    """What must be finished before the consumer reads."""

    reduce_op: str | None  # the Partial op whose addends must all be reduced exactly once
    contributors: tuple[int, ...]  # the ranks whose addends make the value
    inside_domain: str  # where partials are completed before crossing
    requirements: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "reduce_op": self.reduce_op,
            "contributors": list(self.contributors),
            "inside_domain": self.inside_domain,
            "requirements": list(self.requirements),
        }


@dataclass(frozen=True)
class Authority:
    """The single authoritative sender of each piece, and who may observe owner-scoped rows."""

    senders: tuple[tuple[str, int], ...]  # (piece description, rank)
    owner_of_row: tuple[int, ...] | None  # row -> owning consumer rank, for owner-scoped data
    unrestricted: tuple[int, ...]  # ranks that may hold any row (the producer's own ranks)

    def may_hold(self, rank: int, rows: Intervals) -> bool:
        if self.owner_of_row is None or rank in self.unrestricted:
            return True
        return all(self.owner_of_row[r] == rank for a, b in rows for r in range(a, b))

    def to_dict(self) -> dict[str, Any]:
        owners = None
        if self.owner_of_row is not None:
            owners = {
                str(o): region_text((intervals_from_indices([r for r, x in enumerate(self.owner_of_row) if x == o]),))
                for o in sorted(set(self.owner_of_row))
            }
        return {
            "senders": [{"piece": p, "rank": r} for p, r in self.senders],
            "owner_scope": owners,
            "unrestricted_ranks": list(self.unrestricted),
        }


@dataclass(frozen=True)
class Observation:
    """Exactly what one consumer rank observes: form, region, dtype and shape."""

    rank: int
    form: Form
    region: Region  # RAW: region of the tensor; TOKEN/LOGPROB: (rows, all columns)
    dtype: DType
    shape: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "form": self.form.value,
            "region": region_text(self.region),
            "dtype": self.dtype.value,
            "shape": list(self.shape),
        }


@dataclass(frozen=True)
class Demand:
    request: Request
    observations: tuple[Observation, ...]  # one per consumer rank that observes anything
    silent: tuple[int, ...]  # consumer ranks that must observe nothing (non-owners)
    reads_target_ids: bool  # logprob: the request's target id per row is an input every rank holds

    def of(self, rank: int) -> Observation | None:
        for o in self.observations:
            if o.rank == rank:
                return o
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "request": self.request.value,
            "observations": [o.to_dict() for o in self.observations],
            "silent_ranks": list(self.silent),
            "reads_target_ids": self.reads_target_ids,
        }


@dataclass(frozen=True)
class Locality:
    producer_domain: str
    consumer_domain: str
    cross_domain: bool
    link: LinkClass  # class of the bridge between the two domains (fabric when the same)
    bridge: tuple[int, int] | None  # (producer bridge rank, consumer bridge rank)
    collective_domains: tuple[str, ...]  # where native collectives may run

    def to_dict(self) -> dict[str, Any]:
        return {
            "producer_domain": self.producer_domain,
            "consumer_domain": self.consumer_domain,
            "cross_domain": self.cross_domain,
            "link": self.link.value,
            "bridge": list(self.bridge) if self.bridge else None,
            "native_collectives_in": list(self.collective_domains),
        }


@dataclass(frozen=True)
class Contract:
    edge: Edge
    provenance: Provenance
    substitutability: Substitutability
    completion: Completion
    authority: Authority
    demand: Demand
    locality: Locality

    @property
    def exact_reduction(self) -> bool:
        """Whether partials must be summed in the reference order (no native reduction)."""
        return not self.substitutability.allows("native_reduction")

    def to_dict(self) -> dict[str, Any]:
        return {
            "provenance": self.provenance.to_dict(),
            "substitutability": self.substitutability.to_dict(),
            "completion": self.completion.to_dict(),
            "authority": self.authority.to_dict(),
            "demand": self.demand.to_dict(),
            "locality": self.locality.to_dict(),
        }


_RESULT_REQUESTS = tuple(r for r in Request if r.reads_logits)

# The form each request observes (raw values for the others).
REQUEST_FORM: dict[Request, Form] = {
    Request.TOKEN: Form.TOKEN,
    Request.OWNER_TOKEN: Form.TOKEN,
    Request.LOGPROB: Form.LOGPROB,
    Request.TOPK: Form.TOPK,
    Request.TOKEN_LOGPROB: Form.TOKEN_LOGPROB,
    Request.SAMPLE: Form.SAMPLE,
}


def _holdings(edge: Edge) -> tuple[Holding, ...]:
    p = edge.producer
    ranks = edge.mesh.domain(p.domain).ranks
    full = full_region(p.shape)
    out = []
    tp = len(ranks) // p.dp  # a 2-D layout: group g of dp holds rows chunk g, the placement applies inside
    for i, r in enumerate(ranks):
        group, inner = divmod(i, tp)
        block = chunk_region(full, 0, p.shape[0], p.dp, group) if p.dp > 1 else full
        if isinstance(p.placement, Shard):
            d = p.placement.dim
            size = sum(b - a for a, b in block[d])
            start = block[d][0][0] if block[d] else 0
            lo = min(size, inner * -(-size // tp))
            hi = min(size, lo + -(-size // tp))
            region = block[:d] + ((((start + lo, start + hi),) if hi > lo else ()),) + block[d + 1 :]
            out.append(Holding(r, region, False))
        else:
            out.append(Holding(r, block, isinstance(p.placement, Partial)))
    return tuple(out)


def _native_reduction_exact(placement: Placement, dtype: DType, contributors: int) -> bool:
    """A native reduction in unspecified order is bitwise exact for max/min, integers or <= 2 addends."""
    if not isinstance(placement, Partial):
        return True
    return placement.op in ("max", "min") or not dtype.is_floating or contributors <= 2


def _substitutability(edge: Edge, n: int) -> Substitutability:
    p, c = edge.producer, edge.consumer
    req = c.request
    tolerance_ok = not c.exact and req in (Request.LOGPROB, Request.REDUCED, Request.SHARD)
    native_exact = _native_reduction_exact(p.placement, p.dtype, n)
    subs = []
    if req in _RESULT_REQUESTS:
        subs.append(
            Substitute(
                "source_projection",
                True,
                Equivalence.BITWISE,
                "the observation is computed where the data lives and only it crosses",
            )
        )
    if req in (Request.TOKEN, Request.OWNER_TOKEN):
        subs.append(
            Substitute(
                "distributed_argmax",
                True,
                Equivalence.BITWISE,
                "per-shard (max, index) pairs combined with lowest-index ties give the same id",
            )
        )
    if req is Request.LOGPROB:
        subs.append(
            Substitute(
                "distributed_logsoftmax",
                not c.exact,
                Equivalence.TOLERANCE,
                "per-shard (max, sum exp, target) statistics sum exponentials in a different order than a "
                "single-device log-softmax: not bitwise equal" + ("; the consumer demands exact" if c.exact else ""),
            )
        )
    if isinstance(p.placement, Partial):
        allowed = native_exact or tolerance_ok
        subs.append(
            Substitute(
                "native_reduction",
                allowed,
                Equivalence.BITWISE if native_exact else Equivalence.TOLERANCE,
                "a native collective reduces in an unspecified order"
                + ("; exact here" if native_exact else "; a floating sum over more than two addends is not bitwise")
                + ("" if allowed else "; the request needs the reference order"),
            )
        )
    if req is Request.LOGPROB and not c.exact:
        return Substitutability(
            Equivalence.TOLERANCE,
            logsoftmax_tolerance(
                p.columns,
                "log-softmax statistics are combined in float32 in a different order",
                p.dtype,
                0 if native_exact else n,
            ),
            tuple(subs),
        )
    if tolerance_ok and isinstance(p.placement, Partial) and not native_exact:
        return Substitutability(
            Equivalence.TOLERANCE,
            reduction_tolerance(
                p.dtype, n, f"partial {p.placement.op} reduced by a native collective in unspecified order"
            ),
            tuple(subs),
        )
    return Substitutability(Equivalence.BITWISE, None, tuple(subs))


def _demand(edge: Edge) -> Demand:
    p, c = edge.producer, edge.consumer
    full = full_region(p.shape)
    obs: list[Observation] = []
    silent: list[int] = []
    req = c.request
    if req in (Request.FULL, Request.REDUCED) and c.shard_dim is None:
        obs = [Observation(r, Form.RAW, full, p.dtype, p.shape) for r in c.ranks]
    elif req in (Request.SHARD, Request.REDUCED):
        d = c.shard_dim
        if d is None or d >= len(p.shape):
            raise FactError(f"consumer {c.name!r}.shard_dim: {d} is not a dim of the producer's shape {list(p.shape)}")
        for j, r in enumerate(c.ranks):
            reg = chunk_region(full, d, p.shape[d], len(c.ranks), j)
            shape = tuple(sum(b - a for a, b in iv) for iv in reg)
            obs.append(Observation(r, Form.RAW, reg, p.dtype, shape))
    elif req in (Request.TOKEN, Request.LOGPROB, Request.SAMPLE):
        form = REQUEST_FORM[req]
        dt = DType.FLOAT32 if req is Request.LOGPROB else DType.INT64
        obs = [Observation(r, form, full, dt, (p.shape[0],)) for r in c.ranks]
    elif req in (Request.TOPK, Request.TOKEN_LOGPROB):
        width = 2 * (c.k or 1) if req is Request.TOPK else 2
        obs = [Observation(r, REQUEST_FORM[req], full, DType.FLOAT64, (p.shape[0], width)) for r in c.ranks]
    elif req is Request.OWNER_TOKEN:
        owners = c.owners or ()
        for r in c.ranks:
            rows = [i for i, o in enumerate(owners) if o == r]
            if not rows:
                silent.append(r)
                continue
            obs.append(Observation(r, Form.TOKEN, (intervals_from_indices(rows), full[1]), DType.INT64, (len(rows),)))
    return Demand(req, tuple(obs), tuple(silent), req is Request.LOGPROB)


def compile_contract(edge: Edge) -> Contract:
    """Compile the facts of ``edge`` into its contract (deterministic, pure)."""
    p, c, mesh = edge.producer, edge.consumer, edge.mesh
    pdom, cdom = mesh.domain(p.domain), mesh.domain(c.domain)
    holdings = _holdings(edge)
    n = len(holdings)
    provenance = Provenance(p.op, p.name, p.shape, p.dtype, p.domain, p.placement, holdings)
    partial = isinstance(p.placement, Partial)
    reqs = []
    if isinstance(p.placement, Partial):
        reqs.append(f"all {n} {p.placement.op} addends of {p.name} reduced exactly once, inside {pdom.name}")
    if isinstance(p.placement, Shard):
        reqs.append(f"every shard of {p.name} along dim {p.placement.dim} present where it is combined")
    reqs.append(f"{p.op} finished on {pdom.name} before anything is read")
    completion = Completion(
        p.placement.op if isinstance(p.placement, Partial) else None,
        tuple(h.rank for h in holdings),
        pdom.name,
        tuple(reqs),
    )
    demand = _demand(edge)
    pbridge, cbridge = pdom.bridge_rank, cdom.bridge_rank
    assert pbridge is not None and cbridge is not None  # Domain.__post_init__ sets both
    if c.request in _RESULT_REQUESTS:
        if c.request is Request.OWNER_TOKEN:
            senders = tuple(
                (f"token of {p.name}{region_text(o.region)} for its owner, rank {o.rank}", pbridge)
                for o in demand.observations
            )
        else:
            o = demand.observations[0]
            senders = ((f"{o.form.value} of {p.name}{region_text(o.region)}", pbridge),)
    elif isinstance(p.placement, Shard):
        senders = tuple((f"{p.name}{region_text(h.region)}", h.rank) for h in holdings)
    else:
        what = "completed " if partial else ""
        senders = ((f"{what}{p.name}{region_text(full_region(p.shape))}", pbridge),)
    owner_scoped = c.request is Request.OWNER_TOKEN
    authority = Authority(senders, tuple(c.owners) if owner_scoped and c.owners else None, pdom.ranks)
    cross = edge.cross_domain
    link = mesh.link_class(pbridge, cbridge) if cross else LinkClass.FABRIC
    locality = Locality(
        pdom.name,
        cdom.name,
        cross,
        link,
        (pbridge, cbridge) if cross else None,
        tuple(dict.fromkeys((pdom.name, cdom.name))),
    )
    return Contract(edge, provenance, _substitutability(edge, n), completion, authority, demand, locality)


def is_result_request(request: Request) -> bool:
    """Requests whose observation is a projection (log-prob, token) rather than raw values."""
    return request in _RESULT_REQUESTS
