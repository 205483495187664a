"""A recovery as a pipeline: six typed steps whose result is the next generation.

Each step is a function of the job (:class:`Job`: the runtime, :class:`~meshpact.live.recovery.runtime.Resilient`)
and of what the steps before it returned; :meth:`Resilient._recover` calls them in this order:

| step | takes | returns | what it does |
|---|---|---|---|
| :func:`detect` | :class:`Cause` | :class:`Detection` | severs the data path's sockets (peers still waiting on this rank fail at once), takes the heartbeat's alarm, puts FSDP's half-run step back, checks the state against its commit, says what the standby can do |
| :func:`agree_on` | :class:`Detection` | :class:`~.consensus.Decision` | consensus over the control channel on the generation, the step and the policy (:mod:`.consensus`) |
| :func:`rebuild` | the decision | :class:`Rebuilt` | the next generation's groups: the standby swapped in, or built now, or reconfigured in place |
| :func:`rebind` | :class:`Rebuilt` | :class:`Rebound` | every cached reference pointed at the new groups (:mod:`.rebind`), the old ones retired, the session advanced to the new generation |
| :func:`restore` | the decision | — | the state: kept in memory, or a peer's copy of it, or the newest checkpoint |
| :func:`resume` | all of the above | :class:`RecoveryRecord` | every rank ready on the new groups, the first collective, the lost steps replayed, the peer copies refreshed |

Excision (:func:`excise_lost`) stands in for *rebuild*, *rebind* and *restore* when consensus
decides to continue without lost ranks: the survivors re-shard the lost ranks' state from
the peer copies over themselves, and the same :func:`resume` follows. A replacement process
that joined a recovery at start-up runs :func:`load_decided` and :func:`rejoin`, the tail of
the same path.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
import torch.distributed as dist

from meshpact.core.jsonform import JsonObject
from meshpact.core.recording import EventKind
from meshpact.core.recovery import CommunicatorAction, Policy, Stage, StateAction

from . import communicator as comm
from . import device, peers
from .blocks import BlockLog, Point
from .checkpoint import Checkpointer
from .consensus import CounterMoves, Decision, Proposal, agree
from .generation import Generation
from .heartbeat import Heartbeat, HeartbeatAlarm, recovering_key
from .opcount import OpCounter
from .rebind import ModuleScan, RebindReport, fsdp_states, meshes_of, rebind_all
from .refusal import without_checkpoint
from .reshard import ExcisionRecord, LeftWithReplica, Membership, carry_schedule, excise
from .session import Session, c10d_default, resume_barrier
from .state import Chunk, CommitMark, RngState, Schedule, StateCheck, load_job_state, restore_rng
from .stepreset import Leftovers, reset_step_state


__all__ = [
    "Job",
    "RecoveryRecord",
    "StageClock",
    "Cause",
    "Detection",
    "Rebuilt",
    "Rebound",
    "detect",
    "agree_on",
    "rebuild",
    "rebind",
    "restore",
    "resume",
    "excise_lost",
    "load_decided",
    "rejoin",
    "first_collective",
    "RetiredGroup",
    "retire_replaced",
]


class Job(Protocol):
    """What the pipeline reads and moves of a training job: the runtime
    (:class:`~meshpact.live.recovery.runtime.Resilient`) is one."""

    session: Session
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedulers: list[Any]
    build: Callable[[Any], tuple[torch.nn.Module, torch.optim.Optimizer]] | None
    min_ranks: int
    on_rank_loss: Policy
    membership: Membership
    heartbeat: Heartbeat | None
    peers: peers.PeerCopier | None
    ckpt: Checkpointer | None
    counter: OpCounter | None
    committed_step: int
    blocks: BlockLog  # the blocks run between steps since the oldest step a restore goes back to
    resume_at: int  # the block this rank stands in at its committed step (AT_STEP: at the step)
    skip_guards_before: Point | None  # a guarded block the loop reaches before this point is skipped
    mark: CommitMark | None  # what proves the state is the committed one
    rng: RngState  # the generators as committed
    schedule: Schedule  # the optimizer's schedule as committed
    t_attempt: float | None  # when the failed attempt of the step started
    train_step_fn: Callable[[Any], Any] | None
    meshes: Any  # every DeviceMesh alive when training started (a WeakSet)
    scan: ModuleScan
    counters: CounterMoves | None
    storage_bytes_read: int
    retired: list[RetiredGroup]
    recoveries: list[RecoveryRecord]
    excisions: list[ExcisionRecord]
    objects: dict[str, Any]  # the user's Stateful objects, by name

    def state(self) -> dict[str, torch.Tensor]: ...
    def chunks(self) -> dict[str, Chunk]: ...
    def check_state(self, params: Sequence[torch.nn.Parameter] | None = None) -> StateCheck: ...
    def job_groups(self) -> dict[str, dist.ProcessGroup]: ...
    def excise_refusal(self) -> str | None: ...
    def settle_counters(self) -> None: ...
    def mark_committed(self) -> None: ...
    def watch_optimizer(self) -> None: ...
    def restore(self, step: int) -> None: ...
    def replay(self, from_step: int, to_step: int, live: Point | None = None, mark: bool = True) -> int: ...
    def refresh_peers(self) -> None: ...
    def copy_to_peers(self, just_marked: bool = False) -> None: ...
    def adopt_departed(self, departed: Mapping[int, torch.Tensor]) -> None: ...
    def replace_model(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None: ...


@dataclass(frozen=True)
class RecoveryRecord:
    """One recovery of one rank."""

    step: int
    t_detect_wall: float  # this rank knew of the fault
    t_first_collective_wall: float  # this rank issued the first collective on the new group
    t_resumed_wall: float  # ... and completed it (after any replay): this rank runs on the new group
    policy: Policy
    reason: str
    generation: int
    lost_steps: int
    rebind_s: float
    action: CommunicatorAction
    drill: bool
    rebind_cpu_s: float = 0.0  # CPU time the main thread spent rebinding (its wall time less any wait for a core)
    cpu_s: float = 0.0  # CPU time of this rank's process (every thread) from knowing of the fault to resuming
    # cpu_s by pipeline step (they add up to it), and the main thread's share of each
    cpu_s_by_stage: Mapping[str, float] = field(default_factory=dict)
    thread_cpu_s_by_stage: Mapping[str, float] = field(default_factory=dict)
    # CPU of what the recovery leaves to the job once it runs again (its events written, the
    # consensus counters moved, peer copies refreshed): after t_resumed_wall, not in cpu_s
    after_resume_cpu_s: float = 0.0

    def to_dict(self) -> JsonObject:
        return {
            **asdict(self),
            "policy": self.policy.value,
            "action": self.action.value,
            "cpu_s_by_stage": dict(self.cpu_s_by_stage),
            "thread_cpu_s_by_stage": dict(self.thread_cpu_s_by_stage),
        }


class StageClock:
    """The CPU a recovery spends in each pipeline step, on this rank: the process's (every
    thread: the heartbeat's, gloo's, a standby's) and the main thread's. Each step ends with
    :meth:`lap`, which charges it everything since the previous lap, so the steps add up to
    the whole recovery's CPU whatever runs between them."""

    def __init__(self) -> None:
        self._cpu = time.process_time()
        self._thread = time.thread_time()
        self.cpu_s: dict[str, float] = {}
        self.thread_cpu_s: dict[str, float] = {}

    def lap(self, step: str) -> None:
        cpu, thread = time.process_time(), time.thread_time()
        self.cpu_s[step] = self.cpu_s.get(step, 0.0) + cpu - self._cpu
        self.thread_cpu_s[step] = self.thread_cpu_s.get(step, 0.0) + thread - self._thread
        self._cpu, self._thread = cpu, thread

    def since_lap(self) -> float:
        """The process's CPU seconds since the last lap (charged to no step)."""
        return time.process_time() - self._cpu


