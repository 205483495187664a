"""The recovery model: stages, policies and the breakdown of one recovery.

A recovery is a pipeline of :class:`Stage` values, each with a duration. The simulator
models the durations, live mode measures them, the dashboard draws them; all three use
these names. :class:`Policy` names the ways of answering a fault that Meshpact compares
everywhere (CLI flags, JSON keys, app labels, live recordings). What each policy costs, and
what it assumes, is the cost model's business: :mod:`meshpact.core.recovery_costs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Mapping

__all__ = [
    "Stage",
    "Policy",
    "CommunicatorAction",
    "StateAction",
    "POLICY_ACTIONS",
    "RecoveryBreakdown",
]


class Stage(str, Enum):
    """Stages of one recovery, in pipeline order."""

    DETECTION = "detection"  # from the fault to every survivor knowing of it
    RESTART = "restart"  # processes torn down and started again (cold restart only)
    CONSENSUS = "consensus"  # agreement on generation and committed step, out of band
    COMMUNICATOR = "communicator"  # abort, rebuild, or shrink/excise the data-path groups
    STATE = "state"  # retain in memory, reload a checkpoint, or recover a shard from a peer
    REBINDING = "rebinding"  # cached process-group references pointed at the new groups
    REPLAY = "replay"  # steps lost since the restored state, run again

    @classmethod
    def ordered(cls) -> tuple["Stage", ...]:
        return tuple(cls)


class Policy(str, Enum):
    COLD_RESTART = "cold_restart"  # tear down every process, restart, load checkpoint, replay
    CHECKPOINT_RESTORE = "checkpoint_restore"  # in job: rebuild groups, reload checkpoint, replay
    IN_MEMORY = "in_memory"  # consensus, fresh communicators, rebind, re-run the failed step
    PEER_RESTORE = "peer_restore"  # as in_memory; a lost rank's shard comes from a peer's host-memory copy
    EXCISE = "excise"  # drop the failed ranks, continue on survivors at reduced throughput

    @property
    def label(self) -> str:
        return {
            Policy.COLD_RESTART: "cold restart",
            Policy.CHECKPOINT_RESTORE: "checkpoint restore (in job)",
            Policy.IN_MEMORY: "in-memory rebind",
            Policy.PEER_RESTORE: "peer restore",
            Policy.EXCISE: "excise and continue",
        }[self]

    @property
    def explained(self) -> str:
        """What the policy does, in one sentence a person reads."""
        return {
            Policy.COLD_RESTART: "Stop every process, start the job again, load the last checkpoint on every rank "
            "and replay the steps since it.",
            Policy.CHECKPOINT_RESTORE: "Keep the processes, rebuild every communicator, reload the last checkpoint "
            "on every rank and replay the steps since it.",
            Policy.IN_MEMORY: "Agree on the committed step, rebuild only the broken communicators, keep the training "
            "state in memory and re-run the interrupted step; a lost rank's state has no copy "
            "anywhere, so a rank loss falls back to a checkpoint restore.",
            Policy.PEER_RESTORE: "In-memory rebind, and each rank's shard is also copied into a peer's host memory "
            "every step (paid every step), so a lost rank's replacement takes its state from "
            "that peer instead of storage.",
            Policy.EXCISE: "Drop the failed ranks, shrink the communicators to the survivors and continue at reduced "
            "throughput without replaying anything; the dropped ranks rejoin later.",
        }[self]


class CommunicatorAction(str, Enum):
    NONE = "none"
    ABORT = "abort"
    REBUILD = "rebuild"
    RECONFIGURE = "reconfigure"  # in-place ProcessGroup.reconfigure where torch offers it
    SHRINK = "shrink"


class StateAction(str, Enum):
    RETAIN = "retain"
    RELOAD_CHECKPOINT = "reload_checkpoint"
    PEER_RECOVER = "peer_recover"


POLICY_ACTIONS: Mapping[Policy, tuple[CommunicatorAction, StateAction]] = {
    Policy.COLD_RESTART: (CommunicatorAction.REBUILD, StateAction.RELOAD_CHECKPOINT),
    Policy.CHECKPOINT_RESTORE: (CommunicatorAction.REBUILD, StateAction.RELOAD_CHECKPOINT),
    Policy.IN_MEMORY: (CommunicatorAction.REBUILD, StateAction.RETAIN),
    Policy.PEER_RESTORE: (CommunicatorAction.REBUILD, StateAction.PEER_RECOVER),
    Policy.EXCISE: (CommunicatorAction.SHRINK, StateAction.PEER_RECOVER),
}


@dataclass(frozen=True)
class RecoveryBreakdown:
    """Durations of the stages of one recovery under one policy (seconds)."""

    policy: Policy
    durations_s: Mapping[Stage, float] = field(default_factory=dict)
    lost_steps: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", Policy(self.policy))
        durations = {Stage(k): float(v) for k, v in dict(self.durations_s).items()}
        bad = {k.value: v for k, v in durations.items() if v < 0}
        if bad:
            raise ValueError(f"stage durations must be >= 0 seconds, got {bad}")
        object.__setattr__(self, "durations_s", {s: durations[s] for s in Stage.ordered() if s in durations})

    @property
    def total_s(self) -> float:
        return sum(self.durations_s.values())

    def to_dict(self) -> dict:
        return {
            "policy": self.policy.value,
            "durations_s": {s.value: d for s, d in self.durations_s.items()},
            "total_s": self.total_s,
            "lost_steps": self.lost_steps,
        }
