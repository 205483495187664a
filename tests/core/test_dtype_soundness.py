"""The planning core on every dtype and size: the reproducers of wrong-but-accepted plans.

Each test builds the edge a stranger would, runs the lowerer's plan through the checker and
the numeric interpreter on the data that used to go wrong, and compares with what one
device (numpy, or torch where the test can import it) gives.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from planning_facts import edge

from meshpact.core.checker import check
from meshpact.core.contract import compile_contract
from meshpact.core.facts import DType, Request
from meshpact.core.interpreter import (
    combine_max_arg,
    fold,
    interpret,
    judge,
    judge_inputs,
    local_max_arg,
    make_inputs,
    native_reduce,
    reference,
)
from meshpact.core.lowerer import lower
from meshpact.core.numerics import round_bfloat16, round_to, unit_roundoff
from meshpact.core.placement import Partial, Shard
from meshpact.core.plan import Plan, Step, StepKind


def _observe(contract, value):
    """Run the lowerer's plan on ``value`` (whole tensor, split as the placement says)."""
    plan = lower(contract)
    assert check(plan, contract).ok
    inputs = make_inputs(contract)
    holdings = contract.provenance.holdings
    local = {
        h.rank: value[tuple(slice(iv[0][0], iv[0][1]) if iv else slice(0, 0) for iv in h.region)] for h in holdings
    }
    inputs = type(inputs)(value=value, local=local, ids=inputs.ids)
    ex = interpret(plan, contract, inputs)
    return ex, inputs


# -- indices travel as int64 ------------------------------------------------------------------


def test_int64_logits_above_two_to_the_24_pick_the_true_token():
    c = compile_contract(edge(Shard(1), Request.TOKEN, shape=(1, 4), n=2, dtype=DType.INT64))
    value = np.array([[16777216, 0, 16777217, 0]], np.int64)
    ex, _ = _observe(c, value)
    assert all(ex.observed[r].tolist() == [2] for r in c.edge.consumer.ranks)
    assert int(torch.argmax(torch.from_numpy(value), dim=-1)) == 2


def test_global_indices_beyond_two_to_the_24_are_exact():
    x = np.array([[0.5, 2.0, 1.0], [7.0, 7.0, 1.0]], np.float32)
    base = 2**24 + 1
    pairs = np.concatenate([local_max_arg(x[:, :1], base - 1), local_max_arg(x[:, 1:], base)], axis=1)
    assert combine_max_arg(pairs).tolist() == [base, base - 1]
    far = 2**40 + 3  # a logical vocabulary far beyond float32's integers
    assert combine_max_arg(local_max_arg(x, far)).tolist() == [far + 1, far]


@pytest.mark.slow
def test_a_vocabulary_of_two_to_the_24_plus_8_gives_the_last_column():
    vocab = 2**24 + 8
    c = compile_contract(edge(Shard(1), Request.TOKEN, shape=(1, vocab), n=2, m=1, dtype=DType.FLOAT16))
    value = np.zeros((1, vocab), np.float16)
    value[0, 16777217] = 1
    ex, _ = _observe(c, value)
    assert ex.observed[c.edge.consumer.ranks[0]].tolist() == [16777217]


# -- NaN and -inf follow torch ----------------------------------------------------------------


def test_a_row_with_nan_gives_the_nan_index_as_torch_argmax():
    c = compile_contract(edge(Shard(1), Request.TOKEN, shape=(2, 6), n=3))
    value = np.array([[0, 1, 2, np.nan, 9, np.nan], [1, 2, 3, 4, 5, 6]], np.float32)
    ex, _ = _observe(c, value)
    want = torch.argmax(torch.from_numpy(value), dim=-1).tolist()
    assert want == [3, 5]
    assert all(ex.observed[r].tolist() == want for r in c.edge.consumer.ranks)


def test_an_all_minus_inf_row_with_an_empty_shard_gives_index_zero():
    c = compile_contract(edge(Shard(1), Request.TOKEN, shape=(1, 2), n=3))  # shards of 1, 1 and 0 columns
    assert any(not h.region[1] for h in c.provenance.holdings)
    value = np.full((1, 2), -np.inf, np.float32)
    ex, _ = _observe(c, value)
    assert all(ex.observed[r].tolist() == [0] for r in c.edge.consumer.ranks)
    assert torch.argmax(torch.from_numpy(value), dim=-1).tolist() == [0]