@dataclass(frozen=True)
class Cause:
    """What started a recovery: a fault escaping ``step``, or a drill asked for by name."""

    message: str
    step: int  # the step that failed: run again once recovered
    drill: bool = False  # a checkpoint-restore drill: not a fault, and its storage reads are not the job's


@dataclass(frozen=True)
class Detection:
    """What this rank knew once it stopped: when, what the heartbeat saw, its state's condition."""

    cause: Cause
    t_detect: float  # wall time this rank knew of the fault (the heartbeat's, if it knew first)
    clock: StageClock  # the CPU spent so far, by pipeline step
    t_check: float  # perf counter when the state check began (the consensus stage's start)
    alarm: HeartbeatAlarm | None
    states: tuple[Any, ...]  # the model's FSDP states, walked once per recovery
    params: tuple[Any, ...]  # the model's parameters after the reset (sharded), walked once per recovery
    reset_s: float  # seconds putting FSDP's half-run step back
    changed: str  # why the state is not the committed one ("" when it is)
    tensor_meshes: tuple[Any, ...] | None  # the meshes of the state's DTensors, where the commit's tensors hold it
    old_groups: Mapping[str, dist.ProcessGroup]  # every group of the job, by base name
    standby: comm.StandbyStatus  # this rank's word on its standby, carried in its proposal
    leftovers: Leftovers = field(default_factory=Leftovers)  # the failed attempt's buffers: let go once running again

    @property
    def intact(self) -> bool:
        return not self.changed


@dataclass(frozen=True)
class Rebuilt:
    """The next generation's groups, by base name, and how they were made."""

    groups: Mapping[str, dist.ProcessGroup]
    action: CommunicatorAction


