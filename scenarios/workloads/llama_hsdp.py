"""Workload: a small Llama-style decoder with dropout, HSDP on a 2 x 2 (replicate x shard) mesh.

Llama's block, at toy size: RMSNorm before attention and MLP, rotary position embeddings on
queries and keys, causal attention, a SwiGLU MLP (``down(silu(gate(x)) * up(x))``), no
biases, and dropout after attention and MLP so every step draws random numbers. Each block
and the root are ``fully_shard``-ed over the 2-D mesh: parameters sharded along ``shard``,
replicated along ``replicate`` (HSDP), so a step uses both dimensions' groups. AdamW.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

MESH = {"shape": [2, 2], "names": ["replicate", "shard"]}

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH, DROPOUT, SEED = 96, 48, 4, 2, 24, 2, 0.1, 4321


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of channels by an angle that grows with the position (RoPE)."""
    _, _, t, d = x.shape
    freqs = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))
    angles = torch.outer(torch.arange(t, dtype=torch.float32, device=x.device), freqs)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(DIM)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.mlp_norm = RMSNorm(DIM)
        hidden = 2 * DIM
        self.gate, self.up = nn.Linear(DIM, hidden, bias=False), nn.Linear(DIM, hidden, bias=False)
        self.down = nn.Linear(hidden, DIM, bias=False)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, t, HEADS, d // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        a = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        x = x + self.drop(self.wo(a.transpose(1, 2).reshape(b, t, d)))
        h = self.mlp_norm(x)
        return x + self.drop(self.down(F.silu(self.gate(h)) * self.up(h)))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(SEED)
    model = Llama()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED * 7919 + step * 101 + rank)
    return torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)


def train_step(model, optimizer, batch: torch.Tensor) -> float:
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())
