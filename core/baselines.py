"""Baselines the checker judges beside the lowerer: layout-only and byte-only planners.

**Layout-only** plans what DTensor's redistribution would, blind to demand, authority
and completion. Inside one domain it applies DTensor's transition table (Shard ->
Replicate = all-gather, Partial -> Replicate = all-reduce, Partial -> Shard =
reduce-scatter, Shard(i) -> Shard(j) = all-to-all, Replicate -> Shard = local chunk).
DTensor has no cross-mesh collective, so across domains every producer rank's local
tensor makes one bridge hop to the consumer domain's bridge rank, which reassembles it
(concatenation for shards, the sum for partials, any copy for replicas); the consumer
domain then redistributes from that rank (broadcast, or scatter for a sharded demand)
and the application computes its projection (argmax, log-softmax, its own rows) on what
arrived. It moves the whole tensor whatever the consumer reads.

**Byte-only** enumerates candidate plans from a grammar of choices, blind to semantics
(where to project, whether to complete partials, whether a collective may reach across
domains, who receives), and keeps the one with the fewest payload bytes. Its candidates
are the checker's test: every one that goes numerically wrong must be rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from .contract import REQUEST_FORM, Contract, Form
from .facts import DType, Request
from .lowerer import complete_raw, fan_out, lower, observable, row_projection
from .placement import Partial, Shard
from .plan import Plan, StepKind
from .planbuild import PlanBuilder, form_bytes, form_dtype, row_bytes
from .region import full_region, intervals_indices

__all__ = ["layout_only", "byte_only", "byte_only_candidates", "Candidate"]


def _form(c: Contract) -> Form:
    return {Request.TOKEN: Form.TOKEN, Request.OWNER_TOKEN: Form.TOKEN, Request.LOGPROB: Form.LOGPROB}.get(
        c.demand.request, Form.RAW
    )


def _dtype(c: Contract, form: Form) -> DType:
    return form_dtype(form, c.provenance.dtype)


def _chunked(c: Contract) -> bool:
    return c.demand.request in (Request.SHARD, Request.REDUCED) and c.edge.consumer.shard_dim is not None


def _application(b: PlanBuilder, buf: str) -> None:
    """The consumer application's own compute on the raw tensor it received, then deliver."""
    c = b.contract
    cons = c.edge.consumer
    req = c.demand.request
    dt = c.provenance.dtype
    if req is Request.TOKEN:
        buf = b.project("argmax", cons.ranks, buf, b.name("token"), DType.INT64, {}, "consumer computes the token")
        dt = DType.INT64
    elif req is Request.LOGPROB:
        buf = b.project(
            "logsoftmax_at",
            cons.ranks,
            buf,
            b.name("logprob"),
            DType.FLOAT32,
            {},
            "consumer computes log-probabilities",
        )
        dt = DType.FLOAT32
    elif req in (Request.TOPK, Request.TOKEN_LOGPROB, Request.SAMPLE):
        form = REQUEST_FORM[req]
        op, args = row_projection(c, form)
        dt = form_dtype(form, dt)
        buf = b.project(op, cons.ranks, buf, b.name(form.value), dt, args, f"consumer computes {req.value}")
    elif req is Request.OWNER_TOKEN:
        tok = b.project("argmax", cons.ranks, buf, b.name("token"), DType.INT64, {}, "consumer computes tokens")
        owners = tuple(o.rank for o in c.demand.observations)
        index = [intervals_indices(o.region[0]) for o in c.demand.observations]
        buf = b.project(
            "slice", owners, tok, b.name("mine"), DType.INT64, {"dim": 0, "index": index}, "each owner keeps its rows"
        )
        b.deliver(owners, buf, DType.INT64)
        return
    b.deliver(cons.ranks, buf, dt)


