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
recovery as a process with ``MESHPACT_INCARNATION`` above 0 (:func:`~meshpact.live.recovery.session.start_session`).
The agent also plays the launcher's other two parts in consensus: a rank the job declares lost
(silent for the rank-loss bound) is killed here and replaced; a rank it can give no process
again is marked gone (:func:`~meshpact.live.recovery.consensus.mark_gone`), so the survivors excise it or end
with the reason instead of waiting.

Warm spares (``--spare-ranks-per-node N``): N interpreters per node with torch imported
(:mod:`~meshpact.live.launch.warmspare`), each promoted to a failed worker's rank by one file.

Warm starts (``--warm-start``): one process per node imports torch, its distributed packages and
Meshpact's runtime once (:class:`~.warmstart.WarmStart`, a fork server started beside the rendezvous), and
every worker process the agent starts (first, replacement or spare) is forked from it and runs
the worker's command line as ``python`` would. A node of eight workers imports torch once, not
eight times at once. A worker whose environment differs from the server's in what torch reads
at import (:data:`~.forkserver.IMPORT_TIME_ENV`), or a command that is not ``python [-u] script``
or ``python [-u] -m module`` run by this interpreter, starts fresh, and the agent says why.

A lost node (its agent silent for ``--node-loss-s``) is announced by group rank 0's agent. A
*spare node* (``meshpact launch --spare``, :class:`~.spareagent.SpareAgent`) can take its place: it joins no
rendezvous round (the job's world size is what its nodes make), but reads the control channel's
address from the rendezvous endpoint's store (group rank 0 writes it there under
:func:`~.rendezvous.standby_key`), registers on the channel and beats there. Group rank 0's verdict on a lost
node (:func:`~.nodes.choose_spare`) hands the node's group rank to a live spare node with the same
``--nproc-per-node`` instead of announcing its ranks gone; the spare starts the node's workers
from the worker environment every agent publishes (:class:`~.nodes.NodeEnv`), with incarnations above
the lost processes' and its own address, and from then on is that node's agent. While it stands by
it keeps one warm interpreter per worker (as ``--spare-ranks-per-node`` does), promoted to the
node's ranks on the takeover.

With the control plane apart (``--control-plane service``, :mod:`~.controlplane`), ``meshpact
control-plane`` hosts the rendezvous store, the store the workers share and the control channel on a
host that trains nothing, and judges every node; no agent hosts a store or judges, so node 0 is
lost as any node is (excised, or taken by a spare node).

