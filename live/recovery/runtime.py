"""The live recovery runtime: ``with resilient(model, optimizer, session) as rt: rt.step(train_step, batch)``.

:class:`Resilient` wraps the user's unchanged training step. At every commit it keeps what a
re-run needs: the committed step, a commit mark of the state (O(1) bytes hashed, see
:class:`~meshpact.live.recovery.state.CommitMark`), every random-number generator
(:class:`~meshpact.live.recovery.state.RngState`), the optimizer's schedule (its param
groups' settings and its LR schedulers' state, :class:`~meshpact.live.recovery.state.Schedule`)
and the model's persistent buffers (BatchNorm's statistics, which a failed forward moved).

When a communication fault escapes the step (:func:`is_comm_fault`: by type and by where it
was raised, never by its words) it recovers through the stages of :mod:`.pipeline` — detect,
agree, rebuild, rebind, restore, resume — whose result is the session's next generation; or,
where consensus decides to *excise* lost ranks (``on_rank_loss=Policy.EXCISE`` with a
``build(mesh)`` to make the smaller world's model), the survivors re-shard the lost ranks'
state from the peer copies over themselves and ``rt.model`` / ``rt.optimizer`` become the new
objects. The old model refuses any later forward with :class:`StaleModelError`. From then on
every batch is this survivor's share of the original global batch (:meth:`Resilient.share`),
its gradient weighted to keep the global mean.

Then it restores the generators and re-runs the failed step from the same batch, so the final
state, generators included, is bit-identical to a run without the fault. Any other exception
surfaces at once, unretried, with its traceback.

What entering :class:`Resilient` does to the process: it starts the heartbeat's thread and the
standby's builder, and it calls ``gc.freeze()`` (what exists then, most of the heap, is left
out of the garbage collector's scans, so no full collection falls inside a recovery;
``gc.unfreeze()`` on leaving). Objects are still freed by reference counting.
"""

from __future__ import annotations

import contextlib
import gc
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from meshpact.core.recording import EventKind
from meshpact.core.recovery import Policy, Stage

from meshpact.core.errors import MeshpactError

from . import communicator as comm
from . import peers, pipeline
from .blocks import AT_STEP, KEPT_STEPS, BlockLog, BlockRun, Point, point_order, replay_plan
from .consensus import CounterMoves, Decision, open_round
from .device import StepAborted, StepFence
from .faults import CollectiveFault, FaultInjector
from .heartbeat import Heartbeat
from .opcount import OpCounter
from .pipeline import Cause, RecoveryRecord, RetiredGroup
from .rebind import ModuleScan, function_key, meshes_of, module_groups as _groups_held
from .refusal import RecoveryImpossible, without_checkpoint
from .reshard import ExcisionRecord, GradientWeight, Membership, adopt_objects, share_batch
from .session import RecoveryConfig, Session, start_barrier
from .state import (
    CommitMark,
    StateCheck,
    capture_objects,
    capture_rng,
    capture_schedule,
    check_optimizer,
    check_stateful,
    job_state,
    load_buffers,
    SCHEDULE_CLASSES,
    instances_of,
    param_groups_of,
    load_job_state,
    model_buffers,
    restore_objects,
    restore_rng,
    restore_schedule,
    schedulers_of,
    Chunk,
    global_chunks,
)

__all__ = [
    "RecoveryConfig",
    "Session",
    "Resilient",
    "resilient",
    "is_comm_fault",
    "RecoveryRecord",
    "RetiredGroup",
    "COMM_FAULT_TYPES",
    "RAISED_IN_COMM_TYPES",
    "COMM_MODULES",
    "GuardedBlockLost",
    "StaleModelError",
    "CarriedGradientsError",
    "refuse_stale",
    "UnsafeLoopError",
    "LateSchedulerError",
    "ModelParts",
    "model_of",
]


T = TypeVar("T")


class StaleModelError(MeshpactError):
    """A training step ran the model an excision replaced: after an excision the step must use
    ``rt.model`` and ``rt.optimizer`` (the smaller world's), not a model kept from before."""


class UnsafeLoopError(MeshpactError):
    """The training loop keeps state that no commit, peer copy or checkpoint holds, so a
    recovery would resume without it, silently: refused at the commit that finds it."""


class CarriedGradientsError(UnsafeLoopError):
    """A step left gradients for the next one without stepping the optimizer (gradients
    accumulated over several ``rt.step`` calls): a recovery would resume without them and
    train on part of the batch."""


class GuardedBlockLost(MeshpactError):
    """A collective between steps (:meth:`Resilient.run`, :meth:`Resilient.guard`) failed and the
    job recovered, but the block cannot be run again on every rank: a rank was replaced (its new
    process resumes at the next ``rt.step``, not inside the block) or the block was a ``with``
    block. The block's result is lost on every rank alike; catch this to go on without it."""


class LateSchedulerError(UnsafeLoopError):
    """An LR scheduler or gradient scaler was made after ``resilient()`` was entered: its state
    is in no commit, so a recovery would leave it where the failed attempt put it and a
    replacement would start it anew."""


class ModelParts(torch.nn.ModuleList):
    """A pipeline stage's model parts as one module for the runtime (``rt.model``): the state,
    the commit mark, the peer copies and the checkpoints take every part's parameters, named
    ``<part>.<name>``; ``rt.model[i]`` is part ``i``, the user's own object."""


def model_of(model: torch.nn.Module | Sequence[torch.nn.Module]) -> torch.nn.Module:
    """What the runtime keeps as the model: ``model`` itself, or a list of model parts (pipeline
    parallel's stages on this rank) as :class:`ModelParts`; anything else is refused in one line
    naming why."""
    if isinstance(model, torch.nn.Module):
        return model
    if not isinstance(model, (list, tuple)):
        raise TypeError(
            f"resilient() takes a torch.nn.Module or a list of model parts (torch.nn.Module each), "
            f"got {type(model).__name__}"
        )
    if not model:
        raise ValueError("resilient() got an empty list of model parts: pass this rank's parts (at least one)")
    for i, part in enumerate(model):
        if not isinstance(part, torch.nn.Module):
            raise TypeError(f"model part {i} is {type(part).__name__}, not a torch.nn.Module")
    owner: dict[int, int] = {}
    for i, part in enumerate(model):
        for p in part.parameters():
            j = owner.setdefault(id(p), i)
            if j != i:
                raise ValueError(
                    f"model parts {j} and {i} share a parameter (the same part twice, one part inside "
                    "another, or tied weights across parts): each parameter must belong to one part, "
                    "or its state would be kept twice and restored once"
                )
    return ModelParts(model)