@dataclass(frozen=True)
class Rebound:
    """What rebinding cost the training thread (zero where nothing was rebound), and the groups
    it replaced: retired (:func:`retire_replaced`) once the recovery resumed or failed, off its
    path (nothing reads their operation counts before the next commit)."""

    seconds: float
    cpu_s: float
    action: CommunicatorAction
    replaced: tuple[dist.ProcessGroup, ...] = ()


@dataclass
class RetiredGroup:
    """A group replaced in a recovery: its name, and the backend's sequence number when it was
    retired (the backend is kept only until the next commit, then released)."""

    name: str
    ref: "weakref.ref[dist.ProcessGroup]"
    backend: Any
    seq_at_retirement: int
    dispatch_ops_at_retirement: int | None
    seq_ops_after: int | None = None

    @property
    def alive(self) -> bool:
        return self.ref() is not None


# -- detect ----------------------------------------------------------------------------------
def _sever_timing(hb: Any, alarm: Any) -> dict[str, float]:
    """Where a rank told by its heartbeat spent the time from hearing of the fault to its step
    failing: the listener hearing of a peer's recovery (or the watch's look), the wait for the
    sever lock, the sever itself (a flush included), and the step's error reaching this thread."""
    with hb.session.sever_lock:  # a sever under way (its sockets shut: the step failed) has written its record
        sever = hb.last_sever
    if sever.alarm is not alarm:  # this alarm severed nothing (its generation had moved on)
        return {}
    flush = sever.severance
    return {
        "heartbeat_lock_wait_ms": round(sever.lock_wait_s * 1e3, 3),
        "heartbeat_sever_ms": round(sever.sever_s * 1e3, 3),
        "heartbeat_flush_end": flush.flush_end,
        "heartbeat_flush_unsent": flush.unsent,
        "heartbeat_flush_unread": flush.unread,
        "heartbeat_flush_ms": round(flush.flush_s * 1e3, 3),
        "heartbeat_flush_gap_ms": round(flush.gap_s * 1e3, 3),
        "heartbeat_flush_wake_ms": round(flush.wake_s * 1e3, 3),
        "heartbeat_alarm_to_severed_ms": round((sever.t_wall - alarm.t_wall) * 1e3, 3),
        "heartbeat_severed_to_raised_ms": round((time.time() - sever.t_wall) * 1e3, 3),
    }


def detect(rt: Job, cause: Cause) -> Detection:
    s = rt.session
    clock = StageClock()
    t_detect, t0 = time.time(), time.perf_counter()
    told = rt.heartbeat is not None and not cause.drill  # peers still in the step hear it from the control channel
    if rt.heartbeat is not None:
        rt.heartbeat.recovery_begins(s.generation)  # its listener sleeps through this recovery
        if told and not rt.heartbeat.told_of(s.generation):  # (a peer that told this rank told every member)
            # first: each peer's sever (its look for a message under way) runs beside this rank's own
            s.control.set_many(
                [recovering_key(s.generation, r) for r in s.members if r != s.rank],
                {"rank": s.rank, "step": cause.step, "block": rt.resume_at},
            )
    severed = s.sever_data_path(tell_peers=not told)  # the standby's sockets are not the data path's
    alarm = rt.heartbeat.take() if rt.heartbeat is not None else None
    if alarm is not None and (alarm.stalled or alarm.data_path_quiet):  # the heartbeat knew first
        t_detect = min(t_detect, alarm.t_wall)  # (it severed the sockets that raised)
    # a peer's recovery told this rank's heartbeat to sever: the rank knew when its step raised
    # (at once where it waited on the data path; on waking where it was stalled itself)
    s.emit(
        EventKind.DETECTED,
        Stage.DETECTION,
        step=cause.step,
        error=cause.message,
        severed_sockets=severed.sockets,
        flush_end=severed.flush_end,
        flush_ms=round(severed.flush_s * 1e3, 3),
        flush_gap_ms=round(severed.gap_s * 1e3, 3),
        flush_wake_ms=round(severed.wake_s * 1e3, 3),
        generation=s.generation,
        seconds=time.perf_counter() - t0,
        heartbeat_stalled=list(alarm.stalled) if alarm else [],
        heartbeat_quiet=bool(alarm and alarm.data_path_quiet),
        heartbeat_alarm=alarm is not None,
        heartbeat_detail=alarm.detail if alarm else "",
        heartbeat_look_age_s=t_detect - rt.heartbeat.last_look_wall if rt.heartbeat is not None else None,
        heartbeat_failed_looks=rt.heartbeat.failed_looks if rt.heartbeat is not None else 0,
        **(_sever_timing(rt.heartbeat, alarm) if alarm is not None and rt.heartbeat is not None else {}),
    )
    if rt.peers is not None:  # the copy in flight waits: the cores are the recovery's (until let_go)
        rt.peers.pause()
    t0 = time.perf_counter()
    states = fsdp_states(rt.model)  # the reset, the meshes and rebinding read them
    leftovers = Leftovers()  # nothing freed on the recovery's path (until let_go)
    params = reset_step_state(
        rt.model, states, leftovers
    )  # sharded parameters back on the modules before anything reads them
    reset_s = time.perf_counter() - t0
    t_check = time.perf_counter()
    checked = rt.check_state(params)
    # a step that waited out the data-path timeout may have lost a link the standby crosses too;
    # one that failed otherwise heard from its data path (or raised here), however long it ran
    silent_s = (
        t_detect - rt.t_attempt
        if rt.t_attempt is not None and not cause.drill and comm.timed_out(cause.message)
        else None
    )
    old_groups = rt.job_groups()  # consensus builds no group: the same ones are replaced after it
    word = s.standby_word(old_groups, silent_s, quiet=bool(alarm and alarm.data_path_quiet))
    clock.lap("detect")
    return Detection(
        cause,
        t_detect,
        clock,
        t_check,
        alarm,
        tuple(states),
        tuple(params),
        reset_s,
        checked.changed,
        checked.meshes,
        old_groups,
        word,
        leftovers,
    )


