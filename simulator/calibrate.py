"""Calibration: stage durations taken from a live recording, so measured and simulated agree.

A recording (``core/recording.py`` JSONL, or its ``.partial`` while it is being written)
is read in one of two forms:

* **per-recovery summaries**: events whose ``data.stages_s`` maps stage names to seconds
  (live mode's ``recovered`` events, already the slowest rank per stage), with
  ``data.policy``. When a recording has these, they are used alone.
* **per-stage events**: every event whose ``stage`` is a recovery
  :class:`~meshpact.core.recovery.Stage` and whose ``data`` holds ``seconds``. Events of
  one recovery share ``data.recovery`` when given; otherwise each rank's events are cut
  into recoveries in order (a new one begins at ``detection`` or when a stage repeats),
  and the k-th recovery of every rank is the same recovery. A stage lasts as long as its
  slowest rank (the critical path). The policy is any ``data.policy`` seen in that
  recovery (live mode's ``decided`` event carries it).

The policy falls back to the ``recording_start`` policy, else ``in_memory`` (the runtime
live mode runs). Recoveries are averaged per policy. The ``replay`` stage is left out:
the simulator derives it from lost steps.

The measurement is made at a few ranks; the simulator runs at thousands. Each measured
stage therefore scales the model: at ``N`` ranks a stage lasts
``model(N) * measured / model(N_recorded)``, or the measured seconds where the model
says zero. ``peer_restore`` and ``excise`` are decided only when a rank is lost, so their
recorded recoveries are compared with the model of a rank loss; where the recording says how
many bytes their state stage moved (``reloaded`` events: a replacement's ``bytes`` fetched
from its holder, an excision's ``excision.bytes_moved`` gathered for the re-shard), the state
stage scales with the simulated shard over those bytes instead of the model's default shard.
:meth:`Calibration.provenance` says, per policy and stage, whether the seconds come from the
recording or stayed the cost model's default.

**Peer-copy overhead.** A live trial's ``summary`` carries ``peer_copy_overhead``: per commit
and rank, the training thread's seconds in the copy (``snapshot_ms_per_commit``: the host copy
and any wait for the previous copy still in flight; ``host_copy_ms_per_commit``: the host copy
alone), the background ship's seconds (``ship_ms_mean``; ``ship_cpu_ms_per_commit``: the CPU
seconds of serialising and sending), the CPU seconds of
receiving the other ranks' copies (``receive_cpu_ms_per_commit``), the step's
own CPU seconds (``step_cpu_ms``, the process less the copy's threads), the host's cores per
rank, the bytes the whole job ships per step, and the median step. :class:`PeerCopyCalibration`
sets the rates of :func:`~meshpact.core.recovery_costs.peer_copy_cost` from them: the host copy
rate from one copy's bytes over the host copy's seconds, ``peer_bytes_per_s`` from the K copies'
bytes over the ship's seconds, ``peer_cpu_bytes_per_s`` over its CPU seconds and
``peer_receive_bytes_per_s`` over the receive's (the ship's seconds, and the cost model's
default, in recordings without them), the cores
per rank as measured, and the step's busy cores from its CPU seconds. Nothing is fitted to
the measured stretch: the model predicts the training thread's time in the copy (judged against
``snapshot_ms_per_commit``) and the step's stretch over a step without copies (judged against
a run without copies, :meth:`PeerCopyCalibration.judge`).
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any, Mapping

from meshpact.core.errors import RecordingError
from meshpact.core.jsonform import JsonObject
from meshpact.core.recording import Event, EventKind, iter_events
from meshpact.core.recovery import Policy, Stage
from meshpact.core.recovery_costs import (
    DEFAULT_RECOVERY_COSTS,
    FaultImpact,
    PeerCopyCost,
    RecoveryCosts,
    estimate_recovery,
    peer_copy_cost,
)

__all__ = [
    "Calibration",
    "Provenance",
    "StateTransfer",
    "PeerCopyMeasurement",
    "PeerCopyCalibration",
    "PeerCopyJudgement",
    "calibration_from_recording",
    "peer_copy_calibration",
    "RANK_LOSS_POLICIES",
]

# policies live mode decides only when a rank is lost: their recoveries are rank losses
RANK_LOSS_POLICIES = frozenset({Policy.PEER_RESTORE, Policy.EXCISE})


class Provenance(str, Enum):
    """Where the seconds of one stage of one policy come from."""

    RECORDING = "recording"  # measured in the live run (scaled to the simulated ranks and shard)
    MODEL = "model"  # the cost model's default (``RecoveryCosts``)


@dataclass(frozen=True)
class StateTransfer:
    """What the state stage of one policy's recoveries moved: the mean bytes of the slowest
    rank's transfer per recovery (a replacement's fetch from its holder, an excision's gather)."""

    bytes: float
    recoveries: int

    def to_dict(self) -> JsonObject:
        return {"bytes": self.bytes, "recoveries": self.recoveries}


