"""A spare node: an agent that stands by for the job and takes the group rank of a node the job loses.

``meshpact launch --spare`` joins no rendezvous round (the job's world size is what its nodes
make). Its :class:`SpareAgent` reads the control channel's address from the rendezvous endpoint's
store (:class:`~meshpact.live.launch.rendezvous.StandbyRendezvous`), registers there as a
:class:`~meshpact.live.launch.nodes.SpareNode` and beats; group rank 0's verdict on a lost node
(:func:`~meshpact.live.launch.nodes.choose_spare`) may hand it that node's group rank, and from
then on it is that node's agent.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec
from torch.distributed.elastic.rendezvous.api import RendezvousGracefulExitError

from meshpact.core.errors import MeshpactError

from ..recovery.consensus import ROUND_KEY
from ..recovery.control import ControlChannel
from .elastic import LaunchOptions, ReplacingAgent
from .nodes import JOB_ENDED_KEY, SPARE_COUNT_KEY, NodeEnv, SpareNode, incarnation_key
from .processes import say, stoppable
from .rendezvous import StandbyRendezvous

__all__ = ["SpareAgent", "NoJobFound"]


class NoJobFound(MeshpactError):
    """A spare node found no job at its ``--rdzv-endpoint`` under its ``--rdzv-id`` within the join timeout."""


class SpareAgent(ReplacingAgent):
    """A spare node's agent (``meshpact launch --spare``): it registers on the job's control channel as
    a standby node and beats there; when group rank 0's agent hands it a lost node's group rank
    (:func:`choose_spare`) it starts that node's workers from the node's published environment
    (:class:`NodeEnv`) with incarnations above the lost processes' and this node's own address, and is
    that node's agent from then on (it replaces failed workers, beats as the group rank, and says it
    is done on the channel at the end, where group rank 0 waits for it). A job that ends without
    needing it, or whose control channel is gone, ends it too (exit 0)."""

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: Any,
        options: LaunchOptions,
        standby: StandbyRendezvous,
        shutdown_timeout: int = 30,
    ) -> None:
        super().__init__(spec, logs_specs, options, shutdown_timeout=shutdown_timeout)
        self._standby = standby
        self._job_run_id = ""
        self._first: dict[int, int] = {}  # local rank -> the incarnation its first process here starts at
        self.me: SpareNode | None = None

    def _run_id(self) -> str:
        return self._job_run_id

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """Instead of a rendezvous round: register as a spare node, stand by, take the group rank given
        (on a thread of its own, :func:`~.processes.stoppable`: the waits for the job and for a node are the store's)."""
        stoppable(lambda: self._take_a_node(worker_group))

    def _take_a_node(self, worker_group: WorkerGroup) -> None:
        h, p = self._standby.endpoint
        say(
            f"spare node: waiting for job {self._standby.get_run_id()} to name its control channel at {h}:{p} "
            f"(up to the rendezvous join_timeout, {self._standby.join_timeout_s:g} s)"
        )
        try:
            host, port, self._job_run_id = self._standby.job()
        except (RuntimeError, OSError) as exc:  # the store's DistStoreError is a RuntimeError
            h, p = self._standby.endpoint
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise NoJobFound(
                f"--spare: no job with --rdzv-id {self._standby.get_run_id()} named its control channel "
                f"at {h}:{p} within {self._standby.join_timeout_s:g} s (give the spare the job's "
                f"--rdzv-endpoint and --rdzv-id; {first})"
            ) from None
        self._control = (host, port)
        self.nodes.apart = self._standby.apart  # served by `meshpact control-plane`: it judges, this agent beats
        # rank -1: the channel's rank names consensus keys, which an agent never writes (its keys name its group rank)
        channel = self._channel = ControlChannel(
            host, port, -1, 1, 5.0, run_id=self._job_run_id, key=self._options.job_key
        )
        me = self.me = SpareNode(
            channel.add(SPARE_COUNT_KEY), self._node_addr(), worker_group.spec.local_world_size, os.getpid()
        )
        channel.set(f"spare/node{me.spare_id}", me.to_dict())
        self.warm_start.await_ready(self._options.loss_watch_s, lambda: channel.add(f"spare/beat{me.spare_id}"))
        warm = worker_group.spec.entrypoint == sys.executable  # a Python script or module: warm interpreters
        for _ in range(worker_group.spec.local_world_size if warm else 0):
            self._start_spare()
        say(
            f"{me} registered with the job (run {self._job_run_id}, control channel {host}:{port}); standing by"
            + (f" with {len(self.spares)} warm interpreter(s)" if warm else "")
        )
        g = self._stand_by(me)
        node = NodeEnv.from_dict(channel.wait([f"agent/node{g}"])[f"agent/node{g}"])
        held = channel.present([incarnation_key(r) for r in node.ranks])
        self._first = {lr: int(held.get(incarnation_key(r), 0)) + 1 for lr, r in enumerate(node.ranks)}
        self.gone.seen_round = channel.counter(ROUND_KEY)  # rounds decided before now named the lost processes
        self._node = node
        worker_group.workers = node.workers()
        worker_group.group_rank = node.group_rank  # type: ignore[assignment]  # elastic declares the rendezvous fields None until a rendezvous sets them
        worker_group.group_world_size = node.group_world_size  # type: ignore[assignment]  # (as above)
        worker_group.master_addr = node.master_addr  # type: ignore[assignment]  # (as above)
        worker_group.master_port = node.master_port  # type: ignore[assignment]  # (as above)
        worker_group.store = None
        say(
            f"{me} takes node {g}: ranks {list(node.ranks)} start here at incarnation(s) "
            f"{[self._first[lr] for lr in range(len(node.ranks))]}"
        )

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
                say(f"{me}: the job's control channel is gone ({exc}); leaving")
                raise RendezvousGracefulExitError("the job's control channel is gone") from None
            self.spares.note_ready()
            if key in got:
                return int(got[key]["group_rank"])
            if JOB_ENDED_KEY in got:
                say(f"{me}: the job ended without needing a spare node; leaving")
                raise RendezvousGracefulExitError("the job ended")
            time.sleep(self._options.loss_watch_s)

    warm_first = True  # the interpreters started while standing by become the node's workers

    def _first_incarnation(self, local_rank: int) -> int:
        return self._first.get(local_rank, 1)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        pids = super()._start_workers(worker_group)
        warm = sum(r.warm for r in self.ledger.running.values())
        say(
            f"{self.me} started rank(s) {[w.global_rank for w in worker_group.workers]} as pid(s) "
            f"{[pids[w.local_rank] for w in worker_group.workers]} ({warm} of them warm interpreter(s))"
        )
        return pids

    def _exit_barrier(self) -> None:
        """In no elastic barrier (group rank 0 waits for this node's ``agent/done<g>`` on the channel)."""
        with contextlib.suppress(RuntimeError, OSError):
            if self._channel is not None:
                self._channel.set(f"agent/done{self._worker_group.group_rank}", True)
