"""Exports people plug into: a recording as a Perfetto trace.

:func:`perfetto_trace` turns the events of a recording (a live run's or a simulated one's)
into the Chrome trace-event JSON that https://ui.perfetto.dev and ``chrome://tracing``
open: one track (thread) per rank plus a ``job`` track for events of no rank; a recovery
stage is a slice that ends at its event's time and lasts its measured ``seconds``, and so
is a training step of a paced run (``step`` events, named ``step N`` for the step it ran);
every other event (a fault, a checkpoint, a decision) is an instant on its rank's track.
Times are microseconds from the recording's start.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

from meshpact.core.recording import Event, EventKind

__all__ = ["perfetto_trace", "perfetto_json", "JOB_TRACK"]

JOB_TRACK = "job"
_PID = 1


def _seconds(e: Event) -> float:
    for key in ("seconds", "duration_s"):
        value = e.data.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            return float(value)
    return 0.0


def _args(data: Any) -> dict[str, Any]:
    return json.loads(json.dumps(dict(data), default=str))  # plain JSON values only


def perfetto_trace(events: Sequence[Event], name: str = "meshpact recording") -> dict[str, Any]:
    """The trace-event document of ``events`` (see the module docstring)."""
    ranks = sorted({e.rank for e in events if e.rank is not None})
    tid = {r: r + 1 for r in ranks}  # tid 0 is the job track
    out: list[dict[str, Any]] = [
        {"ph": "M", "pid": _PID, "tid": 0, "name": "process_name", "args": {"name": name}},
        {"ph": "M", "pid": _PID, "tid": 0, "name": "thread_name", "args": {"name": JOB_TRACK}},
        {"ph": "M", "pid": _PID, "tid": 0, "name": "thread_sort_index", "args": {"sort_index": -1}},
    ]
    for r in ranks:
        out.append({"ph": "M", "pid": _PID, "tid": tid[r], "name": "thread_name", "args": {"name": f"rank {r}"}})
        out.append({"ph": "M", "pid": _PID, "tid": tid[r], "name": "thread_sort_index", "args": {"sort_index": r}})
    for e in events:
        track = tid.get(e.rank, 0) if e.rank is not None else 0
        end_us = e.t * 1e6
        args = _args(e.data)
        args["event"] = e.event
        if e.stage is not None or e.event == EventKind.STEP:
            dur = _seconds(e) * 1e6
            ran = e.data.get("step")  # the committed step after it: it ran step - 1
            name, cat = (
                (e.stage.value, "recovery")
                if e.stage is not None
                else (f"step {int(ran) - 1}" if isinstance(ran, int) else "step", "training")
            )
            out.append(
                {
                    "ph": "X",
                    "pid": _PID,
                    "tid": track,
                    "name": name,
                    "cat": cat,
                    "ts": round(max(end_us - dur, 0.0), 3),
                    "dur": round(min(dur, end_us), 3),
                    "args": args,
                }
            )
        else:
            out.append(
                {
                    "ph": "i",
                    "s": "t",
                    "pid": _PID,
                    "tid": track,
                    "name": e.event,
                    "cat": "event",
                    "ts": round(end_us, 3),
                    "args": args,
                }
            )
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def perfetto_json(events: Sequence[Event], name: str = "meshpact recording") -> str:
    return json.dumps(perfetto_trace(events, name))
