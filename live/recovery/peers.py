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
state per rank (two own snapshots, two held copies). Depth 1 keeps one of each, about half the
host memory (a holder takes a second buffer while a copy arrives: the one it holds is kept until
its successor is complete and verified), and gives up the one-step rollback: a commit waits for
its copy to land before the next step begins (the ship no longer overlaps the step), and a
rank lost after its peers committed a step it did not (in its optimizer step or its commit) has
no copy of a step the survivors hold, so consensus decides a checkpoint restore and names why.

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

The path is safe on a shared network. Every connection is authenticated with the job's key
(:mod:`~meshpact.live.recovery.jobkey`, purpose ``"peer"``): the server opens with a fresh nonce,
and each frame's header carries an HMAC bound to it (a reply's to the client's nonce too), checked
before anything past the header is read; a client without the key gets nothing and puts
nothing. Each copy travels with the BLAKE3 digest its source computed on the shipper thread
right after the snapshot; the holder checks it on receipt (with the copy's index, and the step
against the newest its source can have committed: :meth:`PeerServer.admit_through`), the
fetcher again before the restore (:func:`fetch`), and a copy that fails is refused: the restore
takes the next holder's (:func:`fetch_first`) and names the refusal. Input is bounded: headers of
``MAX_HEADER``, a deadline per frame, ``PENDING_MAX`` unauthenticated and ``SERVING_MAX``
authenticated connections, copies of at most ``COPY_BYTES_FACTOR`` times the holder's own.

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
import logging
import math
import mmap
import os
import queue
import secrets
import socket
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import blake3

from meshpact.core.jsonform import JsonObject

from .jobkey import TAG_BYTES, JobKey

if TYPE_CHECKING:  # torch is imported where tensors are handled: placement stays torch-free
    import torch

    from .device import DeviceOps, PinnedSnapshot

__all__ = [
    "placement",
    "PeerAddress",
    "PeerServer",
    "PeerCopier",
    "PeerCopyCounters",
    "PeerError",
    "fetch",
    "fetch_first",
    "put",
    "copy_digest",
    "copy_hasher",
    "MAX_HEADER",
    "PENDING_MAX",
    "SERVING_MAX",
    "peer_address",
    "publish",
    "read_addresses",
    "step_cpu_s",
    "host_busy_s",
    "host_buffer",
    "HOST_ENV",
    "ADDR_ENV",
]

ADDR_ENV = "MESHPACT_PEER_ADDR"  # the address a rank's peer server binds to (default: loopback)
HOST_ENV = "MESHPACT_HOST_ID"  # which host a rank is on (default: its peer address)
_HEADER = struct.Struct("!I")
_CHUNK = 1 << 20
_SHIP_PIECE = 4 << 20  # a ship sends a copy's body this much at a time, looking at its gate between pieces
_MAPPED_MIN = 1 << 20  # buffers at least this long are mapped from the kernel (:func:`host_buffer`)
MAX_HEADER = 64 << 10  # a frame's JSON header, at most
_CHALLENGE = b"MPPEER1\n"  # then the server's nonce: the first bytes a peer server sends on a connection
_NONCE = 32
_MIN_RATE = 16 << 20  # bytes per second a frame's body must arrive at, at least: its deadline follows from it
PENDING_MAX = 32  # connections not yet authenticated, at most: the oldest is closed to let a new one in
SERVING_MAX = 64  # authenticated connections served at once, at most: more are refused
# a held copy is at most this many times the holder's own copy, plus _COPY_BYTES_SLACK: every rank's
# copy is its part of one job's state (uneven shards, a pipeline stage holding the embeddings)
COPY_BYTES_FACTOR = 4
_COPY_BYTES_SLACK = 64 << 20
_UNKEYED = bytes(TAG_BYTES)  # the tag sent where the job runs unauthenticated (MESHPACT_UNAUTHENTICATED=1)
_log = logging.getLogger(__name__)


class PeerError(ConnectionError):
    """A peer copy could not be sent or fetched: the holder is gone or does not hold it, a frame
    was malformed, unauthenticated or late, or a copy failed its digest. The one kind of error
    the peer path raises; the message says which."""


def copy_hasher() -> Any:
    """A fresh hasher of a copy's bytes: BLAKE3, a cryptographic hash (a frame's HMAC covers the
    body through its digest) that takes a core under half of SHA-256's time (4.1 against 1.8 GB/s
    measured on one core of the 2-core bench machine), which counts at two hashes of every rank's
    whole state per commit (``bench/scale.py --security-cost``)."""
    return blake3.blake3()


def copy_digest(parts: Sequence[bytes | bytearray | memoryview | mmap.mmap]) -> str:
    """The digest a copy travels with (:func:`copy_hasher` over its bytes, hex): the source computes
    it from its snapshot, the holder checks it on receipt, the fetcher before it restores the copy."""
    h = copy_hasher()
    for part in parts:
        h.update(part)
    return h.hexdigest()


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
    channel.set(
        f"peer/rank{address.rank}",
        {"host": address.host, "addr": address.addr, "port": address.port, "incarnation": address.incarnation},
    )


