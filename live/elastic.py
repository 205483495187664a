"""``meshpact launch``: torchrun's command line on torch.distributed.elastic, replacing one worker, not the job.

One agent per node, as under ``torchrun``: it joins elastic's rendezvous (``c10d``, ``static``
or any registered backend, through :class:`~torch.distributed.elastic.agent.server.api.WorkerSpec`
and its ``rdzv_handler``), is given its workers' ranks by elastic's rank assignment, and starts
them with torchrun's worker environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``GROUP_RANK``, ``ROLE_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` of the store
the rendezvous shares, ``TORCHELASTIC_*``, an error file per worker that elastic's ``@record``
writes). It differs from torchrun's agent in one decision:

| a worker exits with an error | torchrun (``LocalElasticAgent``) | :class:`ReplacingAgent` |
|---|---|---|
| the other workers | SIGTERM, on every node | keep running, memory and all |
| the failed rank | the whole group restarted, all ranks from scratch | one process started for it: same rank, ``MESHPACT_INCARNATION`` + 1 |
| ``--max-restarts`` | group restarts | replacement processes, on this node |
| none left | the job fails | the rank is announced gone to the job (it excises, or ends naming why) |

The recovery runtime learns of the loss from the job itself: its survivors meet
the dead peer in a collective, agree over the control channel (which this agent hosts, on the
node of group rank 0, so a dead rank 0 takes nothing with it) and the replacement joins the
recovery as a process with ``MESHPACT_INCARNATION`` above 0 (:func:`~.recovery.session.start_session`).
The agent also plays the launcher's other two parts in consensus: a rank the job declares lost
(silent for the rank-loss bound) is killed here and replaced; a rank it can give no process
again is marked gone (:func:`~.recovery.consensus.mark_gone`), so the survivors excise it or end
with the reason instead of waiting.

Warm spares (``--spare-ranks-per-node N``): N interpreters per node with torch imported
(:mod:`~meshpact.live.warmspare`), each promoted to a failed worker's rank by one file.

A lost node (its agent silent for ``--node-loss-s``) is announced by group rank 0's agent. A
*spare node* (``meshpact launch --spare``, :class:`SpareAgent`) can take its place: it joins no
rendezvous round (the job's world size is what its nodes make), but reads the control channel's
address from the rendezvous endpoint's store (group rank 0 writes it there under
:func:`standby_key`), registers on the channel and beats there. Group rank 0's verdict on a lost
node (:func:`choose_spare`) hands the node's group rank to a live spare node with the same
``--nproc-per-node`` instead of announcing its ranks gone; the spare starts the node's workers
from the worker environment every agent publishes (:class:`NodeEnv`), with incarnations above
the lost processes' and its own address, and from then on is that node's agent. While it stands by
it keeps one warm interpreter per worker (as ``--spare-ranks-per-node`` does), promoted to the
node's ranks on the takeover.

Plain ``torchrun`` keeps working with the same scripts: without ``MESHPACT_CONTROL_PORT`` rank 0
hosts the control channel, and a kill ends the job as torchrun decides.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from argparse import ArgumentParser, Namespace
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import (RunResult, SimpleElasticAgent, Worker, WorkerGroup, WorkerSpec,
                                                         WorkerState)
from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, record
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousGracefulExitError
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import _get_addr_and_port
from torch.distributed.run import config_from_args, get_args_parser, parse_min_max_nnodes

from meshpact.core.errors import MeshpactError

from .recovery.consensus import ROUND_KEY, declared_lost, mark_gone
from .recovery import jobkey
from .recovery.control import ControlChannel
from .recovery.peers import ADDR_ENV, HOST_ENV
from .store import host_store
from .warmspare import Assignment, assign, ready_path

__all__ = ["FixedRendezvous", "LaunchOptions", "NodeLoss", "NodeEnv", "SpareNode", "NodeVerdict", "choose_spare", "ReplacingAgent",
           "SpareAgent", "StandbyRendezvous", "standby_key", "LaunchRefused", "parser", "main", "CONTROL_KEY", "launch_key",
           "rendezvous_handler"]

logger = logging.getLogger("meshpact.launch")

NODES_CHANGED_KEY = "agent/nodes_changed"  # on the control channel: group rank 0 lost a node or gave it to a spare
CONTROL_KEY = "meshpact/control"  # in the rendezvous store: "host:port" of the control channel
SPARE_COUNT_KEY = "spare/count"  # on the control channel: how many spare nodes registered (each takes the next number)
JOB_ENDED_KEY = "agent/ended"  # on the control channel: group rank 0 passed its exit barrier (spare nodes leave)
_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


class LaunchRefused(MeshpactError):
    """A command line ``meshpact launch`` cannot run; the message names the flag and what it expects."""


class HostNodeLost(MeshpactError):
    """The node of group rank 0 (its agent hosts the job's rendezvous store and control channel) is gone:
    the other nodes cannot go on without those stores, and say so instead of waiting."""


class NoJobFound(MeshpactError):
    """A spare node found no job at its ``--rdzv-endpoint`` under its ``--rdzv-id`` within the join timeout."""


@dataclass(frozen=True)
class LaunchOptions:
    """What ``meshpact launch`` adds to torchrun's command line."""

    spare_ranks_per_node: int = 0
    spare: bool = False  # this agent is a spare node: it stands by to take a lost node's ranks
    node_loss_s: float = 5.0  # a node whose agent has not beaten on the control channel for this long is lost
    loss_watch_s: float = 0.25  # how often the agent reads which ranks the job declared lost, and beats
    # the job key its workers get in their environment and its control channel signs with (None: the job
    # opted out, MESHPACT_UNAUTHENTICATED=1); see launch_key
    job_key: jobkey.JobKey | None = None

    def __post_init__(self) -> None:
        if self.spare_ranks_per_node < 0:
            raise LaunchRefused(f"--spare-ranks-per-node {self.spare_ranks_per_node}: expected 0 or more")
        if not self.node_loss_s > 4 * self.loss_watch_s:
            raise LaunchRefused(f"--node-loss-s {self.node_loss_s}: expected more than {4 * self.loss_watch_s:g} s "
                                f"(four of the agents' beats, one every {self.loss_watch_s:g} s)")


@dataclass(frozen=True)
class NodeLoss:
    """Group rank 0's verdict on a node whose agent fell silent: which ranks went with it, and why."""

    group_rank: int
    ranks: tuple[int, ...]
    silent_s: float

    def describe(self) -> str:
        return (f"{self.what()}; the job is told its ranks are gone (it excises them where it can, above its "
                f"min_ranks, or ends naming why)")

    def what(self) -> str:
        return (f"node {self.group_rank} (ranks {list(self.ranks)}) is lost: its agent has not beaten on the "
                f"control channel for {self.silent_s:.1f} s")


@dataclass(frozen=True)
class NodeEnv:
    """The worker environment of one node's group rank, less what is each process's own (incarnation,
    node address, error file): what its agent publishes on the control channel (``agent/node<g>``) at
    start, so a spare node that takes the group rank starts the same workers."""

    group_rank: int
    group_world_size: int
    role: str
    ranks: tuple[int, ...]  # the global rank of each local rank
    role_ranks: tuple[int, ...]
    world_size: int
    role_world_size: int
    master_addr: str
    master_port: int
    run_id: str  # TORCHELASTIC_RUN_ID: the rendezvous id
    use_agent_store: bool

    @classmethod
    def of(cls, wg: WorkerGroup) -> "NodeEnv":
        spec = wg.spec
        return cls(wg.group_rank, wg.group_world_size, spec.role, tuple(w.global_rank for w in wg.workers),
                   tuple(w.role_rank for w in wg.workers), wg.workers[0].world_size, wg.workers[0].role_world_size,
                   str(wg.master_addr), int(wg.master_port), str(spec.rdzv_handler.get_run_id()),
                   bool(spec.rdzv_handler.use_agent_store))

    def workers(self) -> list[Worker]:
        return [Worker(lr, r, rr, self.world_size, self.role_world_size)
                for lr, (r, rr) in enumerate(zip(self.ranks, self.role_ranks))]

    def to_dict(self) -> dict[str, Any]:
        return {"group_rank": self.group_rank, "group_world_size": self.group_world_size, "role": self.role,
                "ranks": list(self.ranks), "role_ranks": list(self.role_ranks), "world_size": self.world_size,
                "role_world_size": self.role_world_size, "master_addr": self.master_addr,
                "master_port": self.master_port, "run_id": self.run_id, "use_agent_store": self.use_agent_store}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NodeEnv":
        return cls(int(d["group_rank"]), int(d["group_world_size"]), str(d["role"]), tuple(int(r) for r in d["ranks"]),
                   tuple(int(r) for r in d["role_ranks"]), int(d["world_size"]), int(d["role_world_size"]),
                   str(d["master_addr"]), int(d["master_port"]), str(d["run_id"]), bool(d["use_agent_store"]))


@dataclass(frozen=True)
class SpareNode:
    """A spare node's registration on the control channel (``spare/node<id>``)."""

    spare_id: int  # its number among the job's spare nodes, from 1 (the channel's ``spare/count``)
    addr: str  # the node's address (--local-addr)
    nproc_per_node: int
    pid: int  # its agent's process

    def __str__(self) -> str:
        return f"spare node {self.spare_id} at {self.addr}"

    def to_dict(self) -> dict[str, Any]:
        return {"spare_id": self.spare_id, "addr": self.addr, "nproc_per_node": self.nproc_per_node, "pid": self.pid}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SpareNode":
        return cls(int(d["spare_id"]), str(d["addr"]), int(d["nproc_per_node"]), int(d["pid"]))


@dataclass(frozen=True)
class NodeVerdict:
    """What group rank 0's agent does with a lost node: hand its group rank to ``spare``, or (None)
    announce its ranks gone; ``passed_over`` names each registered spare node not used, and why."""

    loss: NodeLoss
    spare: SpareNode | None
    passed_over: tuple[str, ...] = ()

    def describe(self) -> str:
        others = f" ({'; '.join(self.passed_over)})" if self.passed_over else ""
        if self.spare is not None:
            return f"{self.loss.what()}; {self.spare} takes its ranks{others}"
        why = (f"no registered spare node can take its ranks{others}" if self.passed_over
               else "no spare node is registered")
        return f"{self.loss.what()}; {why}; the job is told its ranks are gone (it excises them where it can, above " \
               "its min_ranks, or ends naming why)"


def choose_spare(loss: NodeLoss, nproc_per_node: int, spares: Sequence[SpareNode], live: Collection[int],
                 node_loss_s: float) -> NodeVerdict:
    """The verdict on ``loss``: the first registered spare node (lowest number) that is ``live``
    (beating within ``node_loss_s``) and runs ``nproc_per_node`` workers; every other one is named
    with the reason it was not used."""
    chosen: SpareNode | None = None
    passed: list[str] = []
    for spare in sorted(spares, key=lambda s: s.spare_id):
        if spare.nproc_per_node != nproc_per_node:
            passed.append(f"{spare} runs {spare.nproc_per_node} worker(s) per node, the job {nproc_per_node}")
        elif spare.spare_id not in live:
            passed.append(f"{spare} has not beaten within {node_loss_s:g} s")
        elif chosen is None:
            chosen = spare
    return NodeVerdict(loss, chosen, tuple(passed))


def standby_key(rdzv_id: str) -> str:
    """The key, in the rendezvous endpoint's own store (under no prefix of elastic's), where group
    rank 0's agent names the control channel for spare nodes: a JSON ``{"control": "host:port",
    "run_id": ...}``."""
    return f"meshpact/standby/{rdzv_id}"


@dataclass
class _Running:
    """The process a local rank has now (its first, a replacement, or a promoted spare)."""

    handler: Any  # torch.distributed.elastic's SubprocessHandler
    incarnation: int
    error_file: str
    warm: bool = False
    _pidfd: int | None = field(default=None, repr=False)

    @property
    def pid(self) -> int:
        return int(self.handler.proc.pid)

    def pidfd(self) -> int | None:
        """A descriptor that turns readable when the process exits (None where the kernel has no pidfds)."""
        if self._pidfd is None and hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(self.pid)
            except OSError:  # already reaped, or no pidfd support
                return None
        return self._pidfd

    def close(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


@dataclass
class _Spare:
    handler: Any
    assignment: Path
    started: float  # monotonic time it was started
    ready: bool = False  # its imports are done (:func:`~meshpact.live.warmspare.ready_path` exists)


@dataclass
class _SpareWatch:
    """Group rank 0's view of one registered spare node: its beat count and when it last moved."""

    node: SpareNode
    beats: int
    moved: float | None = None  # monotonic time its beat last moved while watched (None: not yet)

    def live(self, now: float, node_loss_s: float) -> bool:
        return self.moved is not None and now - self.moved <= node_loss_s


@dataclass
class _Ledger:
    """The agent's record of its workers: what each runs, which finished, which are gone."""

    running: dict[int, _Running] = field(default_factory=dict)  # local rank -> its process
    finished: set[int] = field(default_factory=set)  # local ranks whose process exited 0
    gone: dict[int, Any] = field(default_factory=dict)  # local rank -> the ProcessFailure it was left with
    replaced: int = 0


def _stoppable(wait: Callable[[], None]) -> None:
    """Run ``wait`` (a rendezvous, a spare node's standing by) on a thread of its own and look every
    0.2 s whether it ended, so that the agent stays stoppable: a store waits in native code, where
    Python runs no signal handler until it returns (SIGTERM or Ctrl-C was held until the join
    timeout, 600 s by default). A signal ends the agent as at any other point, and the waiting
    thread goes with the process; what ``wait`` raised is raised here."""
    done: list[BaseException | None] = []

    def run() -> None:
        try:
            wait()
            done.append(None)
        except BaseException as exc:  # noqa: BLE001 (re-raised on the agent's own thread)
            done.append(exc)

    waiter = threading.Thread(target=run, name="meshpact-rendezvous", daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(0.2)
    if done and done[0] is not None:
        raise done[0]


class ReplacingAgent(SimpleElasticAgent):
    """torch.distributed.elastic's agent for one node, replacing a failed worker alone (see the module
    docstring); the rendezvous, rank assignment, exit barrier and error records are elastic's own."""

    def __init__(self, spec: WorkerSpec, logs_specs: Any, options: LaunchOptions, exit_barrier_timeout: float = 300,
                 shutdown_timeout: int = 30) -> None:
        super().__init__(spec, exit_barrier_timeout, shutdown_timeout)
        self._logs_specs = logs_specs
        self._options = options
        self._ledger = _Ledger()
        self._spares: list[_Spare] = []
        self._spares_started = 0
        self._control_server: Any = None
        self._channel: ControlChannel | None = None
        self._control: tuple[str, int] = ("", 0)  # the control channel's address
        self._attempt_dir: Path | None = None
        self._spare_dir = Path(tempfile.mkdtemp(prefix="meshpact-spares-"))
        self._streams: dict[int, tuple[str, str]] = {}  # local rank -> (stdout, stderr) of its first process
        self._next_watch = 0.0
        self._beats: dict[int, tuple[int, float]] = {}  # group rank -> (its beat count, when it last moved)
        self._node: NodeEnv | None = None  # the worker environment of this agent's group rank
        self._spare_nodes: dict[int, _SpareWatch] = {}  # group rank 0: spare nodes registered and not yet used
        self._spare_nodes_seen = 0  # group rank 0: the spare count last read
        self.lost_nodes: list[NodeLoss] = []  # nodes whose ranks were announced gone
        self.takeovers: list[NodeVerdict] = []  # nodes whose group rank went to a spare node
        self._seen_round = 0
        self._channel_down_since: float | None = None  # when the control channel last stopped answering

    # -- addresses and the control channel ------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """elastic's rendezvous, waited for on a thread of its own (:func:`_stoppable`)."""
        _stoppable(lambda: super(ReplacingAgent, self)._rendezvous(worker_group))

    def _node_addr(self) -> str:
        return self._worker_group.spec.local_addr or socket.getfqdn()

    given_control: tuple[str, int] | None = None  # a control channel hosted by whoever runs the agent

    def _open_control(self, wg: WorkerGroup) -> None:
        """Group rank 0 hosts the control channel (or takes :attr:`given_control`) and names it in the
        rendezvous store."""
        if self._channel is not None:
            return
        if wg.group_rank == 0:
            if self.given_control is not None:
                address = "{}:{}".format(*self.given_control)
            else:
                self._control_server = host_store(wg.master_addr, 0, wg.workers[0].world_size)
                address = f"{wg.master_addr}:{self._control_server.port}"
            wg.store.set(CONTROL_KEY, address)
            standby = {"control": address, "run_id": self._run_id()}  # for spare nodes, outside elastic's prefix
            _root_store(wg.store).set(standby_key(str(wg.spec.rdzv_handler.get_run_id())), json.dumps(standby))
        host, _, port = wg.store.get(CONTROL_KEY).decode().rpartition(":")
        self._control = (host, int(port))
        self._channel = ControlChannel(host, int(port), wg.group_rank, wg.workers[0].world_size, 5.0,
                                       run_id=self._run_id(), key=self._options.job_key)

    def _run_id(self) -> str:
        return os.environ.get("MESHPACT_RUN_ID") or str(self._worker_group.spec.rdzv_handler.get_run_id())

    # -- the worker environment ---------------------------------------------------------
    def _env(self, wg: WorkerGroup, local_rank: int, incarnation: int) -> dict[str, str]:
        spec = wg.spec
        worker = wg.workers[local_rank]
        node = self._node or NodeEnv.of(wg)
        host, port = self._control
        env = {
            "RANK": str(worker.global_rank),
            "GROUP_RANK": str(wg.group_rank),
            "ROLE_RANK": str(worker.role_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker.world_size),
            "GROUP_WORLD_SIZE": str(wg.group_world_size),
            "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": wg.master_addr,
            "MASTER_PORT": str(wg.master_port),
            "TORCHELASTIC_RESTART_COUNT": "0",  # the group is never restarted: replacements count below
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": node.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": str(node.use_agent_store),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "MESHPACT_INCARNATION": str(incarnation),
            "MESHPACT_RUN_ID": self._run_id(),
            "MESHPACT_CONTROL_ADDR": host,
            "MESHPACT_CONTROL_PORT": str(port),
        }
        key = self._options.job_key
        # the key goes to the workers in their environment (readable by this user alone), never through a store
        env.update({jobkey.KEY_ENV: key.secret.hex()} if key is not None else {jobkey.UNAUTHENTICATED_ENV: "1"})
        env.setdefault(ADDR_ENV, os.environ.get(ADDR_ENV) or _bind_address(self._node_addr()))
        env.setdefault(HOST_ENV, os.environ.get(HOST_ENV) or f"node{wg.group_rank}:{self._node_addr()}")
        iface = _iface_of(spec.local_addr) if spec.local_addr and "GLOO_SOCKET_IFNAME" not in os.environ else None
        if iface is not None:  # gloo finds its address from the host name otherwise: loopback on many hosts
            env["GLOO_SOCKET_IFNAME"] = iface
        for name in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
            if name in os.environ:
                env[name] = os.environ[name]
        env.update(self._worker_env(worker.global_rank))
        return env

    def _worker_env(self, rank: int) -> dict[str, str]:
        """What an agent run inside another program adds to ``rank``'s environment (nothing here)."""
        return {}

    # -- starting ------------------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        spec = worker_group.spec
        self._open_control(worker_group)
        if self._node is None:  # a member of the rendezvous: its node's environment, for a spare node to take
            self._node = NodeEnv.of(worker_group)
            assert self._channel is not None
            self._channel.set(f"agent/node{worker_group.group_rank}", self._node.to_dict())
        first = {w.local_rank: self._first_incarnation(w.local_rank) for w in worker_group.workers}
        envs = {w.local_rank: self._env(worker_group, w.local_rank, first[w.local_rank]) for w in worker_group.workers}
        dest = self._logs_specs.reify(envs)  # error files (TORCHELASTIC_ERROR_FILE) and log files, elastic's layout
        first_error = dest.error_files.get(0, os.devnull)
        self._attempt_dir = Path(first_error).parent.parent if first_error != os.devnull else None
        for w in worker_group.workers:
            lr = w.local_rank
            self._streams[lr] = (dest.stdouts.get(lr, ""), dest.stderrs.get(lr, ""))
            if first[lr]:
                self._note_incarnation(w.global_rank, first[lr])
            self._ledger.running[lr] = self._launch(spec, lr, envs[lr], self._streams[lr],
                                                    dest.error_files.get(lr, os.devnull), first[lr],
                                                    warm=self.warm_first)
        for _ in range(self._options.spare_ranks_per_node):
            self._start_spare()
        return {lr: r.pid for lr, r in self._ledger.running.items()}

    warm_first = False  # whether a first process is a warm spare's promotion where one is alive (a spare node's)

    def _launch(self, spec: WorkerSpec, local_rank: int, env: dict[str, str], streams: tuple[str, str],
                error_file: str, incarnation: int, warm: bool) -> _Running:
        """Start ``local_rank``'s process: a warm spare promoted (``warm``, and one is alive, the ready first),
        else a new process."""
        alive = [s for s in self._spares if s.handler.proc.poll() is None] if warm else []
        spare = next((s for s in alive if s.ready or ready_path(s.assignment).exists()), alive[0] if alive else None)
        if spare is not None:
            self._spares.remove(spare)
            assign(spare.assignment, Assignment(env, tuple(str(a) for a in spec.args), *streams))
            return _Running(spare.handler, incarnation, error_file, warm=True)
        return _Running(self._start_process(spec, local_rank, env, streams, incarnation), incarnation, error_file)

    def _start_process(self, spec: WorkerSpec, local_rank: int, env: dict[str, str], streams: tuple[str, str],
                       incarnation: int) -> Any:
        """A new process for ``local_rank`` (elastic's subprocess handler: ``.proc`` and ``.close``)."""
        return get_subprocess_handler(spec.entrypoint, tuple(spec.args), env, streams[0], streams[1], local_rank,
                                      spec.numa_options)

    def _first_incarnation(self, local_rank: int) -> int:
        """The incarnation of the first process this agent starts for ``local_rank`` (0: the rank's first)."""
        return 0

    def _note_incarnation(self, rank: int, incarnation: int) -> None:
        """Say on the control channel that ``rank`` runs at ``incarnation`` now (before the process starts),
        so a spare node that takes this node starts the rank above it."""
        try:
            assert self._channel is not None
            self._channel.set(f"agent/incarnation/rank{rank}", incarnation)
        except (RuntimeError, OSError) as exc:  # the channel's host gone: the job is ending, no spare reads this
            logger.warning("meshpact launch: cannot write rank %d's incarnation (%s)", rank, exc)

    def _start_spare(self) -> None:
        index = self._spares_started
        self._spares_started += 1
        path = self._spare_dir / f"spare-{index}.json"
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        handler = get_subprocess_handler(sys.executable, ("-u", "-m", "meshpact.live.warmspare", str(path)), env,
                                         "", "", index, None)
        self._spares.append(_Spare(handler, path, time.monotonic()))

    def _files_of(self, local_rank: int, incarnation: int) -> tuple[str, str, str]:
        """(stdout, stderr, error file) of a replacement: beside the first process's, in ``<rank>.<k>/``."""
        if self._attempt_dir is None:
            return "", "", os.devnull
        d = self._attempt_dir / f"{local_rank}.{incarnation}"
        d.mkdir(parents=True, exist_ok=True)
        out, err = self._streams[local_rank]
        return (str(d / "stdout.log") if out else "", str(d / "stderr.log") if err else "", str(d / "error.json"))

    def _replace(self, wg: WorkerGroup, local_rank: int) -> _Running:
        """Start a process for ``local_rank`` (its old one has exited): a warm spare if one waits."""
        spec = wg.spec
        incarnation = self._ledger.running[local_rank].incarnation + 1
        self._note_incarnation(wg.workers[local_rank].global_rank, incarnation)
        env = self._env(wg, local_rank, incarnation)
        out, err, error_file = self._files_of(local_rank, incarnation)
        env["TORCHELASTIC_ERROR_FILE"] = "" if error_file == os.devnull else error_file
        running = self._launch(spec, local_rank, env, (out, err), error_file, incarnation, warm=True)
        self._ledger.running[local_rank] = running
        self._ledger.replaced += 1
        return running

    # -- watching ------------------------------------------------------------------------
    def _watch(self, wg: WorkerGroup) -> RunResult | None:
        """One look at the workers: replace the failed, kill the declared lost; the group's end, or None."""
        ledger = self._ledger
        for lr, running in list(ledger.running.items()):
            if lr in ledger.finished or lr in ledger.gone:
                continue
            rc = running.handler.proc.poll()
            if rc is None:
                continue
            if rc == 0:
                running.close()
                ledger.finished.add(lr)
                continue
            running.close()
            failure = ProcessFailure(lr, running.pid, rc, running.error_file)
            rank = wg.workers[lr].global_rank
            if self._remaining_restarts > 0 and self._should_replace(rank, rc):
                self._remaining_restarts -= 1
                new = self._replace(wg, lr)
                self._replaced(rank, rc, new)
                _say(f"rank {rank} (pid {failure.pid}) exited with {rc}: {failure.message or 'no error file'}; "
                     f"replaced by pid {new.pid} ({'a warm spare' if new.warm else 'a new process'}, "
                     f"incarnation {new.incarnation}; {self._remaining_restarts} replacement(s) left on this node)")
            else:
                ledger.gone[lr] = failure
                self._left_gone(rank, rc)
                _say(f"rank {rank} (pid {failure.pid}) exited with {rc} and no replacement is "
                     f"{'left (--max-restarts ' + str(wg.spec.max_restarts) + ')' if self._remaining_restarts <= 0 else 'started for this exit'}"
                     ": the job is told it is gone")
        self._kill_declared_lost(wg)
        self._note_ready_spares()
        if len(ledger.finished) + len(ledger.gone) < len(wg.workers):
            self._tick()  # after the exits are collected: a job that just ended is not past its deadline
            return None
        if (not ledger.finished and wg.group_rank != 0 and self.given_control is None and self._channel is not None
                and not self._channel.answers()):
            # every worker failed and node 0's channel does not answer: node 0's agent is gone (its node lost,
            # or its own workers failed first and it ended); said beside elastic's record of the failures
            host, port = self._control
            _say(f"the control channel node 0's agent hosts at {host}:{port} does not answer: node 0's agent is gone "
                 "(its node lost, or its job ended there: see node 0's log); no other node can take its stores over")
        if ledger.finished:  # the gone ranks' failures too: elastic's records name every worker of the group
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={wg.workers[lr].global_rank: None for lr in sorted(ledger.finished)},
                             failures={wg.workers[lr].global_rank: f for lr, f in ledger.gone.items()})
        return RunResult(state=WorkerState.FAILED,
                         failures={wg.workers[lr].global_rank: f for lr, f in ledger.gone.items()})

    def _should_replace(self, rank: int, returncode: int) -> bool:
        """Whether a failed worker gets a replacement while some are left (here: any failure, as a job's
        workers fail in many ways; an agent run by a trial replaces only the processes its faults kill)."""
        return True

    def _tick(self) -> None:
        """Every look at the workers, before it (an agent run inside another program does its own part here)."""

    def _replaced(self, rank: int, returncode: int, new: _Running) -> None:
        """``rank``'s process exited with ``returncode`` and ``new`` runs it now."""

    def _left_gone(self, rank: int, returncode: int) -> None:
        """``rank``'s process exited with ``returncode`` and no replacement is left: the job is told it is gone."""
        try:
            mark_gone(self._channel, rank)
        except (RuntimeError, OSError) as exc:  # the channel's host gone: the next look says what that means
            _say(f"cannot tell the job that rank {rank} is gone: the control channel did not answer "
                 f"({str(exc).splitlines()[0]})")

    def _note_ready_spares(self) -> None:
        """Say once when each spare has finished importing (from then on a promotion starts the script at once)."""
        for s in self._spares:
            if not s.ready and ready_path(s.assignment).exists():
                s.ready = True
                _say(f"warm spare pid {s.handler.proc.pid} is ready ({time.monotonic() - s.started:.1f} s after its "
                     "start)")

    def _kill_declared_lost(self, wg: WorkerGroup) -> None:
        """A rank the job declared lost (silent for the rank-loss bound) is killed; the next look replaces it."""
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + self._options.loss_watch_s
        try:
            self._beat_and_watch_nodes(wg, now)
            lost = declared_lost(self._channel, self._seen_round)
        except (RuntimeError, OSError) as exc:  # the channel's host (node 0) gone: nothing to learn from it now
            self._channel_unreachable(wg, now, exc)
            return
        self._channel_down_since = None
        mine = {w.global_rank: w.local_rank for w in wg.workers}
        for round_, ranks in sorted(lost.items()):
            self._seen_round = max(self._seen_round, round_)
            for rank in ranks:
                lr = mine.get(rank)
                if lr is None or lr in self._ledger.finished or lr in self._ledger.gone:
                    continue
                running = self._ledger.running[lr]
                if running.handler.proc.poll() is None:
                    _say(f"rank {rank} (pid {running.pid}) was declared lost by the job in round {round_}: killed")
                    _kill(running.handler.proc)

    def _channel_unreachable(self, wg: WorkerGroup, now: float, exc: Exception) -> None:
        """The control channel did not answer. Hosted by group rank 0's agent: once it has not answered for
        ``--node-loss-s``, that node is lost, and with it the job's stores (group rank 0 is not replaced:
        its agent hosts them), so this node ends its workers and says why in one line."""
        if self._channel_down_since is None:
            self._channel_down_since = now
            logger.warning("meshpact launch: cannot read the control channel (%s)", exc)
        silent = now - self._channel_down_since
        if wg.group_rank != 0 and self.given_control is None and silent > self._options.node_loss_s:
            raise self._host_node_lost(silent, exc)

    def _host_node_lost(self, silent: float, exc: Exception) -> HostNodeLost:
        host, port = self._control
        return HostNodeLost(
            f"node 0 is lost: the control channel node 0's agent hosts at {host}:{port} has not answered for "
            f"{silent:.1f} s (last: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}). "
            "Node 0 hosts the job's rendezvous store and control channel, which no other node can take over: "
            "this node's workers are stopped; start the job again (it resumes from its newest checkpoint)")

    def _beat_and_watch_nodes(self, wg: WorkerGroup, now: float) -> None:
        """Beat on the control channel; group rank 0 also watches the other agents' beats and tells the
        job the ranks of a node whose agent fell silent are gone (an agent that finished says so first)."""
        assert self._channel is not None
        self._channel.add(f"agent/beat{wg.group_rank}")
        if wg.group_rank != 0:
            return
        others = [g for g in range(1, wg.group_world_size) if g not in {n.group_rank for n in self.lost_nodes}]
        if not others:
            return
        spare_ids = sorted(self._spare_nodes)
        counts = self._channel.counters([f"agent/beat{g}" for g in others] + [SPARE_COUNT_KEY] +
                                        [f"spare/beat{i}" for i in spare_ids])
        self._watch_spare_nodes(counts[len(others)], dict(zip(spare_ids, counts[len(others) + 1:])), now)
        done = self._channel.present([f"agent/done{g}" for g in others])
        for g, count in zip(others, counts):
            seen, since = self._beats.get(g, (-1, now))
            if count != seen:
                self._beats[g] = (count, now)
            elif f"agent/done{g}" not in done and now - since > self._options.node_loss_s:
                n = wg.spec.local_world_size
                self._node_lost(NodeLoss(g, tuple(range(g * n, (g + 1) * n)), now - since), n, count, now)

    def _watch_spare_nodes(self, registered: int, beats: dict[int, int], now: float) -> None:
        """Group rank 0: read the spare nodes registered since the last look, and note whose beat moved."""
        assert self._channel is not None
        if registered > self._spare_nodes_seen:
            new = range(self._spare_nodes_seen + 1, registered + 1)
            got = self._channel.present([f"spare/node{i}" for i in new])
            for i in new:
                if f"spare/node{i}" not in got:  # a spare writes its record just after taking its number
                    break
                node = SpareNode.from_dict(got[f"spare/node{i}"])
                self._spare_nodes[i] = _SpareWatch(node, -1)
                self._spare_nodes_seen = i
                _say(f"{node} registered ({node.nproc_per_node} worker(s) per node, agent pid {node.pid})")
        for i, count in beats.items():
            watch = self._spare_nodes.get(i)
            if watch is not None and count != watch.beats:
                if watch.beats >= 0:
                    watch.moved = now
                watch.beats = count

    def _node_lost(self, loss: NodeLoss, nproc_per_node: int, beats: int, now: float) -> None:
        """Group rank 0's verdict on a lost node: its group rank to a live spare node, or its ranks gone."""
        assert self._channel is not None
        live = {i for i, w in self._spare_nodes.items() if w.live(now, self._options.node_loss_s)}
        verdict = choose_spare(loss, nproc_per_node, [w.node for w in self._spare_nodes.values()], live,
                               self._options.node_loss_s)
        _say(verdict.describe())
        self._channel.set(NODES_CHANGED_KEY, True)  # the other agents' exit barrier would wait for it
        if verdict.spare is not None:
            del self._spare_nodes[verdict.spare.spare_id]
            self._channel.set(f"spare/assign{verdict.spare.spare_id}", {"group_rank": loss.group_rank})
            self.takeovers.append(verdict)
            self._beats[loss.group_rank] = (beats, now)  # the spare beats as the node from now: node_loss_s to start
            return
        self.lost_nodes.append(loss)
        for rank in loss.ranks:
            mark_gone(self._channel, rank)

    def _exit_barrier(self) -> None:
        if self._channel is not None:
            self._channel.set(f"agent/done{self._worker_group.group_rank}", True)
        if not (self.lost_nodes or self.takeovers):
            if self._worker_group.group_rank != 0 and self._nodes_changed():
                # group rank 0 lost a node (or gave it to a spare node, which is in no elastic barrier):
                # elastic's barrier would wait its whole timeout for an agent that never arrives
                _say("a node of the job was lost: not waiting at elastic's exit barrier")
                return
            super()._exit_barrier()
            self._end_standby()
            return
        # a lost node's agent never arrives: elastic's barrier would wait out its timeout
        lost = sorted({n.group_rank for n in self.lost_nodes})
        if lost:
            _say(f"not waiting for the agents of lost node(s) {lost} at exit")
        taken = sorted({v.loss.group_rank for v in self.takeovers} - set(lost))
        if taken:  # a spare node is in no elastic barrier: it says it is done on the control channel
            _say(f"waiting for the spare node(s) acting as node(s) {taken} to finish (this agent hosts their "
                 "control channel and store)")
            assert self._channel is not None
            try:
                self._channel.wait([f"agent/done{g}" for g in taken], self._exit_barrier_timeout)
            except (RuntimeError, OSError) as exc:
                _say(f"the spare node(s) acting as node(s) {taken} did not finish within "
                     f"{self._exit_barrier_timeout:g} s ({exc}); leaving")
        self._end_standby()

    def _nodes_changed(self) -> bool:
        """Whether group rank 0 said a node of the job was lost (see :meth:`_node_lost`)."""
        if self._channel is None:
            return False
        try:
            return bool(self._channel.present([NODES_CHANGED_KEY]))
        except (RuntimeError, OSError):  # the channel's host gone: the barrier's store with it
            return True

    def _end_standby(self) -> None:
        """Group rank 0: tell the spare nodes still standing by that the job is over (they leave)."""
        if self._channel is not None and self._worker_group.group_rank == 0:
            with contextlib.suppress(Exception):
                self._channel.set(JOB_ENDED_KEY, True)

    # -- elastic's hooks ------------------------------------------------------------------
    def _invoke_run(self, role: str = "default") -> RunResult:
        wg = self._worker_group
        self._handle_signals()
        self._initialize_workers(wg)
        while True:
            self._wait_for_exit(wg.spec.monitor_interval)
            result = self._watch(wg)
            if result is None:
                continue
            wg.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                self._exit_barrier()
            else:
                self._stop_workers(wg)
            return result

    def _handle_signals(self) -> None:
        """As torchrun's agent: a death signal to the agent ends its workers (elastic's SignalException)."""
        for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", ",".join(_SIGNALS)).split(","):
            sig = getattr(signal, name.strip(), None)
            if sig is not None:
                signal.signal(sig, _terminate_process_handler)

    def _wait_for_exit(self, timeout_s: float) -> None:
        """Sleep ``timeout_s``, or less: until a worker's process exits (its pidfd turns readable), so a
        death is acted on when it happens rather than at the next look."""
        ledger = self._ledger
        fds = [fd for lr, r in ledger.running.items() if lr not in ledger.finished and lr not in ledger.gone
               if (fd := r.pidfd()) is not None]
        if not fds:
            time.sleep(timeout_s)
            return
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        if poller.poll(timeout_s * 1000):  # an exit: a forked worker's is known once its server reports it
            time.sleep(0.002)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        return self._watch(worker_group) or RunResult(state=WorkerState.HEALTHY)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._shutdown()

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        procs = [r.handler.proc for r in self._ledger.running.values()] + [s.handler.proc for s in self._spares]
        for proc in procs:
            if proc.poll() is None:
                _signal_group(proc, death_sig)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                _kill(proc)
        for running in self._ledger.running.values():
            running.close()
        for s in self._spares:
            s.assignment.unlink(missing_ok=True)
            ready_path(s.assignment).unlink(missing_ok=True)
        self._spares = []
        if self._channel is not None:
            self._channel = None
        self._control_server = None

    @property
    def ledger(self) -> _Ledger:
        return self._ledger


class FixedRendezvous(RendezvousHandler):
    """What a rendezvous with no rounds to re-run answers elastic (a spare node's standby, a one-node job
    run in another program): never closed, nobody waiting, and a store of its own dropped at shutdown."""

    def __init__(self, run_id: str) -> None:
        self._run_id = run_id
        self._store: Any = None

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        return None

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._store = None
        return True


class StandbyRendezvous(FixedRendezvous):
    """A spare node's side of elastic's rendezvous: it joins no round (the job's world size is what its
    nodes make), and reads from the rendezvous endpoint's own store where group rank 0's agent hosts
    the control channel (:func:`standby_key`). The c10d backend keeps that store at ``--rdzv-endpoint``."""

    def __init__(self, endpoint: str, run_id: str, join_timeout_s: float) -> None:
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        super().__init__(run_id)
        self.endpoint = parse_rendezvous_endpoint(endpoint, default_port=29400)
        self.join_timeout_s = join_timeout_s

    def job(self) -> tuple[str, int, str]:
        """(host, port, run id of its keys) of the job's control channel, once group rank 0 has named it
        (waits up to the join timeout; a store that never answers raises ``DistStoreError``)."""
        from datetime import timedelta

        from torch.distributed import TCPStore

        if self._store is None:
            self._store = TCPStore(self.endpoint[0], self.endpoint[1], is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=self.join_timeout_s))
        record = json.loads(self._store.get(standby_key(self._run_id)))
        host, _, port = str(record["control"]).rpartition(":")
        return host, int(port), str(record["run_id"])

    def get_backend(self) -> str:
        return "standby"

    def next_rendezvous(self) -> Any:
        raise RendezvousError("a spare node joins no rendezvous round: its agent (SpareAgent) waits on the job's "
                              "control channel to be given a lost node's group rank")


class SpareAgent(ReplacingAgent):
    """A spare node's agent (``meshpact launch --spare``): it registers on the job's control channel as
    a standby node and beats there; when group rank 0's agent hands it a lost node's group rank
    (:func:`choose_spare`) it starts that node's workers from the node's published environment
    (:class:`NodeEnv`) with incarnations above the lost processes' and this node's own address, and is
    that node's agent from then on (it replaces failed workers, beats as the group rank, and says it
    is done on the channel at the end, where group rank 0 waits for it). A job that ends without
    needing it, or whose control channel is gone, ends it too (exit 0)."""

    def __init__(self, spec: WorkerSpec, logs_specs: Any, options: LaunchOptions, standby: StandbyRendezvous,
                 shutdown_timeout: int = 30) -> None:
        super().__init__(spec, logs_specs, options, shutdown_timeout=shutdown_timeout)
        self._standby = standby
        self._job_run_id = ""
        self._first: dict[int, int] = {}  # local rank -> the incarnation its first process here starts at
        self.me: SpareNode | None = None

    def _run_id(self) -> str:
        return self._job_run_id

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """Instead of a rendezvous round: register as a spare node, stand by, take the group rank given
        (on a thread of its own, :func:`_stoppable`: the waits for the job and for a node are the store's)."""
        _stoppable(lambda: self._take_a_node(worker_group))

    def _take_a_node(self, worker_group: WorkerGroup) -> None:
        h, p = self._standby.endpoint
        _say(f"spare node: waiting for job {self._standby.get_run_id()} to name its control channel at {h}:{p} "
             f"(up to the rendezvous join_timeout, {self._standby.join_timeout_s:g} s)")
        try:
            host, port, self._job_run_id = self._standby.job()
        except (RuntimeError, OSError) as exc:  # the store's DistStoreError is a RuntimeError
            h, p = self._standby.endpoint
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise NoJobFound(f"--spare: no job with --rdzv-id {self._standby.get_run_id()} named its control channel "
                             f"at {h}:{p} within {self._standby.join_timeout_s:g} s (give the spare the job's "
                             f"--rdzv-endpoint and --rdzv-id; {first})") from None
        self._control = (host, port)
        # rank -1: the channel's rank names consensus keys, which an agent never writes (its keys name its group rank)
        channel = self._channel = ControlChannel(host, port, -1, 1, 5.0, run_id=self._job_run_id,
                                                 key=self._options.job_key)
        me = self.me = SpareNode(channel.add(SPARE_COUNT_KEY), self._node_addr(), worker_group.spec.local_world_size,
                                 os.getpid())
        channel.set(f"spare/node{me.spare_id}", me.to_dict())
        warm = worker_group.spec.entrypoint == sys.executable  # a Python script or module: warm interpreters
        for _ in range(worker_group.spec.local_world_size if warm else 0):
            self._start_spare()
        _say(f"{me} registered with the job (run {self._job_run_id}, control channel {host}:{port}); standing by"
             + (f" with {len(self._spares)} warm interpreter(s)" if warm else ""))
        g = self._stand_by(me)
        node = NodeEnv.from_dict(channel.wait([f"agent/node{g}"])[f"agent/node{g}"])
        held = channel.present([f"agent/incarnation/rank{r}" for r in node.ranks])
        self._first = {lr: int(held.get(f"agent/incarnation/rank{r}", 0)) + 1 for lr, r in enumerate(node.ranks)}
        self._seen_round = channel.counter(ROUND_KEY)  # rounds decided before now named the lost processes
        self._node = node
        worker_group.workers = node.workers()
        worker_group.group_rank = node.group_rank
        worker_group.group_world_size = node.group_world_size
        worker_group.master_addr = node.master_addr
        worker_group.master_port = node.master_port
        worker_group.store = None
        _say(f"{me} takes node {g}: ranks {list(node.ranks)} start here at incarnation(s) "
             f"{[self._first[lr] for lr in range(len(node.ranks))]}")

    def _stand_by(self, me: SpareNode) -> int:
        """Beat on the control channel until group rank 0 assigns a group rank (returned); a job that
        ended, or a channel gone with its host, ends the standby (elastic's graceful exit)."""
        assert self._channel is not None
        key = f"spare/assign{me.spare_id}"
        while True:
            try:
                self._channel.add(f"spare/beat{me.spare_id}")
                got = self._channel.present([key, JOB_ENDED_KEY])
            except (RuntimeError, OSError) as exc:
                _say(f"{me}: the job's control channel is gone ({exc}); leaving")
                raise RendezvousGracefulExitError("the job's control channel is gone") from None
            self._note_ready_spares()
            if key in got:
                return int(got[key]["group_rank"])
            if JOB_ENDED_KEY in got:
                _say(f"{me}: the job ended without needing a spare node; leaving")
                raise RendezvousGracefulExitError("the job ended")
            time.sleep(self._options.loss_watch_s)

    warm_first = True  # the interpreters started while standing by become the node's workers

    def _first_incarnation(self, local_rank: int) -> int:
        return self._first.get(local_rank, 1)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids = super()._start_workers(worker_group)
        warm = sum(r.warm for r in self._ledger.running.values())
        _say(f"{self.me} started rank(s) {[w.global_rank for w in worker_group.workers]} as pid(s) "
             f"{[pids[w.local_rank] for w in worker_group.workers]} ({warm} of them warm interpreter(s))")
        return pids

    def _exit_barrier(self) -> None:
        """In no elastic barrier (group rank 0 waits for this node's ``agent/done<g>`` on the channel)."""
        with contextlib.suppress(RuntimeError, OSError):
            if self._channel is not None:
                self._channel.set(f"agent/done{self._worker_group.group_rank}", True)



def _root_store(store: Any) -> Any:
    """The store under every ``PrefixStore`` elastic wrapped around it (the rendezvous endpoint's own)."""
    from torch.distributed import PrefixStore

    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


def _bind_address(node_addr: str) -> str:
    """The address this node's peer servers bind to: the node's own, resolved (loopback stays loopback)."""
    try:
        return socket.gethostbyname(node_addr)
    except OSError:
        return "127.0.0.1"


def _iface_of(addr: str) -> str | None:
    """The network interface that holds the IPv4 address ``addr`` (None: loopback, or none holds it)."""
    import fcntl
    import struct

    try:
        ip = socket.gethostbyname(addr)
    except OSError:
        return None
    if ip.startswith("127."):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == ip:
                return name
    return None


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


def _kill(proc: subprocess.Popen) -> None:
    _signal_group(proc, signal.SIGKILL)


def _say(line: str) -> None:
    sys.stderr.write(f"[meshpact launch] {line}\n")
    sys.stderr.flush()


# -- the command line ----------------------------------------------------------------------------
def parser() -> ArgumentParser:
    """torchrun's own parser (torch.distributed.run.get_args_parser), with Meshpact's flags added."""
    p = get_args_parser()
    p.prog = "meshpact launch"
    p.description = ("torchrun's command line; a failed worker is replaced alone, in place, while every other "
                     "worker keeps running.")
    p.add_argument("--spare-ranks-per-node", "--spare_ranks_per_node", type=int, default=0,
                   help="Warm spares per node: interpreters with torch imported, promoted to a failed worker's rank.")
    p.add_argument("--spare", action="store_true",
                   help="Stand by as a spare node: join no rendezvous round, register with the job at "
                        "--rdzv-endpoint and take the group rank of a node the job loses.")
    p.add_argument("--node-loss-s", "--node_loss_s", type=float, default=LaunchOptions.node_loss_s,
                   help="A node whose agent is silent this long on the control channel is lost: its ranks are "
                        "announced gone to the job.")
    return p


def _standalone(args: Namespace) -> None:
    """``--standalone`` as torchrun reads it, with the stores on loopback (one node: nothing else needs them)."""
    args.rdzv_backend = "c10d"
    args.rdzv_endpoint = "localhost:0"
    args.rdzv_id = str(uuid.uuid4())
    if not args.local_addr:
        args.local_addr = "127.0.0.1"


def launch_key(env: Mapping[str, str], max_nodes: int) -> jobkey.JobKey | None:
    """The job key ``meshpact launch`` hands its workers: the user's (``MESHPACT_JOB_KEY`` or
    ``MESHPACT_JOB_KEY_FILE``) where set; else, for a job of one node, one drawn here; a job of
    several nodes needs the user's, the same on every node (:class:`LaunchRefused` otherwise),
    unless it opted out with ``MESHPACT_UNAUTHENTICATED=1`` (None)."""
    given = env.get(jobkey.KEY_ENV) or env.get(jobkey.KEY_FILE_ENV) or env.get(jobkey.UNAUTHENTICATED_ENV) == "1"
    if not given:
        if max_nodes <= 1:
            return jobkey.draw("drawn by meshpact launch")
        raise LaunchRefused(f"a job of several nodes needs one job key on every node and none was given: set "
                            f"{jobkey.KEY_ENV} (64 hex digits, e.g. from `python -c 'import secrets; "
                            f"print(secrets.token_hex(32))'`) or {jobkey.KEY_FILE_ENV} (a 0600 file holding them) in "
                            f"every node's environment, or {jobkey.UNAUTHENTICATED_ENV}=1 to run without "
                            "authentication on a trusted network")
    try:
        return jobkey.load(env, "", multi_host=True)
    except jobkey.JobKeyError as exc:
        raise LaunchRefused(str(exc)) from None


def config(argv: Sequence[str]) -> tuple[Any, Any, list[str], LaunchOptions]:
    """torchrun's LaunchConfig, command and arguments for ``argv``, and Meshpact's options;
    :class:`LaunchRefused` names a bad flag in one line."""
    p = parser()
    args = p.parse_args(list(argv))
    options = LaunchOptions(spare_ranks_per_node=args.spare_ranks_per_node, spare=args.spare,
                            node_loss_s=args.node_loss_s)
    if options.spare_ranks_per_node and (args.no_python or args.run_path):
        raise LaunchRefused("--spare-ranks-per-node: a warm spare runs a Python script or module; it cannot be "
                            "used with --no-python or --run-path")
    if args.spare:
        if args.standalone:
            raise LaunchRefused("--spare: a spare node stands by for a job of several nodes; --standalone runs one "
                                "node with nothing to take over (drop one of the two)")
        if args.rdzv_backend != "c10d" or not args.rdzv_endpoint:
            raise LaunchRefused(f"--spare: expected --rdzv-backend c10d and the job's --rdzv-endpoint (a spare node "
                                f"finds the job in the store there), got --rdzv-backend {args.rdzv_backend} "
                                f"--rdzv-endpoint {args.rdzv_endpoint or '(none)'}")
    if args.standalone:
        _standalone(args)
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        try:
            _, max_nodes = parse_min_max_nnodes(args.nnodes)
        except (RuntimeError, ValueError):
            raise LaunchRefused(f"--nnodes {args.nnodes!r}: expected N or MIN:MAX") from None
        if max_nodes == 1:
            _standalone(args)
    if args.master_port is None:
        args.master_port = 29500
    try:
        cfg, cmd, cmd_args = config_from_args(args)
    except (AssertionError, ValueError, RuntimeError) as exc:
        raise LaunchRefused(f"{exc}") from None
    if not isinstance(cmd, str):
        raise LaunchRefused("--run-path is not supported by meshpact launch: name the script (python) or use -m")
    options = replace(options, job_key=launch_key(os.environ, 2 if options.spare else cfg.max_nodes))
    if cfg.nproc_per_node < 1:
        raise LaunchRefused(f"--nproc-per-node {args.nproc_per_node}: expected 1 or more workers per node")
    script = args.training_script
    if not args.no_python and not args.module and not Path(script).exists():
        raise LaunchRefused(f"{script}: no such script (expected a Python file to run on every worker, or -m "
                            "and a module name)")
    return cfg, cmd, cmd_args, options


def rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Elastic's rendezvous handler for ``params``, with every store this agent hosts listening on
    the address it is named by alone (:func:`~meshpact.live.store.host_store`): torch's TCPStore
    listens on every interface whatever host it is given. The c10d backend's store (on the node
    whose address the ``--rdzv-endpoint`` names; ``--standalone``: loopback) and the store it
    shares with the workers (on the node's ``--local-addr``), and the static backend's store on
    ``--master-addr``. Other backends (etcd) are elastic's own."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous, static_tcp_rendezvous
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

    if params.backend == "static":
        handler = static_tcp_rendezvous.create_rdzv_handler(params)
        if handler.rank == 0:  # the store it would make at its first round, made here on the named address
            handler._store = host_store(handler.master_addr, handler.master_port, handler.world_size,
                                        handler.timeout.total_seconds())
        return handler
    if params.backend != "c10d" or params.get("store_type", "tcp").strip().lower() != "tcp":
        return rdzv_registry.get_rendezvous_handler(params)
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=c10d_rendezvous_backend.DEFAULT_PORT)
    is_host = params.get_as_bool("is_host")
    timeout_s = float(params.get_as_int("read_timeout", 60) or 60)
    store: Any = None
    if is_host is not False and (is_host or _matches_machine_hostname(host)):
        try:
            store = host_store(host, port, 1, timeout_s)
        except OSError:
            if is_host:  # said so by the user: the port must be ours
                raise
            # guessed from the host name: another agent of this machine hosts it (as elastic's own fallback)
    if store is None:
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), multi_tenant=True)
    backend = c10d_rendezvous_backend.C10dRendezvousBackend(store, params.run_id)
    handler = dynamic_rendezvous.create_handler(store, backend, params)
    # the store group rank 0's agent shares with its workers: on the node's address alone
    handler._create_tcp_store_server = (  # type: ignore[method-assign]
        lambda addr, port: host_store(addr, port, 1, timeout_s))
    return handler


