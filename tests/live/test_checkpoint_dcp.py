"""A Meshpact job's checkpoints are DCP checkpoints: a plain FSDP2 loop loads one with torch's own
``get_state_dict``/``dcp.load``/``set_state_dict`` and goes on training, and a checkpoint that
loop writes with ``dcp.save`` restores into a Meshpact rank's state. The job that writes them
loses a rank whose state only a checkpoint holds, and the newest checkpoint has a flipped bit:
the recovery passes it over by name and restores the older one, bit for bit."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from pathlib import Path

import pytest
import torch

from _warm import shared_forkserver
from meshpact.live.recovery.checkpoint import Checkpointer
from meshpact.live.recovery.faults import FaultKind
from meshpact.live.trials.trial import TrialConfig, run_trial

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

_RANKS, _STEPS, _EVERY = 2, 4, 2
_FAULT_STEP = 2  # plan_faults: one kill in [1, 4), at 1 + 3 // 2, of rank 0

# the decoder, as a user's workload, whose rank 0 flips one bit of its own part of the newest
# checkpoint (step 2, written at the commit before) as it draws step 2's batch, just before it is
# killed in that step: it comes back from a checkpoint, and step 2's is damaged
_FLIPPING = """
from pathlib import Path

from meshpact.scenarios.workloads import decoder

PART, DONE = Path({part!r}), Path({done!r})


def build(mesh):
    return decoder.build(mesh)


def train_step(model, optimizer, batch):
    return decoder.train_step(model, optimizer, batch)


def batch(step, rank):
    if step == {step} and rank == 0 and PART.exists() and not DONE.exists():
        data = next(PART.glob("*.distcp"))
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
        DONE.write_text(data.name)
    return decoder.batch(step, rank)
"""


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
        got = Checkpointer(ckpt_dir, rank, _RANKS, 1).load(
            _STEPS + 1, like=like, chunks=global_chunks(fresh, fresh_opt)
        )
        load_job_state(fresh, fresh_opt, got)
        trained, back = local_state(model, optimizer), local_state(fresh, fresh_opt)
        differ = [k for k in trained if not torch.equal(trained[k], back[k])]
        assert not differ, f"rank {rank}: read back differently: {differ}"
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001  (the parent reports it)
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")


def test_a_meshpact_checkpoint_loads_in_a_plain_fsdp2_loop_and_back(tmp_path: Path):
    ckpt_dir = tmp_path / "trial" / "checkpoints"
    workload = tmp_path / "flipping.py"
    workload.write_text(
        _FLIPPING.format(
            part=str(ckpt_dir / f"step{_FAULT_STEP:08d}" / "rank0"), done=str(tmp_path / "flipped"), step=_FAULT_STEP
        )
    )
    cfg = TrialConfig(
        ranks=_RANKS,
        steps=_STEPS,
        faults=1,
        fault_kind=FaultKind.KILL,
        checkpoint_every=_EVERY,
        peer_copies=0,
        baselines=False,
        workload=str(workload),
    )
    result = run_trial(cfg, work_dir=tmp_path / "trial", forkserver=shared_forkserver(), warm_replacements=True)
    assert (tmp_path / "flipped").exists(), "the workload never flipped the checkpoint's bit"
    summary = result.summary()
    (restore,) = result.recoveries()
    assert restore["policy"] == "checkpoint_restore" and restore["lost_steps"] == _FAULT_STEP, restore
    # the choice is bounded by the survivor's committed step (2) where it kept its state intact, and
    # then the damaged step 2 is named; a survivor caught mid-update bounds it at 0, before the damage
    if "rank(s) [0, 1] hold no intact state" not in restore["reason"]:
        assert f"passed over step {_FAULT_STEP} (rank0/" in restore["reason"], restore["reason"]
        assert "sha256 digest" in restore["reason"] and restore["reason"].endswith("using step 0"), restore["reason"]
    assert summary["bit_identical"], (summary["mismatches"], restore["reason"])
    assert Checkpointer(ckpt_dir, 0, _RANKS, _EVERY).latest(_STEPS) == _STEPS
    # one process, no group at all: the whole model from the chunks every rank wrote
    import torch.distributed.checkpoint as dcp

    finals = [
        torch.load(tmp_path / "trial" / "faulted" / f"final-rank{r}.pt", weights_only=True) for r in range(_RANKS)
    ]
    name = next(k for k in finals[0] if k.startswith("param/") and finals[0][k].dim() == 2)
    whole = {
        f"model.{name[len('param/') :]}": torch.empty(sum(f[name].shape[0] for f in finals), finals[0][name].shape[1])
    }
    dcp.load(whole, checkpoint_id=str(ckpt_dir / f"step{_STEPS:08d}"), no_dist=True)
    assert torch.equal(next(iter(whole.values())), torch.cat([f[name] for f in finals]))

    ctx = mp.get_context("fork")
    errors = ctx.Queue()
    init = tmp_path / "init"
    procs = [
        ctx.Process(target=_plain_rank, args=(r, str(init), str(ckpt_dir), str(tmp_path / "trial" / "faulted"), errors))
        for r in range(_RANKS)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    failures = [errors.get() for _ in range(errors.qsize())] if not errors.empty() else []
    assert not failures, "\n".join(failures)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
