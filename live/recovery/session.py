"""The session: one rank's place in a resilient job (stores, control channel, data-path groups, mesh).

:func:`start_session` joins the job from torchrun's environment: it connects to the
rendezvous store and the control channel, builds the generation-0 data-path groups (the
group over every rank and, for an N-D mesh, each dimension's groups) and the
:class:`DeviceMesh` over them. A replacement process instead joins the recovery in
progress: it takes part in consensus and builds the decided generation's groups. The
session is returned, never kept in a module: pass it to
:func:`~meshpact.live.recovery.runtime.resilient`.

Every event of the rank goes through :meth:`Session.emit`, which keeps it, appends it to
the rank's JSONL log (flushed, so it survives SIGKILL) and optionally traces it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any

import torch
import torch.distributed as dist

from meshpact.core.recording import Event, EventKind
from meshpact.core.recovery import CommunicatorAction, Stage

from . import communicator as comm
from ..backends import choose_backend
from ..store import open_store
from .checkpoint import Checkpointer
from .config import RecoveryConfig
from .consensus import Decision, Proposal, agree
from .control import ControlChannel

__all__ = ["RecoveryConfig", "Session", "start_session", "resume_barrier", "build_mesh_groups", "mesh_from_groups"]


@dataclass
class Session:
    """One rank's place in the job: stores, control channel, current data-path groups and mesh."""

    rank: int
    world_size: int
    config: RecoveryConfig
    store: Any
    control: ControlChannel
    spec: comm.GroupSpec
    groups: dict[str, dist.ProcessGroup]  # base name -> this generation's group (this rank a member)
    generation: int
    incarnation: int
    mesh_shape: tuple[int, ...]
    mesh_names: tuple[str, ...] | None
    mesh: Any = None
    protected_sockets: dict[int, str] = field(default_factory=dict)  # stores and control channel
    store_ports: tuple[int, ...] = ()  # the rendezvous store's and the control channel's
    events: list[Event] = field(default_factory=list)
    pending: Decision | None = None  # a replacement's decision, applied when resilient() starts
    log: IO[str] | None = None  # the rank's JSONL event log (survives SIGKILL)

    @property
    def group(self) -> dist.ProcessGroup:
        """The data-path group over every rank."""
        return self.groups[comm.WORLD]

    def attach_log(self, path: str | os.PathLike[str]) -> None:
        self.log = open(path, "a", encoding="utf-8")
        for ev in self.events:
            self.log.write(json.dumps(ev.to_dict(), default=str) + "\n")
        self.log.flush()

    def emit(self, kind: EventKind, stage: Stage | None = None, **data: Any) -> Event:
        ev = Event(time.time(), kind, self.rank, stage, data)
        self.events.append(ev)
        if self.log is not None:
            self.log.write(json.dumps(ev.to_dict(), default=str) + "\n")
            self.log.flush()
        if os.environ.get("MESHPACT_TRACE"):
            print(f"[meshpact rank {self.rank}] {ev}", file=sys.stderr, flush=True)
        return ev

    def checkpointer(self) -> Checkpointer | None:
        if not self.config.checkpoint_dir:
            return None
        return Checkpointer(self.config.checkpoint_dir, self.rank, self.world_size, self.config.checkpoint_every)

    def build_generation(self, generation: int) -> dict[str, dist.ProcessGroup]:
        """Build ``generation``'s world and mesh-dimension groups (every rank calls it)."""
        groups = {comm.WORLD: comm.build_group(self.spec, self.store, generation)}
        groups.update(build_mesh_groups(self.spec, self.store, generation, self.mesh_shape, self.mesh_names))
        return groups


