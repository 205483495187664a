"""Checkpoints are complete only when every rank's file exists; async snapshots are measured."""

from __future__ import annotations

import pytest
import torch

from meshpact.live.recovery.checkpoint import AsyncCheckpointer, Checkpointer, state_bytes


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
    saved = torch.load(tmp_path / "rank0-latest.pt", weights_only=True)
    assert torch.equal(saved["a"], state["a"])
