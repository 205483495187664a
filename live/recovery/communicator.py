"""Data-path communicators, one per generation, and the choice of how to replace one.

Each recovery starts a new *generation*. Every data-path process group of the job (the
group over all ranks, each DeviceMesh dimension's groups, groups the user made with
``new_group``) is built fresh for it over the rendezvous store under its own namespace
(``meshpact/<run>/g<gen>/<base>/``), so nothing of a broken group's key space or sockets is
reused, and installed in c10d's world as ``<base>_g<gen>`` (``meshpact_data_g<gen>`` for the
group over all ranks). The data path gets a short timeout (the bound on detecting a silent
peer); the control channel keeps its own.

How a broken group is replaced is chosen by capability detection, never guessed:
``ProcessGroup.reconfigure`` (torch 2.14+) keeps the same object and rebuilds it in place;
``shrink_group`` applies only when ranks are dropped and the backend says
``supports_shrinking`` (NCCL >= 2.27); otherwise a new communicator is built (gloo always,
NCCL when neither applies) and every cached reference is rebound (:mod:`.rebind`).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from meshpact.core.recovery import CommunicatorAction

__all__ = ["GroupSpec", "WORLD", "group_name", "build_group", "install_group", "store_prefix", "choose_action",
           "can_reconfigure", "can_shrink", "socket_fds", "data_sockets", "sever", "group_ranks", "base_name",
           "backend_of", "sequence_number"]

WORLD = "meshpact_data"  # the base name of the data-path group over every rank


@dataclass(frozen=True)
class GroupSpec:
    backend: str  # "gloo" or "nccl"
    device: str  # "cpu" or "cuda:<i>"
    rank: int
    world_size: int
    timeout_s: float  # data-path operations: the bound on detecting a silent peer
    connect_timeout_s: float = 60.0  # building a group (waits for every peer to arrive)
    run_id: str = ""  # keeps the store keys of runs that share a store apart


def group_name(generation: int, base: str = WORLD) -> str:
    """The name of ``base``'s group in ``generation`` (``meshpact_data_g3``)."""
    return f"{base}_g{generation}"


def base_name(name: str) -> str:
    """The generation-free name of a group (``meshpact_data_g3`` -> ``meshpact_data``); a name
    this module did not give (a user's ``new_group``) is its own base."""
    head, sep, tail = name.rpartition("_g")
    return head if sep and tail.isdigit() else name


def store_prefix(run_id: str, generation: int, base: str = WORLD) -> str:
    """The store namespace of ``base``'s group in a generation (per run, so runs sharing a store never meet)."""
    return f"meshpact/{run_id}/g{generation}/{base}/"


def group_ranks(pg: dist.ProcessGroup) -> tuple[int, ...]:
    """The global ranks of ``pg``'s members, in group-rank order."""
    mapping = c10d._world.pg_group_ranks.get(pg)
    if mapping is None:
        return tuple(range(pg.size()))
    return tuple(g for g, _ in sorted(mapping.items(), key=lambda kv: kv[1]))


def _tcp_table() -> dict[str, tuple[str, int, int]]:
    """``socket:[inode]`` -> (state, local port, remote port) from /proc/net/tcp{,6}."""
    out: dict[str, tuple[str, int, int]] = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as fh:
                next(fh, None)
                for line in fh:
                    cols = line.split()
                    if len(cols) > 9:
                        local, remote = int(cols[1].rsplit(":", 1)[1], 16), int(cols[2].rsplit(":", 1)[1], 16)
                        out[f"socket:[{cols[9]}]"] = (cols[3], local, remote)
        except OSError:
            continue
    return out


