"""The lowerer: a contract becomes a deterministic, backend-neutral plan.

:func:`lower` builds a few candidate plans that all keep the contract and keeps the one
with the lowest α-β time over the link classes (:func:`meshpact.core.plan.plan_time_s`:
startups and bytes weighed by the links they cross), then the fewest startups (every
collective call and bridge message is a launch and, across vendors, a host-staged
handshake), then the fewest payload bytes, then the earlier candidate; so the same
contract always gives the same plan, byte for byte. The candidates follow four rules:

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

from .contract import REQUEST_FORM, Contract, Form
from .facts import DType, Request
from .placement import Partial, Replicate, Shard, shard_bounds
from .plan import Plan, plan_time_s
from .planbuild import PlanBuilder, form_bytes, form_dtype, row_bytes
from .region import full_region, intervals_indices

__all__ = [
    "lower",
    "choose",
    "lower_candidates",
    "complete_raw",
    "observable",
    "fan_out",
    "row_projection",
    "observation_entries",
]

PLANNER = "meshpact"


def lower(contract: Contract) -> Plan:
    """The plan for ``contract``: the fastest of :func:`lower_candidates` (deterministic)."""
    return choose(lower_candidates(contract), contract, time_first=True)


def choose(cands: list[Plan], contract: Contract, time_first: bool = True) -> Plan:
    """The cheapest candidate: lowest α-β time over the link classes, then fewest startups,
    then fewest payload bytes, then the earlier one (``time_first=False``: startups first,
    the rule before times were weighed, kept to show where the choice changes)."""
    if len(cands) == 1:
        return cands[0]
    mesh = contract.edge.mesh
    if time_first:
        # the same order as the key below, with startups and bytes counted only among the fastest
        times = [round(plan_time_s(plan, mesh), 12) for plan in cands]
        fastest = min(times)
        tied = [position for position, time_s in enumerate(times) if time_s == fastest]
        if len(tied) > 1:
            tied.sort(key=lambda position: (cands[position].startups, cands[position].payload_bytes, position))
        return cands[tied[0]]

    def key(indexed: tuple[int, Plan]) -> tuple[float, ...]:
        position, plan = indexed
        time_s = round(plan_time_s(plan, mesh), 12)
        first, second = (time_s, plan.startups) if time_first else (plan.startups, time_s)
        return (first, second, plan.payload_bytes, position)

    return min(enumerate(cands), key=key)[1]


def lower_candidates(contract: Contract) -> list[Plan]:
    """Every plan the lowerer considers for ``contract``; all keep it."""
    req = contract.demand.request
    if req is Request.OWNER_TOKEN:
        return [_owner_token(contract)]
    if req in (Request.SHARD, Request.REDUCED) and contract.edge.consumer.shard_dim is not None:
        return _per_rank_chunks(contract)
    form = REQUEST_FORM.get(req, Form.RAW)
    cands = [_replicated(contract, form)]
    pl = contract.provenance.placement
    if (
        form is Form.RAW
        and isinstance(pl, Shard)
        and contract.locality.cross_domain
        and _n(contract) > 1
        and _flat(contract)
    ):
        cands.append(_replicated(contract, form, direct_shards=True))
    return cands


def _flat(contract: Contract) -> bool:
    """Whether the producer is laid out over one dimension of ranks (not a DP x TP grid)."""
    return contract.edge.producer.dp == 1


def _n(contract: Contract) -> int:
    return len(contract.provenance.holdings)


def _offsets(contract: Contract, dim: int) -> list[int]:
    count = _n(contract)
    return [shard_bounds(contract.provenance.shape[dim], count, position)[0] for position in range(count)]


def complete_raw(build: PlanBuilder, targets: tuple[int, ...]) -> str:
    """Make the complete raw tensor available on ``targets`` (producer-domain ranks)."""
    contract = build.contract
    prov = contract.provenance
    holders, tensor, dtype, count = prov.ranks, prov.tensor, prov.dtype, len(prov.ranks)
    pl = prov.placement
    nbytes = form_bytes(Form.RAW, full_region(prov.shape), dtype)
    if not _flat(contract):
        return _complete_grid(build, targets)
    if count == 1 or isinstance(pl, Replicate):
        return tensor
    rooted = len(targets) == 1
    if isinstance(pl, Shard):
        out = build.name("full")
        args: dict[str, object] = {"dim": pl.dim, **({"root": targets[0]} if rooted else {})}
        return build.collective(
            "gather" if rooted else "all_gather",
            holders,
            tensor,
            out,
            nbytes,
            dtype,
            args,
            f"assemble the shards along dim {pl.dim}",
        )
    assert isinstance(pl, Partial)
    if contract.exact_reduction:
        gathered = build.name("addends")
        args = {"dim": 0, **({"root": targets[0]} if rooted else {})}
        build.collective(
            "gather" if rooted else "all_gather",
            holders,
            tensor,
            gathered,
            count * nbytes,
            dtype,
            args,
            "collect the addends to reduce them in the reference order",
        )
        return build.project(
            "sum",
            targets,
            gathered,
            build.name("complete"),
            dtype,
            {"dim": 0, "op": pl.op, "parts": count},
            f"{pl.op} of the addends in rank order (bitwise the single-device value)",
        )
    out = build.name("complete")
    args = {"op": pl.op, **({"root": targets[0]} if rooted else {})}
    return build.collective(
        "reduce" if rooted else "all_reduce",
        holders,
        tensor,
        out,
        count * nbytes,
        dtype,
        args,
        f"complete the partial {pl.op} inside {prov.domain}",
    )


def row_projection(contract: Contract, form: Form) -> tuple[str, dict[str, object]]:
    """The projection step (op, args) that turns full rows into ``form`` for this consumer."""
    cons = contract.edge.consumer
    if form is Form.TOPK:
        return "topk", {"k": cons.k}
    if form is Form.SAMPLE:
        return "sample", {"seed": cons.seed, "temperature": cons.temperature}
    return "token_logprob", {}


def observation_entries(contract: Contract) -> int:
    """Entries per row of the observation (``k`` for top-k, else 1), for :func:`form_bytes`."""
    return int(contract.edge.consumer.k or 1) if contract.demand.request is Request.TOPK else 1


def _complete_grid(build: PlanBuilder, targets: tuple[int, ...]) -> str:
    """A DP x TP producer: each group assembles its row block on a leader (the first target where
    it is a member), the leaders' blocks are gathered along the rows, then fanned out to targets."""
    contract = build.contract
    prov = contract.provenance
    pl = prov.placement
    dp = contract.edge.producer.dp
    tp = len(prov.holdings) // dp
    root = targets[0]
    blocks = build.name("block")
    leaders = []
    for group in range(dp):
        members = prov.holdings[group * tp : (group + 1) * tp]
        ranks = tuple(h.rank for h in members)
        leader = root if root in ranks else ranks[0]
        leaders.append(leader)
        size = sum(form_bytes(Form.RAW, h.region, prov.dtype) for h in members)
        if isinstance(pl, Shard) and tp > 1:
            build.collective(
                "gather",
                ranks,
                prov.tensor,
                blocks,
                size,
                prov.dtype,
                {"dim": pl.dim, "root": leader},
                f"assemble row block {group} inside its group",
            )
        else:
            build.project("copy", (leader,), prov.tensor, blocks, prov.dtype, {}, f"row block {group}")
    full = build.collective(
        "gather",
        tuple(leaders),
        blocks,
        build.name("full"),
        form_bytes(Form.RAW, full_region(prov.shape), prov.dtype),
        prov.dtype,
        {"dim": 0, "root": root},
        "the groups' row blocks in row order",
    )
    if len(targets) > 1:
        full = build.collective(
            "broadcast",
            targets,
            full,
            build.name("everywhere"),
            form_bytes(Form.RAW, full_region(prov.shape), prov.dtype),
            prov.dtype,
            {"root": root},
        )
    return full


