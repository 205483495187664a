"""Training with faults: SimPy processes for steps, checkpoints, faults and recovery.

One trainer process per policy stands for the whole job (cost grows with events, not
with ranks). A fault process replays a shared :func:`~meshpact.simulator.faults.fault_trace`
and interrupts the trainer, as in SimPy's machine-shop example; the trainer then walks
the stages of the core recovery model (:func:`meshpact.core.recovery_costs.estimate_recovery`),
each a timeout whose length is that stage's duration. A fault during a recovery restarts
it. Work is counted in optimizer steps of the full job: goodput is committed steps times
the nominal full-job step time, over wall time.

What a policy does is its :class:`~meshpact.core.recovery_costs.PolicyModel` record; the
trainer walks it instead of naming policies:

* a policy that ``always_rolls_back`` (cold restart, checkpoint restore), or whose lost
  rank's state comes from the checkpoint (``in_memory``: no peer copies), or whose peer
  copies were lost with the rank (``peer_restore`` after a rack failure: the copy lives on
  the next node), rolls back to the last durable checkpoint; the rolled-back steps are
  lost and replayed (the ``replay`` stage). Otherwise committed steps survive and only the
  interrupted step is re-run.
* ``peer_copies``: every step is stretched by the part of the shard copy that compute does
  not hide, and each rank holds a peer's shard in host memory.
* ``excises``: the replica (tensor x pipeline ranks) holding the faulty ranks is dropped;
  the survivors keep the global batch, so a step takes ``replicas / active`` times longer
  until the replica rejoins (``faults.rejoin_s`` after a transient fault or a hang,
  ``faults.repair_hours`` after a rank loss). With no replica left to continue on,
  excise restores the checkpoint.

Lost ranks are replaced once, from the moment of the fault: from the warm spare pool in
``spare_join_s`` when it holds enough ranks (the failed hardware is back in the pool after
``repair_hours``), else from the scheduler in ``replacement_s``. A recovery waits only for
what is left of that wait, so a second fault does not start it again. Stragglers stretch
every step by the workload's ``straggler_factor``.

Checkpoints: ``sync`` blocks for the write; ``async`` blocks for a snapshot to host
memory and writes behind; a checkpoint is durable when its write ends. A cold restart, a
lost rank or a rollback abandons an in-flight write. Faults that strike a replica while
it is excised do not reach the job and are not counted.

Fixed horizon (``workload.days``) or fixed work (``workload.work_steps``: the run ends
when that many steps are committed, and ``days`` is the limit).

Faults may also be placed by step (:class:`StepFault`, the trace of a live run): the fault
strikes ``offset_s`` into the first computation of that step (the offset is lost work, and
the step is run again after the recovery), once, under every policy at its own time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence, cast

import simpy

from meshpact.core.recovery import Policy, Stage
from meshpact.core.recovery_costs import (
    FaultImpact,
    RecoveryCosts,
    StateSource,
    estimate_recovery,
    peer_copy_seconds_per_step,
    policy_model,
)
from meshpact.core.scenario import CheckpointMode, FaultsSpec, Scenario, with_overrides

from meshpact.core.errors import ScenarioError

from .faults import Fault, cluster_rate_per_s, fault_trace
from .workload import Workload, derive_workload

__all__ = [
    "TimelineEvent",
    "PolicyResult",
    "TrainingResult",
    "simulate_training",
    "StageAdjust",
    "training_overrides",
    "check_bounds",
    "StepFault",
    "MAX_FAULTS",
    "MAX_CHECKPOINT_INTERVALS",
]

_EPS = 1e-9

# The most events one simulation may generate, checked before any work starts: expected
# faults in the trace, and checkpoint intervals per policy. Each costs a few SimPy events;
# at these limits a run takes minutes, not hours, and memory stays in megabytes.
MAX_FAULTS = 200_000
MAX_CHECKPOINT_INTERVALS = 1_000_000

# Adjusts a modelled breakdown's durations: (policy, ranks, modelled durations) -> durations.
StageAdjust = Callable[[Policy, int, Mapping[Stage, float]], Mapping[Stage, float]]


@dataclass(frozen=True)
class StepFault:
    """A fault at a step rather than a time: ``offset_s`` into the first run of step ``step``
    (steps counted from 0, as committed steps are)."""

    step: int
    impact: FaultImpact = FaultImpact.TRANSIENT
    rank: int = 0
    offset_s: float = 0.0


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
        return {
            "t": self.t,
            "duration_s": self.duration_s,
            "policy": self.policy.value,
            "kind": self.kind,
            "stage": self.stage.value if self.stage else None,
            "data": dict(self.data),
        }


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
    wall_s: float = 0.0  # simulated wall time: the horizon, or the time to finish the work
    finished: bool | None = None  # fixed work: whether it was done before the limit
    spares_used: int = 0  # lost ranks replaced from the warm spare pool
    scheduler_replacements: int = 0  # lost ranks replaced from the scheduler (slow)
    peer_copy_s_per_step: float = 0.0  # step time added by peer copies (peer_restore)
    timeline: tuple[TimelineEvent, ...] = ()

    @property
    def time_to_finish_s(self) -> float | None:
        return self.wall_s if self.finished else None

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
            "wall_s": self.wall_s,
            "finished": self.finished,
            "time_to_finish_s": self.time_to_finish_s,
            "spares_used": self.spares_used,
            "scheduler_replacements": self.scheduler_replacements,
            "peer_copy_s_per_step": self.peer_copy_s_per_step,
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
            "straggler_factor": w.straggler_factor,
            "work_steps": w.work_steps,
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
            row: dict[str, Any] = {
                "policy": p.value,
                "goodput": r.goodput,
                "faults": r.faults,
                "lost_steps": r.lost_steps,
                "replayed_steps": r.replayed_steps,
                "downtime_s": r.downtime_total_s,
                "wall_s": r.wall_s,
                "time_to_finish_s": r.time_to_finish_s,
            }
            row.update({f"downtime_{s.value}_s": r.downtime_s.get(s, 0.0) for s in Stage.ordered()})
            row.update(
                {
                    "degraded_s": r.degraded_s,
                    "checkpoint_fraction": r.checkpoint_fraction,
                    "step_latency_overhead": r.step_latency_overhead,
                    "storage_bytes_per_hour": r.storage_bytes_per_hour,
                    "host_memory_bytes_per_rank": r.host_memory_bytes_per_rank,
                }
            )
            rows.append(row)
        return pd.DataFrame(rows)

    def timeline_frame(self) -> Any:
        import pandas as pd

        cols = ["t", "duration_s", "policy", "kind", "stage", "data"]
        return pd.DataFrame([e.to_dict() for r in self.policies.values() for e in r.timeline], columns=cols)


class _Run:
    """One policy on one fault trace."""

    def __init__(
        self,
        w: Workload,
        policy: Policy,
        costs: RecoveryCosts,
        trace: Sequence[Fault],
        horizon_s: float,
        faults: FaultsSpec,
        adjust: StageAdjust | None,
        timeline: bool,
        step_faults: Sequence[StepFault] = (),
    ) -> None:
        self.w, self.policy, self.trace = w, policy, trace
        self.model = policy_model(policy)
        # the real shard, and the scenario's storage bandwidth where it gives one
        self.costs = replace(
            costs,
            state_bytes_per_rank=w.state_bytes_per_rank,
            checkpoint_read_bytes_per_s=w.reload_bytes_per_s or costs.checkpoint_read_bytes_per_s,
        )
        self.horizon_s, self.adjust, self.fspec = horizon_s, adjust, faults
        self.rejoin_s, self.repair_s = faults.rejoin_s, faults.repair_hours * 3600.0
        self.record = timeline
        self.env = simpy.Environment()
        self.done = self.env.event()
        self.peer_copy_s = (
            peer_copy_seconds_per_step(w.state_bytes_per_rank, w.step_s, self.costs) if self.model.peer_copies else 0.0
        )
        self.step_eff = w.step_s * w.straggler_factor + self.peer_copy_s
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
        self.lost_nodes: set[int] = set()  # nodes lost since the last completed recovery
        self.replacement_ready = 0.0  # when every lost rank so far has a replacement
        self.spares = faults.spare_ranks
        self.spare_returns: list[tuple[float, int]] = []  # (time, ranks) repaired hardware rejoins the pool
        self.spares_used = self.scheduler_replacements = 0
        self.phase: tuple[str, float, Any] = ("idle", 0.0, None)
        self.events: list[TimelineEvent] = []
        self.degraded_since: float | None = None
        self.interval = 0  # checkpoints begun so far: the interval the job is in
        self.aged = faults.at_checkpoint_age
        self.aged_fired, self.aged_interval = 0, -1  # faults by checkpoint age so far; interval of the last
        self.step_faults = sorted(step_faults, key=lambda f: f.step)
        self.step_faults_fired = 0

    # --- bookkeeping -----------------------------------------------------------------
    def _log(self, t: float, dur: float, kind: str, stage: Stage | None = None, **data: Any) -> None:
        if self.record:
            self.events.append(TimelineEvent(t, dur, self.policy, kind, stage, data))

    def _step_s(self) -> float:
        return self.step_eff * self.w.replicas / self.active

    def _finished(self) -> bool:
        if self.w.work_steps is not None and self.committed >= self.w.work_steps:
            if not self.done.triggered:
                self.done.succeed()
            return True
        return False

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
                steps = min(int(math.floor(elapsed / self.step_eff + _EPS)), info[1])
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

    def _replicas_of(self, f: Fault) -> set[int]:
        rr = self.w.replica_ranks
        return set(range(f.rank // rr, (f.rank + f.span - 1) // rr + 1))

    def _book_replacement(self, f: Fault) -> None:
        """Replace the ranks ``f`` took, from the spare pool if it can; asked for once the loss is detected."""
        self.spares += sum(n for t, n in self.spare_returns if t <= f.t)
        self.spare_returns = [(t, n) for t, n in self.spare_returns if t > f.t]
        self.spares = min(self.spares, self.fspec.spare_ranks)
        if self.spares >= f.span:
            self.spares -= f.span
            self.spares_used += f.span
            self.spare_returns.append((f.t + self.repair_s, f.span))
            ready = f.t + self.costs.detection_s + self.costs.spare_join_s
        else:
            self.scheduler_replacements += f.span
            ready = f.t + self.costs.detection_s + self.costs.replacement_s
        self.replacement_ready = max(self.replacement_ready, ready)

    def _peer_copies_survive(self) -> bool:
        """Each node's copies live on the next node: they survive unless that node went too."""
        nodes = -(-self.w.ranks // self.fspec.ranks_per_node)
        if nodes < 2:
            return False
        return all((n + 1) % nodes not in self.lost_nodes for n in self.lost_nodes)

    # --- processes -------------------------------------------------------------------
    def fault_source(self, trainer: simpy.Process):
        for f in self.trace:
            yield self.env.timeout(f.t - self.env.now)
            if not trainer.is_alive:
                return
            if self.model.excises and self._replicas_of(f) <= set(self.excised):
                continue  # those replicas are not part of the job right now
            self.faults += 1
            self._log(f.t, 0.0, "fault", rank=f.rank, span=f.span, fault=f.impact.value)
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
        while not self._finished():
            try:
                if self.pending:
                    yield from self._recover()
                elif self.since_ckpt >= self.w.checkpoint_every:
                    yield from self._checkpoint()
                else:
                    yield from self._compute()
            except simpy.Interrupt as irq:
                self._close_phase()
                self.pending.append(cast(Fault, irq.cause))  # only fault_source interrupts the trainer

    def _aged_fault_due(self) -> bool:
        a = self.aged
        return (
            a is not None
            and self.aged_fired < a.count
            and self.aged_interval != self.interval
            and self.since_ckpt < a.steps
        )

    def _compute(self):
        yield from self._apply_rejoins()
        step_s = self._step_s()
        nxt = self.step_faults[self.step_faults_fired] if self.step_faults_fired < len(self.step_faults) else None
        if nxt is not None and self.committed >= nxt.step:
            yield from self._step_fault(nxt, step_s)
            return
        steps = self.w.checkpoint_every - self.since_ckpt
        if self.w.work_steps is not None:
            steps = min(steps, self.w.work_steps - self.committed)
        if nxt is not None:
            steps = min(steps, nxt.step - self.committed)
        aged = self._aged_fault_due()
        if aged:
            assert self.aged is not None
            steps = min(steps, self.aged.steps - self.since_ckpt)
        until = self.env.now + steps * step_s
        if self.excised:
            rejoin = min(self.excised.values())
            if rejoin < until:  # stop at the first step boundary after the rejoin
                steps = max(1, math.ceil((rejoin - self.env.now) / step_s - _EPS))
        self.phase = ("compute", self.env.now, step_s)
        yield self.env.timeout(steps * step_s)
        self.phase = ("idle", self.env.now, None)
        self.committed += steps
        self.since_ckpt += steps
        self.computed_s += steps * step_s
        if aged and self.aged is not None and self.since_ckpt == self.aged.steps:
            self.aged_fired += 1
            self.aged_interval = self.interval
            f = Fault(self.env.now, self.aged.impact, self.aged.rank)
            self.faults += 1
            self._log(f.t, 0.0, "fault", rank=f.rank, span=f.span, fault=f.impact.value, age=self.aged.steps)
            self.pending.append(f)

    def _step_fault(self, sf: StepFault, step_s: float):
        """Run ``sf.offset_s`` of the step, then fault: that part of the step is lost."""
        self.step_faults_fired += 1  # consumed when its step begins, whatever interrupts it
        start = self.env.now
        self.phase = ("compute", start, step_s)
        yield self.env.timeout(min(max(sf.offset_s, 0.0), step_s))
        self.phase = ("idle", self.env.now, None)
        self.lost_compute_s += self.env.now - start
        f = Fault(self.env.now, sf.impact, sf.rank)
        self.faults += 1
        self._log(f.t, 0.0, "fault", rank=f.rank, span=f.span, fault=f.impact.value, step=sf.step)
        self.pending.append(f)

    def _apply_rejoins(self):
        due = [r for r, t in self.excised.items() if t <= self.env.now + _EPS]
        if not due:
            return
        for r in due:
            del self.excised[r]
        self.active += len(due)
        start = self.env.now
        self.phase = ("rejoin", start, None)
        yield self.env.timeout(self._stages(FaultImpact.TRANSIENT, 0)[Stage.COMMUNICATOR])
        self.downtime[Stage.COMMUNICATOR] += self.env.now - start
        self.phase = ("idle", self.env.now, None)
        self._set_degraded()
        self._log(start, self.env.now - start, "rejoin", Stage.COMMUNICATOR, replicas=len(due))

    def _checkpoint(self):
        start = self.env.now
        self.interval += 1
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

    def _stages(
        self, impact: FaultImpact, replay: int, policy: Policy | None = None, replacement_s: float | None = None
    ) -> Mapping[Stage, float]:
        policy = policy or self.policy
        b = estimate_recovery(
            policy,
            self.w.ranks,
            self.costs,
            impact=impact,
            replay_steps=replay,
            step_s=self.step_eff,
            replacement_s=replacement_s,
        )
        d = dict(b.durations_s)
        if self.adjust is not None:
            d.update({s: v for s, v in self.adjust(policy, self.w.ranks, d).items() if s is not Stage.REPLAY})
        return d

    def _recover(self):
        fault = self.pending[-1]
        model = self.model
        for f in self.pending:
            if f.impact is FaultImpact.RANK_LOSS:
                self.loss_unrecovered = True
                rpn = self.fspec.ranks_per_node
                self.lost_nodes.update(range(f.rank // rpn, (f.rank + f.span - 1) // rpn + 1))
        impact = (
            FaultImpact.RANK_LOSS
            if self.loss_unrecovered
            else FaultImpact.HANG
            if fault.impact is FaultImpact.HANG
            else FaultImpact.TRANSIENT
        )
        rollback = model.from_checkpoint(impact)
        if (
            impact is FaultImpact.RANK_LOSS
            and model.lost_state_from is StateSource.PEER
            and not self._peer_copies_survive()
        ):
            rollback = True  # the copies were on the nodes that went down too
        if model.excises:
            for f in self.pending:
                for replica in self._replicas_of(f):
                    if replica not in self.excised and self.active > 1:
                        lost = f.impact is FaultImpact.RANK_LOSS
                        self.excised[replica] = self.env.now + (self.repair_s if lost else self.rejoin_s)
                        self.active -= 1
                    elif replica not in self.excised:
                        rollback = True  # nothing left to continue on
            self._set_degraded()
        if not model.excises or rollback:
            for f in self.pending:
                if f.impact is FaultImpact.RANK_LOSS:
                    self._book_replacement(f)
        if self.writer is not None and (rollback or model.restarts_processes or impact is FaultImpact.RANK_LOSS):
            self.writer.interrupt("cancelled")
        replay = 0
        if rollback:
            replay = self.committed - self.durable
            self.lost += replay
            self.committed = self.durable
            self.since_ckpt = 0
        self.pending.clear()
        self.recoveries += 1
        # a policy that restores the checkpoint only as a fallback recovers as checkpoint restore does
        as_policy = Policy.CHECKPOINT_RESTORE if rollback and not model.always_rolls_back else self.policy
        detection = self._stages(impact, 0, as_policy, 0.0)[Stage.DETECTION]
        wait = max(0.0, self.replacement_ready - self.env.now - detection)
        stages = self._stages(impact, replay, as_policy, wait)
        for stage, d in stages.items():
            start = self.env.now
            self.phase = ("stage", start, (stage, replay))
            yield self.env.timeout(d)
            self.downtime[stage] += d
            if stage is Stage.REPLAY:
                self.committed += replay
                self.replayed += replay
            self._log(start, d, "stage", stage, fault=fault.impact.value, rank=fault.rank)
        self.phase = ("idle", self.env.now, None)
        self.loss_unrecovered = False
        self.lost_nodes.clear()
        if rollback:  # the replayed steps count toward the next checkpoint
            self.since_ckpt = self.committed - self.durable

    def run(self) -> PolicyResult:
        trainer = self.env.process(self.trainer())
        self.env.process(self.fault_source(trainer))
        if self.w.work_steps is None:
            self.env.run(until=self.horizon_s)
        else:
            self.env.run(until=self.env.any_of([self.done, self.env.timeout(self.horizon_s)]))
        self._close_phase()
        wall = self.env.now
        if self.degraded_since is not None:
            self.degraded_s += wall - self.degraded_since
            self._log(self.degraded_since, wall - self.degraded_since, "degraded")
        w, hours = self.w, wall / 3600.0
        return PolicyResult(
            policy=self.policy,
            goodput=self.committed * w.step_s / wall if wall > 0 else 0.0,
            downtime_s={s: d for s, d in self.downtime.items()},
            faults=self.faults,
            recoveries=self.recoveries,
            lost_steps=self.lost,
            replayed_steps=self.replayed,
            lost_compute_s=self.lost_compute_s,
            degraded_s=self.degraded_s,
            committed_steps=self.committed,
            checkpoint_fraction=self.blocked_s / wall if wall > 0 else 0.0,
            step_latency_overhead=self.blocked_s / self.computed_s if self.computed_s else 0.0,
            host_memory_bytes_per_rank=w.host_memory_bytes_per_rank
            + (w.state_bytes_per_rank if self.model.peer_copies else 0.0),
            storage_bytes_per_hour=self.checkpoints * w.state_bytes / hours if hours > 0 else 0.0,
            checkpoints=self.checkpoints,
            wall_s=wall,
            finished=None if w.work_steps is None else self.committed >= w.work_steps,
            spares_used=self.spares_used,
            scheduler_replacements=self.scheduler_replacements,
            peer_copy_s_per_step=self.peer_copy_s,
            timeline=tuple(sorted(self.events, key=lambda e: e.t)),
        )


def training_overrides(
    *,
    ranks: int | None = None,
    days: float | None = None,
    step_seconds: float | None = None,
    rank_mtbf_hours: float | None = None,
    checkpoint_every: int | None = None,
    checkpoint_seconds: float | None = None,
    checkpoint_mode: str | None = None,
    policies: Sequence[Policy | str] | None = None,
    seed: int | None = None,
    work_steps: int | None = None,
) -> dict[str, Any]:
    """Map the CLI's flags onto scenario fields (dotted paths for :func:`with_overrides`)."""
    pairs = {
        "workload.ranks": ranks,
        "workload.days": days,
        "workload.step_seconds": step_seconds,
        "faults.rank_mtbf_hours": rank_mtbf_hours,
        "checkpointing.every_steps": checkpoint_every,
        "checkpointing.seconds": checkpoint_seconds,
        "checkpointing.mode": checkpoint_mode,
        "faults.seed": seed,
        "workload.work_steps": work_steps,
        "recovery.policies": None if policies is None else [Policy(p).value for p in policies],
    }
    out: dict[str, Any] = {k: v for k, v in pairs.items() if v is not None}
    if step_seconds is not None:
        out["workload.tokens_per_step"] = None
    return out


def check_bounds(scenario: Scenario, w: Workload, ranks: int, horizon_s: float) -> None:
    """Refuse a run whose event count would be unbounded in practice, naming the fields to change."""
    src = scenario.name
    intervals = horizon_s / (w.checkpoint_every * w.step_s + w.checkpoint_block_s)
    if w.work_steps is not None:
        intervals = min(intervals, w.work_steps / w.checkpoint_every)
    if intervals > MAX_CHECKPOINT_INTERVALS:
        raise ScenarioError(
            f"{src}: checkpointing.every_steps: {intervals:.3g} checkpoint intervals of {w.checkpoint_every} steps "
            f"({w.step_s:.3g} s each) in {horizon_s / 86400:g} days exceed the limit of {MAX_CHECKPOINT_INTERVALS:,}; "
            "raise checkpointing.every_steps, the step time, or shorten workload.days"
        )
    f = scenario.faults
    for name, mtbf in (
        ("faults.rank_mtbf_hours", f.rank_mtbf_hours),
        ("faults.rank_loss_mtbf_hours", f.rank_loss_mtbf_hours),
        ("faults.hang_mtbf_hours", f.hang_mtbf_hours),
    ):
        expected = cluster_rate_per_s(mtbf, ranks) * horizon_s
        if expected > MAX_FAULTS:
            raise ScenarioError(
                f"{src}: {name}: {mtbf:g} h per rank on {ranks} ranks gives {expected:.3g} faults in "
                f"{horizon_s / 86400:g} days, over the limit of {MAX_FAULTS:,}; raise the MTBF or shorten workload.days"
            )


def simulate_training(
    scenario: Scenario,
    *,
    overrides: Mapping[str, Any] | None = None,
    adjust: StageAdjust | None = None,
    timeline: bool = True,
    progress: Callable[[int, int], None] | None = None,
    step_faults: Sequence[StepFault] = (),
    **flags: Any,
) -> TrainingResult:
    """Run every policy of ``scenario`` on one shared fault trace.

    ``flags`` are the CLI's (``ranks``, ``days``, ``step_seconds``, ``rank_mtbf_hours``,
    ``checkpoint_every``, ``checkpoint_seconds``, ``checkpoint_mode``, ``policies``,
    ``seed``, ``work_steps``); ``overrides`` are dotted scenario paths. ``adjust`` rewrites modelled
    stage durations (calibration); the scenario's ``recovery.stage_seconds`` win over both.
    ``progress(done, total)`` is called after each policy. ``step_faults`` are faults placed
    by step (a live run's trace), added to the scenario's.
    """
    all_overrides = {**training_overrides(**flags), **dict(overrides or {})}
    if all_overrides:
        scenario = with_overrides(scenario, all_overrides, source=f"{scenario.name} (overrides)")
    ranks = scenario.workload.ranks or scenario.mesh().world_size
    w = derive_workload(scenario.workload, scenario.checkpointing, ranks, source=scenario.name)
    horizon = scenario.workload.days * 86400.0
    check_bounds(scenario, w, ranks, horizon)
    aged = scenario.faults.at_checkpoint_age
    if aged is not None and aged.steps >= w.checkpoint_every:
        raise ScenarioError(
            f"{scenario.name}: faults.at_checkpoint_age.steps: {aged.steps} steps is not inside a "
            f"checkpoint interval of {w.checkpoint_every}; expected fewer steps than checkpointing.every_steps"
        )
    for i, sf in enumerate(step_faults):
        if not 0 <= sf.rank < ranks or sf.step < 0 or not 0 <= sf.offset_s < math.inf:
            raise ScenarioError(
                f"{scenario.name}: step fault {i}: rank {sf.rank}, step {sf.step}, offset {sf.offset_s} s; "
                f"expected rank 0..{ranks - 1}, step >= 0 and a finite offset >= 0"
            )
    if aged is not None and aged.rank >= ranks:
        raise ScenarioError(
            f"{scenario.name}: faults.at_checkpoint_age.rank: rank {aged.rank} is not in the job; "
            f"expected 0..{ranks - 1}"
        )
    trace = fault_trace(scenario.faults, ranks, horizon, source=scenario.name)
    costs = scenario.recovery.recovery_costs(scenario.name)
    fixed = scenario.recovery.stage_seconds

    def combined(policy: Policy, n: int, d: Mapping[Stage, float]) -> Mapping[Stage, float]:
        out = dict(adjust(policy, n, d)) if adjust else dict(d)
        out.update(fixed.get(policy, {}))
        return out

    policies = list(dict.fromkeys(scenario.recovery.policies))
    results: dict[Policy, PolicyResult] = {}
    for i, p in enumerate(policies):
        results[p] = _Run(
            w, p, costs, trace, horizon, scenario.faults, combined if (adjust or fixed) else None, timeline, step_faults
        ).run()
        if progress:
            progress(i + 1, len(policies))
    return TrainingResult(scenario=scenario.name, workload=w, horizon_s=horizon, trace=trace, policies=results)
