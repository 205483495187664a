"""A recovery trial, run from the parent: a fault-free reference, a faulted run, and the baselines.

:func:`run_trial` checks the workload file (one clear line, before any rank starts), then
drives one whole comparison: the reference, the faulted run (starting a replacement for any
rank killed with SIGKILL), and, with baselines, a checkpoint restore and a cold restart. Where
the faults cost processes (kill, silent) the checkpoint restore is a run of its own that loses
the same processes at the same steps, their replacements started the same way, with no peer
copies; otherwise it is a restore in the job at the end of the faulted run (the drill). The
cold restart loads the checkpoint the restore loaded and is timed to the step it caught up to.
Each rank runs :func:`~meshpact.live.trials.rankworker.worker`. The
final state of every rank (parameter shards, optimizer state, generators) is compared with
``torch.equal`` against the reference, and every stage event goes to one JSONL recording;
:class:`~meshpact.live.trials.analysis.TrialResult` holds the numbers.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

from meshpact.core.errors import MeshpactError
from meshpact.core.jsonform import JsonObject
from meshpact.core.recording import Event, EventKind, RecordingWriter
from meshpact.core.recovery import Policy, Stage

from ..launch.forkserver import PRELOAD, ForkServer
from ..launch.agentjob import AgentJob
from ..launch.launcher import LaunchError, host_store
from ..netns import entered
from .analysis import ExcisionPlan, ExcisionResult, ReplacementStart, TrialResult, compare_final
from ..recovery.consensus import declared_lost
from ..recovery.control import ControlChannel
from ..recovery.faults import Fault, FaultKind, NetnsPair, netns_unavailable, plan_faults
from ..recovery.jobkey import draw
from ..recovery.peers import ADDR_ENV as PEER_ADDR_ENV
from ..recovery.peers import HOST_ENV as PEER_HOST_ENV
from .outcome import RankOutcome
from .trialconfig import HEARTBEATS_FILE, PROCESSES_FILE, TrialConfig
from ..recovery.workload import WorkloadError, check_workload

__all__ = ["TrialConfig", "TrialResult", "ReplacementSupply", "run_trial", "RANK_PRELOAD"]

WORKER = "meshpact.live.trials.rankworker:worker"
EXCISION_WORKER = "meshpact.live.trials.drills:excision_drill"  # the excising reference
# what a trial's fork server imports before it forks ranks: torch's packages (DCP too: a trial's
# ranks save checkpoints, and each forked rank imported it at its first save), then the rank's own
# modules (0.2 s of CPU a rank; none reads the environment or starts a thread at import)
RANK_PRELOAD = (
    *PRELOAD,
    "torch.distributed.checkpoint",
    WORKER.split(":")[0],
    EXCISION_WORKER.split(":")[0],
    "meshpact.live.recovery.runtime",
    "meshpact.live.recovery.session",
)


def _run(
    cfg: TrialConfig,
    workload: str,
    tag: str,
    work: Path,
    faults: tuple[Fault, ...],
    extra: JsonObject,
    netns: NetnsPair | None,
    stores: dict[str, int] | None,
    recording: RecordingWriter,
    forkserver: ForkServer | Callable[[int], ForkServer] | None = None,
    supply: ReplacementSupply | None = None,
    warm_replacements: bool = False,
) -> tuple[list[RankOutcome], int, float]:
    out_dir = Path(extra.get("out_dir", work / tag))
    out_dir.mkdir(parents=True, exist_ok=True)
    args = {
        "steps": cfg.steps,
        "checkpoint_every": cfg.checkpoint_every,
        "data_timeout_s": cfg.data_timeout_s,
        "process_start_s": cfg.process_start_s,
        "group_create_s": cfg.group_create_s,
        "stall_s": cfg.stall_s,
        "down_s": cfg.down_s,
        "checkpoint_dir": str(work / "checkpoints"),
        "out_dir": str(out_dir),
        "workload": workload,
        "faults": [f.to_dict() for f in faults],
        "count_dispatch": cfg.count_dispatch,
        "restore_rng": cfg.restore_rng,
        "heartbeat": cfg.heartbeat,
        "peer_copies": cfg.peer_copies,
        "peer_copy_depth": cfg.peer_copy_depth,
        "max_rounds": cfg.max_rounds,
        "die_after_proposing": sorted({(f.rank + 1) % cfg.ranks for f in faults}) if cfg.die_after_proposing else [],
        "on_rank_loss": Policy.EXCISE.value if cfg.excising else Policy.PEER_RESTORE.value,
        "min_ranks": cfg.min_ranks,
        **extra,
    }
    supply = supply or ReplacementSupply()
    gone: dict[int, int] = {}  # rank -> the return code of the process it was left without a replacement after

    def replaced(rank: int, rc: int, warm: bool) -> None:
        recording.emit(
            EventKind.REPLACEMENT_STARTED, rank=rank, stage=Stage.RESTART, data={"returncode": rc, "warm_spare": warm}
        )

    def left_gone(rank: int, rc: int) -> None:
        gone[rank] = rc
        data: JsonObject = (
            {"returncode": rc, "excised": True}
            if cfg.excising and rc == -9
            else {
                "returncode": rc,
                "started": False,
                "announced": supply.announce_missing or cfg.excising,
                "why": f"no replacement left (at most {limit} started)"
                if rc == -9
                else f"exited with {rc} by itself (a trial replaces only the processes its faults kill)",
            }
        )
        recording.emit(EventKind.REPLACEMENT_STARTED, rank=rank, stage=Stage.RESTART, data=data)

    # the ranks run under meshpact launch's agent (in this process): it replaces a killed rank, kills and
    # replaces a rank the job declares lost, and tells the job a rank is gone when none is left; an
    # excising trial gives none, so the survivors go on without it; a process that failed by itself is
    # not replaced (a first one is the error the trial reports, a replacement's is left gone, as announced)
    limit = 0 if cfg.excising else (supply.limit if supply.limit is not None else len(faults) + cfg.ranks)
    if netns is not None and stores is not None:
        hosts, control = _Hosts.namespaces(netns, stores, cfg.ranks), None
    else:
        control = host_store("127.0.0.1", 0, cfg.ranks)
        hosts = _Hosts(("127.0.0.1", control.port))
    t_launch = time.time()
    with hosts.entered():  # the agent's connections (and the watch's) are made where the stores are
        # the ranks get it from the agent; the watch reads with it
        key = draw(f"drawn for trial {tag}") if cfg.authenticated else None
        watch = LostRankWatch(
            ControlChannel(*hosts.control, 0, cfg.ranks, 5.0, run_id=tag, key=key),
            recording,
            ages_file=out_dir / HEARTBEATS_FILE,
        )
        with AgentJob(
            WORKER,
            cfg.ranks,
            args,
            timeout_s=cfg.deadline_s,
            spares=int(extra.get("spares", 0)),
            job_key=key,
            unauthenticated=key is None,
            max_replacements=limit,
            control=hosts.control,
            master=hosts.master,
            prefix=hosts.prefix,
            env=hosts.env,
            run_id=tag,
            forkserver=forkserver,
            warm_replacements=warm_replacements,
            registry=work / PROCESSES_FILE,
            on_replaced=replaced,
            on_gone=left_gone,
            on_tick=watch,
            announce_gone=supply.announce_missing or cfg.excising,
            replace_only_killed=True,
        ) as job:
            ran = job.run()
    # a rank left without a replacement is expected where it was killed (a fault, or declared lost) or where
    # a replacement of it died again; a first process that failed by itself is the workload's error
    failed = [
        r for r in ran.results if not r.ok and (r.rank not in gone or (gone[r.rank] != -9 and r.incarnation == 0))
    ]
    if failed:
        bad = failed[0]
        told = "".join(
            f"\nrank {r} was given no further process after exiting with {rc}"
            for r, rc in sorted(gone.items())
            if r != bad.rank
        )
        raise LaunchError(
            f"{tag} run: rank {bad.rank} "
            f"{'timed out' if bad.returncode is None else f'exited with {bad.returncode}'}"
            f" (limit {cfg.deadline_s:.0f} s); its stderr ends:\n{bad.stderr_tail}{told}"
        )
    outcomes = [RankOutcome.from_dict(r.value) for r in ran.results if r.rank not in gone]
    for o in outcomes:
        if o.workload_error:
            raise WorkloadError(o.workload_error)
    del control
    return outcomes, ran.replacements, t_launch


@dataclass(frozen=True)
class _Hosts:
    """Where a run's ranks and stores are: this machine's loopback (the run hosts its control channel, the
    agent the ranks' store), or two network namespaces (:meth:`namespaces`)."""

    control: tuple[str, int]
    master: tuple[str, int] | None = None  # the ranks' store, served elsewhere (None: the agent hosts it)
    prefix: Callable[[int], list[str]] | None = None  # the command a rank starts under (its host)
    env: Callable[[int], dict[str, str]] | None = None
    netns: str | None = None  # the namespace the stores are reached from (None: this thread's own)

    @classmethod
    def namespaces(cls, netns: NetnsPair, stores: dict[str, int], ranks: int) -> "_Hosts":
        """Ranks split between two namespaces, each under its side's ``ip netns exec``, with its side's
        interfaces and its peer copies served on the control link (out of band: a partition of the data
        link spares them); the stores served in the first (:func:`_serve_stores_in`)."""

        def env(rank: int) -> dict[str, str]:  # a rank's host is its side's control address, as its peers see it
            addr = netns.ctrl_ip[netns.side(rank, ranks)]
            return {**netns.rank_env(rank, ranks), PEER_ADDR_ENV: addr, PEER_HOST_ENV: addr}

        return cls(
            (netns.ctrl_ip[0], stores["control_port"]),
            (netns.data_ip[0], stores["data_port"]),
            lambda r: netns.prefix(netns.side(r, ranks)),
            env,
            netns.ns[0],
        )

    def entered(self) -> contextlib.AbstractContextManager[None]:
        """This thread where the stores are reached (in the first namespace), or where it is."""
        return entered(self.netns) if self.netns is not None else contextlib.nullcontext()


@dataclass(frozen=True)
class ReplacementSupply:
    """What the faulted run's launcher can give a lost rank: at most ``limit`` replacement
    processes (None: one per lost rank), and whether it tells the job when it has none
    (``announce_missing``; off: a scheduler that never answers)."""

    limit: int | None = None
    announce_missing: bool = True


class LostRankWatch:
    """The trial's record of a rank declared lost: consensus names it on the control channel
    (``lost/round<k>``); the agent that runs the ranks reads the same channel, kills the rank (a
    silent process is stopped, not gone) and, like any killed rank, replaces it; this watch,
    called at each of the agent's looks, records it. Checked at most every ``every_s`` seconds.

    With ``ages_file`` it also reads every rank's heartbeat counter in the same look and keeps
    each rank's heartbeat age (seconds since its counter last moved, as this observer saw it)
    in that file, rewritten whole (:data:`HEARTBEATS_FILE`: what the dashboard's metrics read)."""

    def __init__(
        self, channel: ControlChannel, recording: RecordingWriter, every_s: float = 0.25, ages_file: Path | None = None
    ) -> None:
        self.channel = channel
        self.recording = recording
        self.every_s = every_s
        self.ages_file = ages_file
        self._seen_round = 0
        self._next = 0.0
        self._beats: dict[int, tuple[int, float]] = {}  # rank -> (its counter, wall time it last moved)

    def __call__(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        if self.ages_file is not None:
            self.write_ages()
        for round_, ranks in sorted(declared_lost(self.channel, self._seen_round).items()):
            self._seen_round = max(self._seen_round, round_)
            for r in ranks:
                self.recording.emit(
                    EventKind.REPLACEMENT_STARTED, rank=r, stage=Stage.RESTART, data={"declared_lost_in_round": round_}
                )

    def write_ages(self) -> None:
        """Read every rank's heartbeat counter (one round trip) and write each rank's age."""
        from ..recovery.heartbeat import beat_key

        assert self.ages_file is not None
        ranks = range(self.channel.world_size)
        counts = self.channel.counters([beat_key(r) for r in ranks])
        wall = time.time()
        for r, n in zip(ranks, counts):
            if n and self._beats.get(r, (0, 0.0))[0] != n:
                self._beats[r] = (n, wall)
        doc = {"t": wall, "ages_s": {str(r): round(wall - t, 3) for r, (_, t) in sorted(self._beats.items())}}
        partial = self.ages_file.with_name(self.ages_file.name + ".partial")
        partial.write_text(json.dumps(doc))
        os.replace(partial, self.ages_file)


def _with_holders(faults: tuple[Fault, ...], cfg: TrialConfig, hosts: list[str] | None) -> tuple[Fault, ...]:
    """Each kill also kills the killed rank's holders at the same step (its state goes with them)."""
    from ..recovery.peers import placement

    extra = [
        Fault(len(faults) + i, f.kind, f.step, h)
        for i, (f, h) in enumerate((f, h) for f in faults for h in placement(f.rank, cfg.ranks, cfg.peer_copies, hosts))
    ]
    return faults + tuple(extra)


def run_trial(
    cfg: TrialConfig,
    recording_path: str | os.PathLike[str] | None = None,
    work_dir: str | os.PathLike[str] | None = None,
    reference_dir: str | os.PathLike[str] | None = None,
    *,
    replacements: int | None = None,
    announce_missing: bool = True,
    forkserver: ForkServer | None = None,
    warm_replacements: bool = False,
) -> TrialResult:
    """Run the trial in ``work_dir``; without one, in a scratch directory that is removed after
    (kept when the recording would live in it, i.e. no ``recording_path`` either).

    ``reference_dir`` holding ``final-rank<r>.pt`` from an earlier fault-free run of the same
    workload, ranks and steps is compared against instead of running the reference again.

    ``replacements`` bounds the replacement processes the faulted run's launcher starts (None:
    one per lost rank, as a scheduler with room would). A lost rank that gets none, or whose
    replacement dies by itself, is marked gone on the control channel, so the survivors excise
    it at once (or stop, saying why they cannot); with ``announce_missing`` off the launcher
    says nothing, as a scheduler that never answers, and the survivors excise it when its
    replacement misses its deadline. A faulted run that excised is judged against the
    excising reference, whatever ``--on-rank-loss`` was.

    ``forkserver``: a running :class:`ForkServer` to take the warm starts from (a caller running
    many trials keeps one, and pays its imports once); without one, the trial starts its own.
    ``warm_replacements``: fork the faulted run's replacement processes (and warm spares) from it too (for callers
    that measure no replacement's start, such as the test suite; a downtime with a warm start
    in it is not a real one).
    """
    checked = check_workload(cfg.workload, cfg.ranks)  # one clear line before any rank starts
    if cfg.on_rank_loss == "excise" and len(checked.mesh.shape) > 2:
        raise WorkloadError(
            f"{checked.path}: --on-rank-loss excise re-shards a 1-D FSDP mesh or drops replicas of a "
            f"2-D HSDP one; this workload's MESH is {list(checked.mesh.shape)} (use --on-rank-loss replace)"
        )
    workload = checked.path
    supply = ReplacementSupply(replacements, announce_missing)
    if work_dir is not None or recording_path is None:
        return _run_trial(cfg, workload, recording_path, work_dir, reference_dir, supply, forkserver, warm_replacements)
    with tempfile.TemporaryDirectory(prefix="meshpact-trial-") as scratch:
        return _run_trial(cfg, workload, recording_path, scratch, reference_dir, supply, forkserver, warm_replacements)


@contextlib.contextmanager
def _partition_hosts(cfg: TrialConfig) -> Iterator[tuple[NetnsPair | None, dict[str, int] | None]]:
    """For partition faults and two-host runs: two network namespaces and the stores served
    inside the first; otherwise nothing. Both are torn down on leaving, whatever happened inside."""
    if cfg.fault_kind is not FaultKind.PARTITION and not cfg.two_hosts:
        yield None, None
        return
    with NetnsPair() as netns:
        proc, stores = _serve_stores_in(netns)
        try:
            yield netns, stores
        finally:
            proc.kill()
            proc.wait(timeout=10)


@contextlib.contextmanager
def _warm_starts(
    cfg: TrialConfig, netns: NetnsPair | None, shared: ForkServer | None
) -> Iterator[ForkServer | Callable[[int], ForkServer] | None]:
    """A fork server for the runs whose rank starts are not measured (the reference, the faulted
    run's first processes, the excising reference): ``shared`` when given (left running; where
    ranks run in two network namespaces it forks each into its rank's), else one of the trial's
    own, or where ranks run in two network namespaces one started in each (its children are
    forked there); none where ``cfg.warm_starts`` is off."""
    if not cfg.warm_starts:
        yield None
        return
    if netns is not None and shared is None:
        with (
            ForkServer(RANK_PRELOAD, prefix=netns.prefix(0)) as first,
            ForkServer(RANK_PRELOAD, prefix=netns.prefix(1)) as second,
        ):
            yield lambda r: (first, second)[netns.side(r, cfg.ranks)]
        return
    if shared is not None:
        yield shared
        return
    with ForkServer(RANK_PRELOAD) as server:
        yield server


def _run_trial(
    cfg: TrialConfig,
    workload: str,
    recording_path: str | os.PathLike[str] | None,
    work_dir: str | os.PathLike[str] | None,
    reference_dir: str | os.PathLike[str] | None,
    supply: ReplacementSupply,
    forkserver: ForkServer | None = None,
    warm_replacements: bool = False,
) -> TrialResult:
    if cfg.fault_kind is FaultKind.PARTITION or cfg.two_hosts:
        why = netns_unavailable()
        if why:
            raise MeshpactError(f"cannot run ranks on two hosts (network namespaces) here: {why}")
    work = Path(work_dir or tempfile.mkdtemp(prefix="meshpact-trial-"))
    work.mkdir(parents=True, exist_ok=True)
    recording_path = Path(recording_path or work / "recording.jsonl")
    faults = plan_faults(
        cfg.fault_kind,
        cfg.steps,
        cfg.faults,
        cfg.ranks,
        injector_ranks=(0,) if cfg.fault_kind is FaultKind.PARTITION else None,
        nth_op=cfg.nth_op,
    )
    if cfg.kill_holders:
        sides = [0 if r < (cfg.ranks + 1) // 2 else 1 for r in range(cfg.ranks)]  # NetnsPair.side
        faults = _with_holders(faults, cfg, [str(x) for x in sides] if cfg.two_hosts else None)
    cold = None
    cold_launch = None
    cold_replays: int | None = None
    ckpt_baseline: TrialResult | None = None
    with RecordingWriter(
        recording_path,
        "live",
        kind="recovery_trial",
        ranks=cfg.ranks,
        steps=cfg.steps,
        fault_kind=cfg.fault_kind.value,
        faults=len(faults),
        workload=workload,
        checkpoint_every=cfg.checkpoint_every,
    ) as rec:
        t0_wall = time.time() - rec.now()
        with _partition_hosts(cfg) as (netns, stores), _warm_starts(cfg, netns, forkserver) as warm:
            ref_dir = Path(reference_dir) if reference_dir else work / "reference"
            if reference_dir and all((ref_dir / f"final-rank{r}.pt").exists() for r in range(cfg.ranks)):
                reference: list[RankOutcome] = []
            else:
                reference, _, _ = _run(
                    cfg,
                    workload,
                    "reference",
                    ref_dir.parent,
                    (),
                    {"checkpoint_dir": str(ref_dir.parent / "ref-checkpoints"), "out_dir": str(ref_dir)},
                    netns,
                    stores,
                    rec,
                    warm,
                )
            # where a fault costs a process, the checkpoint baseline loses the same one (a run of its own
            # below); otherwise it is a drill at the end of the faulted run, in a job where nothing died
            same_loss = cfg.baselines and not cfg.excising and cfg.loses_process and bool(faults)
            faulted, replacements, _ = _run(
                cfg,
                workload,
                "faulted",
                work,
                faults,
                {"drill": cfg.baselines and not cfg.excising and not same_loss, "spares": cfg.spare_ranks},
                netns,
                stores,
                rec,
                warm,
                supply,
                warm_replacements,
            )
            faulted = [o for o in faulted if o.left_with_replica is None]  # ranks that left with their HSDP replica
            excision = None
            plan = _excisions_of(read_rank_events(work / "faulted"))
            if cfg.excising or plan:  # the same ranks leave at the same steps, with no fault: the excising reference
                excision = _excising_reference(cfg, workload, work, plan, faulted, ref_dir, warm)
            cold_from: JsonObject | None = None
            if same_loss and not plan:
                ckpt_baseline = (
                    _same_loss_baseline(cfg, faults, faulted, replacements, work / "faulted")
                    if cfg.peer_copies == 0
                    else _checkpoint_run(
                        cfg, workload, work, faults, netns, stores, rec, warm, supply, warm_replacements
                    )
                )
                first = next(
                    (r for r in ckpt_baseline.recoveries() if r["policy"] == Policy.CHECKPOINT_RESTORE.value), None
                )
                if first is not None:  # from the same checkpoint, up to where the fault struck
                    cold_from = {
                        "cold_from": first["step"] - first["lost_steps"],
                        "checkpoint_dir": str(_checkpoint_dir(cfg, work)),
                    }
                    cold_replays = first["lost_steps"]
            elif cfg.baselines and not cfg.excising and not plan:
                drill = faulted[0].drill
                assert drill is not None, "the faulted run ends with a drill when baselines are on"
                cold_from, cold_replays = {"cold_from": drill.checkpoint_step}, None
            if cold_from is not None:  # a cold restart starts fresh interpreters (not warm)
                cold, _, cold_launch = _run(cfg, workload, "cold", work, (), cold_from, netns, stores, rec)
        fault_records = {k: v for o in faulted for k, v in o.fault_records.items()}
        faulted_events = read_rank_events(work / "faulted")
        mismatches = (
            excision.mismatches if excision is not None else compare_final(ref_dir, work / "faulted", cfg.ranks)
        )
        if cold is not None:
            mismatches += [f"cold restart: {m}" for m in compare_final(ref_dir, work / "cold", cfg.ranks)]
        if ckpt_baseline is not None and cfg.peer_copies > 0:
            mismatches += [f"checkpoint restore: {m}" for m in compare_final(ref_dir, work / "checkpoint", cfg.ranks)]
        cold_events = read_rank_events(work / "cold") if cold is not None else []
        for ev in sorted(faulted_events + cold_events, key=lambda e: e.t):
            rec.emit(ev.event, rank=ev.rank, stage=ev.stage, data=ev.data, t=ev.t - t0_wall)
        for o in faulted:  # each rank's training loop: the step it began at and every step's seconds
            rec.emit(
                EventKind.TRAINED,
                rank=o.rank,
                t=o.t_caught_up_wall - t0_wall,
                data={
                    "first_step": cfg.steps - len(o.step_s),
                    "steps": len(o.step_s),
                    "step_s": list(o.step_s),
                    "seconds": sum(o.step_s),
                    "incarnation": o.incarnation,
                },
            )
        for f in faults:
            r = fault_records.get(f.index)
            if r:
                rec.emit(EventKind.FAULT_INJECTED, rank=f.rank, data={**f.to_dict(), **asdict(r)}, t=r.t_wall - t0_wall)
        result = TrialResult(
            cfg,
            faults,
            reference,
            faulted,
            cold,
            fault_records,
            not mismatches,
            mismatches,
            replacements,
            str(recording_path),
            cold_launch,
            faulted_events,
            excision,
            ckpt_baseline,
            cold_replays if cold is not None else None,
            _replacement_start(cfg, warm_replacements),
        )
        for recovered in result.recoveries():
            rec.emit(EventKind.RECOVERED, data=recovered)
        rec.emit(EventKind.SUMMARY, data=result.summary())
    return result


def _replacement_start(cfg: TrialConfig, warm_replacements: bool) -> ReplacementStart:
    if cfg.spare_ranks:
        return ReplacementStart.WARM_SPARE
    return ReplacementStart.FORKED if warm_replacements and cfg.warm_starts else ReplacementStart.FRESH


def _checkpoint_dir(cfg: TrialConfig, work: Path) -> Path:
    """Where the checkpoint baseline's checkpoints are: its own run's, or the faulted run's when that
    run kept no peer copies (it was the baseline)."""
    return work / ("checkpoints" if cfg.peer_copies == 0 else "checkpoint-run-checkpoints")


def _same_loss_baseline(
    cfg: TrialConfig, faults: tuple[Fault, ...], outcomes: list[RankOutcome], started: int, out_dir: Path
) -> TrialResult:
    """One run's outcomes and events as a result of their own (for their recoveries and downtime)."""
    records = {k: v for o in outcomes for k, v in o.fault_records.items()}
    return TrialResult(
        cfg, faults, [], outcomes, None, records, True, [], started, "", faulted_events=read_rank_events(out_dir)
    )


def _checkpoint_run(
    cfg: TrialConfig,
    workload: str,
    work: Path,
    faults: tuple[Fault, ...],
    netns: NetnsPair | None,
    stores: dict[str, int] | None,
    rec: RecordingWriter,
    warm: ForkServer | Callable[[int], ForkServer] | None,
    supply: ReplacementSupply,
    warm_replacements: bool,
) -> TrialResult:
    """The checkpoint-restore baseline of a trial whose faults cost processes: the same faults at
    the same steps, the replacements started as in the faulted run (warm spares or not), but no
    peer copies, so every lost rank's state comes back from the last checkpoint."""
    outcomes, started, _ = _run(
        cfg,
        workload,
        "checkpoint",
        work,
        faults,
        {"peer_copies": 0, "spares": cfg.spare_ranks, "checkpoint_dir": str(_checkpoint_dir(cfg, work))},
        netns,
        stores,
        rec,
        warm,
        supply,
        warm_replacements,
    )
    return _same_loss_baseline(cfg, faults, outcomes, started, work / "checkpoint")


def _excisions_of(events: list[Event]) -> list[ExcisionPlan]:
    """Each excision the faulted run decided (refused ones included): the step and the lost ranks."""
    seen: dict[int, ExcisionPlan] = {}
    for ev in events:
        if ev.event == EventKind.DECIDED and ev.data.get("policy") == Policy.EXCISE.value:
            seen.setdefault(int(ev.data["round"]), ExcisionPlan(int(ev.data["step"]), tuple(ev.data["lost"])))
    return [seen[k] for k in sorted(seen)]


def _excising_reference(
    cfg: TrialConfig,
    workload: str,
    work: Path,
    plan: list[ExcisionPlan],
    survivors: list[RankOutcome],
    unfailed_dir: Path,
    forkserver: ForkServer | Callable[[int], ForkServer] | None = None,
) -> ExcisionResult:
    """Run :func:`~meshpact.live.trials.drills.excision_drill` in reference mode (no fault:
    each lost rank hands over its copy and leaves before the step the faulted run excised it
    at) and compare every survivor's final state with it bitwise; the survivors' whole tensors
    are also compared with the never-failed reference (largest absolute difference)."""
    import torch

    from ..recovery.reshard import assemble_full, max_abs_diff

    out = work / "excising-reference"
    out.mkdir(parents=True, exist_ok=True)
    control = host_store("127.0.0.1", 0, cfg.ranks)
    env = {
        "MESHPACT_CONTROL_ADDR": "127.0.0.1",
        "MESHPACT_CONTROL_PORT": str(control.port),
        "MESHPACT_RUN_ID": "excising-reference",
        "MESHPACT_VENDOR": "cpu",
    }
    args = {
        "workload": workload,
        "steps": cfg.steps,
        "out_dir": str(out),
        "excisions": [{"step": p.step, "rank": r} for p in plan for r in p.lost],
        "data_timeout_s": cfg.recovery().group_create_s,
        "min_ranks": cfg.min_ranks,
        "checkpoint_dir": str(out / "checkpoints"),
    }
    server = forkserver(0) if callable(forkserver) else forkserver
    with AgentJob(
        EXCISION_WORKER,
        cfg.ranks,
        args,
        timeout_s=cfg.deadline_s,
        env=lambda r: env,
        control=("127.0.0.1", control.port),
        run_id="excising-reference",
        forkserver=server,
    ) as job:
        results = job.run().results
    del control
    bad = [r for r in results if not r.ok]
    if bad:
        raise LaunchError(
            f"excising reference: rank {bad[0].rank} exited with {bad[0].returncode}; its stderr ends:"
            f"\n{bad[0].stderr_tail}"
        )
    mismatches = []
    for o in survivors:
        a = torch.load(out / f"final-rank{o.rank}.pt", weights_only=True)
        b = torch.load(work / "faulted" / f"final-rank{o.rank}.pt", weights_only=True)
        if a.keys() != b.keys():
            mismatches.append(
                f"rank {o.rank}: different tensors from the excising reference {sorted(set(a) ^ set(b))[:3]}"
            )
            continue
        mismatches += [
            f"rank {o.rank}: {k} differs from the excising reference" for k in a if not torch.equal(a[k], b[k])
        ]
    alive = survivors[0].alive or tuple(range(cfg.ranks))
    by_rank = {o.rank: o for o in survivors}
    diff = None
    if set(alive) <= set(by_rank) and all((unfailed_dir / f"final-rank{r}.pt").exists() for r in range(cfg.ranks)):
        excised = assemble_full([torch.load(work / "faulted" / f"final-rank{r}.pt", weights_only=True) for r in alive])
        unfailed = assemble_full(
            [torch.load(unfailed_dir / f"final-rank{r}.pt", weights_only=True) for r in range(cfg.ranks)]
        )
        diff = max_abs_diff(excised, unfailed)
    refused = next((o for o in survivors if o.excision_refused), None)
    if refused is not None:  # stopped before the last step: nothing to hold against the never-failed run
        diff = None
    return ExcisionResult(
        tuple(plan),
        not mismatches,
        mismatches,
        diff,
        refused.excision_refused if refused else None,
        refused.flushed_checkpoint if refused else None,
    )


def read_rank_events(out_dir: Path) -> list[Event]:
    """Every event of every rank process's log in ``out_dir`` (t: wall time)."""
    events = []
    for path in sorted(out_dir.glob("events-rank*.jsonl")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                events.append(Event.from_dict(json.loads(line), where=f"{path}:{lineno}"))
    return events


def _serve_stores_in(netns: NetnsPair) -> tuple[subprocess.Popen, dict[str, int]]:
    """Host the rendezvous and control stores inside the first namespace, on their own links."""
    cmd = [
        *netns.prefix(0),
        sys.executable,
        "-m",
        "meshpact.live.launch.launcher",
        "--serve-stores",
        f"{netns.data_ip[0]}:0",
        f"{netns.ctrl_ip[0]}:0",
    ]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().split() if proc.stdout else []
    if len(line) != 3 or line[0] != "PORTS":
        proc.kill()
        raise MeshpactError(f"the store host in {netns.ns[0]} did not start (said {line!r})")
    return proc, {"data_port": int(line[1]), "control_port": int(line[2])}