def read_addresses(
    channel: Any, world_size: int, timeout_s: float | None = None, ranks: Sequence[int] | None = None
) -> dict[int, PeerAddress]:
    """Every rank's peer address (waits, bounded by the channel, until all are published);
    ``ranks``: only those (the ranks still in the job after an excision)."""
    ranks = tuple(range(world_size)) if ranks is None else tuple(ranks)
    got = channel.wait([f"peer/rank{r}" for r in ranks], timeout_s)
    return {
        r: PeerAddress(r, v["host"], v["addr"], int(v["port"]), int(v["incarnation"]))
        for r in ranks
        for v in (got[f"peer/rank{r}"],)
    }


# -- the wire ----------------------------------------------------------------------------------
# A connection opens with the server's challenge (``_CHALLENGE`` and a fresh nonce). Every frame
# after it is a 4-byte length, a JSON header (at most ``MAX_HEADER`` bytes; its ``n`` is the
# length of the body that follows), the HMAC of the header under the job's peer key (bound to
# the server's nonce, and for a reply to the client's), then the body. A put's header carries the
# copy's digest, so the tag covers the body too; the tag is checked before the header is parsed,
# and a client without the key is sent nothing more. Each frame has one deadline, whatever the
# pace of its bytes: ``timeout_s``, plus the body's length at ``_MIN_RATE``.
def _tag(key: JobKey | None, context: Sequence[bytes], raw: bytes) -> bytes:
    return _UNKEYED if key is None else key.mac(*context, raw)


def _send(
    sock: socket.socket,
    key: JobKey | None,
    context: Sequence[bytes],
    header: JsonObject,
    payload: bytes | memoryview | Sequence[Any] = b"",
    gate: Callable[[], None] | None = None,
) -> None:
    """One frame: ``header`` (tagged under ``key`` bound to ``context``), then ``payload``: bytes, or
    a sequence of buffers sent one after another as one payload. ``gate``: called before each
    piece of ``_SHIP_PIECE`` bytes (it may wait)."""
    parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload)
    raw = json.dumps({**header, "n": sum(len(p) for p in parts)}).encode()
    sock.sendall(_HEADER.pack(len(raw)) + raw + _tag(key, context, raw))
    for part in parts:
        if gate is None:
            if len(part):
                sock.sendall(part)
            continue
        view = memoryview(part).cast("B")
        for at in range(0, len(view), _SHIP_PIECE):
            gate()
            sock.sendall(view[at : at + _SHIP_PIECE])


def _deadline(timeout_s: float, n: int = 0) -> float:
    """When a frame of an ``n``-byte body must have arrived by (monotonic seconds)."""
    return time.monotonic() + timeout_s + n / _MIN_RATE


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _recv_header(sock: socket.socket, key: JobKey | None, context: Sequence[bytes], deadline: float) -> JsonObject:
    """A frame's header, its tag checked before it is parsed; PeerError names what was wrong."""
    (size,) = _HEADER.unpack(bytes(_recv_exact(sock, _HEADER.size, deadline=deadline)))
    if size > MAX_HEADER:
        raise PeerError(f"a frame header of {size} bytes (at most {MAX_HEADER})")
    got = bytes(_recv_exact(sock, size + TAG_BYTES, deadline=deadline))
    raw, tag = got[:size], got[size:]
    if key is not None and not key.verify(tag, *context, raw):
        raise PeerError("a frame whose tag is not the job key's (a client without the key, or a forged frame)")
    try:
        header = json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise PeerError(f"a frame header that is not JSON ({str(exc)[:80]})") from None
    if type(header) is not dict:
        raise PeerError(f"a frame header that is a {type(header).__name__}, not an object")
    _field(header, "n", 0, 1 << 62)
    return header


def _field(header: JsonObject, name: str, lo: int, hi: int) -> int:
    """``header[name]``, an int in ``lo..hi``; PeerError naming it otherwise."""
    v = header.get(name)
    if type(v) is not int or not lo <= v <= hi:
        raise PeerError(f"a frame header whose {name!r} is {str(v)[:40]}, expected an int in {lo}..{hi}")
    return v


def _hex(header: JsonObject, name: str, nbytes: int) -> bytes:
    v = header.get(name)
    try:
        raw = bytes.fromhex(v) if type(v) is str else b""
    except ValueError:
        raw = b""
    if len(raw) != nbytes:
        raise PeerError(f"a frame header whose {name!r} is {str(v)[:40]!r}, expected {2 * nbytes} hex digits")
    return raw


def host_buffer(n: int) -> bytearray | mmap.mmap:
    """A writable host buffer of ``n`` bytes. From a megabyte up it is an anonymous private
    mapping of its own (``mmap``), outside malloc's heaps: a copy's buffer is never carved out
    of the free space the training step's tensors left in a heap (glibc serves a large request
    from free heap memory before it maps any), and its pages go back to the kernel the moment
    its last view goes, not when a heap happens to shrink. A peer copy's and a snapshot's
    memory is then its size, whatever the allocator does with the step's tensors."""
    return bytearray(n) if n < _MAPPED_MIN else mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)


