"""The excising reference of a node loss under ``meshpact launch``: the example script's job with
the lost ranks leaving at a step, no fault, no recovery runtime.

``torchrun --standalone --nproc-per-node W -m meshpact.live.trials.launchref --steps N
--excise-at S --survivors K --out DIR`` trains ``examples/resilient_train.py``'s model (its own
``build``, ``batch`` and ``train_step``, its seeds) as a plain FSDP2 loop on W ranks for steps
``0..S-1``. Every rank then hands its state over (a file in ``DIR``); ranks ``K..W-1`` leave, and
ranks ``0..K-1`` build the model again on a group of their own, load the W ranks' shards
re-cut over K (whole tensors assembled from every rank's rows, each survivor's new rows taken:
:func:`~meshpact.live.recovery.reshard.assemble_full`, :func:`~meshpact.live.recovery.reshard.shard_of`;
each keeps its own generators) and train steps ``S..N-1`` on the same global batch: each its own
samples and its part of the departed ranks', its gradient weighted
(:func:`~meshpact.live.recovery.reshard.share_batch`, as the example's ``rt.share``). Each survivor writes
``rank<r>.json`` (the digest of its state, as the example writes it) and ``state-rank<r>.pt``.

A node killed under ``meshpact launch`` whose ranks the survivors excised at step ``S`` (the
recovery's failed step less the steps it replayed) ends bit for bit as this run: nothing of the
runtime (consensus, peer copies, the excision's all-to-all) is in it, only what an excision means.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import runpy
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--excise-at", type=int, required=True, metavar="S", help="the step the lost ranks leave before")
    p.add_argument("--survivors", type=int, required=True, metavar="K", help="ranks 0..K-1 go on")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import numpy
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from ..recovery.reshard import GradientWeight, Membership, assemble_full, share_batch, shard_of, sharded_keys
    from ..recovery.state import digest, job_state, load_job_state
    from .launchdrill import EXAMPLE

    example = runpy.run_path(str(EXAMPLE), run_name="meshpact_example")
    build, batch, train_step = example["build"], example["batch"], example["train_step"]
    out = Path(args.out)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not 0 < args.survivors < world or not 0 <= args.excise_at <= args.steps:
        sys.stderr.write(
            f"error: --survivors {args.survivors} --excise-at {args.excise_at}: expected 1..{world - 1} "
            f"survivors and a step in 0..{args.steps}\n"
        )
        return 2
    random.seed(rank)  # as the example seeds them: every generator is in the state compared
    numpy.random.seed(rank)
    assert dist.group.WORLD is not None  # the process group is up
    model, optimizer = build(DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    for step in range(args.excise_at):
        train_step(model, optimizer, batch(step, rank))
    torch.save(job_state(model, optimizer), out / f"handover-rank{rank}.pt")
    dist.barrier()
    group = dist.new_group(list(range(args.survivors)))  # every rank takes part in making it
    if rank >= args.survivors:
        dist.destroy_process_group()
        return 0
    states = [torch.load(out / f"handover-rank{r}.pt", weights_only=True) for r in range(world)]
    whole = assemble_full(states)
    mine = {k: v for k, v in states[rank].items() if k not in set(sharded_keys(states[rank]))}  # generators, schedule
    mine.update({k: v if v.dim() == 0 else shard_of(v, args.survivors, rank) for k, v in whole.items()})
    model, optimizer = build(DeviceMesh.from_group(group, "cpu"))
    load_job_state(model, optimizer, mine)  # build reseeded: the generators go back to this rank's own
    membership, weight = Membership(world, tuple(range(args.survivors))), GradientWeight(model)
    for step in range(args.excise_at, args.steps):
        share = share_batch(batch, step, membership, rank)
        weight.weight = share.weight
        train_step(model, optimizer, share.batch)
    state = job_state(model, optimizer)
    torch.save(state, out / f"state-rank{rank}.pt")
    record = {"rank": rank, "pid": os.getpid(), "incarnation": 0, "digest": digest(state), "steps": args.steps}
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from meshpact.exiting import run_then_exit

    run_then_exit(main)