def observable(build: PlanBuilder, form: Form, targets: tuple[int, ...]) -> str:
    """Compute the consumer's observation in ``form`` on ``targets`` (source projection)."""
    if form is Form.RAW:
        return complete_raw(build, targets)
    contract = build.contract
    prov = contract.provenance
    pl = prov.placement
    count = len(prov.ranks)
    if form is Form.SAMPLE and isinstance(pl, Shard) and pl.dim == 1 and count > 1 and _flat(contract):
        # Gumbel-max decomposes over the vocabulary: per-shard (perturbed max, index) pairs, one gather
        rooted = len(targets) == 1
        pair = form_dtype(Form.SAMPLE_ARG, prov.dtype)
        _, args = row_projection(contract, form)
        stats = build.project(
            "local_sample_max_arg",
            prov.ranks,
            prov.tensor,
            build.name("sample_arg"),
            pair,
            {**args, "offsets": _offsets(contract, 1)},
            "each shard's seeded, perturbed maximum",
        )
        gathered = build.collective(
            "gather" if rooted else "all_gather",
            prov.ranks,
            stats,
            build.name("sample_arg_all"),
            count * row_bytes(Form.SAMPLE_ARG, prov.shape[0]),
            pair,
            {"dim": 1, **({"root": targets[0]} if rooted else {})},
            "one collective for all shards' pairs",
        )
        return build.project(
            "combine_max_arg",
            targets,
            gathered,
            build.name("sample"),
            DType.INT64,
            {},
            "the sample of the full rows, bitwise",
        )
    if form in (Form.TOPK, Form.TOKEN_LOGPROB, Form.SAMPLE):
        op, args = row_projection(build.contract, form)
        raw = complete_raw(build, targets)
        return build.project(
            op,
            targets,
            raw,
            build.name(form.value),
            form_dtype(form, build.contract.provenance.dtype),
            args,
            f"{op} of full rows at the source",
        )
    contract = build.contract
    prov = contract.provenance
    holders, tensor, count = prov.ranks, prov.tensor, len(prov.ranks)
    pl = prov.placement
    rows = prov.shape[0]
    rooted = len(targets) == 1
    gather = "gather" if rooted else "all_gather"

    def root(args: dict) -> dict:
        return {**args, **({"root": targets[0]} if rooted else {})}

    if form is Form.TOKEN:
        if isinstance(pl, Shard) and count > 1 and pl.dim == 1 and _flat(contract):
            stats = build.project(
                "local_max_arg",
                holders,
                tensor,
                build.name("max_arg"),
                form_dtype(Form.MAX_ARG, prov.dtype),
                {"offsets": _offsets(contract, 1)},
                "per-row (max, global index) of each vocabulary shard",
            )
            gathered_stats = build.collective(
                gather,
                holders,
                stats,
                build.name("max_arg_all"),
                count * row_bytes(Form.MAX_ARG, rows),
                form_dtype(Form.MAX_ARG, prov.dtype),
                root({"dim": 1}),
                "one collective for all shards' pairs",
            )
            return build.project(
                "combine_max_arg",
                targets,
                gathered_stats,
                build.name("token"),
                DType.INT64,
                {},
                "winner per row, lowest index on ties",
            )
        if isinstance(pl, Shard) and count > 1 and pl.dim == 0 and _flat(contract):
            tok = build.project(
                "argmax", holders, tensor, build.name("token_rows"), DType.INT64, {}, "each rank's rows"
            )
            return build.collective(
                gather, holders, tok, build.name("token"), row_bytes(Form.TOKEN, rows), DType.INT64, root({"dim": 0})
            )
        if isinstance(pl, Partial) and pl.op == "max" and count > 1:
            pair = form_dtype(Form.MAX_ARG, prov.dtype)
            stats = build.project(
                "local_max_arg",
                holders,
                tensor,
                build.name("max_arg"),
                pair,
                {"offsets": [0] * count},
                "per-addend (max, index) pairs",
            )
            gathered_stats = build.collective(
                gather,
                holders,
                stats,
                build.name("max_arg_all"),
                count * row_bytes(Form.MAX_ARG, rows),
                pair,
                root({"dim": 1}),
                "the argmax of a max is the winner of the addends' pairs: exact",
            )
            return build.project(
                "combine_max_arg",
                targets,
                gathered_stats,
                build.name("token"),
                DType.INT64,
                {},
                "winner per row, lowest index on ties",
            )
        raw = complete_raw(build, targets)
        return build.project("argmax", targets, raw, build.name("token"), DType.INT64, {}, "token at the source")
    # log-probabilities at the target ids
    distributed = contract.substitutability.allows("distributed_logsoftmax")
    if isinstance(pl, Shard) and count > 1 and pl.dim == 1 and distributed and _flat(contract):
        stats = build.project(
            "local_lse_stats",
            holders,
            tensor,
            build.name("lse"),
            DType.FLOAT32,
            {"offsets": _offsets(contract, 1)},
            "per-row (max, sum exp, target logit) of each vocabulary shard",
        )
        gathered_stats = build.collective(
            gather,
            holders,
            stats,
            build.name("lse_all"),
            count * row_bytes(Form.LSE_STATS, rows),
            DType.FLOAT32,
            root({"dim": 1}),
            "one collective instead of three all-reduces",
        )
        return build.project(
            "combine_lse_stats",
            targets,
            gathered_stats,
            build.name("logprob"),
            DType.FLOAT32,
            {},
            "log-sum-exp of the shards' statistics",
        )
    if isinstance(pl, Shard) and count > 1 and pl.dim == 0 and _flat(contract):
        lp = build.project(
            "logsoftmax_at",
            holders,
            tensor,
            build.name("logprob_rows"),
            DType.FLOAT32,
            {"row_offsets": _offsets(contract, 0)},
            "each rank's full rows",
        )
        return build.collective(
            gather, holders, lp, build.name("logprob"), row_bytes(Form.LOGPROB, rows), DType.FLOAT32, root({"dim": 0})
        )
    raw = complete_raw(build, targets)
    return build.project(
        "logsoftmax_at",
        targets,
        raw,
        build.name("logprob"),
        DType.FLOAT32,
        {},
        "log-softmax of full rows at the source",
    )