def _recv_exact(
    sock: socket.socket, n: int, into: bytearray | mmap.mmap | None = None, *, deadline: float, hasher: Any = None
) -> bytearray | mmap.mmap:
    """``n`` bytes from ``sock`` by ``deadline`` (monotonic: the frame's, not each ``recv``'s),
    into ``into`` (exactly ``n`` long) where given, else a new buffer (:func:`host_buffer`);
    ``hasher`` is fed the bytes as they come."""
    buf = host_buffer(n) if into is None else into
    view = memoryview(buf)
    got = 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise PeerError(f"a frame not complete by its deadline ({got} of {n} bytes)")
        sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], min(n - got, _CHUNK))
        except socket.timeout:
            raise PeerError(f"a frame not complete by its deadline ({got} of {n} bytes)") from None
        if k == 0:
            raise PeerError(f"connection closed after {got} of {n} bytes")
        if hasher is not None:
            hasher.update(view[got : got + k])
        got += k
    return buf


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
            names.append(name)
            dtypes.append(t.dtype)
            shapes.append(t.shape)
            nbytes.append(n)
            offsets.append(at)
            at += -(-n // _ALIGN) * _ALIGN
        index = json.dumps(
            [
                [k, str(d).removeprefix("torch."), list(sh), n, o]
                for k, d, sh, n, o in zip(names, dtypes, shapes, nbytes, offsets)
            ]
        )
        return cls(tuple(names), tuple(dtypes), tuple(shapes), tuple(nbytes), tuple(offsets), at, index)

    def fits(self, state: dict[str, torch.Tensor], tensors: list[torch.Tensor]) -> bool:
        """Whether ``state`` (its ``tensors``, listed) has this layout's names, dtypes and shapes."""
        return (
            len(tensors) == len(self.names)
            and tuple(state) == self.names
            and [t.dtype for t in tensors] == list(self.dtypes)
            and [t.shape for t in tensors] == list(self.shapes)
        )

    def header(self, step: int) -> bytes:
        """The copy's bytes before its body, for ``step``."""
        head = ('{"step": %d, "bytes": %d, "tensors": %s}' % (step, self.total, self.index)).encode()
        head += b" " * (-(len(_MAGIC) + _HEADER.size + len(head)) % _ALIGN)  # the body starts aligned
        return _MAGIC + _HEADER.pack(len(head)) + head


class Slab:
    """One host buffer (:func:`host_buffer`) laid out by a :class:`Layout`, with a view per tensor (``state``: made
    once, since making them costs more than the copy); :meth:`fill` copies a state into it."""

    def __init__(self, layout: Layout, ops: DeviceOps | None = None) -> None:
        import torch

        self.layout = layout
        if ops is not None and ops.kind == "cuda":  # pinned: the device copies into it asynchronously
            self.flat = ops.host_buffer(torch.empty(layout.total, dtype=torch.uint8, device="meta"))
        else:
            self.flat = (
                torch.frombuffer(host_buffer(layout.total), dtype=torch.uint8)
                if layout.total
                else torch.empty(0, dtype=torch.uint8)
            )
        self.views = [
            self.flat[o : o + n].view(d).view(sh)
            for d, sh, n, o in zip(layout.dtypes, layout.shapes, layout.nbytes, layout.offsets)
        ]
        self.state = dict(zip(layout.names, self.views))
        self.snapshot: PinnedSnapshot | None = None  # on CUDA: the async copy into the views (PeerCopier.commit)

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
        return memoryview(self.flat.numpy())  # type: ignore[arg-type]  # an ndarray exports the buffer protocol; numpy's stubs omit __buffer__


def serialize(step: int, state: dict[str, torch.Tensor]) -> bytes:
    """``state`` (CPU or device tensors; any dtype and layout) and ``step`` as one payload."""
    slab = Slab(Layout.of(state))
    slab.fill(list(state.values()))
    return slab.layout.header(step) + bytes(slab.body())


def deserialize(raw: bytes | bytearray | mmap.mmap) -> tuple[int, dict[str, torch.Tensor]]:
    """The step and the state of a payload :func:`serialize` made; a payload of another form or
    length (a torn or forged copy) raises ``ValueError`` naming what differs, whatever its
    index holds. The tensors of a writable payload (a ``bytearray``, a :func:`host_buffer`) are
    views of it (no copy: the caller's memory stays one copy's; the payload lives as long as
    they do), those of ``bytes`` copies."""
    try:
        return _deserialize(raw)
    except (TypeError, KeyError, IndexError, OverflowError, RuntimeError, RecursionError, struct.error) as exc:
        raise ValueError(f"a malformed state copy ({type(exc).__name__}: {str(exc)[:120]})") from None


def _deserialize(raw: bytes | bytearray | mmap.mmap) -> tuple[int, dict[str, torch.Tensor]]:
    import torch

    view = memoryview(raw)
    writable = not view.readonly
    if bytes(view[: len(_MAGIC)]) != _MAGIC:
        raise ValueError(f"not a state copy: it starts {bytes(view[: len(_MAGIC)])!r}, expected {_MAGIC!r}")
    at = len(_MAGIC) + _HEADER.size
    (size,) = _HEADER.unpack(view[len(_MAGIC) : at])
    try:
        doc = json.loads(bytes(view[at : at + size]), parse_constant=_refuse_constant)
    except ValueError as exc:
        raise ValueError(f"a state copy whose index is not JSON ({exc})") from None
    if (
        type(doc) is not dict
        or type(doc.get("step")) is not int
        or type(doc.get("bytes")) is not int
        or doc["bytes"] < 0
        or type(doc.get("tensors")) is not list
    ):
        raise ValueError(f"a state copy whose index {str(doc)[:80]} is not {{step, bytes, tensors}}")
    at += size
    if at + doc["bytes"] != len(view):
        raise ValueError(f"a state copy of {len(view)} bytes whose index describes {at + doc['bytes']}")
    state, end = {}, 0
    for entry in doc["tensors"]:
        try:
            name, dtype, shape, n, offset = entry
            if not (
                type(name) is str
                and type(dtype) is str
                and type(n) is int
                and type(offset) is int
                and type(shape) is list
                and all(type(d) is int and d >= 0 for d in shape)
                and len(shape) <= 64
            ):
                raise TypeError
        except (TypeError, ValueError):
            raise ValueError(
                f"a state copy's index entry {str(entry)[:120]} is not [name, dtype, shape "
                "(non-negative ints), bytes, offset]"
            ) from None
        kind = getattr(torch, dtype, None)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"a state copy names {dtype!r} as the dtype of {name!r}: not a torch dtype")
        numel = math.prod(shape)
        if numel * kind.itemsize != n:
            raise ValueError(
                f"a state copy gives {name!r} {n} bytes; its shape {list(shape)} of {dtype} "
                f"needs {numel * kind.itemsize}"
            )
        if offset < end or offset + n > doc["bytes"]:
            raise ValueError(
                f"a state copy places {name!r} at bytes {offset}..{offset + n} of its "
                f"{doc['bytes']}-byte body, overlapping the tensor before it or past the end"
            )
        if name in state:
            raise ValueError(f"a state copy names {name!r} twice")
        end = offset + n
        if n:
            part = view[at + offset : at + offset + n]
            aligned = writable and (at + offset) % kind.itemsize == 0
            flat = torch.frombuffer(part if aligned else bytearray(part), dtype=torch.uint8)
            state[name] = flat.view(kind).reshape(shape)
        else:
            state[name] = torch.empty(shape, dtype=kind)
    return doc["step"], state


