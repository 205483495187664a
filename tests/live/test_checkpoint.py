"""Checkpoints are DCP checkpoints, complete only when every rank's part exists; async snapshots are measured."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp

from meshpact.live.recovery.checkpoint import AsyncCheckpointer, Checkpointer, state_bytes
from meshpact.live.recovery.state import Chunk

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_latest_complete_checkpoint_ignores_one_missing_a_rank(tmp_path):
    ranks = [Checkpointer(tmp_path, r, 2, every=5) for r in range(2)]
    for step in (0, 5):
        for c in ranks:
            c.save(step, {"w": torch.full((3,), float(step + c.rank))})
    ranks[0].save(10, {"w": torch.zeros(3)})  # rank 1 died before writing step 10
    assert ranks[0].latest(12) == 5 and ranks[0].latest(4) == 0
    assert torch.equal(ranks[1].load(5)["w"], torch.full((3,), 6.0))
    assert ranks[0].due(10) and not ranks[0].due(11)


def test_no_checkpoint_says_where_it_looked(tmp_path):
    with pytest.raises(FileNotFoundError, match="no complete checkpoint at or before step 3"):
        Checkpointer(tmp_path, 0, 1, every=1).latest(3)


def test_bad_interval_is_refused(tmp_path):
    with pytest.raises(ValueError, match="interval must be >= 1"):
        Checkpointer(tmp_path, 0, 1, every=0)


def test_async_snapshot_is_written_in_the_background_and_reuses_its_buffers(tmp_path):
    ck = AsyncCheckpointer(tmp_path, rank=0)
    state = {"a": torch.arange(10.0), "b": torch.ones(2, 2)}
    for i in range(3):
        state["a"].add_(1)
        ck.snapshot(i, state)
    ck.close()
    assert len(ck.writes) == 3 and ck.host_bytes == state_bytes(state)
    saved = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(saved, checkpoint_id=str(ck.path), no_dist=True)
    assert torch.equal(saved["a"], state["a"]) and torch.equal(saved["b"], state["b"])


def _whole(step_dir, name, shape):
    out = {name: torch.empty(shape)}
    dcp.load(out, checkpoint_id=str(step_dir), no_dist=True)
    return out[name]


def test_parts_of_a_one_d_cut_merge_into_the_whole_tensors_a_plain_loop_reads(tmp_path):
    full = torch.arange(10.0).reshape(5, 2)  # torch.chunk over 2 ranks: rows 0-2 and 3-4
    for r, rows in enumerate((full[:3], full[3:])):
        Checkpointer(tmp_path, r, 2, 1).save(
            0,
            {
                "param/w": rows,
                "optim/w/exp_avg": rows * 2,
                "optim/w/step": torch.tensor(3.0),
                "rng/torch_cpu": torch.get_rng_state(),
            },
        )
    step_dir = Checkpointer(tmp_path, 0, 2, 1).step_dir(0)
    assert torch.equal(_whole(step_dir, "model.w", (5, 2)), full)
    assert torch.equal(_whole(step_dir, "optim.state.w.exp_avg", (5, 2)), full * 2)
    assert torch.equal(Checkpointer(tmp_path, 1, 2, 1).load(0)["param/w"], full[3:])


def test_replicated_shards_with_their_chunks_are_named_once_and_an_unconfirmed_cut_is_not_named(tmp_path):
    full = torch.arange(8.0).reshape(4, 2)
    for r in range(4):  # a 2x2 mesh: rows cut over the inner dimension, replicated over the outer
        half = r % 2
        Checkpointer(tmp_path, r, 4, 1).save(
            0, {"param/w": full[2 * half : 2 * half + 2]}, chunks={"param/w": Chunk((4, 2), (2 * half, 0))}
        )
    assert torch.equal(_whole(tmp_path / "step00000000", "model.w", (4, 2)), full)
    for r, rows in enumerate((full[:1], full[1:3])):  # no chunks, and rows torch.chunk never cuts (1 then 2 of 3)
        Checkpointer(tmp_path, r, 2, 1).save(1, {"param/w": rows})
    meta = dcp.FileSystemReader(str(tmp_path / "step00000001")).read_metadata()
    assert "model.w" not in meta.state_dict_metadata and "meshpact.rank1.param/w" in meta.state_dict_metadata


def test_a_rewritten_part_is_merged_again(tmp_path):
    ranks = [Checkpointer(tmp_path, r, 2, 1) for r in range(2)]
    for c in ranks:
        c.save(0, {"param/w": torch.zeros(2, 2)})
    ranks[1].save(0, {"param/w": torch.ones(2, 2)})  # a replacement wrote its part again
    assert ranks[0].complete(0)
    assert torch.equal(
        _whole(ranks[0].step_dir(0), "model.w", (4, 2)), torch.cat([torch.zeros(2, 2), torch.ones(2, 2)])
    )
