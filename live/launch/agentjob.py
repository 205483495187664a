"""One node's job under ``meshpact launch``'s agent, run inside the calling program.

``meshpact live recover``, the dashboard's Live page and the test suite start their ranks here:
:class:`AgentJob` runs :class:`~meshpact.live.launch.elastic.ReplacingAgent` — the agent ``meshpact
launch`` runs on every node, with elastic's rendezvous interface, worker environment, error files
and log layout — in this process, on a worker target
(``package.module:function``, run by ``python -m meshpact.live.launch.launcher --target``); its rendezvous
is one round of one node that hosts the job's store on loopback (:class:`_OneNode`), or names to the
ranks a store hosted elsewhere (``master``). Every
decision about a worker's process is the agent's: a failed rank is replaced alone, in place (same
rank, next incarnation), a warm spare first (``spares``); a rank the job declares lost is killed and
replaced; a rank with no replacement left (``max_replacements``) is announced gone to the job,
which excises it or ends naming why. The caller adds what a program that runs trials needs:

- the control channel it hosts (``control``): consensus, fault records and heartbeats are read there
  by the caller too, and it outlives every rank; the caller reads it with the job's key (``job_key``,
  drawn for the job unless given), which the ranks get in their environment;
- ranks placed on other hosts of this machine (network namespaces): a command ``prefix`` per rank
  (``ip netns exec NS``), an environment per rank (``env``), and the store the ranks rendezvous at
  (``master``, served where they reach it). The agent's own connections (the control channel) are
  made where the calling thread is: a caller whose stores live inside a namespace runs the job with
  its thread entered there (:func:`~meshpact.live.netns.entered`);
- warm first starts (``forkserver``, one server, or one per rank's host): a rank's first process is
  forked from a :class:`~meshpact.live.launch.forkserver.ForkServer` that imported torch once, where its
  environment allows and the server was started under the rank's own prefix; a replacement starts a
  fresh interpreter (its start is measured) unless ``warm_replacements`` (callers that measure no
  start: the test suite), which forks the warm spares (``spares``) from the one server too;
- the process registry (``registry``, :class:`~meshpact.live.launch.launcher.LaunchedProcess` lines), so
  whoever looks from outside learns which process is which rank;
- a deadline (``timeout_s``) after which every process is killed and each rank still running is
  reported as timed out;
- ``on_replaced(rank, returncode, warm)`` and ``on_gone(rank, returncode)`` as the agent acts, and
  ``on_tick()`` at each of its looks;
- ``replace_only_killed``: only a process killed with SIGKILL is replaced (a trial's faults end processes
  that way, and the agent kills a rank declared lost so); one that failed by itself is left gone;
- ``announce_gone`` off: a rank left without a replacement is not announced to the job (a
  scheduler that never answers; the survivors excise it when its replacement misses its deadline).

Each rank's result is what its worker function returned (:func:`~meshpact.live.launch.worker.write_result`),
collected as :class:`~meshpact.live.launch.launcher.RankResult`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler
from torch.distributed import PrefixStore
from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousStoreInfo

from .elastic import LaunchOptions, ReplacingAgent
from .forkserver import ForkServer
from .processes import ForkedHandler, Running, say
from ..recovery.jobkey import JobKey, draw
from ..netns import netns_of
from ..store import host_store
from .rendezvous import FixedRendezvous
from .worker import ARGS_ENV, RESULT_DIR_ENV, LaunchedProcess, LaunchError, RankResult, _resolve

__all__ = ["AgentJob", "AgentJobResult"]


@dataclass(frozen=True)
class AgentJobResult:
    """Every rank's result, the ranks the agent announced gone, and how many replacements it started."""

    results: list[RankResult]
    gone: dict[int, int] = field(default_factory=dict)  # rank -> the return code its last process exited with
    replacements: int = 0
    timed_out: bool = False


