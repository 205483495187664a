"""Recordings: JSONL event streams that the app and the CLI replay.

One event per line: ``{"t": seconds since the start, "rank": int | null, "stage": stage
name | null, "event": kind, "data": {...}}``. The first line is a ``recording_start``
event whose data says where the recording came from (``live``, ``simulated``...).

A :class:`RecordingWriter` appends to ``<path>.partial`` (flushed per event, so a live
panel can follow it) and on close renames it to ``<path>`` in one atomic step: a reader
never sees a half-written final recording.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, Mapping

from .errors import RecordingError
from .recovery import Stage

__all__ = ["EventKind", "Event", "RecordingWriter", "read_recording", "iter_events", "partial_path"]


class EventKind(str, Enum):
    """What an event records. The values are the names written in recordings (a ``str`` enum,
    so ``EventKind.DECIDED == "decided"``); recordings from other sources may carry names of
    their own, which :class:`Event` keeps as plain strings."""

    RECORDING_START = "recording_start"
    # a rank of a recovery trial
    SESSION_START = "session_start"
    DETECTED = "detected"
    DECIDED = "decided"
    REBUILT = "rebuilt"
    REBOUND = "rebound"
    RETAINED = "retained"
    RELOADED = "reloaded"
    READY = "ready"
    REPLAYED = "replayed"
    FIRST_COLLECTIVE = "first_collective"  # a rank completed the first collective on a new generation's group
    RECOVERY_DONE = "recovery_done"
    CHECKPOINT = "checkpoint"
    STEP = "step"  # a rank committed a step (paced runs: generation, world group and its sequence number)
    HELD = "held"  # a rank waits before its next step because its run is held (paced runs)
    TIMEOUT_FITTED = "timeout_fitted"  # a rank set its data-path timeout from its measured steps
    # the trial's parent
    REPLACEMENT_STARTED = "replacement_started"
    FAULT_INJECTED = "fault_injected"
    RECOVERED = "recovered"
    TRAINED = "trained"  # a rank's training loop ended: its steps and each step's seconds
    SUMMARY = "summary"

    def __str__(self) -> str:
        return self.value


def event_kind(name: str) -> EventKind | str:
    """``name`` as an :class:`EventKind` where it is one, else the name itself."""
    try:
        return EventKind(name)
    except ValueError:
        return name


@dataclass(frozen=True)
class Event:
    """One event: ``t`` is seconds since the recording started (in a rank's own log, wall
    time: the trial rebases it when it writes the recording)."""

    t: float
    event: EventKind | str
    rank: int | None = None
    stage: Stage | None = None
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "t": round(self.t, 9),
            "rank": self.rank,
            "stage": self.stage.value if self.stage else None,
            "event": str(self.event),
            "data": dict(self.data),
        }

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any], where: str = "") -> "Event":
        try:
            stage = obj.get("stage")
            return cls(
                t=float(obj["t"]),
                event=event_kind(str(obj["event"])),
                rank=None if obj.get("rank") is None else int(obj["rank"]),
                stage=Stage(stage) if stage else None,
                data=dict(obj.get("data") or {}),
            )
        except KeyError as exc:
            raise RecordingError(f"{where}: event is missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise RecordingError(f"{where}: malformed event ({exc}); expected t, event, rank, stage, data") from None


def partial_path(path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    return p.with_name(p.name + ".partial")


class RecordingWriter:
    """Write events to ``path`` atomically; usable as a context manager."""

    def __init__(self, path: str | os.PathLike[str], source: str, **meta: Any) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._partial = partial_path(self.path)
        self._fh = open(self._partial, "w", encoding="utf-8")
        self._t0 = time.monotonic()
        self.count = 0
        self.emit(EventKind.RECORDING_START, data={"source": source, "wall_time": time.time(), **meta})

    def now(self) -> float:
        return time.monotonic() - self._t0

    def emit(
        self,
        event: EventKind | str,
        *,
        rank: int | None = None,
        stage: Stage | str | None = None,
        data: Mapping[str, Any] | None = None,
        t: float | None = None,
    ) -> Event:
        ev = Event(
            t=self.now() if t is None else t,
            event=event,
            rank=rank,
            stage=Stage(stage) if stage else None,
            data=dict(data or {}),
        )
        self.write(ev)
        return ev

    def write(self, ev: Event) -> None:
        if self._fh.closed:
            raise RecordingError(f"recording {self.path} is already closed")
        self._fh.write(json.dumps(ev.to_dict(), sort_keys=True) + "\n")
        self._fh.flush()
        self.count += 1

    def close(self) -> Path:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            os.replace(self._partial, self.path)
        return self.path

    def __enter__(self) -> "RecordingWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_events(path: str | os.PathLike[str]) -> Iterator[Event]:
    """Yield events from a recording (or its ``.partial`` while it is being written)."""
    p = Path(path)
    if not p.exists() and partial_path(p).exists():
        p = partial_path(p)
    if not p.exists():
        raise RecordingError(f"recording {path} does not exist")
    with open(p, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise RecordingError(
                    f"{p}:{lineno}: not UTF-8 text; expected a .jsonl recording, one JSON event per line"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                if not line.endswith("\n"):
                    return  # a line still being written
                raise RecordingError(f"{p}:{lineno}: not a JSON object; each line is one event") from None
            yield Event.from_dict(obj, where=f"{p}:{lineno}")


def read_recording(path: str | os.PathLike[str]) -> list[Event]:
    events = list(iter_events(path))
    if not events or events[0].event != EventKind.RECORDING_START:
        raise RecordingError(f"{path}: the first event must be 'recording_start'")
    return events
