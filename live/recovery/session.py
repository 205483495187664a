"""The session: one rank's place in a resilient job (stores, control channel, data-path groups, mesh).

:func:`start_session` joins the job from torchrun's environment: it connects to the
rendezvous store and the control channel, builds the generation-0 data-path groups (the
group over every rank and, for an N-D mesh, each dimension's groups) and the
:class:`DeviceMesh` over them. A replacement process instead joins the recovery in
progress: it takes part in consensus and builds the decided generation's groups, the
session's and then those the job's code made after ``start_session`` (:mod:`.usergroups`:
torch's group creation is routed through the session from then on, so a replacement's script
is handed the groups built for it, matched by creation order). The session is returned, never
kept in a module: pass it to
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

import contextlib
import json
import math
import os
import secrets
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import IO, Any, Callable, Iterable, Iterator, Mapping, Sequence

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
from .control import ATTEMPT_KEY, ControlChannel
from .control import join as join_control
from . import device, jobkey, refusal
from .generation import Generation
from .usergroups import UserGroups, route_group_creation

__all__ = [
    "RecoveryConfig",
    "Session",
    "EventLog",
    "DataPath",
    "Generation",
    "start_session",
    "run_id_of",
    "attempt_scope",
    "resume_barrier",
    "start_barrier",
    "build_mesh_groups",
    "mesh_from_groups",
]


class EventLog:
    """A rank's events: kept in memory, appended to its JSONL log (flushed line by line, so the
    log survives SIGKILL) and optionally traced to stderr. Inside :meth:`deferred` events are
    stamped and kept as ever but written only at :meth:`flush` (or when the block ends): a
    recovery's critical path does not encode and write them. A SIGKILL in between loses the
    deferred lines from the log, not from a finished run."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.events: list[Event] = []
        self._file: IO[str] | None = None
        self._deferred: list[Event] | None = None  # events not yet written (inside deferred())

    def attach(self, path: str | os.PathLike[str]) -> None:
        """Write every event so far, and each one from now on, to ``path``."""
        self._file = open(path, "a", encoding="utf-8")
        self._write(self.events)

    def emit(self, kind: EventKind, stage: Stage | None = None, **data: Any) -> Event:
        ev = Event(time.time(), kind, self.rank, stage, data)
        self.events.append(ev)
        if self._deferred is not None:
            self._deferred.append(ev)
        else:
            self._write((ev,))
        return ev

    @contextlib.contextmanager
    def deferred(self) -> Iterator["EventLog"]:
        """Hold events back from the log until :meth:`flush` or the end of the block."""
        if self._deferred is None:
            self._deferred = []
        try:
            yield self
        finally:
            self.flush()

    def flush(self) -> None:
        """Write the deferred events, in order, and write each event as it comes again."""
        deferred, self._deferred = self._deferred, None
        if deferred:
            self._write(deferred)

    def _write(self, events: Sequence[Event]) -> None:
        if self._file is not None and events:
            self._file.write("".join(json.dumps(ev.to_dict(), default=str) + "\n" for ev in events))
            self._file.flush()
        if os.environ.get("MESHPACT_TRACE"):
            for ev in events:
                print(f"[meshpact rank {self.rank}] {ev}", file=sys.stderr, flush=True)


