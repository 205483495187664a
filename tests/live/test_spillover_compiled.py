"""The exportable decode steps compute what the serving loops' eager decoder does."""

from __future__ import annotations

import pytest
import torch

from meshpact.core.errors import MeshpactError
from meshpact.live.spillover.compiled import CompiledSteps, PartStep, StepModule, _Runner, step_latency
from meshpact.live.spillover.decoder import LAYERS, Decoder, scaled_spec, split_parts


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


def test_latency_is_the_mean_over_the_timed_steps_without_the_warmup(monkeypatch):
    from types import SimpleNamespace

    from meshpact.live.spillover import compiled

    clock = [0.0]
    seen = []

    def step(ids, pos):  # a step at position p takes p seconds on the module's clock
        assert ids.shape == (2,) and 0 <= int(ids.min()) and int(ids.max()) < 10
        seen.append(int(pos[0]))
        clock[0] += float(pos[0])

    monkeypatch.setattr(compiled, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    assert step_latency(step, 2, 10, steps=4, warmup=2) == (2 + 3 + 4 + 5) / 4
    assert seen == [0, 1, 2, 3, 4, 5]


def _eager_parts(decoder, parts):
    """Run ``decoder``'s steps through its :class:`PartStep` modules called eagerly: the same
    pure function the packages compile, with the same cache gathering and write-back."""
    decoder.compiled = _Runner({(p.first, p.last, t): PartStep(decoder, p, t).eval() for p, t in parts})
    return decoder


@pytest.mark.parametrize("family", ["dense", "minimax"])
def test_part_steps_write_the_caches_the_eager_decoder_writes_for_any_subset_of_slots(family):
    torch.set_num_threads(1)
    spec = scaled_spec(family)
    ref = Decoder(spec, 4, 16, seed=5)
    dec = Decoder(spec, 4, 16, seed=5)
    _eager_parts(dec, [(dec.whole, 1), (dec.whole, 3)])
    prompts = [[7, 9, 11], [150_000], [1, 2, 3, 4, 5, 6], [42, 43]]
    for s, p in enumerate(prompts):
        ref.prefill(s, p)
        dec.prefill(s, p)
    tokens = [p[-1] for p in prompts]
    for slots in ([0, 1, 2, 3], [3, 1], [2], [0, 2, 3]):  # rows of different lengths, in any order
        want = ref.step(slots, [tokens[s] for s in slots])
        got = dec.step(slots, [tokens[s] for s in slots])
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(dec.length, ref.length)
        for j, s in enumerate(slots):
            tokens[s] = int(want[j].argmax())
    assert torch.allclose(dec.k, ref.k, atol=1e-5) and torch.allclose(dec.v, ref.v, atol=1e-5)
    # a verification pass: three positions per row at each row's own start
    block = torch.tensor([[1, 2, 3], [4, 5, 6]])
    start = [int(ref.length[1]), int(ref.length[3])]
    assert torch.allclose(dec.score([1, 3], block, start), ref.score([1, 3], block, start), atol=1e-4, rtol=1e-4)
    with pytest.raises(MeshpactError, match="no compiled step for layers \\[0, 2\\) with 2 token"):
        dec.score([0], torch.tensor([[1, 2]]), [int(dec.length[0])])


def test_split_part_steps_cross_the_boundary_in_bf16_like_the_eager_parts():
    torch.set_num_threads(1)
    spec = scaled_spec("moe")
    first, last = split_parts(LAYERS, 1)
    a, b = Decoder(spec, 3, 12, seed=9), Decoder(spec, 3, 12, seed=9)
    ca, cb = Decoder(spec, 3, 12, seed=9), Decoder(spec, 3, 12, seed=9)
    for m, part in ((a, first), (b, last), (ca, first), (cb, last)):
        m.keep_only(part)
    _eager_parts(ca, [(first, 1)])
    _eager_parts(cb, [(last, 1)])
    for s in range(3):
        b.prefill_part(s, last, a.prefill_part(s, first, torch.tensor([s + 1, 5, 8])))
        cb.prefill_part(s, last, ca.prefill_part(s, first, torch.tensor([s + 1, 5, 8])))
    ids = torch.tensor([8, 8, 8])
    for slots in ([0, 1, 2], [2, 0]):
        h, ch = a.step_part(slots, first, ids[: len(slots)]), ca.step_part(slots, first, ids[: len(slots)])
        assert ch.dtype == torch.bfloat16 and ch.shape == h.shape
        assert torch.allclose(cb.step_part(slots, last, ch), b.step_part(slots, last, h), atol=2e-2)


def test_a_package_path_names_the_part_the_tokens_and_the_weights(tmp_path):
    spec = scaled_spec("dense")
    target = Decoder(spec, 2, 10, seed=1)
    steps = CompiledSteps(tmp_path)
    p1, p3 = steps.path(target, target.whole, 1), steps.path(target, target.whole, 3)
    assert p1 != p3 and p1.parent == tmp_path and "-l0-2-t1-len10-" in p1.name
    # other weights (a draft) never share a package; the same seeded weights always do
    target.compiled = lambda *a: None
    draft = target.perturbed(0.05, 3)
    assert steps.path(draft, target.whole, 1) != p1 and draft.compiled is None
    assert steps.path(Decoder(spec, 4, 10, seed=1), target.whole, 1) == p1
