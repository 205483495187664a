"""Checkpoints: the baselines in-memory recovery is measured against.

:class:`Checkpointer` writes every rank's local state (its parameter shards and optimizer
state, as :func:`meshpact.live.recovery.state.job_state` lists them, generators included) every K steps, one file per
rank under ``step<N>/``, each written to a temporary name and renamed, so a checkpoint is
complete exactly when all ranks' files exist. Restoring in the job reloads the newest
complete checkpoint and replays the steps after it; a cold restart starts new processes
that do the same.

:class:`AsyncCheckpointer` measures the alternative of checkpointing after *every* update
without stalling the step: the state is copied into host buffers on the training thread
and written by a background thread. It reports the step-latency overhead, the host memory
the buffers take, and the storage written per hour at the measured step rate.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["Checkpointer", "AsyncCheckpointer", "AsyncCheckpointStats", "state_bytes"]


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class Checkpointer:
    def __init__(self, directory: str | os.PathLike[str], rank: int, world_size: int, every: int) -> None:
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1 step, got {every}")
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.every = every
        self.bytes_written = 0
        self.bytes_read = 0  # by load(): what restores cost in storage reads

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def path(self, step: int, rank: int | None = None) -> Path:
        return self.directory / f"step{step:08d}" / f"rank{self.rank if rank is None else rank}.pt"

    def save(self, step: int, state: dict[str, torch.Tensor]) -> int:
        """Write this rank's ``state`` for ``step`` atomically; returns the bytes written."""
        path = self.path(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save({k: v.detach().clone() for k, v in state.items()}, tmp)
        os.replace(tmp, path)
        size = path.stat().st_size
        self.bytes_written += size
        return size

    def complete(self, step: int) -> bool:
        return all(self.path(step, r).exists() for r in range(self.world_size))

    def latest(self, limit: int) -> int:
        """The newest complete checkpoint at or before ``limit`` (step 0 is always written first)."""
        steps = sorted((int(p.name[4:]) for p in self.directory.glob("step*") if p.name[4:].isdigit()), reverse=True)
        for step in steps:
            if step <= limit and self.complete(step):
                return step
        raise FileNotFoundError(f"no complete checkpoint at or before step {limit} in {self.directory}")

    def load(self, step: int) -> dict[str, torch.Tensor]:
        path = self.path(step)
        self.bytes_read += path.stat().st_size
        return torch.load(path, weights_only=True)


@dataclass(frozen=True)
class AsyncCheckpointStats:
    steps: int
    step_s_without: float  # median step latency, no checkpointing
    step_s_with: float  # median step latency, checkpoint after every update
    host_bytes: int  # host buffers held for the snapshot
    bytes_per_step: int
    write_s_mean: float

    @property
    def overhead(self) -> float:
        return self.step_s_with / self.step_s_without - 1.0 if self.step_s_without else 0.0

    @property
    def bytes_per_hour(self) -> float:
        return self.bytes_per_step * 3600.0 / self.step_s_with if self.step_s_with else 0.0

    def to_dict(self) -> dict:
        return {"steps": self.steps, "step_ms_without": self.step_s_without * 1e3,
                "step_ms_with": self.step_s_with * 1e3, "overhead": self.overhead,
                "host_bytes": self.host_bytes, "bytes_per_step": self.bytes_per_step,
                "storage_bytes_per_hour": self.bytes_per_hour, "write_ms_mean": self.write_s_mean * 1e3}


class AsyncCheckpointer:
    """Snapshot to host buffers on the training thread, write in the background (one in flight)."""

    def __init__(self, directory: str | os.PathLike[str], rank: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._buffers: dict[str, torch.Tensor] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self.writes: list[float] = []
        self.bytes_written = 0
        self._thread = threading.Thread(target=self._writer, name="meshpact-async-ckpt", daemon=True)
        self._thread.start()

    @property
    def host_bytes(self) -> int:
        return state_bytes(self._buffers)

    def snapshot(self, step: int, state: dict[str, torch.Tensor]) -> None:
        self._idle.wait()  # one snapshot in flight: the buffers are reused
        self._idle.clear()
        for k, v in state.items():
            buf = self._buffers.get(k)
            if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                self._buffers[k] = buf = torch.empty_like(v, device="cpu")
            buf.copy_(v.detach())
        self._queue.put(step)

    def _writer(self) -> None:
        while True:
            step = self._queue.get()
            if step is None:
                return
            t0 = time.perf_counter()
            path = self.directory / f"rank{self.rank}-latest.pt"
            tmp = path.with_name(path.name + ".tmp")
            torch.save(self._buffers, tmp)
            os.replace(tmp, path)
            self.bytes_written += path.stat().st_size
            self.writes.append(time.perf_counter() - t0)
            self._idle.set()

    def close(self) -> None:
        self._idle.wait()
        self._queue.put(None)
        self._thread.join(timeout=30)
