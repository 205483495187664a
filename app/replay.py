"""Replay: simulated timelines and recordings as one sequence of frames on the mesh.

A replay is a list of :class:`ReplayEvent` in time order, built from a simulated
training timeline (:func:`from_timeline`) or a JSONL recording (:func:`from_recording`).
:func:`replay_frame` says what the mesh looks like at one event: which ranks are down,
the stage running, and the stage durations of the recovery in progress so far. A fault
marks its rank failed until the recovery that follows it ends (its stages are over, or
another event says the job went on). All of it is pure, so the page only draws frames.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from meshpact.core.facts import Domain, Mesh, Vendor
from meshpact.core.recording import Event, EventKind
from meshpact.core.recovery import Policy, RecoveryBreakdown, Stage

__all__ = [
    "recording_problem",
    "MAX_RECORDING_BYTES",
    "ReplayEvent",
    "ReplayFrame",
    "from_timeline",
    "from_recording",
    "from_breakdown",
    "replay_frame",
    "frame_breakdown",
    "find_recordings",
    "local_mesh",
    "recording_mesh",
    "first_recovery_index",
    "replay_frames",
]

_KEEP_SIMULATED = frozenset({"fault", "stage", "rejoin", "degraded"})
_POLICIES = frozenset(p.value for p in Policy)
_NEUTRAL = frozenset({"degraded", "call", "plan"})  # neither opens nor closes a recovery


@dataclass(frozen=True)
class ReplayEvent:
    t: float
    kind: str
    duration_s: float = 0.0
    stage: Stage | None = None
    rank: int | None = None
    data: Mapping[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        who = f" rank {self.rank}" if self.rank is not None else ""
        what = self.stage.value if self.stage else self.kind
        extra = f" ({self.data['fault']})" if self.kind == "fault" and "fault" in self.data else ""
        dur = f", {self.duration_s:.3g} s" if self.duration_s else ""
        return f"{what}{who}{extra}{dur}"


@dataclass(frozen=True)
class ReplayFrame:
    index: int
    event: ReplayEvent
    failed: frozenset[int]
    stage: Stage | None
    stages_so_far: Mapping[Stage, float]
    recoveries_before: int
    policy: Policy | None = None  # as decided by the recovery in progress, where an event says


def _rank(value: Any) -> int | None:
    try:
        return None if value is None or isinstance(value, bool) else int(value)
    except (TypeError, ValueError):
        return None


def from_timeline(events: Iterable[Any], policy: Policy | str | None = None) -> list[ReplayEvent]:
    """Replay events from a simulated timeline (``TimelineEvent`` objects or their dicts):
    faults, recovery stages, rejoins and degraded spans of one policy."""
    want = None if policy is None else Policy(policy).value
    out = []
    for e in events:
        d = e.to_dict() if hasattr(e, "to_dict") else dict(e)
        if d.get("kind") not in _KEEP_SIMULATED or (want and d.get("policy") != want):
            continue
        data = dict(d.get("data") or {})
        out.append(
            ReplayEvent(
                t=float(d["t"]),
                kind=str(d["kind"]),
                duration_s=float(d.get("duration_s") or 0.0),
                stage=Stage(d["stage"]) if d.get("stage") else None,
                rank=_rank(data.get("rank")),
                data=data,
            )
        )
    return sorted(out, key=lambda e: e.t)


def from_recording(events: Sequence[Event]) -> list[ReplayEvent]:
    """Replay events from a recording: a stage's duration is its ``data.seconds`` (live
    mode's measurement) or ``data.duration_s``; an event naming a fault (``fault``,
    ``fault_injected``...) marks its rank failed."""
    out = []
    for e in events:
        if e.event == EventKind.RECORDING_START:
            continue
        data = dict(e.data)
        kind = "fault" if "fault" in e.event and e.rank is not None else ("stage" if e.stage else e.event)
        out.append(
            ReplayEvent(
                t=e.t,
                kind=kind,
                duration_s=float(data.get("seconds", data.get("duration_s")) or 0.0),
                stage=e.stage,
                rank=e.rank if e.rank is not None else _rank(data.get("rank")),
                data={"event": e.event, **data},
            )
        )
    return sorted(out, key=lambda e: e.t)


def from_breakdown(failed: Iterable[int], breakdown: RecoveryBreakdown) -> list[ReplayEvent]:
    """Replay events of one modelled recovery: every failed rank faults at time 0, then the
    breakdown's stages run one after another (each event at its stage's end), then the
    job resumes."""
    policy = breakdown.policy.value
    out = [ReplayEvent(t=0.0, kind="fault", rank=int(r), data={"fault": "picked on Mesh"}) for r in sorted(set(failed))]
    t = 0.0
    for stage in Stage.ordered():
        secs = breakdown.durations_s.get(stage)
        if secs is None:
            continue
        t += float(secs)
        out.append(ReplayEvent(t=t, kind="stage", duration_s=float(secs), stage=stage, data={"policy": policy}))
    out.append(ReplayEvent(t=t, kind="resumed", data={"policy": policy}))
    return out


def replay_frame(events: Sequence[ReplayEvent], index: int) -> ReplayFrame:
    """The mesh at ``events[index]``: failed ranks, running stage, stage durations so far.

    A recovery opens with a fault (or with a stage when a recording has no fault event).
    It closes when a rank that ran its stages, or the job as a whole, records anything
    else (a checkpoint, a step, resumed), when a fault arrives after its last stage has
    ended, or when a rank detects a second time. A fault while stages still run joins
    that recovery. Ranks run stages side by side: a stage's duration is the longest any
    rank spent in it.
    """
    if not events:
        raise ValueError("nothing to replay: the timeline has no faults or recovery stages")
    index = max(0, min(int(index), len(events) - 1))
    for frame in replay_frames(events):
        if frame.index == index:
            return frame
    raise AssertionError("unreachable: every index has a frame")


def replay_frames(events: Sequence[ReplayEvent]) -> Iterator[ReplayFrame]:
    """:func:`replay_frame` at every index in turn, in one pass over the events."""
    failed: set[int] = set()
    spent: dict[tuple[Stage, int | None], float] = {}  # per stage and rank: ranks run stages side by side
    recoveries, open_, stage, ends_at = 0, False, None, float("-inf")
    policy: Policy | None = None

    def close() -> None:
        nonlocal recoveries, open_, stage, failed
        if open_:
            recoveries += 1
        open_, stage, failed = False, None, set()

    def begin(t: float) -> None:
        nonlocal open_, spent, ends_at, policy, failed
        open_, spent, ends_at, policy, failed = True, {}, t, None, set()

    for i, e in enumerate(events):
        ranks_in = {r for _, r in spent}
        if e.kind == "fault":
            if open_ and spent and e.t >= ends_at:
                close()
            if not open_:
                begin(e.t)
            if e.rank is not None:
                failed.add(e.rank)
        elif e.kind in _NEUTRAL:
            pass
        elif e.stage is not None:
            if open_ and e.stage is Stage.DETECTION and (Stage.DETECTION, e.rank) in spent:
                close()  # this rank detects again: a new recovery
            if not open_:
                begin(e.t)
            stage = e.stage
            spent[(e.stage, e.rank)] = spent.get((e.stage, e.rank), 0.0) + e.duration_s
            ends_at = max(ends_at, e.t + e.duration_s)
            if e.data.get("policy") in _POLICIES:
                policy = Policy(e.data["policy"])
        elif e.rank is None or e.rank in ranks_in:
            close()  # a rank that took part went on (or the whole job did)
        stages: dict[Stage, float] = {}
        for (st, _), secs in spent.items():
            stages[st] = max(stages.get(st, 0.0), secs)
        ordered = {s: stages[s] for s in Stage.ordered() if s in stages}
        yield ReplayFrame(
            index=i,
            event=e,
            failed=frozenset(failed),
            stage=stage,
            stages_so_far=ordered,
            recoveries_before=recoveries,
            policy=policy,
        )


def frame_breakdown(frame: ReplayFrame, policy: Policy | str) -> RecoveryBreakdown:
    """The frame's stage durations as a breakdown, for the stage bar chart."""
    return RecoveryBreakdown(Policy(policy), frame.stages_so_far)


