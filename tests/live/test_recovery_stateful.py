"""A StatefulDataLoader registered with resilient(state=...) (the shipped ``streamed`` workload,
whose batches are drawn from it, not a pure function of the step) keeps its position through
an in-memory recovery and a peer restore: the run ends bit-identical to its reference, the
loader's committed position included (it is part of the job state both compare)."""

from __future__ import annotations

import pytest
import torch
from _recovery import assert_identical, trial

from meshpact.live.recovery.state import SCHEDULE_KEY, _schedule_from

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning")]


def _position(result, rank: int) -> dict:
    from pathlib import Path

    recording = Path(result.summary()["recording"])
    final = torch.load(recording.parent / "faulted" / f"final-rank{rank}.pt", weights_only=True)
    return dict(_schedule_from(final[SCHEDULE_KEY]).objects)["data"]


@pytest.mark.parametrize("kind,policy", [("collective", "in_memory"), ("kill", "peer_restore")])
def test_a_data_loaders_position_survives_recovery_bit_for_bit(kind, policy):
    result = trial(workload="streamed", ranks=2, steps=6, faults=1, fault_kind=kind, checkpoint_every=3,
                   baselines=False)
    assert_identical(result, faults_recovered=1, **{policy: 1})
    assert _position(result, 0)["_sampler_iter_yielded"] == 6  # six batches read, none twice, none skipped
