"""Rendezvous: how an agent finds its job, under elastic's ``RendezvousHandler`` interface.

:func:`rendezvous_handler` is elastic's own handler for ``--rdzv-backend`` with every store the
agent hosts listening on the address it is named by alone. :class:`FixedRendezvous` answers for a
rendezvous with no rounds (a one-node job run inside another program, a spare node);
:class:`StandbyRendezvous` is a spare node's: it joins no round, and reads where group rank 0's
agent hosts the job's control channel from the rendezvous endpoint's own store (:func:`standby_key`).
With the control plane apart (``meshpact control-plane`` serves the endpoint's store and the
channel, :mod:`~.controlplane`), no agent hosts a store: each reads the channel's address from the
same record (:class:`StandbyRecord`), and the workers share the endpoint's store.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.api import RendezvousError

from ..recovery.control import ControlChannel
from ..recovery.jobkey import JobKey
from ..store import host_store

__all__ = [
    "FixedRendezvous",
    "StandbyRendezvous",
    "StandbyRecord",
    "standby_key",
    "rendezvous_handler",
    "root_store",
    "open_control",
    "CONTROL_KEY",
]

CONTROL_KEY = "meshpact/control"  # in the rendezvous store: "host:port" of the control channel


def standby_key(rdzv_id: str) -> str:
    """The key, in the rendezvous endpoint's own store (under no prefix of elastic's), where the host of
    the control channel names it for spare nodes (and, with the control plane apart, for every agent):
    a JSON :class:`StandbyRecord`."""
    return f"meshpact/standby/{rdzv_id}"


@dataclass(frozen=True)
class StandbyRecord:
    """Where a job's control channel is, as its host names it under :func:`standby_key`."""

    host: str
    port: int
    run_id: str  # the run id the channel's keys are kept under
    apart: bool = False  # served by ``meshpact control-plane``, not by group rank 0's agent

    def to_json(self) -> str:
        return json.dumps({"control": f"{self.host}:{self.port}", "run_id": self.run_id, "apart": self.apart})

    @classmethod
    def from_json(cls, raw: bytes | str) -> "StandbyRecord":
        record = json.loads(raw)
        host, _, port = str(record["control"]).rpartition(":")
        return cls(host, int(port), str(record["run_id"]), bool(record.get("apart", False)))


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
        self.apart = False  # the job's control plane runs apart (read with the record, :meth:`job`)

    def job(self) -> tuple[str, int, str]:
        """(host, port, run id of its keys) of the job's control channel, once group rank 0 has named it
        (waits up to the join timeout; a store that never answers raises ``DistStoreError``)."""
        from torch.distributed import TCPStore

        if self._store is None:
            self._store = TCPStore(
                self.endpoint[0],
                self.endpoint[1],
                is_master=False,
                wait_for_workers=False,
                timeout=timedelta(seconds=self.join_timeout_s),
            )
        record = StandbyRecord.from_json(self._store.get(standby_key(self._run_id)))
        self.apart = record.apart
        return record.host, record.port, record.run_id

    def get_backend(self) -> str:
        return "standby"

    def next_rendezvous(self) -> Any:
        raise RendezvousError(
            "a spare node joins no rendezvous round: its agent (SpareAgent) waits on the job's "
            "control channel to be given a lost node's group rank"
        )


def root_store(store: Any) -> Any:
    """The store under every ``PrefixStore`` elastic wrapped around it (the rendezvous endpoint's own)."""
    from torch.distributed import PrefixStore

    while isinstance(store, PrefixStore):
        store = store.underlying_store
    return store


