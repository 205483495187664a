"""Planning for the Plans page: edges from widget values, every planner judged by the checker.

:func:`edge_from_facts` turns the page's widgets (domains, placement, shape, dtype,
request, consumer ranks) into an :class:`~meshpact.core.facts.Edge`, raising the core's
readable :class:`FactError` for a combination that cannot be. :func:`judge` compiles the
edge's contract, runs every planner of the registry (:mod:`meshpact.core.planners`: the
lowerer and the two baselines) and checks each plan against the contract, so the page
only lays the outcomes side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from meshpact.core.errors import MeshpactError
from meshpact.core.facts import Consumer, DType, Edge, Mesh, ProducerTensor, Request
from meshpact.core.placement import parse_placement
from meshpact.core.plan import Plan, PlanCost, plan_cost
from meshpact.core.checker import Violation
from meshpact.core.planners import planner_named, planners
from meshpact.core.runvalues import RunReport

__all__ = [
    "PlannerOutcome",
    "Judgement",
    "edge_from_facts",
    "judge",
    "real_edges",
    "steps_rows",
    "ViolationGroup",
    "violation_groups",
    "run_uploaded",
    "facet_summaries",
]


@dataclass(frozen=True)
class PlannerOutcome:
    planner: str
    plan: Plan | None
    cost: PlanCost | None
    ok: bool
    reasons: tuple[str, ...]  # the checker's violations, or why the planner produced no plan
    violations: tuple[Violation, ...] = ()


@dataclass(frozen=True)
class ViolationGroup:
    """Violations of one kind: how many, and the first few as a person reads them."""

    kind: str
    count: int
    examples: tuple[str, ...]


@dataclass(frozen=True)
class Judgement:
    edge: Edge
    contract: Any  # meshpact.core.contract.Contract
    outcomes: tuple[PlannerOutcome, ...]


def real_edges() -> dict[str, Any]:
    """The catalog of real edges (``core/edges.py``): name -> ``RealEdge`` (its ``edge``,
    ``model`` and where each dimension comes from)."""
    from meshpact.core.edges import EDGES

    return dict(EDGES)


def edge_from_facts(
    mesh: Mesh,
    *,
    producer_domain: str,
    consumer_domain: str,
    placement: str,
    shape: Sequence[int],
    dtype: str,
    request: str,
    consumer_ranks: int,
    shard_dim: int = 0,
    name: str = "custom edge",
    producer_ranks: int | None = None,
    k: int | None = None,
    seed: int | None = None,
    temperature: float | None = None,
    pad_vocab: bool = False,
) -> Edge:
    """An edge from the page's facts: the producer over the first ``producer_ranks`` ranks of
    its domain (its tensor-parallel degree; all of them by default), the first
    ``consumer_ranks`` ranks of the consumer domain; owner-scoped rows go to the consumer
    ranks in turn; ``k`` (topk), ``seed`` and ``temperature`` (sample) as the request takes them;
    ``pad_vocab`` pads logits to a multiple of TP x 128 columns, the padding masked."""
    pdom = mesh.domain(producer_domain)
    if producer_ranks is not None and producer_ranks != pdom.size:
        if not 1 <= producer_ranks <= pdom.size:
            raise MeshpactError(
                f"producer TP degree: expected 1..{pdom.size} (the size of {pdom.name}), got {producer_ranks}"
            )
        kept = tuple(sorted(pdom.ranks)[:producer_ranks])
        bridge = pdom.bridge_rank if pdom.bridge_rank in kept else kept[0]
        narrowed = replace(pdom, ranks=kept, bridge_rank=bridge)
        mesh = replace(mesh, domains=tuple(narrowed if d.name == pdom.name else d for d in mesh.domains))
    cdom = mesh.domain(consumer_domain)
    if not 1 <= consumer_ranks <= cdom.size:
        raise MeshpactError(f"consumer ranks: expected 1..{cdom.size} (the size of {cdom.name}), got {consumer_ranks}")
    ranks = tuple(sorted(cdom.ranks)[:consumer_ranks])
    req = Request(request)
    owners = tuple(ranks[i % len(ranks)] for i in range(int(shape[0]))) if req is Request.OWNER_TOKEN else None
    shape = tuple(int(s) for s in shape)
    vocab_size = None
    if pad_vocab and req.reads_logits:
        step = (producer_ranks or pdom.size) * 128
        vocab_size, shape = shape[-1], shape[:-1] + (-(-shape[-1] // step) * step,)
    producer = ProducerTensor(
        name="y",
        op="producer",
        shape=shape,
        dtype=DType(dtype),
        domain=producer_domain,
        placement=parse_placement(placement),
        vocab_size=vocab_size,
    )
    consumer = Consumer(
        name="consumer",
        domain=consumer_domain,
        ranks=ranks,
        request=req,
        owners=owners,
        shard_dim=shard_dim if req in (Request.SHARD, Request.REDUCED) else None,
        k=k if req is Request.TOPK else None,
        seed=seed if req is Request.SAMPLE else None,
        temperature=temperature if req is Request.SAMPLE else None,
    )
    return Edge(name=name, mesh=mesh, producer=producer, consumer=consumer)


def judge(edge: Edge) -> Judgement:
    """The edge's contract, and every planner's plan with the checker's verdict and cost."""
    from meshpact.core.checker import check
    from meshpact.core.contract import compile_contract

    contract = compile_contract(edge)
    outcomes = []
    for label, planner in planners().items():
        try:
            plan = planner.plan(contract)
        except MeshpactError as exc:
            outcomes.append(PlannerOutcome(label, None, None, False, (f"no plan: {exc}",)))
            continue
        report = check(plan, contract)
        outcomes.append(
            PlannerOutcome(
                label,
                plan,
                plan_cost(plan, edge.mesh),
                report.ok,
                tuple(str(v) for v in report.violations),
                report.violations,
            )
        )
    return Judgement(edge, contract, tuple(outcomes))


