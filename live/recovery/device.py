"""The device side of a recovery: what a GPU job needs that a CPU job does not.

On gloo and the CPU, host order is device order: a collective that fails raises on the
training thread, a tensor copied is copied, and the process's CPU time is its progress. On
CUDA none of that holds. NCCL kernels run on streams the host only enqueues to; a failed
collective leaves a kernel spinning on the device while the host runs ahead; a ``.cpu()`` on
the default stream waits behind that kernel; and NCCL traffic never passes through a socket
that the gloo path's sever could shut down. Each primitive here is the device-correct form of
a step the runtime already takes, chosen by capability detection (:func:`device_ops`):

| step | CPU / gloo | CUDA / NCCL |
|---|---|---|
| sever a broken data path | shut down its sockets (:mod:`.communicator`) | :func:`abort_groups`: the process group's ``abort()``, the process kept |
| the watchdog on a timeout | none | ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``: abort the communicator, keep the process (:func:`nccl_worker_env`) |
| retire a replaced group | drop the reference | :func:`abort_groups` (a NCCL communicator's destructor does not abort) |
| know a step's device work is done | it is, when the host returns | :class:`StepFence`: an event recorded after the optimizer step, queried, never a device synchronize |
| read the state (a commit mark, a detection's check) | on the host | :func:`on_side_stream`: a side stream, never behind the training stream's queue |
| snapshot for peer copies | ``torch._foreach_copy_`` into host buffers | :class:`PinnedSnapshot`: pinned buffers, async copies on a side stream after the fence |
| heartbeat progress | the process's CPU time | :class:`DeviceProgress`: fences completed |
| bit-identical replay | deterministic already | :func:`deterministic`: deterministic algorithms and the cuBLAS workspace setting |

None of the CUDA column has run on a GPU in this project's tests: each branch is reached on the
CPU through :class:`DeviceOps` with fake events and streams that record the calls and their
order (``tests/live/test_device.py``), and ``bench/gpu_check.py`` measures them on one GPU.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, MutableMapping, Protocol, Sequence

import torch
import torch.distributed as dist

__all__ = [
    "DeviceOps",
    "HostOps",
    "CudaOps",
    "device_ops",
    "StepFence",
    "StepAborted",
    "PinnedSnapshot",
    "DeviceProgress",
    "on_side_stream",
    "training_now",
    "abort_groups",
    "nccl_worker_env",
    "deterministic",
    "Determinism",
    "NCCL_ABORT_ONLY",
    "CUBLAS_WORKSPACE",
]

# TORCH_NCCL_ASYNC_ERROR_HANDLING=2: "only abort NCCL communicator" on an error the watchdog sees
# (PyTorch's ProcessGroupNCCL environment variables, docs/source/torch_nccl_environment_variables.md);
# 1, torchrun's default, also tears the process down, and with it the peer copies it holds
NCCL_ABORT_ONLY = "2"
# cuBLAS is deterministic only with a fixed workspace (CUDA's cuBLAS documentation, "Results
# reproducibility"; PyTorch's torch.use_deterministic_algorithms names the same setting)
CUBLAS_WORKSPACE = ":4096:8"


class Event(Protocol):
    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: ...


class DeviceOps(Protocol):
    """What the runtime asks of a device. :class:`HostOps` on the CPU, :class:`CudaOps` on CUDA;
    a test passes one that records the calls."""

    kind: str
    reader: Any  # the side stream reads of the state go to (:func:`on_side_stream`), made there once

    def event(self) -> Event: ...
    def side_stream(self) -> Any: ...
    def current_stream(self) -> Any: ...
    def stream_context(self, stream: Any) -> Any: ...
    def wait_event(self, stream: Any, event: Event) -> None: ...
    def host_buffer(self, like: torch.Tensor) -> torch.Tensor: ...


class _DoneEvent:
    """The CPU's event: the host's work is the device's, so it is complete once recorded."""

    def record(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True


class _NoStream:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@dataclass
class HostOps:
    kind: str = "cpu"
    reader: Any = None

    def event(self) -> Event:
        return _DoneEvent()

    def side_stream(self) -> Any:
        return None

    def current_stream(self) -> Any:
        return None

    def stream_context(self, stream: Any) -> Any:
        return _NoStream()

    def wait_event(self, stream: Any, event: Event) -> None:
        return None

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype)


@dataclass
class CudaOps:
    """CUDA through ``torch.cuda`` (or a module of the same shape, in a test)."""

    cuda: Any = None
    kind: str = "cuda"
    reader: Any = None  # the side stream reads of the state go to (on_side_stream)

    def __post_init__(self) -> None:
        if self.cuda is None:
            self.cuda = torch.cuda

    def event(self) -> Event:
        return self.cuda.Event()

    def side_stream(self) -> Any:
        return self.cuda.Stream()

    def current_stream(self) -> Any:
        return self.cuda.current_stream()

    def stream_context(self, stream: Any) -> Any:
        return self.cuda.stream(stream)

    def wait_event(self, stream: Any, event: Event) -> None:
        stream.wait_event(event)

    def host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)


