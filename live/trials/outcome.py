"""What one rank process of a trial reports back: typed, frozen, and JSON on the way.

A rank worker returns :meth:`RankOutcome.to_dict` (the launcher carries JSON); the parent
reads it back with :meth:`RankOutcome.from_dict`, and the analysis reads fields, never keys.
Torch-free.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

from meshpact.core.jsonform import JsonObject

if TYPE_CHECKING:  # read back only where a rank excised (reshard imports torch)
    from ..recovery.reshard import ExcisionRecord

__all__ = ["RetiredSummary", "Drill", "FaultRecord", "PeerCopyReport", "RankOutcome"]


@dataclass(frozen=True)
class RetiredSummary:
    """A group retired in a recovery: operations it received after (backend sequence numbers,
    and the dispatch-mode count when that counter was on) and whether it is still referenced."""

    group: str
    seq_ops_after: int | None
    dispatch_ops_after: int | None
    alive: bool


@dataclass(frozen=True)
class Drill:
    """The checkpoint restore run in the job at the end of a faulted run."""

    t_start_wall: float
    t_end_wall: float
    checkpoint_step: int
    lost_steps: int


@dataclass(frozen=True)
class FaultRecord:
    """When and where a fault fired, as claimed on the control channel."""

    rank: int
    step: int
    kind: str
    t_wall: float
    nonce: str = ""


@dataclass(frozen=True)
class PeerCopyReport:
    """What keeping peer copies cost one rank over its run (see ``peers.PeerCopyCounters``)."""

    commits: int = 0
    snapshot_s: float = 0.0  # on the training thread
    ship_s: float = 0.0  # on the background thread
    bytes_sent: int = 0
    failed: int = 0  # copies that did not reach a holder (a holder gone)
    host_bytes_peak: int = 0  # own snapshots plus the copies held for others
    host_copy_s: float = 0.0  # the rest: what the simulator's peer-copy model is calibrated from
    wait_s: float = 0.0
    ship_cpu_s: float = 0.0
    recv_cpu_s: float = 0.0
    cycles: int = 0
    cycle_cpu_s: float = 0.0
    cycle_s: float = 0.0
    host_busy_s: float = 0.0
    cores: int = 0
    cores_per_rank: float = 0.0


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    incarnation: int = 0
    digest: str = ""
    recoveries: tuple[Mapping[str, Any], ...] = ()  # RecoveryRecord.to_dict() of each recovery
    op_counts: Mapping[str, int] = field(default_factory=dict)
    retired: tuple[RetiredSummary, ...] = ()
    current_groups: tuple[str, ...] = ()
    step_s: tuple[float, ...] = ()
    generation: int = 0
    drill: Drill | None = None
    t_start_wall: float = 0.0
    t_caught_up_wall: float = 0.0
    t_loaded_wall: float | None = None
    compiled_regions: Mapping[str, int] = field(default_factory=dict)  # before_first_fault / after_last_recovery
    compiled_graphs: int | None = None
    fault_records: Mapping[int, FaultRecord] = field(default_factory=dict)  # every rank that finished reports them
    workload_error: str | None = None
    storage_bytes_read: int = 0  # checkpoint bytes read by this process's recoveries
    peer: PeerCopyReport | None = None
    alive: tuple[int, ...] = ()  # the original ranks in the job when this rank finished (empty: all)
    excisions: tuple[ExcisionRecord, ...] = ()  # every excision this rank took part in
    excision_refused: str | None = None  # the one-line stop below --min-ranks
    flushed_checkpoint: str | None = None  # ... and where the state went
    left_with_replica: str | None = None  # the one line of a rank that left with its HSDP replica (not a survivor)

    def to_dict(self) -> JsonObject:
        out = asdict(self)
        out["fault_records"] = {str(k): asdict(v) for k, v in self.fault_records.items()}
        out["excisions"] = [e.to_dict() for e in self.excisions]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RankOutcome":
        if d.get("excisions"):
            from ..recovery.reshard import ExcisionRecord
        return cls(
            rank=int(d["rank"]),
            incarnation=int(d.get("incarnation", 0)),
            digest=str(d.get("digest", "")),
            recoveries=tuple(d.get("recoveries", ())),
            op_counts=dict(d.get("op_counts", {})),
            retired=tuple(RetiredSummary(**r) for r in d.get("retired", ())),
            current_groups=tuple(d.get("current_groups", ())),
            step_s=tuple(d.get("step_s", ())),
            generation=int(d.get("generation", 0)),
            drill=Drill(**d["drill"]) if d.get("drill") else None,
            t_start_wall=float(d.get("t_start_wall", 0.0)),
            t_caught_up_wall=float(d.get("t_caught_up_wall", 0.0)),
            t_loaded_wall=d.get("t_loaded_wall"),
            compiled_regions=dict(d.get("compiled_regions", {})),
            compiled_graphs=d.get("compiled_graphs"),
            fault_records={int(k): FaultRecord(**v) for k, v in (d.get("fault_records") or {}).items()},
            workload_error=d.get("workload_error"),
            storage_bytes_read=int(d.get("storage_bytes_read", 0)),
            peer=PeerCopyReport(**d["peer"]) if d.get("peer") else None,
            alive=tuple(int(r) for r in d.get("alive", ())),
            excisions=tuple(ExcisionRecord.from_dict(e) for e in d.get("excisions", ())),
            excision_refused=d.get("excision_refused"),
            flushed_checkpoint=d.get("flushed_checkpoint"),
            left_with_replica=d.get("left_with_replica"),
        )
