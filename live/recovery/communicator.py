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

A :class:`Standby` takes the building out of the recovery: a background thread builds the
next generation's groups (every group of the job, in the agreed order, over a store
connection of its own and under its own namespace) and exercises each with one tiny
collective while training runs. A recovery that may use it swaps it in (installs it in
c10d's world) instead of building; one that may not (a rank replaced, a standby not ready
or failed, a data path gone silent) discards it and builds, and says why.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
import struct
import termios
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from meshpact.core.jsonform import JsonObject
from meshpact.core.recovery import CommunicatorAction

__all__ = [
    "GroupSpec",
    "WORLD",
    "group_name",
    "build_group",
    "install_group",
    "store_prefix",
    "choose_action",
    "can_reconfigure",
    "can_shrink",
    "socket_fds",
    "SocketEnds",
    "data_sockets",
    "gloo_pairs",
    "opened_since",
    "sever",
    "Severance",
    "timed_out",
    "SeveredSockets",
    "group_ranks",
    "base_name",
    "backend_of",
    "sequence_number",
    "first_collective",
    "exercise",
    "GroupPlan",
    "group_plan",
    "set_data_timeout",
    "StandbyStatus",
    "Standby",
    "STANDBY_NAMESPACE",
    "standby_refusal",
    "USER_BASE",
    "user_base",
    "user_ordinal",
    "build_order",
]

WORLD = "meshpact_data"  # the base name of the data-path group over every rank
USER_BASE = "user"  # the base names of the groups the job's code makes after start_session: user0, user1, ...
# a sever waits for what its sockets still send (see _flush) while the queue moves, at most this long
# without moving and this long in all
FLUSH_STALL_S = 0.1
FLUSH_MOST_S = 5.0
# once a large message was seen and the queues are empty, the quiet a sever waits for before judging it
# ended: longer than any quiet spell a message under way takes between two of its movements (a writer or
# reader left unscheduled; bench/recovery.py's ``flush`` record says the longest it saw); a shorter
# settle cuts such a message part way, and its operation waits out the data-path timeout
FLUSH_SETTLE_S = 0.05
FLUSH_LARGE_BYTES = 64 * 1024
# how long a sever looks at its sockets before judging that no large message moves through them: a
# message under way moves FLUSH_LARGE_BYTES in 0.5 ms at 1 Gbit/s (a shorter look, 0.25 ms, judged a
# continuous stream over a 1 Gbit/s link "none" 100 times in 100, a 2.5 Gbit/s one 31 in 60; below
# about 0.5 Gbit/s even this look misses some)
FLUSH_LOOK_S = 0.001
# the drain of severed sockets (SeveredSockets): its first look after a sever, while bytes move, and at
# most between looks once they stopped (see drain_delay). A peer's large send into a severed socket's
# full buffer waits for the first look, and the peer's flush waits that pause out before its settle.
# The most is well under the kernel's delayed-ACK timer (40 ms on Linux): a full buffer still unread
# when the timer sends its acknowledgement offers the peer a zero window, and a severed socket sends no
# window update of its own when read (see _quick_ack)
DRAIN_FIRST_S = 0.002
DRAIN_MOVING_S = 0.0005
DRAIN_IDLE_MOST_S = 0.02
# offset of tcpi_bytes_acked, then tcpi_bytes_received, in struct tcp_info (linux/include/uapi/linux/tcp.h)
_TCP_INFO_BYTES = 120


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


def user_base(ordinal: int) -> str:
    """The base name of the ``ordinal``-th group the job's code made after ``start_session``
    (``user0``, ``user1``, ...: the same on every rank, and for a replacement's script that
    makes its groups in the same order, :mod:`.usergroups`)."""
    return f"{USER_BASE}{ordinal}"


def user_ordinal(base: str) -> int | None:
    """The creation ordinal in a user group's base name (None for any other group)."""
    head, tail = base[: len(USER_BASE)], base[len(USER_BASE) :]
    return int(tail) if head == USER_BASE and tail.isdigit() else None


