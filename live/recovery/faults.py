"""Fault injection, each kind real: a raising collective, a stall, a partition, a SIGKILL.

- ``collective``: on the chosen rank and step, the n-th c10d operation raises at the
  dispatcher (a ``TorchDispatchMode`` that sees ``c10d::`` ops), before it reaches the
  backend; the peers are left waiting in that collective. The fault's time is the raise's,
  not the step's start: the ops before the n-th (a 100 MB all-gather at real sizes) are the
  step's work, not the fault's.
- ``stall``: the chosen rank sleeps past the data path's timeout before its first
  collective of the step.
- ``partition``: ranks live in two network namespaces joined by two veth links, one for
  the data path and one for the control channel; the injecting rank sets its end of the
  data link down and a detached ``sh`` sets it up again after ``down_s``. It does so once
  every rank has entered the step (each posts its arrival on the control channel), so the
  cut lands inside the step and not in the tail of the previous one, which a slower rank
  may still be receiving (that would leave the ranks one committed step apart, and the
  group would correctly refuse to resume from memory). Needs root and iproute2;
  :func:`netns_unavailable` says why not elsewhere.
- ``kill``: the chosen rank sends itself SIGKILL; the launcher starts a replacement. Kills
  planned at one step (a rank and its holders, ``--kill-holders``) land together: each rank
  posts its arrival at the step and dies once all of them have, so none of them can learn of
  another's death first and be restored from (or by) a rank that was meant to die with it.
- ``silent``: the chosen rank stops itself with SIGSTOP (alive, silent); consensus declares
  it lost within the rank-loss bound, and the launcher kills and replaces it.

Each fault fires once: the injecting rank claims ``fault/<i>`` on the control channel
(compare-and-set) with the wall time of the injection (a raised collective's record is
written again with the time it raised), so a replayed step or a replacement process never
fires it again, and detection can be timed from that moment.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import time
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any, Callable, Iterator

from meshpact.core.errors import MeshpactError
from meshpact.core.jsonform import JsonObject

from .. import netns

__all__ = [
    "FaultKind",
    "Fault",
    "CollectiveFault",
    "plan_faults",
    "first_fault_step",
    "FaultInjector",
    "NetnsPair",
    "netns_unavailable",
]


class FaultKind(str, Enum):
    COLLECTIVE = "collective"
    STALL = "stall"
    PARTITION = "partition"
    KILL = "kill"
    SILENT = "silent"


class CollectiveFault(RuntimeError):
    """The injected failure of a collective operation."""


@dataclass(frozen=True)
class Fault:
    index: int
    kind: FaultKind
    step: int
    rank: int
    nth_op: int = 1  # collective: which c10d operation of the step raises

    def to_dict(self) -> JsonObject:
        return {**asdict(self), "kind": self.kind.value}

    @classmethod
    def from_dict(cls, d: JsonObject) -> "Fault":
        return cls(int(d["index"]), FaultKind(d["kind"]), int(d["step"]), int(d["rank"]), int(d.get("nth_op", 1)))


FIRST_STEP = 1  # no fault in step 0: the warm-up (building, compiling) is no step to recover
# a stall is a fault only where something can tell it from a slow step: the heartbeat judges a rank
# once it has a usual pause, from its second completed step on (the first, the warm-up, teaches
# none), and the data-path timeout of the first steps is fitted to the warm-up, seconds long. A
# stall in step 1 is a slow step to every rank (nothing recovers, and nothing should).
FIRST_STALL_STEP = 2


def first_fault_step(kind: FaultKind | str) -> int:
    """The first step a fault of ``kind`` is placed at (see :data:`FIRST_STALL_STEP`)."""
    return FIRST_STALL_STEP if FaultKind(kind) is FaultKind.STALL else FIRST_STEP


def plan_faults(
    kind: FaultKind | str,
    steps: int,
    count: int,
    world_size: int,
    first_step: int | None = None,
    injector_ranks: tuple[int, ...] | None = None,
    nth_op: int | None = None,
) -> tuple[Fault, ...]:
    """``count`` faults of ``kind`` at distinct steps spread over ``[first_step, steps)``, ranks
    rotating (``first_step`` by default: :func:`first_fault_step`, 2 for a stall, 1 otherwise); a
    collective fault raises at the ``nth_op``-th operation of its step (default: the first, second
    and third in turn). More faults than those steps is refused in one line."""
    kind = FaultKind(kind)
    first_step = first_fault_step(kind) if first_step is None else first_step
    span = steps - first_step
    if count < 0 or count > span:
        why = " (a stall is placed from step 2, where the heartbeat judges it)" if kind is FaultKind.STALL else ""
        raise MeshpactError(
            f"cannot place {count} fault(s) ({kind.value}) at distinct steps in [{first_step}, {steps})"
            f"{why}; use at most {max(span, 0)} faults or more steps"
        )
    ranks = injector_ranks or tuple(range(world_size))
    stride = span / max(count, 1)
    out = []
    for i in range(count):
        step = first_step + int(i * stride + stride / 2)
        out.append(Fault(i, kind, step, ranks[i % len(ranks)], nth_op=nth_op or 1 + (i % 3)))
    return tuple(out)


class FaultInjector:
    """Fires this rank's faults at their steps (see the module docstring)."""

    def __init__(
        self,
        faults: tuple[Fault, ...],
        rank: int,
        channel: Any,
        stall_s: float = 0.0,
        down_s: float = 0.0,
        data_iface: str | None = None,
    ) -> None:
        self.own = {f.step: f for f in faults if f.rank == rank}  # this rank's faults, by step
        self.partitions = {f.step: f for f in faults if f.kind is FaultKind.PARTITION}
        kills: dict[int, list[int]] = {}
        for f in faults:
            if f.kind is FaultKind.KILL:
                kills.setdefault(f.step, []).append(f.rank)
        self.kills_together = {step: ranks for step, ranks in kills.items() if len(ranks) > 1}  # step -> ranks
        self.rank = rank
        self.channel = channel
        self.stall_s = stall_s
        self.down_s = down_s
        self.data_iface = data_iface or os.environ.get("MESHPACT_DATA_IFACE")
        self._claimed: dict[int, dict[str, Any]] = {}  # fault index -> the record this rank claimed it with

    def _claim(self, fault: Fault) -> bool:
        # not from ``random``: the runtime restores the generators before a re-run, which
        # would draw the same nonce again and fire the fault twice
        nonce = f"{os.getpid()}-{secrets.token_hex(8)}"
        record = {
            "rank": self.rank,
            "step": fault.step,
            "kind": fault.kind.value,
            "t_wall": time.time(),
            "nonce": nonce,
        }
        if self.channel.set_once(f"fault/{fault.index}", record)["nonce"] != nonce:
            return False
        self._claimed[fault.index] = record
        return True

    def _raised(self, fault: Fault) -> None:
        """The armed collective raises now: its record takes this moment (the same nonce, so the
        claim still holds), for the ops before it were the step's own work."""
        record = {**self._claimed[fault.index], "t_wall": time.time()}
        self.channel.set(f"fault/{fault.index}", record)

    def arm(self, step: int) -> Fault | None:
        """The injector's own part of ``step``, run before the runtime watches the step: a
        partition's arrivals, the claim, and the cut itself. It is not the user's step, and a
        rank waiting here for the others to arrive (asleep on the control channel) would read
        as stalled to the heartbeat if it were watched. Returns the fault :meth:`fire` brings
        into the step (None: none, or it fired already)."""
        cut = self.partitions.get(step)
        if cut is not None:  # every rank says it has entered the step (see the module docstring)
            self.channel.set(f"arrived/{cut.index}/rank{self.rank}", True)
        fault = self.own.get(step)
        if fault is not None and fault.kind is FaultKind.PARTITION:  # claimed (and timed) once all are in
            self.channel.wait([f"arrived/{fault.index}/rank{r}" for r in range(self.channel.world_size)])
        together = self.kills_together.get(step, []) if fault is not None and fault.kind is FaultKind.KILL else []
        if together:  # every rank of the kill is in the step before any dies (see the module docstring)
            self.channel.set(f"arrived/kill{step}/rank{self.rank}", True)
            try:
                self.channel.wait([f"arrived/kill{step}/rank{r}" for r in together])
            except TimeoutError:  # a partner that never comes (gone already): this rank dies alone
                pass
        if fault is None or not self._claim(fault):
            return None
        if fault.kind is FaultKind.PARTITION:
            self._partition()
            return None
        return fault

    @contextlib.contextmanager
    def fire(self, fault: Fault | None) -> Iterator[None]:
        """The armed fault inside the watched step: a collective that raises, a stall, a kill."""
        if fault is None:
            yield
            return
        if fault.kind is FaultKind.COLLECTIVE:
            with _RaiseOnCollective(
                fault.nth_op,
                f"injected fault {fault.index}: collective raised on rank {self.rank} at step {fault.step}",
                lambda: self._raised(fault),
            ):
                yield
            return
        if fault.kind is FaultKind.STALL:
            time.sleep(self.stall_s)
        elif fault.kind is FaultKind.KILL:
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault.kind is FaultKind.SILENT:
            os.kill(os.getpid(), signal.SIGSTOP)
        yield

    @contextlib.contextmanager
    def around_step(self, step: int) -> Iterator[None]:
        """:meth:`arm` and :meth:`fire` together (where nothing watches the step)."""
        with self.fire(self.arm(step)):
            yield

    def _partition(self) -> None:
        if not self.data_iface:
            raise MeshpactError("a partition fault needs MESHPACT_DATA_IFACE (the data link's interface)")
        subprocess.run(["ip", "link", "set", "dev", self.data_iface, "down"], check=True)
        subprocess.Popen(
            ["sh", "-c", f"sleep {self.down_s:.3f}; ip link set dev {self.data_iface} up"],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


def _raise_on_collective_mode() -> type:
    from torch.utils._python_dispatch import TorchDispatchMode

    class RaiseOnCollective(TorchDispatchMode):
        def __init__(self, nth: int, message: str, on_raise: Callable[[], None] | None) -> None:
            super().__init__()
            self.left = nth
            self.message = message
            self.on_raise = on_raise

        @classmethod
        def is_infra_mode(cls) -> bool:
            # dynamo runs a compiled frame eagerly under any other dispatch mode, and keeps doing
            # so after it: the injecting rank would leave compilation for good and its numbers
            # would part from the compiled reference. An infra mode still sees every eager op
            # (FSDP's collectives run eagerly between the compiled graphs).
            return True

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                self.left -= 1
                if self.left == 0:
                    if self.on_raise is not None:
                        self.on_raise()
                    raise CollectiveFault(self.message)
            return func(*args, **(kwargs or {}))

    return RaiseOnCollective


def _RaiseOnCollective(nth: int, message: str, on_raise: Callable[[], None] | None = None) -> Any:
    return _raise_on_collective_mode()(nth, message, on_raise)


# -- network namespaces ---------------------------------------------------------------------
def netns_unavailable() -> str | None:
    """Why partition faults cannot run here (root, ``ip``, namespaces, veth), or None if they can."""
    return netns.netns_unavailable(shaped=False)


class NetnsPair(netns.TwoHosts):
    """Two hosts for partition faults: an unshaped data link and a separate control link.

    Ranks split in halves: the lower half (and both stores) on ``ns[0]``. Leaving the
    ``with`` block deletes both namespaces and with them the links.
    """

    def __init__(self, tag: str | None = None) -> None:
        super().__init__(link=None, tag=tag, control=True)

    @property
    def data_ip(self) -> tuple[str, str]:
        return self.addr

    @property
    def ctrl_ip(self) -> tuple[str, str]:
        return self.ctrl_addr

    def side(self, rank: int, world_size: int) -> int:
        return 0 if rank < (world_size + 1) // 2 else 1

    def rank_env(self, rank: int, world_size: int) -> dict[str, str]:
        side = self.side(rank, world_size)
        return {
            "GLOO_SOCKET_IFNAME": self.iface[side],
            "MESHPACT_DATA_IFACE": self.iface[side],
            "MASTER_ADDR": self.addr[0],
            "MESHPACT_CONTROL_ADDR": self.ctrl_addr[0],
        }
