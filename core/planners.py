"""The planners: one registry that the CLI, the dashboard and the benchmarks read.

Three planners turn a :class:`~meshpact.core.contract.Contract` into a
:class:`~meshpact.core.plan.Plan`: the lowerer (:func:`meshpact.core.lowerer.lower`, which
keeps the contract by construction) and two baselines that do not read it
(:mod:`meshpact.core.baselines`): *layout-only*, DTensor's transition table plus a bridge
hop per local tensor, and *byte-only*, the cheapest candidate in bytes. Each entry has a
machine name (the key of ``--json`` documents) and a label for people.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from .baselines import byte_only, layout_only
from .contract import Contract
from .lowerer import lower
from .plan import Plan

__all__ = ["Planner", "PLANNERS", "planners", "planner_named"]


@dataclass(frozen=True)
class Planner:
    """One planner: its machine name, its label for people and the function itself."""

    name: str
    label: str
    plan: Callable[[Contract], Plan]
    about: str


PLANNERS: tuple[Planner, ...] = (
    Planner("meshpact", "meshpact lowerer", lower, "keeps the contract by construction, cheapest α-β time"),
    Planner("layout_only", "layout-only", layout_only, "DTensor's transition table plus a bridge hop per tensor"),
    Planner("byte_only", "byte-only", byte_only, "the candidate with the fewest payload bytes, blind to semantics"),
)


def planners() -> Mapping[str, Planner]:
    """Label -> planner, in a fixed order (the lowerer first)."""
    return {p.label: p for p in PLANNERS}


def planner_named(name: str) -> Planner:
    """The planner whose machine name is ``name``."""
    for p in PLANNERS:
        if p.name == name:
            return p
    raise KeyError(name)
