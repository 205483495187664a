"""Stores that listen where they are told.

``torch.distributed.TCPStore`` listens on every interface whatever host name it is
given. Meshpact's stores (the rendezvous store the launcher hosts, the control channel,
rank 0's store under plain torchrun) listen on the named address alone: loopback unless
the user names another.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

__all__ = ["host_store", "open_store"]


def host_store(host: str = "127.0.0.1", port: int = 0, world_size: int = 1, timeout_s: float = 60.0) -> Any:
    """Start a ``TCPStore`` server listening on ``host:port`` only (0: the kernel picks).

    ``TCPStore`` on its own listens on every interface whatever host it is given, so the
    listening socket is bound here, on ``host`` alone, and handed over through
    ``master_listen_fd``.

    The server is torch's libuv one (its default since 2.4): its event loop does the same work per
    request however many clients are connected. The other server polls every connection on each
    request, so each of a store's operations cost about 0.3 ms of its CPU with 1,024 idle clients
    connected against 0.02 ms for libuv's (``bench/control_scale.py``'s ``server_us_per_request_heartbeat``
    measures it): thousands of ranks on one control channel make that the job's bottleneck.

    libuv's server closes the connection of a client that sends a value over 8 MiB or names more
    than 131,072 keys in one request (a 9 MiB ``set`` and a ``check`` of 131,073 keys, tried on torch
    2.13): every later call on that client fails. Meshpact sends values in pieces of 4 MiB at most
    (the drills' recordings); a control value is a few KB, and a consensus reads one key per rank.
    """
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(4096)
    except OSError as exc:
        listener.close()
        raise OSError(
            f"cannot listen on {host}:{port} for the store ({exc}); pick a free port or another address"
        ) from None
    bound_port = int(listener.getsockname()[1])
    return TCPStore(
        host,
        bound_port,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listener.detach(),
        use_libuv=True,
    )


def open_store(host: str, port: int, world_size: int, is_host: bool, timeout_s: float = 60.0) -> Any:
    """Host the store on ``host:port`` (see :func:`host_store`) or connect to it as a client."""
    if is_host:
        return host_store(host, port, world_size, timeout_s)
    from torch.distributed import TCPStore

    return TCPStore(
        host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )
