"""Peer-held state: every rank's committed state kept in the host memory of K other ranks.

A killed rank's state need not come from storage. At each commit a rank snapshots its local
state (:func:`~meshpact.live.recovery.state.job_state`: parameter shards, optimizer state and
generators; the committed step is the data position) into host memory on the training thread,
and a background thread ships it, overlapping the next step, to its ``K`` *holders*: the ranks
:func:`placement` names (ring order ``rank+1, rank+2, ...``, ranks on another host first when
the job spans hosts). The path is out of band: a small TCP server per rank (:class:`PeerServer`),
bound to the rank's own address (loopback unless ``MESHPACT_PEER_ADDR`` names another), never
the data path's groups and never storage.

Each holder keeps, per source rank, the two newest *complete* copies; the next copy arrives
into the oldest one's buffer (that copy is dropped when the next begins to arrive, not when it
ends), so a source's copies take two buffers, never three. Each rank also keeps
its own two newest snapshots: the newest may still be in flight when the rank dies, so the
group may have to agree on the step before it and the survivors roll back one step from their
own memory. Ranks lost together (a node) may die with their newest copies at different steps,
one landed and one in flight: the step before is then still held for both.

That is depth 2 (``RecoveryConfig.peer_copy_depth``, the default): four buffers of a rank's
state per rank (two own snapshots, two held copies). Depth 1 keeps one of each, half the host
memory, and gives up the one-step rollback: a commit waits for its copy to land before the
next step begins (the ship no longer overlaps the step), and a rank lost after its peers
committed a step it did not (in its optimizer step or its commit) has no copy of a step the
survivors hold, so consensus decides a checkpoint restore and names why.

A recovery is not kept waiting by a ship: from the moment a rank knows of a fault until it runs
again (:meth:`PeerCopier.pause`, :meth:`PeerCopier.resume`) its shipper sends nothing more of the
copy in flight (it looks between pieces of ``_SHIP_PIECE`` bytes), so a depth-2 ship overlapping
the failed step does not take the cores the recovery's stages need (four ranks each sending and
receiving a third of a gigabyte over loopback, for ``gpt100m``). The pause is bounded
(``timeout_s / 2``: the holder's wait for the next bytes is ``timeout_s``), so a recovery that
never resumes the shipper leaves it late, never stuck.

After a fault every rank reports what it holds in its proposal
(:attr:`~meshpact.live.recovery.consensus.Proposal.holds`); consensus picks the step and the
holder (:func:`~meshpact.live.recovery.consensus.decide`), and the lost rank's replacement
fetches its state from that holder (:func:`fetch`).

Addresses are published on the control channel (``peer/rank<r>``); a replacement publishes
its own, and every rank reads them again after each recovery. :class:`PeerCopyCounters` counts what
the copies cost (snapshot time on the training thread, bytes shipped, host bytes held), the
numbers the trial reports beside async checkpointing's, and what the simulator's peer-copy
model is calibrated from: the host copy's seconds, the ship's seconds and CPU seconds, the
receiving end's CPU seconds, the process's CPU seconds between commits, the host's cores and
how busy the whole host was meanwhile (other jobs' load takes cores the ranks do not get).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from meshpact.core.jsonform import JsonObject

if TYPE_CHECKING:  # torch is imported where tensors are handled: placement stays torch-free
    import torch

__all__ = ["placement", "PeerAddress", "PeerServer", "PeerCopier", "PeerCopyCounters", "PeerError", "fetch",
           "peer_address", "publish", "read_addresses", "step_cpu_s", "host_busy_s", "host_buffer", "HOST_ENV", "ADDR_ENV"]

ADDR_ENV = "MESHPACT_PEER_ADDR"  # the address a rank's peer server binds to (default: loopback)
HOST_ENV = "MESHPACT_HOST_ID"  # which host a rank is on (default: its peer address)
_HEADER = struct.Struct("!I")
_CHUNK = 1 << 20
_SHIP_PIECE = 4 << 20  # a ship sends a copy's body this much at a time, looking at its gate between pieces
_MAPPED_MIN = 1 << 20  # buffers at least this long are mapped from the kernel (:func:`host_buffer`)


class PeerError(ConnectionError):
    """A peer copy could not be sent or fetched (the holder is gone, or does not hold it)."""


def placement(src: int, world_size: int, copies: int, hosts: Sequence[str] | None = None) -> tuple[int, ...]:
    """The ``copies`` ranks holding ``src``'s state: ring order from ``src + 1``, ranks on a host
    other than ``src``'s first (so losing a host loses no state it did not hold alone), then
    ranks on the same host. Pure: every rank computes the same placement."""
    if not 0 <= copies < world_size:
        raise ValueError(f"peer copies must be between 0 and {world_size - 1} (ranks - 1), got {copies}")
    ring = [(src + i) % world_size for i in range(1, world_size)]
    if hosts is not None:
        if len(hosts) != world_size:
            raise ValueError(f"one host per rank expected, got {len(hosts)} for {world_size} ranks")
        ring = [r for r in ring if hosts[r] != hosts[src]] + [r for r in ring if hosts[r] == hosts[src]]
    return tuple(ring[:copies])


@dataclass(frozen=True)
class PeerAddress:
    rank: int
    host: str  # which host the rank is on (placement prefers other hosts)
    addr: str
    port: int
    incarnation: int


def peer_address() -> str:
    return os.environ.get(ADDR_ENV, "127.0.0.1")


def publish(channel: Any, address: PeerAddress) -> None:
    channel.set(f"peer/rank{address.rank}", {"host": address.host, "addr": address.addr, "port": address.port,
                                             "incarnation": address.incarnation})


def read_addresses(channel: Any, world_size: int, timeout_s: float | None = None,
                   ranks: Sequence[int] | None = None) -> dict[int, PeerAddress]:
    """Every rank's peer address (waits, bounded by the channel, until all are published);
    ``ranks``: only those (the ranks still in the job after an excision)."""
    ranks = tuple(range(world_size)) if ranks is None else tuple(ranks)
    got = channel.wait([f"peer/rank{r}" for r in ranks], timeout_s)
    return {r: PeerAddress(r, v["host"], v["addr"], int(v["port"]), int(v["incarnation"]))
            for r in ranks for v in (got[f"peer/rank{r}"],)}


# -- the wire: a length-prefixed JSON header, then the payload's bytes -------------------------
def _send(sock: socket.socket, header: JsonObject, payload: bytes | memoryview | Sequence[Any] = b"",
          gate: Callable[[], None] | None = None) -> None:
    """``header`` then ``payload``: bytes, or a sequence of buffers sent one after another as one
    payload. ``gate``: called before each piece of ``_SHIP_PIECE`` bytes (it may wait)."""
    parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload)
    raw = json.dumps({**header, "n": sum(len(p) for p in parts)}).encode()
    sock.sendall(_HEADER.pack(len(raw)) + raw)
    for part in parts:
        if gate is None:
            if len(part):
                sock.sendall(part)
            continue
        view = memoryview(part).cast("B")
        for at in range(0, len(view), _SHIP_PIECE):
            gate()
            sock.sendall(view[at:at + _SHIP_PIECE])


def host_buffer(n: int) -> bytearray | mmap.mmap:
    """A writable host buffer of ``n`` bytes. From a megabyte up it is an anonymous private
    mapping of its own (``mmap``), outside malloc's heaps: a copy's buffer is never carved out
    of the free space the training step's tensors left in a heap (glibc serves a large request
    from free heap memory before it maps any), and its pages go back to the kernel the moment
    its last view goes, not when a heap happens to shrink. A peer copy's and a snapshot's
    memory is then its size, whatever the allocator does with the step's tensors."""
    return bytearray(n) if n < _MAPPED_MIN else mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)


def _recv_exact(sock: socket.socket, n: int, into: bytearray | mmap.mmap | None = None) -> bytearray | mmap.mmap:
    """``n`` bytes from ``sock``, into ``into`` (exactly ``n`` long) where given, else a new
    buffer (:func:`host_buffer`)."""
    buf = host_buffer(n) if into is None else into
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, _CHUNK))
        if k == 0:
            raise PeerError(f"connection closed after {got} of {n} bytes")
        got += k
    return buf


def _recv(sock: socket.socket) -> tuple[JsonObject, bytearray | mmap.mmap]:
    (size,) = _HEADER.unpack(bytes(_recv_exact(sock, _HEADER.size)))
    header = json.loads(bytes(_recv_exact(sock, size)))
    return header, _recv_exact(sock, int(header.get("n", 0)))


# -- a copy's bytes: a magic, a length-prefixed JSON index (the step, the body's length; each
# tensor's name, dtype, shape, byte count and offset in the body), then the body: each tensor's
# bytes as they lie in memory, at an offset aligned for any dtype. A rank's commit copies its
# state into such a body in one call (:class:`Slab`, views made once per layout) and the
# shipper sends the body as it lies: no per-tensor work on either side. Bit-exact for every
# dtype: the bytes are never converted.
_MAGIC = b"MPSTATE2"
_ALIGN = 64  # each tensor's bytes start at a multiple of this: a view of any dtype is aligned


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a state lies in a copy's body (the state's order), and the copy's
    JSON index, written once per layout."""

    names: tuple[str, ...]
    dtypes: tuple[Any, ...]
    shapes: tuple[Any, ...]
    nbytes: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    index: str

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> "Layout":
        names, dtypes, shapes, nbytes, offsets, at = [], [], [], [], [], 0
        for name, t in state.items():
            n = t.numel() * t.element_size()
            names.append(name), dtypes.append(t.dtype), shapes.append(t.shape), nbytes.append(n), offsets.append(at)
            at += -(-n // _ALIGN) * _ALIGN
        index = json.dumps([[k, str(d).removeprefix("torch."), list(sh), n, o]
                            for k, d, sh, n, o in zip(names, dtypes, shapes, nbytes, offsets)])
        return cls(tuple(names), tuple(dtypes), tuple(shapes), tuple(nbytes), tuple(offsets), at, index)

    def fits(self, state: dict[str, torch.Tensor], tensors: list[torch.Tensor]) -> bool:
        """Whether ``state`` (its ``tensors``, listed) has this layout's names, dtypes and shapes."""
        return (len(tensors) == len(self.names) and tuple(state) == self.names
                and [t.dtype for t in tensors] == list(self.dtypes) and [t.shape for t in tensors] == list(self.shapes))

    def header(self, step: int) -> bytes:
        """The copy's bytes before its body, for ``step``."""
        head = ('{"step": %d, "bytes": %d, "tensors": %s}' % (step, self.total, self.index)).encode()
        head += b" " * (-(len(_MAGIC) + _HEADER.size + len(head)) % _ALIGN)  # the body starts aligned
        return _MAGIC + _HEADER.pack(len(head)) + head


