"""The requests serving engines make: top-k log-probabilities, token with its log-probability,
and seeded sampling, planned, checked and judged like the others."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from planning_facts import edge

from meshpact.core.checker import ViolationKind, check
from meshpact.core.contract import Form, compile_contract
from meshpact.core.errors import FactError
from meshpact.core.facts import Consumer, DType, Request
from meshpact.core.interpreter import interpret, judge, make_inputs, reference, sample_tokens
from meshpact.core.lowerer import lower
from meshpact.core.placement import Partial, Replicate, Shard
from meshpact.core.plan import Plan


def _edge(placement, request, **consumer):
    return edge(placement, request, shape=(6, 40), dtype=DType.BFLOAT16, **consumer)


@pytest.mark.parametrize("placement", [Shard(1), Shard(0), Replicate(), Partial("sum")])
@pytest.mark.parametrize(
    "request_, args",
    [(Request.TOPK, {"k": 5}), (Request.TOKEN_LOGPROB, {}), (Request.SAMPLE, {"seed": 7, "temperature": 0.7})],
)
def test_each_serving_request_is_planned_checked_and_right(placement, request_, args):
    c = compile_contract(_edge(placement, request_, **args))
    plan = lower(c)
    assert check(plan, c).ok, [str(v) for v in check(plan, c).violations]
    for seed in range(3):
        assert judge(plan, c, seed).ok
        assert judge(plan, c, seed, specials=True).ok
    crossing = [s for s in plan.steps if s.kind.value == "send"]
    width = {Request.TOPK: 5 * 16, Request.TOKEN_LOGPROB: 16, Request.SAMPLE: 8}[request_]
    assert [s.payload_bytes for s in crossing] == [6 * width]  # only the observation crosses


def test_topk_and_token_logprob_match_torch():
    c = compile_contract(_edge(Shard(1), Request.TOPK, k=4))
    inputs = make_inputs(c, 2)
    got = interpret(lower(c), c, inputs).observed[3]
    logits = torch.from_numpy(inputs.value)
    values, ids = torch.topk(logits, 4, dim=-1)
    assert np.array_equal(got[:, :4], ids.numpy())
    want = torch.log_softmax(logits, dim=-1).gather(1, ids).numpy()
    np.testing.assert_allclose(got[:, 4:], want, rtol=1e-6, atol=1e-6)
    c2 = compile_contract(_edge(Shard(1), Request.TOKEN_LOGPROB))
    pair = interpret(lower(c2), c2, make_inputs(c2, 2)).observed[3]
    assert np.array_equal(pair[:, 0], torch.argmax(logits, -1).numpy()) and np.allclose(pair[:, 1], want[:, 0])


def test_a_sample_is_the_full_logits_sample_with_the_same_seed_bitwise():
    c = compile_contract(_edge(Shard(1), Request.SAMPLE, seed=11, temperature=1.3))
    inputs = make_inputs(c, 4)
    got = interpret(lower(c), c, inputs).observed[3]
    assert np.array_equal(got, sample_tokens(inputs.value, 11, 1.3))
    assert got.dtype == np.int64 and np.array_equal(got, reference(c, inputs)[3])
    # the seed matters, and the draws follow softmax(x / T): a dominant logit almost always wins
    others = {tuple(sample_tokens(inputs.value, s, 1.3)) for s in range(20)}
    assert len(others) > 1
    peaked = np.zeros((1, 40))
    peaked[0, 17] = 40.0
    assert all(sample_tokens(peaked, s, 1.0)[0] == 17 for s in range(50))


def test_a_plan_with_the_wrong_k_or_seed_is_refused_and_wrong():
    for request_, args, change in [
        (Request.TOPK, {"k": 5}, {"k": 3}),
        (Request.SAMPLE, {"seed": 7, "temperature": 1.0}, {"seed": 8}),
    ]:
        c = compile_contract(_edge(Replicate(), request_, **args))
        plan = lower(c)
        i = next(i for i, s in enumerate(plan.steps) if s.op == request_.value)
        bad_step = replace(plan.steps[i], args={**dict(plan.steps[i].args), **change})
        mutant = Plan("e", "mutant", plan.steps[:i] + (bad_step,) + plan.steps[i + 1 :])
        report = check(mutant, c)
        assert ViolationKind.DEMAND_NOT_MET in report.kinds or ViolationKind.PAYLOAD_MISMATCH in report.kinds
        assert not judge(mutant, c).ok


def test_the_contract_states_the_new_forms():
    c = compile_contract(_edge(Shard(1), Request.TOPK, k=3))
    assert {o.form for o in c.demand.observations} == {Form.TOPK}
    assert c.demand.observations[0].shape == (6, 6) and c.demand.observations[0].dtype is DType.FLOAT64
    assert c.substitutability.equivalence.value == "bitwise"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"request": Request.TOPK}, "k"),
        ({"request": Request.TOPK, "k": 0}, "k"),
        ({"request": Request.TOKEN, "k": 3}, "k"),
        ({"request": Request.SAMPLE, "temperature": 0.0}, "temperature"),
        ({"request": Request.SAMPLE, "seed": -1}, "seed"),
        ({"request": Request.TOKEN, "seed": 1}, "seed"),
    ],
)
def test_request_parameters_are_validated(kwargs, field):
    with pytest.raises(FactError, match=field):
        Consumer("c", "cann@B", (3,), **kwargs)


def test_a_vocabulary_sharded_sample_gathers_pairs_not_logits():
    c = compile_contract(_edge(Shard(1), Request.SAMPLE, seed=3, temperature=0.9))
    plan = lower(c)
    ops = [s.op for s in plan.steps]
    assert "local_sample_max_arg" in ops and "topk" not in ops
    gather = next(s for s in plan.steps if s.op == "gather")
    assert gather.payload_bytes == 3 * 6 * 16  # three shards' (perturbed max, index) pairs per row
    assert check(plan, c).ok and all(judge(plan, c, s, specials=True).ok for s in range(5))
    i = ops.index("local_sample_max_arg")
    reseeded = replace(plan.steps[i], args={**dict(plan.steps[i].args), "seed": 4})
    mutant = Plan("e", "mutant", plan.steps[:i] + (reseeded,) + plan.steps[i + 1 :])
    assert ViolationKind.DEMAND_NOT_MET in check(mutant, c).kinds and not judge(mutant, c).ok