def socket_fds() -> dict[int, str]:
    """This process's open socket descriptors: fd -> ``socket:[inode]``."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out[int(name)] = target
    return out


def data_sockets(protected: dict[int, str], store_ports: tuple[int, ...] = ()) -> dict[int, str]:
    """The data path's connected TCP sockets: not listening (shutting down a gloo listener
    makes its accept loop abort the process), not ``protected`` (taken before any data-path
    group existed), and not talking to or serving a store port (the rendezvous store and
    the control channel, whichever process hosts them)."""
    table = _tcp_table()
    out = {}
    for fd, ino in socket_fds().items():
        row = table.get(ino)
        if row is None or protected.get(fd) == ino:
            continue
        state, local, remote = row
        if state == "0A" or local in store_ports or remote in store_ports:
            continue
        out[fd] = ino
    return out


def sever(sockets: dict[int, str]) -> int:
    """Shut down a broken group's sockets (both directions) without closing its descriptors.

    gloo's ``abort`` does not unblock an operation in flight, and a group cannot be destroyed
    while FSDP still holds it; shutting its sockets down is what makes every peer still
    waiting on this rank fail at once ("connection closed by peer") instead of at its
    timeout. Only descriptors that still name the same socket (inode) are touched.
    """
    n = 0
    for fd, inode in sockets.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != inode:
                continue
            with socket.socket(fileno=os.dup(fd)) as s:
                s.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            continue
    return n


def build_group(spec: GroupSpec, store: Any, generation: int, base: str = WORLD,
                ranks: tuple[int, ...] | None = None) -> dist.ProcessGroup:
    """A fresh data-path group for ``base`` in ``generation`` over the global ``ranks`` (default:
    every rank), under its own store namespace, with the data-path timeout. Every member must
    call it; members build their groups in one agreed order (sorted base names), so two groups
    never wait on each other."""
    ranks = tuple(range(spec.world_size)) if ranks is None else tuple(ranks)
    prefix = dist.PrefixStore(store_prefix(spec.run_id, generation, base), store)
    rank, size = ranks.index(spec.rank), len(ranks)
    timeout = timedelta(seconds=spec.timeout_s)
    connect = timedelta(seconds=max(spec.timeout_s, spec.connect_timeout_s))
    pg = dist.ProcessGroup(prefix, rank, size)
    if spec.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        backend = dist.ProcessGroupNCCL(prefix, rank, size, opts)
        kind, device = dist.ProcessGroup.BackendType.NCCL, torch.device(spec.device)
        backend.eager_connect_single_device(device)
    else:
        backend = dist.ProcessGroupGloo(prefix, rank, size, connect)  # connecting may wait out a partition
        kind, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
    backend._set_default_timeout(timeout)
    backend._set_sequence_number_for_group()
    pg._set_default_backend(kind)
    pg._register_backend(device, kind, backend)
    if kind is dist.ProcessGroup.BackendType.NCCL:  # CPU tensors (e.g. flags) still go through gloo
        gloo = dist.ProcessGroupGloo(prefix, rank, size, timeout)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    pg._set_group_name(group_name(generation, base))
    pg._set_group_desc(f"meshpact data path {base}, generation {generation}")
    install_group(pg, store, spec, ranks)
    return pg


def install_group(pg: dist.ProcessGroup, store: Any, spec: GroupSpec, ranks: tuple[int, ...]) -> None:
    """Register ``pg`` in c10d's world (name registry, maps, tags) with its global ``ranks``."""
    c10d._register_pg_in_world(pg, spec.backend, store, pg.group_name,
                               f"{spec.device.split(':')[0]}:{spec.backend}",
                               rank_mapping={g: i for i, g in enumerate(ranks)})


def backend_of(pg: dist.ProcessGroup, device: str) -> Any:
    """The backend ``pg`` uses for ``device`` (None where it has none)."""
    try:
        return pg._get_backend(torch.device(device))
    except RuntimeError:
        return None


def sequence_number(backend: Any) -> int:
    """Operations a backend has issued (its collective sequence number): free, and unlike a
    dispatch mode it leaves ``torch.compile`` on."""
    try:
        return int(backend._get_sequence_number_for_group()) if backend is not None else 0
    except RuntimeError:
        return 0


def can_reconfigure(pg: Any) -> bool:
    """``ProcessGroup.reconfigure`` exists (torch 2.14+): rebuild in place, same object."""
    return callable(getattr(pg, "reconfigure", None))


def can_shrink(pg: dist.ProcessGroup, device: str) -> bool:
    """The backend can drop ranks from its communicator (NCCL >= 2.27 via ncclCommShrink)."""
    if not hasattr(dist, "shrink_group"):
        return False
    try:
        return bool(pg._get_backend(torch.device(device)).supports_shrinking)
    except (RuntimeError, AttributeError):
        return False


def choose_action(pg: Any, device: str, dropped_ranks: int = 0, prefer_reconfigure: bool = True) -> CommunicatorAction:
    """How to replace ``pg``: reconfigure in place, shrink, or rebuild and rebind."""
    if prefer_reconfigure and can_reconfigure(pg) and dropped_ranks == 0:
        return CommunicatorAction.RECONFIGURE
    if dropped_ranks and can_shrink(pg, device):
        return CommunicatorAction.SHRINK
    return CommunicatorAction.REBUILD


def first_collective(pg: dist.ProcessGroup, device: str) -> None:
    """The first collective on a new generation's group: a one-element all-reduce every member
    issues at the same point. When it returns on every rank, the group is proven to carry
    traffic (and a backend that connects lazily has connected); a recovery ends here."""
    dist.all_reduce(torch.zeros(1, device=device), group=pg)
