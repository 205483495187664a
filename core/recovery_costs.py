"""The recovery cost model: what each policy assumes, and what each stage of a recovery costs.

:mod:`meshpact.core.recovery` names the stages and policies; this module prices them. A
policy is one :class:`PolicyModel` record in :data:`POLICY_MODELS` saying what it assumes
(peer copies of every shard, fresh processes, survivors that carry on) and how it gets a
lost rank's state back. :func:`estimate_recovery` walks that record; the simulator walks
the same record to decide rollbacks and per-step charges, so adding a policy is a value in
:class:`~meshpact.core.recovery.Policy` plus one record here.

What a fault did to the job is its :class:`FaultImpact`: a communicator broke with every
process alive (``transient``), a rank stopped making progress without an error (``hang``,
found only by a timeout), or ranks are gone (``rank_loss``: a process, a device, a node, a
rack). How the fault was *injected* (a raising collective, a stall, a partition, a kill) is
live mode's ``FaultKind``; several kinds can have one impact.

| policy | hang found by | a lost rank's state from | rolls back | rebinding | charged every step |
|---|---|---|---|---|---|
| ``cold_restart`` | watchdog | checkpoint | always | fresh processes | nothing |
| ``checkpoint_restore`` | watchdog | checkpoint | always | re-wrap | nothing |
| ``in_memory`` | heartbeat | checkpoint (no peer copies) | on rank loss | cached references | nothing |
| ``peer_restore`` | heartbeat | a peer's host-memory copy | when the copy is lost too | cached references | the copy |
| ``excise`` | heartbeat | not needed: the replica is dropped | with one replica left | cached references | nothing |
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Mapping

from .control_plane import ControlPlaneFit, load_control_plane_fit
from .recovery import Policy, RecoveryBreakdown, Stage

__all__ = [
    "FaultImpact",
    "FaultScope",
    "Detection",
    "StateSource",
    "PolicyModel",
    "POLICY_MODELS",
    "policy_model",
    "CONTROL_PLANE_FIT",
    "RecoveryCosts",
    "DEFAULT_RECOVERY_COSTS",
    "communicator_seconds",
    "consensus_seconds",
    "heartbeat_look_seconds",
    "heartbeat_detection_seconds",
    "PeerCopyCost",
    "peer_copy_cost",
    "peer_copy_seconds_per_step",
    "estimate_recovery",
]


class FaultImpact(str, Enum):
    """What a fault did to the job (not how it was caused)."""

    TRANSIENT = "transient"  # a collective failed or timed out; every process survives and knows it
    HANG = "hang"  # a rank stopped making progress without an error; found only by a timeout
    RANK_LOSS = "rank_loss"  # ranks are gone (process, device, node or rack) with their memory


class FaultScope(str, Enum):
    """How much hardware one fault takes down at once (the failure domain)."""

    RANK = "rank"  # one accelerator or its process
    NODE = "node"  # every accelerator of one node (power supply, host OS, NIC)
    RACK = "rack"  # every node of one rack (top-of-rack switch, power distribution)


class Detection(str, Enum):
    """How a policy's runtime notices a rank that hangs."""

    HEARTBEAT = "heartbeat"  # an out-of-band heartbeat misses its deadline
    WATCHDOG = "watchdog"  # the blocked collective's own timeout fires


class StateSource(str, Enum):
    """Where a lost rank's training state comes from."""

    CHECKPOINT = "checkpoint"  # durable storage: every rank rolls back to it
    PEER = "peer"  # a copy in a peer's host memory, refreshed every step
    NOT_NEEDED = "not_needed"  # the replica holding the rank is dropped (excise)


@dataclass(frozen=True)
class PolicyModel:
    """What one policy assumes and how it answers a fault; the cost model and simulator walk it."""

    policy: Policy
    assumes: str  # one line a person reads: what must be true for this policy to work
    detection: Detection  # how a hang is found
    lost_state_from: StateSource
    restarts_processes: bool = False  # every process is torn down and launched again
    always_rolls_back: bool = False  # every recovery reloads the last durable checkpoint
    rewraps: bool = False  # model and optimizer wrappers are built again after the restore
    peer_copies: bool = False  # each shard is copied to a peer's host memory every step (charged)
    excises: bool = False  # failed replicas are dropped; survivors continue at reduced throughput

    def from_checkpoint(self, impact: FaultImpact) -> bool:
        """Whether a recovery from ``impact`` reloads the checkpoint (when nothing forces it)."""
        lost = impact is FaultImpact.RANK_LOSS
        return self.always_rolls_back or (lost and self.lost_state_from is StateSource.CHECKPOINT)


