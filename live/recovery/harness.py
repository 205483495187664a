"""Training harness: a small decoder transformer sharded with FSDP2 over a DeviceMesh.

The model is a GPT-style decoder (token and position embeddings, pre-norm blocks of causal
self-attention and an MLP, a language-model head), each block and the root wrapped with
``torch.distributed.fsdp.fully_shard`` over a 1-D :class:`DeviceMesh`, trained with AdamW.
Data is a pure function of ``(seed, step, rank)``, so any step can be produced again, by any
process, bit for bit: the recovery runtime re-runs a failed step and replays lost ones from
it. :func:`local_state` lists every tensor a rank holds (its parameter shards and optimizer
state) in one fixed order; digests, checkpoints and the bit-identity checks all read it.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ModelConfig", "Decoder", "build", "make_batch", "make_train_step", "local_state", "digest",
           "load_local_state"]


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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def build(cfg: ModelConfig, mesh: Any, compile: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The sharded model and its AdamW optimizer; every rank starts from the same weights."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(cfg.seed)
    model = Decoder(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if compile:
        model.compile()
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


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor this rank holds, parameter shards then optimizer state, in a fixed order."""
    out: dict[str, torch.Tensor] = {}
    params = dict(model.named_parameters())
    for name, p in params.items():
        out[f"param/{name}"] = _local(p.data)
    for name, p in params.items():
        for key, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                out[f"optim/{name}/{key}"] = _local(value)
    return out


def load_local_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` (as :func:`local_state` gives it) back into the model and optimizer in place."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            _local(p.data).copy_(state[f"param/{name}"])
            p.grad = None
        for name, p in params.items():
            prefix = f"optim/{name}/"
            keys = [k[len(prefix):] for k in state if k.startswith(prefix)]
            if not keys:
                optimizer.state.pop(p, None)
                continue
            slot = optimizer.state.setdefault(p, {})
            for key in keys:
                if key in slot and isinstance(slot[key], torch.Tensor):
                    _local(slot[key]).copy_(state[prefix + key])
                elif p.data.__class__ is not torch.Tensor and state[prefix + key].dim() > 0:
                    slot[key] = _like(p.data, state[prefix + key])
                else:
                    slot[key] = state[prefix + key].clone()


def _like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A DTensor with ``param``'s mesh and placements holding ``local``."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.clone(), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())


def digest(state: dict[str, torch.Tensor]) -> str:
    """A content digest of a rank's tensors (names, dtypes, shapes and bytes)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in state.items():
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        # a copy: exporting a tensor's own storage to numpy would make it non-resizable,
        # which breaks FSDP's freeing of unsharded buffers
        h.update(t.detach().reshape(-1).to("cpu", copy=True).view(torch.uint8).numpy())
    return h.hexdigest()