class Slab:
    """One host buffer (:func:`host_buffer`) laid out by a :class:`Layout`, with a view per tensor (``state``: made
    once, since making them costs more than the copy); :meth:`fill` copies a state into it."""

    def __init__(self, layout: Layout) -> None:
        import torch

        self.layout = layout
        self.flat = (torch.frombuffer(host_buffer(layout.total), dtype=torch.uint8) if layout.total
                     else torch.empty(0, dtype=torch.uint8))
        self.views = [self.flat[o:o + n].view(d).view(sh)
                      for d, sh, n, o in zip(layout.dtypes, layout.shapes, layout.nbytes, layout.offsets)]
        self.state = dict(zip(layout.names, self.views))

    def fill(self, tensors: list[torch.Tensor]) -> None:
        """Copy ``tensors`` (the layout's, in its order; any device, any strides, lazy conjugates
        and negations resolved) into the views."""
        import torch

        with torch.no_grad():
            if all(t.device.type == "cpu" for t in tensors):
                torch._foreach_copy_(self.views, tensors)
            else:
                for view, t in zip(self.views, tensors):
                    view.copy_(t)

    def body(self) -> memoryview:
        return memoryview(self.flat.numpy())


def serialize(step: int, state: dict[str, torch.Tensor]) -> bytes:
    """``state`` (CPU or device tensors; any dtype and layout) and ``step`` as one payload."""
    slab = Slab(Layout.of(state))
    slab.fill(list(state.values()))
    return slab.layout.header(step) + bytes(slab.body())