def build_order(groups: Iterable[str], first: Iterable[str]) -> list[str]:
    """The order every member builds a generation's groups in: ``first`` (the session's groups,
    in the order ``start_session`` builds them), then the user's groups in creation order, then
    any other by name. A replacement builds its groups in this order too (its session's at
    start-up, then the user's it is a member of), so no member of a group waits in another
    group's building while the group's other members wait in this one's."""
    names, lead = set(groups), [b for b in first]
    rest = sorted((b for b in names if b not in lead), key=lambda b: (user_ordinal(b) is None, user_ordinal(b) or 0, b))
    return [b for b in lead if b in names] + rest


def store_prefix(run_id: str, generation: int, base: str = WORLD) -> str:
    """The store namespace of ``base``'s group in a generation (per run, so runs sharing a store never meet)."""
    return f"meshpact/{run_id}/g{generation}/{base}/"


def group_ranks(pg: dist.ProcessGroup) -> tuple[int, ...]:
    """The global ranks of ``pg``'s members, in group-rank order."""
    mapping = c10d._world.pg_group_ranks.get(pg)
    if mapping is None:
        return tuple(range(pg.size()))
    return tuple(g for g, _ in sorted(mapping.items(), key=lambda kv: kv[1]))


def _tcp_ends(fd: int) -> tuple[bool, int, int] | None:
    """(listening, local port, remote port; 0 when not connected) of a TCP socket descriptor,
    asked of the socket itself: a few system calls, where reading ``/proc/net/tcp`` walks every
    socket of the machine (tens of milliseconds on a busy host)."""
    try:
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    with dup:
        if dup.type != socket.SOCK_STREAM or dup.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        try:
            listening = bool(dup.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
            local = int(dup.getsockname()[1])
        except OSError:
            return None
        try:
            remote = int(dup.getpeername()[1])
        except OSError:
            remote = 0
    return listening, local, remote


def socket_fds() -> dict[int, str]:
    """This process's open socket descriptors: fd -> ``socket:[inode]`` (the name
    ``/proc/self/fd`` links to; asked of ``fstat``, a quarter of a ``readlink``'s cost)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            st = os.fstat(fd)
        except OSError:
            continue
        if stat.S_ISSOCK(st.st_mode):
            out[fd] = f"socket:[{st.st_ino}]"
    return out


SocketEnds = dict[str, tuple[bool, int, int]]  # socket:[inode] -> (listening, local port, remote port)


def _nodelay(fd: int) -> bool:
    """Whether ``TCP_NODELAY`` is set on descriptor ``fd``'s socket: gloo sets it on every pair it
    connects or accepts (``gloo/transport/tcp``); a socket's default, and its listener's, is off."""
    try:
        with socket.socket(fileno=os.dup(fd)) as dup:
            return bool(dup.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
    except OSError:
        return False


def opened_since(before: dict[int, str]) -> dict[int, str]:
    """The socket descriptors open now that were not (or named another socket) in ``before``."""
    return {fd: ino for fd, ino in socket_fds().items() if before.get(fd) != ino}


def gloo_pairs(opened: dict[int, str], store_ports: tuple[int, ...] = ()) -> dict[int, str]:
    """Of ``opened``, the sockets of gloo pairs: connected TCP sockets with ``TCP_NODELAY`` set
    (as gloo sets it on each pair), neither end on a store port (a ``TCPStore`` connection, which
    sets it too). ``opened`` are the sockets that appeared while the job's groups were built, so
    what this keeps are those groups' pairs: a socket the user opened before or after, on this
    thread or another, is not among them, unless another thread of the user's opened one with
    ``TCP_NODELAY`` while a group was being built."""
    out = {}
    for fd, ino in opened.items():
        ends = _tcp_ends(fd)
        if ends is None:
            continue
        listening, local, remote = ends
        if listening or not remote or local in store_ports or remote in store_ports or not _nodelay(fd):
            continue
        out[fd] = ino
    return out


def data_sockets(
    protected: dict[int, str], store_ports: tuple[int, ...] = (), known: SocketEnds | None = None
) -> dict[int, str]:
    """Where gloo connects its pairs lazily (``TORCH_GLOO_LAZY_INIT``, a pair's socket may appear
    at any collective, so no build tells them): the connected TCP sockets with gloo's
    ``TCP_NODELAY`` set, not listening (shutting down a gloo listener makes its accept loop abort
    the process), not ``protected`` (taken before any data-path group existed), and not talking
    to or serving a store port (the rendezvous store and the control channel, whichever process
    hosts them). Otherwise the data path's sockets are those its groups opened as they were
    built (:func:`gloo_pairs`).

    ``known`` keeps the ends of sockets already asked (a connected or listening socket's ends
    never change), so a recovery asks only of sockets that are new since the last call;
    entries of sockets since closed are dropped."""
    out = {}
    fds = socket_fds()
    if known is not None:
        for ino in set(known) - set(fds.values()):
            known.pop(ino, None)  # the heartbeat thread asks too
    for fd, ino in fds.items():
        if protected.get(fd) == ino:
            continue
        ends = known.get(ino) if known is not None else None
        if ends is None:
            ends = _tcp_ends(fd)
            if ends is None:
                continue
            if known is not None and (ends[0] or ends[2]):
                known[ino] = ends
        listening, local, remote = ends
        if listening or not remote or local in store_ports or remote in store_ports or not _nodelay(fd):
            continue
        out[fd] = ino
    return out


def timed_out(error: str) -> bool:
    """Whether a data-path error says the operation waited out its timeout (gloo: "Timed out
    waiting ..."; NCCL's watchdog: "... timeout ..."), as opposed to hearing from the data path
    (a peer closed or reset its connection) or failing in this process (a collective raising)."""
    text = error.lower()
    return "timed out" in text or "timeout" in text


class SeveredSockets:
    """Sockets :func:`sever` shut down for reading, kept open until :meth:`release`.

    Once gloo has let go of one (it closes its descriptor when it reads the end of the stream), a
    thread reads and drops whatever the peer still sends on it: a peer part way through a large
    send finishes it instead of meeting a full buffer (its send would then wait on a pair that
    fails before it completes, see :func:`sever`). A socket the peer closed is closed here too.

    The thread is started by the first socket held and then waits, costing nothing, while none
    is: a recovery starts no thread. It looks as :func:`drain_delay` says: first
    ``DRAIN_FIRST_S`` after a socket is held, then every ``DRAIN_MOVING_S`` while bytes arrive,
    and less and less often once they stop (or none came), down to every ``DRAIN_IDLE_MOST_S``;
    a socket gloo still holds is gloo's to read. A held socket whose queue a look finds empty
    sends the acknowledgement the kernel holds back at once (:func:`_quick_ack`)."""

    def __init__(self) -> None:
        self._held: list[tuple[socket.socket, int, str]] = []  # (our socket, gloo's descriptor, its name)
        self._closing: list[socket.socket] = []  # released: closed by the drain thread, between its looks
        self._fresh = False  # a socket was held since the drain's last look
        self._let_go: set[str] = set()  # held sockets gloo let go of (it never takes one back): the drain's alone
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # a socket was held or released
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def holds(self, fd: int, inode: str) -> bool:
        """Whether descriptor ``fd``'s socket ``inode`` is held already (shut down for reading)."""
        with self._lock:
            return any(f == fd and i == inode for _, f, i in self._held)

    def hold(self, sock: socket.socket, fd: int, inode: str) -> None:
        sock.setblocking(False)
        with self._lock:
            self._held.append((sock, fd, inode))
            if not self._fresh:  # (the first of a sever's sockets wakes the drain; the rest go with it)
                self._fresh = True
                self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name="meshpact-severed-drain", daemon=True)
                self._thread.start()

    def release(self) -> None:
        """Close every held socket (every rank has left their generation). The drain thread closes
        them between two of its looks: closed while it reads one, the descriptor could be reused
        by a socket of the new groups, and the drain would read and drop that socket's bytes."""
        with self._lock:
            held, self._held = self._held, []
            if self._thread is not None:
                self._closing += [sock for sock, _, _ in held]
                self._cond.notify()
                return
        for sock, _, _ in held:
            sock.close()

    def _wait(self, delay: float) -> tuple[list[tuple[socket.socket, int, str]], bool]:
        """Wait for the next look: ``delay``, or ``DRAIN_FIRST_S`` after a socket held meanwhile;
        close what was released. The sockets to look at, and whether one was held meanwhile."""
        with self._lock:
            deadline, fresh = time.monotonic() + delay, False
            while True:
                for sock in self._closing:
                    sock.close()
                self._closing = []
                if not self._held:
                    self._let_go.clear()
                    self._cond.wait_for(lambda: bool(self._held) or bool(self._closing))
                    deadline = float("inf")  # (its first look: DRAIN_FIRST_S after the socket was held)
                    continue
                if self._fresh:
                    self._fresh, fresh = False, True
                    deadline = min(deadline, time.monotonic() + DRAIN_FIRST_S)
                left = deadline - time.monotonic()
                if left <= 0:
                    return list(self._held), fresh
                self._cond.wait(timeout=left)

    def _drain(self) -> None:
        # a socket shut down for reading always reads as ready and its recv returns b"" once its queue
        # is empty: what is queued is asked of the kernel, and the peer's end from the TCP state
        delay = DRAIN_FIRST_S
        while True:
            held, fresh = self._wait(delay)
            try:
                moved = self._look(held)
            except Exception:  # noqa: BLE001 (a look that failed is skipped: a thread that ended drains nothing again)
                moved = False
            # a socket held since the last look backs off from the first look's delay, not the idle one's
            delay = drain_delay(DRAIN_FIRST_S if fresh else delay, moved)

    def _look(self, held: list[tuple[socket.socket, int, str]]) -> bool:
        """Read and drop what the held sockets gloo let go of have queued; drop those whose peer
        ended. Whether bytes moved."""
        moved, gone = False, []
        for sock, fd, inode in held:
            try:
                queued = _queued(sock)
                if not queued:
                    # nothing arrived since the last look: the acknowledgement of a message's tail
                    # goes now, whoever reads the socket. While bytes stream in, the kernel's own
                    # acknowledgements pace the peer (asked after every read instead, in a loopback
                    # trial, they stalled a peer's sends of 200 KB and more for 200 ms)
                    _quick_ack(sock)
                if inode not in self._let_go:
                    if _names(fd, inode):
                        continue  # gloo still holds its descriptor: gloo's to read
                    self._let_go.add(inode)
                while queued > 0:
                    got = len(sock.recv(min(queued, 1 << 20)))
                    if not got:
                        break
                    moved, queued = True, queued - got
                if _tcp_state(sock) in _PEER_ENDED:
                    gone.append(sock)
            except BlockingIOError:
                continue
            except OSError:  # reset by the peer
                gone.append(sock)
        if gone:
            with self._lock:
                self._held = [h for h in self._held if h[0] not in gone]
            for sock in gone:
                sock.close()
        return moved


def drain_delay(delay: float, moved: bool) -> float:
    """The drain's wait before its next look, after a look that waited ``delay`` and saw bytes
    move (``moved``) or none: ``DRAIN_MOVING_S`` while they move, then doubling from there, at
    most ``DRAIN_IDLE_MOST_S``. A peer's send that resumes after a pause of ``p`` is read within
    about ``2 p``, or ``p + DRAIN_IDLE_MOST_S`` past about 15 ms (a sender whose buffer is full waits
    for this look): doubling from ``DRAIN_FIRST_S`` after a movement made a pause of a few
    milliseconds in a large message one of 40 ms."""
    return DRAIN_MOVING_S if moved else min(delay * 2, DRAIN_IDLE_MOST_S)


_PEER_ENDED = (7, 8, 9)  # TCP_CLOSE, TCP_CLOSE_WAIT, TCP_LAST_ACK (linux/include/net/tcp_states.h)


def _queued(sock: socket.socket) -> int:
    """Bytes received on ``sock`` and not yet read."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def _tcp_state(sock: socket.socket) -> int:
    """The socket's TCP state (``tcpi_state``, the first byte of ``TCP_INFO``)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


def _names(fd: int, inode: str) -> bool:
    """Whether descriptor ``fd`` still names socket ``inode``."""
    try:
        return f"socket:[{os.fstat(fd).st_ino}]" == inode
    except OSError:
        return False


@dataclass(frozen=True)
class Severance:
    """What one :func:`sever` did: the sockets it shut down, and how its wait for a message under
    way ended (``flush_end``: ``none`` seen, ``settled`` once it ended, ``stalled``: a queue stopped
    moving for ``FLUSH_STALL_S``, ``most``: ``FLUSH_MOST_S`` ran out, or ``""``: no wait), with the
    bytes still queued then, this end's unsent and unread summed over the sockets."""

    sockets: int
    flush_s: float = 0.0
    flush_end: str = ""
    unsent: int = 0
    unread: int = 0
    # the longest quiet spell between two movements the flush saw, as a lower bound: from the look that
    # saw a movement to the last look before the next one that saw nothing (see FLUSH_SETTLE_S)
    gap_s: float = 0.0
    wake_s: float = 0.0  # the longest time between two of its looks (this thread's own wake-ups, late on a busy host)


def sever(sockets: dict[int, str], held: SeveredSockets | None = None) -> Severance:
    """End a broken group's operations by shutting its sockets down, without closing its descriptors.

    gloo's ``abort`` does not unblock an operation in flight, and a group cannot be destroyed
    while FSDP still holds it: a shut-down socket is what makes gloo fail the operations waiting
    on it. Only descriptors that still name the same socket (inode) are touched.

    gloo's TCP transport never fails a collective's send (an unbound buffer's) that it queued on a
    pair because the kernel refused it, nor a receive it was part way through, when the pair then
    fails (``Pair::signalException``, ``gloo/transport/tcp/pair.cc``): such an operation waits out
    its whole timeout. A peer's write is refused once this end has sent a FIN and stopped reading
    (the kernel answers the data with a reset), has closed with data unread, or is full.

    With ``held`` (the peers learn of the recovery over the control channel): each socket is shut
    down for reading only and kept in ``held``, which drains it once gloo lets go. This rank's waits
    fail at once (gloo reads the end of the stream); the peer is sent nothing, and its writes keep
    succeeding, so this sever leaves no peer in that wait. Without ``held`` (nobody would tell the
    peers otherwise): both directions are shut down and the peers' reads end at once, their sends
    exposed to a reset as above.
    """
    opened: list[tuple[socket.socket, int, str]] = []
    for fd, inode in sockets.items():
        if not _names(fd, inode) or (held is not None and held.holds(fd, inode)):
            continue  # gone, or shut down for reading already (the heartbeat's listener severed first)
        try:
            opened.append((socket.socket(fileno=os.dup(fd)), fd, inode))
        except OSError:
            continue
    flushed = _flush([s for s, _, _ in opened]) if held is not None and opened else None
    n = 0
    for s, fd, inode in opened:
        try:
            s.shutdown(socket.SHUT_RD if held is not None else socket.SHUT_RDWR)
        except OSError:
            s.close()
            continue
        n += 1
        if held is not None:
            held.hold(s, fd, inode)
        else:
            s.close()
    return Severance(n) if flushed is None else replace(flushed, sockets=n)


def _traffic(sock: socket.socket) -> tuple[int, int, int]:
    """(bytes given to the kernel on ``sock`` and not yet acknowledged, bytes received and not yet
    read, bytes moved in all: ``tcpi_bytes_acked`` + ``tcpi_bytes_received``); zeros where the
    kernel does not say."""
    try:
        unsent = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        unread = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_BYTES + 16)
    except OSError:
        return 0, 0, 0
    moved = sum(struct.unpack_from("=QQ", info, _TCP_INFO_BYTES)) if len(info) >= _TCP_INFO_BYTES + 16 else 0
    return unsent, unread, moved


