"""Closing the loop: a live recovery run replayed in the simulator, predicted against measured.

A fresh ``meshpact live recover --record`` recording holds what one live run measured: each
rank's training loop (``trained``: every step's seconds), each checkpoint's write time
(``checkpoint``: ``seconds``), each fault (``fault_injected``: step, rank, wall time) and each
recovery (``recovered``: policy, stage durations, downtime from the injection to the moment
every rank could resume). :func:`live_run_from_recording` reduces it to the numbers the
simulator takes:

* **step time**: the mean over steps of the slowest rank's step (a synchronous step lasts as
  long as its slowest rank; the mean, because a total is a sum), leaving out the first step
  (warm-up), the steps a fault struck and the steps that wrote a checkpoint;
* **warm-up**: how much longer the first step took than that (measured; the simulator has no
  warm-up, so it is added to the prediction as measured);
* **checkpoint write**: the mean over the faulted run's checkpoints of the slowest rank's
  write (a cold-restart baseline recorded after it writes checkpoints of its own);
* **stage durations**: the calibration of :mod:`.calibrate` (mean per policy);
* **the trace**: every fault at the step it struck, ``offset_s`` into that step (from the
  injection time and the injecting rank's step start).

:func:`replay_live` then simulates the same work (``work_steps`` = the run's steps) under the
policy the live runtime decided for every fault (``in_memory`` for a transient fault; for a
kill ``peer_restore``, a replacement taking the lost rank's state from a peer, or ``excise``;
where the faults got different policies, ``in_memory``, on which a lost rank means a
checkpoint restore). A fault may be answered by more than one round at its step: the first
round's policy is the fault's, the last round's end its downtime. It reports, per fault, the simulated recovery (the sum of its stages)
against the measured downtime, and the simulated time of the training loop against the
measured one, both with the measured warm-up added and without the first step at all
(``steady``). No parameter is fitted to either: the total follows from the step time, the
checkpoint writes and the stage durations.

What the recording does not give is named in :attr:`Replay.notes` rather than guessed; a
recording that lacks what the replay needs (one made before ``trained`` events and
checkpoint write times were recorded) is refused with one line saying so.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, replace
from typing import Any

from meshpact.core.errors import RecordingError
from meshpact.core.recording import EventKind, iter_events
from meshpact.core.recovery import Policy, Stage
from meshpact.core.catalog import get_model
from meshpact.core.recovery_costs import FaultImpact, estimate_recovery
from meshpact.core.scenario import Scenario, builtin_scenario_path, load_scenario

from .calibrate import Calibration, calibration_from_recording
from .training import StepFault, simulate_training
from .workload import derive_workload, parameter_counts

__all__ = ["LiveFault", "LiveRun", "FaultComparison", "Replay", "live_run_from_recording", "replay_live", "LIVE_POLICY"]

# the policy of the live runtime: in memory when every rank is alive and agrees, else a restore
LIVE_POLICY = Policy.IN_MEMORY

# live fault kinds that take a rank's process (and its memory) with them
_RANK_LOSS_KINDS = frozenset({"kill"})


@dataclass(frozen=True)
class LiveFault:
    """One fault of the live run and what its recovery measured."""

    index: int
    step: int
    rank: int
    impact: FaultImpact
    offset_s: float  # into the step, when it struck
    policy: Policy  # what the live runtime decided
    downtime_s: float  # injection to every rank able to resume


@dataclass(frozen=True)
class LiveRun:
    """What one live run measured, reduced to the simulator's inputs and the numbers to compare."""

    source: str
    ranks: int
    steps: int
    checkpoint_every: int
    fault_kind: str
    step_s: float
    warmup_s: float
    checkpoint_s: float
    checkpoints: int
    total_s: float  # the training loop, slowest rank: first step begun to last step committed
    first_step_s: float  # the first step of the rank whose loop took longest
    faults: tuple[LiveFault, ...]
    unrecovered: int = 0  # faults injected with no recovery at their step (nothing to compare; not replayed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "ranks": self.ranks,
            "steps": self.steps,
            "checkpoint_every": self.checkpoint_every,
            "fault_kind": self.fault_kind,
            "step_s": self.step_s,
            "warmup_s": self.warmup_s,
            "checkpoint_s": self.checkpoint_s,
            "checkpoints": self.checkpoints,
            "total_s": self.total_s,
            "first_step_s": self.first_step_s,
            "unrecovered": self.unrecovered,
            "faults": [
                {
                    "index": f.index,
                    "step": f.step,
                    "rank": f.rank,
                    "impact": f.impact.value,
                    "offset_s": f.offset_s,
                    "policy": f.policy.value,
                    "downtime_s": f.downtime_s,
                }
                for f in self.faults
            ],
        }