def fan_out(build: PlanBuilder, buf: str, nbytes: int, dtype: DType) -> None:
    """Broadcast ``buf`` from the consumer domain's bridge rank to every consumer rank, then deliver."""
    contract = build.contract
    consumers = contract.edge.consumer.ranks
    bc = contract.locality.bridge[1] if contract.locality.bridge else consumers[0]
    group = (bc,) + tuple(rank for rank in consumers if rank != bc)
    if len(group) > 1:
        buf = build.collective(
            "broadcast",
            group,
            buf,
            build.name("bcast"),
            nbytes,
            dtype,
            {"root": bc},
            "fan out inside the consumer's domain",
        )
    build.deliver(consumers, buf, dtype)


def _replicated(contract: Contract, form: Form, direct_shards: bool = False) -> Plan:
    """Every consumer rank observes the same thing (full, reduced, token, logprob)."""
    build = PlanBuilder(contract, PLANNER)
    prov = contract.provenance
    consumers = contract.edge.consumer.ranks
    region = full_region(prov.shape)
    nbytes = form_bytes(form, region, prov.dtype, observation_entries(contract))
    dtype = form_dtype(form, prov.dtype)
    if not contract.locality.cross_domain:
        buf = observable(build, form, consumers)
        build.deliver(consumers, buf, dtype)
        return build.plan()
    assert contract.locality.bridge is not None  # a cross-domain contract names its bridge ranks
    bp, bc = contract.locality.bridge
    if direct_shards:
        pl = prov.placement
        assert isinstance(pl, Shard)
        arrived = []
        for holding in prov.holdings:
            size = form_bytes(Form.RAW, holding.region, prov.dtype)
            if size:
                arrived.append(
                    build.send(
                        holding.rank,
                        bc,
                        prov.tensor,
                        build.name(f"from{holding.rank}"),
                        size,
                        prov.dtype,
                        "each shard crosses once, from its holder",
                    )
                )
        buf = (
            build.project("concat", (bc,), arrived, build.name("full"), prov.dtype, {"dim": pl.dim})
            if len(arrived) > 1
            else arrived[0]
        )
    else:
        obs = observable(build, form, (bp,))
        buf = build.send(bp, bc, obs, build.name("arrived"), nbytes, dtype, "one bridge message")
    fan_out(build, buf, nbytes, dtype)
    return build.plan()


