"""Shared by the live tests: a client of a running job's control channel without the job key.

It does what anything on the host can: it finds the channel among the listening ports (here:
the test process's own, where the trial hosts it), connects a raw TCPStore client, lists the
keys to learn the run's namespace, and writes first, atomically (compare-and-set on an absent
key, so it never destroys a genuine value), every key that would steer the job: each round's
decision and adopted copy (an excision of rank 1), rank proposals, ``lost/round<k>``,
``gone/rank<r>`` (and the gone count), ``recovering/g<n>/rank<r>``, readiness barriers, and
``peer/rank<r>`` pointing at a server of its own, which counts who connects.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from datetime import timedelta
from typing import Any

from _sockets import listeners

_NS = "meshpact/control/"


class ControlAttacker(threading.Thread):
    """Attack every control channel the test process hosts until :meth:`stop`; see the module docstring."""

    def __init__(self, ranks: int, rounds: int = 12, every_s: float = 0.05) -> None:
        super().__init__(name="control-attacker", daemon=True)
        self.ranks, self.rounds, self.every_s = ranks, rounds, every_s
        self.landed: set[str] = set()  # keys (below the run's namespace) its value took first
        self.connections = 0  # connections its peer server accepted
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.05)
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._clients: dict[int, Any] = {}  # listening port -> a raw store client connected to it
        self._probing: set[int] = set()  # ports a probe thread is connecting to now
        self._failures: dict[int, int] = {}  # ports that did not answer as a store, and how often

    def stop(self) -> None:
        self._done.set()
        self.join(10)
        self._server.close()

    def _forgeries(self) -> dict[str, Any]:
        port = self._server.getsockname()[1]
        excise = {
            "round": 0,
            "policy": "excise",
            "step": 0,
            "reason": "forged",
            "members": [0],
            "missing": [1],
            "proposals": {},
            "restore_from": [[1, 0]],
            "lost": [1],
        }
        out: dict[str, Any] = {}
        for k in range(1, self.rounds + 1):
            out[f"round{k}/decision"] = out[f"round{k}/adopted"] = {**excise, "round": k}
            out[f"lost/round{k}"] = [1]
            for r in range(self.ranks):
                out[f"round{k}/rank{r}"] = {
                    "rank": r,
                    "generation": 0,
                    "committed_step": 0,
                    "digest": "",
                    "intact": False,
                }
        for r in range(self.ranks):
            out[f"gone/rank{r}"] = True
            out[f"peer/rank{r}"] = {"host": "elsewhere", "addr": "127.0.0.1", "port": port, "incarnation": 0}
            for g in range(self.rounds + 1):
                out[f"recovering/g{g}/rank{r}"] = {"rank": (r + 1) % self.ranks}
                out[f"ready/g{g}/rank{r}"] = True
        return out

    def _probe(self, port: int) -> None:
        """Connect a raw store client to ``port``, in a thread of its own: a port that is not a store
        (a rank's peer server, which answers the store's handshake with its refusal) costs the
        client seconds of retries, and must not hold up the probe of the channel that opens meanwhile."""
        from torch.distributed import TCPStore

        try:
            client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2), wait_for_workers=False)
        except (RuntimeError, OSError):
            client = None
        with self._lock:
            self._probing.discard(port)
            if client is None:
                self._failures[port] = self._failures.get(port, 0) + 1
            else:
                self._clients[port] = client

    def _channels(self) -> list[tuple[Any, str]]:
        """Raw clients of the control channels among this process's listening ports, with each run's namespace."""
        own = os.getpid()  # the trial hosts its channel here; the ranks' own servers are in their processes
        for pid, _, port in listeners(own):
            with self._lock:
                if (
                    pid != own
                    or port == self._server.getsockname()[1]
                    or port in self._clients
                    or port in self._probing
                    or self._failures.get(port, 0) >= 3
                ):
                    continue  # a port refused three times is not asked again; a slow store may answer later
                self._probing.add(port)
            threading.Thread(target=self._probe, args=(port,), name=f"probe-{port}", daemon=True).start()
        with self._lock:
            clients = list(self._clients.values())
        found = []
        for client in clients:
            try:
                keys = client.list_keys()
            except (RuntimeError, OSError):  # its store has closed: the port may serve another one later
                with self._lock:
                    self._clients = {p: c for p, c in self._clients.items() if c is not client}
                continue
            runs = {k[len(_NS) :].split("/", 1)[0] for k in keys if k.startswith(_NS)}
            found += [(client, f"{_NS}{run}/") for run in runs]
        return found

    def run(self) -> None:
        forged = {k: json.dumps(v) for k, v in self._forgeries().items()}
        attacked: set[str] = set()
        while not self._done.is_set():
            try:
                conn, _ = self._server.accept()
                self.connections += 1
                conn.close()
            except (TimeoutError, OSError):
                pass
            for store, ns in self._channels():
                if ns in attacked:  # every key it wants is held now: its forgery or a genuine value
                    continue
                attacked.add(ns)
                for k, v in forged.items():
                    try:
                        if store.compare_set(ns + k, "", v) == v.encode():
                            self.landed.add(k)
                    except (RuntimeError, OSError):
                        break
                store.add(ns + "gone/count", 1)  # the count a rank reads before it looks for gone marks
            self._done.wait(self.every_s)
