"""Fault traces: when faults strike, what they do, and which ranks they take.

A trace is drawn once and replayed under every policy, so policies are compared on the
same faults. Per-rank faults are independent Poisson processes; their superposition is
one Poisson process at the cluster rate ``ranks / MTBF``, with the rank drawn uniformly.
Drawing it that way costs time in the number of faults, not in the number of ranks.

Three processes are superposed: transient faults, rank losses and hangs. A rank loss takes
its whole node with probability ``node_fraction`` and its whole rack with probability
``rack_fraction`` (correlated failures: a node's power or host, a rack's switch). Ranks
are numbered node by node, so a node is ``ranks_per_node`` consecutive ranks and a rack
``ranks_per_node * nodes_per_rack``. The scope is drawn from its own random stream, so a
trace without node or rack failures is the same trace it was before they existed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshpact.core.errors import ScenarioError
from meshpact.core.recovery_costs import FaultImpact, FaultScope
from meshpact.core.scenario import FaultsSpec

__all__ = ["Fault", "fault_trace", "cluster_rate_per_s", "scope_ranks"]


@dataclass(frozen=True)
class Fault:
    """One fault: at ``t``, ``impact`` on ranks ``rank .. rank + span - 1``."""

    t: float
    impact: FaultImpact
    rank: int
    span: int = 1  # consecutive ranks taken down together (1, a node, a rack)

    @property
    def ranks(self) -> range:
        return range(self.rank, self.rank + self.span)

    def to_dict(self) -> dict:
        return {"t": self.t, "impact": self.impact.value, "rank": self.rank, "span": self.span}


def cluster_rate_per_s(mtbf_hours: float | None, ranks: int) -> float:
    """Faults per second of the whole cluster for a per-rank MTBF (0 when there is none)."""
    return 0.0 if mtbf_hours is None else ranks / (mtbf_hours * 3600.0)


def scope_ranks(faults: FaultsSpec, scope: FaultScope) -> int:
    """Ranks in one failure domain of ``scope``."""
    return {
        FaultScope.RANK: 1,
        FaultScope.NODE: faults.ranks_per_node,
        FaultScope.RACK: faults.ranks_per_node * faults.nodes_per_rack,
    }[scope]


def _widen(faults: FaultsSpec, rank: int, scope: FaultScope, ranks: int) -> tuple[int, int]:
    """(first rank, span) of the ``scope`` domain holding ``rank``, clipped to the job."""
    size = scope_ranks(faults, scope)
    first = rank - rank % size
    return first, min(size, ranks - first)


def fault_trace(
    faults: FaultsSpec, ranks: int, horizon_s: float, seed: int | None = None, source: str = "scenario"
) -> tuple[Fault, ...]:
    """Faults in ``[0, horizon_s)``: the random processes plus the scripted events, in time order.

    Given the count, the times of a Poisson process on an interval are independent and
    uniform; the count itself is Poisson with mean ``rate * horizon``.
    """
    seed = faults.seed if seed is None else seed
    rng = np.random.default_rng(seed)
    scope_rng = np.random.default_rng([seed, 1])
    out: list[Fault] = []
    for impact, mtbf in (
        (FaultImpact.TRANSIENT, faults.rank_mtbf_hours),
        (FaultImpact.RANK_LOSS, faults.rank_loss_mtbf_hours),
        (FaultImpact.HANG, faults.hang_mtbf_hours),
    ):
        rate = cluster_rate_per_s(mtbf, ranks)
        n = int(rng.poisson(rate * horizon_s)) if rate > 0 else 0
        if n == 0:
            continue
        times = rng.uniform(0.0, horizon_s, n)
        who = rng.integers(0, ranks, n)
        if impact is FaultImpact.RANK_LOSS and (faults.node_fraction or faults.rack_fraction):
            u = scope_rng.uniform(0.0, 1.0, n)
            for t, r, x in zip(times, who, u):
                scope = (
                    FaultScope.RACK
                    if x < faults.rack_fraction
                    else FaultScope.NODE
                    if x < faults.rack_fraction + faults.node_fraction
                    else FaultScope.RANK
                )
                first, span = _widen(faults, int(r), scope, ranks)
                out.append(Fault(float(t), impact, first, span))
        else:
            out.extend(Fault(float(t), impact, int(r)) for t, r in zip(times, who))
    for i, s in enumerate(faults.scripted):
        if s.rank >= ranks:
            raise ScenarioError(
                f"{source}: faults.scripted.{i}.rank: rank {s.rank} is not in the job; expected 0..{ranks - 1}"
            )
        if s.at_s < horizon_s:
            first, span = _widen(faults, int(s.rank), s.scope, ranks)
            out.append(Fault(float(s.at_s), FaultImpact(s.impact), first, span))
    out.sort(key=lambda f: (f.t, f.rank))
    return tuple(out)