def let_go(rt: Job, d: Detection, model_replaced: bool = False) -> None:
    """What :func:`detect` held back from the recovery's path goes now: the failed attempt's
    buffers are freed and the paused peer copy ships on (``model_replaced``: an excision's new
    model, so the old one's kept unsharded buffers are freed too)."""
    d.leftovers.release(model_replaced)
    if rt.peers is not None:
        rt.peers.resume()


# -- agree -----------------------------------------------------------------------------------
def agree_on(rt: Job, d: Detection) -> Decision:
    """Consensus; the round's counter moves are left to :meth:`Resilient.settle_counters`, made
    once the job runs again (off the recovery's path)."""
    s = rt.session
    commit_check = rt.mark.check if rt.mark is not None and d.intact else ""
    standby = d.standby.to_dict()

    def proposal(group_generation: int) -> Proposal:
        held = s.peer_server.holds() if s.peer_server is not None else ()
        own = rt.peers.own_steps() if rt.peers is not None else ()
        refused = s.peer_server.dropped() if s.peer_server is not None else ()
        return Proposal(
            s.rank,
            s.generation,
            rt.committed_step,
            commit_check,
            d.intact,
            s.incarnation,
            rt.committed_step if d.cause.drill else None,
            holds=held,
            own_steps=own,
            host=s.host,
            standby=standby,
            refused=refused,
            block=rt.resume_at,
        )

    t_agree = time.perf_counter()
    rt.settle_counters()  # a recovery that failed before settling its counters settles them now
    got = agree(
        s.control,
        proposal,
        rt.ckpt.latest if rt.ckpt else (lambda limit: 0),
        max_rounds=s.config.max_rounds,
        peer_copies=(s.config.peer_copies or 0) if s.peer_server is not None else 0,
        replacement_rounds=s.config.replacement_rounds,
        on_rank_loss=rt.on_rank_loss,
        alive=s.members if s.excised else None,
        excise_refusal=rt.excise_refusal(),
        view=s.view,
        defer_counters=True,
    )
    rt.counters = got.counters
    t_end = time.perf_counter()
    s.emit(
        EventKind.DECIDED,
        Stage.CONSENSUS,
        seconds=t_end - d.t_check,
        agree_s=t_end - t_agree,
        state_changed=d.changed,
        **got.decision.summary(),
    )
    d.clock.lap("agree_on")
    return got.decision