def launch(cfg: Any, cmd: str, cmd_args: list[str], options: LaunchOptions) -> dict[int, Any]:
    """Run one node's agent to the end (elastic's ``launch_agent``, with :class:`ReplacingAgent`)."""
    if not cfg.run_id:
        cfg.run_id = str(uuid.uuid4().int)
    params = RendezvousParameters(backend=cfg.rdzv_backend, endpoint=cfg.rdzv_endpoint, run_id=cfg.run_id,
                                  min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes, local_addr=cfg.local_addr,
                                  **cfg.rdzv_configs)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = cfg.signals_to_handle
    standby: StandbyRendezvous | None = None
    if options.spare:  # no rendezvous handler: a spare node must neither host nor join elastic's store's rounds
        standby = StandbyRendezvous(cfg.rdzv_endpoint, cfg.run_id, float(cfg.rdzv_configs.get("join_timeout", 600)))
        handler: RendezvousHandler = standby
        master_addr, master_port = None, None
    else:
        handler = rendezvous_handler(params)
        master_addr, master_port = _get_addr_and_port(params)
    spec = WorkerSpec(role=cfg.role, local_world_size=cfg.nproc_per_node, entrypoint=cmd, args=tuple(cmd_args),
                      rdzv_handler=handler, max_restarts=cfg.max_restarts,
                      monitor_interval=cfg.monitor_interval, master_addr=master_addr, master_port=master_port,
                      local_addr=cfg.local_addr, event_log_handler=cfg.event_log_handler,
                      numa_options=cfg.numa_options)
    agent = (SpareAgent(spec, cfg.logs_specs, options, standby, shutdown_timeout=cfg.shutdown_timeout)
             if standby is not None else ReplacingAgent(spec, cfg.logs_specs, options,
                                                        shutdown_timeout=cfg.shutdown_timeout))
    shutdown_rdzv = True
    if cfg.max_nodes > 1 and not options.spare:  # it may wait a while for the others: said, not silent
        named = "" if cfg.rdzv_backend == "static" else f" {cfg.run_id}"
        _say(f"joining the {cfg.rdzv_backend} rendezvous{named} at {cfg.rdzv_endpoint or 'MASTER_ADDR:MASTER_PORT'}"
             f" for {cfg.min_nodes}{'' if cfg.min_nodes == cfg.max_nodes else f'-{cfg.max_nodes}'} node(s) "
             f"(waits up to the rendezvous join_timeout, {cfg.rdzv_configs.get('join_timeout', 600)} s, for the others)")
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(cfg.metrics_cfg))
        result = agent.run()
        if result is None:  # a spare node the job did not need (elastic's graceful exit from its rendezvous)
            return {}
        events.record(agent.get_event_succeeded(), cfg.event_log_handler)
        if result.is_failed():
            raise ChildFailedError(name=os.path.basename(cmd_args[1] if len(cmd_args) > 1 else cmd),
                                   failures=result.failures)
        return result.return_values
    except SignalException:
        shutdown_rdzv = False  # as elastic does: a signalled agent leaves the rendezvous open for the others
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    """``meshpact launch ARGS`` / ``python -m meshpact.launch ARGS``: 0 when every worker finished."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, cmd, cmd_args, options = config(args)
    except LaunchRefused as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2

    @record
    def run() -> None:
        launch(cfg, cmd, cmd_args, options)

    try:
        run()
    except ChildFailedError:
        return 1
    except (NoJobFound, HostNodeLost) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    except SignalException as exc:  # as torchrun: the workers were stopped on the way out; said in one line
        sys.stderr.write(f"meshpact launch: stopped by {exc.sigval.name}; this node's workers were stopped\n")
        return 128 + int(exc.sigval)
    return 0
