"""Training with faults: SimPy processes for steps, checkpoints, faults and recovery.

One trainer process per policy stands for the whole job (cost grows with events, not
with ranks). A fault process replays a shared :func:`~meshpact.simulator.faults.fault_trace`
and interrupts the trainer, as in SimPy's machine-shop example; the trainer then walks
the stages of the core recovery model (:func:`meshpact.core.recovery.estimate_recovery`),
each a timeout whose length is that stage's duration. A fault during a recovery restarts
it. Work is counted in optimizer steps of the full job: goodput is committed steps times
the full-job step time, over wall time.

Policies on a fault:

* ``cold_restart`` / ``checkpoint_restore``: roll back to the last durable checkpoint;
  the rolled-back steps are lost and replayed (the ``replay`` stage).
* ``in_memory``: committed steps survive; only the interrupted step is re-run. A lost
  rank is replaced and fetches its state from a peer replica (from the checkpoint when
  there is no second replica).
* ``excise``: the replica (tensor x pipeline ranks) holding the faulty rank is dropped;
  the survivors keep the global batch, so a step takes ``replicas / active`` times
  longer until the replica rejoins (``faults.rejoin_s`` after a transient fault,
  ``faults.repair_hours`` after a rank loss). With a single replica there is nothing to
  continue on, and excise falls back to checkpoint restore.

Checkpoints: ``sync`` blocks for the write; ``async`` blocks for a snapshot to host
memory and writes behind; a checkpoint is durable when its write ends. A cold restart, a
lost rank or a rollback abandons an in-flight write. Faults that strike a replica while
it is excised do not reach the job and are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import simpy

from meshpact.core.recovery import FaultKind, Policy, RecoveryCosts, Stage, estimate_recovery
from meshpact.core.scenario import CheckpointMode, Scenario, with_overrides

from meshpact.core.errors import ScenarioError

from .faults import Fault, cluster_rate_per_s, fault_trace
from .workload import Workload, derive_workload

__all__ = ["TimelineEvent", "PolicyResult", "TrainingResult", "simulate_training", "StageAdjust", "training_overrides",
           "check_bounds", "MAX_FAULTS", "MAX_CHECKPOINT_INTERVALS"]

_EPS = 1e-9

# The most events one simulation may generate, checked before any work starts: expected
# faults in the trace, and checkpoint intervals per policy. Each costs a few SimPy events;
# at these limits a run takes minutes, not hours, and memory stays in megabytes.
MAX_FAULTS = 200_000
MAX_CHECKPOINT_INTERVALS = 1_000_000

# Adjusts a modelled breakdown's durations: (policy, ranks, modelled durations) -> durations.
StageAdjust = Callable[[Policy, int, Mapping[Stage, float]], Mapping[Stage, float]]


@dataclass(frozen=True)
class TimelineEvent:
    """One span (``duration_s > 0``) or instant on a policy's timeline."""

    t: float
    duration_s: float
    policy: Policy
    kind: str  # fault | stage | checkpoint | checkpoint_write | rejoin | degraded
    stage: Stage | None = None
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"t": self.t, "duration_s": self.duration_s, "policy": self.policy.value, "kind": self.kind,
                "stage": self.stage.value if self.stage else None, "data": dict(self.data)}


@dataclass(frozen=True)
class PolicyResult:
    policy: Policy
    goodput: float
    downtime_s: Mapping[Stage, float]
    faults: int
    recoveries: int
    lost_steps: int
    replayed_steps: int
    lost_compute_s: float  # interrupted, uncommitted partial steps
    degraded_s: float  # time with excised replicas
    committed_steps: int
    checkpoint_fraction: float  # wall time blocked by checkpoints
    step_latency_overhead: float  # blocked time per computed step, over the step time
    host_memory_bytes_per_rank: float
    storage_bytes_per_hour: float
    checkpoints: int
    timeline: tuple[TimelineEvent, ...] = ()

    @property
    def downtime_total_s(self) -> float:
        return sum(self.downtime_s.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "goodput": self.goodput,
            "downtime_s": {s.value: d for s, d in self.downtime_s.items()},
            "faults": self.faults,
            "recoveries": self.recoveries,
            "lost_steps": self.lost_steps,
            "replayed_steps": self.replayed_steps,
            "lost_compute_s": self.lost_compute_s,
            "degraded_s": self.degraded_s,
            "committed_steps": self.committed_steps,
            "checkpoint_overhead": {
                "fraction": self.checkpoint_fraction,
                "step_latency_overhead": self.step_latency_overhead,
                "host_memory_bytes_per_rank": self.host_memory_bytes_per_rank,
                "storage_bytes_per_hour": self.storage_bytes_per_hour,
                "checkpoints": self.checkpoints,
            },
        }