def test_log_probabilities_of_nan_and_minus_inf_rows_match_torch():
    c = compile_contract(edge(Shard(1), Request.LOGPROB, shape=(3, 5), n=2))
    value = np.array([[0, 1, np.nan, 2, 3], [-np.inf] * 5, [-np.inf, -np.inf, 1, 2, 0]], np.float32)
    ex, inputs = _observe(c, value)
    want = torch.log_softmax(torch.from_numpy(value), dim=-1)[torch.arange(3), torch.from_numpy(inputs.ids)]
    got = ex.observed[c.edge.consumer.ranks[0]]
    assert np.array_equal(np.isnan(got), torch.isnan(want).numpy())
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


# -- dtype-faithful arithmetic ------------------------------------------------------------------


def test_bfloat16_rounding_is_torchs_bit_for_bit():
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            rng.standard_normal(20000).astype(np.float32) * 1e3,
            np.array([1 + 2**-8, 1 + 3 * 2**-8, 3.4e38, -3.4e38, np.inf, -np.inf, 0.0], np.float32),
        ]
    )
    want = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    assert np.array_equal(round_bfloat16(x), want)


@pytest.mark.parametrize("dtype, tdtype", [(DType.BFLOAT16, torch.bfloat16), (DType.FLOAT16, torch.float16)])
def test_folds_in_half_precision_carry_torchs_bits(dtype, tdtype):
    rng = np.random.default_rng(1)
    xs = [round_to(rng.standard_normal(4096) * 4, dtype) for _ in range(5)]
    ts = [torch.from_numpy(np.asarray(x, np.float32)).to(tdtype) for x in xs]
    want = ts[0]
    for t in ts[1:]:
        want = want + t
    got = fold(xs, "sum", dtype)
    assert np.array_equal(np.asarray(got, np.float32), want.float().numpy())
    assert not np.array_equal(
        np.asarray(got, np.float32), np.sum([np.asarray(x, np.float64) for x in xs], 0).astype(np.float32)
    )  # really rounded at every step
    ring = native_reduce(xs, "sum", dtype)
    assert not np.array_equal(ring, got)


def test_bfloat16_partial_logprob_is_judged_under_a_bound_derived_from_dtype_and_addends():
    c = compile_contract(edge(Partial("sum"), Request.LOGPROB, shape=(8, 16), n=3, dtype=DType.BFLOAT16))
    tol = c.substitutability.tolerance
    assert tol is not None and tol.per_row
    assert tol.scaled >= 4 * 3 * unit_roundoff(DType.BFLOAT16) and "bfloat16" in tol.why and "3" in tol.why
    plan = lower(c)
    assert check(plan, c).ok
    for seed in range(20):
        assert judge(plan, c, seed).ok
    # a float32 floor alone would not hold: the bf16 ring sum really moves the log-probabilities
    inputs = make_inputs(c, 0)
    got = interpret(plan, c, inputs).observed[c.edge.consumer.ranks[0]]
    assert np.max(np.abs(got - reference(c, inputs)[c.edge.consumer.ranks[0]])) > 1e-4


def test_a_missing_addend_is_outside_the_derived_bound():
    c = compile_contract(edge(Partial("sum"), Request.REDUCED, shape=(6, 10), n=3, dtype=DType.FLOAT16))
    plan = lower(c)
    assert check(plan, c).ok and judge(plan, c).ok
    inputs = make_inputs(c)
    zeroed = dict(inputs.local)
    zeroed[1] = np.zeros_like(zeroed[1])
    wrong = type(inputs)(value=inputs.value, local=zeroed, ids=inputs.ids, addends=inputs.addends)
    assert not judge_inputs(plan, c, wrong).ok


def test_judge_always_returns_a_verdict():
    c = compile_contract(edge(Shard(0), Request.FULL))
    rootless = Plan(
        "e", "t", (Step(StepKind.COLLECTIVE, "gather", (0, 1, 2), ("x",), "g", 0, "float32", args={"dim": 0}),)
    )
    verdict = judge(rootless, c)
    assert not verdict.ok and "root" in verdict.reason
