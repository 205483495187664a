"""A port to hand to a server that a child process will open later.

Binding port 0 and closing the socket hands back a port from the kernel's ephemeral range, the
same range every outgoing connection on the host draws its source port from: between the close
and the child's ``bind`` a connection anywhere on the host (another test's store client, a
browser) can take it, and the child fails with ``Address already in use``. :func:`unclaimed_port`
draws below that range instead, where the kernel never hands out a port by itself, and checks
that nothing listens there now.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

__all__ = ["unclaimed_port"]

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10000  # below: well-known and registered services more often sit here


def _ephemeral_low() -> int:
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def unclaimed_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A port on ``host`` nobody holds now, drawn at random below the ephemeral range."""
    low = _ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(tries if low - _LOWEST >= 1000 else 0):
        port = draw.randrange(_LOWEST, low)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # a host whose ephemeral range starts too low to draw below it
        s.bind((host, 0))
        return int(s.getsockname()[1])
