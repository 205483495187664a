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

The recovery runtime learns of the loss as under the project's own launcher: its survivors meet
the dead peer in a collective, agree over the control channel (which this agent hosts, on the
node of group rank 0, so a dead rank 0 takes nothing with it) and the replacement joins the
recovery as a process with ``MESHPACT_INCARNATION`` above 0 (:func:`~.recovery.session.start_session`).
The agent also plays the launcher's other two parts in consensus: a rank the job declares lost
(silent for the rank-loss bound) is killed here and replaced; a rank it can give no process
again is marked gone (:func:`~.recovery.consensus.mark_gone`), so the survivors excise it or end
with the reason instead of waiting.

Warm spares (``--spare-ranks-per-node N``): N interpreters per node with torch imported
(:mod:`~meshpact.live.warmspare`), each promoted to a failed worker's rank by one file.

Plain ``torchrun`` keeps working with the same scripts: without ``MESHPACT_CONTROL_PORT`` rank 0
hosts the control channel, and a kill ends the job as torchrun decides.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from argparse import ArgumentParser, Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import RunResult, SimpleElasticAgent, WorkerGroup, WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, record
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import _get_addr_and_port
from torch.distributed.run import config_from_args, get_args_parser, parse_min_max_nnodes

from meshpact.core.errors import MeshpactError

from .recovery.consensus import declared_lost, mark_gone
from .recovery.control import ControlChannel
from .recovery.peers import ADDR_ENV, HOST_ENV
from .store import host_store
from .warmspare import Assignment, assign, ready_path

__all__ = ["LaunchOptions", "NodeLoss", "ReplacingAgent", "LaunchRefused", "parser", "main", "CONTROL_KEY"]

logger = logging.getLogger("meshpact.launch")

CONTROL_KEY = "meshpact/control"  # in the rendezvous store: "host:port" of the control channel
_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


class LaunchRefused(MeshpactError):
    """A command line ``meshpact launch`` cannot run; the message names the flag and what it expects."""


