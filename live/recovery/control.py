"""The control channel: an out-of-band key-value channel for consensus and fault bookkeeping.

It is a ``TCPStore`` of its own, on its own port (and, in the partition tests, on its own
network link), created at start and never used for tensor traffic: a broken data path does
not touch it. Values are small JSON documents. Every wait is bounded by the channel's own
timeout, separate from the data path's.

Who hosts it: the launcher (as torchrun's agent hosts the rendezvous store), named by
``MESHPACT_CONTROL_ADDR`` and ``MESHPACT_CONTROL_PORT``; under plain ``torchrun`` without
those, rank 0 hosts it on ``MASTER_ADDR`` at a port the kernel picks, and tells the other
ranks where in the job's own store (:func:`join`). A port of its own choosing (once
``MASTER_PORT + 1``) can be taken by anything else on the host.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from meshpact.core.jsonform import JsonObject

from ..store import open_store

__all__ = ["ControlChannel", "ControlTimeout", "join", "ATTEMPT_KEY"]

_NAMESPACE = "meshpact/control/"
_ADDRESS_KEY = "meshpact/control-address/"  # in the job's store: where rank 0 hosts the channel (join)
ATTEMPT_KEY = "attempt"  # the word rank 0 drew for this attempt's channel (join, session.attempt_scope)


class ControlTimeout(TimeoutError):
    """Some keys did not appear on the control channel within its timeout."""

    def __init__(self, missing: list[str], timeout_s: float) -> None:
        super().__init__(f"{len(missing)} key(s) did not appear within {timeout_s:.2f} s: {missing}")
        self.missing = missing
        self.timeout_s = timeout_s


class ControlChannel:
    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 10.0,
                 is_host: bool = False, connect_timeout_s: float = 60.0, run_id: str = "") -> None:
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.timeout_s = float(timeout_s)
        self._store = open_store(host, port, world_size, is_host, connect_timeout_s)
        self.port = int(self._store.port)  # the kernel's pick where port was 0
        self._store.set_timeout(timedelta(seconds=self.timeout_s))
        self._ns = f"{_NAMESPACE}{run_id}/"
        self._made: set[str] = set()  # counters known to exist (read by multi_get, which would wait for them)

    def close(self) -> None:
        """Drop this end's connection (a channel found to be another attempt's, :func:`join`)."""
        del self._store

    # -- values ----------------------------------------------------------------------------
    def set(self, key: str, value: Any) -> None:
        self._store.set(self._ns + key, json.dumps(value))

    def set_many(self, keys: list[str], value: Any) -> None:
        """Write ``value`` under every one of ``keys`` in one round trip."""
        if keys:
            raw = json.dumps(value)
            self._store.multi_set([self._ns + k for k in keys], [raw] * len(keys))

    def answers(self) -> bool:
        """Whether the channel's host answers one read now (False: its process, or its node, is gone)."""
        try:
            self._store.check([self._ns + "answers"])
        except (RuntimeError, OSError):
            return False
        return True

    def get(self, key: str, default: Any = None) -> Any:
        k = self._ns + key
        if not self._store.check([k]):
            return default
        return json.loads(self._store.get(k))

    def add(self, key: str, amount: int = 1) -> int:
        return int(self._store.add(self._ns + key, amount))

    def counter(self, key: str) -> int:
        """Read an integer counter in one round trip (created at 0 if absent)."""
        return int(self._store.add(self._ns + key, 0))

    def counters(self, keys: list[str]) -> list[int]:
        """Read integer counters in one round trip (each created at 0, once per channel, the
        first time it is asked for)."""
        for k in keys:
            if k not in self._made:
                self._store.add(self._ns + k, 0)
                self._made.add(k)
        return [int(v) for v in self._store.multi_get([self._ns + k for k in keys])]

    def advance(self, key: str, to: int) -> None:
        """Move an integer counter from ``to - 1`` to ``to`` in one round trip; a counter already
        at ``to`` (another rank moved it) or beyond is left alone."""
        self._store.compare_set(self._ns + key, str(to - 1), str(to))

    def move(self, key: str, expected: int, to: int) -> None:
        """Set an integer counter from ``expected`` to ``to`` in one round trip, only if it still
        holds ``expected`` (another rank may have moved it already)."""
        self._store.compare_set(self._ns + key, str(expected), str(to))

    def rescope(self, run_id: str) -> None:
        """Keep this channel's keys under ``run_id`` from now on (see :func:`~.session.start_session`)."""
        self._ns = f"{_NAMESPACE}{run_id}/"
        self._made = set()

    def set_once(self, key: str, value: Any) -> Any:
        """Write ``value`` unless the key exists; return what the key holds now (the first writer's)."""
        raw = self._store.compare_set(self._ns + key, "", json.dumps(value))
        return json.loads(raw)

    def wait(self, keys: list[str], timeout_s: float | None = None) -> JsonObject:
        """Wait until every key exists (bounded); raise :class:`ControlTimeout` naming the missing ones."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        full = [self._ns + k for k in keys]
        # multi_get waits for its keys within the client's timeout: one call, not a wait and a get
        self._store.set_timeout(timedelta(seconds=max(timeout, 0.001)))
        try:
            values = self._store.multi_get(full)
        except (dist.DistStoreError, RuntimeError):
            pending = [k for k, f in zip(keys, full) if not self._store.check([f])]
            if pending:
                raise ControlTimeout(pending, timeout) from None
            values = self._store.multi_get(full)
        finally:
            self._store.set_timeout(timedelta(seconds=self.timeout_s))
        return {k: json.loads(v) for k, v in zip(keys, values)}

    def wait_quietly(self, keys: list[str], timeout_s: float, every_s: float = 0.005) -> JsonObject:
        """:meth:`wait` for a wait expected to run long (a consensus wait past its agreement's first
        slice: a replacement that starts in seconds, a rank that missed a round): it asks whether the keys exist every
        ``every_s`` instead of blocking in the store's client, whose timed-out wait writes two
        warning lines (``waitForInput ... likely a timeout``) to the worker's stderr, which
        ``meshpact launch`` shows the user: a few dozen for one replacement."""
        full = [self._ns + k for k in keys]
        deadline = time.monotonic() + timeout_s
        while not self._store.check(full):
            if time.monotonic() >= deadline:
                raise ControlTimeout([k for k, f in zip(keys, full) if not self._store.check([f])], timeout_s)
            time.sleep(every_s)
        return {k: json.loads(v) for k, v in zip(keys, self._store.multi_get(full))}

    def peek(self, keys: list[str]) -> list[Any]:
        """The values of ``keys`` in two round trips, never waiting: all None unless every key
        exists (a value that is not JSON reads as None)."""
        full = [self._ns + k for k in keys]
        if not self._store.check(full):
            return [None] * len(keys)
        out: list[Any] = []
        for raw in self._store.multi_get(full):
            try:
                out.append(json.loads(raw))
            except ValueError:
                out.append(None)
        return out

    def all_present(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` exists now (no waiting): one round trip."""
        return bool(self._store.check([self._ns + k for k in keys]))

    def any_present(self, keys: list[str]) -> bool:
        """Whether any of ``keys`` exists now (no waiting): one round trip per key looked at."""
        return any(self._store.check([self._ns + k]) for k in keys)

    def present(self, keys: list[str]) -> JsonObject:
        """The values of those ``keys`` that exist now (no waiting): two round trips when all
        exist, else two per key."""
        if not keys:
            return {}
        full = [self._ns + k for k in keys]
        if self._store.check(full):
            return {k: json.loads(v) for k, v in zip(keys, self._store.multi_get(full))}
        out: JsonObject = {}
        for k, f in zip(keys, full):
            if self._store.check([f]):
                out[k] = json.loads(self._store.get(f))
        return out


