"""The exportable decode step computes what the serving loops' eager decoder does."""

from __future__ import annotations

import pytest
import torch

from meshpact.live.spillover.compiled import StepModule, step_latency
from meshpact.live.spillover.decoder import Decoder, scaled_spec


@pytest.mark.slow
@pytest.mark.parametrize("family", ["dense", "moe"])
def test_the_step_module_matches_the_decoder_step_by_step_at_every_row(family):
    torch.set_num_threads(1)
    spec = scaled_spec(family)
    dec = Decoder(spec, 3, 12, seed=6)
    module = StepModule(Decoder(spec, 3, 12, seed=6), 3)
    for s in range(3):
        dec.prefill(s, [1])  # an empty cache at position 0, as the module starts
    ids = torch.tensor([5, 151_000, 77])
    for i in range(4):
        ref = dec.step([0, 1, 2], ids.tolist())
        got = module(ids, torch.full((3,), i, dtype=torch.long))
        assert got.shape == (3, spec.vocab_size)
        assert torch.allclose(got, ref, atol=1e-3, rtol=1e-3)
        ids = ref.argmax(-1)
    # the cache holds what was written: a step at an earlier position sees fewer keys
    assert not torch.allclose(module(ids, torch.zeros(3, dtype=torch.long)), dec.step([0, 1, 2], ids.tolist()))


def test_latency_is_timed_over_the_positions_asked_for():
    seen = []
    assert step_latency(lambda ids, pos: seen.append(int(pos[0])), 2, 10, steps=4, warmup=2) >= 0
    assert seen == [0, 1, 2, 3, 4, 5]
