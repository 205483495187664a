"""The live recovery runtime: ``with resilient(model, optimizer) as rt: rt.step(train_step, batch)``.

:func:`start_session` joins the job from torchrun's environment: it connects to the
rendezvous store and the control channel and builds the generation-0 data-path group (a
replacement process instead joins the recovery in progress). :class:`Resilient` wraps the
user's unchanged training step. When a communication fault escapes the step it:

1. *detection* — notes the fault and severs the broken group's sockets, so peers still
   waiting on this rank fail at once rather than at the data-path timeout;
2. *consensus* — agrees with every rank, over the control channel, on generation and
   committed step (:mod:`.consensus`); in memory only if all are alive and agree;
3. *communicator* — builds the next generation's group (new store namespace), or
   reconfigures in place where torch offers ``ProcessGroup.reconfigure``;
4. *rebinding* — points every cached reference at it (:mod:`.rebind`) and releases the old;
5. *state* — in memory: clears FSDP's half-finished step (unsharded parameters, pending
   collectives, gradients) and checks the digest taken at the commit; otherwise reloads the
   newest checkpoint;
6. *replay* — runs the steps lost since the restored state from buffered batches;

then re-runs the failed step from the same batch, so the final state is bit-identical to
a run without the fault. Every stage is timed and kept as an event for the recording.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from meshpact.core.recovery import CommunicatorAction, Policy, Stage, StateAction

from . import communicator as comm
from ..backends import choose_backend
from .checkpoint import Checkpointer
from .consensus import Decision, Proposal, agree
from .control import ControlChannel
from .faults import CollectiveFault, FaultInjector
from .harness import digest, load_local_state, local_state
from .opcount import OpCounter
from .rebind import rebind
from ..store import open_store

__all__ = ["RecoveryConfig", "Session", "start_session", "Resilient", "resilient", "is_comm_fault",
           "reset_step_state"]

_COMM_MARKERS = ("gloo", "nccl", "connection closed", "timed out", "connection reset", "broken pipe",
                 "socket", "peer", "collective")


@dataclass(frozen=True)
class RecoveryConfig:
    data_timeout_s: float = 1.0  # data-path operations: the bound on detecting a silent peer
    control_timeout_s: float = 20.0  # consensus waits (must cover a replacement process starting)
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    count_ops: bool = True
    digest_every_step: bool = True  # keep a digest of each commit, to prove the state intact
    vendor: str = field(default_factory=lambda: os.environ.get("MESHPACT_VENDOR", "cuda"))  # nccl where CUDA is
    prefer_reconfigure: bool = True  # use ProcessGroup.reconfigure where torch has it (2.14+)


def is_comm_fault(exc: BaseException) -> bool:
    """A failure of the data path (as opposed to a bug in the step)."""
    if isinstance(exc, (CollectiveFault, dist.DistError)):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in _COMM_MARKERS)


@dataclass
class Session:
    """One rank's place in the job: stores, control channel, current data-path group."""

    rank: int
    world_size: int
    config: RecoveryConfig
    store: Any
    control: ControlChannel
    spec: comm.GroupSpec
    group: dist.ProcessGroup | None
    generation: int
    incarnation: int
    mesh: Any = None
    protected_sockets: dict[int, str] = field(default_factory=dict)  # stores and control channel
    store_ports: tuple[int, ...] = ()  # the rendezvous store's and the control channel's
    events: list[dict[str, Any]] = field(default_factory=list)
    pending: Decision | None = None  # a replacement's decision, applied when resilient() starts
    log: Any = None  # an open JSONL file that receives every event as it happens (survives SIGKILL)

    def attach_log(self, path: str | os.PathLike[str]) -> None:
        import json

        self.log = open(path, "a", encoding="utf-8")
        for ev in self.events:
            self.log.write(json.dumps(ev, default=str) + "\n")
        self.log.flush()

    def emit(self, event: str, stage: Stage | None = None, **data: Any) -> None:
        ev = {"t_wall": time.time(), "rank": self.rank, "stage": stage.value if stage else None,
              "event": event, "data": data}
        self.events.append(ev)
        if self.log is not None:
            import json

            self.log.write(json.dumps(ev, default=str) + "\n")
            self.log.flush()
        if os.environ.get("MESHPACT_TRACE"):
            print(f"[meshpact rank {self.rank}] {ev}", file=sys.stderr, flush=True)

    def checkpointer(self) -> Checkpointer | None:
        if not self.config.checkpoint_dir:
            return None
        return Checkpointer(self.config.checkpoint_dir, self.rank, self.world_size, self.config.checkpoint_every)


_current: Session | None = None


