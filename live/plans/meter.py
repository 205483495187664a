"""Meter: every collective call and bridge message a live run makes, counted at the call.

Each rank records one :class:`CallRecord` per communication call it takes part in: the
group, the call's sequence number on that group, the op, the link class and the bytes this
rank contributed (the plan's cost convention: for a collective, each participant's
contribution, only the root's for ``broadcast``/``scatter``; for a bridge message, the bytes
sent, counted at the sender). :func:`measure` merges all ranks' records: one startup per
distinct ``(group, seq)`` call, payload bytes summed, and it refuses records that do not
agree (members of one call naming different ops, a message sent but never received).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from meshpact.core.errors import MeshpactError
from meshpact.core.jsonform import JsonObject

__all__ = ["CallRecord", "Meter", "Measured", "measure"]


@dataclass(frozen=True)
class CallRecord:
    rank: int
    group: str  # "domain:<name>[:r0,r1..]" or "bridge:<a>-<b>"
    seq: int  # this call's index among the calls on ``group``
    op: str  # collective name, or "send"/"recv" on a bridge
    link: str  # LinkClass value
    contributed: int  # payload bytes this rank contributed to the call
    t: float = 0.0  # when the call started, seconds since the meter's start
    seconds: float = 0.0  # how long this rank spent in the call

    def to_dict(self) -> JsonObject:
        return {
            "rank": self.rank,
            "group": self.group,
            "seq": self.seq,
            "op": self.op,
            "link": self.link,
            "contributed": self.contributed,
            "t": round(self.t, 9),
            "seconds": round(self.seconds, 9),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CallRecord":
        return cls(
            int(d["rank"]),
            str(d["group"]),
            int(d["seq"]),
            str(d["op"]),
            str(d["link"]),
            int(d["contributed"]),
            float(d.get("t", 0.0)),
            float(d.get("seconds", 0.0)),
        )


@dataclass
class Meter:
    """One rank's record of its calls, in order."""

    rank: int
    records: list[CallRecord] = field(default_factory=list)
    t0: float = field(default_factory=time.monotonic)
    _seq: dict[str, int] = field(default_factory=dict)

    def record(self, group: str, op: str, link: str, contributed: int, started: float | None = None) -> CallRecord:
        """Record one call; ``started`` is its ``time.monotonic()`` at entry (default: now)."""
        now = time.monotonic()
        started = now if started is None else started
        seq = self._seq.get(group, 0)
        self._seq[group] = seq + 1
        rec = CallRecord(self.rank, group, seq, op, link, int(contributed), started - self.t0, now - started)
        self.records.append(rec)
        return rec

    def mark(self) -> int:
        """A position to measure from (records after it belong to the next plan)."""
        return len(self.records)


@dataclass(frozen=True)
class Measured:
    startups: int
    payload_bytes: int
    bytes_by_link: Mapping[str, int]
    startups_by_link: Mapping[str, int]

    def to_dict(self) -> JsonObject:
        return {
            "startups": self.startups,
            "payload_bytes": self.payload_bytes,
            "bytes_by_link": dict(self.bytes_by_link),
            "startups_by_link": dict(self.startups_by_link),
        }


def measure(records: Iterable[CallRecord]) -> Measured:
    """Startups and payload bytes of the calls in ``records`` (all ranks' records together)."""
    calls: dict[tuple[str, int], list[CallRecord]] = {}
    for r in records:
        calls.setdefault((r.group, r.seq), []).append(r)
    by_link: dict[str, int] = {}
    starts: dict[str, int] = {}
    for (group, seq), recs in sorted(calls.items()):
        ops = sorted({r.op for r in recs})
        if group.startswith("bridge:"):
            if ops != ["recv", "send"] or len(recs) != 2:
                raise MeshpactError(
                    f"bridge message {group}#{seq} was not one send and one recv: {[(r.rank, r.op) for r in recs]}"
                )
        elif len(ops) != 1:
            raise MeshpactError(f"collective call {group}#{seq}: members disagree on the op {ops}")
        link = recs[0].link
        by_link[link] = by_link.get(link, 0) + sum(r.contributed for r in recs)
        starts[link] = starts.get(link, 0) + 1
    return Measured(
        startups=sum(starts.values()),
        payload_bytes=sum(by_link.values()),
        bytes_by_link=dict(sorted(by_link.items())),
        startups_by_link=dict(sorted(starts.items())),
    )