def deserialize(raw: bytes | bytearray | mmap.mmap) -> tuple[int, dict[str, torch.Tensor]]:
    """The step and the state of a payload :func:`serialize` made; a payload of another form or
    length (a torn copy) raises ``ValueError`` naming what differs. The tensors of a writable
    payload (a ``bytearray``, a :func:`host_buffer`) are views of it (no copy: the caller's memory stays one copy's; the
    payload lives as long as they do), those of ``bytes`` copies."""
    import torch

    view = memoryview(raw)
    writable = not view.readonly
    if bytes(view[:len(_MAGIC)]) != _MAGIC:
        raise ValueError(f"not a state copy: it starts {bytes(view[:len(_MAGIC)])!r}, expected {_MAGIC!r}")
    at = len(_MAGIC) + _HEADER.size
    (size,) = _HEADER.unpack(view[len(_MAGIC):at])
    try:
        doc = json.loads(bytes(view[at:at + size]))
    except ValueError as exc:
        raise ValueError(f"a state copy whose index is not JSON ({exc})") from None
    at += size
    if at + int(doc["bytes"]) != len(view):
        raise ValueError(f"a state copy of {len(view)} bytes whose index describes {at + int(doc['bytes'])}")
    state, end = {}, 0
    for entry in doc["tensors"]:
        try:
            name, dtype, shape, n, offset = entry
            n, offset, shape = int(n), int(offset), [int(d) for d in shape]
        except (TypeError, ValueError):
            raise ValueError(f"a state copy's index entry {str(entry)[:120]} is not [name, dtype, shape, "
                             "bytes, offset]") from None
        kind = getattr(torch, str(dtype), None)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"a state copy names {dtype!r} as the dtype of {name!r}: not a torch dtype")
        numel = math.prod(int(d) for d in shape)
        if numel * kind.itemsize != n:
            raise ValueError(f"a state copy gives {name!r} {n} bytes; its shape {list(shape)} of {dtype} "
                             f"needs {numel * kind.itemsize}")
        if offset < end or offset + n > int(doc["bytes"]):
            raise ValueError(f"a state copy places {name!r} at bytes {offset}..{offset + n} of its "
                             f"{doc['bytes']}-byte body, overlapping the tensor before it or past the end")
        end = offset + n
        if n:
            part = view[at + offset:at + offset + n]
            aligned = writable and (at + offset) % kind.itemsize == 0
            flat = torch.frombuffer(part if aligned else bytearray(part), dtype=torch.uint8)
            state[name] = flat.view(kind).reshape(shape)
        else:
            state[name] = torch.empty(shape, dtype=kind)
    return int(doc["step"]), state


@dataclass(frozen=True)
class HeldCopy:
    src: int
    step: int
    payload: bytearray | mmap.mmap  # as received (:func:`host_buffer`): the one buffer a copy takes (states handed out are views of it)