# -- rebuild ---------------------------------------------------------------------------------
def rebuild(rt: Job, d: Detection, decision: Decision) -> Rebuilt:
    """The next generation's groups: the standby's where every rank's is ready, else built now
    (or reconfigured in place where torch offers ``ProcessGroup.reconfigure``). Called under
    the session's sever lock, with :func:`rebind`."""
    s = rt.session
    t0 = time.perf_counter()
    action = comm.choose_action(s.group, s.spec.device, prefer_reconfigure=s.config.prefer_reconfigure)
    note = ""
    standby_groups, standby = s.standby_verdict(decision)
    if standby_groups is not None:  # built and exercised in the background: swapped in
        action = CommunicatorAction.REBUILD
    groups: Mapping[str, dist.ProcessGroup] = d.old_groups
    if action is CommunicatorAction.RECONFIGURE:  # torch 2.14+: same objects, rebuilt in place
        try:
            before = comm.socket_fds()  # the same groups, new sockets: theirs from now on
            for base in comm.build_order(d.old_groups, s.groups):
                pg = d.old_groups[base]
                ranks = comm.group_ranks(pg)
                pg.reconfigure(  # type: ignore[attr-defined]  # newer torch's; asked for with can_reconfigure
                    dist.PrefixStore(comm.store_prefix(s.spec.run_id, decision.generation, base), s.store),
                    ranks.index(s.rank),
                    len(ranks),
                )
            s.data_path.record((pg.group_name for pg in d.old_groups.values()), comm.opened_since(before))
        except (TypeError, RuntimeError) as exc:  # an API this code does not know: rebuild instead
            note, action = f"reconfigure refused ({exc}); rebuilt instead", CommunicatorAction.REBUILD
    if standby_groups is not None:
        groups = standby_groups
    elif action is not CommunicatorAction.RECONFIGURE:
        # in the order a replacement builds them: its session's at start-up, then the user's (comm.build_order)
        before = comm.socket_fds()  # what gloo opens while building them is the new data path's
        groups = {
            base: comm.build_group(s.spec, s.store, decision.generation, base, comm.group_ranks(d.old_groups[base]))
            for base in comm.build_order(d.old_groups, s.groups)
        }
        s.data_path.record((pg.group_name for pg in groups.values()), comm.opened_since(before))
    s.emit(
        EventKind.REBUILT,
        Stage.COMMUNICATOR,
        seconds=time.perf_counter() - t0,
        action=action.value,
        generation=decision.generation,
        backend=s.spec.backend,
        groups=len(groups),
        note=note,
        standby=standby,
    )
    d.clock.lap("rebuild")
    return Rebuilt(groups, action)


# -- rebind ----------------------------------------------------------------------------------
def rebind(rt: Job, d: Detection, decision: Decision, rebuilt: Rebuilt) -> Rebound:
    """Point every cached reference at the new groups and advance the session to the new
    generation (under the sever lock, with :func:`rebuild`); the old groups are retired."""
    s = rt.session
    t0, c0 = time.perf_counter(), time.thread_time()
    counts: dict[str, int] = {}
    site_ms: dict[str, float] = {}
    reconfigured = rebuilt.action is CommunicatorAction.RECONFIGURE
    if not reconfigured:
        meshes = list(
            {
                id(m): m
                for m in (
                    s.mesh,
                    *meshes_of(rt.model, rt.optimizer, list(d.states), d.params, d.tensor_meshes),
                    *rt.meshes,
                )
            }.values()
        )
        report: RebindReport = rebind_all(
            [(old, rebuilt.groups[base]) for base, old in d.old_groups.items()],
            rt.model,
            rt.optimizer,
            meshes,
            functions=() if rt.train_step_fn is None else (rt.train_step_fn,),
            scan=rt.scan,
            states=list(d.states),
        )
        counts = dict(report.counts)
        site_ms = {k: round(v * 1e3, 3) for k, v in report.site_s.items()}
        for line in report.unrebound:  # a frame's local: the user is told, by group name
            s.emit(EventKind.REBOUND, Stage.REBINDING, warning=line)
        c10d_default(rebuilt.groups[comm.WORLD])
    seconds, cpu_s = time.perf_counter() - t0, time.thread_time() - c0
    # the session's own groups, now the new ones; the mesh object is the same, rebound in place
    s.advance(
        replace(
            s.gen,
            number=decision.generation,
            groups={base: pg for base, pg in rebuilt.groups.items() if base in s.groups},
        )
    )
    s.emit(
        EventKind.REBOUND,
        Stage.REBINDING,
        seconds=seconds,
        references=counts,
        site_ms=site_ms,
        old_groups=sorted(g.group_name for g in d.old_groups.values()),
        new_groups=sorted(g.group_name for g in rebuilt.groups.values()),
    )
    d.clock.lap("rebind")
    return Rebound(seconds, cpu_s, rebuilt.action, () if reconfigured else tuple(d.old_groups.values()))


def retire_replaced(rt: Job, rebound: Rebound) -> None:
    """Retire the groups a recovery replaced, once it resumed or failed (no operation reached
    them since rebinding: their counts are as they were then)."""
    dispatch = rt.counter.counts if rt.counter is not None else None
    for old in rebound.replaced:
        retire(rt, old, dispatch.get(old.group_name, 0) if dispatch is not None else None)
    # a NCCL communicator's destructor does not abort it: a replaced one would keep its device memory and threads
    device.abort_groups(rebound.replaced, rt.session.spec.backend)


def retire(rt: Job, old: dist.ProcessGroup, dispatch_ops: int | None) -> None:
    """Keep a replaced group's backend and its operation count until the next commit (which
    reads how many operations it issued after this)."""
    backend = comm.backend_of(old, rt.session.spec.device)
    rt.retired.append(
        RetiredGroup(old.group_name, weakref.ref(old), backend, comm.sequence_number(backend), dispatch_ops)
    )