def find_recordings(roots: Iterable[str | Path]) -> list[Path]:
    """Finished recordings (``*.jsonl``) under ``roots``, newest first; in-progress
    ``.partial`` files are left out."""
    found: list[Path] = []
    for root in roots:
        r = Path(root)
        if r.is_dir():
            found.extend(p for p in r.glob("*.jsonl") if p.is_file())
    return sorted(set(found), key=lambda p: (-p.stat().st_mtime, str(p)))


def local_mesh(world_size: int) -> Mesh:
    """The mesh of a live run on this machine: one gloo domain of ``world_size`` ranks."""
    return Mesh(domains=(Domain("cpu@127.0.0.1", Vendor.CPU, "this machine", tuple(range(max(int(world_size), 1)))),))


def recording_mesh(meta: Mapping[str, Any], fallback: Mesh) -> Mesh:
    """The mesh a recording ran on: a live run's local ranks (``ranks`` in its first
    event), else ``fallback`` (the scenario's mesh)."""
    ranks = meta.get("ranks")
    if meta.get("source") == "live" and isinstance(ranks, int) and ranks > 0:
        return local_mesh(ranks)
    return fallback


def first_recovery_index(events: Sequence[ReplayEvent]) -> int:
    """The last event of the first recovery (where its whole stage breakdown shows), or 0:
    one pass, however far into the run the first recovery is."""
    best = 0
    for frame in replay_frames(events):
        if frame.recoveries_before > 0:
            break
        if frame.stage is not None:
            best = frame.index
    return best