@dataclass(frozen=True)
class LaunchOptions:
    """What ``meshpact launch`` adds to torchrun's command line."""

    spare_ranks_per_node: int = 0
    node_loss_s: float = 5.0  # a node whose agent has not beaten on the control channel for this long is lost
    loss_watch_s: float = 0.25  # how often the agent reads which ranks the job declared lost, and beats

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
        return (f"node {self.group_rank} (ranks {list(self.ranks)}) is lost: its agent has not beaten on the "
                f"control channel for {self.silent_s:.1f} s; the job is told its ranks are gone (it excises them "
                f"where it can, above its min_ranks, or ends naming why)")


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
class _Ledger:
    """The agent's record of its workers: what each runs, which finished, which are gone."""

    running: dict[int, _Running] = field(default_factory=dict)  # local rank -> its process
    finished: set[int] = field(default_factory=set)  # local ranks whose process exited 0
    gone: dict[int, Any] = field(default_factory=dict)  # local rank -> the ProcessFailure it was left with
    replaced: int = 0


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
        self._control_server: Any = None
        self._channel: ControlChannel | None = None
        self._control: tuple[str, int] = ("", 0)  # the control channel's address
        self._attempt_dir: Path | None = None
        self._spare_dir = Path(tempfile.mkdtemp(prefix="meshpact-spares-"))
        self._streams: dict[int, tuple[str, str]] = {}  # local rank -> (stdout, stderr) of its first process
        self._next_watch = 0.0
        self._beats: dict[int, tuple[int, float]] = {}  # group rank -> (its beat count, when it last moved)
        self.lost_nodes: list[NodeLoss] = []
        self._seen_round = 0

    # -- addresses and the control channel ------------------------------------------
    def _node_addr(self) -> str:
        return self._worker_group.spec.local_addr or socket.getfqdn()

    def _open_control(self, wg: WorkerGroup) -> None:
        """Group rank 0 hosts the control channel and names it in the rendezvous store."""
        if self._channel is not None:
            return
        if wg.group_rank == 0:
            self._control_server = host_store(wg.master_addr, 0, wg.workers[0].world_size)
            wg.store.set(CONTROL_KEY, f"{wg.master_addr}:{self._control_server.port}")
        host, _, port = wg.store.get(CONTROL_KEY).decode().rpartition(":")
        self._control = (host, int(port))
        self._channel = ControlChannel(host, int(port), wg.group_rank, wg.workers[0].world_size, 5.0,
                                       run_id=self._run_id())

    def _run_id(self) -> str:
        return os.environ.get("MESHPACT_RUN_ID") or str(self._worker_group.spec.rdzv_handler.get_run_id())

    # -- the worker environment ---------------------------------------------------------
    def _env(self, wg: WorkerGroup, local_rank: int, incarnation: int) -> dict[str, str]:
        spec = wg.spec
        worker = wg.workers[local_rank]
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
            "TORCHELASTIC_RUN_ID": str(spec.rdzv_handler.get_run_id()),
            "TORCHELASTIC_USE_AGENT_STORE": str(spec.rdzv_handler.use_agent_store),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "MESHPACT_INCARNATION": str(incarnation),
            "MESHPACT_RUN_ID": self._run_id(),
            "MESHPACT_CONTROL_ADDR": host,
            "MESHPACT_CONTROL_PORT": str(port),
        }
        env.setdefault(ADDR_ENV, os.environ.get(ADDR_ENV) or _bind_address(self._node_addr()))
        env.setdefault(HOST_ENV, os.environ.get(HOST_ENV) or f"node{wg.group_rank}:{self._node_addr()}")
        iface = _iface_of(spec.local_addr) if spec.local_addr and "GLOO_SOCKET_IFNAME" not in os.environ else None
        if iface is not None:  # gloo finds its address from the host name otherwise: loopback on many hosts
            env["GLOO_SOCKET_IFNAME"] = iface
        for name in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
            if name in os.environ:
                env[name] = os.environ[name]
        return env

    # -- starting ------------------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        spec = worker_group.spec
        self._open_control(worker_group)
        envs = {w.local_rank: self._env(worker_group, w.local_rank, 0) for w in worker_group.workers}
        dest = self._logs_specs.reify(envs)  # error files (TORCHELASTIC_ERROR_FILE) and log files, elastic's layout
        first_error = dest.error_files.get(0, os.devnull)
        self._attempt_dir = Path(first_error).parent.parent if first_error != os.devnull else None
        for w in worker_group.workers:
            lr = w.local_rank
            self._streams[lr] = (dest.stdouts.get(lr, ""), dest.stderrs.get(lr, ""))
            handler = get_subprocess_handler(spec.entrypoint, tuple(spec.args), envs[lr], self._streams[lr][0],
                                             self._streams[lr][1], lr, spec.numa_options)
            self._ledger.running[lr] = _Running(handler, 0, dest.error_files.get(lr, os.devnull))
        for i in range(self._options.spare_ranks_per_node):
            self._start_spare(i)
        return {lr: r.pid for lr, r in self._ledger.running.items()}

    def _start_spare(self, index: int) -> None:
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
        env = self._env(wg, local_rank, incarnation)
        out, err, error_file = self._files_of(local_rank, incarnation)
        env["TORCHELASTIC_ERROR_FILE"] = "" if error_file == os.devnull else error_file
        alive = [s for s in self._spares if s.handler.proc.poll() is None]
        spare = next((s for s in alive if s.ready or ready_path(s.assignment).exists()), alive[0] if alive else None)
        if spare is not None:
            self._spares.remove(spare)
            assign(spare.assignment, Assignment(env, tuple(str(a) for a in spec.args), out, err))
            running = _Running(spare.handler, incarnation, error_file, warm=True)
        else:
            handler = get_subprocess_handler(spec.entrypoint, tuple(spec.args), env, out, err, local_rank,
                                             spec.numa_options)
            running = _Running(handler, incarnation, error_file)
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
            if self._remaining_restarts > 0:
                self._remaining_restarts -= 1
                new = self._replace(wg, lr)
                _say(f"rank {rank} (pid {failure.pid}) exited with {rc}: {failure.message or 'no error file'}; "
                     f"replaced by pid {new.pid} ({'a warm spare' if new.warm else 'a new process'}, "
                     f"incarnation {new.incarnation}; {self._remaining_restarts} replacement(s) left on this node)")
            else:
                ledger.gone[lr] = failure
                mark_gone(self._channel, rank)
                _say(f"rank {rank} (pid {failure.pid}) exited with {rc} and no replacement is left "
                     f"(--max-restarts {wg.spec.max_restarts}): the job is told it is gone")
        self._kill_declared_lost(wg)
        self._note_ready_spares()
        if len(ledger.finished) + len(ledger.gone) < len(wg.workers):
            return None
        if ledger.finished:
            return RunResult(state=WorkerState.SUCCEEDED,
                             return_values={wg.workers[lr].global_rank: None for lr in sorted(ledger.finished)})
        return RunResult(state=WorkerState.FAILED,
                         failures={wg.workers[lr].global_rank: f for lr, f in ledger.gone.items()})

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
        except Exception as exc:  # the channel's host (node 0) gone: nothing to learn from it now
            logger.warning("meshpact launch: cannot read the control channel (%s)", exc)
            return
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
        counts = self._channel.counters([f"agent/beat{g}" for g in others])
        done = self._channel.present([f"agent/done{g}" for g in others])
        for g, count in zip(others, counts):
            seen, since = self._beats.get(g, (-1, now))
            if count != seen:
                self._beats[g] = (count, now)
            elif f"agent/done{g}" not in done and now - since > self._options.node_loss_s:
                n = wg.spec.local_world_size
                loss = NodeLoss(g, tuple(range(g * n, (g + 1) * n)), now - since)
                self.lost_nodes.append(loss)
                _say(loss.describe())
                for rank in loss.ranks:
                    mark_gone(self._channel, rank)

    def _exit_barrier(self) -> None:
        if self._channel is not None:
            self._channel.set(f"agent/done{self._worker_group.group_rank}", True)
        if self.lost_nodes:  # a lost node's agent never arrives: elastic's barrier would wait out its timeout
            _say(f"not waiting for the agents of lost node(s) {[n.group_rank for n in self.lost_nodes]} at exit")
            return
        super()._exit_barrier()

    # -- elastic's hooks ------------------------------------------------------------------
    def _invoke_run(self, role: str = "default") -> RunResult:
        wg = self._worker_group
        for name in os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", ",".join(_SIGNALS)).split(","):
            sig = getattr(signal, name.strip(), None)
            if sig is not None:
                signal.signal(sig, _terminate_process_handler)
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
        poller.poll(timeout_s * 1000)

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