# -- restore ---------------------------------------------------------------------------------
def restore(rt: Job, d: Detection, decision: Decision) -> None:
    """This rank's state at the decided step: kept in memory where it is the committed one, else
    from host memory (its own snapshot or a holder's copy), else from the newest checkpoint."""
    s = rt.session
    if decision.in_memory:
        s.emit(
            EventKind.RETAINED, Stage.STATE, seconds=d.reset_s, action=StateAction.RETAIN.value, state_intact=d.intact
        )
    elif (
        decision.policy is Policy.PEER_RESTORE
        and decision.holder_of(s.rank) is None
        and decision.step == rt.committed_step
        and d.intact
    ):
        # the generators as committed: the failed step may have drawn from them (on an N-D mesh a
        # rank whose own shard group lives runs its forward's dropout before the lost rank's
        # collective fails it), and the replay takes them as the committed ones
        restore_rng(rt.rng)
        s.emit(
            EventKind.RETAINED,
            Stage.STATE,
            seconds=d.reset_s,
            action=StateAction.RETAIN.value,
            state_intact=d.intact,
            checkpoint_step=decision.step,
        )
    else:
        load_decided(rt, decision, counts_as_read=not d.cause.drill, spent_s=d.reset_s)
    d.clock.lap("restore")


def load_decided(rt: Job, decision: Decision, counts_as_read: bool = True, spent_s: float = 0.0) -> None:
    """Load the state the decision names: a peer restore from host memory, or the checkpoint
    (its bytes counted as the job's storage reads unless ``counts_as_read`` is off: a drill)."""
    s = rt.session
    t0 = time.perf_counter()
    if decision.policy is Policy.PEER_RESTORE:
        got = peer_restore(rt, decision)
        s.emit(
            EventKind.RELOADED,
            Stage.STATE,
            seconds=spent_s + time.perf_counter() - t0,
            action=StateAction.PEER_RECOVER.value,
            checkpoint_step=decision.step,
            holder=got.holder,
            bytes=got.bytes,
            refused=list(got.refused),
        )
        return
    if rt.ckpt is None or decision.step < 0:  # a replacement says what the survivors say
        raise without_checkpoint(decision.reason, rt.ckpt is not None)
    read = rt.ckpt.bytes_read
    rt.restore(decision.step)
    if counts_as_read:
        rt.storage_bytes_read += rt.ckpt.bytes_read - read
    s.emit(
        EventKind.RELOADED,
        Stage.STATE,
        seconds=spent_s + time.perf_counter() - t0,
        action=StateAction.RELOAD_CHECKPOINT.value,
        checkpoint_step=decision.step,
    )


@dataclass(frozen=True)
class PeerRestored:
    """Where a peer restore took this rank's state from: ``holder`` (this rank: its own snapshot),
    the bytes fetched over the network, and each copy refused before it (holder and why)."""

    holder: int
    bytes: int = 0
    refused: tuple[str, ...] = ()


def holders_in_order(decision: Decision, rank: int, step: int) -> tuple[int, ...]:
    """The ranks holding ``rank``'s copy of ``step``, as their proposals said: the one the decision
    names first, then the others in rank order (a copy refused falls back to the next)."""
    named = decision.holder_of(rank)
    others = dict(decision.alternates).get(rank, ()) if step == decision.step else ()
    return tuple([named] if named is not None else []) + tuple(h for h in others if h != named)


def peer_restore(rt: Job, decision: Decision) -> PeerRestored:
    """Load this rank's state at ``decision.step`` from host memory: its own snapshot, or the
    copy the decision's holder keeps; a copy refused (its digest fails, it is malformed, its
    holder is gone) falls back to the next holder, and :class:`~.peers.PeerError` naming every
    refusal is raised when none is left (the next round finds no copy and restores the checkpoint)."""
    s = rt.session
    if rt.peers is None:
        raise RuntimeError("a peer restore was decided but this rank keeps no peer copies")
    step, holder = decision.step, decision.holder_of(s.rank)
    got = PeerRestored(s.rank)
    if step in rt.peers.own:
        state = rt.peers.own[step]
    elif holder is None or holder == s.rank:
        raise RuntimeError(
            f"a peer restore to step {step} was decided but rank {s.rank} keeps "
            f"only steps {rt.peers.own_steps()} and was named no holder"
        )
    else:
        state, fetched, holder, refused = peers.fetch_first(
            rt.peers.addresses,
            s.rank,
            step,
            holders_in_order(decision, s.rank, step),
            s.config.peer_copy_timeout_s,
            key=rt.peers.key,
        )
        got = PeerRestored(holder, fetched, refused)
        rt.peers.own[step] = state
    load_job_state(
        rt.model,
        rt.optimizer,
        state,
        rt.schedulers,
        rt.objects,
        source=f"rank {s.rank}'s copy of step {step} from rank {got.holder}",
    )
    rt.committed_step = step
    rt.mark_committed()
    rt.peers.keep_only(step)
    return got