@dataclass
class DataPath:
    """Which sockets are the data path's (severed on a fault): those gloo opened while the job's
    groups were built, told by construction, never by elimination, so the user's own connections
    (opened before or after :func:`start_session`) are never touched.

    Every group's sockets are recorded under its name when it is built: a standby's as its thread
    builds them (:meth:`record`, once it is swapped in), a recovery's from the sockets that
    appeared while it built them. A group the job made itself (``dist.new_group``,
    ``init_device_mesh``) is recorded as torch's group creation makes it (:mod:`.usergroups`
    routes it here), so a connection the user opened before it, ``TCP_NODELAY`` or not, is not
    its; a group c10d knows that no build recorded is told from the sockets that appeared since
    the last look (:meth:`look`: the session's start, each recovery's end). Of those only gloo's
    pairs count (:func:`~.communicator.gloo_pairs`). Where gloo
    connects lazily (``TORCH_GLOO_LAZY_INIT``) no build tells them, and the connected sockets with
    gloo's options opened after ``protected`` that no store or peer port ends are listed instead
    (:func:`~.communicator.data_sockets`)."""

    protected: dict[int, str]  # fd -> socket name, taken before any data-path group existed
    ports: tuple[int, ...]  # the rendezvous store's, the control channel's, the peer servers'
    ends: comm.SocketEnds = field(default_factory=dict)
    built: dict[frozenset[str], dict[int, str]] = field(default_factory=dict)  # group names -> their sockets
    since: dict[int, str] | None = None  # the descriptors at the last look (None: ``protected``)
    lazy: bool = field(default_factory=lambda: os.environ.get("TORCH_GLOO_LAZY_INIT", "").lower() in ("1", "true"))
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def protect_ports(self, ports: Iterable[int]) -> None:
        """Never sever a socket to or from one of ``ports`` (the peers' servers, once known)."""
        self.ports = tuple(sorted(set(self.ports) | set(ports)))

    def record(self, names: Iterable[str], opened: dict[int, str]) -> None:
        """The groups ``names`` were built while the sockets ``opened`` appeared: their gloo pairs
        are those groups' data path."""
        pairs = comm.gloo_pairs(opened, self.ports)
        with self._lock:
            self.built[frozenset(names)] = pairs

    def recorded(self) -> set[str]:
        with self._lock:
            return {name for names in self.built for name in names}

    def look(self, live: Iterable[str]) -> None:
        """Tell the sockets of the ``live`` groups (c10d's, the session's) not recorded yet from
        those that appeared since the last look, forget groups no longer live, and look again
        from now (called where no standby is being built: a recovery's end, the session's start)."""
        live = set(live)
        with self._lock:
            self._tell(live)
            self.built = {names: socks for names, socks in self.built.items() if names & live}
            self.since = comm.socket_fds()

    def _tell(self, live: set[str]) -> None:
        known = {name for names in self.built for name in names}
        fresh = live - known
        if fresh and not self.lazy:
            opened = comm.opened_since(self.protected if self.since is None else self.since)
            self.built[frozenset(fresh)] = comm.gloo_pairs(opened, self.ports)

    def sockets(self, keep: dict[int, str], live: Iterable[str]) -> dict[int, str]:
        """The data path's sockets: those of the ``live`` groups, less ``keep`` (the standby's)."""
        live = set(live)
        if self.lazy:
            return comm.data_sockets({**self.protected, **keep}, self.ports, self.ends)
        with self._lock:
            self._tell(live)
            out: dict[int, str] = {}
            for names, socks in self.built.items():
                if names & live:
                    out.update(socks)
        return {fd: ino for fd, ino in out.items() if keep.get(fd) != ino}


@dataclass
class Standbys:
    """The standby being built (the next generation's groups) and those discarded whose thread
    may still run."""

    building: comm.Standby | None = None
    discarded: list[comm.Standby] = field(default_factory=list)


class Joined:
    """The recovery a replacement process joined at start-up, handed once to the first
    ``resilient()`` that enters (which loads the decided state)."""

    def __init__(self, decision: Decision | None) -> None:
        self._decision = decision

    def take(self) -> Decision | None:
        decision, self._decision = self._decision, None
        return decision


