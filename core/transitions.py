"""Structural transitions: every shape of edge the planner must handle, enumerated.

A transition is one combination of

* the **source placement** over the producer's three ranks: ``Replicate()``, ``Shard(0)``
  (rows), ``Shard(1)`` (vocabulary / hidden), ``Partial(sum)``;
* the **consumer's demand**: ``full``, ``logprob``, ``token``, ``owner_token``,
  ``shard`` (along dim 1) and, for partial sources only (a ``reduced`` request reads
  addends), ``reduced``: 3 x 5 + 1 x 6 = 21 combinations;
* the **consumer's scope**: one rank (not the domain's bridge rank) or every rank of
  its domain;
* the **domain relation**: the producer's own domain, another vendor on the same host
  (host bridge), or another vendor on another host (Ethernet).

That is 21 x 2 x 3 = 126 transitions over a ``[6, 10]`` float32 tensor (uneven chunks on
purpose: 10 columns over 3 ranks). :func:`evaluate_transitions` lowers and checks each
one, checks the layout-only plan, and runs every byte-only candidate through the numeric
interpreter to learn which are really wrong, then counts how many of those the checker
rejects.

Same-host and other-host transitions differ only in the class of the bridge link: the
report counts the *structurally distinct* cases, those whose lowered plans differ once
link labels are set aside (84 of the 126). The byte-only candidates counted are the ones
its grammar forms (:data:`CANDIDATE_SET`); the lowerer's and layout-only's own plans,
which ``byte_only`` also weighs, are not counted again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .baselines import byte_only_candidates, layout_only
from .checker import check
from .contract import compile_contract
from .facts import Consumer, Domain, DType, Edge, Mesh, ProducerTensor, Request, Vendor
from .interpreter import judge
from .lowerer import lower
from .placement import Partial, Placement, Replicate, Shard

__all__ = ["Transition", "TransitionResult", "TransitionReport", "enumerate_transitions", "evaluate_transitions"]

PLACEMENTS: tuple[Placement, ...] = (Replicate(), Shard(0), Shard(1), Partial("sum"))
REQUESTS: tuple[Request, ...] = (
    Request.FULL,
    Request.LOGPROB,
    Request.TOKEN,
    Request.OWNER_TOKEN,
    Request.SHARD,
    Request.REDUCED,
)
SCOPES = ("one_rank", "all_ranks")
RELATIONS = ("same_domain", "same_host", "other_host")
SHAPE = (6, 10)
PLANNER_CANDIDATES = ("meshpact", "layout_only")  # byte_only also weighs these; counted apart
CANDIDATE_SET = (
    "byte-only grammar: {project at the source, local data only, per-rank statistics, native "
    "reduction} x {send + fan out, send to the bridge rank only} across domains ({...} + deliver to "
    "all inside one), plus one collective reaching across the domains; the lowerer's and "
    "layout-only's plans are weighed too but not counted here"
)


@dataclass(frozen=True)
class Transition:
    index: int
    placement: Placement
    request: Request
    scope: str
    relation: str
    edge: Edge

    @property
    def label(self) -> str:
        return f"{self.placement!r} -> {self.request.value} ({self.scope}, {self.relation})"


def _mesh(relation: str) -> Mesh:
    host = "hostB" if relation == "other_host" else "hostA"
    return Mesh(
        domains=(
            Domain("cuda@hostA", Vendor.CUDA, "hostA", (0, 1, 2)),
            Domain(f"cann@{host}", Vendor.CANN, host, (3, 4)),
        )
    )


def enumerate_transitions() -> list[Transition]:
    """The 126 transitions, in a fixed order."""
    out: list[Transition] = []
    for placement in PLACEMENTS:
        for request in REQUESTS:
            if request is Request.REDUCED and not isinstance(placement, Partial):
                continue
            for scope in SCOPES:
                for relation in RELATIONS:
                    mesh = _mesh(relation)
                    dom = mesh.domains[0] if relation == "same_domain" else mesh.domains[1]
                    ranks = dom.ranks if scope == "all_ranks" else dom.ranks[-1:]
                    per = -(-SHAPE[0] // len(ranks))
                    consumer = Consumer(
                        "consumer",
                        dom.name,
                        ranks,
                        request,
                        owners=tuple(ranks[r // per] for r in range(SHAPE[0]))
                        if request is Request.OWNER_TOKEN
                        else None,
                        shard_dim=1 if request is Request.SHARD else None,
                    )
                    producer = ProducerTensor("x", "producer_op", SHAPE, DType.FLOAT32, "cuda@hostA", placement)
                    name = f"t{len(out):03d}"
                    out.append(
                        Transition(len(out), placement, request, scope, relation, Edge(name, mesh, producer, consumer))
                    )
    return out


@dataclass(frozen=True)
class TransitionResult:
    transition: Transition
    meshpact_ok: bool
    meshpact_startups: int
    layout_only_ok: bool
    layout_only_startups: int
    candidates: int  # the grammar's own candidates (not the planners' plans)
    invalid: int  # candidates that go numerically wrong
    invalid_rejected: int  # ... of which the checker rejects
    accepted_wrong: tuple[str, ...]  # labels of candidates the checker accepted yet went wrong
    structure: str  # the lowered plan with link labels set aside


@dataclass(frozen=True)
class TransitionReport:
    results: tuple[TransitionResult, ...]

    def to_dict(self) -> dict[str, Any]:
        r = self.results
        distinct = {(repr(x.transition.placement), x.transition.request, x.transition.scope, x.structure) for x in r}
        return {
            "transitions": len(r),
            "structurally_distinct": len(distinct),
            "meshpact_valid": sum(x.meshpact_ok for x in r),
            "layout_only_complete": sum(x.layout_only_ok for x in r),
            "byte_only_candidates": sum(x.candidates for x in r),
            "byte_only_invalid": sum(x.invalid for x in r),
            "byte_only_invalid_rejected": sum(x.invalid_rejected for x in r),
            "candidate_set": CANDIDATE_SET,
        }


def evaluate_transitions(seed: int = 0) -> TransitionReport:
    """Lower, check and numerically judge every transition and its baselines."""
    results = []
    for t in enumerate_transitions():
        c = compile_contract(t.edge)
        plan = lower(c)
        lo = layout_only(c)
        cands = [x for x in byte_only_candidates(c) if x.label not in PLANNER_CANDIDATES]
        invalid = rejected = 0
        wrong: list[str] = []
        for cand in cands:
            truth = judge(cand.plan, c, seed)
            verdict = check(cand.plan, c).ok
            if not truth.ok:
                invalid += 1
                rejected += not verdict
                if verdict:
                    wrong.append(cand.label)
        results.append(
            TransitionResult(
                t,
                check(plan, c).ok,
                plan.startups,
                check(lo, c).ok,
                lo.startups,
                len(cands),
                invalid,
                rejected,
                tuple(wrong),
                _structure(plan),
            )
        )
    return TransitionReport(tuple(results))


def _structure(plan: Any) -> str:
    """``plan`` as JSON with link classes and domain names set aside."""
    steps = [{k: v for k, v in st.to_dict().items() if k not in ("link", "domain")} for st in plan.steps]
    return json.dumps(steps, sort_keys=True)