@dataclass(frozen=True)
class FaultComparison:
    step: int
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        return self.predicted_s / self.measured_s - 1.0 if self.measured_s > 0 else float("inf")


@dataclass(frozen=True)
class Replay:
    """Predicted against measured: downtime per fault and the training loop's total time."""

    run: LiveRun
    calibration: Calibration
    faults: tuple[FaultComparison, ...]
    simulated_wall_s: float  # the simulator's time to finish the steps
    predicted_total_s: float  # that, plus the measured warm-up (and a closing checkpoint)
    notes: tuple[str, ...]
    policy: Policy = LIVE_POLICY  # the policy simulated: the one the live runtime decided for every fault

    @property
    def measured_downtime_s(self) -> float:
        return statistics.fmean(f.measured_s for f in self.faults) if self.faults else 0.0

    @property
    def predicted_downtime_s(self) -> float:
        return statistics.fmean(f.predicted_s for f in self.faults) if self.faults else 0.0

    @property
    def downtime_error(self) -> float:
        """Mean predicted downtime per fault over the measured mean, minus one."""
        m = self.measured_downtime_s
        return self.predicted_downtime_s / m - 1.0 if m > 0 else 0.0

    @property
    def total_error(self) -> float:
        return self.predicted_total_s / self.run.total_s - 1.0

    @property
    def steady(self) -> tuple[float, float] | None:
        """(measured, predicted) seconds of the loop after its first step; None when a fault struck it."""
        if any(f.step == 0 for f in self.run.faults):
            return None
        return self.run.total_s - self.run.first_step_s, self.predicted_total_s - self.run.warmup_s - self.run.step_s

    @property
    def steady_error(self) -> float | None:
        s = self.steady
        return None if s is None else s[1] / s[0] - 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run.to_dict(),
            "calibration": self.calibration.to_dict(),
            "policy": self.policy.value,
            "faults": [
                {"step": f.step, "measured_s": f.measured_s, "predicted_s": f.predicted_s, "error": f.error}
                for f in self.faults
            ],
            "downtime_per_fault_s": {
                "measured": self.measured_downtime_s,
                "predicted": self.predicted_downtime_s,
                "error": self.downtime_error,
            },
            "total_s": {
                "measured": self.run.total_s,
                "predicted": self.predicted_total_s,
                "simulated": self.simulated_wall_s,
                "error": self.total_error,
            },
            "steady_s": None
            if self.steady is None
            else {"measured": self.steady[0], "predicted": self.steady[1], "error": self.steady_error},
            "notes": list(self.notes),
        }


def live_run_from_recording(path: str | os.PathLike[str]) -> LiveRun:
    """The measured inputs and outcomes of the live run recorded in ``path`` (see the module)."""
    header: dict[str, Any] = {}
    trained: dict[int, tuple[float, int, list[float]]] = {}  # rank -> (t at end, first step, step seconds)
    writes: list[tuple[float, int, float]] = []  # t, checkpoint step, seconds (one rank's write)
    injected: list[tuple[int, int, int, str, float]] = []  # index, step, rank, kind, t
    recovered: dict[int, tuple[Policy, float]] = {}  # step -> (policy, downtime)
    for i, ev in enumerate(iter_events(path)):
        try:
            _read_event(i, ev, path, header, trained, writes, injected, recovered)
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordingError(
                f"{path}: event {i + 1} ({ev.event}) is malformed ({type(exc).__name__}: {exc}); "
                "expected the fields a live recovery trial writes"
            ) from None
    return _reduce(path, header, trained, writes, injected, recovered)