def _owner_token(contract: Contract) -> Plan:
    build = PlanBuilder(contract, PLANNER)
    owners = tuple(owner.rank for owner in contract.demand.observations)
    index = [intervals_indices(owner.region[0]) for owner in contract.demand.observations]
    if not contract.locality.cross_domain:
        tok = observable(build, Form.TOKEN, owners)
        mine = build.project(
            "slice",
            owners,
            tok,
            build.name("mine"),
            DType.INT64,
            {"dim": 0, "index": index},
            "each owner keeps its own rows",
        )
        build.deliver(owners, mine, DType.INT64)
        return build.plan()
    assert contract.locality.bridge is not None  # a cross-domain contract names its bridge ranks
    bp, _ = contract.locality.bridge
    tok = observable(build, Form.TOKEN, (bp,))
    mine = build.name("mine")
    for owner, rows in zip(owners, index):
        part = build.project(
            "slice",
            (bp,),
            tok,
            build.name(f"rows_of{owner}"),
            DType.INT64,
            {"dim": 0, "index": [rows]},
            f"rows owned by rank {owner}",
        )
        build.send(bp, owner, part, mine, row_bytes(Form.TOKEN, len(rows)), DType.INT64, f"to its owner {owner} only")
    build.deliver(owners, mine, DType.INT64)
    return build.plan()


