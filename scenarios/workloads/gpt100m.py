"""Workload: a 110 M-parameter GPT-style decoder at real state size, FSDP2 over a 1-D mesh, AdamW.

GPT-2 small's shape (12 blocks of width 768, 12 heads, pre-norm attention and a GELU MLP,
dropout after each) with a 16 384-token vocabulary and an untied head: 110 M parameters,
float32. With AdamW's two moments the job holds 1.3 GB of state, a quarter of it on each of
4 ranks. A step is one 16-token sequence per rank, so the all-gathers, the reduce-scatter
and the optimizer dominate it, as they do a large job's. The learning rate warms up linearly
over the first 10 steps (``LinearLR``, stepped after the optimizer), so a step re-run with
the wrong schedule ends elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH, DROPOUT, SEED, LR, WARMUP = 16384, 768, 12, 12, 16, 1, 0.1, 2024, 3e-4, 10

SCHED: torch.optim.lr_scheduler.LinearLR | None = None  # the warm-up of the optimizer build() made last


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, d // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build(mesh):
    from torch.distributed.fsdp import fully_shard

    global SCHED
    torch.manual_seed(SEED)
    model = GPT()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, foreach=True)
    SCHED = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=WARMUP)
    return model, optimizer


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED * 1_000_003 + step * 1009 + rank)
    return torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)


def train_step(model, optimizer, batch: torch.Tensor) -> float:
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    assert SCHED is not None, "build() makes the scheduler before the first step"
    SCHED.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())
