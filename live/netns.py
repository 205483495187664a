"""Two hosts on one machine: network namespaces joined by veth links.

:class:`TwoHosts` creates two network namespaces (the "hosts") and joins them with a data
veth pair whose addresses exist only inside those namespaces (``10.<a>.<b>.1/30`` and
``.2``). The data link is shaped in both directions with ``tc`` (a token bucket, ``tbf``;
default 1 Gbit/s, ``link=None`` for no shaping) and, when asked, given one-way latency with
``netem``. With ``control=True`` a second, unshaped veth pair (``10.<a>.<b+1>.*``) carries
an out-of-band control channel that the data link's faults do not touch (partition faults
set the data link down and up). Processes run on a host
with :meth:`TwoHosts.prefix` (``ip netns exec``); :meth:`TwoHosts.counters` reads the
kernel's interface statistics of each end, so traffic can be counted by the kernel rather
than by the program that sent it.

Names carry the process id and a random tag, so parallel runs never clash (a name that
exists already is drawn again), and each pair's addresses are drawn from the tag. IPv6 is
off inside both namespaces: otherwise the kernel's own neighbour discovery and multicast
reports cross the link at random moments in the first seconds after it comes up, and a
count of the link's traffic would include them. Leaving the
``with`` block, an exception, the interpreter's exit, or a SIGTERM (turned into ``SystemExit``
while the hosts exist, where no other handler was set) deletes both namespaces, and the
veth pair with them. :func:`netns_unavailable` says what is missing where this cannot run:
root, ``ip``, ``tc``, or the kernel's ``tbf``/``netem`` queueing disciplines.

A program reaches an address that exists only inside a host (a store served on its veth end)
by running a block with its thread there (:func:`entered`, :meth:`TwoHosts.inside`): what the
thread opens, and the processes it starts, live in that namespace; the rest of the program
stays where it is.

:class:`Hosts` is the same resource for three hosts or more: each namespace joined by a veth
pair to a Linux bridge in a hub namespace (unshaped; :func:`bridge_unavailable` says what is
missing where it cannot be built).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator, Sequence, TypeVar

from meshpact.core.errors import MeshpactError

__all__ = [
    "NetnsError",
    "LinkShape",
    "IfaceCounters",
    "TwoHosts",
    "Hosts",
    "entered",
    "netns_unavailable",
    "netem_unavailable",
    "bridge_unavailable",
]


class NetnsError(MeshpactError):
    """Namespaces, veth links or queueing disciplines could not be set up here."""


@dataclass(frozen=True)
class LinkShape:
    """The shaped link between the two hosts: rate in Gbit/s and optional one-way delay."""

    gbit_per_s: float = 1.0
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if not self.gbit_per_s > 0:
            raise NetnsError(f"link rate: expected a positive rate in Gbit/s, got {self.gbit_per_s}")
        if self.delay_ms < 0:
            raise NetnsError(f"link delay: expected a delay >= 0 ms, got {self.delay_ms}")

    @property
    def bytes_per_s(self) -> float:
        return self.gbit_per_s * 1e9 / 8

    @property
    def beta_s_per_byte(self) -> float:
        """Seconds per byte on the wire at the shaped rate (the α-β model's β)."""
        return 1.0 / self.bytes_per_s

    def tbf_args(self) -> list[str]:
        """``tc`` arguments of the token bucket: the rate, a bucket of 1 ms at that rate (at
        least 32 KiB so full-size frames always fit) and 50 ms of queue before drops."""
        burst = max(32 * 1024, int(self.bytes_per_s * 1e-3))
        return ["tbf", "rate", f"{int(self.gbit_per_s * 1e9)}bit", "burst", str(burst), "latency", "50ms"]


@dataclass(frozen=True)
class IfaceCounters:
    """Kernel statistics of one interface (bytes and packets on the wire, Ethernet frames)."""

    rx_bytes: int
    tx_bytes: int
    rx_packets: int
    tx_packets: int

    def __sub__(self, other: "IfaceCounters") -> "IfaceCounters":
        return IfaceCounters(
            self.rx_bytes - other.rx_bytes,
            self.tx_bytes - other.tx_bytes,
            self.rx_packets - other.rx_packets,
            self.tx_packets - other.tx_packets,
        )

    def to_dict(self) -> dict[str, int]:
        return {
            "rx_bytes": self.rx_bytes,
            "tx_bytes": self.tx_bytes,
            "rx_packets": self.rx_packets,
            "tx_packets": self.tx_packets,
        }


def _run(cmd: Sequence[str], what: str) -> str:
    out = subprocess.run(list(cmd), capture_output=True, text=True)
    if out.returncode != 0:
        raise NetnsError(f"{what}: `{' '.join(cmd)}` failed: {out.stderr.strip() or out.returncode}")
    return out.stdout


def _base_unavailable(shaped: bool) -> str | None:
    if os.name != "posix" or os.geteuid() != 0:
        return "network namespaces and veth links need root; run as root"
    tools = (("ip", "iproute2's `ip`"), ("tc", "iproute2's `tc`")) if shaped else (("ip", "iproute2's `ip`"),)
    for tool, pkg in tools:
        if shutil.which(tool) is None:
            return f"two-host runs need {pkg} on PATH (install iproute2)"
    return None


@lru_cache(maxsize=1)
def _probe() -> tuple[str | None, str | None, str | None]:
    """Why (veth links, a tbf-shaped link, netem latency) cannot be used here; None where they can."""
    why = _base_unavailable(shaped=False)
    if why:
        return why, why, why
    ns = f"mpq{_fresh_tag()}"
    made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
    if made.returncode != 0:
        msg = f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
        return msg, msg, msg
    try:
        r = subprocess.run(
            ["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"], capture_output=True, text=True
        )
        if r.returncode != 0:
            msg = f"the kernel refused a veth pair ({r.stderr.strip()}); two-host runs need CONFIG_VETH"
            return msg, msg, msg
        no_tc = _base_unavailable(shaped=True)
        if no_tc:
            return None, no_tc, no_tc
        r = subprocess.run(
            ["tc", "-n", ns, "qdisc", "add", "dev", "pa", "root", "handle", "1:", *LinkShape().tbf_args()],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            msg = (
                f"the kernel refused the tbf queueing discipline ({r.stderr.strip()}); a rate-limited link "
                "needs CONFIG_NET_SCH_TBF"
            )
            return None, msg, msg
        r = subprocess.run(
            ["tc", "-n", ns, "qdisc", "add", "dev", "pb", "root", "netem", "delay", "1ms"],
            capture_output=True,
            text=True,
        )
        netem = (
            None
            if r.returncode == 0
            else (
                f"link latency needs the kernel's netem queueing discipline (sch_netem, CONFIG_NET_SCH_NETEM), "
                f"which this kernel lacks ({r.stderr.strip()}); run with delay 0"
            )
        )
        return None, None, netem
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def netns_unavailable(shaped: bool = True) -> str | None:
    """Why two hosts cannot be built here (``shaped``: with a tbf-limited link), or None if
    they can (probed once)."""
    return _probe()[1 if shaped else 0]


def netem_unavailable() -> str | None:
    """Why a link delay cannot be added here (no netem), or None if it can."""
    return _probe()[2]


def _fresh_tag() -> str:
    """A tag for one pair: the process id (mod 10^5) and five random hexadecimal digits."""
    return f"{os.getpid() % 100000}{secrets.token_hex(3)[:5]}"


def _quiet_ipv6(ns: str) -> None:
    """Turn IPv6 off in ``ns`` before any link exists there, so no router solicitation,
    neighbour discovery or multicast report crosses the link uninvited. Where the kernel has
    no IPv6 there is nothing to quiet."""
    for key in ("all", "default"):
        path = f"net.ipv6.conf.{key}.disable_ipv6"
        subprocess.run(["ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"{path}=1"], capture_output=True)


def _delete_namespaces(names: Sequence[str]) -> None:
    """Kill what still runs inside each namespace of ``names`` and delete it (its veth ends go with it)."""
    for ns in names:
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            with contextlib.suppress(ProcessLookupError, ValueError, PermissionError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


_CLONE_NEWNET = 0x40000000


def _setns(fd: int, what: str) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        raise NetnsError(f"{what}: setns failed: {os.strerror(ctypes.get_errno())}")


def netns_of(prefix: Sequence[str]) -> str | None:
    """The network namespace a command prefix runs its program in (``ip netns exec NAME``), or None."""
    return prefix[3] if len(prefix) == 4 and list(prefix[:3]) == ["ip", "netns", "exec"] else None


def move_into(ns: str) -> None:
    """This process (its calling thread: a process forked a moment ago has no other) into the network
    namespace ``ns`` for good, as ``ip netns exec`` puts the program it runs; what it opens from then
    on lives there. Only the network is moved: ``/sys`` still shows this host's interfaces."""
    try:
        there = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    except FileNotFoundError:
        raise NetnsError(f"enter the network namespace {ns}: there is none of that name") from None
    try:
        _setns(there, f"enter the network namespace {ns}")
    finally:
        os.close(there)


@contextlib.contextmanager
def entered(ns: str) -> Iterator[None]:
    """The calling thread inside the network namespace ``ns`` (an ``ip netns`` name) for the block.

    What the thread opens there, and the processes it starts, live there (a socket keeps its
    namespace after the thread leaves): a program reaches addresses that exist only inside ``ns``
    (a store served on a host's veth address) without moving its other threads. The thread is
    back in its own namespace after the block, whatever happened inside; leave the block before
    the namespace is deleted (its teardown kills every process whose main thread is inside)."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        try:
            there = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
        except FileNotFoundError:
            raise NetnsError(
                f"enter the network namespace {ns}: there is none of that name (`ip netns list` names those that exist)"
            ) from None
        try:
            _setns(there, f"enter the network namespace {ns}")
        finally:
            os.close(there)
        try:
            yield
        finally:
            _setns(own, f"leave the network namespace {ns}")
    finally:
        os.close(own)


_TwoHostsT = TypeVar("_TwoHostsT", bound="TwoHosts")
_HostsT = TypeVar("_HostsT", bound="Hosts")


class _Teardown:
    """The teardown :class:`TwoHosts` and :class:`Hosts` share: every process left in a namespace
    killed, every namespace deleted, on leaving the block, at the interpreter's exit or on SIGTERM."""

    _up: bool
    _made: list[str]
    _sigterm_was: Any

    def _watch_sigterm(self) -> None:
        """Make SIGTERM unwind this process (so the ``with`` block and atexit tear down) when
        it would otherwise kill it outright; leave any handler the program set alone."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._sigterm_was = signal.SIG_DFL
            signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def close(self) -> None:
        """Kill what still runs inside the namespaces and delete them (idempotent)."""
        if not self._up:
            return
        self._up = False
        _delete_namespaces(self._made)
        self._made = []
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        if self._sigterm_was is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm_was)
            self._sigterm_was = None

    def __exit__(self, *exc: object) -> None:
        self.close()


class TwoHosts(_Teardown):
    """Two network namespaces joined by veth links (see the module docstring).

    Use as a context manager. ``ns``, ``iface`` and ``addr`` (the data link) and
    ``ctrl_iface``, ``ctrl_addr`` (the control link, with ``control=True``) are pairs indexed
    by host (0, 1). ``link=None`` leaves the data link unshaped.
    """

    def __init__(self, link: LinkShape | None = LinkShape(), tag: str | None = None, control: bool = False) -> None:
        self.link = link
        self.control = control
        if tag is not None and (len(tag) > 10 or not tag.isalnum()):
            raise NetnsError(f"tag {tag!r}: expected at most 10 letters or digits (interface names are short)")
        self._fixed_tag = tag is not None
        self._name(tag or _fresh_tag())
        self._made: list[str] = []  # the namespaces this object created: the only ones it deletes
        self._up = False
        self._sigterm_was: Any = None

    def _name(self, tag: str) -> None:
        """Names and addresses of the pair with ``tag`` (addresses drawn from it: 10.16-249.x.y)."""
        self.tag = tag
        self.ns = (f"mph{tag}a", f"mph{tag}b")
        self.iface = (f"mpv{tag}a", f"mpv{tag}b")
        self.ctrl_iface = (f"mpc{tag}a", f"mpc{tag}b")
        h = random.Random(tag)
        a, b = h.randrange(16, 250), 2 * h.randrange(0, 127)
        self.addr = (f"10.{a}.{b}.1", f"10.{a}.{b}.2")
        self.ctrl_addr = (f"10.{a}.{b + 1}.1", f"10.{a}.{b + 1}.2")

    def _add_namespaces(self) -> None:
        """Create both namespaces; a name another run holds already is drawn again (a fixed tag refuses)."""
        for attempt in range(8):
            made: list[str] = []
            for ns in self.ns:
                r = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
                if r.returncode != 0:
                    for m in made:
                        subprocess.run(["ip", "netns", "del", m], capture_output=True)
                    if "exists" in r.stderr and not self._fixed_tag and attempt < 7:
                        break
                    raise NetnsError(
                        f"create a host namespace: `ip netns add {ns}` failed: {r.stderr.strip() or r.returncode}"
                    )
                made.append(ns)
            else:
                self._made = made
                return
            self._name(_fresh_tag())

    # -- lifecycle --------------------------------------------------------------------------
    def __enter__(self: _TwoHostsT) -> _TwoHostsT:
        why = netns_unavailable(shaped=self.link is not None)
        if why:
            raise NetnsError(why)
        if self.link is not None and self.link.delay_ms and netem_unavailable():
            raise NetnsError(str(netem_unavailable()))
        atexit.register(self.close)
        self._watch_sigterm()
        self._up = True
        try:
            self._add_namespaces()
            for ns in self.ns:
                _run(["ip", "-n", ns, "link", "set", "lo", "up"], "bring loopback up")
                _quiet_ipv6(ns)
            self._join(self.iface, self.addr, shaped=self.link is not None)
            if self.control:
                self._join(self.ctrl_iface, self.ctrl_addr, shaped=False)
        except BaseException:
            self.close()
            raise
        return self

    def _join(self, iface: tuple[str, str], addr: tuple[str, str], shaped: bool) -> None:
        _run(
            [
                "ip",
                "link",
                "add",
                iface[0],
                "netns",
                self.ns[0],
                "type",
                "veth",
                "peer",
                "name",
                iface[1],
                "netns",
                self.ns[1],
            ],
            "create a veth pair",
        )
        for side in (0, 1):
            ns, dev = self.ns[side], iface[side]
            _run(["ip", "-n", ns, "addr", "add", f"{addr[side]}/30", "dev", dev], "address the veth end")
            _run(["ip", "-n", ns, "link", "set", dev, "up"], "bring the veth end up")
            if shaped:
                self._shape(ns, dev)

    def _shape(self, ns: str, dev: str) -> None:
        assert self.link is not None
        tc = ["tc", "-n", ns, "qdisc", "add", "dev", dev]
        if self.link.delay_ms:
            _run([*tc, "root", "handle", "1:", "netem", "delay", f"{self.link.delay_ms}ms"], "add the link delay")
            _run([*tc, "parent", "1:", "handle", "2:", *self.link.tbf_args()], "limit the link rate")
        else:
            _run([*tc, "root", "handle", "1:", *self.link.tbf_args()], "limit the link rate")

    def exists(self) -> bool:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        return any(ns in listed for ns in self.ns)

    # -- use ----------------------------------------------------------------------------------
    def prefix(self, host: int) -> list[str]:
        """Command prefix that runs a program on ``host`` (0 or 1)."""
        return ["ip", "netns", "exec", self.ns[host]]

    def inside(self, host: int) -> contextlib.AbstractContextManager[None]:
        """The calling thread on ``host`` (0 or 1) for a ``with`` block (:func:`entered`)."""
        return entered(self.ns[host])

    def counters(self, host: int) -> IfaceCounters:
        """Kernel statistics of ``host``'s veth end (``ip -s -j link``)."""
        out = _run(
            ["ip", "-n", self.ns[host], "-s", "-j", "link", "show", "dev", self.iface[host]],
            "read interface statistics",
        )
        stats = json.loads(out)[0]["stats64"]
        return IfaceCounters(
            int(stats["rx"]["bytes"]),
            int(stats["tx"]["bytes"]),
            int(stats["rx"]["packets"]),
            int(stats["tx"]["packets"]),
        )

    def settled_counters(self, timeout_s: float = 5.0, quiet_s: float = 0.2) -> tuple[IfaceCounters, IfaceCounters]:
        """Both ends' statistics once the link is quiet: two reads ``quiet_s`` apart agree (what
        a closing connection still sends, its last acknowledgements, is then counted on both
        ends). After ``timeout_s`` the last reads are returned as they are."""
        last = self.counters(0), self.counters(1)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            time.sleep(quiet_s)
            now = self.counters(0), self.counters(1)
            if now == last:
                break
            last = now
        return last

    def qdisc(self, host: int) -> str:
        """``tc qdisc show`` of ``host``'s veth end, for reports."""
        return _run(["tc", "-n", self.ns[host], "qdisc", "show", "dev", self.iface[host]], "show the qdisc").strip()


@lru_cache(maxsize=1)
def bridge_unavailable() -> str | None:
    """Why :class:`Hosts` cannot be built here (veth links or a Linux bridge missing), or None if
    they can (probed once)."""
    why = netns_unavailable(shaped=False)
    if why:
        return why
    ns = f"mpq{_fresh_tag()}"
    made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
    try:
        r = subprocess.run(
            ["ip", "-n", ns, "link", "add", "name", "mpbr", "type", "bridge"], capture_output=True, text=True
        )
        if r.returncode != 0:
            return f"the kernel refused a bridge ({r.stderr.strip()}); three or more hosts need CONFIG_BRIDGE"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


class Hosts(_Teardown):
    """``n`` network namespaces (the "hosts") on one unshaped link layer: each joined by a veth
    pair to a bridge in a hub namespace of its own, so every host reaches every other and a
    host's end can be cut (``ip -n ns[i] link set iface[i] down``) without touching the others.

    Use as a context manager; ``ns``, ``iface`` and ``addr`` are indexed by host (0..n-1), the
    addresses ``10.<a>.<b>.<i+1>/24`` drawn from the tag. Teardown is :class:`TwoHosts`'s: every
    process left in a namespace is killed and every namespace deleted (the veth pairs and the
    bridge with them) on leaving the block, at the interpreter's exit or on SIGTERM.
    """

    def __init__(self, n: int = 3) -> None:
        if not 2 <= n <= 8:
            raise NetnsError(f"hosts: expected 2 to 8, got {n}")
        self.n = n
        self._name(_fresh_tag())
        self._made: list[str] = []
        self._up = False
        self._sigterm_was: Any = None

    def _name(self, tag: str) -> None:
        self.tag = tag
        self.hub = f"mpn{tag}h"
        self.ns = tuple(f"mpn{tag}{i}" for i in range(self.n))
        self.iface = tuple(f"mpe{tag}{i}" for i in range(self.n))
        self._hub_iface = tuple(f"mpp{tag}{i}" for i in range(self.n))
        h = random.Random(tag)
        a, b = h.randrange(16, 250), h.randrange(0, 256)
        self.addr = tuple(f"10.{a}.{b}.{i + 1}" for i in range(self.n))

    def _add_namespaces(self) -> None:
        """Create the hub and every host; a name another run holds already is drawn again."""
        for _ in range(8):
            made: list[str] = []
            for ns in (self.hub, *self.ns):
                r = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
                if r.returncode != 0:
                    for m in made:
                        subprocess.run(["ip", "netns", "del", m], capture_output=True)
                    if "exists" in r.stderr:
                        break
                    raise NetnsError(
                        f"create a host namespace: `ip netns add {ns}` failed: {r.stderr.strip() or r.returncode}"
                    )
                made.append(ns)
            else:
                self._made = made
                return
            self._name(_fresh_tag())
        raise NetnsError("create the host namespaces: every name drawn was taken")

    def __enter__(self: _HostsT) -> _HostsT:
        why = bridge_unavailable()
        if why:
            raise NetnsError(why)
        atexit.register(self.close)
        self._watch_sigterm()
        self._up = True
        try:
            self._add_namespaces()
            bridge = f"mpr{self.tag}"
            _run(["ip", "-n", self.hub, "link", "add", "name", bridge, "type", "bridge"], "create the bridge")
            _quiet_ipv6(self.hub)
            _run(["ip", "-n", self.hub, "link", "set", bridge, "up"], "bring the bridge up")
            for i, ns in enumerate(self.ns):
                _run(["ip", "-n", ns, "link", "set", "lo", "up"], "bring loopback up")
                _quiet_ipv6(ns)
                _run(
                    [
                        "ip",
                        "link",
                        "add",
                        self.iface[i],
                        "netns",
                        ns,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        self._hub_iface[i],
                        "netns",
                        self.hub,
                    ],
                    "create a veth pair",
                )
                _run(
                    ["ip", "-n", self.hub, "link", "set", self._hub_iface[i], "master", bridge, "up"],
                    "attach the veth end to the bridge",
                )
                _run(
                    ["ip", "-n", ns, "addr", "add", f"{self.addr[i]}/24", "dev", self.iface[i]], "address the veth end"
                )
                _run(["ip", "-n", ns, "link", "set", self.iface[i], "up"], "bring the veth end up")
        except BaseException:
            self.close()
            raise
        return self

    def exists(self) -> bool:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        return any(ns in listed for ns in (self.hub, *self.ns))

    def prefix(self, host: int) -> list[str]:
        """Command prefix that runs a program on ``host``."""
        return ["ip", "netns", "exec", self.ns[host]]