class PeerServer:
    """This rank's holder side: receives copies (``put``) and hands them out (``get``) on a
    daemon thread; keeps the ``depth`` newest complete copies per source rank (the next one
    arrives into the oldest one's buffer)."""

    def __init__(self, addr: str = "127.0.0.1", timeout_s: float = 10.0, depth: int = 2) -> None:
        if depth < 1:
            raise ValueError(f"a holder keeps at least one copy per source, got depth {depth}")
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((addr, 0))
        self._listener.listen(64)
        self.addr = addr
        self.port = int(self._listener.getsockname()[1])
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self.depth = depth
        self._copies: dict[int, dict[int, HeldCopy]] = {}  # source rank -> step -> copy (the depth newest)
        self._lent: dict[int, int] = {}  # id of a copy's buffer -> gets sending it now (never overwritten meanwhile)
        self._receiving = 0  # bytes of copies in flight
        self.peak_bytes = 0
        self.recv_cpu_s = 0.0  # CPU seconds of receiving copies (the holder's side of a ship)
        self._closed = False
        threading.Thread(target=self._accept, name="meshpact-peer-server", daemon=True).start()

    def holds(self) -> tuple[tuple[int, int], ...]:
        """(source rank, step) of every complete copy held."""
        with self._lock:
            return tuple(sorted((src, step) for src, by_step in self._copies.items() for step in by_step))

    def held(self, src: int, step: int) -> dict[str, torch.Tensor]:
        """The copy of ``src``'s state at ``step`` this rank holds (an excision re-shards it)."""
        with self._lock:
            by_step = dict(self._copies.get(src, {}))
        copy = by_step.get(step)
        if copy is None:
            raise PeerError(f"this rank holds no copy of rank {src} at step {step} "
                            f"(it holds {sorted(by_step) or None})")
        got, state = deserialize(copy.payload)
        if got != step:
            raise PeerError(f"the copy of rank {src} held for step {step} is of step {got}")
        return state

    def forget(self, src: int) -> None:
        """Drop the copy of ``src`` (it left the job)."""
        with self._lock:
            self._copies.pop(src, None)

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._kept_bytes() + self._receiving

    def _kept_bytes(self) -> int:
        return sum(len(c.payload) for by_step in self._copies.values() for c in by_step.values())

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="meshpact-peer-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(self.timeout_s)
            try:
                (size,) = _HEADER.unpack(bytes(_recv_exact(conn, _HEADER.size)))
                header = json.loads(bytes(_recv_exact(conn, size)))
                if header["op"] == "put":
                    self._put(conn, header)
                elif header["op"] == "get":
                    with self._lock:
                        by_step = self._copies.get(int(header["src"]), {})
                        held = by_step.get(int(header["step"]))
                        newest = max(by_step, default=None)
                        if held is not None:
                            self._lent[id(held.payload)] = self._lent.get(id(held.payload), 0) + 1
                    if held is None:
                        _send(conn, {"ok": False, "held": newest})
                    else:
                        try:
                            _send(conn, {"ok": True, "step": held.step}, memoryview(held.payload))
                        finally:
                            with self._lock:
                                left = self._lent.pop(id(held.payload)) - 1
                                if left:
                                    self._lent[id(held.payload)] = left
            except (OSError, PeerError, ValueError, KeyError):
                return  # a sender that died mid-copy: its previous complete copy stays

    def _put(self, conn: socket.socket, header: JsonObject) -> None:
        n, src = int(header["n"]), int(header["src"])
        with self._lock:
            # the next copy arrives into the oldest of the two kept (same size, nobody sending it):
            # that copy is no longer held from now on, and a source's copies take two buffers
            by_step = self._copies.get(src, {})
            into = None
            if len(by_step) >= self.depth:
                oldest = min(by_step)
                if len(by_step[oldest].payload) == n and id(by_step[oldest].payload) not in self._lent:
                    into = by_step.pop(oldest).payload
            self._receiving += n
            self.peak_bytes = max(self.peak_bytes, self._kept_bytes() + self._receiving)
        t0 = time.thread_time()
        try:
            payload = _recv_exact(conn, n, into)
        finally:
            with self._lock:
                self._receiving -= n
                self.recv_cpu_s += time.thread_time() - t0
        copy = HeldCopy(int(header["src"]), int(header["step"]), payload)
        with self._lock:
            by_step = self._copies.setdefault(copy.src, {})
            by_step[copy.step] = copy  # complete: displaces the oldest of the two kept
            for old in sorted(by_step)[:-self.depth]:
                del by_step[old]
            self.peak_bytes = max(self.peak_bytes, self._kept_bytes() + self._receiving)
        _send(conn, {"ok": True})

    def close(self) -> None:
        self._closed = True
        try:  # shutdown wakes the accept loop; a close alone would leave it listening
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()