MAX_RECORDING_BYTES = 256 << 20  # a larger file is refused unread (a line-less binary would be read whole)
_EXPECTED = (
    "expected a .jsonl file written by a live or simulated run (one JSON event per line, the first 'recording_start')"
)


def recording_problem(path: Path) -> str | None:
    """Why ``path`` cannot be replayed, in one line that names it and what was expected, before it is
    parsed (None: it looks like a recording; reading it may still find a bad line further on). Reads
    at most its first line."""
    import json

    if path.is_dir():
        return f"{path}: is a folder, not a recording; {_EXPECTED}"
    if not path.is_file():
        return f"{path}: no such file; {_EXPECTED}"
    size = path.stat().st_size
    if size == 0:
        return f"{path}: the file is empty; {_EXPECTED}"
    if size > MAX_RECORDING_BYTES:
        return (
            f"{path}: {size:,} bytes is more than a recording this page replays (at most {MAX_RECORDING_BYTES:,}); "
            f"{_EXPECTED}"
        )
    try:
        with open(path, "rb") as fh:
            first = fh.readline(1 << 20).decode("utf-8", errors="replace").strip()
    except OSError as exc:
        return f"{path}: cannot read it ({exc.strerror or exc}); {_EXPECTED}"
    try:
        obj = json.loads(first)
    except ValueError:
        return None if not first else f"{path}: line 1 is not one JSON event; {_EXPECTED}"
    if not isinstance(obj, dict) or not {"t", "event"} <= set(obj):
        return f"{path}: line 1 is not an event (a JSON object with t, event, rank, stage and data); {_EXPECTED}"
    if obj["event"] != EventKind.RECORDING_START.value:
        return f"{path}: line 1 is a {obj['event']!r} event, not 'recording_start'; {_EXPECTED}"
    return None