@dataclass(frozen=True)
class HeldCopy:
    src: int
    step: int
    payload: (
        bytearray | mmap.mmap
    )  # as received (:func:`host_buffer`): the one buffer a copy takes (states handed out are views of it)
    digest: str  # the source's (:func:`copy_digest`), checked on receipt; a fetcher checks it again


class PeerServer:
    """This rank's holder side: receives copies (``put``) and hands them out (``get``) on a
    daemon thread; keeps the ``depth`` newest complete copies per source rank (the next one
    arrives into the oldest one's buffer; at depth 1 into a buffer of its own, so the copy
    held stays until its successor is complete and verified).

    ``key``: the job's peer key (``JobKey.derive("peer")``); every connection proves it (see
    the wire's comment) before anything is read past its header. None runs unauthenticated,
    where the user opted out by name (``MESHPACT_UNAUTHENTICATED=1``): one warning is logged.
    A put is kept only when its digest matches its bytes, its index describes them, and its
    step is one the source could have committed (:meth:`admit_through`); connections are
    capped (``PENDING_MAX`` unauthenticated, the oldest closed for a new one; ``SERVING_MAX``
    authenticated). Malformed input ends its connection (:class:`PeerError`), never the server."""

    def __init__(self, addr: str = "127.0.0.1", timeout_s: float = 10.0, depth: int = 2, *, key: JobKey | None) -> None:
        if depth < 1:
            raise ValueError(f"a holder keeps at least one copy per source, got depth {depth}")
        if key is None:
            _log.warning(
                "peer copies run unauthenticated (MESHPACT_UNAUTHENTICATED=1): anyone who reaches "
                "this rank's peer server can read and replace the state it holds"
            )
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((addr, 0))
        self._listener.listen(64)
        self.addr = addr
        self.port = int(self._listener.getsockname()[1])
        self.timeout_s = timeout_s
        self.key = key
        self._lock = threading.Lock()
        self.depth = depth
        self._copies: dict[int, dict[int, HeldCopy]] = {}  # source rank -> step -> copy (the depth newest)
        self._lent: dict[int, int] = {}  # id of a copy's buffer -> gets sending it now (never overwritten meanwhile)
        self._receiving = 0  # bytes of copies in flight
        self._pending: OrderedDict[int, socket.socket] = (
            OrderedDict()
        )  # connections not yet authenticated, oldest first
        self._serving = 0  # authenticated connections being served
        self._horizon: int | None = None  # the newest step a put may carry (None: any, before this rank's first commit)
        self._max_bytes: int | None = None  # the largest copy a put may carry (None: before this rank's first commit)
        self.refused: list[str] = []  # why each of the last refused frames was refused (newest last)
        self._dropped: tuple[
            tuple[int, int], ...
        ] = ()  # (source, step) of held copies dropped: they failed their digest
        self.peak_bytes = 0
        self.recv_cpu_s = 0.0  # CPU seconds of receiving copies (the holder's side of a ship)
        self._closed = False
        threading.Thread(target=self._accept, name="meshpact-peer-server", daemon=True).start()

    def holds(self) -> tuple[tuple[int, int], ...]:
        """(source rank, step) of every complete copy held."""
        with self._lock:
            return tuple(sorted((src, step) for src, by_step in self._copies.items() for step in by_step))

    def dropped(self) -> tuple[tuple[int, int], ...]:
        """(source rank, step) of the copies this rank held and dropped since they failed their
        digest (a proposal names them: the decision then says why no copy is left)."""
        with self._lock:
            return self._dropped

    def admit_through(self, step: int, max_bytes: int | None = None) -> None:
        """Accept puts of steps up to ``step`` from now on, each of at most ``max_bytes`` (None: as
        before): this rank committed ``step - 1`` and no source commits further ahead than the step
        it is running (every step's collectives take this rank too). A put past it could only evict
        genuine copies."""
        with self._lock:
            self._horizon = step
            self._max_bytes = self._max_bytes if max_bytes is None else max_bytes

    def held(self, src: int, step: int) -> dict[str, torch.Tensor]:
        """The copy of ``src``'s state at ``step`` this rank holds (an excision re-shards it),
        its digest checked first: a copy whose bytes changed since the source's snapshot raises
        PeerError."""
        with self._lock:
            by_step = dict(self._copies.get(src, {}))
        copy = by_step.get(step)
        if copy is None:
            raise PeerError(
                f"this rank holds no copy of rank {src} at step {step} (it holds {sorted(by_step) or None})"
            )
        if copy_digest([copy.payload]) != copy.digest:
            with self._lock:  # no longer offered: the next round's proposal leaves it out and names it
                if self._copies.get(src, {}).get(step) is copy:
                    del self._copies[src][step]
                self._dropped = (*self._dropped[-15:], (src, step))
            raise PeerError(
                f"the copy of rank {src} at step {step} held here fails its digest (its bytes changed "
                "since the source's snapshot): refused and dropped"
            )
        try:
            got, state = deserialize(copy.payload)
        except ValueError as exc:
            raise PeerError(f"the copy of rank {src} held for step {step}: {exc}") from None
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
                if self._closed:
                    return
                time.sleep(0.01)  # out of descriptors, a connection reset before accept: the server goes on
                continue
            with self._lock:
                self._pending[id(conn)] = conn
                evicted = [self._pending.popitem(last=False)[1] for _ in range(len(self._pending) - PENDING_MAX)]
            for old in evicted:
                _shut(old)
            threading.Thread(target=self._serve, args=(conn,), name="meshpact-peer-conn", daemon=True).start()

    def _refuse(self, why: str) -> None:
        with self._lock:
            self.refused = [*self.refused[-15:], why]

    def _serve(self, conn: socket.socket) -> None:
        serving = False
        with conn:
            try:
                nonce = secrets.token_bytes(_NONCE)
                conn.settimeout(self.timeout_s)
                conn.sendall(_CHALLENGE + nonce)
                header = _recv_header(conn, self.key, (b"request", nonce), _deadline(self.timeout_s))
                with self._lock:
                    if self._pending.pop(id(conn), None) is None:
                        raise PeerError("a connection closed to let a newer one in")
                    serving = self._serving < SERVING_MAX
                    self._serving += serving
                context = (b"reply", nonce, _hex(header, "nonce", _NONCE))
                conn.settimeout(self.timeout_s)  # a reply's send gets the whole timeout, not the header's leftover
                if not serving:
                    raise _Refused(f"{SERVING_MAX} connections are being served already")
                try:
                    if header.get("op") == "put":
                        self._put(conn, header, context)
                    elif header.get("op") == "get":
                        self._get(conn, header, context)
                    else:
                        raise PeerError(f"a frame whose op is {str(header.get('op'))[:20]!r}, expected put or get")
                except _Refused as exc:
                    self._refuse(str(exc))
                    _send(conn, self.key, context, {"ok": False, "why": str(exc)})
            except (OSError, PeerError, ValueError) as exc:  # a sender that died mid-copy: its previous copy stays
                self._refuse(str(exc))
            except Exception as exc:  # noqa: BLE001  (no input ends the server; the connection goes)
                self._refuse(f"{type(exc).__name__}: {str(exc)[:120]}")
            finally:
                with self._lock:
                    self._pending.pop(id(conn), None)
                    self._serving -= serving

    def _get(self, conn: socket.socket, header: JsonObject, context: tuple[bytes, ...]) -> None:
        src, step = _field(header, "src", 0, 1 << 31), _field(header, "step", -1, 1 << 62)
        with self._lock:
            by_step = self._copies.get(src, {})
            held = by_step.get(step)
            newest = max(by_step, default=None)
            if held is not None:
                self._lent[id(held.payload)] = self._lent.get(id(held.payload), 0) + 1
        if held is None:
            raise _Refused(f"this rank holds no copy of rank {src} at step {step} (it holds step {newest})")
        try:
            _send(
                conn,
                self.key,
                context,
                {"ok": True, "step": held.step, "digest": held.digest},
                memoryview(held.payload),
            )
            # the fetcher checks the digest and refuses a changed copy; this rank checks it too, after
            # the send (off the fetcher's path), and stops offering it, so the next round's holds omit it
            intact = copy_digest([held.payload]) == held.digest
        finally:
            with self._lock:
                left = self._lent.pop(id(held.payload)) - 1
                if left:
                    self._lent[id(held.payload)] = left
        if not intact:
            with self._lock:
                if self._copies.get(src, {}).get(step) is held:
                    del self._copies[src][step]
                self._dropped = (*self._dropped[-15:], (src, step))
            self._refuse(f"the copy of rank {src} at step {step} held here failed its digest: dropped")

    def _put(self, conn: socket.socket, header: JsonObject, context: tuple[bytes, ...]) -> None:
        src, step = _field(header, "src", 0, 1 << 31), _field(header, "step", 0, 1 << 62)
        n, digest = header["n"], _hex(header, "digest", 32).hex()
        with self._lock:
            horizon, limit = self._horizon, self._max_bytes
        if horizon is not None and step > horizon:
            raise _Refused(
                f"a copy of rank {src} at step {step}: past step {horizon}, the newest a source can "
                "have committed while this rank runs"
            )
        if limit is not None and n > limit:
            raise _Refused(
                f"a copy of rank {src} at step {step} of {n} bytes: more than the {limit} this holder takes "
                f"(a multiple of its own copy's size, COPY_BYTES_FACTOR)"
            )
        with self._lock:
            # the next copy arrives into the oldest of those kept (same size, nobody sending it), never into
            # the only one: the newest stays held until its successor is complete and verified
            by_step = self._copies.get(src, {})
            into = None
            if len(by_step) >= self.depth > 1:
                oldest = min(by_step)
                if len(by_step[oldest].payload) == n and id(by_step[oldest].payload) not in self._lent:
                    into = by_step.pop(oldest).payload
            self._receiving += n
            self.peak_bytes = max(self.peak_bytes, self._kept_bytes() + self._receiving)
        t0 = time.thread_time()
        hasher = copy_hasher()
        try:
            payload = _recv_exact(conn, n, into, deadline=_deadline(self.timeout_s, n), hasher=hasher)
        finally:
            with self._lock:
                self._receiving -= n
                self.recv_cpu_s += time.thread_time() - t0
        if hasher.hexdigest() != digest:
            raise _Refused(f"the copy of rank {src} at step {step} fails its digest: refused")
        try:
            got, _ = deserialize(payload)
        except ValueError as exc:
            raise _Refused(f"the copy of rank {src} at step {step}: {exc}") from None
        if got != step:
            raise _Refused(f"a copy sent as rank {src}'s step {step} is of step {got}")
        copy = HeldCopy(src, step, payload, digest)
        with self._lock:
            by_step = self._copies.setdefault(copy.src, {})
            by_step[copy.step] = copy  # complete and verified: displaces the oldest kept
            for old in sorted(by_step)[: -self.depth]:
                del by_step[old]
            self.peak_bytes = max(self.peak_bytes, self._kept_bytes() + self._receiving)
        _send(conn, self.key, context, {"ok": True})

    def close(self) -> None:
        self._closed = True
        try:  # shutdown wakes the accept loop; a close alone would leave it listening
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()


