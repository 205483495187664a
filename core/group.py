"""Edge groups: one producer tensor read by several consumers, each with its own request.

A serving engine reads one logits tensor several ways at once (a sampler wants a token, a
scorer log-probabilities, a logger the top-k), and a consumer group may span two native
domains. An :class:`EdgeGroup` holds the producer and its consumers; :func:`split_by_domain`
turns a group of ranks that spans domains into one consumer per domain (no native
collective spans two vendors, so each domain is served through its own bridge). Every
consumer gets its own contract, lowered and checked on its own; :func:`plan_group` joins the
plans into one, renaming each consumer's buffers apart, so one schedule serves them all and
its cost is the sum of what each consumer needs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from .checker import CheckReport, check
from .contract import Contract, compile_contract
from .errors import FactError
from .facts import Consumer, Edge, Mesh, ProducerTensor, Request
from .lowerer import lower
from .plan import Plan, Step

__all__ = ["EdgeGroup", "GroupPlan", "split_by_domain", "plan_group"]


@dataclass(frozen=True)
class EdgeGroup:
    """One producer tensor and the consumers that read it."""

    name: str
    mesh: Mesh
    producer: ProducerTensor
    consumers: tuple[Consumer, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "consumers", tuple(self.consumers))
        if not self.consumers:
            raise FactError(f"edge group {self.name!r}.consumers: expected at least one consumer")
        names = [c.name for c in self.consumers]
        if len(set(names)) != len(names):
            raise FactError(f"edge group {self.name!r}.consumers: names must differ, got {names}")

    def edges(self) -> tuple[Edge, ...]:
        """One edge per consumer (each validated as a single edge is)."""
        return tuple(Edge(f"{self.name}/{c.name}", self.mesh, self.producer, c) for c in self.consumers)


@dataclass(frozen=True)
class GroupPlan:
    """Each consumer's contract, plan and check, and the joined plan."""

    contracts: tuple[Contract, ...]
    plans: tuple[Plan, ...]
    reports: tuple[CheckReport, ...]
    plan: Plan

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.reports)

    def to_dict(self) -> dict[str, Any]:
        return {
            "consumers": [
                {
                    "consumer": c.edge.consumer.name,
                    "request": c.edge.consumer.request.value,
                    "startups": p.startups,
                    "payload_bytes": p.payload_bytes,
                    "check": r.to_dict(),
                }
                for c, p, r in zip(self.contracts, self.plans, self.reports)
            ],
            "startups": self.plan.startups,
            "payload_bytes": self.plan.payload_bytes,
            "ok": self.ok,
        }


def split_by_domain(
    mesh: Mesh, name: str, ranks: Sequence[int], request: Request | str, **args: Any
) -> tuple[Consumer, ...]:
    """A consumer group over ``ranks`` (possibly in several domains) as one consumer per domain."""
    by_domain: dict[str, list[int]] = {}
    for r in ranks:
        by_domain.setdefault(mesh.domain_of(int(r)).name, []).append(int(r))
    if len(by_domain) > 1 and args.get("owners") is not None:
        raise FactError(
            f"consumer {name!r}: owner-scoped rows cannot be split across domains; give one consumer "
            "per domain with its own owners"
        )
    return tuple(
        Consumer(f"{name}@{dom}" if len(by_domain) > 1 else name, dom, tuple(rs), Request(request), **args)
        for dom, rs in by_domain.items()
    )


def _renamed(step: Step, prefix: str, tensor: str) -> Step:
    def name(buf: str) -> str:
        return buf if buf == tensor else prefix + buf

    return replace(step, inputs=tuple(name(b) for b in step.inputs), output=name(step.output))


def plan_group(group: EdgeGroup) -> GroupPlan:
    """Contract, lower and check each consumer; join the plans with buffers renamed apart."""
    contracts = tuple(compile_contract(e) for e in group.edges())
    plans = tuple(lower(c) for c in contracts)
    reports = tuple(check(p, c) for p, c in zip(plans, contracts))
    tensor = group.producer.name
    steps = tuple(_renamed(s, f"{c.edge.consumer.name}:", tensor) for c, p in zip(contracts, plans) for s in p.steps)
    return GroupPlan(contracts, plans, reports, Plan(group.name, "meshpact", steps))
