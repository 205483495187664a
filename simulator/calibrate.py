"""Calibration: stage durations taken from a live recording, so measured and simulated agree.

A recording (``core/recording.py`` JSONL, or its ``.partial`` while it is being written)
contributes every event whose ``stage`` is a recovery :class:`~meshpact.core.recovery.Stage`
and whose ``data`` holds ``seconds``. Events of one recovery (same ``data.generation``,
else ``data.recovery``) are combined by taking the slowest rank, which is the stage's
critical path; recoveries are then averaged. The policy is ``data.policy``, else the
recording's ``recording_start`` policy, else ``in_memory`` (the runtime live mode runs).
The ``replay`` stage is left out: the simulator derives it from lost steps.

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
from meshpact.core.recording import iter_events
from meshpact.core.recovery import DEFAULT_RECOVERY_COSTS, Policy, RecoveryCosts, Stage, estimate_recovery

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
    # (policy, recovery key) -> stage -> slowest rank's seconds
    per_recovery: dict[tuple[Policy, Any], dict[Stage, float]] = defaultdict(dict)
    for i, ev in enumerate(iter_events(path)):
        if i == 0 and ev.event == "recording_start":
            if ev.data.get("policy"):
                default_policy = _policy(ev.data["policy"], path)
            for key in ("world_size", "ranks"):
                if isinstance(ev.data.get(key), int):
                    ranks_meta = int(ev.data[key])
        if ev.rank is not None:
            seen_ranks.add(ev.rank)
        if ev.stage is None or ev.stage is Stage.REPLAY or "seconds" not in ev.data:
            continue
        try:
            seconds = float(ev.data["seconds"])
        except (TypeError, ValueError):
            raise RecordingError(f"{path}: event at t={ev.t}: data.seconds must be a number, got {ev.data['seconds']!r}") from None
        if seconds < 0:
            raise RecordingError(f"{path}: event at t={ev.t}: data.seconds must be >= 0, got {seconds}")
        policy = _policy(ev.data["policy"], path) if ev.data.get("policy") else default_policy
        key = (policy, ev.data.get("generation", ev.data.get("recovery", 0)))
        stages = per_recovery[key]
        stages[ev.stage] = max(stages.get(ev.stage, 0.0), seconds)
    if not per_recovery:
        raise RecordingError(
            f"{path}: no stage durations found; expected events with a recovery stage "
            f"({', '.join(s.value for s in Stage)}) and data.seconds"
        )
    sums: dict[Policy, dict[Stage, list[float]]] = defaultdict(lambda: defaultdict(list))
    count: dict[Policy, int] = defaultdict(int)
    for (policy, _), stages in per_recovery.items():
        count[policy] += 1
        for stage, s in stages.items():
            sums[policy][stage].append(s)
    measured = {p: {s: sum(v) / len(v) for s, v in st.items()} for p, st in sums.items()}
    ranks = ranks_meta or (max(seen_ranks) + 1 if seen_ranks else 1)
    return Calibration(source=str(path), ranks=ranks, measured=measured, recoveries=dict(count), costs=costs)


def _policy(value: Any, path: Any) -> Policy:
    try:
        return Policy(value)
    except ValueError:
        raise RecordingError(f"{path}: policy {value!r} is not one of {[p.value for p in Policy]}") from None