def start_session(config: RecoveryConfig | None = None) -> Session:
    """Join the job described by torchrun's environment and build (or join) the data path."""
    global _current
    from torch.distributed.device_mesh import init_device_mesh

    config = config or RecoveryConfig()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = open_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                       is_host=(rank == 0 and not agent_store), timeout_s=120)
    control = ControlChannel.from_env(config.control_timeout_s)
    choice = choose_backend(config.vendor, int(os.environ.get("LOCAL_RANK", rank)))
    if choice.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(choice.device))
    spec = comm.GroupSpec(choice.backend.value, choice.device, rank, world, config.data_timeout_s,
                          connect_timeout_s=max(60.0, config.control_timeout_s))
    incarnation = int(os.environ.get("MESHPACT_INCARNATION", "0"))
    session = Session(rank, world, config, store, control, spec, None, 0, incarnation,
                      protected_sockets=comm.socket_fds(),
                      store_ports=(int(os.environ["MASTER_PORT"]), control.port))
    session.emit("session_start", backend=choice.to_dict(), incarnation=incarnation)
    if incarnation == 0:
        session.group = comm.build_group(spec, store, 0)
        comm.install_group(session.group, store, spec, as_default=True)
    else:  # a replacement: join the recovery in progress; its state comes from the checkpoint
        ckpt = session.checkpointer()
        t0 = time.perf_counter()
        decision = agree(control, lambda g: Proposal(rank, g, -1, "", False, incarnation),
                         ckpt.latest if ckpt else (lambda limit: 0))
        session.emit("decided", Stage.CONSENSUS, seconds=time.perf_counter() - t0, **_decision_data(decision))
        t0 = time.perf_counter()
        session.generation = decision.round
        session.group = comm.build_group(spec, store, decision.round)
        comm.install_group(session.group, store, spec, as_default=True)
        session.emit("rebuilt", Stage.COMMUNICATOR, seconds=time.perf_counter() - t0,
                     action=CommunicatorAction.REBUILD.value, generation=decision.round)
        session.pending = decision
    session.mesh = init_device_mesh(choice.device.split(":")[0], (world,))
    _current = session
    return session


def resume_barrier(session: Session, generation: int) -> float:
    """Wait (on the control channel) until every rank is ready to use ``generation``'s group;
    a rank that issued its first collective before a slower peer (a replacement still loading
    its checkpoint) arrived would otherwise time out on the data path. Returns seconds waited."""
    t0 = time.perf_counter()
    session.control.set(f"ready/g{generation}/rank{session.rank}", True)
    session.control.wait([f"ready/g{generation}/rank{r}" for r in range(session.world_size)])
    return time.perf_counter() - t0


def _decision_data(d: Decision) -> dict[str, Any]:
    return {"policy": d.policy.value, "round": d.round, "step": d.step, "reason": d.reason,
            "missing": list(d.missing)}


def reset_step_state(model: torch.nn.Module) -> None:
    """Undo what a failed step left behind in FSDP2: unsharded parameters, pending
    collectives, half-run hooks and gradients. The committed state is not touched."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    from .rebind import fsdp_states

    for state in fsdp_states(model):
        ctx = state._state_ctx
        ctx.iter_forward_root = None
        ctx.post_backward_final_callback_queued = False
        ctx.is_last_backward = True
        state._training_state = TrainingState.IDLE
        state._modules_to_run_forward.clear()
        cc = state._comm_ctx
        cc.all_gather_state = None
        cc.reduce_scatter_states.clear()
        cc.post_forward_order.clear()
        for group in state._fsdp_param_groups:
            group._training_state = TrainingState.IDLE
            group._all_gather_result = None
            group._post_forward_indices.clear()
            group._post_reduce_event = None
            group._reshard_after_forward_event = None
            _to_sharded(group)
            for fp in group.fsdp_params:
                if getattr(fp, "unsharded_accumulated_grad", None) is not None:
                    fp.unsharded_accumulated_grad = None
                unsharded = getattr(fp, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
    for p in model.parameters():
        p.grad = None


def _backend_of(pg: dist.ProcessGroup, device: str) -> Any:
    try:
        return pg._get_backend(torch.device(device))
    except RuntimeError:
        return None


def _seq(backend: Any) -> int:
    """Operations a backend has issued (its collective sequence number); compile-safe, free."""
    try:
        return int(backend._get_sequence_number_for_group()) if backend is not None else 0
    except RuntimeError:
        return 0


def _to_sharded(group: Any) -> None:
    """Put a param group back in its sharded state. FSDP frees the unsharded buffers on the
    way; buffers left by an all-gather that failed cannot always be resized, and are then
    kept (the next all-gather writes them whole) while the sharded parameters go back on
    the modules."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    try:
        group.reshard()
        return
    except RuntimeError:
        pass
    for fp in group.fsdp_params:
        fp._setattr_on_modules(fp.sharded_param)
        fp.sharded_state = ShardedState.SHARDED
    group._sharded_state = ShardedState.SHARDED


