"""Compiled decode steps: one family's step as a module AOTInductor can compile ahead of time.

:class:`Decoder` runs a step as Python over tensors: a loop per batch row to write the
key/value cache, a loop over the experts that a token chose. :class:`StepModule` is the
same step written for ``torch.export``: the caches are buffers updated in place through a
one-hot mask of each row's position, and a routed layer runs every expert and weights
them with the router's top-k (the others weigh zero), so the graph has no data-dependent
shapes. :func:`compile_step` exports it for a batch size and packages it with
``torch._inductor.aoti_compile_and_package``; :func:`load_step` loads the package.
:func:`step_latency` times one step of either. The decoders' weights are the same seeded
weights (:class:`Decoder` builds them), so the compiled step computes the same logits up to
float rounding (checked in the tests against :meth:`Decoder.step`).

The serving loops run :class:`Decoder` (eager); wiring a compiled step into them is not
done here.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .decoder import Decoder, rms_norm, rotary

__all__ = ["StepModule", "compile_step", "load_step", "step_latency"]


class StepModule(torch.nn.Module):
    """One decode step of ``decoder``'s weights for ``batch`` sequences (slot ``j`` is row ``j``):
    ``forward(ids [batch], pos [batch]) -> logits [batch, vocab]`` (float32)."""

    def __init__(self, decoder: Decoder, batch: int) -> None:
        super().__init__()
        s = decoder.spec
        self.spec, self.batch, self.max_len = s, batch, decoder.max_len
        self.embed = torch.nn.Buffer(decoder.embed.clone())
        self.head = torch.nn.Buffer(decoder.head.clone())
        self.norm = torch.nn.Buffer(decoder.norm.clone())
        self.names: list[list[str]] = []
        for i, layer in enumerate(decoder.layers):
            self.names.append(sorted(layer))
            for name, w in layer.items():
                self.register_buffer(f"l{i}_{name}", w.clone())
        self.k = torch.nn.Buffer(torch.zeros(s.layers, batch, s.kv_heads, decoder.max_len, s.head_dim))
        self.v = torch.nn.Buffer(torch.zeros_like(self.k))

    def _w(self, i: int, name: str) -> torch.Tensor:
        return getattr(self, f"l{i}_{name}")

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if not s.experts:
            return (F.silu(h @ self._w(i, "gate").T) * (h @ self._w(i, "up").T)) @ self._w(i, "down").T
        probs = torch.softmax(h @ self._w(i, "router").T, dim=-1)
        top, idx = torch.topk(probs, s.experts_per_token)
        weights = torch.zeros_like(probs).scatter(-1, idx, top / top.sum(-1, keepdim=True))
        out = torch.zeros_like(h)
        for e in range(s.experts):
            y = (F.silu(h @ self._w(i, "gate")[e].T) * (h @ self._w(i, "up")[e].T)) @ self._w(i, "down")[e].T
            out = out + y * weights[..., e:e + 1]
        return out

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        s = self.spec
        b = ids.shape[0]
        x = self.embed[ids][:, None]
        at = (torch.arange(self.max_len)[None, :] == pos[:, None]).to(x.dtype)[:, None, :, None]
        mask = torch.arange(self.max_len)[None, None, None, :] <= pos[:, None, None, None]
        for i in range(s.layers):
            h = rms_norm(x, self._w(i, "ln1"))
            q = (h @ self._w(i, "wq").T).view(b, 1, s.heads, s.head_dim).transpose(1, 2)
            k = (h @ self._w(i, "wk").T).view(b, 1, s.kv_heads, s.head_dim).transpose(1, 2)
            v = (h @ self._w(i, "wv").T).view(b, 1, s.kv_heads, s.head_dim).transpose(1, 2)
            q, k = rotary(q, pos[:, None, None]), rotary(k, pos[:, None, None])
            self.k[i].mul_(1 - at).add_(at * k)
            self.v[i].mul_(1 - at).add_(at * v)
            rep = s.heads // s.kv_heads
            att = F.scaled_dot_product_attention(q, self.k[i].repeat_interleave(rep, dim=1),
                                                 self.v[i].repeat_interleave(rep, dim=1), attn_mask=mask)
            x = x + att.transpose(1, 2).reshape(b, 1, s.heads * s.head_dim) @ self._w(i, "wo").T
            x = x + self._mlp(i, rms_norm(x, self._w(i, "ln2")))
        return rms_norm(x, self.norm)[:, 0] @ self.head.T


def compile_step(module: StepModule, package: Path) -> Path:
    """Export ``module`` for its batch size and compile it ahead of time into ``package`` (.pt2)."""
    ids = torch.zeros(module.batch, dtype=torch.long)
    pos = torch.zeros(module.batch, dtype=torch.long)
    with torch.no_grad():
        exported = torch.export.export(module, (ids, pos))
        return Path(torch._inductor.aoti_compile_and_package(exported, package_path=str(package)))


def load_step(package: Path) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The compiled step from ``package`` (its caches live inside the package's runner)."""
    return torch._inductor.aoti_load_package(str(package))


def step_latency(step: Callable[..., Any], batch: int, vocab: int, steps: int = 20, warmup: int = 3) -> float:
    """Mean seconds per decode step of ``step(ids, pos)`` over ``steps`` consecutive positions."""
    ids = torch.randint(0, vocab, (batch,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for i in range(warmup):
            step(ids, torch.full((batch,), i, dtype=torch.long))
        t0 = time.perf_counter()
        for i in range(steps):
            step(ids, torch.full((batch,), warmup + i, dtype=torch.long))
    return (time.perf_counter() - t0) / steps