class _OneNode(FixedRendezvous):
    """Elastic's rendezvous for a job of one node in this process: it hosts the job's store (on loopback,
    the workers connect as clients, as ``--standalone`` has them do; where the job names a store hosted
    elsewhere, the ranks are given that one and this one keeps the agent's keys alone) and is the whole
    round at once.
    ``c10d``'s handler would do the same after a random pause of up to 0.3 s (for nodes joining together)
    that a one-node job spends on every run."""

    def __init__(self, run_id: str, world_size: int) -> None:
        super().__init__(run_id)
        self._world_size = world_size

    def get_backend(self) -> str:
        return "one-node"

    @property
    def use_agent_store(self) -> bool:
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._store = host_store("127.0.0.1", 0, self._world_size)
        return RendezvousInfo(
            PrefixStore(self._run_id, self._store), 0, 1, RendezvousStoreInfo("127.0.0.1", int(self._store.port))
        )


class _Deadline(Exception):
    """The job ran past its deadline (raised out of the agent's loop, which then stops every worker)."""


class _JobAgent(ReplacingAgent):
    """The agent with the calling program's parts (see the module docstring)."""

    def __init__(self, spec: WorkerSpec, logs_specs: Any, job: "AgentJob") -> None:
        super().__init__(
            spec,
            logs_specs,
            LaunchOptions(spare_ranks_per_node=job.spares, job_key=job.job_key),
            exit_barrier_timeout=30,
            shutdown_timeout=5,
        )
        self._job = job
        self.given_control = job.control
        self.stderr_files: dict[int, str] = {}  # rank -> its current process's stderr file

    def _run_id(self) -> str:
        return self._job.run_id

    def _handle_signals(self) -> None:  # the calling program keeps its own signal handling
        return

    def _worker_env(self, rank: int) -> dict[str, str]:
        return self._job.worker_env(rank)

    def _launch(
        self,
        spec: WorkerSpec,
        local_rank: int,
        env: dict[str, str],
        streams: tuple[str, str],
        error_file: str,
        incarnation: int,
        warm: bool,
    ) -> Running:
        self.stderr_files[local_rank] = streams[1]  # one node: a local rank is the job's rank
        return super()._launch(spec, local_rank, env, streams, error_file, incarnation, warm)

    def _start_process(
        self, spec: WorkerSpec, local_rank: int, env: dict[str, str], streams: tuple[str, str], incarnation: int
    ) -> Any:
        rank = local_rank
        server = self._job.server_of(rank)
        prefix = self._job.prefix_of(rank)
        # a server forks its children where it runs, or (one run outside any) into the network namespace of a
        # rank's `ip netns exec`
        netns = netns_of(prefix) if server is not None and not server.prefix else None
        if (
            server is not None
            and (server.prefix == prefix or netns)
            and (incarnation == 0 or self._job.warm_replacements)
        ):
            full = {**os.environ, **env}
            differs = server.differs(full)
            if not differs:
                handler: Any = ForkedHandler(
                    server.spawn(["--target", self._job.target], full, streams[1], netns=netns)
                )
                self._job.register(handler.proc.pid, rank, incarnation)
                return handler
            # said where a reader of the rank's output looks: a fresh start costs seconds
            self._job.notes[rank] = (
                f"meshpact launch: rank {rank} started as a fresh interpreter, not forked: "
                f"{', '.join(differs)} differ(s) from the fork server's, which read them at "
                "import\n"
            )
            say(self._job.notes[rank].partition(": ")[2].rstrip())
        if prefix:  # the command under the rank's prefix (``ip netns exec NS``, which execs it: the same pid)
            handler = get_subprocess_handler(
                prefix[0],
                (*prefix[1:], spec.entrypoint, *spec.args),
                env,
                streams[0],
                streams[1],
                local_rank,
                spec.numa_options,
            )
        else:
            handler = super()._start_process(spec, local_rank, env, streams, incarnation)
        self._job.register(handler.proc.pid, rank, incarnation)
        return handler

    def _tick(self) -> None:
        self._job.tick()

    def _should_replace(self, rank: int, returncode: int) -> bool:
        return self._job.replace_only_killed is False or returncode == -signal.SIGKILL

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        super()._shutdown(death_sig, timeout)
        for pid in self._job.all_pids:  # one started but not yet in the ledger when an exception came
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _replaced(self, rank: int, returncode: int, new: Running) -> None:
        if new.warm:  # a promoted spare: it was registered as a spare, it is the rank now
            self._job.register(new.pid, rank, new.incarnation)
        self._job.replaced(rank, returncode, new.warm)

    def _left_gone(self, rank: int, returncode: int) -> None:
        if self._job.announce_gone:
            super()._left_gone(rank, returncode)
        self._job.left_gone(rank, returncode)

    def _start_spare(self) -> int:
        pid = super()._start_spare()
        self._job.register(pid, None, 0, spare=self.spares.started - 1)
        return pid