def host_busy_s() -> float | None:
    """The host's busy CPU seconds since boot, every core and process together (``/proc/stat``:
    all but idle and I/O wait); None where there is no such file."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def _cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _connect(address: PeerAddress, timeout_s: float) -> socket.socket:
    try:
        return socket.create_connection((address.addr, address.port), timeout=timeout_s)
    except OSError as exc:
        raise PeerError(f"rank {address.rank}'s peer server at {address.addr}:{address.port}: {exc}") from None


def put(address: PeerAddress, src: int, step: int, payload: bytes | Sequence[Any], timeout_s: float,
        gate: Callable[[], None] | None = None) -> None:
    """Send a copy (a payload, or its parts: a header and a body) to the holder at ``address``
    (``gate``: see :func:`_send`)."""
    with _connect(address, timeout_s) as sock:
        try:
            _send(sock, {"op": "put", "src": src, "step": step}, payload, gate)
            header, _ = _recv(sock)
        except OSError as exc:
            raise PeerError(f"copy of rank {src} step {step} to rank {address.rank}: {exc}") from None
    if not header.get("ok"):
        raise PeerError(f"rank {address.rank} refused the copy of rank {src} step {step}")


def fetch(address: PeerAddress, src: int, step: int, timeout_s: float) -> tuple[dict[str, torch.Tensor], int]:
    """Rank ``src``'s state at ``step`` from the holder at ``address``; returns it and the bytes read."""
    with _connect(address, timeout_s) as sock:
        try:
            _send(sock, {"op": "get", "src": src, "step": step})
            header, payload = _recv(sock)
        except OSError as exc:
            raise PeerError(f"fetching rank {src} step {step} from rank {address.rank}: {exc}") from None
    if not header.get("ok"):
        raise PeerError(f"rank {address.rank} holds no copy of rank {src} at step {step} "
                        f"(it holds step {header.get('held')})")
    got, state = deserialize(payload)
    if got != step:
        raise PeerError(f"rank {address.rank} sent rank {src}'s step {got}, not {step}")
    return state, len(payload)


@dataclass
class PeerCopyCounters:
    """What the copies cost one rank (mutable counters; :meth:`freeze` for the report)."""

    commits: int = 0
    snapshot_s: float = 0.0  # on the training thread: the host copy and any wait for the copy in flight
    ship_s: float = 0.0  # on the background thread (wall)
    bytes_sent: int = 0
    failed: int = 0
    host_bytes_peak: int = 0
    host_copy_s: float = 0.0  # listing the state for the copy and the host copy (training thread, wall)
    wait_s: float = 0.0  # the training thread waiting for the copy in flight (wall)
    ship_cpu_s: float = 0.0  # serialising and sending (the shipper's CPU seconds)
    recv_cpu_s: float = 0.0  # receiving the other ranks' copies (this rank's server, CPU seconds)
    cycles: int = 0  # commit-to-commit intervals counted below
    cycle_cpu_s: float = 0.0  # the process's CPU seconds over those intervals (every thread)
    cycle_s: float = 0.0  # their wall seconds
    host_busy_s: float = 0.0  # the whole host's busy CPU seconds over those intervals (every process; Linux)
    cores: int = 0  # this host's cores (affinity)
    cores_per_rank: float = 0.0  # those over the ranks on it (LOCAL_WORLD_SIZE)


def step_cpu_s(c: PeerCopyCounters | Any) -> float:
    """The process's CPU seconds per commit-to-commit interval less the copy's own work (host
    copy, ship, receive): what the step itself keeps the cores busy with (``c``: the counters,
    or a report with their fields)."""
    if not c.cycles or not c.commits:
        return 0.0
    copy = (c.host_copy_s + c.ship_cpu_s + c.recv_cpu_s) / c.commits
    return max(c.cycle_cpu_s / c.cycles - copy, 0.0)


