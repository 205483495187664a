"""A Meshpact job's checkpoints are DCP checkpoints: a plain FSDP2 loop loads one with torch's own
``get_state_dict``/``dcp.load``/``set_state_dict`` and goes on training, and a checkpoint that
loop writes with ``dcp.save`` restores into a Meshpact rank's state."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from pathlib import Path

import pytest
import torch

from _warm import shared_forkserver
from meshpact.live.recovery.checkpoint import Checkpointer
from meshpact.live.trials.trial import TrialConfig, run_trial

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

_RANKS, _STEPS, _EVERY = 2, 4, 2


def _sharded(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in state.items() if k.startswith(("param/", "optim/"))}


def _plain_rank(rank: int, init: str, ckpt_dir: str, final_dir: str, errors: mp.Queue) -> None:
    """One rank of a plain FSDP2 loop (no Meshpact runtime): load the job's checkpoint of the
    last step as torchtitan does, check it against the job's final state, train one more step,
    save with ``dcp.save``, and read that back through Meshpact's :class:`Checkpointer`."""
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
        from torch.distributed.device_mesh import init_device_mesh

        from meshpact.live.recovery.state import global_chunks, job_state, load_job_state, local_state
        from meshpact.scenarios.workloads import decoder

        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=_RANKS)
        mesh = init_device_mesh("cpu", (_RANKS,))
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        model, optimizer = decoder.build(mesh)
        msd, osd = get_state_dict(model, optimizer, options=opts)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=os.path.join(ckpt_dir, f"step{_STEPS:08d}"))
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd, options=opts)
        job = torch.load(os.path.join(final_dir, f"final-rank{rank}.pt"), weights_only=True)
        mine = local_state(model, optimizer, buffers=False)
        differ = [k for k, v in _sharded(job).items() if not torch.equal(mine[k], v)]
        assert not differ and mine.keys() == _sharded(job).keys(), f"rank {rank}: {differ or mine.keys() ^ job.keys()}"
        # and on: one more step of the plain loop, saved as torchtitan saves
        decoder.train_step(model, optimizer, decoder.batch(_STEPS, rank))
        msd, osd = get_state_dict(model, optimizer, options=opts)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(ckpt_dir, f"step{_STEPS + 1:08d}"))
        dist.barrier()
        fresh, fresh_opt = decoder.build(mesh)
        like = job_state(fresh, fresh_opt)
        got = Checkpointer(ckpt_dir, rank, _RANKS, 1).load(_STEPS + 1, like=like, chunks=global_chunks(fresh, fresh_opt))
        load_job_state(fresh, fresh_opt, got)
        trained, back = local_state(model, optimizer), local_state(fresh, fresh_opt)
        differ = [k for k in trained if not torch.equal(trained[k], back[k])]
        assert not differ, f"rank {rank}: read back differently: {differ}"
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  (the parent reports it)
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")


def test_a_meshpact_checkpoint_loads_in_a_plain_fsdp2_loop_and_back(tmp_path: Path):
    cfg = TrialConfig(ranks=_RANKS, steps=_STEPS, faults=1, checkpoint_every=_EVERY, baselines=False)
    result = run_trial(cfg, work_dir=tmp_path / "trial", forkserver=shared_forkserver(), warm_replacements=True)
    assert result.summary()["bit_identical"]
    ckpt_dir = tmp_path / "trial" / "checkpoints"
    assert Checkpointer(ckpt_dir, 0, _RANKS, _EVERY).latest(_STEPS) == _STEPS
    # one process, no group at all: the whole model from the chunks every rank wrote
    import torch.distributed.checkpoint as dcp

    finals = [torch.load(tmp_path / "trial" / "faulted" / f"final-rank{r}.pt", weights_only=True) for r in range(_RANKS)]
    name = next(k for k in finals[0] if k.startswith("param/") and finals[0][k].dim() == 2)
    whole = {f"model.{name[len('param/'):]}": torch.empty(sum(f[name].shape[0] for f in finals), finals[0][name].shape[1])}
    dcp.load(whole, checkpoint_id=str(ckpt_dir / f"step{_STEPS:08d}"), no_dist=True)
    assert torch.equal(next(iter(whole.values())), torch.cat([f[name] for f in finals]))

    ctx = mp.get_context("fork")
    errors = ctx.Queue()
    init = tmp_path / "init"
    procs = [ctx.Process(target=_plain_rank, args=(r, str(init), str(ckpt_dir), str(tmp_path / "trial" / "faulted"),
                                                   errors)) for r in range(_RANKS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