def config(argv: Sequence[str]) -> tuple[Any, Any, list[str], LaunchOptions]:
    """torchrun's LaunchConfig, command and arguments for ``argv``, and Meshpact's options;
    :class:`LaunchRefused` names a bad flag in one line."""
    p = parser()
    args = p.parse_args(list(argv))
    options = LaunchOptions(spare_ranks_per_node=args.spare_ranks_per_node, node_loss_s=args.node_loss_s)
    if options.spare_ranks_per_node and (args.no_python or args.run_path):
        raise LaunchRefused("--spare-ranks-per-node: a warm spare runs a Python script or module; it cannot be "
                            "used with --no-python or --run-path")
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
    return cfg, cmd, cmd_args, options


def launch(cfg: Any, cmd: str, cmd_args: list[str], options: LaunchOptions) -> dict[int, Any]:
    """Run one node's agent to the end (elastic's ``launch_agent``, with :class:`ReplacingAgent`)."""
    if not cfg.run_id:
        cfg.run_id = str(uuid.uuid4().int)
    params = RendezvousParameters(backend=cfg.rdzv_backend, endpoint=cfg.rdzv_endpoint, run_id=cfg.run_id,
                                  min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes, local_addr=cfg.local_addr,
                                  **cfg.rdzv_configs)
    master_addr, master_port = _get_addr_and_port(params)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = cfg.signals_to_handle
    spec = WorkerSpec(role=cfg.role, local_world_size=cfg.nproc_per_node, entrypoint=cmd, args=tuple(cmd_args),
                      rdzv_handler=rdzv_registry.get_rendezvous_handler(params), max_restarts=cfg.max_restarts,
                      monitor_interval=cfg.monitor_interval, master_addr=master_addr, master_port=master_port,
                      local_addr=cfg.local_addr, event_log_handler=cfg.event_log_handler,
                      numa_options=cfg.numa_options)
    agent = ReplacingAgent(spec, cfg.logs_specs, options, shutdown_timeout=cfg.shutdown_timeout)
    shutdown_rdzv = True
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(cfg.metrics_cfg))
        result = agent.run()
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
    return 0