def layout_only(contract: Contract) -> Plan:
    """DTensor's transition table plus one bridge hop per local tensor (see the module docstring)."""
    c = contract
    b = PlanBuilder(c, "layout_only")
    prov = c.provenance
    cons = c.edge.consumer
    P, t, dt, pl = prov.ranks, prov.tensor, prov.dtype, prov.placement
    full = full_region(prov.shape)
    nbytes = form_bytes(Form.RAW, full, dt)
    n, m = len(P), len(cons.ranks)
    if not c.locality.cross_domain:
        if _chunked(c) and tuple(cons.ranks) == tuple(P) and n > 1:
            d = cons.shard_dim
            if isinstance(pl, Shard) and pl.dim == d:
                buf = t
            elif isinstance(pl, Shard):
                buf = b.collective(
                    "all_to_all",
                    P,
                    t,
                    b.name("resharded"),
                    nbytes,
                    dt,
                    {"split_dim": d, "concat_dim": pl.dim},
                    "Shard(i) -> Shard(j)",
                )
            elif isinstance(pl, Partial):
                buf = b.collective(
                    "reduce_scatter", P, t, b.name("chunk"), n * nbytes, dt, {"dim": d, "op": pl.op}, "Partial -> Shard"
                )
            else:
                buf = b.project(
                    "chunk",
                    P,
                    t,
                    b.name("chunk"),
                    dt,
                    {"dim": d, "parts": n, "index": list(range(n))},
                    "Replicate -> Shard",
                )
            b.deliver(cons.ranks, buf, dt)
            return b.plan()
        buf = t
        if isinstance(pl, Shard) and n > 1:
            buf = b.collective(
                "all_gather", P, t, b.name("replicated"), nbytes, dt, {"dim": pl.dim}, "Shard -> Replicate"
            )
        elif isinstance(pl, Partial) and n > 1:
            buf = b.collective(
                "all_reduce", P, t, b.name("replicated"), n * nbytes, dt, {"op": pl.op}, "Partial -> Replicate"
            )
        if _chunked(c):
            buf = b.project(
                "chunk",
                cons.ranks,
                buf,
                b.name("chunk"),
                dt,
                {"dim": cons.shard_dim, "parts": m, "index": list(range(m))},
                "Replicate -> Shard",
            )
        _application(b, buf)
        return b.plan()
    assert c.locality.bridge is not None  # a cross-domain contract names its bridge ranks
    _, bc = c.locality.bridge
    arrived = []
    for h in prov.holdings:
        size = form_bytes(Form.RAW, h.region, dt)
        if size:
            arrived.append(b.send(h.rank, bc, t, b.name(f"from{h.rank}"), size, dt, "each local tensor hops once"))
    if isinstance(pl, Shard) and len(arrived) > 1:
        buf = b.project("concat", (bc,), arrived, b.name("full"), dt, {"dim": pl.dim}, "reassemble the shards")
    elif isinstance(pl, Partial) and len(arrived) > 1:
        buf = b.project("sum", (bc,), arrived, b.name("full"), dt, {"op": pl.op}, "reduce the addends")
    else:
        buf = arrived[0]
    group = (bc,) + tuple(r for r in cons.ranks if r != bc)
    if _chunked(c):
        d = cons.shard_dim
        if bc in cons.ranks and m > 1:
            buf = b.collective(
                "scatter",
                cons.ranks,
                buf,
                b.name("chunk"),
                nbytes,
                dt,
                {"dim": d, "root": bc},
                "Replicate on one rank -> Shard",
            )
        elif bc not in cons.ranks:
            buf = b.collective("broadcast", group, buf, b.name("bcast"), nbytes, dt, {"root": bc})
            buf = b.project(
                "chunk", cons.ranks, buf, b.name("chunk"), dt, {"dim": d, "parts": m, "index": list(range(m))}
            )
        b.deliver(cons.ranks, buf, dt)
        return b.plan()
    if len(group) > 1:
        buf = b.collective(
            "broadcast", group, buf, b.name("bcast"), nbytes, dt, {"root": bc}, "Replicate over the consumer's ranks"
        )
    _application(b, buf)
    return b.plan()


