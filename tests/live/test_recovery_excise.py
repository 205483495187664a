"""Ranks lost for good and not replaced: the survivors excise them and go on, same global batch.

Each faulted run kills two ranks (SIGKILL, no replacement) and is judged bitwise against the
excising reference (no fault; the same ranks hand over their copies and leave at the steps
the faulted run excised them at), and its whole tensors against the never-failed run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshpact.commands.live_recover import json_view
from meshpact.live.recovery.checkpoint import Checkpointer

from _recovery import trial

pytestmark = [pytest.mark.live, pytest.mark.slow]

_RUN = dict(
    ranks=4, steps=10, checkpoint_every=4, baselines=False, fault_kind="kill", peer_copies=1, on_rank_loss="excise"
)


def test_two_kills_are_excised_leaving_two_ranks_bitwise_equal_to_the_excising_reference():
    result = trial(faults=2, **_RUN)
    s = result.summary()
    assert s["bit_identical"], s["mismatches"]
    assert s["policy_counts"]["excise"] == 2 and s["faults_recovered"] == s["faults_injected"] == 2
    assert s["final_world_size"] == 2 and s["storage_bytes_read"] == 0
    exc = s["excision"]
    assert exc["equal_to_excising_reference"] and exc["refused"] is None
    killed = sorted(f.rank for f in result.faults)
    assert sorted(r for e in exc["excisions"] for r in e["lost"]) == killed
    assert sorted(o.rank for o in result.faulted) == sorted(set(range(4)) - set(killed))
    # the same global batch and mean over fewer ranks: rounding only, far below one Adam step (lr 1e-3)
    assert 0 < exc["max_abs_diff_from_unfailed"] < 1e-4
    assert s["downtime_s"]["excise"] > 0
    view = json_view(s)
    assert view["final_world_size"] == 2 and view["excision"]["excisions"] == exc["excisions"]
    reasons = [r["reason"] for r in result.recoveries()]
    in_order = [f.rank for f in sorted(result.faults, key=lambda f: f.step)]  # one recovery per kill, in step order
    assert len(reasons) == 2, reasons
    assert all(why.startswith(f"rank(s) [{r_lost}] declared lost") for why, r_lost in zip(reasons, in_order)), reasons


def test_excising_below_min_ranks_stops_with_one_line_and_a_complete_checkpoint():
    result = trial(faults=2, min_ranks=3, **_RUN)
    s = result.summary()
    exc = s["excision"]
    assert exc["refused"] and "\n" not in exc["refused"] and "below --min-ranks 3" in exc["refused"]
    assert s["bit_identical"], s["mismatches"]  # the stopped state equals the excising reference's
    assert s["policy_counts"]["excise"] == 1 and s["faults_recovered"] == 1  # the second loss was refused
    flushed = Path(exc["flushed_checkpoint"])
    step = int(flushed.name.removeprefix("step"))
    assert exc["excisions"][-1]["step"] == step and str(flushed) in exc["refused"]
    # the world of three before the refused excision, every group rank's file (the lost rank's from its copy)
    assert Checkpointer(flushed.parent, 0, 3, 1).complete(step)
    assert sorted(p.name for p in flushed.glob("rank*")) == ["rank0", "rank1", "rank2"]