Plain ``torchrun`` keeps working with the same scripts: without ``MESHPACT_CONTROL_PORT`` rank 0
hosts the control channel, and a kill ends the job as torchrun decides.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import (
    RunResult,
    SimpleElasticAgent,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from torch.distributed.elastic.multiprocessing.subprocess_handler import get_subprocess_handler

from meshpact.core.errors import MeshpactError

from ..recovery import jobkey
from ..recovery.control import ControlChannel
from ..recovery.refusal import REFUSAL_FILE_ENV, REFUSAL_LINE
from .controlplane import ControlPlaneHost
from .gone import GoneRanks
from .nodes import NodeEnv, NodeWatch, note_incarnation
from .processes import Running, handle_death_signals, say, stop, stoppable, wait_any
from .rendezvous import open_control
from .replacement import Ledger, Replacements
from .sparepool import SparePool
from .warmstart import WarmStart
from .workerenv import worker_environment

__all__ = ["LaunchOptions", "LaunchRefused", "ReplacingAgent"]

logger = logging.getLogger("meshpact.launch")


class LaunchRefused(MeshpactError):
    """A command line ``meshpact launch`` cannot run; the message names the flag and what it expects."""


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
    control_plane: ControlPlaneHost = ControlPlaneHost.NODE  # who hosts the stores and judges node loss
    warm_start: bool = False  # workers and spares forked from one process per node that imported torch once

    @property
    def apart(self) -> bool:
        """Whether the control plane runs apart from the training nodes (``meshpact control-plane``)."""
        return self.control_plane is ControlPlaneHost.SERVICE

    def __post_init__(self) -> None:
        if self.spare_ranks_per_node < 0:
            raise LaunchRefused(f"--spare-ranks-per-node {self.spare_ranks_per_node}: expected 0 or more")
        if not self.node_loss_s > 4 * self.loss_watch_s:
            raise LaunchRefused(
                f"--node-loss-s {self.node_loss_s}: expected more than {4 * self.loss_watch_s:g} s "
                f"(four of the agents' beats, one every {self.loss_watch_s:g} s)"
            )


class ReplacingAgent(SimpleElasticAgent):
    """torch.distributed.elastic's agent for one node, replacing a failed worker alone (see the module
    docstring); the rendezvous, rank assignment, exit barrier and error records are elastic's own.
    Its decisions are its collaborators': :class:`~.replacement.Replacements` (replace a failed
    worker), :class:`~.sparepool.SparePool` (promote a warm spare), :class:`~.gone.GoneRanks`
    (announce gone ranks, kill the declared lost) and :class:`~.nodes.NodeWatch` (node loss)."""

    given_control: tuple[str, int] | None = None  # a control channel hosted by whoever runs the agent
    warm_first = False  # whether a first process is a warm spare's promotion where one is alive (a spare node's)

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: Any,
        options: LaunchOptions,
        exit_barrier_timeout: float = 300,
        shutdown_timeout: int = 30,
    ) -> None:
        super().__init__(spec, exit_barrier_timeout, shutdown_timeout)
        self._logs_specs = logs_specs
        self._options = options
        self.replacements = Replacements(spec.max_restarts)
        self.spares = SparePool()
        self.gone = GoneRanks(options.loss_watch_s)
        self.nodes = NodeWatch(options.node_loss_s, apart=options.apart)
        self._control_server: Any = None
        self._channel: ControlChannel | None = None
        self._control: tuple[str, int] = ("", 0)  # the control channel's address
        self._node: NodeEnv | None = None  # the worker environment of this agent's group rank
        self.warm_start = WarmStart.start(
            options.warm_start, spec.entrypoint, spec.args, spec.numa_options, self.spares
        )

    @property
    def ledger(self) -> Ledger:
        return self.replacements.ledger

    # -- addresses and the control channel ------------------------------------------
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """elastic's rendezvous, waited for on a thread of its own (:func:`~.processes.stoppable`)."""
        stoppable(lambda: super(ReplacingAgent, self)._rendezvous(worker_group))

    def _node_addr(self) -> str:
        return self._worker_group.spec.local_addr or socket.getfqdn()

    def _open_control(self, wg: WorkerGroup) -> None:
        if self._channel is None:
            self._control_server, self._control, self._channel = open_control(
                wg, self.given_control, self._run_id(), self._options.job_key, apart=self._options.apart
            )

    def _run_id(self) -> str:
        return os.environ.get("MESHPACT_RUN_ID") or str(self._worker_group.spec.rdzv_handler.get_run_id())

    def _env(self, wg: WorkerGroup, local_rank: int, incarnation: int) -> dict[str, str]:
        env = worker_environment(
            wg,
            local_rank,
            incarnation,
            self._node or NodeEnv.of(wg),
            self._control,
            self._run_id(),
            self._options.job_key,
            self._node_addr(),
        )
        env[REFUSAL_FILE_ENV] = str(self.replacements.marker_of(local_rank, incarnation))
        env.update(self._worker_env(wg.workers[local_rank].global_rank))
        return env

    def _worker_env(self, rank: int) -> dict[str, str]:
        """What an agent run inside another program adds to ``rank``'s environment (nothing here)."""
        return {}

    # -- starting ------------------------------------------------------------------------
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        spec = worker_group.spec
        self._open_control(worker_group)
        assert self._channel is not None
        if self._node is None:  # a member of the rendezvous: its node's environment, for a spare node to take
            self._node = NodeEnv.of(worker_group)
            self._channel.set(f"agent/node{worker_group.group_rank}", self._node.to_dict())
        self.warm_start.await_ready(self._options.loss_watch_s, lambda: self._kill_declared_lost(worker_group))
        first = {w.local_rank: self._first_incarnation(w.local_rank) for w in worker_group.workers}
        envs = {w.local_rank: self._env(worker_group, w.local_rank, first[w.local_rank]) for w in worker_group.workers}
        dest = self._logs_specs.reify(envs)  # error files (TORCHELASTIC_ERROR_FILE) and log files, elastic's layout
        first_error = dest.error_files.get(0, os.devnull)
        self.replacements.attempt_dir = Path(first_error).parent.parent if first_error != os.devnull else None
        for w in worker_group.workers:
            lr = w.local_rank
            streams = self.replacements.streams[lr] = (dest.stdouts.get(lr, ""), dest.stderrs.get(lr, ""))
            if first[lr]:
                note_incarnation(self._channel, w.global_rank, first[lr])
            self.ledger.running[lr] = self._launch(
                spec, lr, envs[lr], streams, dest.error_files.get(lr, os.devnull), first[lr], warm=self.warm_first
            )
        for _ in range(self._options.spare_ranks_per_node):
            self._start_spare()
        return {lr: r.pid for lr, r in self.ledger.running.items()}

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
        """Start ``local_rank``'s process: a warm spare promoted (``warm``, and one is alive), else a new process."""
        handler = self.spares.promote(env, spec.args, streams) if warm else None
        if handler is not None:
            return Running(handler, incarnation, error_file, warm=True)
        return Running(self._start_process(spec, local_rank, env, streams, incarnation), incarnation, error_file)

    def _start_process(
        self, spec: WorkerSpec, local_rank: int, env: dict[str, str], streams: tuple[str, str], incarnation: int
    ) -> Any:
        """A new process for ``local_rank`` (elastic's subprocess handler: ``.proc`` and ``.close``): forked
        from the node's fork server (``--warm-start``), else a fresh one."""
        assert isinstance(spec.entrypoint, str)  # a program to run: the launcher takes no Python callable
        return self.warm_start.fork(spec.args, env, streams) or get_subprocess_handler(
            spec.entrypoint, tuple(spec.args), env, streams[0], streams[1], local_rank, spec.numa_options
        )

    def _first_incarnation(self, local_rank: int) -> int:
        """The incarnation of the first process this agent starts for ``local_rank`` (0: the rank's first)."""
        return 0

    def _start_spare(self) -> int:
        """Start one warm spare on this node; its pid."""
        return self.spares.start()

    def _replace(self, wg: WorkerGroup, local_rank: int) -> Running:
        """Start a process for ``local_rank`` (its old one has exited): a warm spare if one waits."""
        incarnation = self.replacements.next_incarnation(local_rank)
        note_incarnation(self._channel, wg.workers[local_rank].global_rank, incarnation)
        env = self._env(wg, local_rank, incarnation)
        out, err, error_file = self.replacements.files_of(local_rank, incarnation)
        env["TORCHELASTIC_ERROR_FILE"] = "" if error_file == os.devnull else error_file
        running = self._launch(wg.spec, local_rank, env, (out, err), error_file, incarnation, warm=True)
        self.replacements.replaced(local_rank, running)
        return running

    # -- watching ------------------------------------------------------------------------
    def _watch(self, wg: WorkerGroup) -> RunResult | None:
        """One look at the workers: replace the failed, kill the declared lost; the group's end, or None."""
        for lr, failure in self.replacements.exits():
            rank, rc = wg.workers[lr].global_rank, failure.exitcode
            refused = self.replacements.refusal(lr)
            if refused is None and self.replacements.allowed() and self._should_replace(rank, rc):
                new = self._replace(wg, lr)
                self._replaced(rank, rc, new)
                say(
                    f"rank {rank} (pid {failure.pid}) exited with {rc}: {failure.message or 'no error file'}; "
                    f"replaced by pid {new.pid} ({'a warm spare' if new.warm else 'a new process'}, "
                    f"incarnation {new.incarnation}; {self.replacements.remaining} replacement(s) left on this node)"
                )
                continue
            if refused is not None:
                why = refused.removeprefix(REFUSAL_LINE)
                said = f", refusing a recovery that cannot happen ({why}); no replacement is started for it"
            else:
                said = f" and no replacement is {self.replacements.why_not()}"
            self.replacements.left_gone(lr, failure)
            self._left_gone(rank, rc)
            say(f"rank {rank} (pid {failure.pid}) exited with {rc}{said}: the job is told it is gone")
        self._kill_declared_lost(wg)
        self.spares.note_ready()
        result = self.replacements.end(wg)
        if result is None:
            self._tick()  # after the exits are collected: a job that just ended is not past its deadline
            return None
        if (
            not self.ledger.finished
            and self.nodes.judges_host(wg.group_rank, self.given_control is not None)
            and self._channel is not None
            and not self._channel.answers()
        ):
            # every worker failed and the channel does not answer: its host is gone (node 0's agent, its node
            # lost or its own workers failed first; or the control plane); said beside elastic's record
            say(self.nodes.host_gone(self._control))
        return result

    def _should_replace(self, rank: int, returncode: int) -> bool:
        """Whether a failed worker gets a replacement while some are left (here: any failure, as a job's
        workers fail in many ways; an agent run by a trial replaces only the processes its faults kill)."""
        return True

    def _tick(self) -> None:
        """Every look at the workers, before it (an agent run inside another program does its own part here)."""

    def _replaced(self, rank: int, returncode: int, new: Running) -> None:
        """``rank``'s process exited with ``returncode`` and ``new`` runs it now."""

    def _left_gone(self, rank: int, returncode: int) -> None:
        """``rank``'s process exited with ``returncode`` and no replacement is left: the job is told it is gone."""
        assert self._channel is not None
        self.gone.announce(self._channel, rank)

    def _kill_declared_lost(self, wg: WorkerGroup) -> None:
        """Kill the ranks the job declared lost (:meth:`.gone.GoneRanks.kill_declared`)."""
        hosted = self.given_control is not None
        self.gone.kill_declared(self._channel, wg, self.nodes, self.ledger.watched(), self._control, hosted)

    def _exit_barrier(self) -> None:
        barrier = super()._exit_barrier
        self.nodes.exit_barrier(self._channel, self._worker_group.group_rank, barrier, self._exit_barrier_timeout)

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
        handle_death_signals()

    def _wait_for_exit(self, timeout_s: float) -> None:
        wait_any(self.ledger.watched().values(), timeout_s)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        return self._watch(worker_group) or RunResult(state=WorkerState.HEALTHY)

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._shutdown()

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        stop([r.handler.proc for r in self.ledger.running.values()] + self.spares.procs(), death_sig, timeout)
        for running in self.ledger.running.values():
            running.close()
        self.spares.clear()
        self.replacements.close()
        self.warm_start.close()  # every process it forked is stopped: it ends as its stdin closes
        self._channel = None
        self._control_server = None