class Session:
    """One rank's place in the job: its identity, the stores, the control channel, and the
    current :class:`~.generation.Generation` of data-path groups.

    After :func:`start_session` returns, the session's fields are fixed but one: ``current``,
    which :meth:`advance` replaces when a recovery makes the next generation. The event log,
    the standby, the socket lists and the user's groups are objects of their own that change inside."""

    _sealed = False

    def __init__(
        self,
        rank: int,
        world_size: int,
        incarnation: int,
        config: RecoveryConfig,
        store: Any,
        store_addr: tuple[str, int],
        control: ControlChannel,
        mesh_shape: tuple[int, ...],
        mesh_names: tuple[str, ...] | None,
        data_path: DataPath,
    ) -> None:
        self.rank = rank  # this process's original rank: control-channel keys, peer copies, logs
        self.world_size = world_size  # the original world
        self.incarnation = incarnation  # 0: the rank's first process; 1..: replacements
        self.config = config
        self.store = store
        self.store_addr = store_addr  # the rendezvous store (a standby connects on its own)
        self.control = control
        self.mesh_shape = mesh_shape
        self.mesh_names = mesh_names
        self.data_path = data_path
        self.log = EventLog(rank)
        self.standbys = Standbys()
        # held while the heartbeat severs and while the runtime swaps in the next generation's
        # groups: a late sever never reaches the new groups' sockets
        self.sever_lock = threading.Lock()
        # sockets this rank shut down for reading, kept open until every rank has left their generation
        # (closing one with data unread would reset the peer's connection: see communicator.sever)
        self.severed = comm.SeveredSockets()
        self.peer_server: Any = None  # peers.PeerServer: holds other ranks' copies (peer_copies > 0)
        self.host = ""  # the host this rank is on, as peer placement sees it
        self.joined = Joined(None)  # a replacement's decision: the recovery it joined at start-up
        self.start_view: tuple[int, int] = (0, 0)  # (last round decided, generation) when the rank started
        # the most restarts any rank's agent counted at the start (torchrun's TORCHELASTIC_RESTART_COUNT): above 0,
        # torchrun restarted the whole job and its state is in the newest checkpoint. One rank's own count is not
        # enough: an agent restarting healthy workers for a node that left counts no restart
        self.job_restarts = 0
        self.current: Generation | None = None
        # the job's secret (jobkey.load); None only where the user opted out by name
        self.job_key: jobkey.JobKey | None = None
        # the groups the job's code makes after start_session, in creation order (matched by a replacement)
        self.user_groups = UserGroups(
            lambda: (self.spec, self.store, self.control, self.generation),
            lambda names, opened: self.data_path.record(names, opened),
        )
        # the device's side of a step (HostOps on the CPU: every fence done at once) and the fences of the
        # steps under way, which the heartbeat counts and an abort of the data path fails
        self.ops: device.DeviceOps = device.HostOps()
        self.progress = device.DeviceProgress()

    def __setattr__(self, name: str, value: Any) -> None:
        if self._sealed:
            raise AttributeError(
                f"Session.{name} is fixed once the session has started (a recovery replaces "
                "only the current generation, through Session.advance)"
            )
        object.__setattr__(self, name, value)

    def seal(self) -> None:
        object.__setattr__(self, "_sealed", True)

    def advance(self, generation: Generation) -> None:
        """Make ``generation`` the current one (the only write a recovery makes to the session).
        Its groups wait up to its spec's data-path timeout (a standby built before the timeout
        was fitted to the job's steps gets the fitted one here)."""
        if self.current is not None and generation.number <= self.current.number:
            raise ValueError(f"generation {generation.number} does not follow generation {self.current.number}")
        comm.set_data_timeout(generation.groups.values(), generation.spec)
        object.__setattr__(self, "current", generation)

    def fit_data_timeout(self, seconds: float) -> None:
        """The data-path timeout fitted to the job's measured steps (the runtime's one other
        write): the current generation's groups wait up to ``seconds`` from their next
        operation, and every later generation is built with it."""
        gen = self.gen
        if seconds == gen.spec.timeout_s:
            return
        fitted = replace(gen, spec=replace(gen.spec, timeout_s=seconds))
        comm.set_data_timeout(fitted.groups.values(), fitted.spec)
        object.__setattr__(self, "current", fitted)

    # -- the current generation ---------------------------------------------------------------
    @property
    def gen(self) -> Generation:
        assert self.current is not None, "the session has no generation yet"
        return self.current

    @property
    def generation(self) -> int:
        return self.gen.number

    @property
    def spec(self) -> comm.GroupSpec:
        return self.gen.spec

    @property
    def groups(self) -> Mapping[str, dist.ProcessGroup]:
        return self.gen.groups

    @property
    def mesh(self) -> Any:
        return self.gen.mesh

    @property
    def members(self) -> tuple[int, ...]:
        """The original ranks in the job now. ``rank`` stays this process's original rank
        (control channel keys, peer copies); its rank in the data-path groups is ``spec.rank``."""
        return self.gen.members

    @property
    def excised(self) -> bool:
        """Whether an excision left the job with fewer ranks than it started with."""
        return len(self.gen.members) < self.world_size

    @property
    def group(self) -> dist.ProcessGroup:
        """The data-path group over every rank."""
        return self.gen.group

    @property
    def view(self) -> tuple[int, int]:
        """(the last round decided, the generation) as this rank last saw them: a recovery's first
        consensus round starts from it instead of reading the counters (consensus.agree's view)."""
        return self.start_view if self.gen.number == 0 else (self.gen.number, self.gen.number)

    # -- the event log ------------------------------------------------------------------------
    @property
    def events(self) -> list[Event]:
        return self.log.events

    def attach_log(self, path: str | os.PathLike[str]) -> None:
        self.log.attach(path)

    def emit(self, kind: EventKind, stage: Stage | None = None, **data: Any) -> Event:
        return self.log.emit(kind, stage, **data)

    def checkpointer(self) -> Checkpointer | None:
        if not self.config.checkpoint_dir:
            return None
        cur = self.current  # None while a replacement joins: the original world's checkpoints
        sub = cur.checkpoint_subdir if cur is not None else ""
        rank, world = (cur.spec.rank, len(cur.members)) if cur is not None else (self.rank, self.world_size)
        directory = os.path.join(self.config.checkpoint_dir, sub) if sub else self.config.checkpoint_dir
        return Checkpointer(directory, rank, world, self.config.checkpoint_every)

    # -- the standby ------------------------------------------------------------------------
    @property
    def standby(self) -> comm.Standby | None:
        return self.standbys.building

    def data_sockets(self) -> dict[int, str]:
        """The data path's sockets to sever on a fault: those the job's live groups opened as they
        were built (:class:`DataPath`), never the stores', the control channel's, the peer
        servers', the standby's or the user's own."""
        return self.data_path.sockets(self.standby.sockets if self.standby is not None else {}, self.live_groups())

    def sever_data_path(self, tell_peers: bool) -> comm.Severance:
        """Make every operation of this generation's data path fail (:func:`~.communicator.sever`).
        ``tell_peers``: the peers learn from these sockets (both directions shut down), where no
        heartbeat hears the recovery opened on the control channel for them; else only this
        rank's reading is shut down and the sockets are held until :meth:`release_severed`."""
        if self.spec.backend == "nccl":  # NCCL's traffic passes no socket of ours: abort its communicators
            self.progress.fail_running()  # first: an aborted kernel returns, and a fence behind it would complete
            device.abort_groups(self.groups.values(), "nccl")
        return comm.sever(self.data_sockets(), None if tell_peers else self.severed)

    def release_severed(self) -> None:
        """Close the sockets severed in generations every rank has left (a full step ran since)."""
        self.severed.release()

    def remember_data_path(self) -> None:
        """Tell the sockets of groups built since the last look (this generation's, a group the
        user made), and look again from now (called where no standby is being built: a
        recovery's end, the session's start)."""
        self.data_path.look(self.live_groups())

    def live_groups(self) -> set[str]:
        """The names of the job's data-path groups now: c10d's and the current generation's."""
        import torch.distributed.distributed_c10d as c10d

        names: set[str] = {pg.group_name for pg in list(c10d._world.pg_map)}
        if self.current is not None:
            names.update(pg.group_name for pg in self.current.groups.values())
        return names

    def start_standby(self, groups: Mapping[str, dist.ProcessGroup]) -> None:
        """Start building the next generation's copy of ``groups`` (every group of the job) in
        the background; every rank starts it at the same point of the job."""
        self.drop_standby()
        if not self.config.standby or self.excised:  # after an excision the groups are built when needed
            return
        host, port = self.store_addr

        def connect() -> Any:
            return open_store(host, port, self.world_size, False, self.config.store_connect_s)

        self.standbys.building = comm.Standby(self.spec, connect, self.generation + 1, comm.group_plan(groups)).start()

    def build_standby_between_steps(self) -> bool:
        """On NCCL, build the standby asked for since the last step, now (the training thread, after
        a commit: no collective of the job runs meanwhile); elsewhere nothing. Whether it built."""
        return self.standby is not None and self.standby.build_between_steps()

    def drop_standby(self) -> None:
        """Discard the standby (its thread, if still running, is joined on :meth:`stop_standby`)."""
        slot = self.standbys
        if slot.building is not None:
            slot.building.discard()
            slot.discarded.append(slot.building)
            slot.building = None
        slot.discarded = [sb for sb in slot.discarded if not sb.join(0.0)]

    def stop_standby(self) -> None:
        """Discard the standby and join every standby thread (each bounded by group creation)."""
        self.drop_standby()
        for sb in self.standbys.discarded:
            sb.join(self.config.connect_timeout_s)
        self.standbys.discarded = []

    def standby_word(
        self, groups: Mapping[str, dist.ProcessGroup], silent_s: float | None, quiet: bool = False
    ) -> comm.StandbyStatus:
        """What this rank says, in its proposal, of whether its standby can replace ``groups``.
        ``silent_s``: how long the failed step ran before it timed out (None: it failed otherwise,
        hearing from its data path); a data path silent for the data-path timeout may have lost
        a link the standby crosses too, and so may one the heartbeat found quiet on every rank
        (``quiet``)."""
        if self.standby is None:
            return comm.StandbyStatus(
                self.generation + 1, False, "no standby" if self.config.standby else "standby off"
            )
        if quiet:
            return comm.StandbyStatus(
                self.standby.generation,
                False,
                "the heartbeat found every rank's data path quiet (a cut link or a hung "
                "collective: the standby's links may be cut too)",
            )
        if silent_s is not None and silent_s >= self.spec.timeout_s:
            return comm.StandbyStatus(
                self.standby.generation,
                False,
                f"rank {self.rank}'s data path was silent for {silent_s:.2f} s (a cut "
                "link or a stalled peer: the standby's links may be cut too)",
            )
        status = self.standby.status(comm.group_plan(dict(groups)), self.config.standby_wait_s)
        if not status.ready:
            status = comm.StandbyStatus(status.generation, False, f"rank {self.rank}'s standby {status.reason}")
        return status

    def standby_verdict(self, decision: Decision) -> tuple[dict[str, dist.ProcessGroup] | None, str]:
        """After ``decision``: the standby's groups, installed, when every rank said in its
        proposal that its standby is ready for the decided generation; else None (the standby
        is discarded). Every rank reads the same words, so every rank gets the same answer. The
        note says which (``used`` / ``built (why)``)."""
        generation = decision.generation
        said = {
            r: comm.StandbyStatus.from_dict(w) if isinstance(w, dict) else None
            for r, w in decision.standby_words().items()
        }
        why = comm.standby_refusal(said, generation, self.world_size)
        if not why and (self.standby is None or self.standby.generation != generation):
            why = f"rank {self.rank} holds no standby for generation {generation}"
        if why:
            self.drop_standby()
            return None, f"built ({why})"
        assert self.standby is not None
        opened = dict(self.standby.sockets)
        groups = self.standby.take(self.store)
        self.data_path.record((pg.group_name for pg in groups.values()), opened)
        self.standbys.building = None
        return groups, "used"

    def build_groups(self, generation: int) -> dict[str, dist.ProcessGroup]:
        """Build ``generation``'s world and mesh-dimension groups (every rank calls it)."""
        return build_groups(self.spec, self.store, generation, self.mesh_shape, self.mesh_names)


