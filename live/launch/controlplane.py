"""The control plane apart: the job's rendezvous store and control channel on a host that trains nothing.

By default group rank 0's agent hosts the job's stores (the c10d rendezvous store at
``--rdzv-endpoint``, the store its workers share, the control channel) and judges the other nodes,
so losing node 0 ends the job. ``meshpact control-plane`` serves all of them as a service of its own
(as torchft's Lighthouse runs apart from its replica groups), and ``meshpact launch
--control-plane service`` (or ``MESHPACT_CONTROL_PLANE=service``) makes every agent a client of it:

| what | group rank 0's agent (``node``) | ``meshpact control-plane`` (``service``) |
|---|---|---|
| c10d rendezvous store | at ``--rdzv-endpoint``, on node 0 | at ``--host``:``--port`` (the nodes' ``--rdzv-endpoint``) |
| the workers' store (``MASTER_ADDR``/``PORT``) | on node 0's ``--local-addr`` | the same store as the rendezvous |
| control channel | on node 0, a port the kernel picks | at ``--host``:``--control-port`` (0: the kernel picks) |
| where agents find the channel | the rendezvous store (elastic's prefix) | :func:`~.rendezvous.standby_key` (:class:`~.rendezvous.StandbyRecord`) |
| who judges a silent node | group rank 0's agent, nodes 1.. | the service, every node (node 0 included) |
| node 0 lost | the job ends | as any node: excised, or taken by a spare node |

The service writes the channel's address under :func:`~.rendezvous.standby_key` as it starts, then
watches: once a node has published its worker environment (``agent/node<g>``, which names the job's
number of nodes) it judges every node's beats with :meth:`~.nodes.NodeWatch.judge`, the verdict
group rank 0's agent gives otherwise. When every node has said it is done or was lost, it tells the
spare nodes standing by that the job ended, serves ``--linger-s`` longer (the agents' exit barrier
and rendezvous shutdown still reach its stores), and exits 0. Values it writes on the channel are
signed with the job key like every agent's (:mod:`~meshpact.live.recovery.jobkey`): it needs the
same ``MESHPACT_JOB_KEY`` or ``MESHPACT_JOB_KEY_FILE`` as the nodes.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Mapping

from meshpact.core.errors import MeshpactError

from ..recovery import jobkey
from ..recovery.control import ControlChannel
from ..store import host_store
from .nodes import NodeEnv, NodeWatch
from .processes import say
from .rendezvous import StandbyRecord, standby_key

__all__ = [
    "ControlPlaneHost",
    "ControlPlaneOptions",
    "ControlPlaneRefused",
    "ControlPlaneStopped",
    "ControlPlane",
    "CONTROL_PLANE_ENV",
    "control_plane_host",
    "service_key",
    "MAX_NODES",
]

CONTROL_PLANE_ENV = "MESHPACT_CONTROL_PLANE"  # the default of ``meshpact launch --control-plane``
MAX_NODES = 65536  # a node record naming more nodes than this is not watched (read from the channel)
_RDZV_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def _say(line: str) -> None:
    say(line, "meshpact control-plane")


class ControlPlaneHost(Enum):
    """Who hosts a job's rendezvous store and control channel."""

    NODE = "node"  # group rank 0's agent (the default): losing node 0 ends the job
    SERVICE = "service"  # ``meshpact control-plane``, on a host that trains nothing


class ControlPlaneRefused(MeshpactError):
    """A ``meshpact control-plane`` command line (or ``--control-plane`` value) that cannot run; the message
    names the flag and what it expects."""


