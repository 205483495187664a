"""Policy comparison for the Mesh page: what each recovery policy would cost now.

Given the mesh, the failed ranks and how the fault looks (a broken communicator with
every process alive, or lost ranks), this asks the recovery cost model for one
:class:`RecoveryBreakdown` per policy and derives the two numbers the page leads with:
the downtime reduction factor of in-memory rebind over a cold restart, and how much
training state stays in device memory instead of being reloaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from meshpact.core import recovery_costs as _recovery
from meshpact.core.facts import Mesh
from meshpact.core.mesh import health
from meshpact.core.recovery import Policy, RecoveryBreakdown

__all__ = ["PolicyComparison", "cost_model_available", "compare_policies"]


@dataclass(frozen=True)
class PolicyComparison:
    breakdowns: tuple[RecoveryBreakdown, ...]
    ranks_in_job: int  # ranks that rebuild communicators (survivors under excise)
    retained_ranks: int  # ranks whose state stays in device memory under in-memory rebind
    retained_bytes: float
    reloaded_bytes: float  # what a checkpoint restore reads back

    def total_s(self, policy: Policy) -> float:
        return next(b.total_s for b in self.breakdowns if b.policy is policy)

    @property
    def downtime_reduction(self) -> float:
        """Cold restart's downtime divided by in-memory rebind's."""
        fast = self.total_s(Policy.IN_MEMORY)
        return self.total_s(Policy.COLD_RESTART) / fast if fast > 0 else float("inf")


def cost_model_available() -> bool:
    return hasattr(_recovery, "estimate_recovery")


def compare_policies(
    mesh: Mesh,
    failed: Iterable[int],
    *,
    rank_loss: bool,
    steps_since_checkpoint: int,
    step_s: float,
) -> PolicyComparison:
    """Every policy's stage breakdown for this failure.

    A checkpoint restore (cold or in job) replays the steps since the last checkpoint;
    in-memory rebind replays only the interrupted step; excise continues on the
    survivors and replays nothing.
    """
    state = health(mesh, failed)
    if not state.failed:
        raise ValueError("no failed ranks: pick at least one rank to fail")
    estimate = _recovery.estimate_recovery  # type: ignore[attr-defined]
    fault = _recovery.FaultImpact.RANK_LOSS if rank_loss else _recovery.FaultImpact.TRANSIENT  # type: ignore[attr-defined]
    costs = _recovery.DEFAULT_RECOVERY_COSTS  # type: ignore[attr-defined]
    world = mesh.world_size
    models = _recovery.POLICY_MODELS
    replay = {p: steps_since_checkpoint if m.from_checkpoint(fault) else 0 if m.excises else 1 for p, m in models.items()}
    ranks = {p: world for p in Policy}
    ranks[Policy.EXCISE] = state.healthy
    out = tuple(estimate(p, ranks[p], costs, impact=fault, replay_steps=replay[p], step_s=step_s) for p in Policy)
    retained = state.healthy if rank_loss else world
    per_rank = float(costs.state_bytes_per_rank)
    return PolicyComparison(
        breakdowns=out,
        ranks_in_job=state.healthy,
        retained_ranks=retained,
        retained_bytes=retained * per_rank,
        reloaded_bytes=world * per_rank,
    )