def rendezvous_handler(params: RendezvousParameters, apart: bool = False) -> RendezvousHandler:
    """Elastic's rendezvous handler for ``params``, with every store this agent hosts listening on
    the address it is named by alone (:func:`~meshpact.live.store.host_store`): torch's TCPStore
    listens on every interface whatever host it is given. The c10d backend's store (on the node
    whose address the ``--rdzv-endpoint`` names; ``--standalone``: loopback) and the store it
    shares with the workers (on the node's ``--local-addr``), and the static backend's store on
    ``--master-addr``. Other backends (etcd) are elastic's own. ``apart``: the control plane
    service hosts the endpoint's store, and the workers share it (the agent hosts nothing)."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous, static_tcp_rendezvous
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

    if params.backend == "static":
        handler = static_tcp_rendezvous.create_rdzv_handler(params)
        assert isinstance(handler, static_tcp_rendezvous.StaticTCPRendezvous)  # what the static backend makes
        if handler.rank == 0:  # the store it would make at its first round, made here on the named address
            handler._store = host_store(
                handler.master_addr, handler.master_port, handler.world_size, handler.timeout.total_seconds()
            )
        return handler
    if params.backend != "c10d" or params.get("store_type", "tcp").strip().lower() != "tcp":
        return rdzv_registry.get_rendezvous_handler(params)
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=c10d_rendezvous_backend.DEFAULT_PORT)
    is_host = params.get_as_bool("is_host")
    timeout_s = float(params.get_as_int("read_timeout", 60) or 60)
    store: Any = None
    if not apart and is_host is not False and (is_host or _matches_machine_hostname(host)):
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
    if apart:  # the workers share the service's store (their MASTER_ADDR/PORT: the endpoint): none hosted here
        handler._create_tcp_store_server = lambda addr, port: store  # type: ignore[method-assign, assignment]  # elastic has no hook for the store it shares with the workers
        return handler
    # the store group rank 0's agent shares with its workers: on the node's address alone
    handler._create_tcp_store_server = (  # type: ignore[method-assign]  # elastic has no hook for the store it shares with the workers
        lambda addr, port: host_store(addr, port, 1, timeout_s)  # type: ignore[assignment]  # (as above)
    )
    return handler


def open_control(
    wg: WorkerGroup, given: tuple[str, int] | None, run_id: str, key: JobKey | None, apart: bool = False
) -> tuple[Any, tuple[str, int], ControlChannel]:
    """The job's control channel, as one agent joins it: group rank 0 hosts it (or takes ``given``, a
    channel hosted by whoever runs the agent) and names it in the rendezvous store, under elastic's
    prefix for the agents and under :func:`standby_key` for spare nodes; every agent then reads
    it there. ``apart``: the control plane service hosts it and named it under :func:`standby_key`,
    where every agent reads it. (the store group rank 0 hosts, or None; the channel's address; the channel)."""
    server: Any = None
    store, group_rank = wg.store, wg.group_rank
    assert store is not None and group_rank is not None  # the group has met: its rendezvous set both
    if apart:
        record = StandbyRecord.from_json(root_store(store).get(standby_key(str(wg.spec.rdzv_handler.get_run_id()))))
        channel = ControlChannel(
            record.host, record.port, group_rank, wg.workers[0].world_size, 5.0, run_id=run_id, key=key
        )
        return None, (record.host, record.port), channel
    if group_rank == 0:
        if given is not None:
            address = "{}:{}".format(*given)
        else:
            assert wg.master_addr is not None  # rank 0's rendezvous names its address
            server = host_store(wg.master_addr, 0, wg.workers[0].world_size)
            address = f"{wg.master_addr}:{server.port}"
        store.set(CONTROL_KEY, address)
        host, _, port = address.rpartition(":")
        standby = StandbyRecord(host, int(port), run_id)  # for spare nodes, outside elastic's prefix
        root_store(store).set(standby_key(str(wg.spec.rdzv_handler.get_run_id())), standby.to_json())
    host, _, port = store.get(CONTROL_KEY).decode().rpartition(":")
    channel = ControlChannel(host, int(port), group_rank, wg.workers[0].world_size, 5.0, run_id=run_id, key=key)
    return server, (host, int(port)), channel