class ControlPlaneStopped(MeshpactError):
    """The service was stopped by a signal before the job ended."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def control_plane_host(value: str, flag: str = "--control-plane") -> ControlPlaneHost:
    """``value`` read as a :class:`ControlPlaneHost`; :class:`ControlPlaneRefused` names ``flag`` otherwise."""
    try:
        return ControlPlaneHost(value.strip().lower())
    except ValueError:
        choices = " or ".join(h.value for h in ControlPlaneHost)
        raise ControlPlaneRefused(f"{flag} {value!r}: expected {choices}") from None


def service_key(env: Mapping[str, str]) -> jobkey.JobKey | None:
    """The job key the service signs with: the nodes' (``MESHPACT_JOB_KEY`` or ``MESHPACT_JOB_KEY_FILE``);
    None where the job opted out (``MESHPACT_UNAUTHENTICATED=1``); refused in one line otherwise."""
    if not (env.get(jobkey.KEY_ENV) or env.get(jobkey.KEY_FILE_ENV)):
        if env.get(jobkey.UNAUTHENTICATED_ENV) == "1":
            return None
        raise ControlPlaneRefused(
            f"the control plane signs with the job's key and none was given: set "
            f"{jobkey.KEY_ENV} or {jobkey.KEY_FILE_ENV} to the key every node of the job "
            f"has, or {jobkey.UNAUTHENTICATED_ENV}=1 where the job runs without one"
        )
    try:
        return jobkey.load(env, "", multi_host=True)
    except jobkey.JobKeyError as exc:
        raise ControlPlaneRefused(str(exc)) from None


@dataclass(frozen=True)
class ControlPlaneOptions:
    """``meshpact control-plane``'s command line."""

    rdzv_id: str  # the job's --rdzv-id: the keys the service writes and watches
    host: str = "127.0.0.1"  # the address its stores listen on (that alone)
    port: int = 29400  # the rendezvous store: the nodes' --rdzv-endpoint is host:port
    control_port: int = 0  # the control channel (0: the kernel picks; the nodes read it from the record)
    node_loss_s: float = 5.0  # a node whose agent has not beaten for this long is lost
    linger_s: float = 30.0  # how long the stores stay up once the job ended
    watch_s: float = 0.25  # how often the service reads the beats (the agents beat as often)

    def __post_init__(self) -> None:
        if not _RDZV_ID.fullmatch(self.rdzv_id):
            raise ControlPlaneRefused(
                f"--rdzv-id {self.rdzv_id[:140]!r}: expected the job's rendezvous id, 1 to 128 "
                "letters, digits, '.', '_' or '-' (the nodes' --rdzv-id)"
            )
        if not self.host:
            raise ControlPlaneRefused("--host '': expected the address the stores listen on (127.0.0.1 by default)")
        if not 1 <= self.port <= 65535:
            raise ControlPlaneRefused(
                f"--port {self.port}: expected a port from 1 to 65535 (the nodes' --rdzv-endpoint names it)"
            )
        if not 0 <= self.control_port <= 65535 or self.control_port == self.port:
            raise ControlPlaneRefused(
                f"--control-port {self.control_port}: expected 0 (the kernel picks) or a port "
                f"from 1 to 65535 other than --port {self.port}"
            )
        if not self.node_loss_s > 4 * self.watch_s:
            raise ControlPlaneRefused(
                f"--node-loss-s {self.node_loss_s}: expected more than {4 * self.watch_s:g} s "
                f"(four of the agents' beats, one every {self.watch_s:g} s)"
            )
        if not 0 <= self.linger_s <= 3600:
            raise ControlPlaneRefused(f"--linger-s {self.linger_s}: expected 0 to 3600 s")


@dataclass(frozen=True)
class JobLayout:
    """The job's nodes as the service learns them from a node's published worker environment."""

    group_world_size: int
    nproc_per_node: int