def on_side_stream(ops: DeviceOps, after: Event | None = None) -> Any:
    """A context in which the work the host enqueues goes to a side stream of ``ops``'s own (made
    once, kept on ``ops``), never the training stream: a detection's read of the state there does
    not queue behind a kernel hung on the training stream. ``after``: an event of the training
    stream the side stream first waits for (a commit mark: the step's fence, so the read sees the
    state as the optimizer step left it and never waits for a collective enqueued after it). On
    the CPU a context that does nothing."""
    if ops.kind != "cuda":
        return _NoStream()
    if ops.reader is None:
        ops.reader = ops.side_stream()
    if after is not None:
        ops.wait_event(ops.reader, after)
    return ops.stream_context(ops.reader)


def training_now(ops: DeviceOps) -> Event:
    """An event recorded on the training stream now: what the host enqueued so far comes before it."""
    event = ops.event()
    event.record(ops.current_stream())
    return event


def device_ops(device: str | torch.device) -> DeviceOps:
    """The ops for ``device`` ("cpu", "cuda:0", ...): chosen by what the device is, never guessed."""
    kind = torch.device(device).type
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"device {device!s} asked for, but torch.cuda finds no CUDA device; a GPU job needs "
                "a CUDA build of torch and a visible device (CUDA_VISIBLE_DEVICES)"
            )
        return CudaOps()
    return HostOps(kind=kind)


class StepAborted(dist.DistError):
    """A step's device work was not known complete within its bound, or the data path was
    aborted under it: a communication fault (its step is recovered and run again, never
    committed)."""


class StepFence:
    """Whether a step's device work has completed, asked without waiting for the device.

    The runtime records the fence after the optimizer step (:meth:`record`) and commits the step
    only once :meth:`done` is true: a step whose collective was aborted leaves its kernels unfinished
    or is marked :meth:`fail`-ed by the abort (an aborted NCCL kernel returns, and an event recorded
    behind it would then complete), and is never committed. :meth:`wait` polls, so a hung kernel
    costs the caller its bound and nothing more; nothing here synchronizes the device."""

    def __init__(self, ops: DeviceOps) -> None:
        self.ops = ops
        self.event: Event | None = None
        self.step = -1
        self.failed = False

    def record(self, step: int) -> None:
        self.event = self.ops.event()
        self.event.record(self.ops.current_stream())
        self.step = step

    def fail(self) -> None:
        """The data path was aborted before this fence was found done: it never counts as done."""
        self.failed = True

    def done(self) -> bool:
        return not self.failed and self.event is not None and bool(self.event.query())

    def wait(self, timeout_s: float, poll_s: float = 0.0005) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.done():
            if self.failed or time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True


@dataclass
class PinnedSnapshot:
    """A step's state copied to host buffers for peer copies, off the training thread's path.

    The buffers are allocated once per layout (pinned on CUDA); :meth:`start` enqueues the copies on
    a side stream that first waits on the step's fence, so the training thread only enqueues;
    :meth:`ready` says whether they landed (an event, not a synchronize), and the shipper sends the
    buffers once it is true. The copies read the live tensors after the step, so the next step
    must not write them before the copies land: :meth:`protect` makes the training stream wait on
    them (a device-side wait, the host does not block) before the next in-place write of the state
    (the next optimizer update; the next forward where the state holds buffers it updates).
    ``buffers`` may be set by the caller (views of one host slab): kept while their shapes fit."""

    ops: DeviceOps
    buffers: list[torch.Tensor] = field(default_factory=list)
    stream: Any = None
    copied: Event | None = None
    step: int = -1
    protected: bool = True  # the training stream waits on ``copied`` already (or no copy is in flight)

    def _fit(self, tensors: Sequence[torch.Tensor]) -> None:
        if len(self.buffers) != len(tensors) or any(
            b.shape != t.shape or b.dtype != t.dtype for b, t in zip(self.buffers, tensors)
        ):
            self.buffers = [self.ops.host_buffer(t) for t in tensors]

    def start(self, step: int, tensors: Sequence[torch.Tensor], fence: StepFence) -> None:
        if fence.event is None or fence.step != step:
            raise RuntimeError(
                f"snapshot of step {step} started before that step's fence was recorded "
                f"(the fence holds step {fence.step}): its copies could read a step still running"
            )
        self._fit(tensors)
        if self.stream is None:
            self.stream = self.ops.side_stream()
        self.ops.wait_event(self.stream, fence.event)
        with self.ops.stream_context(self.stream):
            if self.ops.kind == "cuda":
                for b, t in zip(self.buffers, tensors):
                    b.copy_(t.detach(), non_blocking=True)
            elif self.buffers:
                torch._foreach_copy_(self.buffers, [t.detach() for t in tensors])
            self.copied = self.ops.event()
            self.copied.record(self.stream)
        self.step = step
        self.protected = False

    def ready(self) -> bool:
        return self.copied is not None and bool(self.copied.query())

    def protect(self) -> None:
        """Order the training stream's next work after this snapshot's copies (once per snapshot):
        without it an in-place optimizer update could overwrite a tensor the side stream has not
        copied yet, and the copy would mix two steps."""
        if self.protected or self.copied is None:
            return
        self.ops.wait_event(self.ops.current_stream(), self.copied)
        self.protected = True


