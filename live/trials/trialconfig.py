"""A recovery trial's settings: ranks, steps, faults, timeouts and the workload to train.

Torch-free, so the CLI and the dashboard can check a user's settings (one clear line each)
before anything starts. :class:`Pace` is the one control a person has over a run while it
goes: a small JSON file (:data:`PACE_FILE`) in the trial's work directory, written by the
dashboard and read by every rank before each step, that slows the ranks to a number of
steps per second or holds them before their next step (for instance before the faulted
run's first step, so a fault can be injected by hand). Without the file the ranks train at
full speed, as they always did.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from meshpact.core.errors import MeshpactError

from ..recovery.config import RecoveryConfig
from ..recovery.faults import FaultKind
from ..recovery.workload import DEFAULT_WORKLOAD

__all__ = [
    "TrialConfig",
    "Pace",
    "PACE_FILE",
    "PROCESSES_FILE",
    "HEARTBEATS_FILE",
    "PHASES",
    "ON_RANK_LOSS",
    "OnRankLoss",
]

PACE_FILE = "pace.json"  # in the trial's work directory
PROCESSES_FILE = (
    "processes.jsonl"  # in the trial's work directory: every rank process started (launcher.LaunchedProcess)
)
HEARTBEATS_FILE = "heartbeats.json"  # in a run's folder: each rank's heartbeat age as the trial parent saw it
PHASES = ("reference", "faulted", "cold")  # a trial's runs, in order (each rank's MESHPACT_RUN_ID)


class OnRankLoss(str, Enum):
    """What a killed rank leads to."""

    REPLACE = "replace"  # a new process or a warm spare takes its state from a peer
    EXCISE = "excise"  # the survivors re-shard its state from the peer copy and go on


ON_RANK_LOSS = tuple(p.value for p in OnRankLoss)


@dataclass(frozen=True)
class TrialConfig:
    """One trial's settings, checked on construction (a bad value is one clear line)."""

    ranks: int = 4
    steps: int = 40
    faults: int = 10
    fault_kind: FaultKind = FaultKind.COLLECTIVE
    checkpoint_every: int = 10
    data_timeout_s: float | None = None  # None: follow the job's measured steps (RecoveryConfig)
    process_start_s: float = 30.0  # a replacement process starting under load (sets the consensus round)
    group_create_s: float = 20.0
    stall_s: float = 1.5  # a stalled rank sleeps this long (past the data-path timeout)
    down_s: float = 2.0  # a partitioned data link stays down this long
    baselines: bool = True  # also measure a checkpoint restore (on the same lost processes) and a cold restart
    timeout_s: float | None = None  # the launcher deadline; None: derived (RecoveryConfig.launcher_deadline_s)
    workload: str = DEFAULT_WORKLOAD  # a shipped workload's name or a path to a workload file
    count_dispatch: bool = False  # also count ops with a dispatch mode (turns torch.compile off)
    restore_rng: bool = True  # off only to show that a re-run step needs its generators back
    heartbeat: bool = True  # find a stalled rank by heartbeat too, not only by the data-path timeout
    nth_op: int | None = None  # collective faults: the c10d operation of the step that raises
    peer_copies: int = 1  # K: ranks holding each rank's committed state in host memory (0: none)
    peer_copy_depth: int = 2  # committed steps kept of each copy and own snapshot (1: half the memory, no rollback)
    max_rounds: int = 4  # incomplete consensus rounds before a silent rank is declared lost
    kill_holders: bool = False  # a kill also kills the lost rank's K holders (its state is lost with them)
    two_hosts: bool = False  # ranks in two network namespaces (the lower half and the stores in the first)
    spare_ranks: int = 0  # warm spare processes waiting to be promoted to a lost rank (faulted run)
    die_after_proposing: bool = False  # the rank after each fault's dies once that recovery's round is decided
    on_rank_loss: str = "replace"  # a killed rank: "replace" (a new process or a spare) or "excise" (go on without it)
    min_ranks: int = 1  # excising: stop (state flushed to a checkpoint) rather than go below this many ranks
    # the unmeasured runs' first rank processes forked from a server that imported torch once (a forked
    # process shows the server's environment in /proc: PROCESSES_FILE says which rank it is)
    warm_starts: bool = True
    # the job key (signed control values, authenticated peer-copy connections); off only to measure what they
    # cost (the ranks run with MESHPACT_UNAUTHENTICATED=1); copies keep their digests either way
    authenticated: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "fault_kind", FaultKind(self.fault_kind))
        recovery = self.recovery()  # refuses an ordering of timeouts that cannot work
        if self.timeout_s is not None:
            recovery.check_deadline(self.timeout_s)
        if self.ranks < 2:
            raise MeshpactError(f"--ranks must be at least 2 (a fault needs peers), got {self.ranks}")
        if not 0 <= self.peer_copies < self.ranks:
            raise MeshpactError(
                f"--peer-copies must be between 0 and --ranks - 1 ({self.ranks - 1}), got {self.peer_copies}"
            )
        if self.kill_holders and (self.fault_kind is not FaultKind.KILL or self.peer_copies < 1):
            raise MeshpactError("killing a rank with its holders needs --fault-kind kill and --peer-copies >= 1")
        if self.spare_ranks < 0 or (self.spare_ranks and (self.two_hosts or self.fault_kind is FaultKind.PARTITION)):
            raise MeshpactError(
                f"--spare-ranks must be 0 or more, and spares run on one host (not with two hosts "
                f"or partition faults), got {self.spare_ranks}"
            )
        if self.on_rank_loss not in ON_RANK_LOSS:
            raise MeshpactError(f"--on-rank-loss must be replace or excise, got {self.on_rank_loss!r}")
        if not 1 <= self.min_ranks <= self.ranks:
            raise MeshpactError(f"--min-ranks must be between 1 and --ranks ({self.ranks}), got {self.min_ranks}")
        if self.excising:
            clash = [
                name
                for name, on in (
                    ("--fault-kind other than kill", self.fault_kind is not FaultKind.KILL),
                    ("--peer-copies 0", self.peer_copies < 1),
                    ("--spare-ranks", self.spare_ranks > 0),
                    ("--kill-holders", self.kill_holders),
                    ("two hosts", self.two_hosts),
                )
                if on
            ]
            if clash:
                raise MeshpactError(
                    f"--on-rank-loss excise needs --fault-kind kill and --peer-copies >= 1 and takes no "
                    f"spares, holder kills or two hosts; got {', '.join(clash)}"
                )
            if self.faults > self.ranks - 1:
                raise MeshpactError(
                    f"--on-rank-loss excise kills a different rank per fault: at most --ranks - 1 "
                    f"({self.ranks - 1}) faults, got {self.faults}"
                )
        if self.steps < 2:
            raise MeshpactError(f"--steps must be at least 2, got {self.steps}")
        if self.checkpoint_every < 1 or self.checkpoint_every > self.steps:
            raise MeshpactError(
                f"--checkpoint-every must be between 1 and --steps ({self.steps}), got {self.checkpoint_every}"
            )
        if (
            not self.heartbeat
            and self.data_timeout_s is None
            and self.fault_kind in (FaultKind.STALL, FaultKind.PARTITION)
        ):
            raise MeshpactError(
                f"without the heartbeat a {self.fault_kind.value} is found by the data-path timeout "
                "alone: set --data-timeout (shorter than the stall or the partition)"
            )
        if self.fault_kind is FaultKind.STALL and self.stall_s <= recovery.detection_bound_s:
            raise MeshpactError(
                f"a stall ({self.stall_s} s) must outlast the data-path timeout ({self.data_timeout_s} s)"
                if not self.heartbeat
                else f"a stall ({self.stall_s} s) must outlast the heartbeat detection bound "
                f"({recovery.detection_bound_s:g} s)"
            )
        if self.fault_kind is FaultKind.PARTITION and self.down_s <= recovery.detection_bound_s:
            by = "the heartbeat" if self.heartbeat else "the data-path timeout"
            raise MeshpactError(
                f"a partition ({self.down_s} s down) must outlast the hang detection bound "
                f"({recovery.detection_bound_s:g} s: {by}), or the collective simply resumes"
            )

    @property
    def excising(self) -> bool:
        return self.on_rank_loss == "excise"

    @property
    def loses_process(self) -> bool:
        """Whether each fault costs a rank its process (killed, or declared lost and then killed)."""
        return self.fault_kind in (FaultKind.KILL, FaultKind.SILENT)

    def recovery(self, checkpoint_dir: str | None = None) -> RecoveryConfig:
        """The ranks' recovery settings (every timeout derived from these inputs)."""
        return RecoveryConfig(
            data_timeout_s=self.data_timeout_s,
            process_start_s=self.process_start_s,
            peer_copy_depth=self.peer_copy_depth,
            group_create_s=self.group_create_s,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=self.checkpoint_every,
            count_dispatch=self.count_dispatch,
            restore_rng=self.restore_rng,
            heartbeat=self.heartbeat,
            peer_copies=self.peer_copies,
            max_rounds=self.max_rounds,
        )

    @property
    def deadline_s(self) -> float:
        """The launcher deadline of one run: given, or derived from the recovery settings, the
        steps and the faults (each lasting its stall or its partition)."""
        if self.timeout_s is not None:
            return self.timeout_s
        recovery = self.recovery()
        per_fault = {
            FaultKind.STALL: self.stall_s,
            FaultKind.PARTITION: self.down_s,
            FaultKind.SILENT: recovery.replacement_bound_s,
        }.get(self.fault_kind, 0.0)
        return recovery.launcher_deadline_s(self.steps, self.faults, per_fault)


