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

The serving loops run :class:`PartStep` instead: a pure function of a decoder part's
inputs, positions and the running slots' caches (gathered by the caller) that returns the
part's output and the new key/value rows, so the :class:`Decoder` keeps its caches, its
eager prefill and its slot bookkeeping, and the batch size is a dynamic dimension (one
package per part and tokens per step, whatever the batch). :class:`CompiledSteps` compiles
each (part, tokens per step) once into a package cached on disk under a directory keyed by
the weights' digest, and :meth:`CompiledSteps.attach` makes a decoder run its steps
(:meth:`Decoder.step`, :meth:`Decoder.step_part`, :meth:`Decoder.score`) through them.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from meshpact.core.errors import MeshpactError

from .decoder import Decoder, Part, rms_norm, rotary

__all__ = [
    "StepModule",
    "PartStep",
    "CompiledSteps",
    "compile_step",
    "load_step",
    "step_latency",
    "weights_digest",
    "BATCH_LIMIT",
]

BATCH_LIMIT = 256  # the dynamic batch dimension's upper bound in every package
# AOTInductor's precompiled headers pay off over many builds sharing one cache; a run builds a
# package or two, each from a cold cache on a fresh machine: the two packages of the split run
# took 54-58 s to build without them and 66 s with them (2 cores, quiet). The code built is the same.
# The wrapper (the C++ that calls the kernels, not the kernels) is built at -O0: one part of the
# moe split took 36-38 s to build against 46 s at torch's default -O1 (2 cores, load 6-8), and its
# decode step ran within the same noise (0.21-0.36 ms against 0.30 ms).
_BUILD = {"aot_inductor.precompile_headers": False, "aot_inductor.compile_wrapper_opt_level": "O0"}


