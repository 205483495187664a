"""A user's training script with its own group, its own connection and its own errors (run by a launcher).

Written as a user would: after ``start_session`` it makes a metrics reducer whose group, made
with ``dist.new_group``, lives on ``self.pg``; it opens a TCP connection to an echo service of
its own (``--echo PORT``) and uses it every step; its data fetch, inside the step, raises
``TimeoutError`` once on one rank (``--fetch-timeout STEP:RANK``), which the script catches and
retries. The loss is scaled by the reducer's mean over ``self.pg``, so a step that reached a stale
group would fail or change the numbers, and an evaluation between steps all-reduces over it
through ``rt.run``. The model has dropout and the evaluation draws from the same generator, so a
re-run step that started from other generators than its first run's would change the numbers.
Faults come from ``--faults KIND:STEP:RANK[:NTH],...``; the kind ``eval`` is the script's own:
the evaluation after step STEP raises a data-path error on rank RANK once its all-reduce has
completed everywhere it could (its peers go on into the next step). Each rank writes
``rank<r>.json``: the digest of its whole state, its recoveries, how many steps its echo
connection answered, and (``timeouts-rank<r>.jsonl``, as it is caught) what its own TimeoutError did.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import time
from pathlib import Path

import numpy
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from meshpact.live.recovery import RecoveryConfig, resilient, start_session
from meshpact.live.recovery.faults import Fault, FaultInjector, FaultKind
from meshpact.live.recovery.state import digest


class MetricsReducer:
    """The mean of a value over the reducer's own group."""

    def __init__(self, ranks: list[int]) -> None:
        self.pg = dist.new_group(ranks)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        out = value.detach().clone()
        dist.all_reduce(out, group=self.pg)
        return out / dist.get_world_size(self.pg)


def build(mesh):
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Dropout(0.25), torch.nn.Linear(32, 16)
    )
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(131 * step + rank))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--echo", type=int, required=True)
    p.add_argument("--faults", default="")
    p.add_argument("--fetch-timeout", default="")
    p.add_argument("--stall-s", type=float, default=2.0)
    args = p.parse_args()
    session = start_session(RecoveryConfig(peer_copies=1))
    random.seed(session.rank)  # every generator the state holds is seeded: two runs compare bit for bit
    numpy.random.seed(session.rank)
    world = dist.get_world_size()
    reducer = MetricsReducer(list(range(world)))  # the user's group, made after start_session
    echo = socket.create_connection(("127.0.0.1", args.echo), timeout=30)  # the user's own connection
    model, optimizer = build(session.mesh)
    faults, eval_faults = [], set()
    for i, spec in enumerate(x for x in args.faults.split(",") if x):
        kind, step, rank, *nth = spec.split(":")
        if kind == "eval":
            eval_faults.add((int(step), int(rank)))
            continue
        faults.append(Fault(i, FaultKind(kind), int(step), int(rank), int(nth[0]) if nth else 1))
    injector = FaultInjector(tuple(faults), session.rank, session.control, stall_s=args.stall_s)
    timeout_step, timeout_rank = (int(x) for x in args.fetch_timeout.split(":")) if args.fetch_timeout else (-1, -1)
    raised: list[int] = []
    out = Path(args.out)
    answered = 0
    evaluations = []

    def train_step(b: torch.Tensor, step: int) -> float:
        if step == timeout_step and session.rank == timeout_rank and not raised:
            raised.append(step)
            raise TimeoutError(f"the data server did not answer for step {step}")  # the user's own fetch
        loss = model(b).pow(2).mean()
        scale = reducer.mean(loss)
        (loss / (1.0 + scale)).backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    def evaluate(step: int) -> float:
        drawn = torch.rand(1)  # an evaluation that draws (rt.run leaves the generators as it found them)
        got = float(reducer.mean(torch.tensor([float(session.rank)]) + drawn))
        if (step, session.rank) in eval_faults:
            eval_faults.discard((step, session.rank))
            time.sleep(0.3)  # its peers have their sums: they go on into the next step meanwhile
            raise dist.DistBackendError(f"injected: the evaluation after step {step} failed on rank {session.rank}")
        return got

    with resilient(model, optimizer, session, injector, batches=lambda step: batch(step, session.rank)) as rt:
        for step in range(rt.committed_step, args.steps):
            while True:
                before = len(rt.recoveries)
                try:
                    rt.step(lambda b, s=step: train_step(b, s), batch(step, session.rank))
                    break
                except TimeoutError as exc:  # the user's own error, unchanged: retried by the user
                    seen = {
                        "step": step,
                        "message": str(exc),
                        "type": type(exc).__name__,
                        "rank": session.rank,
                        "recoveries_before": before,
                        "recoveries_after": len(rt.recoveries),
                        "generation": session.generation,
                    }
                    with open(out / f"timeouts-rank{session.rank}.jsonl", "a") as f:  # kept if this process dies later
                        f.write(json.dumps(seen) + "\n")
            word = f"{session.rank}:{step}\n".encode()
            echo.sendall(word)
            if echo.recv(len(word)) == word:
                answered += 1
            evaluations.append(rt.run(evaluate, step))  # a collective between steps, over the user's group
        state = rt.state()
        record = {
            "rank": session.rank,
            "pid": os.getpid(),
            "incarnation": session.incarnation,
            "digest": digest(state),
            "answered": answered,
            "steps": args.steps,
            "first_step": args.steps - len(evaluations),
            "blocks_replayed": rt.blocks.replayed,
            "evaluations": evaluations,
            "recoveries": [{"policy": r.policy.value, "step": r.step} for r in rt.recoveries],
        }
    tmp = out / f"rank{session.rank}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, out / f"rank{session.rank}.json")


if __name__ == "__main__":
    main()
