"""A training loop built from torchtitan's components, recovered by Meshpact with no registration.

    meshpact launch --standalone --nproc-per-node 2 examples/torchtitan_train.py --steps 8 --out /tmp/titan
    torchrun        --standalone --nproc-per-node 2 examples/torchtitan_train.py --steps 8 --out /tmp/titan

Needs ``pip install 'meshpact[torchtitan]'`` (torchtitan 0.3.0 and triton, which its components
import even on CPU). The model is torchtitan's Llama 3 (``Llama3Model``) with a tiny config,
sharded by FSDP2; the optimizer is torchtitan's ``OptimizersContainer`` with two parameter groups,
one per optimizer kind (Adam for the norms, AdamW for the rest: two inner optimizers), and its
``LRSchedulersContainer`` (a ``LambdaLR`` warm-up and decay on each inner optimizer); the loss is
logged through torchtitan's ``dist_mean``. ``resilient()`` takes the container as it comes: the
inner optimizers' state and both schedulers are found and recovered.

``--fault kind:step:rank`` (repeatable; ``kill``, ``collective``, ``stall``) injects a fault;
``kill`` needs ``meshpact launch``, which replaces the killed worker alone. With ``--out`` each
rank writes ``rank<r>.json``: a digest of its whole job state, of its model shards and of the
container's own ``state_dict()``, and each inner optimizer's learning rate.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from meshpact.live.recovery import RecoveryConfig, resilient, start_session
from meshpact.live.recovery.faults import Fault, FaultInjector, FaultKind
from meshpact.live.recovery.state import digest

VOCAB, DIM, HEADS, LAYERS, SEQ = 64, 32, 4, 2, 16
TOTAL_STEPS = 40  # the LR schedule's length: a short run ends mid-decay


def tiny_llama() -> torch.nn.Module:
    """torchtitan's Llama 3 with a tiny config. Its attention is torch's SDPA: torchtitan's default
    FlexAttention has no backward on CPU."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention

    layers = llama3._build_llama3_layers(
        fuse_qkv=True,
        n_layers=LAYERS,
        dim=DIM,
        n_heads=HEADS,
        hidden_dim=2 * DIM,
        attn_backend="flex",
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=SEQ, theta=10000.0, scaling="none"),
    )
    sdpa = [
        dataclasses.replace(
            b, attention=dataclasses.replace(b.attention, inner_attention=ScaledDotProductAttention.Config())
        )
        for b in layers
    ]
    config = llama3.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        layers=sdpa,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=llama3._output_linear_init(DIM)),
    )
    return config.build()


def build(mesh: Any) -> tuple[torch.nn.Module, Any, Any]:
    """The model (FSDP2 over ``mesh``; None: unsharded), torchtitan's optimizer container and its
    LR scheduler container, the same on every rank and in every process that builds them."""
    from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    torch.manual_seed(0)
    model = tiny_llama()
    if mesh is not None:
        for block in model.layers.values():  # type: ignore[operator]  # nn.Module's __getattr__ is typed Tensor | Module
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    groups = [
        ParamGroupConfig(pattern=r"norm", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-2, "betas": (0.9, 0.99)}),
        ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.1}),
    ]
    optimizers = OptimizersContainer(
        OptimizersContainer.Config(param_groups=groups, implementation="for-loop"), model_parts=[model]
    )
    schedulers = LRSchedulersContainer.Config(warmup_steps=2, decay_type="cosine").build(
        optimizers=optimizers, training_steps=TOTAL_STEPS
    )
    return model, optimizers, schedulers


def batch(step: int, rank: int) -> torch.Tensor:
    """A pure function of the step and rank: a replacement draws the same tokens."""
    return torch.randint(VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1000 * step + rank))


def train_step(model: torch.nn.Module, optimizers: Any, schedulers: Any, tokens: torch.Tensor, mesh: Any) -> float:
    from torchtitan.distributed.utils import dist_mean

    positions = torch.arange(SEQ).expand(tokens.shape[0], SEQ)
    logits = model(tokens[:, :-1], positions)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizers.step()
    schedulers.step()
    optimizers.zero_grad()
    return dist_mean(loss.detach(), mesh) if mesh is not None else float(loss)


def container_digest(optimizers: Any) -> str:
    """A digest of the container's own ``state_dict()`` (torchtitan's flat, FQN-keyed one: every
    inner optimizer's moments, steps and param-group settings), local shards of DTensors."""
    h = hashlib.blake2b(digest_size=16)
    for key, value in sorted(optimizers.state_dict().items()):
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            h.update(f"{key}|{local.dtype}|{tuple(local.shape)}".encode())
            h.update(local.detach().reshape(-1).to("cpu", copy=True).view(torch.uint8).numpy())  # type: ignore[arg-type]  # an ndarray exports the buffer protocol; numpy's stubs omit __buffer__
        else:
            h.update(f"{key}={value!r}".encode())
    return h.hexdigest()


def _fault(text: str, index: int) -> Fault:
    try:
        kind, step, rank = text.split(":")
        return Fault(index, FaultKind(kind), int(step), int(rank))
    except ValueError:
        raise SystemExit(f"--fault takes kind:step:rank (kind: kill, collective or stall), got {text!r}") from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--step-s", type=float, default=0.0, help="sleep after each step (a slower job, for drills)")
    p.add_argument("--out", default=None, help="a folder for each rank's final digests")
    p.add_argument("--fault", action="append", default=[], metavar="KIND:STEP:RANK")
    p.add_argument("--stall-s", type=float, default=3.0, help="how long a stall fault sleeps")
    args = p.parse_args()
    faults = tuple(_fault(f, i) for i, f in enumerate(args.fault))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    session = start_session(RecoveryConfig(peer_copies=1))
    random.seed(session.rank)
    numpy.random.seed(session.rank)
    model, optimizers, schedulers = build(session.mesh)
    injector = FaultInjector(faults, session.rank, session.control, args.stall_s) if faults else None
    with resilient(model, optimizers, session, injector, batches=lambda step: batch(step, session.rank)) as rt:
        for step in range(rt.committed_step, args.steps):
            rt.step(lambda b: train_step(model, optimizers, schedulers, b, session.mesh), batch(step, session.rank))
            if args.out:
                _write(
                    Path(args.out) / f"progress-rank{session.rank}.json",
                    {"step": step, "pid": os.getpid(), "incarnation": session.incarnation},
                )
            time.sleep(args.step_s)
        state = rt.state()
        recoveries = [{"policy": r.policy.value, "step": r.step, "reason": r.reason} for r in rt.recoveries]
    if args.out:
        _write(
            Path(args.out) / f"rank{session.rank}.json",
            {
                "rank": session.rank,
                "pid": os.getpid(),
                "incarnation": session.incarnation,
                "digest": digest(state),
                "model": digest({k: v for k, v in state.items() if k.startswith("param/")}),
                "optimizers": container_digest(optimizers),
                "lr": [g["lr"] for o in optimizers.optimizers for g in o.param_groups],
                "recoveries": recoveries,
            },
        )


def _write(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