class _Refused(PeerError):
    """A request an authenticated client is answered no to, with why."""


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


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


def _connect(address: PeerAddress, timeout_s: float) -> tuple[socket.socket, bytes]:
    """A connection to ``address``'s peer server and the server's nonce (its challenge)."""
    try:
        sock = socket.create_connection((address.addr, address.port), timeout=timeout_s)
    except OSError as exc:
        raise PeerError(f"rank {address.rank}'s peer server at {address.addr}:{address.port}: {exc}") from None
    try:
        got = bytes(_recv_exact(sock, len(_CHALLENGE) + _NONCE, deadline=_deadline(timeout_s)))
    except (OSError, PeerError) as exc:
        sock.close()
        raise PeerError(
            f"rank {address.rank}'s peer server at {address.addr}:{address.port} sent no challenge: {exc}"
        ) from None
    if not got.startswith(_CHALLENGE):
        sock.close()
        raise PeerError(f"{address.addr}:{address.port} is not a Meshpact peer server (it sent {got[:8]!r})")
    return sock, got[len(_CHALLENGE) :]


def _ask(
    address: PeerAddress,
    key: JobKey | None,
    timeout_s: float,
    header: JsonObject,
    payload: bytes | Sequence[Any] = b"",
    gate: Callable[[], None] | None = None,
    what: str = "",
) -> tuple[JsonObject, bytearray | mmap.mmap]:
    """One request to ``address``'s peer server and its reply (header, body); the reply's tag and
    the body's digest (where the reply names one) are checked. PeerError names ``what`` failed."""
    sock, nonce = _connect(address, timeout_s)
    mine = secrets.token_bytes(_NONCE)
    with sock:
        try:
            sock.settimeout(timeout_s)
            _send(sock, key, (b"request", nonce), {**header, "nonce": mine.hex()}, payload, gate)
            reply = _recv_header(sock, key, (b"reply", nonce, mine), _deadline(timeout_s))
            if not reply.get("ok"):
                raise PeerError(f"rank {address.rank} refused: {str(reply.get('why'))[:300]}")
            hasher = copy_hasher() if "digest" in reply else None
            body = _recv_exact(sock, reply["n"], deadline=_deadline(timeout_s, reply["n"]), hasher=hasher)
        except OSError as exc:
            raise PeerError(f"{what} with rank {address.rank}: {exc}") from None
        except PeerError as exc:
            raise PeerError(f"{what} with rank {address.rank}: {exc}") from None
    if hasher is not None and hasher.hexdigest() != reply["digest"]:
        raise PeerError(
            f"{what} from rank {address.rank}: the copy fails its digest (its bytes changed since the "
            "source's snapshot): refused"
        )
    return reply, body