class DeviceProgress:
    """The heartbeat's progress count on a device: steps whose device work completed.

    A rank spinning in a CUDA call behind a hung kernel uses CPU time but completes no fence; the
    heartbeat reads :meth:`count`, which moves only when a recorded fence is found done. The
    training thread tracks fences and the heartbeat's thread counts them (and may abort the data
    path, :meth:`fail_running`): a lock orders them."""

    def __init__(self) -> None:
        self._fences: list[StepFence] = []
        self._lock = threading.Lock()
        self.completed = 0

    def track(self, fence: StepFence) -> None:
        """Track ``fence``; those found done or failed meanwhile are let go here too, so the list
        stays as short as the steps in flight where nothing else counts (no heartbeat, the CPU)."""
        with self._lock:
            self._sweep()
            self._fences.append(fence)

    def count(self) -> int:
        with self._lock:
            self._sweep()
            return self.completed

    def _sweep(self) -> None:
        still = []
        for f in self._fences:
            if f.done():
                self.completed += 1
            elif not f.failed:
                still.append(f)
        self._fences = still

    def fail_running(self) -> int:
        """Mark every tracked fence not found done as failed (called before the data path is
        aborted: after the abort its kernels return and the fences would complete). Returns how many."""
        with self._lock:
            n = 0
            for f in self._fences:
                if not f.done():
                    f.fail()
                    n += 1
            return n


def abort_groups(
    groups: Iterable[dist.ProcessGroup], backend: str, abort: Callable[[dist.ProcessGroup], None] | None = None
) -> int:
    """Abort every group in ``groups`` where the backend's traffic passes no socket the sever could
    shut down (NCCL): each group's communicators are aborted, the process and its memory kept.
    Returns how many were aborted; on gloo none (its sever and drain end the traffic)."""
    if backend != "nccl":
        return 0
    act = abort or (lambda pg: pg.abort())
    n = 0
    for pg in groups:
        act(pg)
        n += 1
    return n


def nccl_worker_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment a worker's NCCL needs for a recovery that keeps the process: the watchdog
    aborts a failed communicator but does not tear the process down. A value the user set is kept
    unless it is the tear-down one, which would lose the peer copies the process holds."""
    current = (env or {}).get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "")
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": current if current in ("0", NCCL_ABORT_ONLY) else NCCL_ABORT_ONLY}


@dataclass(frozen=True)
class Determinism:
    on: bool
    said: str


def deterministic(
    bit_identical: bool,
    device_type: str,
    env: MutableMapping[str, str] | None = None,
    cuda_initialized: Callable[[], bool] | None = None,
) -> Determinism:
    """Turn on deterministic algorithms where the job asks for bit-identical recovery, and say so.

    On CUDA the cuBLAS workspace must be fixed before cuBLAS starts: where the process already
    initialized CUDA without it, this refuses in one line rather than claim a bit-identity it
    cannot give."""
    env = os.environ if env is None else env
    if not bit_identical:
        return Determinism(False, "bit-identical recovery not asked for: deterministic algorithms left as they are")
    if device_type != "cuda":
        return Determinism(
            True, f"{device_type}: the kernels a replay runs are the same kernels in the same order; nothing to turn on"
        )
    if env.get("CUBLAS_WORKSPACE_CONFIG") not in (CUBLAS_WORKSPACE, ":16:8"):
        if (cuda_initialized or torch.cuda.is_initialized)():
            raise RuntimeError(
                "bit-identical recovery on CUDA needs CUBLAS_WORKSPACE_CONFIG=:4096:8 set before "
                "CUDA starts; set it in the launch environment, or start the session first"
            )
        env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    return Determinism(
        True,
        f"deterministic algorithms on (cuda, CUBLAS_WORKSPACE_CONFIG="
        f"{env['CUBLAS_WORKSPACE_CONFIG']}) for bit-identical recovery",
    )
