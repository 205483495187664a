"""Workload: the built-in GPT-style decoder, FSDP2 over a 1-D mesh of all ranks, AdamW.

The model, its sharding and its data are :mod:`meshpact.live.trials.harness`'s; this file
is the workload interface around them (``build``, ``batch``, ``train_step``). No ``MESH``:
the default 1-D mesh over every rank.
"""

from __future__ import annotations

import torch

from meshpact.live.trials.harness import ModelConfig, build as build_decoder, make_batch

CONFIG = ModelConfig()


def build(mesh):
    return build_decoder(CONFIG, mesh)


def batch(step: int, rank: int) -> torch.Tensor:
    return make_batch(CONFIG, step, rank)


def train_step(model, optimizer, batch: torch.Tensor) -> float:
    logits = model(batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())
