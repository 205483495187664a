"""Training harness: a small decoder transformer sharded with FSDP2 over a DeviceMesh.

The model is a GPT-style decoder (token and position embeddings, pre-norm blocks of causal
self-attention and an MLP, a language-model head), each block and the root wrapped with
``torch.distributed.fsdp.fully_shard`` over a 1-D :class:`DeviceMesh`, trained with AdamW.
Data is a pure function of ``(seed, step, rank)``, so any step can be produced again, by any
process, bit for bit: the recovery runtime re-runs a failed step and replays lost ones from
it. The shipped workload ``scenarios/workloads/decoder.py`` runs this model in a recovery trial.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ModelConfig", "Decoder", "build", "make_batch", "make_train_step"]


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 128
    dim: int = 64
    heads: int = 4
    layers: int = 2
    seq: int = 32
    batch: int = 4  # sequences per rank per step
    lr: float = 1e-3
    seed: int = 1234


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.down = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build(cfg: ModelConfig, mesh: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The sharded model and its AdamW optimizer; every rank starts from the same weights."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(cfg.seed)
    model = Decoder(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=True)
    return model, optimizer


def make_batch(cfg: ModelConfig, step: int, rank: int) -> torch.Tensor:
    """Tokens for ``(step, rank)``: shape (batch, seq + 1), the same in every process."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step * 1009 + rank)
    return torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g)


def make_train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], float]:
    """An ordinary training step: forward, loss, backward, optimizer step, zero grads."""

    device = next(model.parameters()).device

    def train_step(batch: torch.Tensor) -> float:
        batch = batch.to(device)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return train_step