class PeerCopier:
    """The source side: snapshot at commit (training thread), ship in the background, one in
    flight; keeps this rank's own ``depth`` newest snapshots (two: a one-step rollback), in
    ``depth`` host buffers (the oldest one's is filled by the next commit)."""

    def __init__(self, rank: int, world_size: int, copies: int, channel: Any, server: PeerServer,
                 timeout_s: float, depth: int = 2) -> None:
        self.rank = rank
        self.world_size = world_size
        self.copies = copies
        self.channel = channel
        self.server = server
        self.timeout_s = timeout_s
        self.addresses: dict[int, PeerAddress] = {}
        self.alive: tuple[int, ...] = tuple(range(world_size))  # the ranks still in the job (fewer after an excision)
        self.depth = depth  # own snapshots kept: the newest and depth - 1 before it
        self.own: dict[int, dict[str, torch.Tensor]] = {}  # step -> this rank's snapshot (the depth newest)
        self._slabs: dict[int, Slab] = {}  # step -> the slab its own snapshot lies in
        self._free: list[Slab] = []  # slabs no snapshot lies in: the next commits copy into them
        cores = _cores()
        self.counters = PeerCopyCounters(cores=cores,
                                         cores_per_rank=cores / max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1))
        self._last: tuple[float, float, float | None] | None = None  # (process CPU, wall, host busy) at the last commit
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self._go = threading.Event()  # clear while a recovery runs: the shipper waits between pieces
        self._go.set()
        self._pause_until = 0.0  # monotonic time the pause ends by itself
        self._thread = threading.Thread(target=self._shipper, name="meshpact-peer-ship", daemon=True)
        self._thread.start()

    def refresh(self) -> dict[int, PeerAddress]:
        """Read every rank's address again (a replacement publishes a new one); on the
        training thread only (the control channel is not shared with the shipper). Waits for
        the copy in flight first, so the shipper never reads a half-written table."""
        self._idle.wait(self.timeout_s)
        self.addresses = read_addresses(self.channel, self.world_size, ranks=self.alive)
        return self.addresses

    def replace_ring(self, alive: Sequence[int]) -> None:
        """Place the copies over ``alive`` only (after an excision): the ring is recomputed over
        the survivors, K capped at their number less one. On the training thread, like
        :meth:`refresh`, which it calls."""
        self._idle.wait(self.timeout_s)
        self.alive = tuple(alive)
        for src, _ in self.server.holds():
            if src not in self.alive:
                self.server.forget(src)
        self.refresh()

    def holders(self) -> tuple[int, ...]:
        """The original ranks holding this rank's copies: :func:`placement` over the ranks still in the job."""
        hosts = [self.addresses[r].host for r in self.alive]
        ring = placement(self.alive.index(self.rank), len(self.alive), min(self.copies, len(self.alive) - 1), hosts)
        return tuple(self.alive[i] for i in ring)

    def commit(self, step: int, state: dict[str, torch.Tensor], listed_s: float = 0.0) -> None:
        """Snapshot ``state`` (committed at ``step``) to host memory and hand it to the shipper.
        ``listed_s``: what listing ``state`` took the training thread (the runtime lists it for
        the copy alone, so it counts as the copy's host cost)."""
        self.counters.host_copy_s += listed_s
        t0 = time.perf_counter()
        now = (time.process_time(), t0, host_busy_s())
        if self._last is not None:
            self.counters.cycles += 1
            self.counters.cycle_cpu_s += now[0] - self._last[0]
            self.counters.cycle_s += now[1] - self._last[1]
            if now[2] is not None and self._last[2] is not None:
                self.counters.host_busy_s += now[2] - self._last[2]
        self._last = now
        self._idle.wait()  # one copy in flight: no slab is being sent while one is filled
        self.counters.wait_s += time.perf_counter() - t0
        c0 = time.perf_counter()
        tensors = list(state.values())
        older = sorted(s for s in self.own if s < step)
        kept = older[max(len(older) - (self.depth - 1), 0):]  # the depth - 1 newest before this one
        for old in [s for s in self.own if s not in kept]:  # what this commit replaces frees its slab first:
            self._drop(old)  # depth slabs in all, never one more
        slab = self._slab(state, tensors)
        slab.fill(tensors)
        self.counters.host_copy_s += time.perf_counter() - c0
        self.own[step], self._slabs[step] = slab.state, slab
        self._idle.clear()
        self._queue.put((step, slab))
        if self.depth == 1:  # no older snapshot to roll back to: the copy lands before the next step begins
            self._idle.wait(self.timeout_s)
        self.counters.commits += 1
        self.counters.snapshot_s += time.perf_counter() - t0
        self.counters.host_bytes_peak = max(self.counters.host_bytes_peak, self.host_bytes())

    def _slab(self, state: dict[str, torch.Tensor], tensors: list[torch.Tensor]) -> Slab:
        """A free slab laid out as ``state`` is (one made when none is: the first commits, or
        after the state's shapes changed, as an excision changes them)."""
        while self._free:
            slab = self._free.pop()
            if slab.layout.fits(state, tensors):
                return slab
        layout = next((s.layout for s in self._slabs.values() if s.layout.fits(state, tensors)), None)
        return Slab(layout or Layout.of(state))

    def _drop(self, step: int) -> None:
        """Forget the own snapshot of ``step``; its slab (if it lies in one) takes the next copies."""
        snap = self.own.pop(step)
        slab = self._slabs.pop(step, None)
        if slab is not None and slab.state is snap:
            self._free.append(slab)

    def own_steps(self) -> tuple[int, ...]:
        return tuple(sorted(self.own))

    def keep_only(self, step: int) -> None:
        """Drop own snapshots newer than ``step`` (the group went back to it)."""
        for s in [s for s in self.own if s > step]:
            self._drop(s)

    def release_own(self) -> None:
        """Drop every own snapshot and the buffers kept for the next ones (an excision re-shards
        the state, and the next commit copies a new layout): their memory goes back now, not
        after the rebuild. A snapshot still being shipped is freed when its ship ends."""
        self.own.clear()
        self._slabs.clear()
        self._free.clear()

    def host_bytes(self) -> int:
        """Host memory the copies take on this rank: its own snapshots, the buffer kept for the
        next commit, and the copies it holds for others."""
        own = sum(self._slabs[s].layout.total if s in self._slabs and self._slabs[s].state is snap
                  else sum(t.numel() * t.element_size() for t in snap.values()) for s, snap in self.own.items())
        return own + sum(slab.layout.total for slab in self._free) + self.server.held_bytes

    def pause(self) -> None:
        """Hold the copy in flight where it is (a recovery began on this rank) until :meth:`resume`,
        or for ``timeout_s / 2`` at most; see the module docstring."""
        self._pause_until = time.monotonic() + self.timeout_s / 2
        self._go.clear()

    def resume(self) -> None:
        """Let the copy in flight go on (the recovery is over)."""
        self._go.set()

    @property
    def paused(self) -> bool:
        return not self._go.is_set()

    def _gate(self) -> None:
        if not self._go.wait(max(self._pause_until - time.monotonic(), 0.0)):
            self._go.set()  # the pause outlived its bound: the ship goes on

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until the copy in flight has been shipped (or failed)."""
        return self._idle.wait(timeout_s)

    def _shipper(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, slab = item
            t0 = time.perf_counter()
            c0 = time.thread_time()
            try:
                payload = (slab.layout.header(step), slab.body())
                for holder in self.holders():
                    try:
                        put(self.addresses[holder], self.rank, step, payload, self.timeout_s, self._gate)
                    except PeerError:  # a holder gone: this copy is one short until the next recovery
                        self.counters.failed += 1  # reads the addresses again (:meth:`refresh`)
                        continue
                    self.counters.bytes_sent += len(payload[0]) + len(payload[1])
            except Exception:  # noqa: BLE001  (a copy that cannot be made is one copy short, not a crash)
                self.counters.failed += 1
            finally:
                self.counters.ship_s += time.perf_counter() - t0
                self.counters.ship_cpu_s += time.thread_time() - c0
                self.counters.recv_cpu_s = self.server.recv_cpu_s
                self.counters.host_bytes_peak = max(self.counters.host_bytes_peak, self.host_bytes())
                self._idle.set()

    def close(self) -> None:
        """Let the copy in flight finish, then stop the shipper and wait for it: a daemon thread
        still inside torch's serialiser when the interpreter exits aborts the process."""
        self._idle.wait(self.timeout_s)
        self._queue.put(None)
        self._thread.join(self.timeout_s)