@dataclass(frozen=True)
class TrainingResult:
    scenario: str
    workload: Workload
    horizon_s: float
    trace: tuple[Fault, ...]
    policies: Mapping[Policy, PolicyResult]

    def to_dict(self) -> dict[str, Any]:
        w = self.workload
        return {
            "scenario": self.scenario,
            "ranks": w.ranks,
            "days": self.horizon_s / 86400.0,
            "step_s": w.step_s,
            "checkpoint_every": w.checkpoint_every,
            "checkpoint_mode": w.checkpoint_mode.value,
            "faults_in_trace": len(self.trace),
            "policies": {p.value: r.to_dict() for p, r in self.policies.items()},
        }

    def to_frame(self) -> Any:
        """One row per policy: goodput, downtime per stage, steps, checkpoint overhead."""
        import pandas as pd

        rows = []
        for p, r in self.policies.items():
            row: dict[str, Any] = {"policy": p.value, "goodput": r.goodput, "faults": r.faults,
                                   "lost_steps": r.lost_steps, "replayed_steps": r.replayed_steps,
                                   "downtime_s": r.downtime_total_s}
            row.update({f"downtime_{s.value}_s": r.downtime_s.get(s, 0.0) for s in Stage.ordered()})
            row.update({"degraded_s": r.degraded_s, "checkpoint_fraction": r.checkpoint_fraction,
                        "step_latency_overhead": r.step_latency_overhead,
                        "storage_bytes_per_hour": r.storage_bytes_per_hour,
                        "host_memory_bytes_per_rank": r.host_memory_bytes_per_rank})
            rows.append(row)
        return pd.DataFrame(rows)

    def timeline_frame(self) -> Any:
        import pandas as pd

        cols = ["t", "duration_s", "policy", "kind", "stage", "data"]
        return pd.DataFrame([e.to_dict() for r in self.policies.values() for e in r.timeline], columns=cols)


