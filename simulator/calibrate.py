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
says zero.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping

from meshpact.core.errors import RecordingError
from meshpact.core.recording import EventKind, iter_events
from meshpact.core.recovery import Policy, Stage
from meshpact.core.recovery_costs import DEFAULT_RECOVERY_COSTS, RecoveryCosts, estimate_recovery

__all__ = ["Calibration", "calibration_from_recording"]


@dataclass(frozen=True)
class Calibration:
    source: str
    ranks: int
    measured: Mapping[Policy, Mapping[Stage, float]]  # mean over recoveries, seconds
    recoveries: Mapping[Policy, int]
    costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS

    def adjust(self, policy: Policy, ranks: int, modelled: Mapping[Stage, float]) -> Mapping[Stage, float]:
        """Modelled durations at ``ranks`` with every measured stage of ``policy`` applied."""
        measured = self.measured.get(Policy(policy), {})
        if not measured:
            return modelled
        at_recorded = estimate_recovery(policy, self.ranks, self.costs).durations_s
        out = dict(modelled)
        for stage, seconds in measured.items():
            base = at_recorded.get(stage, 0.0)
            out[stage] = modelled.get(stage, 0.0) * seconds / base if base > 0 else seconds
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "ranks": self.ranks,
            "measured_s": {p.value: {s.value: v for s, v in st.items()} for p, st in self.measured.items()},
            "recoveries": {p.value: n for p, n in self.recoveries.items()},
        }


def calibration_from_recording(
    path: str | os.PathLike[str], costs: RecoveryCosts = DEFAULT_RECOVERY_COSTS
) -> Calibration:
    """Read the measured stage durations of ``path`` (see the module's rules)."""
    default_policy = Policy.IN_MEMORY
    ranks_meta: int | None = None
    seen_ranks: set[int] = set()
    summaries: list[tuple[Policy | None, dict[Stage, float]]] = []
    # recovery key -> [policy or None, stage -> slowest rank's seconds]
    grouped: dict[Any, list[Any]] = {}
    per_rank: dict[Any, tuple[int, set[Stage]]] = {}  # rank -> (index, stages seen in it)
    for i, ev in enumerate(iter_events(path)):
        where = f"{path}: event at t={ev.t}"
        if i == 0 and ev.event == EventKind.RECORDING_START:
            if ev.data.get("policy"):
                default_policy = _policy(ev.data["policy"], where)
            for key in ("world_size", "ranks"):
                if isinstance(ev.data.get(key), int):
                    ranks_meta = int(ev.data[key])
            continue
        if ev.rank is not None:
            seen_ranks.add(ev.rank)
        if isinstance(ev.data.get("stages_s"), Mapping):
            stages = {}
            for name, v in ev.data["stages_s"].items():
                if name in _STAGE_NAMES and name != Stage.REPLAY.value and v is not None:
                    stages[Stage(name)] = _seconds(v, where)
            policy = _policy(ev.data["policy"], where) if ev.data.get("policy") else None
            summaries.append((policy, stages))
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
    recoveries = summaries or [(p, st) for p, st in grouped.values() if st]
    if not recoveries:
        raise RecordingError(
            f"{path}: no stage durations found; expected events with a recovery stage "
            f"({', '.join(s.value for s in Stage)}) and data.seconds, or data.stages_s"
        )
    sums: dict[Policy, dict[Stage, list[float]]] = defaultdict(lambda: defaultdict(list))
    count: dict[Policy, int] = defaultdict(int)
    for policy, stages in recoveries:
        policy = policy or default_policy
        count[policy] += 1
        for stage, sec in stages.items():
            sums[policy][stage].append(sec)
    measured = {p: {s: sum(v) / len(v) for s, v in st.items()} for p, st in sums.items()}
    ranks = ranks_meta or (max(seen_ranks) + 1 if seen_ranks else 1)
    return Calibration(source=str(path), ranks=ranks, measured=measured, recoveries=dict(count), costs=costs)


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