class ControlPlane:
    """The service (see the module docstring): its stores are up while it is entered as a context manager;
    :meth:`serve` watches the job's nodes until the job ends."""

    def __init__(self, options: ControlPlaneOptions, key: jobkey.JobKey | None) -> None:
        self.options = options
        self.key = key
        self.watch = NodeWatch(options.node_loss_s, apart=True, who="meshpact control-plane")
        self._stores: list[Any] = []
        self.channel: ControlChannel | None = None
        self.layout: JobLayout | None = None

    def __enter__(self) -> "ControlPlane":
        o = self.options
        try:
            rendezvous = host_store(o.host, o.port, 1, 60.0)
            control = host_store(o.host, o.control_port, 1, 60.0)
        except OSError as exc:
            self._stores.clear()
            raise ControlPlaneRefused(f"--host {o.host} --port {o.port}: {exc}") from None
        self._stores = [rendezvous, control]
        record = StandbyRecord(o.host, int(control.port), o.rdzv_id, apart=True)
        rendezvous.set(standby_key(o.rdzv_id), record.to_json())
        # rank -1: the service writes no consensus key of a rank (as a spare node's agent)
        self.channel = ControlChannel(o.host, int(control.port), -1, 1, 5.0, run_id=o.rdzv_id, key=self.key)
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel = None
        self._stores.clear()

    @property
    def control_port(self) -> int:
        return int(self._stores[1].port)

    def _read_layout(self) -> JobLayout | None:
        """The job's number of nodes and workers per node, once a node has published its environment."""
        assert self.channel is not None
        got = self.channel.present(["agent/node0"])
        if "agent/node0" not in got:
            return None
        try:
            node = NodeEnv.from_dict(got["agent/node0"])
        except (KeyError, TypeError, ValueError):
            return None
        if not 1 <= node.group_world_size <= MAX_NODES or not node.ranks:
            _say(
                f"node 0's record names {node.group_world_size} node(s) of {len(node.ranks)} worker(s): not a job "
                f"this service watches (1 to {MAX_NODES} nodes)"
            )
            return None
        return JobLayout(node.group_world_size, len(node.ranks))

    def look(self, now: float) -> bool:
        """One look at the job's nodes: the verdict on a silent one; whether the job ended."""
        assert self.channel is not None
        if self.layout is None:
            self.layout = self._read_layout()
            if self.layout is None:
                return False
            _say(
                f"job {self.options.rdzv_id}: {self.layout.group_world_size} node(s) of "
                f"{self.layout.nproc_per_node} worker(s); watching their agents' beats (lost after "
                f"{self.options.node_loss_s:g} s)"
            )
        layout = self.layout
        self.watch.judge(self.channel, range(layout.group_world_size), layout.nproc_per_node, now)
        return self.watch.ended(self.channel, layout.group_world_size)

    def serve(self, until: float | None = None) -> bool:
        """Watch the job until it ends (True; the spare nodes standing by are told, and the stores stay up
        ``linger_s``), or until the monotonic time ``until`` (False)."""
        while until is None or time.monotonic() < until:
            if self.look(time.monotonic()):
                NodeWatch.end_standby(self.channel, 0)
                lost = sorted(n.group_rank for n in self.watch.lost_nodes)
                taken = sorted(v.loss.group_rank for v in self.watch.takeovers)
                _say(
                    f"job {self.options.rdzv_id} ended: every node is done"
                    + (f" or lost ({lost})" if lost else "")
                    + (f"; node(s) {taken} ended on spare nodes" if taken else "")
                    + f"; serving {self.options.linger_s:g} s more for the agents' exit"
                )
                time.sleep(self.options.linger_s)
                return True
            time.sleep(self.options.watch_s)
        return False


def run(options: ControlPlaneOptions, env: Mapping[str, str] = os.environ) -> int:
    """``meshpact control-plane``: serve the job's stores until it ends (0), or until SIGTERM/SIGINT (128+signal)."""
    key = service_key(env)

    def stop(signum: int, frame: Any) -> None:
        raise ControlPlaneStopped(signum)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with ControlPlane(options, key) as plane:
            o = options
            _say(
                f"control plane for job {o.rdzv_id}: rendezvous store at {o.host}:{o.port} (the nodes' "
                f"--rdzv-endpoint), control channel at {o.host}:{plane.control_port}; key: "
                f"{key.source if key is not None else 'none (MESHPACT_UNAUTHENTICATED=1)'}"
            )
            plane.serve()
        return 0
    except ControlPlaneStopped as exc:
        _say(f"{exc}; the job's stores are gone")
        return 128 + exc.signum
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
