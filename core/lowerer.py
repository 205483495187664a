"""The lowerer: a contract becomes a deterministic, backend-neutral plan.

:func:`lower` builds a few candidate plans that all keep the contract and keeps the one
with the fewest startups (every collective call and bridge message is a launch and, across
vendors, a host-staged handshake), then the lowest α-β time, then the fewest payload
bytes, then the earlier candidate; so the same contract always gives the same plan, byte
for byte. The candidates follow four rules:

* **source projection**: when the consumer observes a projection (token, log-prob), it
  is computed where the data lives and only the projection moves. A vocabulary-sharded
  head sends per-shard statistics, (max, index) pairs or (max, sum exp, target) triples,
  in *one* collective, not Megatron's three all-reduces, and not the logits;
* **completion inside the producer's domain**: partial addends are reduced exactly once
  before anything crosses (in the reference order when the contract forbids a native,
  order-unspecified reduction);
* **one authoritative sender per piece**, crossing the bridge once: either the
  producer's bridge rank sends the completed observation, or each shard's holder sends
  exactly the slice a consumer rank needs;
* **owner-scoped delivery**: an owner's rows are sliced at the source and sent to that
  owner alone; no other consumer-side rank holds them.
"""

from __future__ import annotations

from typing import Callable

from .contract import Contract, Form
from .facts import DType, Request
from .placement import Partial, Replicate, Shard, shard_bounds
from .plan import Plan, plan_cost
from .planbuild import PlanBuilder, form_bytes
from .region import full_region, intervals_indices

__all__ = ["lower", "lower_candidates", "complete_raw", "observable", "fan_out"]

PLANNER = "meshpact"


def lower(contract: Contract) -> Plan:
    """The plan for ``contract``: the cheapest of :func:`lower_candidates` (deterministic)."""
    cands = lower_candidates(contract)
    if len(cands) == 1:
        return cands[0]
    mesh = contract.edge.mesh
    return min(enumerate(cands), key=lambda ip: (ip[1].startups, round(plan_cost(ip[1], mesh).time_s, 12),
                                                  ip[1].payload_bytes, ip[0]))[1]


def lower_candidates(contract: Contract) -> list[Plan]:
    """Every plan the lowerer considers for ``contract``; all keep it."""
    req = contract.demand.request
    if req is Request.OWNER_TOKEN:
        return [_owner_token(contract)]
    if req in (Request.SHARD, Request.REDUCED) and contract.edge.consumer.shard_dim is not None:
        return _per_rank_chunks(contract)
    form = {Request.TOKEN: Form.TOKEN, Request.LOGPROB: Form.LOGPROB}.get(req, Form.RAW)
    cands = [_replicated(contract, form)]
    pl = contract.provenance.placement
    if form is Form.RAW and isinstance(pl, Shard) and contract.locality.cross_domain and _n(contract) > 1:
        cands.append(_replicated(contract, form, direct_shards=True))
    return cands


def _n(c: Contract) -> int:
    return len(c.provenance.holdings)


def _offsets(c: Contract, dim: int) -> list[int]:
    n = _n(c)
    return [shard_bounds(c.provenance.shape[dim], n, i)[0] for i in range(n)]


def complete_raw(b: PlanBuilder, targets: tuple[int, ...]) -> str:
    """Make the complete raw tensor available on ``targets`` (producer-domain ranks)."""
    c = b.contract
    prov = c.provenance
    P, t, dt, n = prov.ranks, prov.tensor, prov.dtype, len(prov.ranks)
    pl = prov.placement
    nbytes = form_bytes(Form.RAW, full_region(prov.shape), dt)
    if n == 1 or isinstance(pl, Replicate):
        return t
    rooted = len(targets) == 1
    if isinstance(pl, Shard):
        out = b.name("full")
        args = {"dim": pl.dim, **({"root": targets[0]} if rooted else {})}
        return b.collective("gather" if rooted else "all_gather", P, t, out, nbytes, dt, args,
                            f"assemble the shards along dim {pl.dim}")
    assert isinstance(pl, Partial)
    if c.exact_reduction:
        gathered = b.name("addends")
        args = {"dim": 0, **({"root": targets[0]} if rooted else {})}
        b.collective("gather" if rooted else "all_gather", P, t, gathered, n * nbytes, dt, args,
                     "collect the addends to reduce them in the reference order")
        return b.project("sum", targets, gathered, b.name("complete"), dt, {"dim": 0, "op": pl.op, "parts": n},
                         f"{pl.op} of the addends in rank order (bitwise the single-device value)")
    out = b.name("complete")
    args = {"op": pl.op, **({"root": targets[0]} if rooted else {})}
    return b.collective("reduce" if rooted else "all_reduce", P, t, out, n * nbytes, dt, args,
                        f"complete the partial {pl.op} inside {prov.domain}")