@dataclass(frozen=True)
class Candidate:
    """One byte-only candidate: the grammar choices that made it, and the plan."""

    label: str
    plan: Plan


def _local(b: PlanBuilder, form: Form, rank: int) -> str:
    """Project the observation from one rank's local data alone (blind to shards and addends)."""
    t = b.contract.provenance.tensor
    if form is Form.TOKEN:
        return b.project("argmax", (rank,), t, b.name("token"), DType.INT64, {}, "token of the local data")
    if form is Form.LOGPROB:
        return b.project(
            "logsoftmax_at", (rank,), t, b.name("logprob"), DType.FLOAT32, {}, "log-softmax of the local data"
        )
    return t


def _stats(b: PlanBuilder, form: Form, root: int) -> str:
    """Per-rank statistics gathered and combined at ``root``, whatever the placement."""
    c = b.contract
    prov = c.provenance
    P, n, rows = prov.ranks, len(prov.ranks), prov.shape[0]
    offs = [h.region[1][0][0] if h.region[1] else 0 for h in prov.holdings]
    local, stat, comb = (
        ("local_max_arg", Form.MAX_ARG, "combine_max_arg")
        if form is Form.TOKEN
        else ("local_lse_stats", Form.LSE_STATS, "combine_lse_stats")
    )
    dt = form_dtype(stat, prov.dtype)
    s = b.project(local, P, prov.tensor, b.name("stats"), dt, {"offsets": offs})
    g = b.collective("gather", P, s, b.name("stats_all"), n * row_bytes(stat, rows), dt, {"dim": 1, "root": root})
    return b.project(comb, (root,), g, b.name("combined"), _dtype(c, form))


def _native(b: PlanBuilder, form: Form, root: int) -> str:
    """Complete partials with a native reduction whatever the contract's equivalence."""
    prov = b.contract.provenance
    pl = prov.placement
    assert isinstance(pl, Partial)  # offered only for partial producers
    nbytes = form_bytes(Form.RAW, full_region(prov.shape), prov.dtype)
    raw = b.collective(
        "reduce",
        prov.ranks,
        prov.tensor,
        b.name("reduced"),
        len(prov.ranks) * nbytes,
        prov.dtype,
        {"op": pl.op, "root": root},
    )
    if form is Form.TOKEN:
        return b.project("argmax", (root,), raw, b.name("token"), DType.INT64)
    if form is Form.LOGPROB:
        return b.project("logsoftmax_at", (root,), raw, b.name("logprob"), DType.FLOAT32)
    return raw


def _deliver_cross(b: PlanBuilder, buf: str, form: Form, how: str, nbytes: int | None = None) -> None:
    c = b.contract
    assert c.locality.bridge is not None  # a cross-domain contract names its bridge ranks
    dt = _dtype(c, form)
    cons = c.edge.consumer
    if nbytes is None:
        nbytes = form_bytes(form, full_region(c.provenance.shape), c.provenance.dtype)
    if c.demand.request is Request.OWNER_TOKEN and how == "fan_out":
        tok = (
            b.collective(
                "broadcast",
                (cons.ranks[0],) + cons.ranks[1:],
                buf,
                b.name("bcast"),
                nbytes,
                dt,
                {"root": cons.ranks[0]},
            )
            if len(cons.ranks) > 1 and buf
            else buf
        )
        _keep_rows(b, tok)
        return
    if _chunked(c) and how == "fan_out":
        d = cons.shard_dim
        m = len(cons.ranks)
        group = (c.locality.bridge[1],) + tuple(r for r in cons.ranks if r != c.locality.bridge[1])
        if len(group) > 1:
            buf = b.collective("broadcast", group, buf, b.name("bcast"), nbytes, dt, {"root": group[0]})
        buf = b.project("chunk", cons.ranks, buf, b.name("chunk"), dt, {"dim": d, "parts": m, "index": list(range(m))})
        b.deliver(cons.ranks, buf, dt)
        return
    if how == "fan_out":
        fan_out(b, buf, nbytes, dt)
    else:
        b.deliver((c.locality.bridge[1],), buf, dt)


