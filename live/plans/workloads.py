"""Workloads for live plan execution: a vocabulary-sharded LM head and a Qwen3-14B MLP slice.

Both run on the producer domain of a two-domain mesh and are read by the consumer domain.

* **LM head.** Hidden states ``x [tokens, hidden]`` times a vocabulary-sharded weight: producer
  rank *i* holds rows ``shard_bounds(vocab, n, i)`` of ``W [vocab, hidden]`` and computes its
  logits shard ``x @ W_i.T`` (``Shard(1)`` of ``logits [tokens, vocab]``). The consumer issues
  ``full``, ``logprob``, ``token`` or ``owner_token``.
* **MLP slice.** Qwen3's SwiGLU MLP, ``down(silu(gate(x)) * up(x))``: gate and up are
  column-parallel (rank *i* holds columns ``shard_bounds(intermediate, n, i)``), down is
  row-parallel, so each producer rank ends with a full-shaped partial sum of the output
  (``Partial(sum)``). The consumer ranks read activation shards of the completed output
  (``shard`` along the hidden dimension); the partials must be completed inside the producer
  domain before anything crosses.

Weights are random (seeded per shard, scaled by ``1/sqrt(fan_in)``), the sizes real. The
single-process reference (:func:`reference_producer`) computes the same per-shard products in
one process with one thread, so the reduction order of every element matches the producer
ranks' and a bitwise comparison is meaningful.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import os
import tempfile
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Iterator

import torch

from meshpact.core.facts import Consumer, DType, Edge, Mesh, ProducerTensor, Request
from meshpact.core.placement import Partial, Shard, shard_bounds

from .jobs import PRESETS, LiveRequest, Preset, get_preset

__all__ = [
    "LiveRequest",
    "Preset",
    "PRESETS",
    "get_preset",
    "workload_edge",
    "producer_local",
    "reference_producer",
    "logprob_ids",
    "TORCH_DTYPE",
]

TORCH_DTYPE: dict[DType, torch.dtype] = {
    DType.FLOAT32: torch.float32,
    DType.BFLOAT16: torch.bfloat16,
    DType.FLOAT16: torch.float16,
    DType.INT64: torch.int64,
    DType.INT32: torch.int32,
}


def logprob_ids(preset: Preset) -> tuple[int, ...]:
    """The token ids whose log-probabilities a ``logprob`` consumer reads, one per row."""
    g = torch.Generator().manual_seed(preset.seed + 101)
    return tuple(int(i) for i in torch.randint(0, preset.vocab, (preset.tokens,), generator=g))


def owners(preset: Preset, consumer_ranks: tuple[int, ...]) -> tuple[int, ...]:
    """Sequence ownership for ``owner_token``: row *r* belongs to consumer rank ``r mod n``."""
    return tuple(consumer_ranks[r % len(consumer_ranks)] for r in range(preset.tokens))


def workload_edge(request: LiveRequest | str, preset: Preset, mesh: Mesh) -> Edge:
    """The facts of one live run: the producer tensor on domain 0, the consumer on domain 1."""
    req = LiveRequest(request)
    prod, cons = mesh.domains[0], mesh.domains[1]
    if req.is_lm_head:
        producer = ProducerTensor("logits", "lm_head", (preset.tokens, preset.vocab), preset.dtype, prod.name, Shard(1))
        consumer = Consumer(
            f"{req.value}_reader",
            cons.name,
            cons.ranks,
            Request(req.value),
            owners=owners(preset, cons.ranks) if req is LiveRequest.OWNER_TOKEN else None,
        )
        what = f"LM head ({preset.name}) vocab-sharded over {prod.name}, read as {req.value} by {cons.name}"
    else:
        producer = ProducerTensor(
            "mlp_out", "mlp.down_proj", (preset.tokens, preset.hidden), preset.dtype, prod.name, Partial("sum")
        )
        consumer = Consumer("mlp_shard_reader", cons.name, cons.ranks, Request.SHARD, shard_dim=1)
        what = f"MLP slice ({preset.name}) row-parallel partials on {prod.name}, activation shards to {cons.name}"
    return Edge(f"live_{req.value}_{preset.name}", mesh, producer, consumer, description=what, source=preset.source)


def _randn(shape: tuple[int, ...], seed: int, dtype: torch.dtype, fan_in: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=dtype).mul_(1.0 / math.sqrt(fan_in))


def _hidden_states(preset: Preset) -> torch.Tensor:
    return _randn((preset.tokens, preset.hidden), preset.seed, TORCH_DTYPE[preset.dtype], 1)


def _lm_head_shard(preset: Preset, parts: int, index: int) -> torch.Tensor:
    lo, hi = shard_bounds(preset.vocab, parts, index)
    w = _randn((hi - lo, preset.hidden), preset.seed * 1000 + 1 + index, TORCH_DTYPE[preset.dtype], preset.hidden)
    return _hidden_states(preset) @ w.T


def _mlp_partial(preset: Preset, parts: int, index: int) -> torch.Tensor:
    dt = TORCH_DTYPE[preset.dtype]
    lo, hi = shard_bounds(preset.intermediate, parts, index)
    x = _hidden_states(preset)
    base = preset.seed * 1000 + 500 + 3 * index
    gate = x @ _randn((preset.hidden, hi - lo), base, dt, preset.hidden)
    up = x @ _randn((preset.hidden, hi - lo), base + 1, dt, preset.hidden)
    act = torch.nn.functional.silu(gate) * up
    return act @ _randn((hi - lo, preset.hidden), base + 2, dt, preset.intermediate)


def producer_local(request: str, preset_name: str, parts: int, index: int) -> torch.Tensor:
    """What producer rank ``index`` of ``parts`` holds: its logits shard or its MLP partial.

    Computed on the CPU (then moved to the rank's device by the caller), so that a CUDA or
    Ascend run is compared bit for bit against the same producer values as a CPU run: the
    verification judges the plan's communication, not a device's matmul.
    """
    return _producer_local(LiveRequest(request).is_lm_head, preset_name, parts, index)


@lru_cache(maxsize=8)
def _producer_local(lm_head: bool, preset_name: str, parts: int, index: int) -> torch.Tensor:
    preset = get_preset(preset_name)
    path = _cached_path(lm_head, preset, parts, index)
    if path.is_file():
        try:
            return torch.load(path, weights_only=True)
        except Exception:  # noqa: BLE001 (a file cut short by a full disk: computed again, written again)
            pass
    with _one_thread():
        value = _lm_head_shard(preset, parts, index) if lm_head else _mlp_partial(preset, parts, index)
    with contextlib.suppress(OSError):  # an unwritable temp dir only costs the next process the same work
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        torch.save(value, tmp)
        os.replace(tmp, path)  # whole or absent: a concurrent rank never reads half a file
    return value


def _cached_path(lm_head: bool, preset: Preset, parts: int, index: int) -> Path:
    """Where a producer piece is kept between processes. The piece is small (a few rows of logits or
    of an MLP output) but its weights are not: a Qwen3-14B vocabulary shard is 0.4-0.8 G values drawn
    on one thread, again in every rank process and in the verifying parent of every job. The name
    holds everything the value follows from: the preset's fields, the split, torch's version, and
    the source of the functions that compute it (an edited generator is never served stale)."""
    code = "".join(inspect.getsource(f) for f in (_randn, _hidden_states, _lm_head_shard, _mlp_partial))
    key = hashlib.sha256(f"{preset!r}|{parts}|{index}|{lm_head}|{torch.__version__}|{code}".encode()).hexdigest()[:24]
    return Path(tempfile.gettempdir()) / "meshpact-producer-pieces" / f"{preset.name}-{key}.pt"


def reference_producer(request: str, preset_name: str, parts: int) -> torch.Tensor:
    """The producer tensor's logical value, computed in this one process on one thread.

    Logits: the shards side by side (each logit one dot product, same shapes as on the
    ranks). MLP: the partials summed in rank order, ``((p0 + p1) + p2) ...``. Every piece is
    computed here by :func:`producer_local`'s code (a piece this process already computed as a
    producer rank is reused, not recomputed).
    """
    return _reference_producer(LiveRequest(request).is_lm_head, preset_name, parts)


@lru_cache(maxsize=2)
def _reference_producer(lm_head: bool, preset_name: str, parts: int) -> torch.Tensor:
    pieces = [_producer_local(lm_head, preset_name, parts, i) for i in range(parts)]
    if lm_head:
        return torch.cat(pieces, dim=1)
    total = pieces[0]
    for p in pieces[1:]:
        total = total + p
    return total


@contextmanager
def _one_thread() -> Iterator[None]:
    """Products on one CPU thread, in the ranks and in the reference alike (one reduction order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
