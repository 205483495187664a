"""Workload: the built-in decoder fed by torchdata's ``StatefulDataLoader``, its position state.

The model and optimizer are the ``decoder`` workload's. The data is a fixed synthetic corpus of
token sequences, shuffled per rank by a seeded generator and read in batches by a
``StatefulDataLoader``; ``batch`` draws the next batch, so it is not a pure function of the
step. ``state`` registers the loader (through :class:`Stream`, which restarts its iterator
when a position is loaded) with ``resilient(state=...)``: its position is committed with
each step, copied to peers, checkpointed, and restored on every recovery path, so a
recovered rank reads neither a batch twice nor one too few.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from meshpact.live.trials.harness import ModelConfig, build as build_decoder

CONFIG = ModelConfig()
SEQUENCES = 512  # an epoch is SEQUENCES / CONFIG.batch steps

STREAMS: dict[int, "Stream"] = {}  # this process's stream, by rank (one rank per process)


class Stream:
    """A ``StatefulDataLoader`` and the iterator reading it, as one Stateful object."""

    def __init__(self, rank: int) -> None:
        corpus = torch.randint(
            CONFIG.vocab, (SEQUENCES, CONFIG.seq + 1), generator=torch.Generator().manual_seed(CONFIG.seed)
        )
        self.loader = StatefulDataLoader(
            corpus,
            batch_size=CONFIG.batch,
            shuffle=True,
            drop_last=True,
            generator=torch.Generator().manual_seed(CONFIG.seed + 7919 * rank),
        )
        self._it: Iterator[torch.Tensor] | None = None

    def next(self) -> torch.Tensor:
        if self._it is None:
            self._it = iter(self.loader)
        try:
            return next(self._it)
        except StopIteration:  # the next epoch
            self._it = iter(self.loader)
            return next(self._it)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self._it = None  # the loaded position takes effect with the next iterator


def state(rank: int) -> dict:
    return {"data": STREAMS.setdefault(rank, Stream(rank))}


def build(mesh):
    return build_decoder(CONFIG, mesh)


def batch(step: int, rank: int) -> torch.Tensor:
    return STREAMS.setdefault(rank, Stream(rank)).next()


def train_step(model, optimizer, batch: torch.Tensor) -> float:
    logits = model(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())