class AgentJob:
    """``world_size`` ranks of ``target`` on this node under the elastic agent (see the module docstring)."""

    def __init__(
        self,
        target: str,
        world_size: int,
        args: Mapping[str, Any] | None = None,
        *,
        timeout_s: float = 120.0,
        spares: int = 0,
        max_replacements: int = 0,
        control: tuple[str, int] | None = None,
        env: Callable[[int], Mapping[str, str]] | None = None,
        prefix: Callable[[int], Sequence[str]] | None = None,
        master: tuple[str, int] | None = None,
        run_id: str | None = None,
        forkserver: ForkServer | Callable[[int], ForkServer | None] | None = None,
        warm_replacements: bool = False,
        registry: str | os.PathLike[str] | None = None,
        on_replaced: Callable[[int, int, bool], None] | None = None,
        on_gone: Callable[[int, int], None] | None = None,
        on_tick: Callable[[], None] | None = None,
        announce_gone: bool = True,
        replace_only_killed: bool = False,
        job_key: JobKey | None = None,
        unauthenticated: bool = False,
    ) -> None:
        if world_size < 1:
            raise LaunchError(f"world_size must be >= 1, got {world_size}")
        if spares < 0 or max_replacements < 0:
            raise LaunchError(f"spares and max_replacements must be 0 or more, got {spares} and {max_replacements}")
        if spares and prefix is not None:
            raise LaunchError(
                f"spares={spares}: a warm spare starts on the agent's own host, not under a rank's "
                "command prefix (another host)"
            )
        _resolve(target)  # a bad target is reported here, not once per rank
        self.target = target
        self.world_size = world_size
        self.args = dict(args or {})
        self.timeout_s = float(timeout_s)
        self.spares = spares
        self.max_replacements = max_replacements
        self.control = control
        self.run_id = run_id or uuid.uuid4().hex[:12]
        # the ranks' job key (drawn here unless given): the caller signs with it on the channel it hosts;
        # none where the caller opted out by name (the ranks run with MESHPACT_UNAUTHENTICATED=1)
        self.job_key = None if unauthenticated else job_key if job_key is not None else draw("drawn for this AgentJob")
        self.forkserver = forkserver
        self.master = master  # the ranks' store, hosted elsewhere (None: the job hosts it on loopback)
        self._prefix = prefix
        self.warm_replacements = warm_replacements
        self.announce_gone = announce_gone  # off: the agent plays a scheduler that never says a rank is gone
        self.replace_only_killed = replace_only_killed  # a process that failed by itself is left gone (trials)
        self.all_pids: list[int] = []  # every process started (each leads its own process group)
        self._env = env
        self._registry = Path(registry) if registry is not None else None
        self._on_replaced = on_replaced
        self._on_gone = on_gone
        self._on_tick = on_tick
        self._deadline = 0.0
        self.pids: dict[int, int] = {}  # rank -> the process it runs as now
        self.notes: dict[int, str] = {}  # rank -> what the agent said about how it started it (heads its stderr)
        self._dir = Path(tempfile.mkdtemp(prefix="meshpact-agentjob-"))

    # -- the agent's callbacks --------------------------------------------------------------
    def worker_env(self, rank: int) -> dict[str, str]:
        env = {
            RESULT_DIR_ENV: str(self._dir),
            ARGS_ENV: str(self._dir / "args.json"),
            "MESHPACT_RUN_ID": self.run_id,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }
        if self.control is not None:
            env.update({"MESHPACT_CONTROL_ADDR": self.control[0], "MESHPACT_CONTROL_PORT": str(self.control[1])})
        if self._env is not None:
            env.update({k: str(v) for k, v in self._env(rank).items()})
        return env

    def prefix_of(self, rank: int) -> tuple[str, ...]:
        """The command ``rank``'s processes start under (empty: none)."""
        return tuple(self._prefix(rank)) if self._prefix is not None else ()

    def server_of(self, rank: int) -> ForkServer | None:
        """The fork server for ``rank``'s host (None: none)."""
        return self.forkserver(rank) if callable(self.forkserver) else self.forkserver

    def register(self, pid: int, rank: int | None, incarnation: int, spare: int | None = None) -> None:
        if pid not in self.all_pids:
            self.all_pids.append(pid)
        if rank is not None:
            self.pids[rank] = pid
        if self._registry is not None:
            with open(self._registry, "a") as fh:
                fh.write(json.dumps(LaunchedProcess(pid, rank, incarnation, self.run_id, spare).to_dict()) + "\n")

    def tick(self) -> None:
        if self._on_tick is not None:
            self._on_tick()
        if time.monotonic() > self._deadline:
            raise _Deadline()

    def replaced(self, rank: int, returncode: int, warm: bool) -> None:
        if self._on_replaced is not None:
            self._on_replaced(rank, returncode, warm)

    def left_gone(self, rank: int, returncode: int) -> None:
        if self._on_gone is not None:
            self._on_gone(rank, returncode)

    # -- running ------------------------------------------------------------------------------
    def _agent(self) -> _JobAgent:
        spec = WorkerSpec(
            role="default",
            local_world_size=self.world_size,
            entrypoint=sys.executable,
            args=("-u", "-m", "meshpact.live.launch.launcher", "--target", self.target),
            rdzv_handler=_OneNode(self.run_id, self.world_size),
            max_restarts=self.max_replacements,
            monitor_interval=0.05,
            local_addr="127.0.0.1",
            master_addr=self.master[0] if self.master else None,
            master_port=self.master[1] if self.master else None,
        )
        logs = DefaultLogsSpecs(log_dir=str(self._dir / "logs"), redirects=Std.ALL)
        agent = _JobAgent(spec, logs, self)
        if self.warm_replacements and isinstance(self.forkserver, ForkServer) and not self.forkserver.prefix:
            # a spare is a replacement not yet placed; it runs on the agent's own host (no command prefix)
            agent.spares.forkserver = self.forkserver
        return agent

    def run(self) -> AgentJobResult:
        """Start every rank, let the agent run the job to its end (or the deadline), collect the results."""
        (self._dir / "args.json").write_text(json.dumps(self.args))
        self._deadline = time.monotonic() + self.timeout_s
        agent = self._agent()
        timed_out = False
        try:
            agent.run()
        except _Deadline:  # elastic's run() stopped every worker on the way out
            timed_out = True
        finally:
            agent._worker_group.spec.rdzv_handler.shutdown()
            agent._store = agent._worker_group.store = None  # the job's store stops listening with its last reference
            agent.spares.clear()
        ledger = agent.ledger
        results = []
        for rank, running in sorted(ledger.running.items()):  # one node: a local rank is the job's rank
            path = self._dir / f"result-{rank}.json"
            value = json.loads(path.read_text()) if path.exists() else None
            rc = running.handler.proc.poll()
            if timed_out and rank not in ledger.finished and rank not in ledger.gone:  # running at the deadline
                rc = None
            results.append(
                RankResult(
                    rank,
                    rc,
                    value,
                    self.notes.get(rank, "") + _tail(agent.stderr_files.get(rank, "")),
                    running.incarnation,
                )
            )
        gone = {rank: int(failure.exitcode) for rank, failure in ledger.gone.items()}
        return AgentJobResult(results, gone, ledger.replaced, timed_out)

    def close(self) -> None:
        """Remove the job's scratch directory (results and logs are read before; ``MESHPACT_KEEP_LAUNCH_DIR=1``
        keeps it)."""
        if not os.environ.get("MESHPACT_KEEP_LAUNCH_DIR"):
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> "AgentJob":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tail(path: str, limit: int = 4000) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - limit))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