def violation_groups(violations: Sequence[Violation], examples: int = 2) -> list[ViolationGroup]:
    """Violations grouped by kind (most frequent first), each with its count and first examples."""
    groups: dict[str, list[Violation]] = {}
    for v in violations:
        groups.setdefault(v.kind.value, []).append(v)
    return [
        ViolationGroup(kind, len(vs), tuple(str(v) for v in vs[:examples]))
        for kind, vs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    ]


def run_uploaded(edge: Edge, name: str, content: bytes) -> RunReport:
    """Interpret the lowerer's plan for ``edge`` on an uploaded values file (as ``plan --run``)."""
    from meshpact.core.contract import compile_contract
    from meshpact.core.runvalues import parse_values, run_values, values_from

    contract = compile_contract(edge)
    inputs = values_from(parse_values(name, content), contract, name)
    return run_values(planner_named("meshpact").plan(contract), contract, inputs)


def steps_rows(plan: Plan) -> list[dict[str, Any]]:
    """A plan's steps as table rows."""
    return [
        {
            "#": i,
            "kind": s.kind.value,
            "op": s.op,
            "ranks": ", ".join(map(str, s.ranks))
            if len(s.ranks) <= 6
            else f"{s.ranks[0]}..{s.ranks[-1]} ({len(s.ranks)})",
            "bytes": s.payload_bytes,
            "dtype": s.dtype.value,
            "link": s.link.value if s.link else "",
            "output": s.output,
            "note": s.note,
        }
        for i, s in enumerate(plan.steps, start=1)
    ]


def facet_summaries(contract: Any) -> dict[str, str]:
    """One line per facet of a contract, for a person to read before the details."""
    p, sub, loc = contract.provenance, contract.substitutability, contract.locality
    allowed = ", ".join(s.name for s in sub.substitutes if s.allowed) or "nothing"
    crossing = (
        (
            f"crosses {loc.link.value.replace('_', ' ')} from {loc.producer_domain} to {loc.consumer_domain} "
            f"via bridge ranks {list(loc.bridge or ())}"
        )
        if loc.cross_domain
        else f"inside {loc.producer_domain}"
    )
    return {
        "provenance": f"{p.op} → {p.tensor} {list(p.shape)} {p.dtype.value}, {p.placement!r} over "
        f"{len(p.holdings)} ranks of {p.domain}",
        "substitutability": f"judged {sub.equivalence.value}; may stand in: {allowed}",
        "completion": "; ".join(contract.completion.requirements),
        "authority": f"{len(contract.authority.senders)} authoritative sender(s)"
        + (", owner-scoped rows" if contract.authority.owner_of_row else ""),
        "demand": f"{contract.demand.request.value}: {len(contract.demand.observations)} observing rank(s), "
        f"{len(contract.demand.silent)} silent",
        "locality": crossing,
    }
