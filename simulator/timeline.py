"""Timelines in the Chrome trace event format, which Perfetto and chrome://tracing open.

Each policy becomes a process (``pid``) with one track (``tid``) per kind of event:
recovery stages, checkpoints, checkpoint writes, degraded running, and faults as
instants. Times are microseconds, as the format requires.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from meshpact.core.errors import MeshpactError
from meshpact.core.recovery import Policy

from .training import TimelineEvent, TrainingResult

__all__ = ["chrome_trace", "check_trace_path", "write_chrome_trace", "TRACKS"]

TRACKS = {"stage": 1, "checkpoint": 2, "checkpoint_write": 3, "degraded": 4, "rejoin": 1, "fault": 5}
_TRACK_NAMES = {1: "recovery", 2: "checkpoint (blocking)", 3: "checkpoint write", 4: "degraded (excised)", 5: "faults"}


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def chrome_trace(
    events: Iterable[TimelineEvent] | TrainingResult, title: str = "meshpact simulate training"
) -> dict[str, Any]:
    """The trace document for ``events`` (or every policy of a training result)."""
    if isinstance(events, TrainingResult):
        title = f"{title}: {events.scenario}, {events.workload.ranks} ranks"
        events = [e for r in events.policies.values() for e in r.timeline]
    pids = {p: i + 1 for i, p in enumerate(Policy)}
    out: list[dict[str, Any]] = []
    for p, pid in pids.items():
        out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": p.value}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        for tid, name in _TRACK_NAMES.items():
            out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
    for e in events:
        pid, tid = pids[e.policy], TRACKS.get(e.kind, 6)
        name = e.stage.value if e.kind == "stage" and e.stage else e.kind
        args = {k: v for k, v in e.data.items()}
        if e.duration_s > 0:
            out.append(
                {
                    "ph": "X",
                    "name": name,
                    "cat": e.kind,
                    "pid": pid,
                    "tid": tid,
                    "ts": _us(e.t),
                    "dur": _us(e.duration_s),
                    "args": args,
                }
            )
        else:
            out.append(
                {"ph": "i", "s": "t", "name": name, "cat": e.kind, "pid": pid, "tid": tid, "ts": _us(e.t), "args": args}
            )
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"title": title}}


def check_trace_path(path: str | os.PathLike[str]) -> Path:
    """Refuse a trace path that cannot be written, before the simulation runs (no folder is created)."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise MeshpactError(f"--trace {p}: folder {parent} does not exist; create it first or choose another path")
    if p.is_dir():
        raise MeshpactError(f"--trace {p}: is a folder; expected a file name such as run.json")
    if not os.access(parent, os.W_OK):
        raise MeshpactError(f"--trace {p}: folder {parent} is not writable")
    return p


def write_chrome_trace(result: TrainingResult, path: str | os.PathLike[str]) -> Path:
    """Write the trace of ``result`` to ``path`` (JSON), atomically."""
    p = check_trace_path(path)
    try:
        tmp = p.with_name(p.name + ".partial")
        tmp.write_text(json.dumps(chrome_trace(result)), encoding="utf-8")
        os.replace(tmp, p)
    except OSError as exc:
        raise MeshpactError(f"--trace {p}: cannot write the trace ({exc.strerror}); choose a writable path") from None
    return p
