"""Node loss: a node whose agent fell silent, and group rank 0's verdict on it.

Every agent beats on the job's control channel (``agent/beat<g>``) and publishes its node's worker
environment (:class:`NodeEnv`). Group rank 0's agent watches the other agents' beats
(:class:`NodeWatch`): a node silent for ``--node-loss-s`` is lost (:class:`NodeLoss`), and the
verdict (:func:`choose_spare`, :class:`NodeVerdict`) hands its group rank to a live spare node
(:class:`SpareNode`) with the same workers per node, or announces its ranks gone to the job. Every
other agent notes when the channel, hosted by group rank 0's agent, stops answering: past the same
bound node 0 is lost with the job's stores (:class:`HostNodeLost`). At the end, the agents do not
wait at elastic's exit barrier for a node that will not come.

With the control plane apart (``meshpact control-plane``, :mod:`~.controlplane`), the service judges
every node, group rank 0's included (:meth:`NodeWatch.judge`), and every agent only beats: a channel
that stops answering is then the service lost, not a training node.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable, Sequence

from torch.distributed.elastic.agent.server.api import Worker, WorkerGroup

from meshpact.core.errors import MeshpactError

from ..recovery.consensus import mark_gone
from ..recovery.control import ControlChannel
from .processes import say

__all__ = [
    "HostNodeLost",
    "NodeLoss",
    "NodeEnv",
    "SpareNode",
    "NodeVerdict",
    "choose_spare",
    "NodeWatch",
    "note_incarnation",
    "incarnation_key",
    "NODES_CHANGED_KEY",
    "SPARE_COUNT_KEY",
    "JOB_ENDED_KEY",
]

logger = logging.getLogger("meshpact.launch")

NODES_CHANGED_KEY = "agent/nodes_changed"  # on the control channel: group rank 0 lost a node or gave it to a spare
SPARE_COUNT_KEY = "spare/count"  # on the control channel: how many spare nodes registered (each takes the next number)
JOB_ENDED_KEY = "agent/ended"  # on the control channel: group rank 0 passed its exit barrier (spare nodes leave)


class HostNodeLost(MeshpactError):
    """The host of the job's rendezvous store and control channel (group rank 0's node, or the control
    plane service) is gone: the nodes cannot go on without those stores, and say so instead of waiting."""


@dataclass(frozen=True)
class NodeLoss:
    """Group rank 0's verdict on a node whose agent fell silent: which ranks went with it, and why."""

    group_rank: int
    ranks: tuple[int, ...]
    silent_s: float

    def describe(self) -> str:
        return (
            f"{self.what()}; the job is told its ranks are gone (it excises them where it can, above its "
            f"min_ranks, or ends naming why)"
        )

    def what(self) -> str:
        return (
            f"node {self.group_rank} (ranks {list(self.ranks)}) is lost: its agent has not beaten on the "
            f"control channel for {self.silent_s:.1f} s"
        )


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
        return cls(
            wg.group_rank,  # type: ignore[arg-type]  # elastic declares the rendezvous fields None until a rendezvous sets them
            wg.group_world_size,  # type: ignore[arg-type]
            spec.role,
            tuple(w.global_rank for w in wg.workers),
            tuple(w.role_rank for w in wg.workers),
            wg.workers[0].world_size,
            wg.workers[0].role_world_size,
            str(wg.master_addr),
            int(wg.master_port),  # type: ignore[call-overload]  # elastic declares the rendezvous fields None until a rendezvous sets them
            str(spec.rdzv_handler.get_run_id()),
            bool(spec.rdzv_handler.use_agent_store),
        )

    def workers(self) -> list[Worker]:
        return [
            Worker(lr, r, rr, self.world_size, self.role_world_size)
            for lr, (r, rr) in enumerate(zip(self.ranks, self.role_ranks))
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "group_rank": self.group_rank,
            "group_world_size": self.group_world_size,
            "role": self.role,
            "ranks": list(self.ranks),
            "role_ranks": list(self.role_ranks),
            "world_size": self.world_size,
            "role_world_size": self.role_world_size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "run_id": self.run_id,
            "use_agent_store": self.use_agent_store,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "NodeEnv":
        return cls(
            int(d["group_rank"]),
            int(d["group_world_size"]),
            str(d["role"]),
            tuple(int(r) for r in d["ranks"]),
            tuple(int(r) for r in d["role_ranks"]),
            int(d["world_size"]),
            int(d["role_world_size"]),
            str(d["master_addr"]),
            int(d["master_port"]),
            str(d["run_id"]),
            bool(d["use_agent_store"]),
        )


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
        why = (
            f"no registered spare node can take its ranks{others}"
            if self.passed_over
            else "no spare node is registered"
        )
        return (
            f"{self.loss.what()}; {why}; the job is told its ranks are gone (it excises them where it can, above "
            "its min_ranks, or ends naming why)"
        )


def incarnation_key(rank: int) -> str:
    """The control channel's key saying which incarnation runs ``rank`` now (a spare node that takes
    the rank's node starts it above that)."""
    return f"agent/incarnation/rank{rank}"


def note_incarnation(channel: Any, rank: int, incarnation: int) -> None:
    """Say on the control channel that ``rank`` runs at ``incarnation`` now (before its process starts)."""
    try:
        channel.set(incarnation_key(rank), incarnation)
    except (RuntimeError, OSError) as exc:  # the channel's host gone: the job is ending, no spare reads this
        logger.warning("meshpact launch: cannot write rank %d's incarnation (%s)", rank, exc)


def choose_spare(
    loss: NodeLoss, nproc_per_node: int, spares: Sequence[SpareNode], live: Collection[int], node_loss_s: float
) -> NodeVerdict:
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


@dataclass
class _SpareWatch:
    """Group rank 0's view of one registered spare node: its beat count and when it last moved."""

    node: SpareNode
    beats: int
    moved: float | None = None  # monotonic time its beat last moved while watched (None: not yet)

    def live(self, now: float, node_loss_s: float) -> bool:
        return self.moved is not None and now - self.moved <= node_loss_s


class NodeWatch:
    """One agent's watch over the job's nodes (see the module docstring): group rank 0 judges the others
    and the spare nodes; every agent beats, and notes how long the channel has not answered."""

    def __init__(self, node_loss_s: float, apart: bool = False, who: str = "meshpact launch") -> None:
        self.node_loss_s = node_loss_s
        self.apart = apart  # the control plane runs apart: the service judges every node, no agent does
        self.who = who  # what its verdicts are said as
        self.lost_nodes: list[NodeLoss] = []  # nodes whose ranks were announced gone
        self.takeovers: list[NodeVerdict] = []  # nodes whose group rank went to a spare node
        self._beats: dict[int, tuple[int, float]] = {}  # group rank -> (its beat count, when it last moved)
        self._spare_nodes: dict[int, _SpareWatch] = {}  # group rank 0: spare nodes registered and not yet used
        self._spare_nodes_seen = 0  # group rank 0: the spare count last read
        self._down_since: float | None = None  # when the control channel last stopped answering

    def look(self, channel: ControlChannel, wg: WorkerGroup, now: float) -> None:
        """Beat on the control channel; group rank 0 (where the control plane is not apart) also judges
        the other nodes (:meth:`judge`)."""
        channel.add(f"agent/beat{wg.group_rank}")
        if wg.group_rank == 0 and not self.apart:
            self.judge(channel, range(1, wg.group_world_size), wg.spec.local_world_size, now)  # type: ignore[call-overload]  # elastic declares the rendezvous fields None until a rendezvous sets them

    def judge(self, channel: ControlChannel, group_ranks: Iterable[int], nproc_per_node: int, now: float) -> None:
        """Watch the beats of the agents of ``group_ranks`` and of the spare nodes, and give the verdict on
        a node whose agent fell silent for ``node_loss_s`` (an agent that finished says so first)."""
        others = [g for g in group_ranks if g not in {n.group_rank for n in self.lost_nodes}]
        if not others:
            return
        spare_ids = sorted(self._spare_nodes)
        counts = channel.counters(
            [f"agent/beat{g}" for g in others] + [SPARE_COUNT_KEY] + [f"spare/beat{i}" for i in spare_ids]
        )
        self._watch_spare_nodes(channel, counts[len(others)], dict(zip(spare_ids, counts[len(others) + 1 :])), now)
        done = channel.present([f"agent/done{g}" for g in others])
        for g, count in zip(others, counts):
            seen, since = self._beats.get(g, (-1, now))
            if count != seen:
                self._beats[g] = (count, now)
            elif f"agent/done{g}" not in done and now - since > self.node_loss_s:
                n = nproc_per_node
                self._node_lost(channel, NodeLoss(g, tuple(range(g * n, (g + 1) * n)), now - since), n, count, now)

    def ended(self, channel: ControlChannel, group_world_size: int) -> bool:
        """Whether every node of the job has said it is done or was lost with its ranks announced gone
        (a node taken over by a spare node is done when the spare says so)."""
        lost = {n.group_rank for n in self.lost_nodes}
        waited = [f"agent/done{g}" for g in range(group_world_size) if g not in lost]
        return channel.all_present(waited)

    def _watch_spare_nodes(self, channel: ControlChannel, registered: int, beats: dict[int, int], now: float) -> None:
        """Group rank 0: read the spare nodes registered since the last look, and note whose beat moved."""
        if registered > self._spare_nodes_seen:
            new = range(self._spare_nodes_seen + 1, registered + 1)
            got = channel.present([f"spare/node{i}" for i in new])
            for i in new:
                if f"spare/node{i}" not in got:  # a spare writes its record just after taking its number
                    break
                node = SpareNode.from_dict(got[f"spare/node{i}"])
                self._spare_nodes[i] = _SpareWatch(node, -1)
                self._spare_nodes_seen = i
                say(f"{node} registered ({node.nproc_per_node} worker(s) per node, agent pid {node.pid})", self.who)
        for i, count in beats.items():
            watch = self._spare_nodes.get(i)
            if watch is not None and count != watch.beats:
                if watch.beats >= 0:
                    watch.moved = now
                watch.beats = count

    def _node_lost(self, channel: ControlChannel, loss: NodeLoss, nproc_per_node: int, beats: int, now: float) -> None:
        """Group rank 0's verdict on a lost node: its group rank to a live spare node, or its ranks gone."""
        live = {i for i, w in self._spare_nodes.items() if w.live(now, self.node_loss_s)}
        verdict = choose_spare(
            loss, nproc_per_node, [w.node for w in self._spare_nodes.values()], live, self.node_loss_s
        )
        say(verdict.describe(), self.who)
        channel.set(NODES_CHANGED_KEY, True)  # the other agents' exit barrier would wait for it
        if verdict.spare is not None:
            del self._spare_nodes[verdict.spare.spare_id]
            channel.set(f"spare/assign{verdict.spare.spare_id}", {"group_rank": loss.group_rank})
            self.takeovers.append(verdict)
            self._beats[loss.group_rank] = (beats, now)  # the spare beats as the node from now: node_loss_s to start
            return
        self.lost_nodes.append(loss)
        for rank in loss.ranks:
            mark_gone(channel, rank)

    def answered(self) -> None:
        """The control channel answered a look."""
        self._down_since = None

    def unanswered(self, now: float, exc: Exception, control: tuple[str, int], judge_host: bool) -> None:
        """The control channel did not answer. Hosted by group rank 0's agent: once it has not answered for
        ``node_loss_s``, that node is lost, and with it the job's stores (group rank 0 is not replaced:
        its agent hosts them); where ``judge_host`` (an agent of another node, on a channel node 0
        hosts, or any agent where the control plane runs apart) this raises :class:`HostNodeLost`, so
        the node ends its workers and says why in one line."""
        if self._down_since is None:
            self._down_since = now
            logger.warning("meshpact launch: cannot read the control channel (%s)", exc)
        silent = now - self._down_since
        if judge_host and silent > self.node_loss_s:
            host, port = control
            last = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if self.apart:
                raise HostNodeLost(
                    f"the control plane is lost: meshpact control-plane at {host}:{port} has not answered for "
                    f"{silent:.1f} s (last: {last}). It hosts the job's rendezvous store and control channel: "
                    "this node's workers are stopped; start the service and the job again (it resumes from its "
                    "newest checkpoint)"
                )
            raise HostNodeLost(
                f"node 0 is lost: the control channel node 0's agent hosts at {host}:{port} has not answered for "
                f"{silent:.1f} s (last: {last}). Node 0 hosts the job's rendezvous store and control channel, which "
                "no other node can take over: this node's workers are stopped; start the job again (it resumes from "
                "its newest checkpoint)"
            )

    def judges_host(self, group_rank: int | None, hosted_by_caller: bool) -> bool:
        """Whether an agent judges the stores' host lost when its channel falls silent: where the control
        plane runs apart, or on another node than node 0; never where the program running the agent hosts
        the channel (``hosted_by_caller``)."""
        return (self.apart or group_rank != 0) and not hosted_by_caller

    def host_gone(self, control: tuple[str, int]) -> str:
        """The line an agent says when every worker failed and the channel's host does not answer."""
        host, port = control
        if self.apart:
            return (
                f"the control plane at {host}:{port} does not answer: meshpact control-plane is gone (see its "
                "log); the job's stores went with it"
            )
        return (
            f"the control channel node 0's agent hosts at {host}:{port} does not answer: node 0's agent is gone "
            "(its node lost, or its job ended there: see node 0's log); no other node can take its stores over"
        )

    @staticmethod
    def changed(channel: ControlChannel | None) -> bool:
        """Whether group rank 0 said a node of the job was lost or given to a spare node."""
        if channel is None:
            return False
        try:
            return bool(channel.present([NODES_CHANGED_KEY]))
        except (RuntimeError, OSError):  # the channel's host gone: the barrier's store with it
            return True

    def exit_barrier(
        self,
        channel: ControlChannel | None,
        group_rank: int | None,
        elastic_barrier: Callable[[], None],
        timeout_s: float,
    ) -> None:
        """A succeeded agent's end: it says it is done, then waits at elastic's exit barrier
        (``elastic_barrier``) unless a node was lost, given to a spare node or changed, whose agent
        never arrives there; then it tells the spare nodes the job ended."""
        if channel is not None:
            channel.set(f"agent/done{group_rank}", True)
        if not (self.lost_nodes or self.takeovers):
            if (self.apart or group_rank != 0) and self.changed(channel):
                # group rank 0 (or the control plane) lost a node, or gave it to a spare node, which is in no
                # elastic barrier: elastic's barrier would wait its whole timeout for an agent that never arrives
                say("a node of the job was lost: not waiting at elastic's exit barrier")
                return
            elastic_barrier()
        else:  # a lost node's agent never arrives: elastic's barrier would wait out its timeout
            self.wait_at_exit(channel, timeout_s)
        if not self.apart:  # the control plane tells the spare nodes itself
            self.end_standby(channel, group_rank)

    def wait_at_exit(self, channel: ControlChannel | None, timeout_s: float) -> None:
        """Group rank 0, once a node was lost or taken over: wait for the spare nodes acting as nodes to say
        they are done (a spare node is in no elastic barrier, and a lost node's agent never arrives)."""
        lost = sorted({n.group_rank for n in self.lost_nodes})
        if lost:
            say(f"not waiting for the agents of lost node(s) {lost} at exit")
        taken = sorted({v.loss.group_rank for v in self.takeovers} - set(lost))
        if taken and channel is not None:
            say(
                f"waiting for the spare node(s) acting as node(s) {taken} to finish (this agent hosts their "
                "control channel and store)"
            )
            try:
                channel.wait([f"agent/done{g}" for g in taken], timeout_s)
            except (RuntimeError, OSError) as exc:
                say(
                    f"the spare node(s) acting as node(s) {taken} did not finish within {timeout_s:g} s ({exc}); "
                    "leaving"
                )

    @staticmethod
    def end_standby(channel: ControlChannel | None, group_rank: int | None) -> None:
        """Group rank 0: tell the spare nodes still standing by that the job is over (they leave)."""
        if channel is not None and group_rank == 0:
            with contextlib.suppress(Exception):
                channel.set(JOB_ENDED_KEY, True)