POLICY_MODELS: Mapping[Policy, PolicyModel] = {
    m.policy: m
    for m in (
        PolicyModel(
            Policy.COLD_RESTART,
            "a scheduler relaunches the whole job; a durable checkpoint exists",
            Detection.WATCHDOG,
            StateSource.CHECKPOINT,
            restarts_processes=True,
            always_rolls_back=True,
        ),
        PolicyModel(
            Policy.CHECKPOINT_RESTORE,
            "processes survive a transient fault; a durable checkpoint exists",
            Detection.WATCHDOG,
            StateSource.CHECKPOINT,
            always_rolls_back=True,
            rewraps=True,
        ),
        PolicyModel(
            Policy.IN_MEMORY,
            "a control-channel heartbeat; no peer copies, so a lost rank means a checkpoint restore",
            Detection.HEARTBEAT,
            StateSource.CHECKPOINT,
        ),
        PolicyModel(
            Policy.PEER_RESTORE,
            "every shard also lives in the host memory of a rank on the next node, copied every step",
            Detection.HEARTBEAT,
            StateSource.PEER,
            peer_copies=True,
        ),
        PolicyModel(
            Policy.EXCISE,
            "data-parallel replicas: the job keeps its global batch on fewer replicas",
            Detection.HEARTBEAT,
            StateSource.NOT_NEEDED,
            excises=True,
        ),
    )
}


def policy_model(policy: Policy | str) -> PolicyModel:
    return POLICY_MODELS[Policy(policy)]


CONTROL_PLANE_FIT: ControlPlaneFit = load_control_plane_fit()  # scenarios/control_plane_fit.json