def _mesh_ranks(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(math.prod(shape)).reshape(shape)


def _dim_base(names: tuple[str, ...] | None, dim: int, ranks: tuple[int, ...]) -> str:
    label = names[dim] if names else f"dim{dim}"
    return f"meshpact_{label}_{'-'.join(map(str, ranks))}"


def build_groups(
    spec: comm.GroupSpec, store: Any, generation: int, shape: tuple[int, ...], names: tuple[str, ...] | None
) -> dict[str, dist.ProcessGroup]:
    """Build ``generation``'s world and mesh-dimension groups (every rank calls it)."""
    groups = {comm.WORLD: comm.build_group(spec, store, generation)}
    groups.update(build_mesh_groups(spec, store, generation, shape, names))
    return groups


def build_mesh_groups(
    spec: comm.GroupSpec, store: Any, generation: int, shape: tuple[int, ...], names: tuple[str, ...] | None
) -> dict[str, dist.ProcessGroup]:
    """This rank's group along each dimension of an N-D mesh (none for a 1-D mesh: the world
    group is its only dimension). Dimensions are built in order, so every member of a group
    builds it at the same point."""
    if len(shape) == 1:
        return {}
    mesh = _mesh_ranks(shape)
    coords = [int(c) for c in (mesh == spec.rank).nonzero()[0]]
    out = {}
    for dim in range(len(shape)):
        index: list[Any] = list(coords)
        index[dim] = slice(None)
        ranks = tuple(int(r) for r in mesh[tuple(index)].tolist())
        base = _dim_base(names, dim, ranks)
        out[base] = comm.build_group(spec, store, generation, base, ranks)
    return out


def mesh_from_groups(
    groups: Mapping[str, dist.ProcessGroup], device_type: str, shape: tuple[int, ...], names: tuple[str, ...] | None
) -> Any:
    """The DeviceMesh over this generation's groups (its dimensions in order)."""
    from torch.distributed.device_mesh import DeviceMesh

    if len(shape) == 1:
        return DeviceMesh.from_group(groups[comm.WORLD], device_type, mesh_dim_names=names)
    dims = [g for base, g in groups.items() if base != comm.WORLD]
    return DeviceMesh.from_group(
        dims, device_type, _mesh_ranks(shape), mesh_dim_names=names or tuple(f"dim{d}" for d in range(len(shape)))
    )


def run_id_of(env: Mapping[str, str]) -> str:
    """What this process's store keys are kept apart by: ``MESHPACT_RUN_ID`` (set by ``meshpact
    launch`` and the trials), else torchrun's run id (plain ``torchrun``; :func:`start_session`
    adds a word per attempt where the agents share their store), else nothing."""
    return env.get("MESHPACT_RUN_ID") or env.get("TORCHELASTIC_RUN_ID") or ""


def attempt_scope(run_id: str, control: Any, env: Mapping[str, str]) -> str:
    """``run_id``, and under plain ``torchrun`` whose workers share the agents' store
    (``TORCHELASTIC_USE_AGENT_STORE``) a word drawn once per attempt: every attempt after
    ``--max-restarts`` restarted the job meets the keys the last one left in that store (group
    addresses, counters). Torchrun's restart count cannot name the attempt: an agent whose own
    workers were healthy restarts them for a node that left without counting a restart, so two
    nodes of one attempt disagree. The control channel is hosted anew by each attempt's rank 0,
    which writes the attempt's word there first (:func:`~.control.join`), and every rank reads it."""
    if (
        env.get("MESHPACT_RUN_ID")
        or env.get("MESHPACT_CONTROL_PORT")  # a channel that outlives the attempt
        or env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
    ):
        return run_id
    word = control.set_once(ATTEMPT_KEY, secrets.token_hex(6))
    scoped = f"{run_id}.{word}"
    control.rescope(scoped)
    return scoped


def job_key_of(env: Mapping[str, str], run_id: str, world: int) -> jobkey.JobKey | None:
    """This rank's job key (:func:`~.jobkey.load`): the job is named on its host by its run id and
    rendezvous address, and spans hosts where torchrun's ``LOCAL_WORLD_SIZE`` is below the world.
    A launcher that sets no ``LOCAL_WORLD_SIZE`` (``srun`` alone, a hand-written environment) is taken
    to span hosts unless its rendezvous address is this host's loopback: a key made per host would
    differ between hosts, and every signed value from another host would read as forged."""
    identity = f"{run_id}@{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    if env.get("LOCAL_WORLD_SIZE"):
        multi_host = int(env["LOCAL_WORLD_SIZE"]) < world
    else:
        multi_host = world > 1 and not _loopback(env.get("MASTER_ADDR", ""))
    return jobkey.load(env, identity, multi_host=multi_host)


def _loopback(host: str) -> bool:
    import ipaddress

    if host in ("localhost", ""):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def start_session(
    config: RecoveryConfig | None = None,
    mesh_shape: tuple[int, ...] | None = None,
    mesh_names: tuple[str, ...] | None = None,
) -> Session:
    """Join the job described by torchrun's environment and build (or join) the data path.

    ``mesh_shape`` (default: all ranks in one dimension) and ``mesh_names`` describe the
    DeviceMesh; the environment is read here and nowhere deeper (``MESHPACT_RUN_ID`` names
    this run's store keys, ``MESHPACT_INCARNATION`` a replacement process)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    config = (config or RecoveryConfig()).for_world(world)  # peer copies on by default where there are peers
    refusal.install()  # a recovery that cannot happen: one line, and the launcher starts no replacement for it
    shape = tuple(mesh_shape) if mesh_shape else (world,)
    if math.prod(shape) != world:
        raise ValueError(f"a mesh of shape {list(shape)} needs {math.prod(shape)} ranks, the job has {world}")
    names = tuple(mesh_names) if mesh_names else None
    run_id = run_id_of(os.environ)
    key = job_key_of(os.environ, run_id, world)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store_addr = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    store = open_store(*store_addr, world, is_host=(rank == 0 and not agent_store), timeout_s=config.store_connect_s)
    control = join_control(store, rank, world, config.control_timeout_s, run_id, config.store_connect_s, key=key)
    run_id = attempt_scope(run_id, control, os.environ)
    last_round, generation, _ = control.counters([ROUND_KEY, GENERATION_KEY, GONE_COUNT_KEY])  # made now
    choice = choose_backend(config.vendor, int(os.environ.get("LOCAL_RANK", rank)))
    if choice.device.startswith("cuda"):
        # before CUDA and NCCL start: the cuBLAS workspace for bit-identity, and a watchdog that aborts a
        # failed communicator but keeps the process (and the peer copies it holds)
        session_said = device.deterministic(True, "cuda").said
        os.environ.update(device.nccl_worker_env(os.environ))
        torch.cuda.set_device(torch.device(choice.device))
    else:
        session_said = ""
    spec = comm.GroupSpec(
        choice.backend.value,
        choice.device,
        rank,
        world,
        config.data_timeout_start_s,
        connect_timeout_s=config.connect_timeout_s,
        run_id=run_id,
    )
    incarnation = int(os.environ.get("MESHPACT_INCARNATION", "0"))
    session = Session(
        rank,
        world,
        incarnation,
        config,
        store,
        store_addr,
        control,
        shape,
        names,
        DataPath(comm.socket_fds(), (store_addr[1], control.port)),
    )
    session.start_view = (last_round, generation)
    session.job_key = key
    session.ops = device.device_ops(choice.device)
    assert config.peer_copies is not None  # RecoveryConfig.for_world settled it
    if config.peer_copies > 0:  # serving before any proposal, so a holder can always be reached
        from . import peers

        session.peer_server = peers.PeerServer(
            peers.peer_address(),
            config.peer_copy_timeout_s,
            config.peer_copy_depth,
            key=key.derive("peer") if key is not None else None,
        )
        session.host = os.environ.get(peers.HOST_ENV, session.peer_server.addr)
        peers.publish(
            control,
            peers.PeerAddress(rank, session.host, session.peer_server.addr, session.peer_server.port, incarnation),
        )
    said: dict[str, Any] = {"device": session_said} if session_said else {}
    session.emit(EventKind.SESSION_START, backend=choice.to_dict(), incarnation=incarnation, **said)
    if incarnation == 0:
        # every rank is here before any group connects: group creation bounds connecting, not a
        # peer still starting (imports under load), which the store connect bound covers
        control.set(f"arrived/rank{rank}", int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0))
        arrived = control.wait([f"arrived/rank{r}" for r in range(world)], timeout_s=config.store_connect_s)
        session.job_restarts = max(int(v) for v in arrived.values())
        number = 0
    else:  # a replacement: join the recovery in progress; its state comes from a peer or the checkpoint
        ckpt = session.checkpointer()
        t0 = time.perf_counter()
        held = session.peer_server.holds() if session.peer_server is not None else ()
        decision = agree(
            control,
            lambda g: Proposal(rank, g, -1, "", False, incarnation, holds=held, host=session.host),
            ckpt.latest if ckpt else (lambda limit: 0),
            max_rounds=config.max_rounds,
            peer_copies=config.peer_copies if session.peer_server is not None else 0,
            replacement_rounds=config.replacement_rounds,
        ).decision
        session.emit(EventKind.DECIDED, Stage.CONSENSUS, seconds=time.perf_counter() - t0, **decision.summary())
        session.joined = Joined(decision)
        number = decision.generation
    t0 = time.perf_counter()
    groups = build_groups(spec, store, number, shape, names)
    if incarnation > 0:  # then the user's groups, in the order the survivors rebuild them (comm.build_order)
        made = session.user_groups.prebuild(spec, store, control, number)
        session.emit(
            EventKind.REBUILT,
            Stage.COMMUNICATOR,
            seconds=time.perf_counter() - t0,
            action=CommunicatorAction.REBUILD.value,
            generation=number,
            user_groups=made,
        )
    c10d_default(groups[comm.WORLD])  # the mesh asks c10d's default group for this rank
    mesh = mesh_from_groups(groups, choice.device.split(":")[0], shape, names)
    session.advance(Generation(number, spec, groups, mesh, tuple(range(world))))
    session.remember_data_path()  # before any standby is built
    route_group_creation(session.user_groups, spec.backend)  # the job's own groups, made from here on
    session.seal()
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
                "replacement)"
            )
        time.sleep(0.01)
    return False


def _ready_key(generation: int, rank: int) -> str:
    return f"ready/g{generation}/rank{rank}"
