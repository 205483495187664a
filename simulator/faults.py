"""Fault traces: when faults strike, of what kind, and on which rank.

A trace is drawn once and replayed under every policy, so policies are compared on the
same faults. Per-rank faults are independent Poisson processes; their superposition is
one Poisson process at the cluster rate ``ranks / MTBF``, with the rank drawn uniformly.
Drawing it that way costs time in the number of faults, not in the number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshpact.core.errors import ScenarioError
from meshpact.core.recovery import FaultKind
from meshpact.core.scenario import FaultsSpec

__all__ = ["Fault", "fault_trace", "cluster_rate_per_s"]


@dataclass(frozen=True)
class Fault:
    t: float
    kind: FaultKind
    rank: int

    def to_dict(self) -> dict:
        return {"t": self.t, "kind": self.kind.value, "rank": self.rank}


def cluster_rate_per_s(mtbf_hours: float | None, ranks: int) -> float:
    """Faults per second of the whole cluster for a per-rank MTBF (0 when there is none)."""
    return 0.0 if mtbf_hours is None else ranks / (mtbf_hours * 3600.0)


def fault_trace(
    faults: FaultsSpec, ranks: int, horizon_s: float, seed: int | None = None, source: str = "scenario"
) -> tuple[Fault, ...]:
    """Faults in ``[0, horizon_s)``: the random process plus the scripted events, in time order.

    Given the count, the times of a Poisson process on an interval are independent and
    uniform; the count itself is Poisson with mean ``rate * horizon``.
    """
    rng = np.random.default_rng(faults.seed if seed is None else seed)
    out: list[Fault] = []
    for kind, mtbf in ((FaultKind.TRANSIENT, faults.rank_mtbf_hours), (FaultKind.RANK_LOSS, faults.rank_loss_mtbf_hours)):
        rate = cluster_rate_per_s(mtbf, ranks)
        n = int(rng.poisson(rate * horizon_s)) if rate > 0 else 0
        times = rng.uniform(0.0, horizon_s, n)
        who = rng.integers(0, ranks, n)
        out.extend(Fault(float(t), kind, int(r)) for t, r in zip(times, who))
    for i, s in enumerate(faults.scripted):
        if s.rank >= ranks:
            raise ScenarioError(f"{source}: faults.scripted.{i}.rank: rank {s.rank} is not in the job; expected 0..{ranks - 1}")
        if s.at_s < horizon_s:
            out.append(Fault(float(s.at_s), FaultKind(s.kind), int(s.rank)))
    out.sort(key=lambda f: (f.t, f.rank))
    return tuple(out)