# exceptions that are communication faults wherever they were raised: torch's own distributed errors
# (a backend's, the network's, the store's) and the injector's
COMM_FAULT_TYPES: tuple[type[BaseException], ...] = (CollectiveFault, dist.DistError)
# exceptions that are communication faults when raised in torch's communication code (a backend's plain
# RuntimeError from a collective's wait); raised anywhere else (the user's data fetch, an HTTP client) they
# are the user's own. RuntimeError counts as that type alone: its subclasses name failures of their own
# (torch.OutOfMemoryError in FSDP2's all-gather buffers, NotImplementedError, RecursionError)
RAISED_IN_COMM_TYPES: tuple[type[BaseException], ...] = (RuntimeError, TimeoutError, ConnectionError)
_TORCH_DIST = str(Path(dist.__file__).parent)
COMM_MODULES: tuple[str, ...] = tuple(
    f"{_TORCH_DIST}/{m}"
    for m in (
        "distributed_c10d.py",
        "_functional_collectives.py",
        "_functional_collectives_impl.py",
        "fsdp/",
        "_composable/",
        "device_mesh.py",
        "tensor/_collective_utils.py",
        "tensor/_redistribute.py",
    )
)
_CHAIN_MOST = 8  # causes followed from an exception to the one it was raised from


def _raised_in_comm(exc: BaseException) -> bool:
    """``exc``'s innermost frame is in torch's communication code (:data:`COMM_MODULES`)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename.startswith(COMM_MODULES)


def _of_comm_type(exc: BaseException) -> bool:
    """``exc`` is of :data:`RAISED_IN_COMM_TYPES` (a plain ``RuntimeError``, not a subclass of it)."""
    return type(exc) is RuntimeError or isinstance(exc, tuple(t for t in RAISED_IN_COMM_TYPES if t is not RuntimeError))


def fault_message(exc: BaseException) -> str:
    """The line a communication fault is recovered with, its frames cleared first: they hold the failed
    attempt's tensors, which a recovery that kept them alive would hold through the next attempt."""
    message = f"{type(exc).__name__}: {str(exc)[:300]}"
    traceback.clear_frames(exc.__traceback__)
    return message


def is_comm_fault(exc: BaseException) -> bool:
    """A failure of the data path, as opposed to the user's own error: decided by construction,
    never by the words of the message. It is one when ``exc`` (or an exception it was raised from
    or while handling, a user's wrapper of a failed collective) is of :data:`COMM_FAULT_TYPES`
    wherever it was raised, or of :data:`RAISED_IN_COMM_TYPES` (a plain ``RuntimeError``) raised in torch's communication
    code (:data:`COMM_MODULES`). A ``TimeoutError`` or ``ConnectionError`` the user's own code
    raises (a data fetch, a metrics client) is not: it propagates unchanged and no recovery starts.
    Nor is a refusal (:class:`~.refusal.RecoveryImpossible`): another recovery would decide the same."""
    if isinstance(exc, RecoveryImpossible):
        return False
    seen: set[int] = set()
    at: BaseException | None = exc
    while at is not None and id(at) not in seen and len(seen) < _CHAIN_MOST:
        seen.add(id(at))
        if isinstance(at, COMM_FAULT_TYPES):
            return True
        if _of_comm_type(at) and _raised_in_comm(at):
            return True
        at = at.__cause__ or at.__context__
    return False


def unprotected_note(step: int) -> str:
    """The line added to a communication fault that left the ``with resilient(...)`` block: it was
    raised outside ``rt.step`` (an evaluation or logging collective between steps), where nothing
    recovers it."""
    return (
        f"meshpact: a collective failed outside rt.step at committed step {step}, where no recovery runs: "
        "protect collectives between steps with rt.run(fn) or `with rt.guard():`"
    )


@dataclass(frozen=True)
class _OptimizerHook:
    """The step pre-hook and post-hook on one optimizer (their handles, to remove them)."""

    optimizer: torch.optim.Optimizer
    handle: Any
    after: Any = None

    def remove(self) -> None:
        self.handle.remove()
        if self.after is not None:
            self.after.remove()


