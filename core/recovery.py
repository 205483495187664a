"""The recovery model: stages, policies and the breakdown of one recovery.

A recovery is a pipeline of :class:`Stage` values, each with a duration. The simulator
models the durations, live mode measures them, the dashboard draws them; all three use
these names. :class:`Policy` names the four ways of answering a communication fault that
Meshpact compares everywhere (CLI flags, JSON keys, app labels, live recordings).
"""

from __future__ import annotations

import math
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
    EXCISE = "excise"  # drop the failed ranks, continue on survivors at reduced throughput

    @property
    def label(self) -> str:
        return {
            Policy.COLD_RESTART: "cold restart",
            Policy.CHECKPOINT_RESTORE: "checkpoint restore (in job)",
            Policy.IN_MEMORY: "in-memory rebind",
            Policy.EXCISE: "excise and continue",
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


# --- The recovery cost model: stage durations as a function of ranks and policy. -------------


class FaultKind(str, Enum):
    """What broke: a communicator (the rank's memory is intact) or a whole rank."""

    TRANSIENT = "transient"  # a collective failed or timed out; every process survives
    RANK_LOSS = "rank_loss"  # a rank (its process, device or host) is gone


@dataclass(frozen=True)
class RecoveryCosts:
    """Parameters of :func:`estimate_recovery`; every field may be overridden per scenario.

    Sources of the defaults. From published figures: ``detection_s`` is torchft's Lighthouse
    heartbeat timeout (5 s); ``abort_s`` (~0.5 s to destroy the groups) and the rendezvous
    barrier (~0.5 s at 16,384 ranks, hence ``rendezvous_per_log2_rank_s = 0.5 / 14``) are
    the costs nvidia-resiliency-ext states for its in-process restart. The rest are
    assumptions, stated as such, to be replaced by measurements (``meshpact simulate
    training --calibrate-from RECORDING``): a cold restart's relaunch (scheduler, imports,
    device init: 60 s plus 4 s per doubling of ranks), communicator creation (1 s plus
    0.25 s per doubling), one consensus round through the control store (20 ms per
    doubling), rebinding cached group references (10 ms), re-wrapping the model and
    optimizer in a fresh in-job restore (15 s), a replacement for a lost rank (300 s),
    checkpoint reads at 2 GB/s per rank and peer state transfer at 12.5 GB/s (100 Gb/s).
    """

    detection_s: float = 5.0
    restart_s: float = 60.0
    restart_per_log2_rank_s: float = 4.0
    consensus_s: float = 0.05
    consensus_per_log2_rank_s: float = 0.02
    abort_s: float = 0.5
    rendezvous_per_log2_rank_s: float = 0.5 / 14
    comm_init_s: float = 1.0
    comm_init_per_log2_rank_s: float = 0.25
    rebind_s: float = 0.01
    rewrap_s: float = 15.0
    replacement_s: float = 300.0
    state_bytes_per_rank: float = 2e9
    checkpoint_read_bytes_per_s: float = 2e9
    peer_bytes_per_s: float = 12.5e9

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.__dict__.items() if not v >= 0}
        if bad:
            raise ValueError(f"recovery costs must be >= 0, got {bad}")
        for name in ("checkpoint_read_bytes_per_s", "peer_bytes_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"recovery costs: {name} must be > 0 bytes per second")

    def to_dict(self) -> dict:
        return dict(self.__dict__)


DEFAULT_RECOVERY_COSTS = RecoveryCosts()


def _log2(ranks: int) -> float:
    return math.log2(max(int(ranks), 1))


def communicator_seconds(ranks: int, costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS) -> float:
    """Abort the broken groups, meet at a rendezvous, create fresh communicators for ``ranks``."""
    lg = _log2(ranks)
    return costs.abort_s + costs.rendezvous_per_log2_rank_s * lg + costs.comm_init_s + costs.comm_init_per_log2_rank_s * lg


def estimate_recovery(
    policy: Policy | str,
    ranks: int,
    costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS,
    *,
    fault: FaultKind | str = FaultKind.TRANSIENT,
    replay_steps: int = 0,
    step_s: float = 0.0,
) -> RecoveryBreakdown:
    """Modelled durations of one recovery of ``ranks`` ranks under ``policy``.

    Stages, by policy (times grow with log2 of the rank count where a rendezvous or a
    communicator is involved):

    * ``cold_restart``: detection; restart (relaunch every process, plus a replacement
      when a rank is lost); consensus; communicator (created from scratch, no abort);
      state (reload this rank's checkpoint shard); replay.
    * ``checkpoint_restore``: detection; consensus; communicator (abort and rebuild);
      state (reload the shard; a lost rank waits for its replacement first, counted in
      restart); rebinding (re-wrap model and optimizer); replay.
    * ``in_memory``: detection; consensus; communicator; state (nothing for a transient
      fault; a replacement rank fetches its shard from a peer replica); rebinding
      (cached references only); replay (the interrupted step, counted by the caller).
    * ``excise``: detection; consensus; communicator (shrink to the survivors); rebinding.
      Survivors keep their state; the excised ranks rejoin later.
    """
    policy, fault = Policy(policy), FaultKind(fault)
    ranks = max(int(ranks), 1)
    lg = _log2(ranks)
    lost = fault is FaultKind.RANK_LOSS
    d: dict[Stage, float] = {Stage.DETECTION: costs.detection_s}
    consensus = costs.consensus_s + costs.consensus_per_log2_rank_s * lg
    reload = costs.state_bytes_per_rank / costs.checkpoint_read_bytes_per_s
    if policy is Policy.COLD_RESTART:
        d[Stage.RESTART] = costs.restart_s + costs.restart_per_log2_rank_s * lg + (costs.replacement_s if lost else 0.0)
        d[Stage.CONSENSUS] = consensus
        d[Stage.COMMUNICATOR] = communicator_seconds(ranks, costs) - costs.abort_s
        d[Stage.STATE] = reload
    elif policy is Policy.CHECKPOINT_RESTORE:
        if lost:
            d[Stage.RESTART] = costs.replacement_s
        d[Stage.CONSENSUS] = consensus
        d[Stage.COMMUNICATOR] = communicator_seconds(ranks, costs)
        d[Stage.STATE] = reload
        d[Stage.REBINDING] = costs.rewrap_s
    elif policy is Policy.IN_MEMORY:
        if lost:
            d[Stage.RESTART] = costs.replacement_s
        d[Stage.CONSENSUS] = consensus
        d[Stage.COMMUNICATOR] = communicator_seconds(ranks, costs)
        d[Stage.STATE] = costs.state_bytes_per_rank / costs.peer_bytes_per_s if lost else 0.0
        d[Stage.REBINDING] = costs.rebind_s
    else:
        d[Stage.CONSENSUS] = consensus
        d[Stage.COMMUNICATOR] = communicator_seconds(ranks, costs)
        d[Stage.REBINDING] = costs.rebind_s
    d[Stage.REPLAY] = max(int(replay_steps), 0) * max(float(step_s), 0.0)
    return RecoveryBreakdown(policy, d, lost_steps=max(int(replay_steps), 0))


__all__ += ["FaultKind", "RecoveryCosts", "DEFAULT_RECOVERY_COSTS", "communicator_seconds", "estimate_recovery"]