@dataclass(frozen=True)
class RecoveryCosts:
    """Parameters of :func:`estimate_recovery`; every field may be overridden per scenario.

    Sources of the defaults. From published figures: ``detection_s`` and
    ``heartbeat_timeout_s`` are torchft's Lighthouse heartbeat timeout (5 s, at a store that keeps
    the heartbeat's interval);
    ``watchdog_timeout_s`` is PyTorch's default process-group timeout for NCCL (10 minutes,
    ``torch.distributed.init_process_group``); ``abort_s`` (~0.5 s to destroy the groups) and
    the rendezvous barrier (~0.5 s at 16,384 ranks, hence ``rendezvous_per_log2_rank_s =
    0.5 / 14``) are the costs nvidia-resiliency-ext states for its in-process restart.

    Fitted to this project's live control plane (:mod:`meshpact.core.control_plane`, from
    ``bench/control_scale.py``'s result; each is ``a + b * N`` or ``a + b * log2 N``, whichever
    the measurements fit better, the other slope zero): one consensus, fault known to every rank
    holding the decision (``consensus_s``, ``consensus_per_rank_s``,
    ``consensus_per_log2_rank_s``), and the control store's CPU seconds for one round of
    heartbeat looks (``heartbeat_store_s`` and its slopes) at the interval the bench ran
    (``heartbeat_interval_s``). The rest are assumptions, stated as such, to be replaced by measurements (``meshpact
    simulate training --calibrate-from RECORDING``): a cold restart's relaunch (scheduler,
    imports, device init: 60 s plus 4 s per doubling of ranks), communicator creation (1 s
    plus 0.25 s per doubling), rebinding cached group references (10 ms), re-wrapping the model and
    optimizer in a fresh in-job restore (15 s), a replacement for a lost rank from the
    scheduler (300 s) or from a warm spare pool (``spare_join_s``, 30 s), peer state
    transfer at 12.5 GB/s (100 Gb/s).

    A peer copy every step (:func:`peer_copy_cost`) costs a host copy of the shard on the
    training thread (``host_copy_bytes_per_s``, 25 GB/s device to host, PCIe 4.0 x16's 32 GB/s
    less protocol overhead: an assumption), a
    ship (serialise and send) on a background thread that lasts ``peer_bytes_per_s`` and
    keeps a core busy at ``peer_cpu_bytes_per_s`` (12.5 GB/s: an assumption), and the
    holder's receive, whose CPU work goes at ``peer_receive_bytes_per_s`` (12.5 GB/s: an
    assumption). How much of the ship a step hides follows from the host's spare cores, never from
    a fitted fraction: ``cores_per_rank`` (host cores over the ranks on the host; 12, a host
    of 96 cores driving 8 accelerators: an assumption) and ``step_cores_per_rank`` (the cores
    a step keeps busy, on average over the step: 1, the thread driving an accelerator; a
    CPU-bound step uses every core it is given). The three peer-copy rates and core counts
    are what ``--calibrate-from`` measures in a live run. ``state_bytes_per_rank`` and
    ``checkpoint_read_bytes_per_s`` (2 GB per rank at 2 GB/s) apply only where no workload
    is known; the simulator uses the real shard and the scenario's storage bandwidth.
    """

    detection_s: float = 5.0
    heartbeat_timeout_s: float = 5.0
    heartbeat_interval_s: float = CONTROL_PLANE_FIT.interval_s
    heartbeat_store_s: float = CONTROL_PLANE_FIT.heartbeat_store_s.intercept
    heartbeat_store_per_rank_s: float = CONTROL_PLANE_FIT.heartbeat_store_s.per_rank()
    heartbeat_store_per_log2_rank_s: float = CONTROL_PLANE_FIT.heartbeat_store_s.per_log2_rank()
    watchdog_timeout_s: float = 600.0
    restart_s: float = 60.0
    restart_per_log2_rank_s: float = 4.0
    consensus_s: float = CONTROL_PLANE_FIT.consensus_s.intercept
    consensus_per_rank_s: float = CONTROL_PLANE_FIT.consensus_s.per_rank()
    consensus_per_log2_rank_s: float = CONTROL_PLANE_FIT.consensus_s.per_log2_rank()
    abort_s: float = 0.5
    rendezvous_per_log2_rank_s: float = 0.5 / 14
    comm_init_s: float = 1.0
    comm_init_per_log2_rank_s: float = 0.25
    rebind_s: float = 0.01
    rewrap_s: float = 15.0
    replacement_s: float = 300.0
    spare_join_s: float = 30.0
    state_bytes_per_rank: float = 2e9
    checkpoint_read_bytes_per_s: float = 2e9
    peer_bytes_per_s: float = 12.5e9
    host_copy_bytes_per_s: float = 25e9
    peer_cpu_bytes_per_s: float = 12.5e9
    peer_receive_bytes_per_s: float = 12.5e9
    cores_per_rank: float = 12.0
    step_cores_per_rank: float = 1.0

    def __post_init__(self) -> None:
        bad = {k: v for k, v in self.__dict__.items() if not (v >= 0 and math.isfinite(v))}
        if bad:
            raise ValueError(f"recovery costs must be finite and >= 0, got {bad}")
        for name in (
            "checkpoint_read_bytes_per_s",
            "peer_bytes_per_s",
            "host_copy_bytes_per_s",
            "peer_cpu_bytes_per_s",
            "peer_receive_bytes_per_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"recovery costs: {name} must be > 0 bytes per second")
        if self.heartbeat_interval_s <= 0:
            raise ValueError("recovery costs: heartbeat_interval_s must be > 0 seconds")
        if self.cores_per_rank <= 0:
            raise ValueError("recovery costs: cores_per_rank must be > 0 (host cores over the ranks on the host)")

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


DEFAULT_RECOVERY_COSTS = RecoveryCosts()


def _log2(ranks: int) -> float:
    return math.log2(max(int(ranks), 1))


def communicator_seconds(ranks: int, costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS) -> float:
    """Abort the broken groups, meet at a rendezvous, create fresh communicators for ``ranks``."""
    lg = _log2(ranks)
    return (
        costs.abort_s + costs.rendezvous_per_log2_rank_s * lg + costs.comm_init_s + costs.comm_init_per_log2_rank_s * lg
    )


def consensus_seconds(ranks: int, costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS) -> float:
    """A fault known to one rank until every one of ``ranks`` holds the decision (fitted)."""
    return (
        costs.consensus_s
        + costs.consensus_per_rank_s * max(int(ranks), 1)
        + costs.consensus_per_log2_rank_s * _log2(ranks)
    )


def heartbeat_look_seconds(ranks: int, costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS) -> float:
    """How often each of ``ranks`` gets a heartbeat look: the interval, or the control store's
    time for one round of looks (every rank one) when that is longer (fitted)."""
    store = (
        costs.heartbeat_store_s
        + costs.heartbeat_store_per_rank_s * max(int(ranks), 1)
        + costs.heartbeat_store_per_log2_rank_s * _log2(ranks)
    )
    return max(costs.heartbeat_interval_s, store)


def heartbeat_detection_seconds(ranks: int, costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS) -> float:
    """The heartbeat's time to find a hang at ``ranks``: ``heartbeat_timeout_s`` is a count of
    looks at the interval, so a store that cannot serve a round of looks in one interval
    stretches it by the ratio (:func:`heartbeat_look_seconds`)."""
    return costs.heartbeat_timeout_s * heartbeat_look_seconds(ranks, costs) / costs.heartbeat_interval_s


@dataclass(frozen=True)
class PeerCopyCost:
    """One step with a peer copy of the shard, by :func:`peer_copy_cost` (seconds)."""

    host_copy_s: float  # the host copy on the training thread: never hidden
    ship_s: float  # serialise and send the K copies (the background thread's seconds)
    ship_cpu_s: float  # the CPU seconds of that
    receive_s: float  # the CPU seconds of receiving K copies from other ranks (a rank holds as many as it ships)
    step_s: float  # the step without copies
    cycle_s: float  # the step with them
    cpu_bound: bool  # the host's cores, not the training thread, set the cycle

    @property
    def per_step_s(self) -> float:
        """What the copy adds to every step."""
        return max(self.cycle_s - self.step_s, 0.0)

    @property
    def training_thread_s(self) -> float:
        """The training thread's time in the copy: the host copy, then any wait at the next
        commit for a ship that outlasted the step (one copy in flight)."""
        return self.host_copy_s + max(self.ship_s - self.step_s, 0.0)


def peer_copy_cost(
    shard_bytes: float, step_s: float, costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS, copies: int = 1
) -> PeerCopyCost:
    """A step of ``step_s`` (without copies) with its shard copied to ``copies`` peers.

    The host copy ``H = shard / host_copy_bytes_per_s`` runs on the training thread at the
    commit; the ship ``S = copies * shard / peer_bytes_per_s`` runs on a background thread
    while the next step computes, and the next commit waits for it (one copy in flight),
    keeping a core busy for ``Sc = copies * shard / peer_cpu_bytes_per_s`` of it; the rank
    also receives as many copies as it ships, ``R = copies * shard / peer_receive_bytes_per_s``
    CPU seconds on its server's threads. The cycle is the longer of two bounds:

    * the training thread: ``H + max(step_s, S)`` (the ship hides behind the step as long
      as a core is free for it);
    * the host's cores: the step's CPU work ``u * step_s`` (``u = min(step_cores_per_rank,
      cores_per_rank)``), ``H``, ``Sc`` and ``R`` all share the rank's ``cores_per_rank``
      cores: ``(u * step_s + H + Sc + R) / cores_per_rank``. With cores to spare this bound
      stays below the first; with fewer cores than the step keeps busy (ranks sharing cores,
      a CPU-bound step) every second of copy work stretches the step by ``1 / cores_per_rank``.

    Zero bytes cost nothing; a step of 0 s (unknown) costs ``H + S``, more where ranks share
    cores.
    """
    step_s = max(float(step_s), 0.0)
    shard_bytes = max(float(shard_bytes), 0.0)
    host = shard_bytes / costs.host_copy_bytes_per_s
    ship = max(int(copies), 0) * shard_bytes / costs.peer_bytes_per_s
    ship_cpu = max(int(copies), 0) * shard_bytes / costs.peer_cpu_bytes_per_s
    receive = max(int(copies), 0) * shard_bytes / costs.peer_receive_bytes_per_s
    busy = min(costs.step_cores_per_rank, costs.cores_per_rank) * step_s
    thread = host + max(step_s, ship)
    cores = (busy + host + ship_cpu + receive) / costs.cores_per_rank
    return PeerCopyCost(host, ship, ship_cpu, receive, step_s, max(thread, cores, step_s), cores > thread)


def peer_copy_seconds_per_step(
    shard_bytes: float, step_s: float, costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS, copies: int = 1
) -> float:
    """Time a step is stretched by copying its shard to peers (:func:`peer_copy_cost`)."""
    return peer_copy_cost(shard_bytes, step_s, costs, copies).per_step_s


def estimate_recovery(
    policy: Policy | str,
    ranks: int,
    costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS,
    *,
    impact: FaultImpact | str = FaultImpact.TRANSIENT,
    replay_steps: int = 0,
    step_s: float = 0.0,
    replacement_s: float | None = None,
    from_checkpoint: bool | None = None,
) -> RecoveryBreakdown:
    """Modelled durations of one recovery of ``ranks`` ranks under ``policy``.

    The stages follow the policy's :class:`PolicyModel` (times grow with log2 of the rank
    count where a rendezvous or a communicator is involved; the consensus and the heartbeat
    as fitted to the live control plane):

    * detection: ``detection_s``; a hang waits for the heartbeat (:func:`heartbeat_detection_seconds`)
      or the watchdog timeout.
    * restart: relaunch every process (``restarts_processes``), plus the wait for a
      replacement when ranks are lost (``replacement_s``, default ``costs.replacement_s``;
      the simulator passes what is left of a wait begun at the fault). Excise waits for none.
    * consensus, communicator (abort and rebuild, or created fresh after a relaunch, or
      shrunk to the survivors under excise).
    * state: reload the shard from the checkpoint when the recovery rolls back
      (``from_checkpoint``; by default as the policy decides for ``impact``), fetch it from a
      peer's copy when a rank is lost under ``peer_restore``, nothing when memory is intact.
    * rebinding: re-wrap model and optimizer after a checkpoint reload in the job, else
      point cached references at the new groups; none after a relaunch.
    * replay: ``replay_steps`` of ``step_s``, counted by the caller.
    """
    policy, impact = Policy(policy), FaultImpact(impact)
    model = POLICY_MODELS[policy]
    ranks = max(int(ranks), 1)
    lg = _log2(ranks)
    lost = impact is FaultImpact.RANK_LOSS
    reload = model.from_checkpoint(impact) if from_checkpoint is None else from_checkpoint
    wait = (costs.replacement_s if replacement_s is None else max(float(replacement_s), 0.0)) if lost else 0.0
    d: dict[Stage, float] = {}
    if impact is FaultImpact.HANG:
        d[Stage.DETECTION] = (
            heartbeat_detection_seconds(ranks, costs)
            if model.detection is Detection.HEARTBEAT
            else costs.watchdog_timeout_s
        )
    else:
        d[Stage.DETECTION] = costs.detection_s
    if model.restarts_processes:
        d[Stage.RESTART] = costs.restart_s + costs.restart_per_log2_rank_s * lg + wait
    elif lost and (reload or not model.excises):
        d[Stage.RESTART] = wait
    d[Stage.CONSENSUS] = consensus_seconds(ranks, costs)
    comm = communicator_seconds(ranks, costs)
    d[Stage.COMMUNICATOR] = comm - costs.abort_s if model.restarts_processes else comm
    if reload:
        d[Stage.STATE] = costs.state_bytes_per_rank / costs.checkpoint_read_bytes_per_s
    elif lost and model.lost_state_from is StateSource.PEER:
        d[Stage.STATE] = costs.state_bytes_per_rank / costs.peer_bytes_per_s
    elif not model.excises:
        d[Stage.STATE] = 0.0
    if not model.restarts_processes:
        d[Stage.REBINDING] = costs.rewrap_s if (reload or model.rewraps) else costs.rebind_s
    d[Stage.REPLAY] = max(int(replay_steps), 0) * max(float(step_s), 0.0)
    return RecoveryBreakdown(policy, d, lost_steps=max(int(replay_steps), 0))