def _quick_ack(sock: socket.socket) -> None:
    """Send the acknowledgement the kernel holds back for its delayed-ACK timer (40 ms at least on
    Linux) at once (``TCP_QUICKACK``): a peer whose send waits on it would pause its message that
    long, and a flush on either end waits the pause out. Asked only of a socket whose queue was
    just seen empty (:func:`_quick_acks`, ``SeveredSockets._look``).

    Asked of a socket with bytes unread, the acknowledgement would offer the peer the window those
    bytes leave, none once the buffer is full; and a socket shut down for reading (a severed one)
    sends no window update of its own when it is read (Linux, ``tcp_cleanup_rbuf``): only an
    acknowledgement already pending, sent later, carries the wider window. Where none is, the
    peer's send waits for its zero-window probe, 200 ms and doubling."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
    except OSError:
        pass


def _quick_acks(socks: list[socket.socket]) -> None:
    """:func:`_quick_ack` on those of ``socks`` whose received bytes were all read (asked again at
    every look: the kernel drops the mode by itself)."""
    for s in socks:
        try:
            queued = _queued(s)
        except OSError:
            continue
        if not queued:
            _quick_ack(s)


def _flush(socks: list[socket.socket], stall_s: float = FLUSH_STALL_S, most_s: float = FLUSH_MOST_S) -> Severance:
    """Wait while a large message is part way through one of these sockets, so that it ends before
    the pair fails: gloo writes a message the kernel cannot take whole from its own queue as the
    socket's buffer frees, and reads one in pieces as they arrive; either, cut short, waits out its
    timeout. Only a message of more than ``FLUSH_LARGE_BYTES`` can be part way (a smaller one fits
    the free buffer whole, and is read whole): with none in sight (queued either way, or moved
    within ``FLUSH_LOOK_S``) this returns then. At each look, the sockets whose queue is empty
    send the acknowledgement the kernel holds back at once (:func:`_quick_acks`). Once one was
    seen, it waits until the sockets' queues are empty and nothing moved for ``FLUSH_SETTLE_S``
    (a loaded machine may leave gloo's writer unscheduled while the peer empties the buffer; the
    longest such quiet spell it saw between two movements is ``gap_s``, its own longest wait
    between two looks ``wake_s``). Bounded: a queue not moving for ``stall_s`` (a peer that
    stopped reading, a cut link), or ``most_s`` in all. How it ended
    (:class:`Severance`, its socket count left to the caller)."""
    t0 = time.monotonic()
    last = [_traffic(s) for s in socks]
    large = any(q > FLUSH_LARGE_BYTES or r > FLUSH_LARGE_BYTES for q, r, _ in last)
    moved_at, gap, wake, looked = t0, 0.0, 0.0, t0
    while True:
        _quick_acks(socks)
        time.sleep(FLUSH_LOOK_S)
        now = time.monotonic()
        wake, prev, looked = max(wake, now - looked), looked, now
        seen = [_traffic(s) for s in socks]
        delta = sum(b[2] - a[2] for a, b in zip(last, seen))
        large = (
            large
            or delta > FLUSH_LARGE_BYTES
            or any(q > FLUSH_LARGE_BYTES or r > FLUSH_LARGE_BYTES for q, r, _ in seen)
        )
        if not large:
            return Severance(0, now - t0, "none", wake_s=wake)
        if seen != last:
            # quiet at least from the look that saw the last movement to the look before this one (a
            # late look of this thread's own is not a pause of the message's)
            gap = max(gap, prev - moved_at) if moved_at > t0 else gap
            last, moved_at = seen, now
        queued = any(q or r for q, r, _ in seen)
        if not queued and now - moved_at >= FLUSH_SETTLE_S:
            return Severance(0, now - t0, "settled", gap_s=gap, wake_s=wake)
        if (queued and now - moved_at > stall_s) or now - t0 > most_s:
            return Severance(
                0,
                now - t0,
                "most" if now - t0 > most_s else "stalled",
                sum(q for q, _, _ in seen),
                sum(r for _, r, _ in seen),
                gap,
                wake,
            )


def build_group(
    spec: GroupSpec,
    store: Any,
    generation: int,
    base: str = WORLD,
    ranks: tuple[int, ...] | None = None,
    namespace: str = "",
    install: bool = True,
) -> dist.ProcessGroup:
    """A fresh data-path group for ``base`` in ``generation`` over the global ``ranks`` (default:
    every rank), under its own store namespace (``namespace`` appended: a standby's keys never
    meet a group built in the recovery), with the data-path timeout. Every member must call
    it; members build their groups in one agreed order (:func:`build_order`), so two groups
    never wait on each other. ``install=False`` leaves it out of c10d's world (a standby,
    installed when it is swapped in)."""
    ranks = tuple(range(spec.world_size)) if ranks is None else tuple(ranks)
    prefix = dist.PrefixStore(store_prefix(spec.run_id, generation, base) + namespace, store)
    rank, size = ranks.index(spec.rank), len(ranks)
    timeout = timedelta(seconds=spec.timeout_s)
    connect = timedelta(seconds=max(spec.timeout_s, spec.connect_timeout_s))
    pg = dist.ProcessGroup(prefix, rank, size)
    if spec.backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        backend: dist.ProcessGroupNCCL | dist.ProcessGroupGloo = dist.ProcessGroupNCCL(prefix, rank, size, opts)
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
    pg._set_group_name(c10d.GroupName(group_name(generation, base)))
    pg._set_group_desc(f"meshpact data path {base}, generation {generation}")
    if install:
        install_group(pg, store, spec, ranks)
    return pg


def install_group(pg: dist.ProcessGroup, store: Any, spec: GroupSpec, ranks: tuple[int, ...]) -> None:
    """Register ``pg`` in c10d's world (name registry, maps, tags) with its global ``ranks``."""
    c10d._register_pg_in_world(
        pg,
        spec.backend,
        store,
        pg.group_name,
        f"{spec.device.split(':')[0]}:{spec.backend}",
        rank_mapping={g: i for i, g in enumerate(ranks)},
    )