def _per_rank_chunks(contract: Contract) -> list[Plan]:
    """Consumer rank *j* observes chunk *j* along ``shard_dim`` (shard, or reduced and sharded)."""
    builders: list[Callable[[Contract], Plan | None]] = [_chunks_via_bridge, _chunks_direct]
    if not contract.locality.cross_domain:
        builders = [_chunks_same_domain]
    return [plan for plan in (make(contract) for make in builders) if plan is not None]


def _chunks_same_domain(contract: Contract) -> Plan:
    build = PlanBuilder(contract, PLANNER)
    prov = contract.provenance
    cons = contract.edge.consumer
    dim, holders, pl, tensor, dtype = cons.shard_dim, prov.ranks, prov.placement, prov.tensor, prov.dtype
    parts = len(cons.ranks)
    full = full_region(prov.shape)
    same_ranks = tuple(cons.ranks) == tuple(holders) and len(holders) > 1 and _flat(contract)
    if same_ranks and isinstance(pl, Shard) and pl.dim == dim:
        build.deliver(cons.ranks, tensor, dtype)
        return build.plan()
    if same_ranks and isinstance(pl, Shard):
        buf = build.collective(
            "all_to_all",
            holders,
            tensor,
            build.name("resharded"),
            form_bytes(Form.RAW, full, dtype),
            dtype,
            {"split_dim": dim, "concat_dim": pl.dim},
            f"Shard({pl.dim}) -> Shard({dim})",
        )
        build.deliver(cons.ranks, buf, dtype)
        return build.plan()
    if same_ranks and isinstance(pl, Partial) and not contract.exact_reduction:
        buf = build.collective(
            "reduce_scatter",
            holders,
            tensor,
            build.name("chunk"),
            len(holders) * form_bytes(Form.RAW, full, dtype),
            dtype,
            {"dim": dim, "op": pl.op},
            "complete and split in one collective",
        )
        build.deliver(cons.ranks, buf, dtype)
        return build.plan()
    whole = complete_raw(build, cons.ranks)
    buf = build.project(
        "chunk",
        cons.ranks,
        whole,
        build.name("chunk"),
        dtype,
        {"dim": dim, "parts": parts, "index": list(range(parts))},
        "each consumer rank keeps its chunk",
    )
    build.deliver(cons.ranks, buf, dtype)
    return build.plan()