@dataclass(frozen=True)
class PeerCopyMeasurement:
    """What keeping peer copies cost a live run (its summary's ``peer_copy_overhead``); the
    fields after ``step_s_reference`` are None in recordings made before they were measured."""

    ranks: int
    copies: int  # K holders per rank
    bytes_per_commit: float  # one rank's copies of one commit, all K holders together
    snapshot_s: float  # per commit, training thread: the host copy and any wait for the copy in flight
    ship_s: float  # per commit, background thread: serialise and send to the holders (wall)
    step_s: float  # median step of the run with copies
    step_s_reference: float | None  # median step of the trial's fault-free reference run (it keeps copies too)
    host_copy_s: float | None = None  # per commit, training thread: the host copy alone
    ship_cpu_s: float | None = None  # per commit: serialise and send (CPU seconds)
    receive_cpu_s: float | None = None  # per commit: receive the other ranks' K copies (CPU seconds)
    step_cpu_s: float | None = None  # per step: the process's CPU seconds less the copy's threads
    cores_per_rank: float | None = None  # the host's cores over the ranks on it

    @property
    def measured_s_per_step(self) -> float:
        """The seconds the copy takes from each step on the training thread."""
        return self.snapshot_s

    @property
    def compute_s(self) -> float:
        """The step without the copy's time on the training thread (this run's own estimate
        of a step without copies; a run without copies measures it)."""
        return max(self.step_s - self.snapshot_s, 0.0)

    def to_dict(self) -> JsonObject:
        return {
            "ranks": self.ranks,
            "copies": self.copies,
            "bytes_per_commit": self.bytes_per_commit,
            "snapshot_s": self.snapshot_s,
            "ship_s": self.ship_s,
            "step_s": self.step_s,
            "step_s_reference": self.step_s_reference,
            "host_copy_s": self.host_copy_s,
            "ship_cpu_s": self.ship_cpu_s,
            "receive_cpu_s": self.receive_cpu_s,
            "step_cpu_s": self.step_cpu_s,
            "cores_per_rank": self.cores_per_rank,
        }


@dataclass(frozen=True)
class PeerCopyJudgement:
    """The model against a measured stretch: the step with copies less the step without, both
    measured in one run (interleaved), the prediction made from the rates alone."""

    step_s_without: float
    step_s_with: float
    predicted_s_per_step: float

    @property
    def measured_s_per_step(self) -> float:
        return self.step_s_with - self.step_s_without

    @property
    def error(self) -> float | None:
        """Predicted over measured seconds per step, minus one (None where nothing was measured)."""
        m = self.measured_s_per_step
        return self.predicted_s_per_step / m - 1.0 if m > 0 else None

    def to_dict(self) -> JsonObject:
        return {
            "step_s_without": self.step_s_without,
            "step_s_with": self.step_s_with,
            "measured_s_per_step": self.measured_s_per_step,
            "predicted_s_per_step": self.predicted_s_per_step,
            "error": self.error,
        }