def put(
    address: PeerAddress,
    src: int,
    step: int,
    payload: bytes | Sequence[Any],
    timeout_s: float,
    gate: Callable[[], None] | None = None,
    *,
    key: JobKey | None,
    digest: str | None = None,
) -> None:
    """Send a copy (a payload, or its parts: a header and a body) to the holder at ``address``
    (``gate``: see :func:`_send`; ``digest``: the payload's :func:`copy_digest`, computed here
    where not given)."""
    parts = [payload] if isinstance(payload, (bytes, bytearray, memoryview)) else list(payload)
    digest = copy_digest(parts) if digest is None else digest
    _ask(
        address,
        key,
        timeout_s,
        {"op": "put", "src": src, "step": step, "digest": digest},
        parts,
        gate,
        f"copy of rank {src} step {step}",
    )


def fetch(
    address: PeerAddress, src: int, step: int, timeout_s: float, *, key: JobKey | None
) -> tuple[dict[str, torch.Tensor], int]:
    """Rank ``src``'s state at ``step`` from the holder at ``address``, its digest checked;
    returns it and the bytes read. PeerError says why none came (a copy failing its digest
    included)."""
    reply, payload = _ask(
        address, key, timeout_s, {"op": "get", "src": src, "step": step}, what=f"fetching rank {src} step {step}"
    )
    if "digest" not in reply:
        raise PeerError(f"rank {address.rank} sent rank {src}'s step {step} without its digest")
    try:
        got, state = deserialize(payload)
    except ValueError as exc:
        raise PeerError(f"rank {address.rank} sent rank {src}'s step {step}: {exc}") from None
    if got != step:
        raise PeerError(f"rank {address.rank} sent rank {src}'s step {got}, not {step}")
    return state, len(payload)