def observable(b: PlanBuilder, form: Form, targets: tuple[int, ...]) -> str:
    """Compute the consumer's observation in ``form`` on ``targets`` (source projection)."""
    if form is Form.RAW:
        return complete_raw(b, targets)
    c = b.contract
    prov = c.provenance
    P, t, n = prov.ranks, prov.tensor, len(prov.ranks)
    pl = prov.placement
    rows = prov.shape[0]
    rooted = len(targets) == 1
    gather = "gather" if rooted else "all_gather"

    def root(args: dict) -> dict:
        return {**args, **({"root": targets[0]} if rooted else {})}

    if form is Form.TOKEN:
        if isinstance(pl, Shard) and n > 1 and pl.dim == 1:
            stats = b.project("local_max_arg", P, t, b.name("max_arg"), DType.FLOAT32, {"offsets": _offsets(c, 1)},
                              "per-row (max, global index) of each vocabulary shard")
            g = b.collective(gather, P, stats, b.name("max_arg_all"), n * rows * 8, DType.FLOAT32, root({"dim": 1}),
                             "one collective for all shards' pairs")
            return b.project("combine_max_arg", targets, g, b.name("token"), DType.INT64, {},
                             "winner per row, lowest index on ties")
        if isinstance(pl, Shard) and n > 1 and pl.dim == 0:
            tok = b.project("argmax", P, t, b.name("token_rows"), DType.INT64, {}, "each rank's rows")
            return b.collective(gather, P, tok, b.name("token"), rows * 8, DType.INT64, root({"dim": 0}))
        raw = complete_raw(b, targets)
        return b.project("argmax", targets, raw, b.name("token"), DType.INT64, {}, "token at the source")
    # log-probabilities at the target ids
    if isinstance(pl, Shard) and n > 1 and pl.dim == 1 and c.substitutability.allows("distributed_logsoftmax"):
        stats = b.project("local_lse_stats", P, t, b.name("lse"), DType.FLOAT32, {"offsets": _offsets(c, 1)},
                          "per-row (max, sum exp, target logit) of each vocabulary shard")
        g = b.collective(gather, P, stats, b.name("lse_all"), n * rows * 12, DType.FLOAT32, root({"dim": 1}),
                         "one collective instead of three all-reduces")
        return b.project("combine_lse_stats", targets, g, b.name("logprob"), DType.FLOAT32, {},
                         "log-sum-exp of the shards' statistics")
    if isinstance(pl, Shard) and n > 1 and pl.dim == 0:
        lp = b.project("logsoftmax_at", P, t, b.name("logprob_rows"), DType.FLOAT32,
                       {"row_offsets": _offsets(c, 0)}, "each rank's full rows")
        return b.collective(gather, P, lp, b.name("logprob"), rows * 4, DType.FLOAT32, root({"dim": 0}))
    raw = complete_raw(b, targets)
    return b.project("logsoftmax_at", targets, raw, b.name("logprob"), DType.FLOAT32, {},
                     "log-softmax of full rows at the source")


def fan_out(b: PlanBuilder, buf: str, nbytes: int, dtype: DType) -> None:
    """Broadcast ``buf`` from the consumer domain's bridge rank to every consumer rank, then deliver."""
    c = b.contract
    consumers = c.edge.consumer.ranks
    bc = c.locality.bridge[1] if c.locality.bridge else consumers[0]
    group = (bc,) + tuple(r for r in consumers if r != bc)
    if len(group) > 1:
        buf = b.collective("broadcast", group, buf, b.name("bcast"), nbytes, dtype, {"root": bc},
                           "fan out inside the consumer's domain")
    b.deliver(consumers, buf, dtype)


