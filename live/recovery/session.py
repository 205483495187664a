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

The session also holds the *standby* (:class:`~meshpact.live.recovery.communicator.Standby`):
the next generation's groups, built in the background after the job starts and after each
recovery. A recovering rank's proposal says what its standby can do
(:meth:`Session.standby_word`); the decision carries every proposal, so every rank reads the
same words from it (:meth:`Session.standby_verdict`) and all use the standby or all build,
never a mix, at no round trip of its own.
"""

from __future__ import annotations

import json
import math
import os
import threading
import sys
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Sequence

import torch
import torch.distributed as dist

from meshpact.core.recording import Event, EventKind
from meshpact.core.recovery import CommunicatorAction, Stage

from . import communicator as comm
from ..backends import choose_backend
from ..store import open_store
from .checkpoint import Checkpointer
from .config import RecoveryConfig
from .consensus import GENERATION_KEY, GONE_COUNT_KEY, ROUND_KEY, Decision, Proposal, agree
from .control import ControlChannel

__all__ = ["RecoveryConfig", "Session", "start_session", "resume_barrier", "start_barrier", "build_mesh_groups", "mesh_from_groups"]


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
    socket_ends: comm.SocketEnds = field(default_factory=dict)  # ends of sockets already asked (data_sockets)
    # held while the heartbeat severs and while the runtime swaps in the next
    # generation's groups: a late sever never reaches the new groups' sockets
    sever_lock: threading.Lock = field(default_factory=threading.Lock)
    events: list[Event] = field(default_factory=list)
    pending: Decision | None = None  # a replacement's decision, applied when resilient() starts
    peer_server: Any = None  # peers.PeerServer: holds other ranks' copies (peer_copies > 0)
    host: str = ""  # the host this rank is on, as peer placement sees it
    log: IO[str] | None = None  # the rank's JSONL event log (survives SIGKILL)
    held: list[Event] | None = None  # events not yet written to the log (hold_log)
    store_addr: tuple[str, int] = ("127.0.0.1", 0)  # the rendezvous store (a standby connects on its own)
    standby: comm.Standby | None = None  # the next generation's groups, built in the background
    dropped: list[comm.Standby] = field(default_factory=list)  # discarded standbys whose thread may still run
    alive: tuple[int, ...] = ()  # the original ranks still in the job (empty: all; fewer after an excision)
    # (the last round decided, the generation) as this rank last saw them: a recovery's first
    # consensus round starts from it instead of reading the counters (consensus.agree's view)
    round_view: tuple[int, int] | None = None
    checkpoint_subdir: str = ""  # after an excision the smaller world checkpoints apart from the larger one

    @property
    def members(self) -> tuple[int, ...]:
        """The original ranks in the job now. ``rank`` stays this process's original rank
        (control channel keys, peer copies); its rank in the data-path groups is ``spec.rank``."""
        return self.alive or tuple(range(self.world_size))

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
        if self.held is not None:
            self.held.append(ev)
        else:
            self._write((ev,))
        return ev

    def hold_log(self) -> None:
        """Keep events out of the log (stamped and kept in :attr:`events` as ever) until
        :meth:`release_log`: a recovery's critical path does not encode and write them. A
        SIGKILL in between loses the held lines from the log, not from a finished run."""
        if self.held is None:
            self.held = []

    def release_log(self) -> None:
        """Write the held events, in order, and log each event as it comes again."""
        held, self.held = self.held, None
        if held:
            self._write(held)

    def _write(self, events: Sequence[Event]) -> None:
        if self.log is not None:
            self.log.write("".join(json.dumps(ev.to_dict(), default=str) + "\n" for ev in events))
            self.log.flush()
        if os.environ.get("MESHPACT_TRACE"):
            for ev in events:
                print(f"[meshpact rank {self.rank}] {ev}", file=sys.stderr, flush=True)

    def checkpointer(self) -> Checkpointer | None:
        if not self.config.checkpoint_dir:
            return None
        directory = os.path.join(self.config.checkpoint_dir, self.checkpoint_subdir) if self.checkpoint_subdir \
            else self.config.checkpoint_dir
        return Checkpointer(directory, self.spec.rank, len(self.members), self.config.checkpoint_every)

    # -- the standby ------------------------------------------------------------------------
    def data_sockets(self) -> dict[int, str]:
        """The data path's sockets to sever on a fault: never the stores', the control
        channel's or the standby's."""
        keep = dict(self.protected_sockets)
        if self.standby is not None:
            keep.update(self.standby.sockets)
        return comm.data_sockets(keep, self.store_ports, self.socket_ends)

    def start_standby(self, groups: dict[str, dist.ProcessGroup]) -> None:
        """Start building the next generation's copy of ``groups`` (every group of the job) in
        the background; every rank starts it at the same point of the job."""
        self.drop_standby()
        if not self.config.standby or self.alive:  # after an excision the groups are built when needed
            return
        host, port = self.store_addr

        def connect() -> Any:
            return open_store(host, port, self.world_size, False, self.config.store_connect_s)

        self.standby = comm.Standby(self.spec, connect, self.generation + 1, comm.group_plan(groups)).start()

    def drop_standby(self) -> None:
        """Discard the standby (its thread, if still running, is joined on :meth:`stop_standby`)."""
        if self.standby is not None:
            self.standby.discard()
            self.dropped.append(self.standby)
            self.standby = None
        self.dropped = [sb for sb in self.dropped if not sb.join(0.0)]

    def stop_standby(self) -> None:
        """Discard the standby and join every standby thread (each bounded by group creation)."""
        self.drop_standby()
        for sb in self.dropped:
            sb.join(self.config.connect_timeout_s)
        self.dropped = []

    def standby_word(self, groups: dict[str, dist.ProcessGroup], silent_s: float | None,
                     quiet: bool = False) -> comm.StandbyStatus:
        """What this rank says, in its proposal, of whether its standby can replace ``groups``.
        ``silent_s``: how long the failed step ran before it timed out (None: it failed otherwise,
        hearing from its data path); a data path silent for the data-path timeout may have lost
        a link the standby crosses too, and so may one the heartbeat found quiet on every rank
        (``quiet``)."""
        if self.standby is None:
            return comm.StandbyStatus(self.generation + 1, False,
                                      "no standby" if self.config.standby else "standby off")
        if quiet:
            return comm.StandbyStatus(self.standby.generation, False,
                                      "the heartbeat found every rank's data path quiet (a cut link or a hung "
                                      "collective: the standby's links may be cut too)")
        if silent_s is not None and silent_s >= self.config.data_timeout_s:
            return comm.StandbyStatus(self.standby.generation, False,
                                      f"rank {self.rank}'s data path was silent for {silent_s:.2f} s (a cut "
                                      "link or a stalled peer: the standby's links may be cut too)")
        status = self.standby.status(comm.group_plan(groups), self.config.standby_wait_s)
        if not status.ready:
            status = comm.StandbyStatus(status.generation, False, f"rank {self.rank}'s standby {status.reason}")
        return status

    def standby_verdict(self, decision: Decision) -> tuple[dict[str, dist.ProcessGroup] | None, str]:
        """After ``decision``: the standby's groups, installed, when every rank said in its
        proposal that its standby is ready for the decided generation; else None (the standby
        is discarded). Every rank reads the same words, so every rank gets the same answer. The
        note says which (``used`` / ``built (why)``)."""
        generation = decision.round
        said = {r: comm.StandbyStatus.from_dict(p["standby"]) if isinstance(p.get("standby"), dict) else None
                for r, p in decision.proposals.items()}
        why = comm.standby_refusal(said, generation, self.world_size)
        if not why and (self.standby is None or self.standby.generation != generation):
            why = f"rank {self.rank} holds no standby for generation {generation}"
        if why:
            self.drop_standby()
            return None, f"built ({why})"
        assert self.standby is not None
        groups = self.standby.take(self.store)
        self.standby = None
        return groups, "used"

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
    last_round, generation, _ = control.counters([ROUND_KEY, GENERATION_KEY, GONE_COUNT_KEY])  # made now
    choice = choose_backend(config.vendor, int(os.environ.get("LOCAL_RANK", rank)))
    if choice.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(choice.device))
    spec = comm.GroupSpec(choice.backend.value, choice.device, rank, world, config.data_timeout_s,
                          connect_timeout_s=config.connect_timeout_s, run_id=run_id)
    incarnation = int(os.environ.get("MESHPACT_INCARNATION", "0"))
    session = Session(rank, world, config, store, control, spec, {}, 0, incarnation, shape,
                      tuple(mesh_names) if mesh_names else None,
                      protected_sockets=comm.socket_fds(),
                      store_ports=(int(os.environ["MASTER_PORT"]), control.port),
                      store_addr=(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    if config.peer_copies > 0:  # serving before any proposal, so a holder can always be reached
        from . import peers

        session.peer_server = peers.PeerServer(peers.peer_address(), config.peer_copy_timeout_s)
        session.host = os.environ.get(peers.HOST_ENV, session.peer_server.addr)
        peers.publish(control, peers.PeerAddress(rank, session.host, session.peer_server.addr,
                                                 session.peer_server.port, incarnation))
    session.round_view = (last_round, generation)
    session.emit(EventKind.SESSION_START, backend=choice.to_dict(), incarnation=incarnation)
    if incarnation == 0:
        # every rank is here before any group connects: group creation bounds connecting, not a
        # peer still starting (imports under load), which the store connect bound covers
        control.set(f"arrived/rank{rank}", True)
        control.wait([f"arrived/rank{r}" for r in range(world)], timeout_s=config.store_connect_s)
        session.groups = session.build_generation(0)
    else:  # a replacement: join the recovery in progress; its state comes from a peer or the checkpoint
        ckpt = session.checkpointer()
        t0 = time.perf_counter()
        held = session.peer_server.holds() if session.peer_server is not None else ()
        decision = agree(control, lambda g: Proposal(rank, g, -1, "", False, incarnation, holds=held,
                                                     host=session.host),
                         ckpt.latest if ckpt else (lambda limit: 0), max_rounds=config.max_rounds,
                         peer_copies=config.peer_copies if session.peer_server is not None else 0,
                         replacement_rounds=config.replacement_rounds)
        session.emit(EventKind.DECIDED, Stage.CONSENSUS, seconds=time.perf_counter() - t0, **decision.summary())
        t0 = time.perf_counter()
        session.generation = decision.round
        session.round_view = (decision.round, decision.round)
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
    session.control.set(_ready_key(generation, session.rank), True)
    session.control.wait([_ready_key(generation, r) for r in session.members])
    return time.perf_counter() - t0


def start_barrier(session: Session, idle: Callable[[], object]) -> bool:
    """:func:`resume_barrier` at the start of training, for a rank lost before it got there:
    its replacement opens a recovery round, and ``idle()`` (the runtime's ``join_recovery``),
    called between looks, joins it. Returns whether it did (the recovery's own barrier then
    stood in for this one); a rank that never comes is named after the control channel's bound.
    Polled: a store wait that times out logs a c10d warning each time."""
    keys = [_ready_key(session.generation, r) for r in session.members]
    session.control.set(_ready_key(session.generation, session.rank), True)
    deadline = time.monotonic() + session.control.timeout_s
    looks = 0
    while not session.control.all_present(keys):  # every 10 ms: the ranks leave within about that of each other
        looks += 1
        if looks % 10 == 0 and idle() is not None:  # every 100 ms: a round is opened seconds after a loss
            return True
        if time.monotonic() > deadline:
            ranks = [r for r, k in zip(session.members, keys) if not session.control.all_present([k])]
            raise RuntimeError(
                f"rank(s) {ranks} did not reach the start of training within {session.control.timeout_s:g} s and "
                "no replacement opened a recovery round (a rank lost during start-up is recovered only through its "
                "replacement)")
        time.sleep(0.01)
    return False


def _ready_key(generation: int, rank: int) -> str:
    return f"ready/g{generation}/rank{rank}"