def _read_event(
    i: int,
    ev: Any,
    path: Any,
    header: dict[str, Any],
    trained: dict[int, tuple[float, int, list[float]]],
    writes: list[tuple[float, int, float]],
    injected: list[tuple[int, int, int, str, float]],
    recovered: dict[int, tuple[Policy, float]],
) -> None:
    """Keep what ``ev`` (the ``i``-th event) adds to the run's measurements."""
    if i == 0:
        if ev.event != EventKind.RECORDING_START:
            raise RecordingError(f"{path}: the first event must be 'recording_start'")
        header.update(ev.data)
    elif ev.event == EventKind.TRAINED and ev.rank is not None:
        if int(ev.data.get("incarnation", 0)) == 0:
            trained[ev.rank] = (ev.t, int(ev.data["first_step"]), [float(x) for x in ev.data["step_s"]])
    elif ev.event == EventKind.CHECKPOINT and "seconds" in ev.data:
        writes.append((ev.t, int(ev.data["step"]), float(ev.data["seconds"])))
    elif ev.event == EventKind.FAULT_INJECTED:
        injected.append(
            (int(ev.data["index"]), int(ev.data["step"]), int(ev.rank or 0), str(ev.data.get("kind", "")), ev.t)
        )
    elif ev.event == EventKind.RECOVERED and ev.data.get("downtime_s") is not None:
        # a fault may be followed by more than one round at its step (a kill: the peer restore, then an
        # in-memory round): the first round's policy answered it, the last one's end is its downtime
        step, policy, downtime = int(ev.data["step"]), Policy(ev.data["policy"]), float(ev.data["downtime_s"])
        first = recovered.get(step)
        recovered[step] = (first[0], max(first[1], downtime)) if first else (policy, downtime)