# -- excise: rebuild, rebind and restore for a smaller world -----------------------------------
def excise_lost(rt: Job, d: Detection, decision: Decision) -> Rebound:
    """Continue without ``decision.lost``: this survivor's state (rolled back to its own
    snapshot where the group went back a step) and the copies it holds of the lost ranks,
    re-sharded over the survivors; the session advances to the smaller world, whose
    checkpoints start at the excision's step. Below ``min_ranks`` survivors
    :class:`~.reshard.ExcisionRefused` (the state flushed to a checkpoint) ends the job."""
    s = rt.session
    assert rt.build is not None
    let_go(rt, d, model_replaced=True)  # a re-shard is work per byte anyway: nothing is held through it
    s.drop_standby()  # built for the larger world: none serves the survivors
    if decision.step != rt.committed_step or not d.intact:  # back to its own snapshot: memory, no storage
        if rt.peers is None or decision.step not in rt.peers.own:
            raise RuntimeError(
                f"excision at step {decision.step} was decided but rank {s.rank} keeps only "
                f"steps {rt.peers.own_steps() if rt.peers else ()} and committed {rt.committed_step}"
            )
        load_job_state(
            rt.model, rt.optimizer, rt.peers.own[decision.step], rt.schedulers, rt.objects
        )  # generators included
        rt.committed_step = decision.step
        rt.mark_committed()
    else:  # the generators as committed (the failed step may have drawn from them)
        restore_rng(rt.rng)
    held = {r: s.peer_server.held(r, decision.step) for r, h in decision.restore_from if h == s.rank}
    # nothing held for the larger world is needed past this point: the lost ranks' copies live on in
    # ``held`` until re-sharded, the others' and this rank's own snapshots are of the old layout
    # (new ones follow the first commit): their memory goes back before the new model is built
    for src, _ in s.peer_server.holds():
        s.peer_server.forget(src)
    if rt.peers is not None:
        rt.peers.release_own()
    shape = tuple(getattr(s.mesh, "shape", ()) or ())  # a 2-D (HSDP) mesh is excised by whole replicas
    with s.sever_lock:  # a late sever by the heartbeat never reaches the smaller world's new group
        # below min_ranks this raises ExcisionRefused (one line, the flushed checkpoint named), and on a rank
        # of a replica that leaves LeftWithReplica: the caller's to report
        before = comm.socket_fds()  # what the smaller world's groups open is its data path, nothing else
        try:
            out = excise(
                rt.state(),
                held,
                Membership(s.world_size, s.members),
                decision.lost,
                step=decision.step,
                spec=s.spec,
                store=s.store,
                generation=decision.generation,
                build=rt.build,
                old_group=s.group,
                min_ranks=rt.min_ranks,
                checkpoint_dir=str(rt.ckpt.directory) if rt.ckpt is not None else None,
                shape=shape,
                names=s.mesh_names if len(shape) > 1 else None,
            )
        except LeftWithReplica as exc:  # this rank builds no group: it leaves, the other replicas go on
            s.emit(
                EventKind.REBUILT,
                Stage.COMMUNICATOR,
                generation=decision.generation,
                groups=0,
                world=0,
                left_with_replica=str(exc),
            )
            raise
        s.data_path.record((pg.group_name for pg in out.groups.values()), comm.opened_since(before))
        rec = out.record
        s.emit(
            EventKind.REBUILT,
            Stage.COMMUNICATOR,
            seconds=rec.communicator_s,
            action=rec.action.value,
            generation=decision.generation,
            backend=s.spec.backend,
            groups=len(out.groups),
            world=rec.new_world,
            mesh=list(out.shape),
        )
        rt.replace_model(out.model, out.optimizer, decision.step)
        if rt.heartbeat is not None:  # a model built anew warms up again: no stall bound from the old one's steps
            rt.heartbeat.warm_up_again()
        rt.membership = out.membership
        rt.schedulers = carry_schedule(rt.schedule, rt.optimizer)  # the survivor's, as committed
        rt.adopt_departed(out.departed)  # the lost ranks' registered objects (data positions) continue here
        for old in d.old_groups.values():
            retire(rt, old, None)
        device.abort_groups(d.old_groups.values(), s.spec.backend)  # on NCCL: as retire_replaced does
        s.advance(
            Generation(
                decision.generation,
                out.spec,
                dict(out.groups),
                out.mesh,
                out.membership.alive,
                f"world{out.membership.world}-from-step{decision.step}",
            )
        )
    rt.meshes = weakref.WeakSet([out.mesh])
    s.emit(
        EventKind.RELOADED,
        Stage.STATE,
        seconds=d.reset_s + rec.gather_s + rec.rebuild_s,
        action=StateAction.PEER_RECOVER.value,
        checkpoint_step=decision.step,
        holder=dict(decision.restore_from),
        excision=rec.to_dict(),
    )
    rt.excisions.append(rec)
    if rt.ckpt is not None:  # the smaller world's own checkpoints start at the excision's step
        rt.ckpt = s.checkpointer()
        assert rt.ckpt is not None
        rt.ckpt.save(rt.committed_step, rt.state(), rt.chunks())
    if s.config.check_commits:  # a new model: its mark is taken afresh
        rt.mark = CommitMark.take(rt.committed_step, rt.model, rt.optimizer)
    rt.watch_optimizer()  # and its optimizer watched; the generators stay as committed (excise undid build's draws)
    d.clock.lap("excise_lost")
    return Rebound(0.0, 0.0, rec.action)