def exportable_mlp(spec: Any, w: Callable[[str], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A layer's MLP without data-dependent shapes: SwiGLU, or for a routed layer every expert
    on every row weighted by the router's renormalised top-k (zero elsewhere). ``w(name)``
    is the layer's weight ``name``."""
    if not spec.experts:
        return (F.silu(x @ w("gate").T) * (x @ w("up").T)) @ w("down").T
    weights, chosen = torch.topk(torch.softmax(x @ w("router").T, dim=-1), spec.experts_per_token)
    weights = weights / weights.sum(-1, keepdim=True)
    dense = torch.zeros(*x.shape[:-1], spec.experts, dtype=x.dtype).scatter(-1, chosen, weights)
    out = torch.zeros_like(x)
    for e in range(spec.experts):
        y = (F.silu(x @ w("gate")[e].T) * (x @ w("up")[e].T)) @ w("down")[e].T
        out = out + y * dense[..., e : e + 1]
    return out


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
        return exportable_mlp(self.spec, lambda name: self._w(i, name), h)

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
            att = F.scaled_dot_product_attention(
                q, self.k[i].repeat_interleave(rep, dim=1), self.v[i].repeat_interleave(rep, dim=1), attn_mask=mask
            )
            x = x + att.transpose(1, 2).reshape(b, 1, s.heads * s.head_dim) @ self._w(i, "wo").T
            x = x + self._mlp(i, rms_norm(x, self._w(i, "ln2")))
        return rms_norm(x, self.norm)[:, 0] @ self.head.T


def compile_step(module: StepModule, package: Path) -> Path:
    """Export ``module`` for its batch size and compile it ahead of time into ``package`` (.pt2)."""
    ids = torch.zeros(module.batch, dtype=torch.long)
    pos = torch.zeros(module.batch, dtype=torch.long)
    with torch.no_grad():
        exported = torch.export.export(module, (ids, pos))
        with torch._inductor.config.patch(_BUILD):
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


class PartStep(torch.nn.Module):
    """A decode step of ``part`` of ``decoder`` as a pure function, for ``tokens`` new positions per row:

    ``forward(inputs, pos, k, v) -> (out, k_new, v_new)`` with ``inputs`` the token ids
    ``[b, t]`` (a part that embeds) or the previous part's hidden states ``[b, t, hidden]``
    (bfloat16), ``pos [b, t]`` their positions, ``k``/``v`` the running slots' caches of the
    part's layers ``[layers, b, kv_heads, max_len, head_dim]``; ``out`` is the float32 logits
    ``[b, t, vocab]`` (a part with the head) or the hidden states ``[b, t, hidden]``
    (bfloat16), and ``k_new``/``v_new`` ``[layers, b, kv_heads, t, head_dim]`` the rows the
    caller writes into its caches at ``pos``. The same operations as :meth:`Decoder._part`
    in the same order; attention reads every cache position, masked beyond ``pos``."""

    def __init__(self, decoder: Decoder, part: Part, tokens: int) -> None:
        super().__init__()
        self.spec, self.part, self.tokens, self.max_len = decoder.spec, part, tokens, decoder.max_len
        if part.embeds:
            self.embed = torch.nn.Buffer(decoder.embed.clone())
        if part.has_head:
            self.head = torch.nn.Buffer(decoder.head.clone())
            self.norm = torch.nn.Buffer(decoder.norm.clone())
        for i in range(part.first, part.last):
            for name, w in decoder.layers[i].items():
                self.register_buffer(f"l{i}_{name}", w.clone())

    def _w(self, i: int, name: str) -> torch.Tensor:
        return getattr(self, f"l{i}_{name}")

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return exportable_mlp(self.spec, lambda name: self._w(i, name), x)

    def forward(
        self, inputs: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s, part = self.spec, self.part
        b, t = pos.shape
        x = self.embed[inputs] if part.embeds else inputs.to(torch.float32)
        mask = torch.arange(self.max_len)[None, None, None, :] <= pos[:, None, :, None]
        where = pos[:, None, :, None].expand(b, s.kv_heads, t, s.head_dim)
        rep = s.heads // s.kv_heads
        ks, vs = [], []
        for j, i in enumerate(range(part.first, part.last)):
            h = rms_norm(x, self._w(i, "ln1"))
            q = (h @ self._w(i, "wq").T).view(b, t, s.heads, s.head_dim).transpose(1, 2)
            kn = (h @ self._w(i, "wk").T).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
            vn = (h @ self._w(i, "wv").T).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
            q, kn = rotary(q, pos[:, None, :]), rotary(kn, pos[:, None, :])
            keys = k[j].scatter(2, where, kn).repeat_interleave(rep, dim=1)
            vals = v[j].scatter(2, where, vn).repeat_interleave(rep, dim=1)
            att = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
            x = x + att.transpose(1, 2).reshape(b, t, s.heads * s.head_dim) @ self._w(i, "wo").T
            x = x + self._mlp(i, rms_norm(x, self._w(i, "ln2")))
            ks.append(kn)
            vs.append(vn)
        out = rms_norm(x, self.norm) @ self.head.T if part.has_head else x.to(torch.bfloat16)
        return out, torch.stack(ks), torch.stack(vs)


def weights_digest(decoder: Decoder, part: Part) -> str:
    """A fingerprint of the weights ``part`` of ``decoder`` reads (a package bakes them in)."""
    h = hashlib.blake2b(digest_size=8)
    tensors = ([decoder.embed] if part.embeds else []) + ([decoder.head, decoder.norm] if part.has_head else [])
    tensors += [decoder.layers[i][n] for i in range(part.first, part.last) for n in sorted(decoder.layers[i])]
    for x in tensors:
        h.update(x.contiguous().numpy().tobytes())
    return h.hexdigest()


class CompiledSteps:
    """AOTInductor packages of a decoder's :class:`PartStep` per (part, tokens per step), cached on disk.

    A package lives at ``root/<family>-l<first>-<last>-t<tokens>-len<max_len>-<weights digest>.pt2``:
    compiled the first time it is asked for (:meth:`ensure`, in the parent before a run
    starts), loaded by each host (:meth:`attach`). The batch is a dynamic dimension
    (1 .. :data:`BATCH_LIMIT`)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.compile_s = 0.0  # seconds spent compiling in this process (0 when every package was cached)

    def path(self, decoder: Decoder, part: Part, tokens: int) -> Path:
        return self.root / (
            f"{decoder.spec.family}-l{part.first}-{part.last}-t{tokens}-len{decoder.max_len}-"
            f"{weights_digest(decoder, part)}.pt2"
        )

    def ensure(self, decoder: Decoder, part: Part, tokens: int) -> Path:
        """The package for ``part`` with ``tokens`` positions per step, compiled now if not on disk."""
        path = self.path(decoder, part, tokens)
        if path.exists():
            return path
        self.root.mkdir(parents=True, exist_ok=True)
        module = PartStep(decoder, part, tokens).eval()
        b = 2  # an example batch above 1: a batch of 1 would be specialised
        s = decoder.spec
        ids = (
            torch.zeros(b, tokens, dtype=torch.long)
            if part.embeds
            else torch.zeros(b, tokens, s.hidden, dtype=torch.bfloat16)
        )
        pos = torch.arange(tokens).repeat(b, 1)
        k = torch.zeros(part.last - part.first, b, s.kv_heads, decoder.max_len, s.head_dim)
        batch = torch.export.Dim("batch", min=1, max=BATCH_LIMIT)
        dyn = ({0: batch}, {0: batch}, {1: batch}, {1: batch})
        t0 = time.perf_counter()
        tmp = path.with_suffix(f".{time.time_ns()}.tmp.pt2")
        with torch.no_grad():
            exported = torch.export.export(module, (ids, pos, k, k.clone()), dynamic_shapes=dyn)
            with torch._inductor.config.patch(_BUILD):
                torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp))
        tmp.replace(path)  # whole or absent: a concurrent run never loads half a package
        self.compile_s += time.perf_counter() - t0
        return path

    def attach(self, decoder: Decoder, parts: Sequence[tuple[Part, int]]) -> None:
        """Make ``decoder`` run its steps of each (part, tokens per step) through the packages
        (compiled here if a package is missing)."""
        runners = {(p.first, p.last, t): load_step(self.ensure(decoder, p, t)) for p, t in parts}
        decoder.compiled = _Runner(runners)


class _Runner:
    """The loaded packages of one decoder, called by :meth:`Decoder._run_step`."""

    def __init__(self, runners: dict[tuple[int, int, int], Callable[..., Any]]) -> None:
        self.runners = runners

    def __call__(
        self, decoder: Decoder, part: Part, inputs: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        key = (part.first, part.last, int(pos.shape[1]))
        run = self.runners.get(key)
        if run is None:
            raise MeshpactError(
                f"no compiled step for layers [{part.first}, {part.last}) with {key[2]} token(s) "
                f"per step; compiled: {sorted(self.runners)}"
            )
        layers = slice(part.first, part.last)
        out, k_new, v_new = run(
            inputs.contiguous(),
            pos.contiguous(),
            decoder.k[layers, slots].contiguous(),
            decoder.v[layers, slots].contiguous(),
        )
        rows = slots[:, None].expand_as(pos)
        # advanced indices apart (rows, pos) put their [b, t] first: [b, t, layers, kv_heads, head_dim]
        decoder.k[layers, rows, :, pos] = k_new.permute(1, 3, 0, 2, 4)
        decoder.v[layers, rows, :, pos] = v_new.permute(1, 3, 0, 2, 4)
        return out
