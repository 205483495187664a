"""Shared by the live tests: which TCP sockets a process tree listens on, read from ``/proc``."""

from __future__ import annotations

import os
from pathlib import Path


class Listener(tuple):
    """One listening TCP socket (``/proc/net/tcp{,6}``) and the process that holds it."""

    @property
    def wildcard(self) -> bool:
        return set(self[1]) == {"0"}  # 0.0.0.0 or ::, as /proc writes them (hex)


def listeners(root: int) -> list[Listener]:
    """Every TCP socket listening in ``root``'s process tree (``root`` and its descendants), as
    ``(pid, local address in hex, port)``; the process's network namespace's tables are read."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    owner: dict[int, int] = {}  # socket inode -> pid
    for pid in tree:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    owner[int(link[8:-1])] = pid
        except OSError:  # a process that ended meanwhile
            continue
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            addr, port = fields[1].split(":")
            if fields[3] == "0A" and int(fields[9]) in owner:  # 0A: LISTEN
                found.append(Listener((owner[int(fields[9])], addr, int(port, 16))))
    return found