class _Run:
    """One policy on one fault trace."""

    def __init__(self, w: Workload, policy: Policy, costs: RecoveryCosts, trace: Sequence[Fault],
                 horizon_s: float, rejoin_s: float, repair_s: float, adjust: StageAdjust | None,
                 timeline: bool) -> None:
        self.w, self.policy, self.costs, self.trace = w, policy, costs, trace
        self.horizon_s, self.rejoin_s, self.repair_s, self.adjust = horizon_s, rejoin_s, repair_s, adjust
        self.record = timeline
        self.env = simpy.Environment()
        self.committed = 0  # steps
        self.durable = 0  # steps in the last durable checkpoint
        self.since_ckpt = 0  # steps computed since the last checkpoint began
        self.active = w.replicas
        self.excised: dict[int, float] = {}  # replica -> time it rejoins
        self.writer: simpy.Process | None = None
        self.downtime = {s: 0.0 for s in Stage.ordered()}
        self.faults = self.recoveries = self.lost = self.replayed = self.checkpoints = 0
        self.blocked_s = self.lost_compute_s = self.degraded_s = self.computed_s = 0.0
        self.pending: list[Fault] = []
        self.loss_unrecovered = False
        self.phase: tuple[str, float, Any] = ("idle", 0.0, None)
        self.events: list[TimelineEvent] = []
        self.degraded_since: float | None = None

    # --- bookkeeping -----------------------------------------------------------------
    def _log(self, t: float, dur: float, kind: str, stage: Stage | None = None, **data: Any) -> None:
        if self.record:
            self.events.append(TimelineEvent(t, dur, self.policy, kind, stage, data))

    def _step_s(self) -> float:
        return self.w.step_s * self.w.replicas / self.active

    def _close_phase(self) -> None:
        """Account the phase in progress up to now (it was interrupted or the run ended)."""
        kind, start, info = self.phase
        now = self.env.now
        elapsed = now - start
        if kind == "compute":
            step_s = info
            steps = int(math.floor(elapsed / step_s + _EPS))
            self.committed += steps
            self.since_ckpt += steps
            self.computed_s += steps * step_s
            self.lost_compute_s += elapsed - steps * step_s
        elif kind in ("checkpoint", "checkpoint_wait"):
            self.blocked_s += elapsed
            self._log(start, elapsed, "checkpoint", interrupted=True)
        elif kind == "stage":
            self.downtime[info[0]] += elapsed
            if info[0] is Stage.REPLAY:
                steps = min(int(math.floor(elapsed / self.w.step_s + _EPS)), info[1])
                self.committed += steps
                self.replayed += steps
                self.since_ckpt += steps
            self._log(start, elapsed, "stage", info[0], interrupted=True)
        elif kind == "rejoin":
            self.downtime[Stage.COMMUNICATOR] += elapsed
        self.phase = ("idle", now, None)

    def _set_degraded(self) -> None:
        now = self.env.now
        if self.active < self.w.replicas and self.degraded_since is None:
            self.degraded_since = now
        elif self.active == self.w.replicas and self.degraded_since is not None:
            self.degraded_s += now - self.degraded_since
            self._log(self.degraded_since, now - self.degraded_since, "degraded")
            self.degraded_since = None

    # --- processes -------------------------------------------------------------------
    def fault_source(self, trainer: simpy.Process):
        for f in self.trace:
            yield self.env.timeout(f.t - self.env.now)
            if self.policy is Policy.EXCISE and f.rank // self.w.replica_ranks in self.excised:
                continue  # that replica is not part of the job right now
            self.faults += 1
            self._log(f.t, 0.0, "fault", rank=f.rank, fault=f.kind.value)
            trainer.interrupt(f)

    def writer_proc(self, steps: int):
        start = self.env.now
        try:
            yield self.env.timeout(self.w.checkpoint_write_s)
            self.durable = max(self.durable, steps)
            self.checkpoints += 1
            self._log(start, self.env.now - start, "checkpoint_write", step=steps)
        except simpy.Interrupt:
            self._log(start, self.env.now - start, "checkpoint_write", step=steps, cancelled=True)
        finally:
            self.writer = None

    def trainer(self):
        while True:
            try:
                if self.pending:
                    yield from self._recover()
                elif self.since_ckpt >= self.w.checkpoint_every:
                    yield from self._checkpoint()
                else:
                    yield from self._compute()
            except simpy.Interrupt as irq:
                self._close_phase()
                self.pending.append(irq.cause)

    def _compute(self):
        yield from self._apply_rejoins()
        step_s = self._step_s()
        steps = self.w.checkpoint_every - self.since_ckpt
        until = self.env.now + steps * step_s
        if self.excised:
            nxt = min(self.excised.values())
            if nxt < until:  # stop at the first step boundary after the rejoin
                steps = max(1, math.ceil((nxt - self.env.now) / step_s - _EPS))
        self.phase = ("compute", self.env.now, step_s)
        yield self.env.timeout(steps * step_s)
        self.phase = ("idle", self.env.now, None)
        self.committed += steps
        self.since_ckpt += steps
        self.computed_s += steps * step_s

    def _apply_rejoins(self):
        due = [r for r, t in self.excised.items() if t <= self.env.now + _EPS]
        if not due:
            return
        for r in due:
            del self.excised[r]
        self.active += len(due)
        start = self.env.now
        self.phase = ("rejoin", start, None)
        yield self.env.timeout(self._stages(FaultKind.TRANSIENT, 0)[Stage.COMMUNICATOR])
        self.downtime[Stage.COMMUNICATOR] += self.env.now - start
        self.phase = ("idle", self.env.now, None)
        self._set_degraded()
        self._log(start, self.env.now - start, "rejoin", Stage.COMMUNICATOR, replicas=len(due))

    def _checkpoint(self):
        start = self.env.now
        if self.w.checkpoint_mode is CheckpointMode.SYNC:
            self.phase = ("checkpoint", start, None)
            yield self.env.timeout(self.w.checkpoint_write_s)
            self.durable = self.committed
            self.checkpoints += 1
        else:
            if self.writer is not None:  # the previous write is still running: wait for it
                self.phase = ("checkpoint_wait", start, None)
                yield self.writer
            self.phase = ("checkpoint", start, None)
            yield self.env.timeout(self.w.checkpoint_block_s)
            self.writer = self.env.process(self.writer_proc(self.committed))
        self.blocked_s += self.env.now - start
        self.phase = ("idle", self.env.now, None)
        self.since_ckpt = 0
        self._log(start, self.env.now - start, "checkpoint", step=self.committed)

    def _stages(self, kind: FaultKind, replay: int, policy: Policy | None = None) -> Mapping[Stage, float]:
        policy = policy or self.policy
        b = estimate_recovery(policy, self.w.ranks, self.costs, fault=kind, replay_steps=replay, step_s=self.w.step_s)
        d = dict(b.durations_s)
        if self.adjust is not None:
            d.update({s: v for s, v in self.adjust(policy, self.w.ranks, d).items() if s is not Stage.REPLAY})
        return d

    def _recover(self):
        fault = self.pending[-1]
        # a rank lost earlier still needs its replacement if a new fault restarts the recovery
        self.loss_unrecovered |= any(f.kind is FaultKind.RANK_LOSS for f in self.pending)
        kind = FaultKind.RANK_LOSS if self.loss_unrecovered else FaultKind.TRANSIENT
        policy = self.policy
        rollback = policy in (Policy.COLD_RESTART, Policy.CHECKPOINT_RESTORE)
        if policy is Policy.IN_MEMORY and kind is FaultKind.RANK_LOSS and self.w.replicas < 2:
            rollback = True  # no peer replica holds the lost shard
        if policy is Policy.EXCISE:
            for f in self.pending:
                replica = f.rank // self.w.replica_ranks
                if replica not in self.excised and self.active > 1:
                    self.excised[replica] = self.env.now + (self.repair_s if f.kind is FaultKind.RANK_LOSS else self.rejoin_s)
                    self.active -= 1
                elif replica not in self.excised:
                    rollback = True  # nothing left to continue on
            self._set_degraded()
        if self.writer is not None and (rollback or policy is Policy.COLD_RESTART or kind is FaultKind.RANK_LOSS):
            self.writer.interrupt("cancelled")
        replay = 0
        if rollback:
            replay = self.committed - self.durable
            self.lost += replay
            self.committed = self.durable
            self.since_ckpt = 0
        self.pending.clear()
        self.recoveries += 1
        fallback = rollback and policy in (Policy.IN_MEMORY, Policy.EXCISE)
        stages = self._stages(kind, replay, Policy.CHECKPOINT_RESTORE if fallback else policy)
        for stage, d in stages.items():
            start = self.env.now
            self.phase = ("stage", start, (stage, replay))
            yield self.env.timeout(d)
            self.downtime[stage] += d
            if stage is Stage.REPLAY:
                self.committed += replay
                self.replayed += replay
            self._log(start, d, "stage", stage, fault=fault.kind.value, rank=fault.rank)
        self.phase = ("idle", self.env.now, None)
        self.loss_unrecovered = False
        if rollback:  # the replayed steps count toward the next checkpoint
            self.since_ckpt = self.committed - self.durable

    def run(self) -> PolicyResult:
        trainer = self.env.process(self.trainer())
        self.env.process(self.fault_source(trainer))
        self.env.run(until=self.horizon_s)
        self._close_phase()
        if self.degraded_since is not None:
            self.degraded_s += self.env.now - self.degraded_since
            self._log(self.degraded_since, self.env.now - self.degraded_since, "degraded")
        w, hours = self.w, self.horizon_s / 3600.0
        return PolicyResult(
            policy=self.policy,
            goodput=self.committed * w.step_s / self.horizon_s,
            downtime_s={s: d for s, d in self.downtime.items()},
            faults=self.faults,
            recoveries=self.recoveries,
            lost_steps=self.lost,
            replayed_steps=self.replayed,
            lost_compute_s=self.lost_compute_s,
            degraded_s=self.degraded_s,
            committed_steps=self.committed,
            checkpoint_fraction=self.blocked_s / self.horizon_s,
            step_latency_overhead=self.blocked_s / self.computed_s if self.computed_s else 0.0,
            host_memory_bytes_per_rank=w.host_memory_bytes_per_rank,
            storage_bytes_per_hour=self.checkpoints * w.state_bytes / hours,
            checkpoints=self.checkpoints,
            timeline=tuple(sorted(self.events, key=lambda e: e.t)),
        )