def _reduce(
    path: Any,
    header: dict[str, Any],
    trained: dict[int, tuple[float, int, list[float]]],
    writes: list[tuple[float, int, float]],
    injected: list[tuple[int, int, int, str, float]],
    recovered: dict[int, tuple[Policy, float]],
) -> LiveRun:
    need = "record a fresh one with `meshpact live recover --record PATH`"
    if header.get("kind") != "recovery_trial":
        raise RecordingError(f"{path}: not a live recovery trial (recording_start kind {header.get('kind')!r}); {need}")
    missing = [k for k in ("ranks", "steps", "checkpoint_every") if not isinstance(header.get(k), int)]
    if missing:
        raise RecordingError(f"{path}: recording_start lacks {', '.join(missing)}; {need}")
    ranks, steps, every = int(header["ranks"]), int(header["steps"]), int(header["checkpoint_every"])
    full = {r: v for r, v in trained.items() if v[1] == 0 and len(v[2]) == steps}
    if not full:
        raise RecordingError(f"{path}: no 'trained' events with every step's seconds; {need}")
    # the faulted run's checkpoints only: a cold-restart baseline recorded after it writes its own
    t_end = max(v[0] for v in full.values())
    slowest_write: dict[int, float] = {}
    for t, step, sec in writes:
        if t <= t_end:
            slowest_write[step] = max(slowest_write.get(step, 0.0), sec)
    if not slowest_write:
        raise RecordingError(f"{path}: no checkpoint write times ('checkpoint' events with seconds); {need}")
    fault_steps = {step for _, step, _, _, _ in injected}
    # the rank whose loop took longest sets the measured total; its own steps give the step time. A
    # per-step maximum over ranks would not: under load each rank's descheduled steps fall on
    # different steps, and their maxima add up to more than any rank's loop took
    critical = max(full.values(), key=lambda v: sum(v[2]))[2]
    clean = [critical[s] for s in range(1, steps) if s not in fault_steps and (s + 1) % every != 0]
    if not clean:
        raise RecordingError(
            f"{path}: no step without a fault or a checkpoint to measure the step time from; record more steps"
        )
    step_s = statistics.fmean(clean)
    warmup_s = max(0.0, critical[0] - step_s) if 0 not in fault_steps else 0.0
    faults = []
    for index, step, rank, kind, t in sorted(injected):
        if step not in recovered:
            continue  # fired but not followed by a recovery at its step: nothing measured to compare
        policy, downtime = recovered[step]
        t_end, _, secs = full.get(rank, next(iter(full.values())))
        t_step = t_end - sum(secs[step:])  # when that step began on the injecting rank
        offset = min(max(t - t_step, 0.0), step_s)
        impact = FaultImpact.RANK_LOSS if kind in _RANK_LOSS_KINDS else FaultImpact.TRANSIENT
        faults.append(LiveFault(index, step, rank, impact, offset, policy, downtime))
    return LiveRun(
        source=str(path),
        ranks=ranks,
        steps=steps,
        checkpoint_every=every,
        fault_kind=str(header.get("fault_kind", "")),
        step_s=step_s,
        warmup_s=warmup_s,
        checkpoint_s=statistics.fmean(slowest_write.values()),
        checkpoints=len(slowest_write),
        total_s=sum(critical),
        first_step_s=critical[0],
        faults=tuple(faults),
        unrecovered=len(injected) - len(faults),
    )


def _scenario(run: LiveRun, detection_s: float, policy: Policy, shard_bytes: float | None) -> Scenario:
    """The live run as a scenario: its ranks, steps, step time, checkpoints; no random faults.
    A lost rank's replacement is asked for at the measured detection and waits no further:
    live mode's survivors wait for it inside the consensus stage, which is measured. Under a
    peer policy each rank is its own failure domain (live mode's holder is another process: a
    kill takes one), and the shard is the recorded one (``shard_bytes``, the bytes a replacement
    fetched), so the copy the measured step already includes is not charged again."""
    from meshpact.core.scenario import with_overrides

    base = load_scenario(builtin_scenario_path("default"))
    extra: dict[str, object] = {}
    if policy in (Policy.PEER_RESTORE, Policy.EXCISE):
        extra["faults.ranks_per_node"] = 1
        if shard_bytes:
            total, _ = parameter_counts(get_model(base.workload.model))
            extra["workload.state_bytes_per_param"] = shard_bytes * max(run.ranks, 1) / total
    return with_overrides(
        base,
        {
            "workload.ranks": run.ranks,
            "workload.parallelism": {"tensor": 1, "pipeline": 1},
            "workload.step_seconds": run.step_s,
            "workload.tokens_per_step": None,
            "workload.step_time_cv": 0.0,
            "workload.work_steps": run.steps,
            "workload.days": 1.0,
            "faults.rank_mtbf_hours": None,
            "faults.rank_loss_mtbf_hours": None,
            "faults.hang_mtbf_hours": None,
            "faults.scripted": [],
            "faults.at_checkpoint_age": None,
            "faults.spare_ranks": 0,
            "faults.ranks_per_node": max(run.ranks, 1),
            **extra,
            "checkpointing.every_steps": run.checkpoint_every,
            "checkpointing.mode": "sync",
            "checkpointing.seconds": run.checkpoint_s,
            "recovery.policies": [policy.value],
            "recovery.costs.replacement_s": 0.0,
            "recovery.costs.detection_s": detection_s,
        },
        source=f"{run.source} (replayed)",
    )