def fetch_first(
    addresses: dict[int, PeerAddress],
    src: int,
    step: int,
    holders: Sequence[int],
    timeout_s: float,
    *,
    key: JobKey | None,
) -> tuple[dict[str, torch.Tensor], int, int, tuple[str, ...]]:
    """Rank ``src``'s state at ``step`` from the first of ``holders`` whose copy passes
    (:func:`fetch`): the state, the bytes read, that holder, and why each one before it was
    refused ("rank h: why"). PeerError naming every refusal where none passes."""
    refused: list[str] = []
    for h in holders:
        if h not in addresses:
            refused.append(f"rank {h}: no peer address is known for it")
            continue
        try:
            state, n = fetch(addresses[h], src, step, timeout_s, key=key)
        except PeerError as exc:
            refused.append(f"rank {h}: {exc}")
            continue
        return state, n, h, tuple(refused)
    raise PeerError(f"no holder gave rank {src}'s copy of step {step}: " + ("; ".join(refused) or "none is held"))


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
    ``depth`` host buffers (the oldest one's is filled by the next commit).

    On CUDA (``ops``) the training thread only enqueues: each slab is pinned, the commit starts a
    :class:`~.device.PinnedSnapshot` into it (async copies on a side stream, after an event on the
    training stream) and hands it over without waiting for the previous ship; the shipper sends
    once the copies landed. A commit made while a ship is under way replaces the one still waiting
    (only the newest waits: ``superseded`` counts those never sent), and the slab in flight is never
    refilled, so a CUDA rank holds at most one slab more than ``depth``."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        copies: int,
        channel: Any,
        server: PeerServer,
        timeout_s: float,
        depth: int = 2,
        ops: DeviceOps | None = None,
    ) -> None:
        self.key = server.key  # the job's peer key: the copier proves it to every holder, as its server asks of them
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
        self.counters = PeerCopyCounters(
            cores=cores, cores_per_rank=cores / max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)
        )
        self._last: tuple[float, float, float | None] | None = None  # (process CPU, wall, host busy) at the last commit
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self._go = threading.Event()  # clear while a recovery runs: the shipper waits between pieces
        self._go.set()
        self._pause_until = 0.0  # monotonic time the pause ends by itself
        from .device import HostOps

        self.ops: DeviceOps = ops or HostOps()
        self._stream: Any = None  # the side stream every snapshot copies on (CUDA)
        self._handoff = threading.Lock()  # a commit's hand-over against the shipper's end of a ship
        self._in_flight: set[int] = set()  # ids of the slabs waiting to be shipped or being shipped
        self._latest: PinnedSnapshot | None = None  # the newest snapshot's copies: the next writes wait on them
        self.superseded = 0  # commits replaced by a newer one before their ship began (CUDA: commits do not wait)
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
        device = self.ops.kind == "cuda"
        if not device:
            self._idle.wait()  # one copy in flight: no slab is being sent while one is filled
        self.counters.wait_s += time.perf_counter() - t0
        c0 = time.perf_counter()
        tensors = list(state.values())
        older = sorted(s for s in self.own if s < step)
        kept = older[max(len(older) - (self.depth - 1), 0) :]  # the depth - 1 newest before this one
        for old in [s for s in self.own if s not in kept]:  # what this commit replaces frees its slab first:
            self._drop(old)  # depth slabs in all, never one more (on CUDA, one more while one ships)
        slab = self._slab(state, tensors)
        if device:
            self._start_snapshot(step, slab, tensors)
        else:
            slab.fill(tensors)
        self.counters.host_copy_s += time.perf_counter() - c0
        self.own[step], self._slabs[step] = slab.state, slab
        self.server.admit_through(step + 1, self._copy_bound(slab.layout.total))
        with self._handoff:
            if device:  # only the newest waits: one still waiting is superseded (it stays an own snapshot)
                try:
                    waiting = self._queue.get_nowait()
                except queue.Empty:
                    waiting = None
                if waiting is not None:
                    self._in_flight.discard(id(waiting[1]))
                    self.superseded += 1
            self._idle.clear()
            self._in_flight.add(id(slab))
            self._queue.put((step, slab))
        if self.depth == 1:  # no older snapshot to roll back to: the copy lands before the next step begins
            self._idle.wait(self.timeout_s)
        self.counters.commits += 1
        self.counters.snapshot_s += time.perf_counter() - t0
        self.counters.host_bytes_peak = max(self.counters.host_bytes_peak, self.host_bytes())

    def _start_snapshot(self, step: int, slab: Slab, tensors: list[torch.Tensor]) -> None:
        """Enqueue the device-to-host copies of ``tensors`` into ``slab`` on the side stream, after
        an event recorded on the training stream now (the step's work, its optimizer update
        included, comes before it); the training thread does not wait for them."""
        import torch

        from .device import PinnedSnapshot, StepFence

        if self._stream is None:
            self._stream = self.ops.side_stream()
        if slab.snapshot is None:
            slab.snapshot = PinnedSnapshot(self.ops, buffers=list(slab.views), stream=self._stream)
        fence = StepFence(self.ops)
        fence.record(step)
        with torch.no_grad():
            slab.snapshot.start(step, tensors, fence)
        self._latest = slab.snapshot

    def protect(self) -> None:
        """Before the next in-place write of the state (the optimizer's update; a forward that
        updates buffers): the training stream waits for the newest snapshot's copies, so no copy
        mixes two steps (:meth:`~.device.PinnedSnapshot.protect`; the host does not wait)."""
        if self._latest is not None:
            self._latest.protect()

    @staticmethod
    def _copy_bound(own_bytes: int) -> int:
        """The largest copy of another rank this rank's server takes, from its own copy's bytes."""
        return COPY_BYTES_FACTOR * own_bytes + _COPY_BYTES_SLACK

    def _slab(self, state: dict[str, torch.Tensor], tensors: list[torch.Tensor]) -> Slab:
        """A free slab laid out as ``state`` is (one made when none is: the first commits, or
        after the state's shapes changed, as an excision changes them)."""
        shipping: list[Slab] = []  # free, but its ship has not ended (CUDA: commits do not wait for it)
        found: Slab | None = None
        while self._free:
            slab = self._free.pop()
            with self._handoff:
                busy = id(slab) in self._in_flight
            if busy:
                shipping.append(slab)
            elif slab.layout.fits(state, tensors):
                found = slab
                break
        self._free.extend(s for s in shipping if s.layout.fits(state, tensors))
        if found is not None:
            return found
        layout = next((s.layout for s in self._slabs.values() if s.layout.fits(state, tensors)), None)
        return Slab(layout or Layout.of(state), self.ops)

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
        kept = self.own.get(step)
        self.server.admit_through(
            step + 1,
            None if kept is None else self._copy_bound(sum(t.numel() * t.element_size() for t in kept.values())),
        )

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
        own = sum(
            self._slabs[s].layout.total
            if s in self._slabs and self._slabs[s].state is snap
            else sum(t.numel() * t.element_size() for t in snap.values())
            for s, snap in self.own.items()
        )
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
                if slab.snapshot is not None and not self._landed(slab.snapshot):
                    raise PeerError(f"the device-to-host copy of step {step} did not land in {self.timeout_s:g} s")
                payload = (slab.layout.header(step), slab.body())
                digest = copy_digest(payload)  # here, off the training thread: the slab holds still until idle
                for holder in self.holders():
                    try:
                        put(
                            self.addresses[holder],
                            self.rank,
                            step,
                            payload,
                            self.timeout_s,
                            self._gate,
                            key=self.key,
                            digest=digest,
                        )
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
                with self._handoff:
                    self._in_flight.discard(id(slab))
                    if self._queue.empty():  # a commit's hand-over waits on this lock: none is missed
                        self._idle.set()

    def _landed(self, snapshot: PinnedSnapshot) -> bool:
        """Wait (polling an event, never a synchronize) until ``snapshot``'s copies landed, at most
        ``timeout_s``: a copy behind a hung kernel is one copy short, not a stuck shipper."""
        deadline = time.monotonic() + self.timeout_s
        while not snapshot.ready():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.0005)
        return True

    def close(self) -> None:
        """Let the copy in flight finish, then stop the shipper and wait for it: a daemon thread
        still inside torch's serialiser when the interpreter exits aborts the process."""
        self._idle.wait(self.timeout_s)
        self._queue.put(None)
        self._thread.join(self.timeout_s)