@dataclass(frozen=True)
class Pace:
    """How fast the ranks of a trial may go: at most ``steps_per_s`` steps a second (None: as
    fast as they can), and the runs (:data:`PHASES`) whose ranks wait before their next step."""

    steps_per_s: float | None = None
    hold: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        object.__setattr__(self, "hold", frozenset(self.hold))
        unknown = sorted(self.hold - set(PHASES))
        if unknown:
            raise MeshpactError(f"pace: cannot hold {', '.join(unknown)}; the runs are {', '.join(PHASES)}")
        if self.steps_per_s is not None and not self.steps_per_s > 0:
            raise MeshpactError(f"pace: steps per second must be above 0 (or unset), got {self.steps_per_s}")

    def holds(self, phase: str) -> bool:
        return phase in self.hold

    def write(self, work_dir: str | os.PathLike[str]) -> Path:
        """Replace the pace file in ``work_dir`` in one step (a rank never reads half of it)."""
        path = Path(work_dir) / PACE_FILE
        tmp = path.with_name(f".{PACE_FILE}.{os.getpid()}")
        tmp.write_text(json.dumps({"steps_per_s": self.steps_per_s, "hold": sorted(self.hold)}))
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, work_dir: str | os.PathLike[str]) -> "Pace | None":
        """The pace in ``work_dir``, or None when there is no pace file (full speed)."""
        try:
            raw = json.loads((Path(work_dir) / PACE_FILE).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise MeshpactError(
                f"{Path(work_dir) / PACE_FILE}: unreadable pace ({exc}); "
                'expected {"steps_per_s": number or null, "hold": [run names]}'
            ) from None
        return cls(raw.get("steps_per_s"), frozenset(raw.get("hold") or ()))