@dataclass(frozen=True)
class PeerCopyCalibration:
    """The peer-copy model calibrated from a measurement, and its predictions against it."""

    measured: PeerCopyMeasurement
    costs: RecoveryCosts  # the host copy rate, ``peer_bytes_per_s`` and the cores per rank as measured

    @classmethod
    def of(cls, m: PeerCopyMeasurement, costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS) -> "PeerCopyCalibration":
        """The rates of ``m`` (see the module): nothing from its step latency."""
        one_copy = m.bytes_per_commit / max(m.copies, 1)
        host = m.host_copy_s if m.host_copy_s else m.snapshot_s  # older recordings: the whole training-thread time
        ship_cpu = m.ship_cpu_s if m.ship_cpu_s else m.ship_s
        receive = m.bytes_per_commit / m.receive_cpu_s if m.receive_cpu_s else costs.peer_receive_bytes_per_s
        return cls(
            m,
            replace(
                costs,
                peer_bytes_per_s=m.bytes_per_commit / m.ship_s,
                peer_cpu_bytes_per_s=m.bytes_per_commit / ship_cpu,
                peer_receive_bytes_per_s=receive,
                host_copy_bytes_per_s=one_copy / host if host > 0 else costs.host_copy_bytes_per_s,
                cores_per_rank=m.cores_per_rank or costs.cores_per_rank,
            ),
        )

    def step_cores(self, step_s: float) -> float:
        """The cores a step of ``step_s`` keeps busy: its measured CPU seconds over ``step_s``
        (the costs' default where not measured)."""
        cpu = self.measured.step_cpu_s
        return cpu / step_s if cpu is not None and step_s > 0 else self.costs.step_cores_per_rank

    def cost(self, step_s: float) -> PeerCopyCost:
        """The model at a step of ``step_s`` without copies."""
        m = self.measured
        costs = replace(self.costs, step_cores_per_rank=self.step_cores(step_s))
        return peer_copy_cost(m.bytes_per_commit / max(m.copies, 1), step_s, costs, max(m.copies, 1))

    def judge(self, step_s_without: float, step_s_with: float) -> PeerCopyJudgement:
        """The predicted stretch of a step measured at ``step_s_without`` without copies,
        against the stretch measured (``step_s_with`` in the same run with them)."""
        return PeerCopyJudgement(step_s_without, step_s_with, self.cost(step_s_without).per_step_s)

    @property
    def predicted_s_per_step(self) -> float:
        """The predicted stretch of this run's step (its own estimate of the step without copies)."""
        return self.cost(self.measured.compute_s).per_step_s

    @property
    def predicted_thread_s(self) -> float:
        """The predicted training-thread time in the copy per commit."""
        return self.cost(self.measured.compute_s).training_thread_s

    @property
    def predicted_overhead(self) -> float:
        """Predicted step latency overhead: the stretch over the step without it."""
        c = self.measured.compute_s
        return self.predicted_s_per_step / c if c > 0 else 0.0

    @property
    def measured_overhead(self) -> float:
        """The training thread's time in the copy over the step without it (what this run
        alone measures; the whole stretch needs a run without copies)."""
        c = self.measured.compute_s
        return self.measured.measured_s_per_step / c if c > 0 else 0.0

    @property
    def error(self) -> float:
        """Predicted over measured training-thread seconds per commit, minus one (inf where
        nothing was measured)."""
        m = self.measured.measured_s_per_step
        return self.predicted_thread_s / m - 1.0 if m > 0 else math.inf

    def to_dict(self) -> JsonObject:
        return {
            "measured": self.measured.to_dict(),
            "peer_bytes_per_s": self.costs.peer_bytes_per_s,
            "host_copy_bytes_per_s": self.costs.host_copy_bytes_per_s,
            "peer_cpu_bytes_per_s": self.costs.peer_cpu_bytes_per_s,
            "peer_receive_bytes_per_s": self.costs.peer_receive_bytes_per_s,
            "cores_per_rank": self.costs.cores_per_rank,
            "step_cores_per_rank": self.step_cores(self.measured.compute_s),
            "s_per_step": {
                "measured": self.measured.measured_s_per_step,
                "predicted": self.predicted_thread_s,
                "error": None if math.isinf(self.error) else self.error,
            },
            "stretch_s_per_step_predicted": self.predicted_s_per_step,
            "step_latency": {"measured": self.measured_overhead, "predicted": self.predicted_overhead},
        }


