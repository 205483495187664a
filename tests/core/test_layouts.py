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
from meshpact.core.plan import Plan, Step, StepKind

VOCAB, TP = 200, 2
PADDED = -(-VOCAB // (TP * 128)) * TP * 128  # 256: as Megatron and vLLM pad the embedding


def _padded(placement, request, dtype=DType.BFLOAT16, **args):
    mesh = two_domain_mesh(TP, 2)
    return Edge(
        "padded",
        mesh,
        ProducerTensor("logits", "lm_head", (4, PADDED), dtype, "cuda@A", placement, vocab_size=VOCAB),
        Consumer("c", "cann@B", mesh.domains[1].ranks, request, **args),
    )


@pytest.mark.parametrize("placement", [Shard(1), Shard(0), Replicate(), Partial("max")])
@pytest.mark.parametrize(
    "request_, args",
    [
        (Request.TOKEN, {}),
        (Request.LOGPROB, {}),
        (Request.TOPK, {"k": 3}),
        (Request.TOKEN_LOGPROB, {}),
        (Request.SAMPLE, {"seed": 1, "temperature": 1.0}),
        (Request.OWNER_TOKEN, {"owners": (2, 3, 2, 3)}),
    ],
)
def test_padding_is_masked_and_never_observed(placement, request_, args):
    c = compile_contract(_padded(placement, request_, **args))
    plan = lower(c)
    assert check(plan, c).ok, [str(v) for v in check(plan, c).violations]
    assert all(judge(plan, c, seed).ok for seed in range(3))
    # the same plan without masking reads the padding (which holds the largest values): refused and wrong
    unmasked = Plan(
        "e", "unmasked", tuple(replace(s, args={k: v for k, v in s.args if k != "valid"}) for s in plan.steps)
    )
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


def _grid(placement, request, consumers=(4, 5), **args):
    mesh = two_domain_mesh(4, 2)  # producer: 2 DP groups x 2 TP ranks
    dom = mesh.domain_of(consumers[0]).name
    return Edge(
        "grid",
        mesh,
        ProducerTensor("x", "op", (6, 10), DType.FLOAT32, "cuda@A", placement, dp=2),
        Consumer("c", dom, tuple(consumers), request, **args),
    )


@pytest.mark.parametrize("placement", [Shard(1), Shard(0), Replicate()])
@pytest.mark.parametrize(
    "request_, args, consumers",
    [
        (Request.FULL, {}, (4, 5)),
        (Request.TOKEN, {}, (4, 5)),
        (Request.LOGPROB, {}, (4,)),
        (Request.SHARD, {"shard_dim": 1}, (4, 5)),
        (Request.TOPK, {"k": 2}, (5,)),
        (Request.TOKEN, {}, (1, 2)),
        (Request.OWNER_TOKEN, {"owners": (4, 4, 4, 5, 5, 5)}, (4, 5)),
    ],
)
def test_a_dp_by_tp_producer_is_assembled_group_by_group(placement, request_, args, consumers):
    c = compile_contract(_grid(placement, request_, consumers, **args))
    holdings = {h.rank: h.region for h in c.provenance.holdings}
    rows = {r: holdings[r][0][0] if holdings[r][0] else (0, 0) for r in holdings}
    assert all(0 <= rows[r][0] and rows[r][1] <= 3 for r in (0, 1))  # group 0 holds rows 0..3
    assert all(3 <= rows[r][0] and rows[r][1] <= 6 for r in (2, 3))  # group 1 rows 3..6
    plan = lower(c)
    assert check(plan, c).ok, [str(v) for v in check(plan, c).violations]
    assert all(judge(plan, c, seed).ok for seed in range(3))
    # a flat all-gather over the four ranks would interleave the groups' blocks: refused and wrong
    if placement == Shard(1):
        flat = Plan(
            "e",
            "flat",
            (
                Step(
                    StepKind.COLLECTIVE,
                    "gather",
                    (0, 1, 2, 3),
                    ("x",),
                    "g",
                    240,
                    DType.FLOAT32,
                    "cuda@A",
                    None,
                    {"dim": 1, "root": 0},
                ),
            )
            + tuple(s for s in plan.steps if s.kind is not StepKind.COLLECTIVE or s.domain != "cuda@A"),
        )
        assert not check(flat, c).ok


def test_grid_layouts_are_validated():
    with pytest.raises(FactError, match="does not divide"):
        Edge(
            "g",
            two_domain_mesh(3, 2),
            ProducerTensor("x", "op", (6, 10), DType.FLOAT32, "cuda@A", Shard(1), dp=2),
            Consumer("c", "cann@B", (3,), Request.TOKEN),
        )
    with pytest.raises(FactError, match="Shard or Replicate inside"):
        ProducerTensor("x", "op", (6, 10), DType.FLOAT32, "cuda@A", Partial("sum"), dp=2)