def set_data_timeout(groups: Iterable[dist.ProcessGroup], spec: GroupSpec) -> None:
    """Let every backend of ``groups`` wait up to ``spec.timeout_s`` from its next collective
    (gloo and NCCL read the timeout when an operation starts)."""
    timeout = timedelta(seconds=spec.timeout_s)
    devices = {torch.device(spec.device), torch.device("cpu")}
    for pg in groups:
        for device in devices:
            backend = backend_of(pg, str(device))
            if backend is not None:
                backend._set_default_timeout(timeout)


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
        return bool(pg._get_backend(torch.device(device)).supports_shrinking)  # type: ignore[attr-defined]  # newer backends have it; the stub lists supports_splitting alone
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
    traffic (and a backend that connects lazily has connected); a recovery ends here. Issued through
    ``dist.all_reduce``, not the group object's own ``allreduce().wait()``: a backend's plain
    ``RuntimeError`` is a data-path fault when it is raised from torch's communication code
    (``is_comm_fault``), and from the group object it is raised from this file, so a peer dying during
    a recovery's first collective ended the rank instead of starting the next recovery."""
    dist.all_reduce(torch.zeros(1, device=device), group=pg)


def exercise(pg: dist.ProcessGroup, device: str) -> None:
    """One tiny all-reduce on ``pg`` through the group object itself (it need not be installed
    in c10d's world): a standby proven to carry traffic before a recovery relies on it."""
    pg.allreduce([torch.zeros(1, device=device)]).wait()