def _replicated(c: Contract, form: Form, direct_shards: bool = False) -> Plan:
    """Every consumer rank observes the same thing (full, reduced, token, logprob)."""
    b = PlanBuilder(c, PLANNER)
    prov = c.provenance
    consumers = c.edge.consumer.ranks
    region = full_region(prov.shape)
    nbytes = form_bytes(form, region, prov.dtype)
    dtype = DType.INT64 if form is Form.TOKEN else (DType.FLOAT32 if form is Form.LOGPROB else prov.dtype)
    if not c.locality.cross_domain:
        buf = observable(b, form, consumers)
        b.deliver(consumers, buf, dtype)
        return b.plan()
    bp, bc = c.locality.bridge
    if direct_shards:
        pl = prov.placement
        assert isinstance(pl, Shard)
        arrived = []
        for h in prov.holdings:
            size = form_bytes(Form.RAW, h.region, prov.dtype)
            if size:
                arrived.append(b.send(h.rank, bc, prov.tensor, b.name(f"from{h.rank}"), size, prov.dtype,
                                      "each shard crosses once, from its holder"))
        buf = b.project("concat", (bc,), arrived, b.name("full"), prov.dtype, {"dim": pl.dim}) \
            if len(arrived) > 1 else arrived[0]
    else:
        obs = observable(b, form, (bp,))
        buf = b.send(bp, bc, obs, b.name("arrived"), nbytes, dtype, "one bridge message")
    fan_out(b, buf, nbytes, dtype)
    return b.plan()


def _owner_token(c: Contract) -> Plan:
    b = PlanBuilder(c, PLANNER)
    owners = tuple(o.rank for o in c.demand.observations)
    index = [intervals_indices(o.region[0]) for o in c.demand.observations]
    if not c.locality.cross_domain:
        tok = observable(b, Form.TOKEN, owners)
        mine = b.project("slice", owners, tok, b.name("mine"), DType.INT64, {"dim": 0, "index": index},
                         "each owner keeps its own rows")
        b.deliver(owners, mine, DType.INT64)
        return b.plan()
    bp, _ = c.locality.bridge
    tok = observable(b, Form.TOKEN, (bp,))
    mine = b.name("mine")
    for o, rows in zip(owners, index):
        part = b.project("slice", (bp,), tok, b.name(f"rows_of{o}"), DType.INT64, {"dim": 0, "index": [rows]},
                         f"rows owned by rank {o}")
        b.send(bp, o, part, mine, len(rows) * 8, DType.INT64, f"to its owner {o} only")
    b.deliver(owners, mine, DType.INT64)
    return b.plan()


def _per_rank_chunks(c: Contract) -> list[Plan]:
    """Consumer rank *j* observes chunk *j* along ``shard_dim`` (shard, or reduced and sharded)."""
    builders: list[Callable[[Contract], Plan | None]] = [_chunks_via_bridge, _chunks_direct]
    if not c.locality.cross_domain:
        builders = [_chunks_same_domain]
    return [p for p in (f(c) for f in builders) if p is not None]


def _chunks_same_domain(c: Contract) -> Plan:
    b = PlanBuilder(c, PLANNER)
    prov = c.provenance
    cons = c.edge.consumer
    d, P, pl, t, dt = cons.shard_dim, prov.ranks, prov.placement, prov.tensor, prov.dtype
    m = len(cons.ranks)
    full = full_region(prov.shape)
    same_ranks = tuple(cons.ranks) == tuple(P) and len(P) > 1
    if same_ranks and isinstance(pl, Shard) and pl.dim == d:
        b.deliver(cons.ranks, t, dt)
        return b.plan()
    if same_ranks and isinstance(pl, Shard):
        buf = b.collective("all_to_all", P, t, b.name("resharded"), form_bytes(Form.RAW, full, dt), dt,
                           {"split_dim": d, "concat_dim": pl.dim}, f"Shard({pl.dim}) -> Shard({d})")
        b.deliver(cons.ranks, buf, dt)
        return b.plan()
    if same_ranks and isinstance(pl, Partial) and not c.exact_reduction:
        buf = b.collective("reduce_scatter", P, t, b.name("chunk"), len(P) * form_bytes(Form.RAW, full, dt), dt,
                           {"dim": d, "op": pl.op}, "complete and split in one collective")
        b.deliver(cons.ranks, buf, dt)
        return b.plan()
    whole = complete_raw(b, cons.ranks)
    buf = b.project("chunk", cons.ranks, whole, b.name("chunk"), dt,
                    {"dim": d, "parts": m, "index": list(range(m))}, "each consumer rank keeps its chunk")
    b.deliver(cons.ranks, buf, dt)
    return b.plan()


