"""Fault injection, each kind real: a raising collective, a stall, a partition, a SIGKILL.

- ``collective``: on the chosen rank and step, the n-th c10d operation raises at the
  dispatcher (a ``TorchDispatchMode`` that sees ``c10d::`` ops), before it reaches the
  backend; the peers are left waiting in that collective.
- ``stall``: the chosen rank sleeps past the data path's timeout before its first
  collective of the step.
- ``partition``: ranks live in two network namespaces joined by two veth links, one for
  the data path and one for the control channel; the injecting rank sets its end of the
  data link down and a detached ``sh`` sets it up again after ``down_s``. Needs root and
  iproute2; :func:`netns_unavailable` says why not elsewhere.
- ``kill``: the chosen rank sends itself SIGKILL; the launcher starts a replacement.

Each fault fires once: the injecting rank claims ``fault/<i>`` on the control channel
(compare-and-set) with the wall time of the injection, so a replayed step or a
replacement process never fires it again, and detection can be timed from that moment.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Iterator

from meshpact.core.errors import MeshpactError

__all__ = ["FaultKind", "Fault", "CollectiveFault", "plan_faults", "FaultInjector", "NetnsPair", "netns_unavailable"]


class FaultKind(str, Enum):
    COLLECTIVE = "collective"
    STALL = "stall"
    PARTITION = "partition"
    KILL = "kill"


class CollectiveFault(RuntimeError):
    """The injected failure of a collective operation."""


@dataclass(frozen=True)
class Fault:
    index: int
    kind: FaultKind
    step: int
    rank: int
    nth_op: int = 1  # collective: which c10d operation of the step raises

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kind": self.kind.value}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Fault":
        return cls(int(d["index"]), FaultKind(d["kind"]), int(d["step"]), int(d["rank"]), int(d.get("nth_op", 1)))


def plan_faults(kind: FaultKind | str, steps: int, count: int, world_size: int, first_step: int = 1,
                injector_ranks: tuple[int, ...] | None = None) -> tuple[Fault, ...]:
    """``count`` faults of ``kind`` at distinct steps spread over ``[first_step, steps)``, ranks rotating."""
    kind = FaultKind(kind)
    span = steps - first_step
    if count < 0 or count > span:
        raise MeshpactError(f"cannot place {count} fault(s) at distinct steps in [{first_step}, {steps}); "
                            f"use at most {max(span, 0)} faults or more steps")
    ranks = injector_ranks or tuple(range(world_size))
    stride = span / max(count, 1)
    out = []
    for i in range(count):
        step = first_step + int(i * stride + stride / 2)
        out.append(Fault(i, kind, step, ranks[i % len(ranks)], nth_op=1 + (i % 3)))
    return tuple(out)


class FaultInjector:
    """Fires this rank's faults at their steps (see the module docstring)."""

    def __init__(self, faults: tuple[Fault, ...], rank: int, channel: Any, stall_s: float = 0.0,
                 down_s: float = 0.0, data_iface: str | None = None) -> None:
        self.mine = {f.step: f for f in faults if f.rank == rank}
        self.rank = rank
        self.channel = channel
        self.stall_s = stall_s
        self.down_s = down_s
        self.data_iface = data_iface or os.environ.get("MESHPACT_DATA_IFACE")

    def _claim(self, fault: Fault) -> bool:
        nonce = f"{os.getpid()}-{random.getrandbits(64):x}"
        record = {"rank": self.rank, "step": fault.step, "kind": fault.kind.value, "t_wall": time.time(),
                  "nonce": nonce}
        return self.channel.set_once(f"fault/{fault.index}", record)["nonce"] == nonce

    @contextlib.contextmanager
    def around_step(self, step: int) -> Iterator[None]:
        fault = self.mine.get(step)
        if fault is None or not self._claim(fault):
            yield
            return
        if fault.kind is FaultKind.COLLECTIVE:
            with _RaiseOnCollective(fault.nth_op, f"injected fault {fault.index}: collective raised on rank "
                                    f"{self.rank} at step {step}"):
                yield
            return
        if fault.kind is FaultKind.STALL:
            time.sleep(self.stall_s)
        elif fault.kind is FaultKind.PARTITION:
            self._partition()
        elif fault.kind is FaultKind.KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        yield

    def _partition(self) -> None:
        if not self.data_iface:
            raise MeshpactError("a partition fault needs MESHPACT_DATA_IFACE (the data link's interface)")
        subprocess.run(["ip", "link", "set", "dev", self.data_iface, "down"], check=True)
        subprocess.Popen(["sh", "-c", f"sleep {self.down_s:.3f}; ip link set dev {self.data_iface} up"],
                         start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _raise_on_collective_mode() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    class RaiseOnCollective(TorchDispatchMode):
        def __init__(self, nth: int, message: str) -> None:
            super().__init__()
            self.left = nth
            self.message = message

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            if func.namespace == "c10d":
                self.left -= 1
                if self.left == 0:
                    raise CollectiveFault(self.message)
            return func(*args, **(kwargs or {}))

    return RaiseOnCollective


def _RaiseOnCollective(nth: int, message: str) -> Any:
    return _raise_on_collective_mode()(nth, message)


# -- network namespaces ---------------------------------------------------------------------
def netns_unavailable() -> str | None:
    """Why partition faults cannot run here, or None if they can."""
    if os.name != "posix" or os.geteuid() != 0:
        return "partition faults need root (network namespaces and veth links)"
    if shutil.which("ip") is None:
        return "partition faults need iproute2's `ip` command"
    probe = f"mpprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class NetnsPair:
    """Two namespaces joined by a data veth link and a control veth link (private addresses).

    ``ns[0]`` holds the lower half of the ranks and hosts both stores; addresses are
    ``10.<o>.1.{1,2}`` (data) and ``10.<o>.2.{1,2}`` (control) with a random second octet.
    Always use as a context manager: leaving it deletes both namespaces and with them the links.
    """

    tag: str = field(default_factory=lambda: f"{os.getpid() % 10000}{random.randrange(100, 999)}")
    octet: int = field(default_factory=lambda: random.randrange(64, 250))

    def __post_init__(self) -> None:
        self.ns = (f"mpA{self.tag}", f"mpB{self.tag}")
        self.data_if = (f"mpdA{self.tag}", f"mpdB{self.tag}")
        self.ctrl_if = (f"mpcA{self.tag}", f"mpcB{self.tag}")
        self.data_ip = (f"10.{self.octet}.1.1", f"10.{self.octet}.1.2")
        self.ctrl_ip = (f"10.{self.octet}.2.1", f"10.{self.octet}.2.2")

    def _ip(self, *args: str) -> None:
        out = subprocess.run(["ip", *args], capture_output=True, text=True)
        if out.returncode != 0:
            raise MeshpactError(f"`ip {' '.join(args)}` failed: {out.stderr.strip()}")

    def __enter__(self) -> "NetnsPair":
        try:
            for ns in self.ns:
                self._ip("netns", "add", ns)
                self._ip("-n", ns, "link", "set", "lo", "up")
            for (a, b), (ipa, ipb) in ((self.data_if, self.data_ip), (self.ctrl_if, self.ctrl_ip)):
                self._ip("link", "add", a, "netns", self.ns[0], "type", "veth", "peer", "name", b, "netns", self.ns[1])
                self._ip("-n", self.ns[0], "addr", "add", f"{ipa}/24", "dev", a)
                self._ip("-n", self.ns[1], "addr", "add", f"{ipb}/24", "dev", b)
                self._ip("-n", self.ns[0], "link", "set", a, "up")
                self._ip("-n", self.ns[1], "link", "set", b, "up")
        except BaseException:
            self.close()
            raise
        return self

    def side(self, rank: int, world_size: int) -> int:
        return 0 if rank < (world_size + 1) // 2 else 1

    def prefix(self, side: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]]

    def rank_env(self, rank: int, world_size: int) -> dict[str, str]:
        side = self.side(rank, world_size)
        return {"GLOO_SOCKET_IFNAME": self.data_if[side], "MESHPACT_DATA_IFACE": self.data_if[side],
                "MASTER_ADDR": self.data_ip[0], "MESHPACT_CONTROL_ADDR": self.ctrl_ip[0]}

    def close(self) -> None:
        for ns in self.ns:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def exists(self) -> bool:
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return any(ns in listed for ns in self.ns)
