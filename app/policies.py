"""Policy comparison for the Mesh page: what each recovery policy would cost for these failures.

Which ranks failed matters, not only how many. :func:`failure_shape` names the domains
and hosts that lost every rank and the bridge ranks that failed; :func:`compare_policies`
turns that into one :class:`RecoveryBreakdown` per policy that can apply, and a reason
for each one that cannot:

- a lost host takes its processes with it, so the fault is a rank loss whatever the
  page's toggle says;
- a lost domain leaves no rank that holds its state in memory, so in-memory rebind cannot
  apply (a checkpoint must be read back), and excise cannot either (no rank is left to do
  that domain's part of the work);
- in-memory rebind rebuilds only the communicators a failed rank belonged to (a failed
  bridge rank adds the bridge), so its figures grow with the ranks those communicators
  span; a restore rebuilds every communicator and reloads every rank.

It also derives the two numbers the page leads with: the downtime reduction factor of
in-memory rebind over a cold restart, and how much training state stays in device memory.
:data:`POLICY_EXPLAINED` says in one sentence what each policy does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

from meshpact.core.facts import Mesh
from meshpact.core.mesh import health
from meshpact.core.recovery import Policy, RecoveryBreakdown, Stage
from meshpact.core.recovery_costs import DEFAULT_RECOVERY_COSTS, POLICY_MODELS, FaultImpact, estimate_recovery

__all__ = [
    "FailureShape",
    "PolicyComparison",
    "POLICY_EXPLAINED",
    "failure_shape",
    "compare_policies",
    "comparison_rows",
]

POLICY_EXPLAINED: Mapping[Policy, str] = {p: p.explained for p in Policy}


@dataclass(frozen=True)
class FailureShape:
    """Where the failed ranks are: whole domains and hosts lost, bridge ranks among them."""

    failed: frozenset[int]
    lost_domains: tuple[str, ...] = ()
    lost_hosts: tuple[str, ...] = ()
    failed_bridges: tuple[int, ...] = ()  # failed ranks that carried their domain's bridge
    rebuild_ranks: int = 0  # ranks of the communicators a failed rank belonged to


def failure_shape(mesh: Mesh, failed: Iterable[int]) -> FailureShape:
    state = health(mesh, failed)
    dead = state.failed
    lost_domains = tuple(d.name for d in mesh.domains if set(d.ranks) <= dead)
    lost_hosts = tuple(h for h in mesh.hosts if all(set(d.ranks) <= dead for d in mesh.domains if d.host == h))
    bridges = tuple(sorted(d.bridge_rank for d in mesh.domains if d.bridge_rank is not None and d.bridge_rank in dead))
    touched: set[int] = set()
    for c in state.broken:
        touched.update(c.ranks)
    return FailureShape(dead, lost_domains, lost_hosts, bridges, len(touched))


@dataclass(frozen=True)
class PolicyComparison:
    breakdowns: tuple[RecoveryBreakdown, ...]  # the policies that can apply, in Policy order
    shape: FailureShape
    rank_loss: bool  # as costed: forced on when a whole host is gone
    ranks_in_job: int  # ranks that go on (survivors)
    retained_ranks: int  # ranks whose state stays in device memory under in-memory rebind
    retained_bytes: float
    reloaded_bytes: float  # what a checkpoint restore reads back
    unavailable: Mapping[Policy, str] = field(default_factory=dict)  # policy -> why it cannot apply

    def total_s(self, policy: Policy) -> float | None:
        """The policy's downtime, or None when it cannot apply to these failures."""
        return next((b.total_s for b in self.breakdowns if b.policy is policy), None)

    @property
    def downtime_reduction(self) -> float | None:
        """Cold restart's downtime divided by in-memory rebind's (None when in-memory cannot apply)."""
        fast, cold = self.total_s(Policy.IN_MEMORY), self.total_s(Policy.COLD_RESTART)
        if fast is None or cold is None:
            return None
        return cold / fast if fast > 0 else float("inf")


def compare_policies(
    mesh: Mesh,
    failed: Iterable[int],
    *,
    rank_loss: bool,
    steps_since_checkpoint: int,
    step_s: float,
) -> PolicyComparison:
    """Every applicable policy's stage breakdown for these failures, and why the others do not apply.

    A checkpoint restore (cold or in job) replays the steps since the last checkpoint;
    in-memory rebind replays only the interrupted step; excise continues on the
    survivors and replays nothing.
    """
    shape = failure_shape(mesh, failed)
    if not shape.failed:
        raise ValueError("no failed ranks: pick at least one rank to fail")
    lost = rank_loss or bool(shape.lost_hosts)
    fault = FaultImpact.RANK_LOSS if lost else FaultImpact.TRANSIENT
    costs = DEFAULT_RECOVERY_COSTS
    world = mesh.world_size
    survivors = world - len(shape.failed)
    unavailable: dict[Policy, str] = {}
    if shape.lost_domains:
        names = ", ".join(shape.lost_domains)
        unavailable[Policy.IN_MEMORY] = (
            f"every rank of {names} failed: no surviving rank holds that state in "
            "memory, so it must be read back from a checkpoint"
        )
        unavailable[Policy.EXCISE] = f"every rank of {names} failed: no rank is left to carry on that domain's work"
    if survivors == 0:
        unavailable[Policy.EXCISE] = "every rank failed: nothing is left to continue on"
    models = POLICY_MODELS
    replay = {
        p: steps_since_checkpoint if m.from_checkpoint(fault) else 0 if m.excises else 1 for p, m in models.items()
    }
    ranks = {p: world for p in Policy}
    ranks[Policy.IN_MEMORY] = ranks[Policy.PEER_RESTORE] = max(shape.rebuild_ranks, 1)
    ranks[Policy.EXCISE] = max(survivors, 1)
    out = tuple(
        estimate_recovery(p, ranks[p], costs, impact=fault, replay_steps=replay[p], step_s=step_s)
        for p in Policy
        if p not in unavailable
    )
    retained = 0 if Policy.IN_MEMORY in unavailable else (survivors if lost else world)
    per_rank = float(costs.state_bytes_per_rank)
    return PolicyComparison(
        breakdowns=out,
        shape=shape,
        rank_loss=lost,
        ranks_in_job=survivors,
        retained_ranks=retained,
        retained_bytes=retained * per_rank,
        reloaded_bytes=world * per_rank,
        unavailable=unavailable,
    )


def comparison_rows(cmp: PolicyComparison) -> list[dict[str, object]]:
    """One row per policy (stage seconds, total, or why it cannot apply): the CSV download."""
    stages = [s for s in Stage.ordered() if any(s in b.durations_s for b in cmp.breakdowns)]
    rows: list[dict[str, object]] = []
    for p in Policy:
        b = next((x for x in cmp.breakdowns if x.policy is p), None)
        row: dict[str, object] = {
            "policy": p.value,
            "applies": b is not None,
            "total_s": round(b.total_s, 6) if b else None,
        }
        for s in stages:
            row[f"{s.value}_s"] = round(b.durations_s.get(s, 0.0), 6) if b else None
        row["failed_ranks"] = len(cmp.shape.failed)
        row["rank_loss"] = cmp.rank_loss
        row["why_not"] = cmp.unavailable.get(p, "")
        rows.append(row)
    return rows