def _carried_gradients(model: torch.nn.Module, most: int = 16) -> list[str]:
    """Parameters with a nonzero gradient (the first, middle and last elements of at most
    ``most`` of them, on this rank): free when every gradient is None, as ``zero_grad()`` leaves them."""
    present = [(name, p.grad) for name, p in model.named_parameters() if p.grad is not None]
    out = []
    for name, grad in present[:most]:
        flat = getattr(grad, "_local_tensor", grad).detach().reshape(-1)
        n = flat.numel()
        if n and bool(torch.stack([flat[0], flat[n // 2], flat[n - 1]]).ne(0).any()):
            out.append(name)
    return out


def refuse_stale(model: torch.nn.Module, rank: int, step: int) -> None:
    """Make ``model`` (replaced by an excision at ``step``) raise :class:`StaleModelError` on
    any forward: a training step that kept it would otherwise train a model nobody reduces with."""

    def refuse(*_: Any) -> None:
        raise StaleModelError(
            f"rank {rank}: the training step ran the model from before the excision at step "
            f"{step}; after an excision use rt.model and rt.optimizer"
        )

    model.register_forward_pre_hook(refuse)


def device_meshes(objects: list[Any] | None = None) -> list[Any]:
    """Every live DeviceMesh of the process among ``objects`` (default: every one the collector
    holds, :func:`~.state.instances_of`; done once, when training starts): the session's, FSDP's,
    DTensors' and the user's own."""
    from torch.distributed.device_mesh import DeviceMesh

    return instances_of(DeviceMesh, objects=objects)


class Resilient:
    """Wraps a training step with in-memory recovery (see the module docstring).

    ``batches(step)`` is the batch source: replay after a checkpoint restore draws the lost
    steps' batches from it again. Without one, the batches since the second-newest
    checkpoint are kept in memory (a restarted process then cannot replay)."""

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        optimizer: torch.optim.Optimizer,
        session: Session,
        injector: FaultInjector | None = None,
        batches: Callable[[int], Any] | None = None,
        *,
        build: Callable[[Any], tuple[torch.nn.Module, torch.optim.Optimizer]] | None = None,
        on_rank_loss: Policy = Policy.PEER_RESTORE,
        min_ranks: int = 1,
        state: Mapping[str, Any] | None = None,
        state_of: Callable[[int], Mapping[str, Any]] | None = None,
    ) -> None:
        if on_rank_loss not in (Policy.PEER_RESTORE, Policy.EXCISE):
            raise ValueError(f"on_rank_loss must be peer_restore (replace) or excise, got {on_rank_loss.value}")
        if on_rank_loss is Policy.EXCISE and build is None:
            raise ValueError("excising lost ranks needs build(mesh) -> (model, optimizer) for the smaller world")
        if on_rank_loss is Policy.EXCISE and state and state_of is None:
            raise ValueError(
                f"excising lost ranks with registered objects ({', '.join(sorted(state))}) needs "
                "state_of=lambda rank: {...}: the survivors draw a lost rank's samples from its objects"
            )
        model = model_of(model)
        if isinstance(model, ModelParts) and on_rank_loss is Policy.EXCISE:
            raise ValueError(
                "excising lost ranks re-shards one model's Shard(0) parameters over the survivors; "
                "model parts are pipeline stages (other layers on other ranks): use "
                "on_rank_loss=Policy.PEER_RESTORE with model parts"
            )
        if not callable(getattr(optimizer, "register_step_pre_hook", None)):
            raise TypeError(
                f"resilient() needs a torch.optim.Optimizer (its step hook says when a step began), got "
                f"{type(optimizer).__name__}"
            )
        check_optimizer(optimizer)  # a state that cannot be read is refused here, in one line
        self.model = model
        self.optimizer = optimizer
        self.session = session
        self.injector = injector
        self.batches = batches
        self.committed_step = 0
        self.start_step = 0
        self.blocks = BlockLog()  # the blocks run between steps (rt.run, rt.guard) since the oldest step kept
        self.resume_at = AT_STEP  # the rt.run block this rank stands in (AT_STEP: at the step)
        self.skip_guards_before: Point | None = None  # the furthest point of the last recovery (blocks.py)
        self._in_block = False  # rt.run or rt.guard runs a block (or a recovery runs blocks again)
        self._saved: deque[int] = deque(maxlen=2)  # the steps of the two newest checkpoints this process saved
        self.recoveries: list[RecoveryRecord] = []
        self.ckpt = session.checkpointer()
        self._kept: deque[tuple[int, Any]] = deque()
        self.train_step_fn: Callable[[Any], Any] | None = None
        self.mark: CommitMark | None = None  # what proves the state is the committed one (check_commits)
        self.rng = capture_rng()
        self._buffers: dict[str, torch.Tensor] = {}
        self.schedulers: list[Any] = []  # the LR schedulers on the optimizer when training started
        self.objects = check_stateful(state or {})  # the user's Stateful objects, by name: committed with the step
        self.state_of = state_of  # another rank's objects, made here (an excision continues a lost rank's)
        self.schedule = capture_schedule(optimizer, (), self.objects)
        self.counter = OpCounter() if session.config.count_dispatch else None
        self.retired: list[RetiredGroup] = []
        self.meshes: "weakref.WeakSet[Any]" = weakref.WeakSet()  # every mesh alive when training started
        self.max_attempts = 8  # recoveries of one step before giving up
        self.heartbeat: Heartbeat | None = None
        self.peers: peers.PeerCopier | None = None
        if session.peer_server is not None:
            assert session.config.peer_copies is not None  # start_session settled it (RecoveryConfig.for_world)
            self.peers = peers.PeerCopier(
                session.rank,
                session.world_size,
                session.config.peer_copies,
                session.control,
                session.peer_server,
                session.config.peer_copy_timeout_s,
                session.config.peer_copy_depth,
                ops=session.ops,
            )
        self.storage_bytes_read = 0  # checkpoint bytes read by recoveries (drills and cold starts apart)
        self.on_decided: Callable[[Decision], None] | None = None  # sees each decision (fault drills use it)
        self.t_attempt: float | None = None  # when the running attempt of the step started
        self.build = build
        self.on_rank_loss: Policy = on_rank_loss
        self.min_ranks = min_ranks
        self.membership = Membership(session.world_size, session.members)
        self.weight: GradientWeight | None = None  # set on the model after the first excision
        self.excisions: list[ExcisionRecord] = []
        self.scan = ModuleScan()  # the modules rebinding reads, walked again only when sys.modules changes
        self.counters: CounterMoves | None = None  # consensus counter moves made once the job runs again
        # the optimizer's step began since the last commit: its state may be written in part
        # (an optimizer that all-reduces inside step(), after writing some tensors, fails there)
        self._optimizer_began = False
        self._optimizer_hook: Any = None
        # recorded on the training stream after the optimizer's step (by its post-hook), or when the
        # step returns where it ran none: the step is committed only once it is done (device order)
        self.fence: StepFence | None = None
        self._first_step = True  # schedulers and scalers made after __enter__, before the first step, are refused then
        self._in_step = False  # rt.step runs: rt.run and rt.guard inside it leave a fault to the step
        self.steps_run = 0  # steps this process ran to their end (a re-run after a recovery counts once)
        self.longest_step_s = 0.0  # the longest of them, the process's first apart (building, compiling)
        self._last_start: tuple[int, float, int] | None = None  # (step, its start, recoveries then) of the last step

    # -- context ---------------------------------------------------------------------------
    def __enter__(self) -> "Resilient":
        s = self.session
        # the walk takes a replacement a while under load: done before any barrier, so no peer
        # waits on a collective of the new group while this rank walks
        from torch.distributed.device_mesh import DeviceMesh

        # one walk: every mesh, LR scheduler and gradient scaler alive when training started
        objects = instances_of(DeviceMesh, *SCHEDULE_CLASSES)
        self.meshes = weakref.WeakSet(device_meshes(objects))
        self.schedulers = schedulers_of(self.optimizer, objects)
        del objects
        if self.peers is not None:
            self.refresh_peers()
        joined = s.joined.take()  # a replacement process: the recovery it joined at start-up
        if joined is not None:
            pipeline.load_decided(self, joined)
            pipeline.rejoin(self, joined.generation)
        elif self.ckpt is not None and self.committed_step == 0 and not self.ckpt.complete(0):
            self.ckpt.save(0, self.state(), self.chunks())
        self.start_step = self.committed_step
        self._saved.append(self.committed_step)
        self.blocks.keep_from(self.committed_step)  # a replacement ran no block before the step it starts at
        if joined is not None:
            self.skip_guards_before = joined.furthest
        self.mark_committed()
        if self.peers is not None:  # the starting state is held by peers before the first step
            self.copy_to_peers()
        # the checkpoint and the walk above take a rank a while under load; no rank issues its
        # first collective before every rank is here, or a slow one would look like a fault
        met = start_barrier(s, self.join_recovery)  # a rank lost during start-up: its replacement's round
        # what exists now (torch, the model, the job's modules: most of the heap) is left out of
        # the garbage collector's scans: a full collection over it lasts tens of milliseconds,
        # and one that falls inside a recovery is that recovery's tail. Objects are still freed
        # by reference counting; only cycles among them wait for unfreeze() on leaving
        gc.freeze()
        if not met:  # a recovery joined at the barrier started its own
            s.start_standby(self.job_groups())  # the next generation's groups, built while training runs
        if s.config.heartbeat:
            self.heartbeat = Heartbeat(s, COMM_MODULES).start()
        if self.counter is not None:
            self.counter.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None and not isinstance(exc, MeshpactError) and is_comm_fault(exc):
            exc.add_note(unprotected_note(self.committed_step))
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
        if self.peers is not None:
            self.peers.close()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.session.stop_standby()
        self.session.release_severed()
        if self.counter is not None:
            self.counter.__exit__(None, None, None)
        gc.unfreeze()

    def mark_committed(self) -> None:
        """What a re-run of the next step needs: the commit mark and the generators."""
        if self.session.config.check_commits:
            fence = self.fence if self.fence is not None and self.fence.step == self.committed_step - 1 else None
            self.mark = CommitMark.take(
                self.committed_step,
                self.model,
                self.optimizer,
                self.mark,
                self.session.ops,
                fence.event if fence is not None else None,
            )
        self.rng = capture_rng()
        self.schedule = capture_schedule(self.optimizer, self.schedulers, self.objects)
        # the persistent buffers as committed: a failed forward may have moved BatchNorm's statistics
        self._buffers = {f"buffer/{k}": v.detach().clone() for k, v in model_buffers(self.model).items()}
        self.watch_optimizer()
        self.scan.refresh()  # the modules rebinding reads, walked here where they changed, not in a recovery
        self.refresh_objects()

    def refresh_objects(self) -> list[str]:
        """Walk the job's objects for attributes holding a group (:class:`~.rebind.ObjectScan`),
        where a group was made or dropped or a root changed since the last walk: from the job's
        module globals, the model's modules, the objects registered with ``state=`` and the step
        function (at each commit, and before a step whose function reaches other objects: a few
        microseconds when nothing changed). Once the step function is known, a group c10d knows
        that nothing rebinding reads holds is warned of once (and logged). Returns those warnings."""
        groups = {pg.group_name: pg for pg in list(c10d._world.pg_map)}
        key = (
            tuple(sorted(groups)),
            id(self.model),
            function_key(self.train_step_fn),
            tuple(id(o) for o in self.objects.values()),
        )

        def roots() -> list[tuple[str, Any]]:
            own, _ = self.scan.modules()
            out: list[tuple[str, Any]] = [(name, d) for name, d in own]
            out += [(f"model.{name}" if name else "model", m) for name, m in self.model.named_modules()]
            out += [(f"state[{name!r}]", obj) for name, obj in self.objects.items()]
            if self.train_step_fn is not None:
                out.append(("step function", self.train_step_fn))
            return out

        def known() -> tuple[dict[str, Any], set[str]]:
            if self.train_step_fn is None:  # before the first step: what the step reaches is not known yet
                return {}, set()
            own = {pg.group_name for pg in self.session.groups.values()}
            retired = {r.name for r in self.retired}
            reached = {g.group_name for g in _groups_held(self.scan, (self.train_step_fn,))}
            for mesh in [*self.meshes, *meshes_of(self.model)]:
                reached.update(getattr(mesh, "_dim_group_names", None) or ())
            return {n: pg for n, pg in groups.items() if n not in own and n not in retired}, reached

        lines = self.scan.objects.refresh(key, roots, known)
        for line in lines:
            self.session.emit(EventKind.REBOUND, Stage.REBINDING, warning=line)
        return lines

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's job state now (:func:`~meshpact.live.recovery.state.job_state`: parameter
        shards, optimizer state, generators and the optimizer's schedule)."""
        return job_state(self.model, self.optimizer, schedulers=self.schedulers, objects=self.objects)

    def chunks(self) -> dict[str, Chunk]:
        """Where this rank's sharded tensors lie in the whole ones (a checkpoint names them so
        any loop, any mesh, reads the model and optimizer back)."""
        return global_chunks(self.model, self.optimizer)

    def watch_optimizer(self) -> None:
        """Note when the optimizer's step begins (from the commit on; hooked again when an
        excision brings a new optimizer)."""
        self._optimizer_began = False
        if self._optimizer_hook is not None and self._optimizer_hook.optimizer is self.optimizer:
            return
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()

        def began(*_: Any) -> None:
            self._optimizer_began = True
            if self.peers is not None:  # its in-place update waits (on the device) for the last snapshot's copies
                self.peers.protect()

        def ended(*_: Any) -> None:
            self.record_fence()

        self._optimizer_hook = _OptimizerHook(
            self.optimizer, self.optimizer.register_step_pre_hook(began), self.optimizer.register_step_post_hook(ended)
        )

    def record_fence(self) -> StepFence:
        """Record the step's fence on the training stream now (after its optimizer step), tracked
        for the heartbeat's device progress."""
        fence = StepFence(self.session.ops)
        fence.record(self.committed_step)
        self.session.progress.track(fence)
        self.fence = fence
        return fence

    def await_device(self, step: int) -> None:
        """The step's device work is complete, or :class:`~.device.StepAborted` (a communication
        fault: recovered, never committed). The fence is queried, never synchronized, for at most
        the data-path timeout; on the CPU it is done at once. A step that ran no optimizer step
        is fenced where it returned."""
        fence = self.fence if self.fence is not None and self.fence.step == step else self.record_fence()
        if not fence.wait(self.session.spec.timeout_s):
            why = (
                "the data path was aborted before its device work was found complete"
                if fence.failed
                else f"its device work did not complete within {self.session.spec.timeout_s:g} s"
            )
            raise StepAborted(f"step {step}: {why}; not committed")

    def check_state(self, params: Sequence[torch.nn.Parameter] | None = None) -> StateCheck:
        """Why this rank's state is not the committed one ("" when it is; always "" with
        ``check_commits`` off, which trusts the state), and the meshes of its tensors where the
        commit's own tensors still hold it. An optimizer step begun since the commit counts as a
        change whatever the commit check says: it samples at most 64 tensors, and an optimizer
        that failed part-way (a collective inside its step) may have written only tensors it does
        not sample. ``params``: the model's parameters as they stand now, where the caller listed
        them already (a recovery's detect: the model is walked once)."""
        if self.mark is None:
            return StateCheck("")
        if self._optimizer_began:
            return StateCheck(
                "the optimizer's step began after the commit (a fault inside or after it: its state "
                "may be written in part)"
            )
        return self.mark.verify(self.committed_step, self.model, self.optimizer, params, self.session.ops)

    @property
    def generation(self) -> int:
        return self.session.generation

    def op_counts(self) -> dict[str, int]:
        """Operations per live group: the backends' sequence numbers, plus the dispatch-mode
        counts (under ``dispatch:``) when that counter is on."""
        device = self.session.spec.device
        out: dict[str, int] = {
            pg.group_name: comm.sequence_number(comm.backend_of(pg, device)) for pg in self.session.groups.values()
        }
        if self.counter is not None:
            out.update({f"dispatch:{k}": v for k, v in self.counter.snapshot().items()})
        return out

    # -- the step --------------------------------------------------------------------------
    def step(self, train_step: Callable[[Any], Any], batch: Any) -> Any:
        """Run one training step; on a communication fault recover and run it again."""
        if self._in_step:
            raise UnsafeLoopError(
                "rt.step was called inside a step: call the inner step function directly "
                "(the outer step recovers its collectives)"
            )
        step = self.committed_step
        self.train_step_fn = train_step
        self.refresh_objects()  # a step function reaching other objects: walked now, before a fault can need it
        if self._first_step:
            self._find_late_schedules()
        # the registered objects as this step found them: a data loader has drawn the batch in hand
        # (the commit has the position before it), an EMA is as committed
        began = capture_objects(self.objects) if self.objects else ()
        self._in_step = True
        try:
            return self._step(step, train_step, batch, began)
        finally:
            self._in_step = False

    def _step(self, step: int, train_step: Callable[[Any], Any], batch: Any, began: Any) -> Any:
        message: str | None = None
        widened = False  # the data-path timeout was raised for this step's next run (_widen)
        for attempt in range(self.max_attempts):
            try:
                if message is not None:
                    timed_out = comm.timed_out(message)
                    decision = self._recover(Cause(message, step))
                    message = None
                    if timed_out:
                        widened = self._widen(step) or widened
                    if decision.policy is Policy.EXCISE:  # this survivor's share of the step's global batch now
                        batch = self._batch(step)  # drawn from the objects as committed, the lost ranks' too
                        began = capture_objects(self.objects) if self.objects else ()
                    if self.session.config.restore_rng:
                        restore_rng(self.rng)
                    # a scheduler stepped before the fault (or the optimizer's settings changed) goes back too,
                    # and so do buffers the failed attempt's forward moved (BatchNorm's running statistics)
                    restore_schedule(self.optimizer, self.schedulers, self.schedule)
                    if self.objects:  # as the step found them, whichever state the recovery restored
                        restore_objects(self.objects, began)
                    load_buffers(self.model, self._buffers)
                armed = self.injector.arm(step) if self.injector is not None else None
                if self.heartbeat is not None:
                    self.heartbeat.step_begins(again=attempt > 0, step=step)
                    self.heartbeat.watching = True
                self.t_attempt = time.time()
                self.fence = None  # this attempt's, recorded after its optimizer step
                if self.peers is not None and self._buffers:  # the forward updates buffers the last snapshot copies
                    self.peers.protect()
                try:
                    if self.injector is not None:
                        with self.injector.fire(armed):
                            out = train_step(batch)
                    else:
                        out = train_step(batch)
                    if step == 0 and self.session.generation == 0:
                        # the first step's tail is uneven (each rank's first optimizer step on the
                        # decoder took 0.8-1.1 s, ending up to 0.3 s apart between ranks);
                        # the ranks leave it together, so a fault in the next step is not met by
                        # a rank still finishing this one. Every rank of generation 0 runs step 0;
                        # through torch's dist API, so a wait and a failure here read as the data path's
                        comm.first_collective(self.session.group, self.session.spec.device)
                    self.await_device(step)
                finally:
                    if self.heartbeat is not None:
                        self.heartbeat.watching = False
                took_s = time.time() - self.t_attempt
                if self.heartbeat is not None:
                    self.heartbeat.step_completed()
                break
            except Exception as exc:  # noqa: BLE001  (only data-path faults are handled)
                if not is_comm_fault(exc):
                    raise
                message = fault_message(exc)
                del exc
        else:
            control = self.session.control
            if not control.answers():  # no recovery can be agreed: say what is gone, not the last symptom
                raise RuntimeError(
                    f"step {step} cannot be recovered: the control channel at {control.host}:"
                    f"{control.port} does not answer (its host, the launcher's agent on node 0 or "
                    f"rank 0 under plain torchrun, is gone); last: {message}"
                )
            hint = ""
            if message is not None and comm.timed_out(message) and self.session.config.data_timeout_s is not None:
                hint = (
                    f" (the data-path timeout is set to {self.session.spec.timeout_s:g} s: leave "
                    "RecoveryConfig.data_timeout_s unset to follow the job's steps)"
                )
            raise RuntimeError(f"step {step} failed {self.max_attempts} times; last: {message}{hint}")
        t_commit = time.time()
        self._commit(step, batch)
        self._measure(step, took_s, time.time() - t_commit)
        if widened:  # back to what the measured steps need (this one included, if it was longer)
            s = self.session
            fitted = s.config.timeout_for(self.longest_step_s) if self.steps_run > 1 else s.config.data_timeout_start_s
            if fitted != s.spec.timeout_s:
                s.emit(
                    EventKind.TIMEOUT_FITTED,
                    step=step,
                    generation=s.generation,
                    longest_step_s=self.longest_step_s,
                    seconds=fitted,
                    before_s=s.spec.timeout_s,
                )
                s.fit_data_timeout(fitted)
        return out

    # -- collectives between steps ----------------------------------------------------------
    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, an evaluation or a logging collective between steps, protected
        as a step is: on a communication fault the job recovers (the committed state is unchanged,
        nothing to restore) and ``fn`` runs again from the generators it started with, up to
        ``max_attempts`` times. A rank that had finished ``fn`` and gone on when a peer's run of it
        failed runs it again too, with that peer (its result dropped: :mod:`.blocks`), so every
        rank resumes at one point of the loop. Every rank calls ``rt.run`` for the same blocks in
        the same order (a block run on some ranks only is no point the others can find).

        ``fn`` leaves the generators as it found them: an evaluation that draws does not move the
        training's random streams (a replaced rank, which starts at the next step without running
        the block, could not follow them otherwise). Its arguments are kept for a run again until
        a few blocks later and, at most, until the oldest step a restore can go back to.

        Where ``fn`` cannot run again on every rank, it raises :class:`GuardedBlockLost` on the ranks
        standing in it: a replacement process joined (it starts at the next ``rt.step``) or lost
        ranks were excised. Called inside a step or inside another block, ``fn`` is that one's: it
        runs once, and its fault re-runs the step or the block."""
        if self._in_step or self._in_block:
            return fn(*args, **kwargs)
        at = self.committed_step
        rng = capture_rng() if self.session.config.restore_rng else None
        message: str | None = None
        self.resume_at = index = self.blocks.count(at)
        self._in_block = True
        try:
            for _ in range(self.max_attempts):
                try:
                    if message is not None:
                        decision = self._recover(Cause(message, self.committed_step))
                        message = None
                        if point_order((at, index)) < point_order(decision.resume_point):
                            self.blocks.add(at, BlockRun(None))  # dropped on this rank, as no rank runs it now
                            why = (
                                "lost ranks were excised"
                                if decision.policy is Policy.EXCISE
                                else "a replacement process joined, which starts at the next rt.step"
                            )
                            raise GuardedBlockLost(
                                f"a collective between steps failed at step {self.committed_step} and {why}, so "
                                f"{getattr(fn, '__qualname__', 'the block')} is not run again on any rank"
                            )
                        if rng is not None:
                            restore_rng(rng)
                    with self._watched():
                        out = fn(*args, **kwargs)
                except Exception as exc:  # noqa: BLE001  (only data-path faults are handled)
                    if not is_comm_fault(exc):  # (a recovery that failed in its replay: the next attempt)
                        raise
                    message = fault_message(exc)
                    del exc
                    continue
                self.blocks.add(self.committed_step, BlockRun(fn, args, dict(kwargs), rng))
                return out
        finally:
            self.resume_at = AT_STEP
            self._in_block = False
            if rng is not None:
                restore_rng(rng)
        raise RuntimeError(
            f"a collective between steps at step {self.committed_step} failed {self.max_attempts} "
            f"times; last: {message}"
        )

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """``with rt.guard(): ...``: a block of collectives between steps whose communication fault
        the job recovers from, as a step's. A ``with`` block cannot be run again, so once the job
        has recovered it raises :class:`GuardedBlockLost` (on every rank alike: each rank's block
        failed or was severed by the recovery, or, reached after a recovery that a peer stood past
        it in, is skipped at its entry); :meth:`run` runs the block again instead. Inside a step
        or another block the block is that one's: its fault re-runs it. The block leaves the
        generators as it found them, as :meth:`run`'s does."""
        if self._in_step or self._in_block:
            yield
            return
        at = self.committed_step
        index = self.blocks.count(at)
        if self.skip_guards_before is not None and point_order((at, index)) < point_order(self.skip_guards_before):
            self.blocks.add(at, BlockRun(None))
            raise GuardedBlockLost(
                f"a guarded block at step {at} was skipped: a peer was past it when the job last "
                "recovered, and a with block cannot run again (use rt.run(fn) to run it again)"
            )
        rng = capture_rng() if self.session.config.restore_rng else None
        self._in_block = True
        try:
            with self._watched():
                yield
        except Exception as exc:  # noqa: BLE001  (only data-path faults are handled)
            if not is_comm_fault(exc):
                raise
            message: str | None = fault_message(exc)
            del exc
            self.blocks.add(at, BlockRun(None))  # this rank is past it: it runs the next block, or the step
            self.resume_at = self.blocks.count(at)
            try:
                for _ in range(self.max_attempts):  # a recovery whose replay fails is followed by the next
                    try:
                        self._recover(Cause(message or "", self.committed_step))
                        message = None
                        break
                    except Exception as again:  # noqa: BLE001
                        if not is_comm_fault(again):
                            raise
                        message = fault_message(again)
                        del again
            finally:
                self.resume_at = AT_STEP
            if message is not None:
                raise RuntimeError(
                    f"a guarded block at step {at} could not be recovered in {self.max_attempts} "
                    f"attempts; last: {message}"
                ) from None
            raise GuardedBlockLost(
                f"a collective in a guarded block failed at step {self.committed_step}; the "
                "job recovered, and the block's result is lost on every rank: use rt.run(fn) to "
                "run it again after a recovery"
            ) from None
        finally:
            self._in_block = False
            if rng is not None:
                restore_rng(rng)
        self.blocks.add(at, BlockRun(None))

    @contextlib.contextmanager
    def _watched(self) -> Iterator[None]:
        """The heartbeat watches the block as a step of ``committed_step`` (a peer's recovery
        severs this rank's data path while the block waits on it)."""
        hb = self.heartbeat
        if hb is None:
            yield
            return
        hb.running_step = self.committed_step
        hb.running_block = self.blocks.count(self.committed_step)  # the block it runs (blocks.py)
        hb.watching = True
        try:
            yield
        finally:
            hb.watching = False

    def _widen(self, step: int) -> bool:
        """A step whose collective timed out runs again with twice the wait (at most the warm-up
        bound), where the timeout follows the job: a step that is just longer than any measured
        before (an evaluation inside it) would otherwise time out on every run of it until the
        attempts ran out. Once it completes, the timeout is fitted to the measured steps again,
        so a stall found by the timeout leaves no wider timeout behind. Whether it was widened."""
        s = self.session
        if not s.config.data_timeout_follows:
            return False
        now = s.spec.timeout_s
        wider = min(2 * now, max(s.config.data_timeout_start_s, now))
        if wider <= now:
            return False
        s.emit(
            EventKind.TIMEOUT_FITTED,
            step=step,
            generation=s.generation,
            longest_step_s=self.longest_step_s,
            seconds=wider,
            before_s=now,
            widened=True,
        )
        s.fit_data_timeout(wider)
        return True

    def _measure(self, step: int, took_s: float, commit_s: float) -> None:
        """Count a step that ran to its end and fit the data-path timeout to the longest wait a
        collective of the job can meet (:meth:`RecoveryConfig.timeout_for`): a collective waits
        for its slowest peer, which may still be in its step, its commit (a checkpoint, a peer
        copy) or whatever the loop does between steps, so what is measured is the longest of
        the step (``took_s``), its commit (``commit_s``) and the period from the previous step's
        start to this one's (consecutive steps, no recovery between). From the process's
        second step on the groups wait ``data_timeout_margin`` times that (never under the set
        timeout or the floor) instead of the warm-up bound the first step needed. The longest
        only grows, so after the first fit the timeout only rises. A set timeout that may not
        follow and is too short is refused here, naming both values."""
        self.steps_run += 1
        start, prev = self.t_attempt or 0.0, self._last_start
        self._last_start = (step, start, len(self.recoveries))
        period = (
            start - prev[1]
            if prev is not None and prev[0] == step - 1 and prev[2] == len(self.recoveries) and self.steps_run > 2
            else 0.0
        )  # the first step's period holds its building and compiling
        took_s = max(took_s, commit_s, period)
        if self.steps_run == 1 or took_s <= self.longest_step_s:
            return
        self.longest_step_s = took_s
        s = self.session
        timeout = s.config.timeout_for(took_s)
        if timeout != s.spec.timeout_s:
            before = s.spec.timeout_s
            s.fit_data_timeout(timeout)
            s.emit(
                EventKind.TIMEOUT_FITTED,
                step=step,
                generation=s.generation,
                longest_step_s=took_s,
                seconds=timeout,
                before_s=before,
            )

    def _find_late_schedules(self) -> None:
        """Before the first step: an LR scheduler or gradient scaler made between ``__enter__``
        and it is refused. Its state would be in no peer copy or checkpoint of step 0, and a
        replacement or a restart (which builds and enters before any step) could not load one
        that has it. The walk sees only what was made since ``__enter__`` froze the heap."""
        self._first_step = False
        known = {id(x) for x in self.schedulers}
        late = [x for x in schedulers_of(self.optimizer) if id(x) not in known]
        if late:
            raise LateSchedulerError(
                f"{', '.join(type(x).__qualname__ for x in late)} made after resilient() was entered: its state is "
                "in no commit, peer copy or checkpoint of step 0, and a replacement or a restart could not load one "
                "that has it. Make LR schedulers and gradient scalers before entering resilient() (in build)"
            )

    def _refuse_late_scheduler(self, step: int) -> None:
        """An LR scheduler records ``initial_lr`` in every param group it drives: one there with
        none known was made after training started (a dict lookup per group, each commit)."""
        from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

        if any(isinstance(x, (LRScheduler, ReduceLROnPlateau)) for x in self.schedulers):
            return
        if any("initial_lr" in g for g in param_groups_of(self.optimizer)):
            raise LateSchedulerError(
                f"step {step}: the optimizer's param groups carry initial_lr, an LR scheduler's mark, but no scheduler "
                "on this optimizer existed when training started: its state is in no commit, peer copy or "
                "checkpoint, so a recovery would leave it where a failed attempt put it. Make the scheduler before "
                "entering resilient() (in build)"
            )

    def join_recovery(self) -> Decision | None:
        """Between steps: join a recovery this rank's peers opened, now (None: none is open).

        A rank meets a fault only inside a collective. One that idles between steps (an
        evaluation, waiting for data, a held run) while a peer is lost leaves the replacement
        and the survivors waiting round after round for its proposal, and after the rank-loss
        bound they declare it lost and its process is replaced. A loop with such idle phases
        calls this in them, as often as it likes (a few control-channel round trips when no
        round is open). Nothing ran since the commit, so the state goes into the round as
        committed; the step after it starts on the new generation's groups."""
        s = self.session
        nxt = open_round(s.control, s.members)
        if nxt is None:
            return None
        return self._recover(
            Cause(f"peers opened recovery round {nxt} while this rank was between steps", self.committed_step)
        )

    def _commit(self, step: int, batch: Any) -> None:
        self._refuse_late_scheduler(step)
        if not self._optimizer_began:
            carried = _carried_gradients(self.model)
            if carried:
                raise CarriedGradientsError(
                    f"step {step} left nonzero gradients for the next rt.step call without an optimizer step (on "
                    f"{', '.join(carried)}): gradients accumulated over several calls are in no commit, peer copy or "
                    "checkpoint, so a recovery would drop them. Accumulate the micro-batches inside one train_step, "
                    "or zero the gradients before it returns"
                )
        # a full step has run since these groups were retired: count their operations, let them go
        # (no gc.collect() on the step path: a full collection can outlast the data-path timeout)
        for r in self.retired:
            if r.backend is not None:
                r.seq_ops_after = comm.sequence_number(r.backend) - r.seq_at_retirement
                r.backend = None
        if self.session.severed:
            self.session.release_severed()
        self.committed_step = step + 1
        self.mark_committed()
        if self.peers is not None:  # a host copy now; shipped to the holders while the next step runs
            self.copy_to_peers(just_marked=True)
        if self.batches is None:
            self._kept.append((step, batch))
        if self.ckpt is not None and self.ckpt.due(self.committed_step):
            t0 = time.perf_counter()
            written = self.ckpt.save(self.committed_step, self.state(), self.chunks())
            self._saved.append(self.committed_step)
            self.session.emit(
                EventKind.CHECKPOINT, step=self.committed_step, seconds=time.perf_counter() - t0, bytes=written
            )
        if self.ckpt is not None and self._kept:
            try:  # keep batches since the checkpoint before the newest complete one
                newest = self.ckpt.latest(self.committed_step, verify=False)
                keep_from = self.ckpt.latest(newest - 1, verify=False) if newest > 0 else 0
            except FileNotFoundError:
                keep_from = 0
            while self._kept and self._kept[0][0] < keep_from:
                self._kept.popleft()
        # the blocks of the steps a restore can go back to (own snapshots, the two newest checkpoints saved), the
        # newest KEPT_STEPS at most: a restore from further back that needs them ends in one line (blocks.py)
        if self.blocks.ran_any:
            oldest = (
                min(self.peers.own_steps(), default=self.committed_step)
                if self.peers is not None
                else self.committed_step
            )
            oldest = min(oldest, self._saved[0]) if self._saved and self.ckpt is not None else oldest
            self.blocks.keep_from(max(oldest, self.committed_step - KEPT_STEPS))
        self.session.build_standby_between_steps()  # on NCCL: no collective of the job runs now

    # -- recovery --------------------------------------------------------------------------
    def job_groups(self) -> dict[str, dist.ProcessGroup]:
        """Every group of the job this rank belongs to, by base name: the session's and any the
        user made (``new_group``, ``new_subgroups``, ``init_device_mesh``)."""
        groups = dict(self.session.groups)
        retired = {r.name for r in self.retired}
        known = {id(g) for g in groups.values()}
        for pg in list(c10d._world.pg_map):
            if id(pg) not in known and pg.group_name not in retired:
                groups[comm.base_name(pg.group_name)] = pg
        return groups

    def _recover(self, cause: Cause) -> Decision:
        """One recovery, stage by stage (:mod:`.pipeline`). Its events reach the rank's log after
        its first collective (or, off the in-memory path, once decided), not on the critical path."""
        try:
            return self._run_pipeline(cause)
        finally:  # resumed, or failed into the next attempt: the listener waits on the generation now
            if self.heartbeat is not None:
                self.heartbeat.recovery_ends()

    def _run_pipeline(self, cause: Cause) -> Decision:
        s = self.session
        with s.log.deferred():
            d = pipeline.detect(self, cause)
            decision = pipeline.agree_on(self, d)
            if self.on_decided is not None or not decision.in_memory:  # a drill may end the process; a long path
                s.log.flush()
            if self.on_decided is not None:
                self.on_decided(decision)
            if decision.policy is Policy.EXCISE:
                rebound = pipeline.excise_lost(self, d, decision)
            else:
                if decision.policy is Policy.CHECKPOINT_RESTORE and (self.ckpt is None or decision.step < 0):
                    raise without_checkpoint(decision.reason, self.ckpt is not None)
                with s.sever_lock:  # from the standby's sockets joining the data path until the generation moves on
                    rebound = pipeline.rebind(self, d, decision, pipeline.rebuild(self, d, decision))
            try:
                if decision.policy is not Policy.EXCISE:
                    pipeline.restore(self, d, decision)
                pipeline.resume(self, d, decision, rebound)
            finally:  # resumed, or failing into the next recovery: kept until a commit either way
                pipeline.retire_replaced(self, rebound)
        return decision

    def settle_counters(self) -> None:
        """Make the consensus counter moves the last agreement left to this rank (see consensus.agree)."""
        if self.counters is not None:
            counters, self.counters = self.counters, None
            counters.make(self.session.control)

    def excise_refusal(self) -> str | None:
        """Why this job cannot excise a lost rank whose replacement never came (None: it can)."""
        if self.build is None:
            return "no build(mesh) was given to resilient() for the smaller world"
        if self.objects and self.state_of is None:
            return (
                f"the registered objects ({', '.join(sorted(self.objects))}) of a lost rank cannot be continued: "
                "no state_of=lambda rank: {...} was given to resilient()"
            )
        if isinstance(self.model, ModelParts):
            return "excision re-shards one model; this job's model is a list of parts (pipeline stages)"
        shape = tuple(getattr(self.session.mesh, "shape", ()) or ())
        if len(shape) > 2:
            return f"excision re-shards a 1-D FSDP mesh or drops replicas of a 2-D HSDP one; this job's mesh is {list(shape)}"
        if len(shape) == 2 and self.objects:
            return (
                f"an HSDP excision drops whole replicas, and their ranks' registered objects "
                f"({', '.join(sorted(self.objects))}) are not carried over: register none to excise replicas"
            )
        if len(shape) == 2 and shape[0] < 2:
            return f"this job's HSDP mesh {list(shape)} has one replica left: losing a rank of it leaves none whole"
        return None

    def adopt_departed(self, departed: Mapping[int, torch.Tensor]) -> None:
        """After an excision: the registered objects go back to the committed step (the failed
        attempt drew its batch from them), and each lost rank's objects, made here by
        ``state_of``, take the positions its committed schedule (``departed``, by original rank)
        holds. They are registered as ``<name>@rank<r>``, so the survivors draw the lost ranks'
        samples where those left off, and commit, copy and checkpoint them with their own; a
        lost rank's own adopted objects pass on under their first owner's rank."""
        if not self.objects:
            return
        restore_objects(self.objects, self.schedule.objects)
        assert self.state_of is not None, "excise_refusal() lets no job with objects excise without state_of"
        adopt_objects(self.objects, departed, self.state_of)
        self.schedule = replace(self.schedule, objects=capture_objects(self.objects))

    def replace_model(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        """After an excision at ``step``: the smaller world's model and optimizer; the old model
        refuses any later forward, and the new one's gradients are weighted per batch share."""
        refuse_stale(self.model, self.session.rank, step)
        if self.weight is not None:
            self.weight.remove()
        self.model, self.optimizer = model, optimizer
        self.weight = GradientWeight(self.model)

    def share(self, batch: Callable[[int, int], Any], step: int) -> Any:
        """This rank's samples of ``step`` from ``batch(step, original rank)``: its own until an
        excision, then its share of the original world's global batch (the departed ranks'
        samples spread over the survivors, :func:`~meshpact.live.recovery.reshard.share_batch`),
        its gradient weighted so the group's average stays the mean over every sample."""
        if not self.membership.departed:
            return batch(step, self.session.rank)
        got = share_batch(batch, step, self.membership, self.session.rank, drawn_once=bool(self.objects))
        assert self.weight is not None
        self.weight.weight = got.weight
        return got.batch

    def copy_to_peers(self, just_marked: bool = False) -> None:
        """Hand the committed state to the peer copier, with the time its listing took (the
        copy's cost on the training thread: the peer-copy model prices it). ``just_marked``: the
        generators were captured by the commit mark a moment ago, nothing drawn since."""
        assert self.peers is not None
        t0 = time.perf_counter()
        state = job_state(self.model, self.optimizer, self.rng, schedule=self.schedule) if just_marked else self.state()
        self.peers.commit(self.committed_step, state, listed_s=time.perf_counter() - t0)

    def refresh_peers(self) -> None:
        """Read every rank's peer address again and keep the data-path severing off the peer path."""
        assert self.peers is not None
        self.session.data_path.protect_ports(a.port for a in self.peers.refresh().values())

    def restore(self, step: int) -> None:
        """Load the checkpoint of ``step`` (state and generators) and make it the committed state."""
        if self.ckpt is None:
            raise RuntimeError("no checkpoint directory is set: nothing to restore from")
        if step < 0:  # a decision made when none was complete (consensus.decide)
            raise RuntimeError("no complete checkpoint exists to restore from")
        load_job_state(self.model, self.optimizer, self.ckpt.load(step), self.schedulers, self.objects)
        self.committed_step = step
        self.mark_committed()
        if self.peers is not None:  # this rank's server takes its peers' copies of the steps after it from now on
            self.peers.keep_only(step)  # (a job restarted from its checkpoint: not only after this rank's next commit)

    def _batch(self, step: int) -> Any:
        if self.batches is not None:
            return self.batches(step)
        for st, b in self._kept:
            if st == step:
                return b
        raise RuntimeError(
            f"cannot replay step {step}: its batch is gone (pass batches=... to resilient() so "
            "lost steps are drawn again from their source)"
        )

    def replay(self, from_step: int, to_step: int, live: Point | None = None, mark: bool = True) -> int:
        """Run again, in the order they first ran, what lies between the state at ``from_step`` and
        where this rank stood (``to_step``, at :attr:`resume_at`): every step the restore took back,
        and the blocks between steps (``rt.run``) from the point where the job resumes live
        (``live``; None: the decided step, no block) on, each from the generators it first ran
        from (:mod:`.blocks`). The commit mark is taken anew after the last step run again (or, with
        none, where ``mark`` asks). Returns the steps run again."""
        try:
            plan = replay_plan(from_step, live or (from_step, AT_STEP), (to_step, self.resume_at), self.blocks.count)
            runs = {(at, i): self.blocks.run_at(at, i) for kind, at, i in plan if kind == "block"}
        except LookupError as exc:
            raise RecoveryImpossible(f"rank {self.session.rank} cannot stand again where it stood: {exc}") from None
        steps = [at for kind, at, _ in plan if kind == "step"]
        if steps and self.train_step_fn is None:
            raise RuntimeError("cannot replay: no step has run in this process yet")
        self._in_block = True  # an rt.run inside a block run again is that block's
        try:
            for kind, at, i in plan:
                if kind == "step":
                    assert self.train_step_fn is not None
                    self.train_step_fn(self._batch(at))
                    self.committed_step = at + 1
                    if at == steps[-1]:
                        self.mark_committed()
                    continue
                run = runs[(at, i)]
                if run.fn is None:  # a guarded block: never run again (its peers skip it at its entry)
                    continue
                rng = capture_rng() if self.session.config.restore_rng else None
                if run.rng is not None:
                    restore_rng(run.rng)
                try:
                    run.fn(*run.args, **run.kwargs)  # its result was returned once already
                finally:
                    if rng is not None:
                        restore_rng(rng)
                self.blocks.replayed += 1
        finally:
            self._in_block = False
        if not steps and mark:
            self.mark_committed()
        return len(steps)

    def drill_checkpoint_restore(self) -> Decision:
        """A real checkpoint restore in this job, now: consensus, new groups, reload, replay."""
        return self._recover(Cause("drill: checkpoint restore in job", self.committed_step, drill=True))


def resilient(
    model: torch.nn.Module | Sequence[torch.nn.Module],
    optimizer: torch.optim.Optimizer,
    session: Session,
    injector: FaultInjector | None = None,
    batches: Callable[[int], Any] | None = None,
    *,
    build: Callable[[Any], tuple[torch.nn.Module, torch.optim.Optimizer]] | None = None,
    on_rank_loss: Policy = Policy.PEER_RESTORE,
    min_ranks: int = 1,
    state: Mapping[str, Any] | None = None,
    state_of: Callable[[int], Mapping[str, Any]] | None = None,
) -> Resilient:
    """``with resilient(model, optimizer, session, batches=source) as rt: rt.step(train_step, batch)``;
    ``model``: one module, or a list of this rank's model parts (pipeline parallel's stages),
    kept as one :class:`ModelParts` (``rt.model``; a list the runtime cannot keep whole is refused
    in one line). ``on_rank_loss=Policy.EXCISE`` with ``build(mesh)`` continues on the survivors
    of a lost rank (one model, not parts).
    ``state={"data": loader, "ema": ema}``: objects with ``state_dict``/``load_state_dict``,
    committed with each step, in the peer copies and checkpoints, restored on every path.
    ``state_of(rank)``: any rank's objects (as ``state`` has this rank's), which an excision
    needs: the survivors continue a lost rank's objects from its committed copy."""
    return Resilient(
        model,
        optimizer,
        session,
        injector,
        batches,
        build=build,
        on_rank_loss=on_rank_loss,
        min_ranks=min_ranks,
        state=state,
        state_of=state_of,
    )
