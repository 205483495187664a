"""Recovery settings: every timeout of a resilient job derived from a few stated inputs.

A resilient job waits in eight places: the heartbeat (a rank that stops beating), a data-path
collective, a consensus round on the control channel, building a new group, the launcher's
deadline, the bound after which a silent rank is declared lost, the bound by which its
replacement must join, and a peer copy's send or fetch. Each was once a constant
picked where it was used; here each is a derived property of one :class:`RecoveryConfig`,
from inputs a user can reason about (how long a replacement process takes to start, how long
a group takes to connect, how long a step takes), and an ordering that cannot work is refused
on construction with one line naming both values.

The orderings:

- a consensus round must cover group creation: a rank still building the previous
  generation's group (up to ``group_create_s``) must not be taken for a silent one by peers
  already in the next round; and it must cover a replacement process starting;
- the launcher deadline must cover the rank-loss bound, or the launcher kills a job that
  consensus was about to name a lost rank in;
- a heartbeat detection bound longer than the data-path timeout is allowed (the data path
  then finds hangs first) but reported in :attr:`RecoveryConfig.notes`: the heartbeat adds
  nothing there;
- the data-path timeout must cover what the job's own steps take. Left unset (the default) it
  follows the job: the first groups wait up to the warm-up bound (``warmup_s``: building,
  compiling, the first optimizer step), and once a step has been measured the runtime sets
  ``data_timeout_margin`` times the longest step measured (a step bounds every collective in
  it), never under ``data_timeout_floor_s``, on the live groups and every later generation
  (:meth:`RecoveryConfig.timeout_for`). A set value is used from the first step; a measured
  step that needs more raises it (``data_timeout_follows``, the default) or is refused in one
  line naming both values. The heartbeat judges progress, not time (a rank in a step of any
  length, working or waiting on its peers, progresses); a step that waits on something else (a
  queue, a disk) pauses, and that bound follows the job too: ``stall_margin`` times the longest
  pause a completed step made, at least ``heartbeat_misses`` looks (heartbeat.py).

Torch-free: the CLI checks a user's settings before anything starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

from meshpact.core.errors import MeshpactError

__all__ = ["RecoveryConfig", "TimeoutOrderError"]


class TimeoutOrderError(MeshpactError):
    """Two timeouts in an order that cannot work; the message names both values."""


@dataclass(frozen=True)
class RecoveryConfig:
    """The settings of a resilient job; every timeout is a property derived from the inputs.

    Inputs (seconds unless said): ``data_timeout_s`` (a data-path operation; None, the default:
    follow the job's measured steps, see the module docstring), ``heartbeat_interval_s`` and ``heartbeat_misses`` (a rank is
    stalled after this many intervals without a beat), ``process_start_s`` (a replacement
    process starting and reaching the control channel), ``group_create_s`` (every member of a
    new group connecting), ``max_rounds`` (incomplete consensus rounds before a silent rank is
    declared lost), ``step_s`` and ``warmup_s`` (a training step, and the first one with
    building and compiling: only the launcher deadline uses them). ``consensus_round_s``
    overrides the derived round (refused when it cannot work)."""

    data_timeout_s: float | None = None  # None: follow the job (warm-up bound, then margin x the longest step)
    heartbeat_interval_s: float = 0.05
    heartbeat_misses: int = 3
    process_start_s: float = 20.0
    group_create_s: float = 20.0
    max_rounds: int = 4
    heartbeat: bool = True  # run the heartbeat (live/recovery/heartbeat.py); off: hangs wait for the data path
    standby: bool = True  # build the next generation's groups in the background (communicator.Standby)
    step_s: float = 5.0
    warmup_s: float = 120.0
    consensus_round_s_override: float | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    count_dispatch: bool = False  # also count ops with a dispatch mode (turns torch.compile off)
    check_commits: bool = True  # keep a commit check (O(1) bytes) to prove the state intact
    restore_rng: bool = True  # restore every generator before a step is re-run (off only to prove it matters)
    vendor: str = field(default_factory=lambda: os.environ.get("MESHPACT_VENDOR", "cuda"))  # nccl where CUDA is
    prefer_reconfigure: bool = True  # use ProcessGroup.reconfigure where torch has it (2.14+)
    # K: ranks holding a copy of each rank's committed state in host memory (peers.py); None (the default):
    # 1 where the job has more than one rank (for_world), 0 turns them off
    peer_copies: int | None = None
    # committed steps kept of each: 2 (own snapshots and held copies: a one-step rollback when a rank dies with
    # its newest copy in flight) or 1 (half the host memory; that case restores from the checkpoint)
    peer_copy_depth: int = 2
    replacement_rounds: int = 2  # rounds waited for a replacement after a rank is declared lost
    data_timeout_margin: float = 4.0  # the data-path timeout is at least this many times the longest step measured
    data_timeout_follows: bool = True  # raise a set data-path timeout to that (off: refuse a shorter one)
    data_timeout_floor_s: float = 1.0  # a followed data-path timeout is never shorter than this
    # a rank is stalled after this many times the longest pause its own completed steps made (heartbeat.py)
    stall_margin: float = 4.0

    def __post_init__(self) -> None:
        for name in (
            "data_timeout_s",
            "heartbeat_interval_s",
            "process_start_s",
            "group_create_s",
            "step_s",
            "warmup_s",
            "data_timeout_floor_s",
        ):
            value = getattr(self, name)
            if value is None and name == "data_timeout_s":
                continue
            if not (isinstance(value, (int, float)) and value > 0):
                raise TimeoutOrderError(f"{name} must be a positive number of seconds, got {value}")
        for name in ("heartbeat_misses", "max_rounds", "replacement_rounds"):
            if getattr(self, name) < 1:
                raise TimeoutOrderError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.data_timeout_margin >= 1.0:
            raise TimeoutOrderError(
                f"data_timeout_margin must be at least 1 (times the longest step), got {self.data_timeout_margin}"
            )
        if not self.stall_margin >= 1.0:
            raise TimeoutOrderError(
                f"stall_margin must be at least 1 (times the longest pause of a completed step), "
                f"got {self.stall_margin}"
            )
        if self.peer_copies is not None and not (isinstance(self.peer_copies, int) and self.peer_copies >= 0):
            raise TimeoutOrderError(f"peer_copies must be 0 or more (0: none kept), got {self.peer_copies!r}")
        if self.peer_copy_depth not in (1, 2):
            raise TimeoutOrderError(
                f"peer_copy_depth must be 1 or 2 (committed steps kept), got {self.peer_copy_depth}"
            )
        if self.consensus_round_s < self.group_create_s:
            raise TimeoutOrderError(
                f"the consensus round ({self.consensus_round_s:g} s) is shorter than group creation "
                f"({self.group_create_s:g} s): a rank still building a group would be taken for a silent one"
            )
        if self.consensus_round_s < self.process_start_s:
            raise TimeoutOrderError(
                f"the consensus round ({self.consensus_round_s:g} s) is shorter than a process start "
                f"({self.process_start_s:g} s): a replacement could never join a round"
            )

    def for_world(self, world: int) -> "RecoveryConfig":
        """These settings for a job of ``world`` ranks, with the peer copies settled: as set, or by
        default K = 1 where the job has more than one rank (a killed rank's state then comes from a
        peer's host memory) and 0 for a job of one rank (nobody to hold a copy)."""
        if self.peer_copies is not None:
            return self
        return replace(self, peer_copies=1 if world > 1 else 0)

    # -- derived ---------------------------------------------------------------------------
    @property
    def data_timeout_start_s(self) -> float:
        """The data-path timeout of the first groups, before any step is measured: the set one,
        or (following the job) the warm-up bound, which covers a first step's building and
        compiling (``max(warmup_s, data_timeout_floor_s)``)."""
        if self.data_timeout_s is not None:
            return float(self.data_timeout_s)
        return max(self.warmup_s, self.data_timeout_floor_s)

    @property
    def data_timeout_least_s(self) -> float:
        """The shortest the data-path timeout can be once steps are measured: the set one, or the
        floor when it follows the job."""
        return float(self.data_timeout_s) if self.data_timeout_s is not None else self.data_timeout_floor_s

    @property
    def heartbeat_detect_s(self) -> float:
        """The longest a stalled rank goes unnoticed by its peers' heartbeat watch: its last beat
        may come just before the stall, then ``misses`` whole intervals pass, then the watcher's
        next look (one interval)."""
        return self.heartbeat_interval_s * (self.heartbeat_misses + 1)

    @property
    def detection_bound_s(self) -> float:
        """A hang is found by whichever comes first: the heartbeat (when it runs) or the
        data-path timeout."""
        if self.heartbeat:
            return min(self.heartbeat_detect_s, self.data_timeout_start_s)
        return self.data_timeout_start_s

    @property
    def standby_wait_s(self) -> float:
        """How long a recovery waits for a standby still being built before building instead:
        ``min(data_timeout_least_s, group_create_s)``. A standby still connecting after a data-path
        timeout is waiting on a silent peer; building would wait on the same peer."""
        return min(self.data_timeout_least_s, self.group_create_s)

    @property
    def consensus_round_s(self) -> float:
        """How long a round waits for every proposal (the control channel's wait bound):
        ``max(process_start_s, group_create_s)`` unless overridden."""
        if self.consensus_round_s_override is not None:
            return float(self.consensus_round_s_override)
        return max(self.process_start_s, self.group_create_s)

    @property
    def control_timeout_s(self) -> float:
        """The control channel's wait bound: one consensus round."""
        return self.consensus_round_s

    @property
    def connect_timeout_s(self) -> float:
        """Building a group: every member connecting (a rank that died after proposing is met here)."""
        return self.group_create_s

    @property
    def store_connect_s(self) -> float:
        """Reaching the rendezvous store and the control channel: a process starting, then
        every peer arriving."""
        return self.process_start_s + self.group_create_s

    @property
    def rank_loss_bound_s(self) -> float:
        """A silent rank is declared lost after ``max_rounds`` incomplete rounds."""
        return self.max_rounds * self.consensus_round_s

    @property
    def replacement_bound_s(self) -> float:
        """A lost rank's replacement must join by then, or the survivors excise the rank where
        the job can (else consensus gives up): the rank-loss bound, then ``replacement_rounds``
        more rounds (each covers a process start)."""
        return (self.max_rounds + self.replacement_rounds) * self.consensus_round_s

    @property
    def peer_copy_timeout_s(self) -> float:
        """Sending one peer copy, or a replacement fetching one: a connection as slow as a group's."""
        return self.group_create_s

    @property
    def recovery_bound_s(self) -> float:
        """The longest a recovery that succeeds can take: detection, one round, group creation."""
        return self.detection_bound_s + self.consensus_round_s + self.group_create_s

    def launcher_deadline_s(self, steps: int, faults: int, per_fault_s: float = 0.0) -> float:
        """When the launcher stops a job of ``steps`` steps and ``faults`` faults (each lasting
        ``per_fault_s`` itself, e.g. a stall): starting, warm-up, the steps, a bounded recovery
        per fault, and the replacement bound once (a rank declared lost and replaced, or the
        job ended)."""
        return (
            self.store_connect_s
            + self.warmup_s
            + steps * self.step_s
            + faults * (self.recovery_bound_s + per_fault_s)
            + self.replacement_bound_s
        )

    def timeout_for(self, longest_step_s: float) -> float:
        """The data-path timeout for a job whose longest measured step took ``longest_step_s``
        (each step bounds every collective in it): ``data_timeout_margin`` times it, never under
        :attr:`data_timeout_least_s`. A set timeout that does not follow and is shorter is
        refused in one line naming both values."""
        need = self.data_timeout_margin * longest_step_s
        least = self.data_timeout_least_s
        if need <= least:
            return least
        if self.data_timeout_s is not None and not self.data_timeout_follows:
            raise TimeoutOrderError(
                f"the data-path timeout ({least:g} s) is shorter than {self.data_timeout_margin:g} x the "
                f"longest step measured ({longest_step_s:.3g} s = {need:.3g} s): a normal step would time out; "
                "raise it or let it follow the job"
            )
        return need

    def fit(self, longest_step_s: float) -> "RecoveryConfig":
        """This config with the data-path timeout :meth:`timeout_for` gives (itself when the set
        timeout already covers the steps)."""
        timeout = self.timeout_for(longest_step_s)
        return self if timeout == self.data_timeout_s else replace(self, data_timeout_s=timeout)

    def check_deadline(self, deadline_s: float) -> None:
        """Refuse a launcher deadline shorter than the rank-loss bound."""
        if deadline_s < self.rank_loss_bound_s:
            raise TimeoutOrderError(
                f"the launcher deadline ({deadline_s:g} s) is shorter than the rank-loss bound "
                f"({self.rank_loss_bound_s:g} s = {self.max_rounds} rounds x {self.consensus_round_s:g} s): "
                "the job would be killed before consensus names a lost rank"
            )

    @property
    def notes(self) -> tuple[str, ...]:
        """Orderings that work but are probably not meant (one line each, both values named)."""
        out = []
        if self.heartbeat and self.heartbeat_detect_s > self.data_timeout_least_s:
            out.append(
                f"the heartbeat detection bound ({self.heartbeat_detect_s:g} s) is longer than the "
                f"data-path timeout ({self.data_timeout_least_s:g} s): the data path finds hangs first and "
                "the heartbeat adds nothing"
            )
        return tuple(out)

    def table(self) -> list[tuple[str, float, str]]:
        """(derived value, seconds, formula) for each derived timeout: the README's table."""
        return [
            (
                "heartbeat detection bound",
                self.heartbeat_detect_s,
                "heartbeat_interval_s x (heartbeat_misses + 1), at the least: a job whose steps pause allows stall_margin x the longest pause",
            ),
            (
                "data-path timeout, first steps",
                self.data_timeout_start_s,
                "data_timeout_s, or max(warmup_s, data_timeout_floor_s) while it follows the job",
            ),
            (
                "data-path timeout, once a step is measured",
                self.data_timeout_least_s,
                "at least this: max(data_timeout_s or data_timeout_floor_s, data_timeout_margin x longest step)",
            ),
            (
                "hang detection bound",
                self.detection_bound_s,
                "min(heartbeat bound, first-steps data-path timeout) with the heartbeat on, else that timeout",
            ),
            ("consensus round (control channel wait)", self.consensus_round_s, "max(process_start_s, group_create_s)"),
            ("group creation (connect)", self.connect_timeout_s, "group_create_s"),
            (
                "wait for a standby still being built",
                self.standby_wait_s,
                "min(data_timeout_s or data_timeout_floor_s, group_create_s)",
            ),
            ("store connect", self.store_connect_s, "process_start_s + group_create_s"),
            ("rank-loss bound (declared lost)", self.rank_loss_bound_s, "max_rounds x consensus round"),
            ("replacement bound", self.replacement_bound_s, "(max_rounds + replacement_rounds) x consensus round"),
            ("peer copy send / fetch", self.peer_copy_timeout_s, "group_create_s"),
            ("one recovery, at most", self.recovery_bound_s, "detection + consensus round + group creation"),
        ]