GroupPlan = tuple[tuple[str, tuple[int, ...]], ...]  # (base name, global ranks) of each group, sorted by base
STANDBY_NAMESPACE = "standby/"  # appended to a standby's store prefix: never the keys of a group built in a recovery


def group_plan(groups: Mapping[str, dist.ProcessGroup]) -> GroupPlan:
    """The job's groups as a standby must rebuild them: base names and global ranks, sorted."""
    return tuple(sorted((base, group_ranks(pg)) for base, pg in groups.items()))


@dataclass(frozen=True)
class StandbyStatus:
    """What one rank says of its standby before consensus; a standby serves only when every
    rank says ``ready`` for the decided generation."""

    generation: int  # the generation the standby was built for
    ready: bool
    reason: str = ""  # why it cannot serve ("" when ready)

    def to_dict(self) -> dict[str, object]:
        return {"generation": self.generation, "ready": self.ready, "reason": self.reason}

    @classmethod
    def from_dict(cls, d: JsonObject) -> "StandbyStatus":
        return cls(int(d["generation"]), bool(d["ready"]), str(d.get("reason", "")))


def standby_refusal(said: dict[int, StandbyStatus | None], generation: int, world_size: int) -> str:
    """Why the standbys cannot serve ``generation``, from every rank's word (None: the rank
    said nothing, e.g. a replacement process that has no standby); "" when every rank's
    standby is ready for it. Pure: every rank reads the same words and gets the same answer."""
    for r in range(world_size):
        status = said.get(r)
        if status is None:
            return f"rank {r} has no standby (a replacement process)"
        if status.generation != generation:
            return f"rank {r}'s standby is for generation {status.generation}, the decision is {generation}"
        if not status.ready:
            return status.reason
    return ""


