"""Layouts people run: a vocabulary padded to a multiple of TP x 128, its padding masked."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from planning_facts import two_domain_mesh

from meshpact.core.checker import ViolationKind, check
from meshpact.core.contract import compile_contract
from meshpact.core.errors import FactError
from meshpact.core.facts import Consumer, DType, Edge, ProducerTensor, Request
from meshpact.core.interpreter import judge
from meshpact.core.lowerer import lower
from meshpact.core.placement import Partial, Replicate, Shard
from meshpact.core.plan import Plan

VOCAB, TP = 200, 2
PADDED = -(-VOCAB // (TP * 128)) * TP * 128  # 256: as Megatron and vLLM pad the embedding


def _padded(placement, request, dtype=DType.BFLOAT16, **args):
    mesh = two_domain_mesh(TP, 2)
    return Edge("padded", mesh, ProducerTensor("logits", "lm_head", (4, PADDED), dtype, "cuda@A", placement,
                                               vocab_size=VOCAB),
                Consumer("c", "cann@B", mesh.domains[1].ranks, request, **args))


@pytest.mark.parametrize("placement", [Shard(1), Shard(0), Replicate(), Partial("max")])
@pytest.mark.parametrize("request_, args", [
    (Request.TOKEN, {}), (Request.LOGPROB, {}), (Request.TOPK, {"k": 3}), (Request.TOKEN_LOGPROB, {}),
    (Request.SAMPLE, {"seed": 1, "temperature": 1.0}), (Request.OWNER_TOKEN, {"owners": (2, 3, 2, 3)}),
])
def test_padding_is_masked_and_never_observed(placement, request_, args):
    c = compile_contract(_padded(placement, request_, **args))
    plan = lower(c)
    assert check(plan, c).ok, [str(v) for v in check(plan, c).violations]
    assert all(judge(plan, c, seed).ok for seed in range(3))
    # the same plan without masking reads the padding (which holds the largest values): refused and wrong
    unmasked = Plan("e", "unmasked", tuple(replace(s, args={k: v for k, v in s.args if k != "valid"})
                                            for s in plan.steps))
    assert any(s.arg("valid") == VOCAB for s in plan.steps)
    assert ViolationKind.DEMAND_NOT_MET in check(unmasked, c).kinds
    assert not judge(unmasked, c).ok


def test_padded_tokens_are_real_columns():
    c = compile_contract(_padded(Shard(1), Request.TOKEN, dtype=DType.FLOAT32))
    from meshpact.core.interpreter import interpret, make_inputs

    inputs = make_inputs(c, 0)
    assert inputs.value[:, VOCAB:].min() > inputs.value[:, :VOCAB].max()  # the padding would win unmasked
    got = interpret(lower(c), c, inputs).observed[2]
    assert np.array_equal(got, np.argmax(inputs.value[:, :VOCAB], axis=-1)) and (got < VOCAB).all()


def test_vocab_size_applies_to_logits_only():
    with pytest.raises(FactError, match="vocab_size"):
        ProducerTensor("x", "o", (4, 256), DType.FLOAT32, "cuda@A", Shard(1), vocab_size=300)
    with pytest.raises(FactError, match="applies to logits requests"):
        _padded(Shard(1), Request.FULL)
    with pytest.raises(FactError, match="exceeds the vocabulary"):
        _padded(Shard(1), Request.TOPK, k=201)