def _keep_rows(b: PlanBuilder, tok: str) -> None:
    c = b.contract
    owners = tuple(o.rank for o in c.demand.observations)
    index = [intervals_indices(o.region[0]) for o in c.demand.observations]
    mine = b.project("slice", owners, tok, b.name("mine"), DType.INT64, {"dim": 0, "index": index})
    b.deliver(owners, mine, DType.INT64)


def byte_only_candidates(contract: Contract) -> list[Candidate]:
    """Every candidate of the byte-only grammar for ``contract``, in a fixed order."""
    c = contract
    out = [Candidate("meshpact", lower(c)), Candidate("layout_only", layout_only(c))]
    form = _form(c)
    prov = c.provenance
    pl = prov.placement
    n = len(prov.ranks)
    producers: list[tuple[str, Callable[[PlanBuilder, int], str]]] = [
        ("local_only", lambda b, r: _local(b, form, r)),
    ]
    if form is not Form.RAW and (isinstance(pl, Partial) or (isinstance(pl, Shard) and pl.dim == 1)) and n > 1:
        producers.append(("shard_statistics", lambda b, r: _stats(b, form, r)))
    if isinstance(pl, Partial) and n > 1:
        producers.append(("native_reduction", lambda b, r: _native(b, form, r)))
    if not c.locality.cross_domain:
        cons = c.edge.consumer
        for label, make in producers:
            b = PlanBuilder(c, "byte_only")
            buf = make(b, cons.ranks[0])
            b.deliver(cons.ranks, buf, _dtype(c, form))
            out.append(Candidate(f"{label}+deliver_all", b.plan()))
        return out
    assert c.locality.bridge is not None  # a cross-domain contract names its bridge ranks
    bp, bc = c.locality.bridge
    producers.insert(0, ("project_at_source", lambda b, r: observable(b, form, (r,))))
    for label, make in producers:
        for how in ("fan_out", "bridge_rank_only"):
            b = PlanBuilder(c, "byte_only")
            buf = make(b, bp)
            region = full_region(prov.shape)
            if label == "local_only":  # only what the bridge rank's own shard gives crosses
                region = next(h.region for h in prov.holdings if h.rank == bp)
            size = form_bytes(form, region, prov.dtype)
            arrived = b.send(bp, bc, buf, b.name("arrived"), size, _dtype(c, form))
            _deliver_cross(b, arrived, form, how, size)
            out.append(Candidate(f"{label}+send+{how}", b.plan()))
    # one collective reaching across the domains, rooted at the consumer's bridge rank
    b = PlanBuilder(c, "byte_only")
    buf = observable(b, form, (bc,)) if form is not Form.RAW else complete_raw(b, (bc,))
    if buf == prov.tensor:
        buf = b.collective(
            "broadcast",
            prov.ranks[:1] + (bc,),
            buf,
            b.name("bcast"),
            form_bytes(Form.RAW, full_region(prov.shape), prov.dtype),
            prov.dtype,
            {"root": prov.ranks[0]},
        )
    steps = []
    for s in b.steps:
        if s.kind is StepKind.COLLECTIVE and s.arg("root") == bc and bc not in s.ranks:
            s = replace(s, ranks=s.ranks + (bc,))
        steps.append(s)
    b.steps = steps
    _deliver_cross(b, buf, form, "fan_out")
    out.append(Candidate("collective_across_domains", b.plan()))
    return out


def byte_only(contract: Contract) -> Plan:
    """The candidate with the fewest payload bytes (ties: fewer startups, then the earlier one)."""
    cands = byte_only_candidates(contract)
    best = min(enumerate(cands), key=lambda ic: (ic[1].plan.payload_bytes, ic[1].plan.startups, ic[0]))[1]
    return Plan(edge=best.plan.edge, planner="byte_only", steps=best.plan.steps)