@dataclass(frozen=True)
class Calibration:
    source: str
    ranks: int
    measured: Mapping[Policy, Mapping[Stage, float]]  # mean over recoveries, seconds
    recoveries: Mapping[Policy, int]
    costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS
    state_bytes: Mapping[Policy, StateTransfer] | None = None  # what the state stage moved, where recorded
    peer_copy: PeerCopyCalibration | None = None

    def _recorded(self, policy: Policy) -> Mapping[Stage, float]:
        """The model's durations of ``policy`` at the recorded ranks (and shard, where recorded)."""
        impact = FaultImpact.RANK_LOSS if policy in RANK_LOSS_POLICIES else FaultImpact.TRANSIENT
        costs = self.costs
        moved = (self.state_bytes or {}).get(policy)
        if moved is not None and moved.bytes > 0:
            costs = replace(costs, state_bytes_per_rank=moved.bytes)
        return estimate_recovery(policy, self.ranks, costs, impact=impact, replacement_s=0.0).durations_s

    def adjust(self, policy: Policy, ranks: int, modelled: Mapping[Stage, float]) -> Mapping[Stage, float]:
        """Modelled durations at ``ranks`` with every measured stage of ``policy`` applied."""
        policy = Policy(policy)
        measured = self.measured.get(policy, {})
        if not measured:
            return modelled
        at_recorded = self._recorded(policy)
        out = dict(modelled)
        for stage, seconds in measured.items():
            base = at_recorded.get(stage, 0.0)
            out[stage] = modelled.get(stage, 0.0) * seconds / base if base > 0 else seconds
        return out

    def provenance(self, policy: Policy | str) -> Mapping[Stage, Provenance]:
        """Per stage of ``policy``'s recovery (a rank loss for ``peer_restore`` and ``excise``),
        whether its seconds come from this recording or stayed the cost model's default."""
        policy = Policy(policy)
        measured = self.measured.get(policy, {})
        stages: list[Stage] = [s for s in self._recorded(policy) if s is not Stage.REPLAY]
        stages += [s for s in measured if s not in stages]
        return {s: Provenance.RECORDING if s in measured else Provenance.MODEL for s in Stage.ordered() if s in stages}

    def to_dict(self) -> JsonObject:
        return {
            "source": self.source,
            "ranks": self.ranks,
            "measured_s": {p.value: {s.value: v for s, v in st.items()} for p, st in self.measured.items()},
            "recoveries": {p.value: n for p, n in self.recoveries.items()},
            "provenance": {p.value: {s.value: v.value for s, v in self.provenance(p).items()} for p in Policy},
            "state_bytes": {p.value: t.to_dict() for p, t in (self.state_bytes or {}).items()},
            "peer_copy": self.peer_copy.to_dict() if self.peer_copy is not None else None,
        }