def training_overrides(
    *, ranks: int | None = None, days: float | None = None, step_seconds: float | None = None,
    rank_mtbf_hours: float | None = None, checkpoint_every: int | None = None,
    checkpoint_seconds: float | None = None, checkpoint_mode: str | None = None,
    policies: Sequence[Policy | str] | None = None, seed: int | None = None,
) -> dict[str, Any]:
    """Map the CLI's flags onto scenario fields (dotted paths for :func:`with_overrides`)."""
    pairs = {
        "workload.ranks": ranks, "workload.days": days, "workload.step_seconds": step_seconds,
        "faults.rank_mtbf_hours": rank_mtbf_hours, "checkpointing.every_steps": checkpoint_every,
        "checkpointing.seconds": checkpoint_seconds, "checkpointing.mode": checkpoint_mode,
        "faults.seed": seed,
        "recovery.policies": None if policies is None else [Policy(p).value for p in policies],
    }
    out = {k: v for k, v in pairs.items() if v is not None}
    if step_seconds is not None:
        out["workload.tokens_per_step"] = None
    return out


def check_bounds(scenario: Scenario, w: Workload, ranks: int, horizon_s: float) -> None:
    """Refuse a run whose event count would be unbounded in practice, naming the fields to change."""
    src = scenario.name
    intervals = horizon_s / (w.checkpoint_every * w.step_s + w.checkpoint_block_s)
    if intervals > MAX_CHECKPOINT_INTERVALS:
        raise ScenarioError(
            f"{src}: checkpointing.every_steps: {intervals:.3g} checkpoint intervals of {w.checkpoint_every} steps "
            f"({w.step_s:.3g} s each) in {horizon_s / 86400:g} days exceed the limit of {MAX_CHECKPOINT_INTERVALS:,}; "
            "raise checkpointing.every_steps, the step time, or shorten workload.days")
    f = scenario.faults
    for field, mtbf in (("faults.rank_mtbf_hours", f.rank_mtbf_hours), ("faults.rank_loss_mtbf_hours", f.rank_loss_mtbf_hours)):
        expected = cluster_rate_per_s(mtbf, ranks) * horizon_s
        if expected > MAX_FAULTS:
            raise ScenarioError(
                f"{src}: {field}: {mtbf:g} h per rank on {ranks} ranks gives {expected:.3g} faults in "
                f"{horizon_s / 86400:g} days, over the limit of {MAX_FAULTS:,}; raise the MTBF or shorten workload.days")


