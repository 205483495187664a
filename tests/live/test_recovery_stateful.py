"""A StatefulDataLoader registered with resilient(state=...) (the shipped ``streamed`` workload,
whose batches are drawn from it, not a pure function of the step) keeps its position through
an in-memory recovery, a peer restore and an excision (where the survivors continue the lost
rank's loader): the run ends bit-identical to its reference, the
loader's committed position included (it is part of the job state both compare)."""

from __future__ import annotations

import pytest
import torch
from _recovery import assert_identical, trial

from meshpact.live.recovery.state import SCHEDULE_KEY, _schedule_from

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def _position(result, rank: int, name: str = "data") -> dict:
    from pathlib import Path

    recording = Path(result.summary()["recording"])
    final = torch.load(recording.parent / "faulted" / f"final-rank{rank}.pt", weights_only=True)
    return dict(_schedule_from(final[SCHEDULE_KEY]).objects)[name]


@pytest.mark.parametrize("kind,policy", [("collective", "in_memory"), ("kill", "peer_restore")])
def test_a_data_loaders_position_survives_recovery_bit_for_bit(kind, policy):
    result = trial(
        workload="streamed", ranks=2, steps=6, faults=1, fault_kind=kind, checkpoint_every=3, baselines=False
    )
    assert_identical(result, faults_recovered=1, **{policy: 1})
    assert _position(result, 0)["_sampler_iter_yielded"] == 6  # six batches read, none twice, none skipped


def test_a_lost_ranks_data_position_continues_on_the_survivor_after_an_excision():
    """Rank 0 is killed in step 3 and excised: the survivor takes its loader from its committed
    copy and draws its samples of steps 3-5 from there, so it ends six batches in, none twice,
    none skipped, registered as data@rank0 beside its own."""
    result = trial(
        workload="streamed",
        ranks=2,
        steps=6,
        faults=1,
        fault_kind="kill",
        on_rank_loss="excise",
        checkpoint_every=3,
        baselines=False,
    )
    assert_identical(result, faults_recovered=1, excise=1)
    assert _position(result, 1)["_sampler_iter_yielded"] == 6
    assert _position(result, 1, "data@rank0")["_sampler_iter_yielded"] == 6