class Resilient:
    """Wraps a training step with in-memory recovery (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, session: Session | None = None,
                 injector: FaultInjector | None = None) -> None:
        session = session or _current
        if session is None:
            raise RuntimeError("no Meshpact session: call meshpact.live.recovery.runtime.start_session() first")
        self.model = model
        self.optimizer = optimizer
        self.session = session
        self.injector = injector
        self.committed_step = 0
        self.start_step = 0
        self.recoveries: list[dict[str, Any]] = []
        self.ckpt = session.checkpointer()
        self._batches: deque[tuple[int, Any, Callable[[Any], Any]]] = deque()
        self._digest = ""
        self.counter = OpCounter() if session.config.count_ops else None
        self.retired: list[dict[str, Any]] = []  # old groups: name, ops at retirement, weakref
        self.max_attempts = 8  # recoveries of one step before giving up

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> "Resilient":
        s = self.session
        if s.pending is not None:
            decision, s.pending = s.pending, None
            t0 = time.perf_counter()
            self._restore(decision.step)
            s.emit("reloaded", Stage.STATE, seconds=time.perf_counter() - t0,
                   action=StateAction.RELOAD_CHECKPOINT.value, checkpoint_step=decision.step)
            s.emit("ready", Stage.CONSENSUS, seconds=resume_barrier(s, decision.round), generation=decision.round)
        elif self.ckpt is not None and self.committed_step == 0 and not self.ckpt.complete(0):
            self.ckpt.save(0, local_state(self.model, self.optimizer))
        self.start_step = self.committed_step
        self._digest = self._state_digest()
        if self.counter is not None:
            self.counter.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.counter is not None:
            self.counter.__exit__(None, None, None)

    def _state_digest(self) -> str:
        return digest(local_state(self.model, self.optimizer)) if self.session.config.digest_every_step else ""

    @property
    def generation(self) -> int:
        return self.session.generation

    def op_counts(self) -> dict[str, int]:
        return self.counter.snapshot() if self.counter is not None else {}

    # -- the step --------------------------------------------------------------------------
    def step(self, train_step: Callable[[Any], Any], batch: Any) -> Any:
        """Run one training step; on a communication fault recover and run it again."""
        step = self.committed_step
        message: str | None = None
        for _ in range(self.max_attempts):
            try:
                if message is not None:
                    self._recover(message, step)
                    message = None
                if self.injector is not None:
                    with self.injector.around_step(step):
                        out = train_step(batch)
                else:
                    out = train_step(batch)
                break
            except Exception as exc:  # noqa: BLE001  (only data-path faults are handled)
                if not is_comm_fault(exc):
                    raise
                message = f"{type(exc).__name__}: {str(exc)[:300]}"
                traceback.clear_frames(exc.__traceback__)
                del exc
        else:
            raise RuntimeError(f"step {step} failed {self.max_attempts} times; last: {message}")
        self._commit(step, train_step, batch)
        return out

    def _commit(self, step: int, train_step: Callable[[Any], Any], batch: Any) -> None:
        for r in self.retired:  # a full step has run since these groups were retired: count, release
            if r["backend"] is not None:
                r["seq_ops_after"] = _seq(r["backend"]) - r["seq_at_retirement"]
                r["backend"] = None
        self.committed_step = step + 1
        self._digest = self._state_digest()
        self._batches.append((step, batch, train_step))
        if self.ckpt is not None and self.ckpt.due(self.committed_step):
            self.ckpt.save(self.committed_step, local_state(self.model, self.optimizer))
            self.session.emit("checkpoint", step=self.committed_step)
        if self.ckpt is not None:
            try:  # keep batches since the checkpoint before the newest complete one
                newest = self.ckpt.latest(self.committed_step)
                keep_from = self.ckpt.latest(newest - 1) if newest > 0 else 0
            except FileNotFoundError:
                keep_from = 0
            while self._batches and self._batches[0][0] < keep_from:
                self._batches.popleft()

    # -- recovery --------------------------------------------------------------------------
    def _recover(self, message: str, step: int, force: Policy | None = None) -> Decision:
        s = self.session
        t_detect = time.time()
        old = s.group
        t0 = time.perf_counter()
        severed = comm.sever(comm.data_sockets(s.protected_sockets, s.store_ports)) if old is not None else 0
        s.emit("detected", Stage.DETECTION, step=step, error=message, severed_sockets=severed,
               generation=s.generation, seconds=time.perf_counter() - t0)

        t0 = time.perf_counter()
        reset_step_state(self.model)  # sharded parameters back on the modules before anything reads them
        reset_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        intact = (self._state_digest() == self._digest) if s.config.digest_every_step else True
        mine = self._digest

        def proposal(group_generation: int) -> Proposal:
            drill = self.committed_step if force is Policy.CHECKPOINT_RESTORE else None
            return Proposal(s.rank, s.generation, self.committed_step, mine, intact, s.incarnation, drill)

        decision = agree(s.control, proposal, self.ckpt.latest if self.ckpt else (lambda limit: 0))
        s.emit("decided", Stage.CONSENSUS, seconds=time.perf_counter() - t0, **_decision_data(decision))
        if not decision.in_memory and self.ckpt is None:
            raise RuntimeError(f"cannot recover in memory ({decision.reason}) and no checkpoint directory is set")

        t0 = time.perf_counter()
        action = comm.choose_action(old, s.spec.device, prefer_reconfigure=s.config.prefer_reconfigure)
        note = ""
        new = old
        if action is CommunicatorAction.RECONFIGURE:  # torch 2.14+: same object, rebuilt in place
            try:
                old.reconfigure(dist.PrefixStore(comm.store_prefix(decision.round), s.store), s.rank, s.world_size)
            except (TypeError, RuntimeError) as exc:  # an API this code does not know: rebuild instead
                note, action = f"reconfigure refused ({exc}); rebuilt instead", CommunicatorAction.REBUILD
        if action is not CommunicatorAction.RECONFIGURE:
            new = comm.build_group(s.spec, s.store, decision.round)
            comm.install_group(new, s.store, s.spec, as_default=False)
        s.emit("rebuilt", Stage.COMMUNICATOR, seconds=time.perf_counter() - t0, action=action.value,
               generation=decision.round, backend=s.spec.backend, note=note)

        t0 = time.perf_counter()
        report = rebind(old, new, self.model, self.optimizer, [s.mesh]) if new is not old else None
        rebind_s = time.perf_counter() - t0
        s.group, s.generation = new, decision.round
        old_ops = self.counter.counts.get(old.group_name, 0) if self.counter is not None else None
        if new is not old:
            backend = _backend_of(old, s.spec.device)
            self.retired.append({"group": old.group_name, "ops_at_retirement": old_ops, "ref": weakref.ref(old),
                                 "backend": backend, "seq_at_retirement": _seq(backend), "seq_ops_after": None})
        s.emit("rebound", Stage.REBINDING, seconds=rebind_s, references=report.counts if report else {},
               old_group=old.group_name, new_group=new.group_name)
        del old

        t0 = time.perf_counter()
        if decision.in_memory:
            s.emit("retained", Stage.STATE, seconds=reset_s, action=StateAction.RETAIN.value,
                   digest_intact=intact)
            lost = 0  # no barrier: building the group already waited for every rank to connect
        else:
            self._restore(decision.step)
            s.emit("reloaded", Stage.STATE, seconds=reset_s + time.perf_counter() - t0,
                   action=StateAction.RELOAD_CHECKPOINT.value, checkpoint_step=decision.step)
            s.emit("ready", Stage.CONSENSUS, seconds=resume_barrier(s, decision.round), generation=decision.round)
            t0 = time.perf_counter()
            lost = self._replay(decision.step, step)
            s.emit("replayed", Stage.REPLAY, seconds=time.perf_counter() - t0, steps=lost)
        record = {"step": step, "t_detect_wall": t_detect, "t_resumed_wall": time.time(),
                  "policy": decision.policy.value, "reason": decision.reason, "generation": decision.round,
                  "lost_steps": lost, "rebind_s": rebind_s, "action": action.value, "drill": force is not None}
        self.recoveries.append(record)
        s.emit("recovery_done", **record)
        return decision

    def _restore(self, step: int) -> None:
        assert self.ckpt is not None
        load_local_state(self.model, self.optimizer, self.ckpt.load(step))
        self.committed_step = step

    def _replay(self, from_step: int, to_step: int) -> int:
        """Re-run the buffered steps ``[from_step, to_step)`` (the ones lost to the restore)."""
        todo = [(st, b, fn) for st, b, fn in self._batches if from_step <= st < to_step]
        if [st for st, _, _ in todo] != list(range(from_step, to_step)):
            raise RuntimeError(f"cannot replay steps {from_step}..{to_step - 1}: batches for "
                               f"{sorted(set(range(from_step, to_step)) - {st for st, _, _ in todo})} are gone")
        for st, b, fn in todo:
            fn(b)
            self.committed_step = st + 1
        self._digest = self._state_digest()
        return len(todo)

    def drill_checkpoint_restore(self) -> Decision:
        """A real checkpoint restore in this job, now: consensus, new group, reload, replay."""
        return self._recover("drill: checkpoint restore in job", self.committed_step, force=Policy.CHECKPOINT_RESTORE)


def resilient(model: torch.nn.Module, optimizer: torch.optim.Optimizer, session: Session | None = None,
              injector: FaultInjector | None = None) -> Resilient:
    """``with resilient(model, optimizer) as rt: rt.step(train_step, batch)``."""
    return Resilient(model, optimizer, session, injector)