def _mesh_ranks(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(math.prod(shape)).reshape(shape)


def _dim_base(names: tuple[str, ...] | None, dim: int, ranks: tuple[int, ...]) -> str:
    label = names[dim] if names else f"dim{dim}"
    return f"meshpact_{label}_{'-'.join(map(str, ranks))}"


def build_mesh_groups(spec: comm.GroupSpec, store: Any, generation: int, shape: tuple[int, ...],
                      names: tuple[str, ...] | None) -> dict[str, dist.ProcessGroup]:
    """This rank's group along each dimension of an N-D mesh (none for a 1-D mesh: the world
    group is its only dimension). Dimensions are built in order, so every member of a group
    builds it at the same point."""
    if len(shape) == 1:
        return {}
    mesh = _mesh_ranks(shape)
    coords = [int(c) for c in (mesh == spec.rank).nonzero()[0]]
    out = {}
    for dim in range(len(shape)):
        index = list(coords)
        index[dim] = slice(None)
        ranks = tuple(int(r) for r in mesh[tuple(index)].tolist())
        base = _dim_base(names, dim, ranks)
        out[base] = comm.build_group(spec, store, generation, base, ranks)
    return out


def mesh_from_groups(groups: dict[str, dist.ProcessGroup], device_type: str, shape: tuple[int, ...],
                     names: tuple[str, ...] | None) -> Any:
    """The DeviceMesh over this generation's groups (its dimensions in order)."""
    from torch.distributed.device_mesh import DeviceMesh

    if len(shape) == 1:
        return DeviceMesh.from_group(groups[comm.WORLD], device_type,
                                     mesh_dim_names=names)
    dims = [g for base, g in groups.items() if base != comm.WORLD]
    return DeviceMesh.from_group(dims, device_type, _mesh_ranks(shape),
                                 mesh_dim_names=names or tuple(f"dim{d}" for d in range(len(shape))))


def start_session(config: RecoveryConfig | None = None, mesh_shape: tuple[int, ...] | None = None,
                  mesh_names: tuple[str, ...] | None = None) -> Session:
    """Join the job described by torchrun's environment and build (or join) the data path.

    ``mesh_shape`` (default: all ranks in one dimension) and ``mesh_names`` describe the
    DeviceMesh; the environment is read here and nowhere deeper (``MESHPACT_RUN_ID`` names
    this run's store keys, ``MESHPACT_INCARNATION`` a replacement process)."""
    config = config or RecoveryConfig()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    shape = tuple(mesh_shape) if mesh_shape else (world,)
    if math.prod(shape) != world:
        raise ValueError(f"a mesh of shape {list(shape)} needs {math.prod(shape)} ranks, the job has {world}")
    run_id = os.environ.get("MESHPACT_RUN_ID", "")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = open_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                       is_host=(rank == 0 and not agent_store), timeout_s=config.store_connect_s)
    control = ControlChannel.from_env(config.control_timeout_s, run_id, connect_timeout_s=config.store_connect_s)
    choice = choose_backend(config.vendor, int(os.environ.get("LOCAL_RANK", rank)))
    if choice.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(choice.device))
    spec = comm.GroupSpec(choice.backend.value, choice.device, rank, world, config.data_timeout_s,
                          connect_timeout_s=config.connect_timeout_s, run_id=run_id)
    incarnation = int(os.environ.get("MESHPACT_INCARNATION", "0"))
    session = Session(rank, world, config, store, control, spec, {}, 0, incarnation, shape,
                      tuple(mesh_names) if mesh_names else None,
                      protected_sockets=comm.socket_fds(),
                      store_ports=(int(os.environ["MASTER_PORT"]), control.port))
    session.emit(EventKind.SESSION_START, backend=choice.to_dict(), incarnation=incarnation)
    if incarnation == 0:
        # every rank is here before any group connects: group creation bounds connecting, not a
        # peer still starting (imports under load), which the store connect bound covers
        control.set(f"arrived/rank{rank}", True)
        control.wait([f"arrived/rank{r}" for r in range(world)], timeout_s=config.store_connect_s)
        session.groups = session.build_generation(0)
    else:  # a replacement: join the recovery in progress; its state comes from the checkpoint
        ckpt = session.checkpointer()
        t0 = time.perf_counter()
        decision = agree(control, lambda g: Proposal(rank, g, -1, "", False, incarnation),
                         ckpt.latest if ckpt else (lambda limit: 0), max_rounds=config.max_rounds)
        session.emit(EventKind.DECIDED, Stage.CONSENSUS, seconds=time.perf_counter() - t0, **decision.summary())
        t0 = time.perf_counter()
        session.generation = decision.round
        session.groups = session.build_generation(decision.round)
        session.emit(EventKind.REBUILT, Stage.COMMUNICATOR, seconds=time.perf_counter() - t0,
                     action=CommunicatorAction.REBUILD.value, generation=decision.round)
        session.pending = decision
    c10d_default(session.group)
    session.mesh = mesh_from_groups(session.groups, choice.device.split(":")[0], shape, session.mesh_names)
    return session


def c10d_default(pg: dist.ProcessGroup) -> None:
    """Make ``pg`` c10d's default group (what ``dist.all_reduce(x)`` without a group uses)."""
    import torch.distributed.distributed_c10d as c10d

    c10d._world.default_pg = pg


def resume_barrier(session: Session, generation: int) -> float:
    """Wait (on the control channel) until every rank is ready to use ``generation``'s groups;
    a rank that issued its first collective before a slower peer (a replacement still loading
    its checkpoint) arrived would otherwise time out on the data path. Returns seconds waited."""
    t0 = time.perf_counter()
    session.control.set(f"ready/g{generation}/rank{session.rank}", True)
    session.control.wait([f"ready/g{generation}/rank{r}" for r in range(session.world_size)])
    return time.perf_counter() - t0