# -- resume ----------------------------------------------------------------------------------
def resume(rt: Job, d: Detection, decision: Decision, rebound: Rebound) -> RecoveryRecord:
    """Back to training: the first collective on the new groups (after every rank is ready,
    where a state was loaded), the lost steps replayed, the peer copies refreshed, the
    consensus counters moved; the recovery's record."""
    s = rt.session
    if decision.in_memory:
        # no barrier: building the groups already waited for every rank to connect
        t_first, t_resumed = first_collective(rt, decision.generation)
        d.clock.lap("resume")
        let_go(rt, d)
        s.log.flush()
        # the blocks between steps that a rank further on ran and another is back at, run again (blocks.py)
        ran = rt.blocks.replayed
        t0 = time.perf_counter()
        lost = rt.replay(decision.step, d.cause.step, decision.resume_point, mark=False)
        if rt.blocks.replayed > ran or lost:
            t_resumed = time.time()
            s.emit(
                EventKind.REPLAYED,
                Stage.REPLAY,
                seconds=time.perf_counter() - t0,
                steps=lost,
                blocks=rt.blocks.replayed - ran,
            )
    else:
        t_first, _ = rejoin(rt, decision.generation)
        let_go(rt, d)
        t0 = time.perf_counter()
        ran = rt.blocks.replayed
        lost = rt.replay(decision.step, d.cause.step, decision.resume_point)
        s.emit(
            EventKind.REPLAYED,
            Stage.REPLAY,
            seconds=time.perf_counter() - t0,
            steps=lost,
            blocks=rt.blocks.replayed - ran,
        )
        t_resumed = time.time()
        d.clock.lap("resume")
        if rt.peers is not None:  # holders get this generation's state (a replacement's holder included)
            if decision.policy is Policy.EXCISE:  # the ring over the survivors
                rt.peers.replace_ring(s.members)
            rt.refresh_peers()
            rt.peers.keep_only(rt.committed_step)
            rt.copy_to_peers()
    rt.skip_guards_before = decision.furthest  # a guarded block a peer is past is skipped here too (blocks.py)
    rt.settle_counters()  # the job runs again: the round counters move now, off the recovery's path
    s.remember_data_path()  # this generation's sockets, listed before its standby starts building
    record = RecoveryRecord(
        d.cause.step,
        d.t_detect,
        t_first,
        t_resumed,
        decision.policy,
        decision.reason,
        decision.generation,
        lost,
        rebound.seconds,
        rebound.action,
        d.cause.drill,
        rebound.cpu_s,
        sum(d.clock.cpu_s.values()),
        dict(d.clock.cpu_s),
        dict(d.clock.thread_cpu_s),
        d.clock.since_lap(),
    )
    rt.recoveries.append(record)
    s.emit(EventKind.RECOVERY_DONE, **record.to_dict())
    s.start_standby(rt.job_groups())  # the generation after this one, built while training runs
    return record


def rejoin(rt: Job, generation: int) -> tuple[float, float]:
    """Wait until every rank is ready on ``generation``'s groups, then run the first collective
    on them (a rank that issued it before a slower peer finished loading its state would time out)."""
    rt.session.emit(
        EventKind.READY, Stage.CONSENSUS, seconds=resume_barrier(rt.session, generation), generation=generation
    )
    return first_collective(rt, generation)


def first_collective(rt: Job, generation: int) -> tuple[float, float]:
    """Run the first collective on the new world group (every rank at the same point); returns
    the wall times it was issued and completed."""
    s = rt.session
    t_first = time.time()
    comm.first_collective(s.group, s.spec.device)
    t_done = time.time()
    s.emit(
        EventKind.FIRST_COLLECTIVE,
        seconds=t_done - t_first,
        generation=generation,
        t_issued_wall=t_first,
        t_done_wall=t_done,
    )
    return t_first, t_done