def calibration_from_recording(
    path: str | os.PathLike[str], costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS
) -> Calibration:
    """Read the measured stage durations of ``path`` (see the module's rules)."""
    default_policy = Policy.IN_MEMORY
    ranks_meta: int | None = None
    seen_ranks: set[int] = set()
    summaries: list[tuple[Policy | None, dict[Stage, float], int | None]] = []  # policy, stages, generation
    # recovery key -> [policy or None, stage -> slowest rank's seconds]
    grouped: dict[Any, list[Any]] = {}
    per_rank: dict[Any, tuple[int, set[Stage]]] = {}  # rank -> (index, stages seen in it)
    moved: dict[int, float] = {}  # generation -> the most bytes one rank's state stage moved
    round_of: dict[int | None, int] = {}  # rank -> the generation (round) it last saw decided
    overhead: Mapping[str, Any] | None = None
    reporting: int | None = None
    for i, ev in enumerate(iter_events(path)):
        where = f"{path}: event at t={ev.t}"
        if i == 0 and ev.event == EventKind.RECORDING_START:
            if ev.data.get("policy"):
                default_policy = _policy(ev.data["policy"], where)
            for size_key in ("world_size", "ranks"):
                if isinstance(ev.data.get(size_key), int):
                    ranks_meta = int(ev.data[size_key])
            continue
        if ev.rank is not None:
            seen_ranks.add(ev.rank)
        if ev.event == EventKind.SUMMARY and isinstance(ev.data.get("peer_copy_overhead"), Mapping):
            overhead = ev.data["peer_copy_overhead"]
            if isinstance(ev.data.get("final_world_size"), int):  # the ranks whose copies were counted
                reporting = int(ev.data["final_world_size"])
        if ev.event == EventKind.DECIDED and isinstance(ev.data.get("round"), int):
            round_of[ev.rank] = int(ev.data["round"])
        if ev.event == EventKind.RELOADED and ev.rank in round_of:
            n = _bytes_moved(ev, where)
            if n is not None:
                decided = round_of[ev.rank]
                moved[decided] = max(moved.get(decided, 0.0), n)
        if isinstance(ev.data.get("stages_s"), Mapping):
            stages = {}
            for name, v in ev.data["stages_s"].items():
                if name in _STAGE_NAMES and name != Stage.REPLAY.value and v is not None:
                    stages[Stage(name)] = _seconds(v, where)
            policy = _policy(ev.data["policy"], where) if ev.data.get("policy") else None
            gen = ev.data.get("generation")
            summaries.append((policy, stages, gen if isinstance(gen, int) else None))
            continue
        if ev.stage is None or "seconds" not in ev.data:
            continue
        if "recovery" in ev.data:
            key: Any = ("recovery", ev.data["recovery"])
        else:
            index, stages_seen = per_rank.get(ev.rank, (-1, set()))
            if index < 0 or ev.stage is Stage.DETECTION or ev.stage in stages_seen:
                index, stages_seen = index + 1, set()
            stages_seen.add(ev.stage)
            per_rank[ev.rank] = (index, stages_seen)
            key = ("index", index)
        entry = grouped.setdefault(key, [None, {}])
        if ev.data.get("policy"):
            entry[0] = _policy(ev.data["policy"], where)
        if ev.stage is not Stage.REPLAY:
            seconds = _seconds(ev.data["seconds"], where)
            entry[1][ev.stage] = max(entry[1].get(ev.stage, 0.0), seconds)
    recoveries = summaries or [(p, st, None) for p, st in grouped.values() if st]
    if not recoveries:
        raise RecordingError(
            f"{path}: no stage durations found; expected events with a recovery stage "
            f"({', '.join(s.value for s in Stage)}) and data.seconds, or data.stages_s"
        )
    sums: dict[Policy, dict[Stage, list[float]]] = defaultdict(lambda: defaultdict(list))
    count: dict[Policy, int] = defaultdict(int)
    transfers: dict[Policy, list[float]] = defaultdict(list)
    for policy, stages, gen in recoveries:
        policy = policy or default_policy
        count[policy] += 1
        for stage, sec in stages.items():
            sums[policy][stage].append(sec)
        if policy in RANK_LOSS_POLICIES and gen is not None and moved.get(gen, 0.0) > 0:
            transfers[policy].append(moved[gen])
    measured = {p: {s: sum(v) / len(v) for s, v in st.items()} for p, st in sums.items()}
    ranks = ranks_meta or (max(seen_ranks) + 1 if seen_ranks else 1)
    state_bytes = {p: StateTransfer(sum(v) / len(v), len(v)) for p, v in transfers.items()}
    peer = peer_copy_calibration(overhead, reporting or ranks, costs, str(path)) if overhead is not None else None
    return Calibration(
        source=str(path),
        ranks=ranks,
        measured=measured,
        recoveries=dict(count),
        costs=costs,
        state_bytes=state_bytes,
        peer_copy=peer,
    )


