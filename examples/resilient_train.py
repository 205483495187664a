"""A resilient training script: the README's example as a file of its own, for torchrun or ``meshpact launch``.

    meshpact launch --standalone --nproc-per-node 4 examples/resilient_train.py --steps 40 --out /tmp/run
    torchrun        --standalone --nproc-per-node 4 examples/resilient_train.py --steps 40 --out /tmp/run

Each rank keeps a copy of a peer's committed state in host memory (``peer_copies=1``), so a
rank whose process dies is restored from its peer by the process that replaces it (under
``meshpact launch``). With ``--out`` each rank writes ``rank<r>.json`` at the end: its process,
incarnation, last step and a digest of every byte of its state (parameter shards, optimizer
state, generators), the recoveries it took part in, and ``progress-rank<r>.json`` (step, process, incarnation) after each step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import numpy
import torch
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

from meshpact.core.recovery import Policy
from meshpact.live.recovery import RecoveryConfig, Resilient, resilient, start_session
from meshpact.live.recovery.state import digest

VOCAB = 64


def build(mesh):
    torch.manual_seed(0)  # every rank starts from the same weights
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, 32), torch.nn.Dropout(0.1), torch.nn.Linear(32, VOCAB))
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(step, rank):  # a pure function of the step and rank: a replacement draws the same batches
    return torch.randint(VOCAB, (4, 17), generator=torch.Generator().manual_seed(1000 * step + rank))


def train_step(model, optimizer, b):
    logits = model(b[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), b[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-s", type=float, default=0.0, help="sleep after each step (a slower job, for drills)")
    p.add_argument("--out", default=None, help="a folder for each rank's final digest and progress")
    p.add_argument("--checkpoint-dir", default=None, help="a DCP checkpoint every --checkpoint-every steps")
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument(
        "--excise-to",
        type=int,
        default=0,
        metavar="MIN_RANKS",
        help="a rank that gets no replacement (its node lost) is excised while MIN_RANKS or more remain",
    )
    args = p.parse_args()
    session = start_session(
        RecoveryConfig(peer_copies=1, checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every)
    )
    random.seed(session.rank)  # every generator the state holds is seeded: two runs compare bit for bit
    numpy.random.seed(session.rank)
    model, optimizer = build(session.mesh)
    out = Path(args.out) if args.out else None
    excise = dict(build=build, on_rank_loss=Policy.EXCISE, min_ranks=args.excise_to) if args.excise_to else {}
    # rt.share(batch, step): this rank's own batch, and after an excision its part of the departed ranks'
    # samples too (weighted), so the global batch stays what the original world trained on
    rt: Resilient  # bound by the with below, before any batch is asked for
    with resilient(model, optimizer, session, batches=lambda step: rt.share(batch, step), **excise) as rt:
        if rt.ckpt is not None and session.job_restarts > 0:
            rt.restore(rt.ckpt.latest(args.steps))  # torchrun restarted every worker: the newest checkpoint
        for step in range(rt.committed_step, args.steps):
            # rt.model and rt.optimizer: after an excision, the smaller world's (build(mesh) made them)
            rt.step(lambda b: train_step(rt.model, rt.optimizer, b), rt.share(batch, step))
            if out is not None:
                _write(
                    out / f"progress-rank{session.rank}.json",
                    {"step": step, "pid": os.getpid(), "incarnation": session.incarnation},
                )
                with open(out / f"steps-rank{session.rank}.log", "a") as log:  # when each step was committed
                    log.write(f"{step} {time.time():.6f}\n")
            time.sleep(args.step_s)
        state = rt.state()  # what a recovery restores and bit-identity compares
        recoveries = [
            {
                "policy": r.policy.value,
                "step": r.step,
                "lost_steps": r.lost_steps,
                "reason": r.reason,
                "detected": r.t_detect_wall,
                "resumed": r.t_resumed_wall,
            }
            for r in rt.recoveries
        ]
    if out is not None:
        torch.save(state, out / f"state-rank{session.rank}.pt")
        _write(
            out / f"rank{session.rank}.json",
            {
                "rank": session.rank,
                "pid": os.getpid(),
                "incarnation": session.incarnation,
                "digest": digest(state),
                "steps": args.steps,
                "recoveries": recoveries,
                "storage_bytes_read": rt.ckpt.bytes_read if rt.ckpt else 0,
            },
        )


def _write(path: Path, record: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