def simulate_training(
    scenario: Scenario,
    *,
    overrides: Mapping[str, Any] | None = None,
    adjust: StageAdjust | None = None,
    timeline: bool = True,
    progress: Callable[[int, int], None] | None = None,
    **flags: Any,
) -> TrainingResult:
    """Run every policy of ``scenario`` on one shared fault trace.

    ``flags`` are the CLI's (``ranks``, ``days``, ``step_seconds``, ``rank_mtbf_hours``,
    ``checkpoint_every``, ``checkpoint_seconds``, ``checkpoint_mode``, ``policies``,
    ``seed``); ``overrides`` are dotted scenario paths. ``adjust`` rewrites modelled
    stage durations (calibration); the scenario's ``recovery.stage_seconds`` win over both.
    ``progress(done, total)`` is called after each policy.
    """
    all_overrides = {**training_overrides(**flags), **dict(overrides or {})}
    if all_overrides:
        scenario = with_overrides(scenario, all_overrides, source=f"{scenario.name} (overrides)")
    ranks = scenario.workload.ranks or scenario.mesh().world_size
    w = derive_workload(scenario.workload, scenario.checkpointing, ranks, source=scenario.name)
    horizon = scenario.workload.days * 86400.0
    check_bounds(scenario, w, ranks, horizon)
    trace = fault_trace(scenario.faults, ranks, horizon, source=scenario.name)
    costs = scenario.recovery.recovery_costs()
    fixed = scenario.recovery.stage_seconds

    def combined(policy: Policy, n: int, d: Mapping[Stage, float]) -> Mapping[Stage, float]:
        out = dict(adjust(policy, n, d)) if adjust else dict(d)
        out.update(fixed.get(policy, {}))
        return out

    policies = list(dict.fromkeys(scenario.recovery.policies))
    results: dict[Policy, PolicyResult] = {}
    for i, p in enumerate(policies):
        results[p] = _Run(w, p, costs, trace, horizon, scenario.faults.rejoin_s,
                          scenario.faults.repair_hours * 3600.0, combined if (adjust or fixed) else None,
                          timeline).run()
        if progress:
            progress(i + 1, len(policies))
    return TrainingResult(scenario=scenario.name, workload=w, horizon_s=horizon, trace=trace, policies=results)