def _bytes_moved(ev: Event, where: str) -> float | None:
    """The bytes a ``reloaded`` event moved: a replacement's fetch from its holder, or an
    excision's gather for the re-shard; None for any other reload (a checkpoint's)."""
    excision = ev.data.get("excision")
    if isinstance(excision, Mapping) and "bytes_moved" in excision:
        n = excision["bytes_moved"]
    elif "bytes" in ev.data:
        n = ev.data["bytes"]
    else:
        return None
    if isinstance(n, bool) or not isinstance(n, (int, float)) or not n >= 0 or not math.isfinite(n):
        raise RecordingError(f"{where}: reloaded bytes must be a number >= 0, got {n!r}")
    return float(n)


def peer_copy_calibration(
    o: Mapping[str, Any], ranks: int, costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS, where: str = "summary"
) -> PeerCopyCalibration | None:
    """The peer-copy model calibrated from a summary's ``peer_copy_overhead`` (None when it
    shipped nothing: no copies, or every copy failed). ``ranks`` are the ranks whose copies
    the summary counts: the final world's (after an excision, the survivors)."""
    need = ("network_bytes_per_step", "ship_ms_mean", "snapshot_ms_per_commit", "step_ms_with", "copies")
    values: dict[str, float] = {}
    for key in need:
        values[key] = _number(o.get(key), f"{where}: summary peer_copy_overhead.{key}")
    optional: dict[str, float | None] = {}
    for key in (
        "host_copy_ms_per_commit",
        "ship_cpu_ms_per_commit",
        "receive_cpu_ms_per_commit",
        "step_cpu_ms",
        "cores_per_rank",
    ):
        optional[key] = None if o.get(key) is None else _number(o[key], f"{where}: summary peer_copy_overhead.{key}")
    ref = o.get("step_ms_without")
    per_commit = values["network_bytes_per_step"] / max(ranks, 1)
    ship_s = values["ship_ms_mean"] / 1e3
    if per_commit <= 0 or ship_s <= 0:
        return None

    def ms(key: str) -> float | None:
        v = optional[key]
        return None if v is None else v / 1e3

    m = PeerCopyMeasurement(
        ranks=ranks,
        copies=int(values["copies"]),
        bytes_per_commit=per_commit,
        snapshot_s=values["snapshot_ms_per_commit"] / 1e3,
        ship_s=ship_s,
        step_s=values["step_ms_with"] / 1e3,
        step_s_reference=float(ref) / 1e3 if isinstance(ref, (int, float)) and ref else None,
        host_copy_s=ms("host_copy_ms_per_commit"),
        ship_cpu_s=ms("ship_cpu_ms_per_commit"),
        receive_cpu_s=ms("receive_cpu_ms_per_commit"),
        step_cpu_s=ms("step_cpu_ms"),
        cores_per_rank=optional["cores_per_rank"] or None,
    )
    return PeerCopyCalibration.of(m, costs)


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 or not math.isfinite(v):
        raise RecordingError(f"{what} must be a number >= 0, got {v!r}")
    return float(v)


_STAGE_NAMES = {s.value for s in Stage}


def _seconds(value: Any, where: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise RecordingError(f"{where}: seconds must be a number, got {value!r}") from None
    if not seconds >= 0:
        raise RecordingError(f"{where}: seconds must be >= 0, got {value!r}")
    return seconds


def _policy(value: Any, where: str) -> Policy:
    try:
        return Policy(value)
    except ValueError:
        raise RecordingError(f"{where}: policy {value!r} is not one of {[p.value for p in Policy]}") from None
