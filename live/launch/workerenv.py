"""The environment a worker process starts with: torchrun's, and what Meshpact's runtime reads.

torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK``, ``ROLE_*``,
``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_*``) as elastic's agent sets them, with
``TORCHELASTIC_RESTART_COUNT`` always 0 (the group is never restarted; a replacement's count is
``MESHPACT_INCARNATION``), and Meshpact's: the incarnation, the run id, the control channel's
address, the job key (in the environment alone, never through a store), the address the rank's
peer-copy server binds and the host it names, and gloo's interface where the node names an address.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping

from torch.distributed.elastic.agent.server.api import WorkerGroup

from ..recovery import jobkey
from ..recovery.peers import ADDR_ENV, HOST_ENV
from .nodes import NodeEnv

__all__ = ["worker_environment", "bind_address", "iface_of"]


def worker_environment(
    wg: WorkerGroup,
    local_rank: int,
    incarnation: int,
    node: NodeEnv,
    control: tuple[str, int],
    run_id: str,
    key: jobkey.JobKey | None,
    node_addr: str,
    environ: Mapping[str, str] = os.environ,
) -> dict[str, str]:
    """``local_rank``'s environment at ``incarnation`` on the node ``node`` describes (see the module
    docstring); ``environ``: the agent's own, which a few settings pass through."""
    spec = wg.spec
    worker = wg.workers[local_rank]
    host, port = control
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
        "MASTER_ADDR": str(wg.master_addr),
        "MASTER_PORT": str(wg.master_port),
        "TORCHELASTIC_RESTART_COUNT": "0",  # the group is never restarted: replacements count below
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": node.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(node.use_agent_store),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "MESHPACT_INCARNATION": str(incarnation),
        "MESHPACT_RUN_ID": run_id,
        "MESHPACT_CONTROL_ADDR": host,
        "MESHPACT_CONTROL_PORT": str(port),
    }
    env.update({jobkey.KEY_ENV: key.secret.hex()} if key is not None else {jobkey.UNAUTHENTICATED_ENV: "1"})
    env[ADDR_ENV] = environ.get(ADDR_ENV) or bind_address(node_addr)
    env[HOST_ENV] = environ.get(HOST_ENV) or f"node{wg.group_rank}:{node_addr}"
    iface = iface_of(spec.local_addr) if spec.local_addr and "GLOO_SOCKET_IFNAME" not in environ else None
    if iface is not None:  # gloo finds its address from the host name otherwise: loopback on many hosts
        env["GLOO_SOCKET_IFNAME"] = iface
    for name in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):
        if name in environ:
            env[name] = environ[name]
    return env


def bind_address(node_addr: str) -> str:
    """The address this node's peer servers bind to: the node's own, resolved (loopback stays loopback)."""
    try:
        return socket.gethostbyname(node_addr)
    except OSError:
        return "127.0.0.1"


def iface_of(addr: str) -> str | None:
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