def _chunks_via_bridge(contract: Contract) -> Plan:
    """Complete at the producer's bridge rank, one bridge message, split inside the consumer's domain."""
    build = PlanBuilder(contract, PLANNER)
    prov = contract.provenance
    cons = contract.edge.consumer
    dim, dtype = cons.shard_dim, prov.dtype
    parts = len(cons.ranks)
    assert contract.locality.bridge is not None  # a cross-domain contract names its bridge ranks
    bp, bc = contract.locality.bridge
    nbytes = form_bytes(Form.RAW, full_region(prov.shape), dtype)
    whole = complete_raw(build, (bp,))
    buf = build.send(bp, bc, whole, build.name("arrived"), nbytes, dtype, "one bridge message")
    if bc in cons.ranks:
        out = (
            build.collective(
                "scatter",
                cons.ranks,
                buf,
                build.name("chunk"),
                nbytes,
                dtype,
                {"dim": dim, "root": bc},
                "split inside the consumer's domain",
            )
            if parts > 1
            else buf
        )
    else:
        group = (bc,) + tuple(cons.ranks)
        bcast = build.collective("broadcast", group, buf, build.name("bcast"), nbytes, dtype, {"root": bc})
        out = build.project(
            "chunk",
            cons.ranks,
            bcast,
            build.name("chunk"),
            dtype,
            {"dim": dim, "parts": parts, "index": list(range(parts))},
        )
    build.deliver(cons.ranks, out, dtype)
    return build.plan()


def _chunks_direct(contract: Contract) -> Plan | None:
    """Each holder sends exactly the slice each consumer rank needs (no gather, no fan-out)."""
    prov = contract.provenance
    cons = contract.edge.consumer
    dim, dtype, pl = cons.shard_dim, prov.dtype, prov.placement
    assert dim is not None  # lower_candidates chunks only a request that names its dimension
    parts = len(cons.ranks)
    build = PlanBuilder(contract, PLANNER)
    if not _flat(contract):
        return None  # a DP x TP grid: the bridge candidate assembles the row blocks first
    if isinstance(pl, Partial):
        if contract.exact_reduction or _n(contract) == 1:
            return None
        src = build.collective(
            "reduce_scatter",
            prov.ranks,
            prov.tensor,
            build.name("reduced"),
            _n(contract) * form_bytes(Form.RAW, full_region(prov.shape), dtype),
            dtype,
            {"dim": dim, "op": pl.op},
            "complete and split in one collective inside the producer's domain",
        )
        count = _n(contract)
        pieces = [(rank, shard_bounds(prov.shape[dim], count, position)) for position, rank in enumerate(prov.ranks)]
    elif isinstance(pl, Shard) and pl.dim == dim:
        src = prov.tensor
        pieces = [
            (holding.rank, (holding.region[dim][0][0], holding.region[dim][0][1]) if holding.region[dim] else (0, 0))
            for holding in prov.holdings
        ]
    elif isinstance(pl, Replicate) or _n(contract) == 1:
        assert contract.locality.bridge is not None  # a cross-domain contract names its bridge ranks
        src = prov.tensor
        pieces = [(contract.locality.bridge[0], (0, prov.shape[dim]))]
    else:
        return None
    bytes_per_slice = form_bytes(Form.RAW, full_region(prov.shape), dtype) // max(1, prov.shape[dim])
    mine = build.name("mine")
    received: dict[int, list[str]] = {}
    for index, rank in enumerate(cons.ranks):
        lo, hi = shard_bounds(prov.shape[dim], parts, index)
        for holder, (plo, phi) in pieces:
            start, stop = max(lo, plo), min(hi, phi)
            if stop <= start:
                continue
            buf = src
            if (start, stop) != (plo, phi):
                buf = build.project(
                    "slice",
                    (holder,),
                    src,
                    build.name(f"for{rank}"),
                    dtype,
                    {"dim": dim, "start": start - plo, "stop": stop - plo},
                    f"the part consumer rank {rank} reads",
                )
            name = mine if (lo, hi) == (start, stop) else build.name(f"part{holder}to{rank}")
            build.send(
                holder,
                rank,
                buf,
                name,
                (stop - start) * bytes_per_slice,
                dtype,
                "one message per piece, from its holder",
            )
            received.setdefault(rank, []).append(name)
    for index, rank in enumerate(cons.ranks):
        held = received.get(rank, [])
        if len(held) > 1:
            build.project("concat", (rank,), held, mine, dtype, {"dim": dim})
        elif not held:
            return None  # an empty chunk: the bridge candidate covers it
    build.deliver(cons.ranks, mine, dtype)
    return build.plan()