class Standby:
    """The next generation's groups, built and exercised by a background thread.

    ``connect()`` opens the thread's own connection to the rendezvous store (the training
    thread's connection is never shared). The groups are not installed in c10d's world until
    :meth:`take`; :meth:`discard` drops them (at once if built, when the thread ends if not).
    ``sockets`` are the descriptors the standby opened: severing the broken data path leaves
    them alone.

    On NCCL the groups are built between steps instead (``between_steps``): NCCL documents that
    operations on separate communicators issued concurrently can deadlock, and building a
    communicator (``ncclCommInitRank``, the first all-reduce) beside the training thread's
    collectives is such a pair. :meth:`start` then starts nothing, and the training thread calls
    :meth:`build_between_steps` after a commit, at the same point of the job on every rank."""

    def __init__(self, spec: GroupSpec, connect: Callable[[], Any], generation: int, plan: GroupPlan) -> None:
        self.spec = spec
        self.generation = generation
        self.plan = plan
        self.sockets: dict[int, str] = {}
        self.error: str | None = None
        self.build_s: float | None = None  # building and exercising every group, once done
        self._connect = connect
        self._store: Any = None
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._discarded = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"meshpact-standby-g{generation}", daemon=True)
        self.between_steps = spec.backend == "nccl"
        self._started = False

    def start(self) -> "Standby":
        if not self.between_steps:
            self._started = True
            self._thread.start()
        return self

    def build_between_steps(self) -> bool:
        """Build the groups here, on the calling (training) thread between two steps, where this
        standby waits for that (NCCL) and has not been built or discarded. Whether it built now."""
        if not self.between_steps or self._started or self._discarded:
            return False
        self._started = True
        self._run()
        return True

    def _run(self) -> None:
        try:
            if self.spec.device.startswith("cuda"):  # the current device is per thread
                torch.cuda.set_device(torch.device(self.spec.device))
            before = socket_fds()
            t0 = time.perf_counter()
            store = self._connect()
            groups = {
                base: build_group(self.spec, store, self.generation, base, ranks, STANDBY_NAMESPACE, install=False)
                for base, ranks in self.plan
            }
            for base, _ in self.plan:  # the same order on every member, as the building
                exercise(groups[base], self.spec.device)
            opened = {fd: ino for fd, ino in socket_fds().items() if before.get(fd) != ino}
            with self._lock:
                if not self._discarded:
                    self._store, self._groups, self.sockets = store, groups, opened
                    self.build_s = time.perf_counter() - t0
            del groups, store
        except Exception as exc:  # noqa: BLE001  (a failed standby is reported, never raised in this thread)
            self.error = f"{type(exc).__name__}: {str(exc)[:200]}"
        finally:
            self._done.set()

    def status(self, plan: GroupPlan, wait_s: float) -> StandbyStatus:
        """Whether this standby can replace ``plan``'s groups, waiting at most ``wait_s`` for a
        standby still being built."""
        if self.between_steps and not self._started:
            return StandbyStatus(
                self.generation,
                False,
                "not built yet (on NCCL it is built between steps, and no step ended since it was asked for)",
            )
        if not self._done.wait(wait_s):
            return StandbyStatus(self.generation, False, f"still being built after {wait_s:g} s")
        if self.error is not None:
            return StandbyStatus(self.generation, False, f"failed its own check ({self.error})")
        if self._discarded:
            return StandbyStatus(self.generation, False, "discarded")
        if plan != self.plan:
            return StandbyStatus(self.generation, False, "the job's groups changed since it was built")
        return StandbyStatus(self.generation, True)

    def take(self, store: Any) -> dict[str, dist.ProcessGroup]:
        """The built groups, installed in c10d's world (registered with ``store``): from now on
        they are the data path, and this standby holds nothing."""
        with self._lock:
            groups, self._groups, self.sockets, self._discarded, self._store = self._groups, {}, {}, True, None
        ranks = dict(self.plan)
        for base, pg in groups.items():
            install_group(pg, store, self.spec, ranks[base])
        return groups

    def discard(self) -> None:
        """Drop the groups (a thread still building drops them when it ends)."""
        with self._lock:
            self._discarded, self._groups, self.sockets, self._store = True, {}, {}, None

    def join(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` for the thread; True when it has ended (or never started)."""
        if not self._thread.is_alive():
            return True
        self._thread.join(timeout=timeout_s)
        return not self._thread.is_alive()
