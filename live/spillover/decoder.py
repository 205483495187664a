"""Small decoders with the real vocabularies of three model families, for live serving.

:func:`scaled_spec` keeps what decides the size of a result crossing a link, the
vocabulary, exactly as the catalog's published ``config.json`` gives it (Qwen3-14B and
Qwen3-30B-A3B: 151,936; MiniMax-M2: 200,064), keeps each family's shape (dense SwiGLU
MLP; a routed expert layer for the MoE families; grouped-query attention with the
family's ratio of query to key/value heads) and scales depth and width down by one rule,
so a decode step on one CPU thread takes milliseconds. Weights are random and seeded.

:class:`Decoder` keeps a key/value cache per slot: :meth:`Decoder.prefill` fills a slot's
cache from a prompt, :meth:`Decoder.step` runs one decode step for any set of slots at
once (a batch) and returns logits ``[batch, vocab]``.

Split by layers (the model deployment), a host runs one :class:`Part` of the decoder:
:meth:`Decoder.prefill_part` and :meth:`Decoder.step_part` take token ids (the first part)
or the previous part's hidden states and return hidden states (bfloat16, what crosses to
the next host) or, for the last part, the LM head's logits. Every host builds the same
seeded weights and keeps the ones its part needs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from meshpact.core.catalog import get_model
from meshpact.core.errors import MeshpactError
from meshpact.core.jsonform import JsonObject

__all__ = ["FAMILIES", "DecoderSpec", "scaled_spec", "Decoder", "Part", "split_parts", "rms_norm", "rotary"]

# Family -> catalog model (the Hugging Face config.json each catalog entry names).
FAMILIES: dict[str, str] = {"dense": "qwen3-14b", "moe": "qwen3-30b-a3b", "minimax": "minimax-m2"}

# Hidden and intermediate sizes are divided by this, so a decode step of a batch on one CPU
# thread takes about what a GPU decode step of the full model takes (10-30 ms): the ratio
# of compute to the link time of a step's full logits is then of the real deployment's order.
WIDTH_DIVISOR = 64
LAYERS = 2
HEAD_DIM = 32
EXPERTS = 8  # routed experts kept per MoE layer
EXPERTS_PER_TOKEN = 2


@dataclass(frozen=True)
class DecoderSpec:
    family: str
    source: str  # the catalog model whose shape this scales
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (0 for MoE layers)
    experts: int
    experts_per_token: int
    expert_intermediate: int

    def to_dict(self) -> JsonObject:
        return asdict(self)


def scaled_spec(family: str) -> DecoderSpec:
    """The family's catalog model with its vocabulary kept and depth and width scaled down."""
    if family not in FAMILIES:
        raise MeshpactError(f"model {family!r}: expected one of {', '.join(FAMILIES)}")
    m = get_model(FAMILIES[family])
    hidden = max(HEAD_DIM, m.hidden_size // WIDTH_DIVISOR)
    heads = max(1, hidden // HEAD_DIM)
    kv = max(1, heads * m.num_kv_heads // m.num_heads)
    while heads % kv:
        kv -= 1
    moe = m.is_moe
    return DecoderSpec(
        family=family,
        source=m.name,
        vocab_size=m.vocab_size,
        hidden=hidden,
        layers=LAYERS,
        heads=heads,
        kv_heads=kv,
        head_dim=HEAD_DIM,
        intermediate=0 if moe else m.intermediate_size // WIDTH_DIVISOR,
        experts=min(EXPERTS, m.num_experts) if moe else 0,
        experts_per_token=min(EXPERTS_PER_TOKEN, m.experts_per_token) if moe else 0,
        expert_intermediate=max(8, m.moe_intermediate_size // WIDTH_DIVISOR) if moe else 0,
    )


@dataclass(frozen=True)
class Part:
    """Layers ``[first, last)`` of a decoder of ``layers`` layers: the first part embeds the
    token ids, the last applies the final norm and the LM head."""

    first: int
    last: int
    layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.first < self.last <= self.layers:
            raise MeshpactError(
                f"decoder part [{self.first}, {self.last}): expected 0 <= first < last <= {self.layers}"
            )

    @property
    def embeds(self) -> bool:
        return self.first == 0

    @property
    def has_head(self) -> bool:
        return self.last == self.layers


def split_parts(layers: int, at: int) -> tuple[Part, Part]:
    """The two hosts' parts of a ``layers``-layer decoder split before layer ``at``."""
    if not 0 < at < layers:
        raise MeshpactError(f"split at layer {at}: expected 1..{layers - 1} for a {layers}-layer decoder")
    return Part(0, at, layers), Part(at, layers, layers)


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def rotary(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (base 1e6, as Qwen3) of ``x [..., seq, head_dim]`` at ``pos``."""
    half = x.shape[-1] // 2
    freq = 1e6 ** (-torch.arange(half, dtype=torch.float32) / half)
    ang = pos.to(torch.float32)[..., None] * freq
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Decoder:
    """A seeded random decoder of ``spec`` with a KV cache of ``slots`` sequences of ``max_len``."""

    def __init__(self, spec: DecoderSpec, slots: int, max_len: int, seed: int = 0) -> None:
        self.spec = spec
        self.slots, self.max_len = slots, max_len
        g = torch.Generator().manual_seed(seed)

        def w(*shape: int) -> torch.Tensor:
            return torch.empty(shape).normal_(0.0, 1.0 / math.sqrt(shape[-1]), generator=g)

        s = spec
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.embed = torch.empty(s.vocab_size, s.hidden).normal_(0.0, 1.0, generator=g)
        self.head = w(s.vocab_size, s.hidden)
        self.norm = torch.ones(s.hidden)
        self.layers: list[dict[str, torch.Tensor]] = []
        for _ in range(s.layers):
            layer = {
                "ln1": torch.ones(s.hidden),
                "ln2": torch.ones(s.hidden),
                "wq": w(q, s.hidden),
                "wk": w(kv, s.hidden),
                "wv": w(kv, s.hidden),
                "wo": w(s.hidden, q),
            }
            if s.experts:
                layer["router"] = w(s.experts, s.hidden)
                layer["gate"] = w(s.experts, s.expert_intermediate, s.hidden)
                layer["up"] = w(s.experts, s.expert_intermediate, s.hidden)
                layer["down"] = w(s.experts, s.hidden, s.expert_intermediate)
            else:
                layer.update(
                    gate=w(s.intermediate, s.hidden), up=w(s.intermediate, s.hidden), down=w(s.hidden, s.intermediate)
                )
            self.layers.append(layer)
        self.k = torch.zeros(s.layers, slots, s.kv_heads, max_len, s.head_dim)
        self.v = torch.zeros_like(self.k)
        self.length = torch.zeros(slots, dtype=torch.long)
        # None: steps run eagerly; else a callable (decoder, part, inputs, slots, pos) -> output
        # running them compiled (:meth:`meshpact.live.spillover.compiled.CompiledSteps.attach`)
        self.compiled: Callable[..., torch.Tensor] | None = None

    # -- blocks -------------------------------------------------------------------------------
    def _mlp(self, layer: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if not self.spec.experts:
            return (F.silu(x @ layer["gate"].T) * (x @ layer["up"].T)) @ layer["down"].T
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(torch.softmax(flat @ layer["router"].T, dim=-1), self.spec.experts_per_token)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e in range(self.spec.experts):
            rows, which = (chosen == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            h = flat[rows]
            y = (F.silu(h @ layer["gate"][e].T) * (h @ layer["up"][e].T)) @ layer["down"][e].T
            out.index_add_(0, rows, y * weights[rows, which, None])
        return out.reshape(x.shape)

    def _attend(
        self, i: int, layer: dict[str, torch.Tensor], x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        """Attention of ``x [b, t, hidden]`` at positions ``pos [b, t]``, writing the slots' cache."""
        s = self.spec
        b, t, _ = x.shape
        q = (x @ layer["wq"].T).view(b, t, s.heads, s.head_dim).transpose(1, 2)
        k = (x @ layer["wk"].T).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        v = (x @ layer["wv"].T).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        q, k = rotary(q, pos[:, None, :]), rotary(k, pos[:, None, :])
        for j in range(b):
            self.k[i, int(slots[j])][:, pos[j]] = k[j]
            self.v[i, int(slots[j])][:, pos[j]] = v[j]
        end = int(pos.max()) + 1
        keys = self.k[i, slots, :, :end].repeat_interleave(s.heads // s.kv_heads, dim=1)
        vals = self.v[i, slots, :, :end].repeat_interleave(s.heads // s.kv_heads, dim=1)
        mask = torch.arange(end)[None, None, None, :] <= pos[:, None, :, None]
        out = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, t, s.heads * s.head_dim) @ layer["wo"].T

    def _layers(self, x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, first: int, last: int) -> torch.Tensor:
        for i in range(first, last):
            layer = self.layers[i]
            x = x + self._attend(i, layer, rms_norm(x, layer["ln1"]), slots, pos)
            x = x + self._mlp(layer, rms_norm(x, layer["ln2"]))
        return x

    def _forward(self, ids: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return rms_norm(self._layers(self.embed[ids], slots, pos, 0, len(self.layers)), self.norm)

    def _part(self, part: Part, inputs: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``part`` of the forward pass: ids ``[b, t]`` or hidden ``[b, t, hidden]`` in; hidden
        states (bfloat16, the boundary's dtype) or, for the last part, the normed states out."""
        x = self.embed[inputs] if part.embeds else inputs.to(torch.float32)
        x = self._layers(x, slots, pos, part.first, part.last)
        return rms_norm(x, self.norm) if part.has_head else x.to(torch.bfloat16)

    @property
    def whole(self) -> Part:
        """The whole decoder as one part (embedding to LM head)."""
        return Part(0, len(self.layers), len(self.layers))

    def keep_only(self, part: Part) -> None:
        """Drop the weights ``part`` never reads (a host holds only its layers)."""
        if part.layers != len(self.layers):
            raise MeshpactError(
                f"a part of a {part.layers}-layer decoder does not fit this {len(self.layers)}-layer one"
            )
        if not part.embeds:
            self.embed = torch.empty(0, self.spec.hidden)
        if not part.has_head:
            self.head = torch.empty(0, self.spec.hidden)
        for i in range(len(self.layers)):
            if not part.first <= i < part.last:
                self.layers[i] = {}

    # -- serving --------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, slot: int, prompt: Sequence[int]) -> None:
        """Fill ``slot``'s cache with ``prompt`` (no logits: the first decode step reads its last token)."""
        n = len(prompt)
        if n < 1 or n >= self.max_len:
            raise MeshpactError(f"prompt of {n} tokens: expected 1..{self.max_len - 1}")
        if n > 1:
            ids = torch.tensor([list(prompt[:-1])])
            self._forward(ids, torch.tensor([slot]), torch.arange(n - 1)[None, :])
        self.length[slot] = n - 1

    @torch.no_grad()
    def step(self, slots: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        """One decode step of ``slots`` fed ``tokens``: float32 logits ``[len(slots), vocab]``."""
        sl = torch.tensor(list(slots), dtype=torch.long)
        pos = self.length[sl].clone()
        if int(pos.max()) >= self.max_len:
            raise MeshpactError(f"a sequence reached the cache length {self.max_len}")
        ids = torch.tensor(list(tokens))[:, None]
        if self.compiled is not None:
            out = self.compiled(self, self.whole, ids, sl, pos[:, None])[:, 0]
        else:
            out = self._forward(ids, sl, pos[:, None])[:, 0] @ self.head.T
        self.length[sl] += 1
        return out

    @torch.no_grad()
    def score(self, slots: Sequence[int], tokens: torch.Tensor, start: Sequence[int]) -> torch.Tensor:
        """Run ``tokens [b, t]`` at positions ``start[j] ..`` of each slot (a verification pass):
        float32 logits ``[b, t, vocab]``; each slot's length becomes ``start + t`` (set it back
        with :meth:`set_length` for the positions a verifier rejects)."""
        sl = torch.tensor(list(slots), dtype=torch.long)
        t = int(tokens.shape[1])
        pos = torch.tensor(list(start), dtype=torch.long)[:, None] + torch.arange(t)[None, :]
        if int(pos.max()) >= self.max_len:
            raise MeshpactError(f"a sequence reached the cache length {self.max_len}")
        if self.compiled is not None:
            out = self.compiled(self, self.whole, tokens, sl, pos)
        else:
            out = self._forward(tokens, sl, pos) @ self.head.T
        self.length[sl] = pos[:, -1] + 1
        return out

    def set_length(self, slot: int, length: int) -> None:
        """Forget ``slot``'s cached positions from ``length`` on (they are masked until rewritten)."""
        self.length[slot] = length

    def perturbed(self, scale: float, seed: int) -> "Decoder":
        """A draft: this decoder with seeded noise of ``scale`` times each weight's spread added
        to every weight (its caches fresh); the larger ``scale``, the less often it agrees."""
        g = torch.Generator().manual_seed(seed)
        out = Decoder.__new__(Decoder)
        out.spec, out.slots, out.max_len = self.spec, self.slots, self.max_len

        def noisy(x: torch.Tensor) -> torch.Tensor:
            if x.numel() == 0:
                return x.clone()
            return x + torch.empty_like(x).normal_(0.0, 1.0, generator=g) * (scale * float(x.std()))

        out.embed, out.head, out.norm = noisy(self.embed), noisy(self.head), self.norm.clone()
        out.layers = [
            {k: (v.clone() if k.startswith("ln") else noisy(v)) for k, v in layer.items()} for layer in self.layers
        ]
        out.k, out.v = torch.zeros_like(self.k), torch.zeros_like(self.v)
        out.length = torch.zeros_like(self.length)
        out.compiled = None  # other weights: a package of this decoder's would compute the wrong thing
        return out

    @torch.no_grad()
    def prefill_part(self, slot: int, part: Part, inputs: torch.Tensor) -> torch.Tensor | None:
        """Fill ``slot``'s cache for ``part`` from a prompt's first ``n - 1`` positions: the
        prompt's ids (all ``n``; the first part) or the previous part's hidden states
        ``[n - 1, hidden]``. Returns the hidden states for the next part (None from the last)."""
        n = int(inputs.shape[0]) + (0 if part.embeds else 1)
        if n < 1 or n >= self.max_len:
            raise MeshpactError(f"prompt of {n} tokens: expected 1..{self.max_len - 1}")
        self.length[slot] = n - 1
        x = inputs[:-1] if part.embeds else inputs
        if n == 1:
            return None if part.has_head else torch.empty(0, self.spec.hidden, dtype=torch.bfloat16)
        h = self._part(part, x[None], torch.tensor([slot]), torch.arange(n - 1)[None, :])
        return None if part.has_head else h[0]

    @torch.no_grad()
    def step_part(self, slots: Sequence[int], part: Part, inputs: torch.Tensor) -> torch.Tensor:
        """One decode step of ``part`` for ``slots``: token ids ``[b]`` or hidden ``[b, hidden]``
        in; hidden states ``[b, hidden]`` (bfloat16) or float32 logits ``[b, vocab]`` out."""
        sl = torch.tensor(list(slots), dtype=torch.long)
        pos = self.length[sl].clone()
        if int(pos.max()) >= self.max_len:
            raise MeshpactError(f"a sequence reached the cache length {self.max_len}")
        if self.compiled is not None:
            out = self.compiled(self, part, inputs[:, None], sl, pos[:, None])[:, 0]
        else:
            h = self._part(part, inputs[:, None], sl, pos[:, None])
            out = h[:, 0] @ self.head.T if part.has_head else h[:, 0]
        self.length[sl] += 1
        return out