def replay_live(path: str | os.PathLike[str]) -> Replay:
    """Simulate the live run of ``path`` from its measured costs; compare with what it measured."""
    run = live_run_from_recording(path)
    cal = calibration_from_recording(path)
    notes = []
    if run.unrecovered:
        notes.append(f"{run.unrecovered} injected fault(s) had no recovery at their step: not replayed")
    decided = {f.policy for f in run.faults}
    policy = decided.pop() if len(decided) == 1 else LIVE_POLICY
    if decided:
        notes.append(
            f"the live runtime answered the faults with {len(decided) + 1} policies; replayed under {LIVE_POLICY.value}"
        )
    if policy is Policy.EXCISE:
        notes.append(
            "each lost rank is excised, not replaced: the survivors go on with the same global batch, "
            "the simulator's replicas one fewer per loss"
        )
    elif any(f.impact is FaultImpact.RANK_LOSS for f in run.faults):
        notes.append(
            "a lost rank's replacement start is inside the measured consensus (survivors wait there for it); "
            "no restart stage is added"
        )
    # the replacement is asked for when the replayed policy's recoveries detected the loss
    detections = [st[Stage.DETECTION] for p, st in cal.measured.items() if Stage.DETECTION in st and p is policy]
    detections = detections or [st[Stage.DETECTION] for st in cal.measured.values() if Stage.DETECTION in st]
    moved = (cal.state_bytes or {}).get(policy)
    scenario = _scenario(
        run,
        statistics.fmean(detections) if detections else cal.costs.detection_s,
        policy,
        moved.bytes if moved is not None else None,
    )
    # the calibration's reference is the simulated job itself (its shard), so each measured stage is used as measured
    w = derive_workload(scenario.workload, scenario.checkpointing, run.ranks, source=scenario.name)
    cal = replace(
        cal, costs=replace(scenario.recovery.recovery_costs(scenario.name), state_bytes_per_rank=w.state_bytes_per_rank)
    )
    as_measured = replace(cal, state_bytes=None)  # the simulated job is the recorded one: no shard to scale by
    if run.warmup_s > 0:
        notes.append(f"first-step warm-up {run.warmup_s:.3f} s is measured, not simulated: added to the prediction")
    unmeasured: list[str] = []
    for f in run.faults:  # each recovery as the live runtime ran it
        modelled = estimate_recovery(f.policy, run.ranks, cal.costs, impact=f.impact, replacement_s=0.0).durations_s
        unmeasured += [
            s.value
            for s, d in modelled.items()
            if s is not Stage.REPLAY and d > 0 and s not in cal.measured.get(f.policy, {}) and s.value not in unmeasured
        ]
    if unmeasured:
        notes.append(f"stages not in the recording, taken from the cost model: {', '.join(unmeasured)}")
    closing = run.checkpoint_s if run.steps % run.checkpoint_every == 0 else 0.0
    if closing:
        notes.append("the checkpoint after the last step is added (the simulation ends at the last commit)")
    result = simulate_training(
        scenario,
        adjust=as_measured.adjust,
        timeline=True,
        step_faults=[StepFault(f.step, f.impact, f.rank, f.offset_s) for f in run.faults],
    )
    r = result.policies[policy]
    recoveries: list[float] = []
    for e in r.timeline:
        if e.kind == "stage" and e.stage is not None:
            if e.stage is Stage.DETECTION:
                recoveries.append(0.0)
            if recoveries:
                recoveries[-1] += e.duration_s
    if len(recoveries) != len(run.faults):
        notes.append(f"the simulation recovered {len(recoveries)} times for {len(run.faults)} faults")
    comparisons = tuple(FaultComparison(f.step, f.downtime_s, p) for f, p in zip(run.faults, recoveries))
    return Replay(
        run=run,
        calibration=cal,
        faults=comparisons,
        simulated_wall_s=r.wall_s,
        predicted_total_s=r.wall_s + run.warmup_s + closing,
        notes=tuple(notes),
        policy=policy,
    )
