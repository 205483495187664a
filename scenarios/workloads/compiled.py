"""Workload: a decoder whose every block is compiled with ``torch.compile``, FSDP2 on a 1-D mesh.

Each block is ``fully_shard``-ed, then compiled on its own (``torch.compile(block)``), as
large trainings do: FSDP2's collectives run in its hooks around the compiled graphs. The blocks use
dropout, so a re-run step must also restore the generators.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, LAYERS, SEQ, BATCH, SEED = 64, 32, 2, 16, 2, 99


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(mesh):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(SEED)
    model = Model()
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh)
        model.blocks[i] = torch.compile(block)  # type: ignore[assignment]  # compiling a Module returns a Module; the stub says a callable
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED * 31 + step * 7 + rank)
    return torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)


def train_step(model, optimizer, batch: torch.Tensor) -> float:
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())