def join(store: Any, rank: int, world_size: int, timeout_s: float, run_id: str, connect_timeout_s: float,
         env: Any = None) -> ControlChannel:
    """This rank's end of the job's control channel.

    Named by ``MESHPACT_CONTROL_ADDR``/``MESHPACT_CONTROL_PORT`` (``meshpact launch``, the
    trial command): a client of that. Otherwise (plain ``torchrun``) rank 0 hosts it on
    ``MASTER_ADDR`` at a port the kernel picks, writes a word of its own drawing there
    (``ATTEMPT_KEY``), and publishes address, port and word under ``run_id`` in ``store``, the
    job's store; every other rank reads that record, connects, and keeps the channel only if
    it holds the record's word. Under ``torchrun --max-restarts`` the job's store is the
    agents' and outlives an attempt, so a record can be the last attempt's: its host is gone
    (the connect is refused) or its port now serves something else (the word differs), and
    the rank reads the record again until this attempt's rank 0 has written its own, within
    ``connect_timeout_s``. Not told apart: the last attempt's rank 0 still alive and serving its
    channel (an agent killed outright leaves its workers running, in a session of their own),
    whose word is its own record's; a rank that reads that record first joins the wrong channel
    and learns so only when the consensus times out."""
    env = os.environ if env is None else env
    if env.get("MESHPACT_CONTROL_PORT"):
        return ControlChannel(env.get("MESHPACT_CONTROL_ADDR", "127.0.0.1"), int(env["MESHPACT_CONTROL_PORT"]), rank,
                              world_size, timeout_s, connect_timeout_s=connect_timeout_s, run_id=run_id)
    key = _ADDRESS_KEY + run_id
    if rank == 0:
        host = env.get("MASTER_ADDR", "127.0.0.1")
        channel = ControlChannel(host, 0, rank, world_size, timeout_s, is_host=True,
                                 connect_timeout_s=connect_timeout_s, run_id=run_id)
        word = channel.set_once(ATTEMPT_KEY, secrets.token_hex(6))
        store.set(key, json.dumps({"host": host, "port": channel.port, "word": word}))
        return channel
    deadline = time.monotonic() + connect_timeout_s
    last, passed_over = "", ""  # the address read last; the record found not to be this attempt's
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            said = f"its record names {last}, which did not answer with it" if last else "no record"
            raise TimeoutError(f"rank {rank}: rank 0's control channel for this attempt was not reached within "
                               f"{connect_timeout_s:.0f} s ({said})")
        try:  # asked every 10 ms: a timed-out wait in the store's client writes warnings to stderr
            raw = store.get(key) if store.check([key]) else None
            record = json.loads(raw) if raw is not None else None
        except (RuntimeError, dist.DistStoreError, ValueError):
            raw = record = None
        if record is None or raw == passed_over:  # none yet, or one known stale: read again
            time.sleep(0.01)
            continue
        last = f"{record['host']}:{record['port']}"
        channel = _client(record["host"], int(record["port"]), rank, world_size, timeout_s, run_id, min(left, 2.0))
        try:
            if channel is not None and channel.get(ATTEMPT_KEY) == record["word"]:
                return channel
        except (RuntimeError, OSError, dist.DistStoreError, ValueError):
            pass
        if channel is not None:
            channel.close()
        passed_over = raw
        time.sleep(0.02)


def _client(host: str, port: int, rank: int, world_size: int, timeout_s: float, run_id: str,
            within_s: float) -> ControlChannel | None:
    """A client of the channel a record names, or None if it did not connect within ``within_s``.
    A refusal is answered at once; a listener that accepts and never answers would hold a store
    client's handshake past any timeout (torch 2.13), so the client is made on a thread of its
    own and left behind (at most one per record passed over) when it does not answer in time."""
    if not _listening(host, port, within_s):
        return None
    made: list[ControlChannel] = []

    def connect() -> None:
        try:
            made.append(ControlChannel(host, port, rank, world_size, timeout_s, connect_timeout_s=within_s,
                                       run_id=run_id))
        except (RuntimeError, OSError, dist.DistStoreError):
            pass

    thread = threading.Thread(target=connect, name="meshpact-control-connect", daemon=True)
    thread.start()
    thread.join(within_s)
    return made[0] if made else None


def _listening(host: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts a connection at ``host:port`` now (a refusal is answered at once)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
