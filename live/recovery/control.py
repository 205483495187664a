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

Signed values. Anything that reaches the port can read, write and delete the store's keys
(TCPStore has no authentication, and lists its keys), so every value Meshpact writes carries an
HMAC made with the job key's ``"control"`` key (:mod:`.jobkey`) over the value's full key and
its JSON: ``tag (32 bytes) + JSON``. A read checks the tag before it parses anything; a value
without a valid one reads as absent (a wait goes on waiting for a genuine value) and is logged
once per :data:`_SAY_EVERY_S`. A :meth:`ControlChannel.set_once` slot that a forgery took first
is taken back by a compare-and-set that replaces exactly that forgery, so the first genuine
value written stands. Counters (:meth:`ControlChannel.add`, ``counters``, ``advance``,
``move``) are TCPStore's own integers and carry no tag: what an attacker can do with them is
bounded where they are read (``docs/security.md``). A channel made with ``key=None`` (the job
opted out with ``MESHPACT_UNAUTHENTICATED=1``) writes and reads plain JSON.
"""

from __future__ import annotations

import json
import logging
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
from .jobkey import TAG_BYTES, JobKey

__all__ = ["ControlChannel", "ControlTimeout", "ControlForged", "join", "ATTEMPT_KEY", "seal", "unseal"]

logger = logging.getLogger("meshpact.control")

_NAMESPACE = "meshpact/control/"
_ADDRESS_KEY = "meshpact/control-address/"  # in the job's store: where rank 0 hosts the channel (join)
ATTEMPT_KEY = "attempt"  # the word rank 0 drew for this attempt's channel (join, session.attempt_scope)
_SAY_EVERY_S = 30.0  # at most one line per channel this often about values ignored for their signature
_RECLAIMS = 4  # set_once: how many forgeries in a row a slot is taken back from before the channel gives up
# the polling waits (wait_quietly) of a whole job ask the channel at most this often together: a rank asks every
# world_size / QUIET_ASKS_PER_S seconds, and never more often than every 5 ms (up to 25 ranks). At 64 ranks that is
# every 12.8 ms, at 1,024 every 0.2 s, at 4,096 every 0.82 s, where every 5 ms would be 800,000 requests a second,
# past what one store serves (about 45,000 a second at 22 us of its CPU each, bench/control_scale.py), while every
# rank waits on a slow round. A wait never sleeps past its own deadline
QUIET_ASKS_PER_S = 5_000.0
_FORGED: Any = object()  # what unseal answers for a value without a valid tag (or not JSON)


def seal(key: JobKey | None, name: str, value: Any) -> bytes:
    """The bytes stored for ``value`` under the full key ``name``: its tag and its JSON (the JSON
    alone without a key)."""
    raw = json.dumps(value).encode()
    return raw if key is None else key.mac(name, raw) + raw


def unseal(key: JobKey | None, name: str, stored: bytes | str) -> Any:
    """The value :func:`seal` stored under ``name``, or :data:`_FORGED` where its tag does not
    verify (the JSON is parsed only after it does) or it is not JSON."""
    raw = stored.encode() if isinstance(stored, str) else bytes(stored)
    if key is not None:
        if len(raw) < TAG_BYTES or not key.verify(raw[:TAG_BYTES], name, raw[TAG_BYTES:]):
            return _FORGED
        raw = raw[TAG_BYTES:]
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return _FORGED


class ControlTimeout(TimeoutError):
    """Some keys did not appear on the control channel within its timeout."""

    def __init__(self, missing: list[str], timeout_s: float) -> None:
        super().__init__(f"{len(missing)} key(s) did not appear within {timeout_s:.2f} s: {missing}")
        self.missing = missing
        self.timeout_s = timeout_s


class ControlForged(RuntimeError):
    """A :meth:`ControlChannel.set_once` slot kept being taken by values without the job's
    signature: something without the job key writes to the channel as fast as it is reclaimed."""


class ControlChannel:
    """One end of the control channel. ``key`` is the job key (:mod:`.jobkey`; its ``"control"``
    key signs and checks every value) or None where the job opted out of authentication."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float = 10.0,
        is_host: bool = False,
        connect_timeout_s: float = 60.0,
        run_id: str = "",
        *,
        key: JobKey | None,
    ) -> None:
        self.key = key
        self._signer = key.derive("control") if key is not None else None
        self._ignored = 0  # values ignored for their signature since the last line about them
        self._said_at = -_SAY_EVERY_S
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
    def _seal(self, full: str, value: Any) -> bytes:
        return seal(self._signer, full, value)

    def _open(self, full: str, stored: bytes | str) -> Any:
        """The value stored under ``full``, or :data:`_FORGED` (counted and, now and then, said)."""
        value = unseal(self._signer, full, stored)
        if value is _FORGED:
            self._ignored += 1
            now = time.monotonic()
            if now - self._said_at >= _SAY_EVERY_S:
                why = "without this job's signature" if self._signer is not None else "that are not JSON"
                logger.warning(
                    "control channel %s:%s: ignored %d value(s) %s (the last under %r): something "
                    "without the job key writes to this channel",
                    self.host,
                    self.port,
                    self._ignored,
                    why,
                    full[len(self._ns) :] if full.startswith(self._ns) else full,
                )
                self._said_at, self._ignored = now, 0
        return value

    @property
    def ignored(self) -> int:
        """Values ignored for their signature since the last line said so (a test's probe)."""
        return self._ignored

    def set(self, key: str, value: Any) -> None:
        full = self._ns + key
        self._store.set(full, self._seal(full, value))

    def set_many(self, keys: list[str], value: Any) -> None:
        """Write ``value`` under every one of ``keys`` in one round trip."""
        if keys:
            full = [self._ns + k for k in keys]
            self._store.multi_set(full, [self._seal(f, value) for f in full])

    def answers(self) -> bool:
        """Whether the channel's host answers one read now (False: its process, or its node, is gone)."""
        try:
            self._store.check([self._ns + "answers"])
        except (RuntimeError, OSError):
            return False
        return True

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` where it is absent or fails its check."""
        k = self._ns + key
        if not self._store.check([k]):
            return default
        value = self._open(k, self._store.get(k))
        return default if value is _FORGED else value

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
        """Write ``value`` unless the key holds a genuine value; return what the key holds now (the
        first genuine writer's). A forgery found in the slot is replaced by a compare-and-set that
        expects exactly it, so of two ranks that find it, one takes the slot and the other reads
        that; :class:`ControlForged` where forgeries keep taking it (:data:`_RECLAIMS` in a row)."""
        full = self._ns + key
        mine = self._seal(full, value)
        held = self._store.compare_set(full, "", mine)
        for _ in range(_RECLAIMS):
            got = self._open(full, held)
            if got is not _FORGED:
                return got
            now = self._store.compare_set(full, held, mine)  # the forgery out, only if it still holds the slot
            held = now if now != held else self._store.compare_set(full, "", mine)  # (== held: the key is gone)
        raise ControlForged(
            f"control channel {self.host}:{self.port}: {key!r} was taken {_RECLAIMS} times in a row "
            "by values without this job's signature; something without the job key writes to "
            "this channel (see docs/security.md)"
        )

    def _read(self, keys: list[str], full: list[str], stored: list[bytes]) -> tuple[JsonObject, list[int]]:
        """The values that verify, by key, and the indices of those that do not."""
        out: JsonObject = {}
        bad: list[int] = []
        for i, (k, f, raw) in enumerate(zip(keys, full, stored)):
            value = self._open(f, raw)
            if value is _FORGED:
                bad.append(i)
            else:
                out[k] = value
        return out, bad

    def _wait_genuine(
        self,
        keys: list[str],
        full: list[str],
        got: JsonObject,
        bad: list[int],
        deadline: float,
        timeout_s: float,
        every_s: float = 0.005,
    ) -> JsonObject:
        """Finish a wait whose keys exist but ``bad`` of them hold forgeries: look again until a
        genuine value replaces each (its writer's next set) or the deadline passes."""
        while True:
            still = []
            for i in bad:
                if self._store.check([full[i]]):
                    value = self._open(full[i], self._store.get(full[i]))
                    if value is not _FORGED:
                        got[keys[i]] = value
                        continue
                still.append(i)
            if not still:
                return {k: got[k] for k in keys}
            if time.monotonic() >= deadline:
                raise ControlTimeout([keys[i] for i in still], timeout_s)
            bad = still
            time.sleep(min(every_s, max(deadline - time.monotonic(), 0.0)))

    def wait(self, keys: list[str], timeout_s: float | None = None) -> JsonObject:
        """Wait until every key exists (bounded); raise :class:`ControlTimeout` naming the missing ones."""
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        deadline = time.monotonic() + timeout
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
        got, bad = self._read(keys, full, values)
        return self._wait_genuine(keys, full, got, bad, deadline, timeout) if bad else got

    @property
    def quiet_every_s(self) -> float:
        """How often this rank's polling waits ask (``QUIET_ASKS_PER_S`` shared by the job's ranks)."""
        return max(0.005, self.world_size / QUIET_ASKS_PER_S)

    def wait_quietly(self, keys: list[str], timeout_s: float, every_s: float | None = None) -> JsonObject:
        """:meth:`wait` for a wait expected to run long (a consensus wait past its agreement's first
        slice: a replacement that starts in seconds, a rank that missed a round): it asks whether the keys exist every
        ``every_s`` (by default :attr:`quiet_every_s`) instead of blocking in the store's client, whose
        timed-out wait writes two warning lines (``waitForInput ... likely a timeout``) to the worker's
        stderr, which ``meshpact launch`` shows the user: a few dozen for one replacement."""
        every_s = self.quiet_every_s if every_s is None else every_s
        full = [self._ns + k for k in keys]
        deadline = time.monotonic() + timeout_s
        while not self._store.check(full):
            left = deadline - time.monotonic()
            if left <= 0:
                raise ControlTimeout([k for k, f in zip(keys, full) if not self._store.check([f])], timeout_s)
            time.sleep(min(every_s, left))  # the last look at the deadline itself, not up to every_s past it
        got, bad = self._read(keys, full, self._store.multi_get(full))
        return self._wait_genuine(keys, full, got, bad, deadline, timeout_s, every_s) if bad else got

    def peek(self, keys: list[str]) -> list[Any]:
        """The values of ``keys`` in two round trips, never waiting: all None unless every key
        exists (a value that fails its check, or is not JSON, reads as None)."""
        full = [self._ns + k for k in keys]
        if not self._store.check(full):
            return [None] * len(keys)
        out: list[Any] = []
        for f, raw in zip(full, self._store.multi_get(full)):
            value = self._open(f, raw)
            out.append(None if value is _FORGED else value)
        return out

    def all_present(self, keys: list[str]) -> bool:
        """Whether every one of ``keys`` holds a genuine value now (no waiting): one round trip
        while any is absent, two once all exist."""
        full = [self._ns + k for k in keys]
        if not self._store.check(full):
            return False
        return not self._read(keys, full, self._store.multi_get(full))[1] if keys else True

    def any_present(self, keys: list[str]) -> bool:
        """Whether any of ``keys`` holds a genuine value now (no waiting): one round trip per key
        looked at, two for one that exists."""
        return any(
            self._store.check([f]) and self._open(f, self._store.get(f)) is not _FORGED
            for f in (self._ns + k for k in keys)
        )

    def present(self, keys: list[str]) -> JsonObject:
        """The values of those ``keys`` that exist now (no waiting): two round trips when all
        exist, else two per key."""
        if not keys:
            return {}
        full = [self._ns + k for k in keys]
        if self._store.check(full):
            return self._read(keys, full, self._store.multi_get(full))[0]
        out: JsonObject = {}
        for k, f in zip(keys, full):
            if self._store.check([f]):
                value = self._open(f, self._store.get(f))
                if value is not _FORGED:
                    out[k] = value
        return out


def join(
    store: Any,
    rank: int,
    world_size: int,
    timeout_s: float,
    run_id: str,
    connect_timeout_s: float,
    env: Any = None,
    *,
    key: JobKey | None,
) -> ControlChannel:
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
    and learns so only when the consensus times out.

    The record is signed as the channel's values are (:func:`seal`), and the word is read as a
    signed value: a record or a channel set up by something without the job key is passed over."""
    env = os.environ if env is None else env
    if env.get("MESHPACT_CONTROL_PORT"):
        return ControlChannel(
            env.get("MESHPACT_CONTROL_ADDR", "127.0.0.1"),
            int(env["MESHPACT_CONTROL_PORT"]),
            rank,
            world_size,
            timeout_s,
            connect_timeout_s=connect_timeout_s,
            run_id=run_id,
            key=key,
        )
    name = _ADDRESS_KEY + run_id
    signer = key.derive("control") if key is not None else None
    if rank == 0:
        host = env.get("MASTER_ADDR", "127.0.0.1")
        channel = ControlChannel(
            host,
            0,
            rank,
            world_size,
            timeout_s,
            is_host=True,
            connect_timeout_s=connect_timeout_s,
            run_id=run_id,
            key=key,
        )
        word = channel.set_once(ATTEMPT_KEY, secrets.token_hex(6))
        store.set(name, seal(signer, name, {"host": host, "port": channel.port, "word": word}))
        return channel
    deadline = time.monotonic() + connect_timeout_s
    last, passed_over = "", None  # the address read last; the record found not to be this attempt's
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            said = f"its record names {last}, which did not answer with it" if last else "no record"
            raise TimeoutError(
                f"rank {rank}: rank 0's control channel for this attempt was not reached within "
                f"{connect_timeout_s:.0f} s ({said})"
            )
        try:  # asked every 10 ms: a timed-out wait in the store's client writes warnings to stderr
            raw = store.get(name) if store.check([name]) else None
            record = _address(unseal(signer, name, raw)) if raw is not None else None
        except (RuntimeError, dist.DistStoreError):
            raw = record = None
        if record is None or raw == passed_over:  # none yet, one known stale, or not signed: read again
            time.sleep(0.01)
            continue
        last = f"{record['host']}:{record['port']}"
        client = _client(record["host"], record["port"], rank, world_size, timeout_s, run_id, min(left, 2.0), key)
        try:
            if client is not None and client.get(ATTEMPT_KEY) == record["word"]:
                return client
        except (RuntimeError, OSError, dist.DistStoreError, ValueError):
            pass
        if client is not None:
            client.close()
        passed_over = raw
        time.sleep(0.02)


def _address(record: Any) -> dict[str, Any] | None:
    """A channel record's fields where it has them in their types (else None: passed over)."""
    if (
        isinstance(record, dict)
        and isinstance(record.get("host"), str)
        and isinstance(record.get("port"), int)
        and 0 < record["port"] < 65536
        and isinstance(record.get("word"), str)
    ):
        return record
    return None


def _client(
    host: str, port: int, rank: int, world_size: int, timeout_s: float, run_id: str, within_s: float, key: JobKey | None
) -> ControlChannel | None:
    """A client of the channel a record names, or None if it did not connect within ``within_s``.
    A refusal is answered at once; a listener that accepts and never answers would hold a store
    client's handshake past any timeout (torch 2.13), so the client is made on a thread of its
    own and left behind (at most one per record passed over) when it does not answer in time."""
    if not _listening(host, port, within_s):
        return None
    made: list[ControlChannel] = []

    def connect() -> None:
        try:
            made.append(
                ControlChannel(
                    host, port, rank, world_size, timeout_s, connect_timeout_s=within_s, run_id=run_id, key=key
                )
            )
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