def _chunks_via_bridge(c: Contract) -> Plan:
    """Complete at the producer's bridge rank, one bridge message, split inside the consumer's domain."""
    b = PlanBuilder(c, PLANNER)
    prov = c.provenance
    cons = c.edge.consumer
    d, dt = cons.shard_dim, prov.dtype
    m = len(cons.ranks)
    bp, bc = c.locality.bridge
    nbytes = form_bytes(Form.RAW, full_region(prov.shape), dt)
    whole = complete_raw(b, (bp,))
    buf = b.send(bp, bc, whole, b.name("arrived"), nbytes, dt, "one bridge message")
    if bc in cons.ranks:
        out = b.collective("scatter", cons.ranks, buf, b.name("chunk"), nbytes, dt, {"dim": d, "root": bc},
                           "split inside the consumer's domain") if m > 1 else buf
    else:
        group = (bc,) + tuple(cons.ranks)
        bcast = b.collective("broadcast", group, buf, b.name("bcast"), nbytes, dt, {"root": bc})
        out = b.project("chunk", cons.ranks, bcast, b.name("chunk"), dt,
                        {"dim": d, "parts": m, "index": list(range(m))})
    b.deliver(cons.ranks, out, dt)
    return b.plan()


def _chunks_direct(c: Contract) -> Plan | None:
    """Each holder sends exactly the slice each consumer rank needs (no gather, no fan-out)."""
    prov = c.provenance
    cons = c.edge.consumer
    d, dt, pl = cons.shard_dim, prov.dtype, prov.placement
    m = len(cons.ranks)
    b = PlanBuilder(c, PLANNER)
    if isinstance(pl, Partial):
        if c.exact_reduction or _n(c) == 1:
            return None
        src = b.collective("reduce_scatter", prov.ranks, prov.tensor, b.name("reduced"),
                           _n(c) * form_bytes(Form.RAW, full_region(prov.shape), dt), dt, {"dim": d, "op": pl.op},
                           "complete and split in one collective inside the producer's domain")
        n = _n(c)
        pieces = [(r, shard_bounds(prov.shape[d], n, i)) for i, r in enumerate(prov.ranks)]
    elif isinstance(pl, Shard) and pl.dim == d:
        src = prov.tensor
        pieces = [(h.rank, (h.region[d][0][0], h.region[d][0][1]) if h.region[d] else (0, 0))
                  for h in prov.holdings]
    elif isinstance(pl, Replicate) or _n(c) == 1:
        src = prov.tensor
        pieces = [(c.locality.bridge[0], (0, prov.shape[d]))]
    else:
        return None
    row_bytes = form_bytes(Form.RAW, full_region(prov.shape), dt) // max(1, prov.shape[d])
    mine = b.name("mine")
    received: dict[int, list[str]] = {}
    for j, r in enumerate(cons.ranks):
        lo, hi = shard_bounds(prov.shape[d], m, j)
        for holder, (plo, phi) in pieces:
            a, z = max(lo, plo), min(hi, phi)
            if z <= a:
                continue
            buf = src
            if (a, z) != (plo, phi):
                buf = b.project("slice", (holder,), src, b.name(f"for{r}"), dt,
                                {"dim": d, "start": a - plo, "stop": z - plo}, f"the part consumer rank {r} reads")
            name = mine if (lo, hi) == (a, z) else b.name(f"part{holder}to{r}")
            b.send(holder, r, buf, name, (z - a) * row_bytes, dt, "one message per piece, from its holder")
            received.setdefault(r, []).append(name)
    for j, r in enumerate(cons.ranks):
        parts = received.get(r, [])
        if len(parts) > 1:
            b.project("concat", (r,), parts, mine, dt, {"dim": d})
        elif not parts:
            return None  # an empty chunk: the bridge candidate covers it
    b.deliver(cons.ranks, mine, dt)
    return b.plan()
