"""Contracts compiled from facts, and the interpreter's step semantics that the live executor mirrors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from planning_facts import edge

from meshpact.core.contract import Equivalence, Form, compile_contract
from meshpact.core.errors import FactError, PlanError
from meshpact.core.facts import DType, Request
from meshpact.core.interpreter import (
    equivalent,
    fold,
    interpret,
    make_inputs,
    native_reduce,
    reference,
    reference_logprob,
)
from meshpact.core.placement import Partial, Replicate, Shard
from meshpact.core.plan import Plan, Step, StepKind

FACETS = {"provenance", "substitutability", "completion", "authority", "demand", "locality"}


def test_contract_has_six_json_facets_and_is_deterministic():
    c = compile_contract(edge(Shard(1), Request.LOGPROB))
    doc = c.to_dict()
    assert set(doc) == FACETS
    assert json.dumps(doc, sort_keys=True) == json.dumps(
        compile_contract(edge(Shard(1), Request.LOGPROB)).to_dict(), sort_keys=True
    )
    assert [h["region"] for h in doc["provenance"]["holdings"]] == ["[0:6, 0:4]", "[0:6, 4:8]", "[0:6, 8:10]"]
    assert doc["locality"]["bridge"] == [0, 3] and doc["locality"]["cross_domain"]


def test_distributed_logsoftmax_is_not_bitwise_and_the_contract_says_so():
    sub = compile_contract(edge(Shard(1), Request.LOGPROB)).substitutability
    assert sub.equivalence is Equivalence.TOLERANCE and sub.tolerance is not None
    lse = next(s for s in sub.substitutes if s.name == "distributed_logsoftmax")
    assert lse.allowed and lse.equivalence is Equivalence.TOLERANCE and "not bitwise" in lse.reason
    exact = compile_contract(edge(Shard(1), Request.LOGPROB, exact=True)).substitutability
    assert exact.equivalence is Equivalence.BITWISE and not exact.allows("distributed_logsoftmax")


@pytest.mark.parametrize(
    "request_, equivalence",
    [
        (Request.TOKEN, Equivalence.BITWISE),
        (Request.FULL, Equivalence.BITWISE),
        (Request.REDUCED, Equivalence.TOLERANCE),
    ],
)
def test_native_reduction_of_three_float_addends_is_allowed_only_under_tolerance(request_, equivalence):
    c = compile_contract(edge(Partial("sum"), request_))
    assert c.substitutability.equivalence is equivalence
    assert c.exact_reduction is (equivalence is Equivalence.BITWISE)
    assert "reduced exactly once" in " ".join(c.completion.requirements)


def test_max_partials_and_two_addends_reduce_exactly_in_any_order():
    assert not compile_contract(edge(Partial("max"), Request.FULL)).exact_reduction
    assert not compile_contract(edge(Partial("sum"), Request.FULL, n=2)).exact_reduction


def test_owner_scope_and_silent_ranks():
    c = compile_contract(edge(Shard(1), Request.OWNER_TOKEN, consumers=(3, 4), owners=(3, 3, 3, 3, 3, 3)))
    assert c.demand.silent == (4,)
    assert c.demand.of(3).shape == (6,) and c.demand.of(3).form is Form.TOKEN
    assert c.authority.may_hold(3, ((0, 6),)) and not c.authority.may_hold(4, ((0, 1),))
    assert c.authority.may_hold(0, ((0, 6),))  # producer ranks hold every row


def test_bad_shard_dim_names_the_field():
    with pytest.raises(FactError, match="shard_dim"):
        compile_contract(edge(Shard(1), Request.SHARD, shard_dim=5))


# -- the interpreter's semantics ------------------------------------------------------------------


def test_native_sum_over_three_ranks_reassociates_but_stays_close():
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(4096).astype(np.float32) for _ in range(3)]
    ring, ref = native_reduce(xs, "sum"), fold(xs, "sum")
    assert not np.array_equal(ring, ref)
    np.testing.assert_allclose(ring, ref, rtol=1e-5, atol=1e-5)
    assert np.array_equal(native_reduce(xs[:2], "sum"), fold(xs[:2], "sum"))
    assert np.array_equal(native_reduce(xs, "max"), np.maximum(np.maximum(xs[0], xs[1]), xs[2]))


def test_reference_logprob_is_a_log_softmax():
    x = np.array([[0.0, np.log(3.0)]], np.float32)
    np.testing.assert_allclose(reference_logprob(x, np.array([1])), [np.log(0.75)], rtol=1e-6)


def _run(steps, c, inputs):
    return interpret(Plan("e", "t", tuple(steps)), c, inputs)


def test_collectives_follow_the_table():
    c = compile_contract(edge(Shard(0), Request.FULL, shape=(6, 4)))
    inputs = make_inputs(c)
    S = lambda *a, **k: Step(StepKind.COLLECTIVE, *a, dtype=DType.FLOAT32, **k)  # noqa: E731
    ex = _run(
        [
            S("all_gather", (0, 1, 2), ("x",), "g", 0, args={"dim": 0}),
            S("scatter", (0, 1, 2), ("g",), "s", 0, args={"dim": 1, "root": 1}),
            S("all_to_all", (0, 1, 2), ("x",), "a", 0, args={"split_dim": 1, "concat_dim": 0}),
            S("reduce_scatter", (0, 1, 2), ("g",), "r", 0, args={"dim": 0, "op": "max"}),
        ],
        c,
        inputs,
    )
    v = inputs.value
    cols = [(0, 2), (2, 4), (4, 4)]  # torch.chunk of 4 columns into 3: sizes 2, 2, 0
    for i, r in enumerate((0, 1, 2)):
        lo, hi = cols[i]
        assert np.array_equal(ex.buffers[r]["g"], v)
        assert np.array_equal(ex.buffers[r]["s"], v[:, lo:hi])
        assert np.array_equal(ex.buffers[r]["a"], v[:, lo:hi])
        assert np.array_equal(ex.buffers[r]["r"], v[2 * i : 2 * i + 2])


def test_projections_and_ties():
    c = compile_contract(edge(Replicate(), Request.TOKEN, shape=(2, 4)))
    inputs = make_inputs(c)
    x = np.array([[1, 5, 5, 0], [2, 2, 2, 2]], np.float32)
    inputs.local[0][...] = x
    P = lambda op, ins, out, **a: Step(StepKind.PROJECT, op, (0,), ins, out, 0, DType.FLOAT32, args=a)  # noqa: E731
    ex = _run(
        [
            P("argmax", ("x",), "t"),
            P("slice", ("x",), "lo", dim=1, start=0, stop=2),
            P("slice", ("x",), "hi", dim=1, start=2, stop=4),
            P("local_max_arg", ("lo",), "s0", offsets=[0]),
            P("local_max_arg", ("hi",), "s1", offsets=[2]),
            P("concat", ("s0", "s1"), "s", dim=1),
            P("combine_max_arg", ("s",), "tok"),
            P("slice", ("tok",), "mine", dim=0, index=[[1]]),
        ],
        c,
        inputs,
    )
    assert ex.buffers[0]["t"].tolist() == [1, 0]
    assert ex.buffers[0]["tok"].tolist() == [1, 0]  # lowest index wins ties across shards too
    assert ex.buffers[0]["mine"].tolist() == [0]


def test_lse_statistics_match_the_reference_within_tolerance():
    c = compile_contract(edge(Shard(1), Request.LOGPROB, shape=(5, 37)))
    inputs = make_inputs(c, seed=3)
    from meshpact.core.lowerer import lower

    seen = interpret(lower(c), c, inputs).observed
    for rank, exp in reference(c, inputs).items():
        assert equivalent(seen[rank], exp, c).ok


def test_interpreter_refuses_what_cannot_run():
    c = compile_contract(edge(Shard(1), Request.TOKEN))
    with pytest.raises(PlanError, match="no native communicator spans"):
        interpret(
            Plan(
                "e", "t", (Step(StepKind.COLLECTIVE, "all_gather", (0, 3), ("x",), "g", 0, "float32", args={"dim": 1}),)
            ),
            c,
        )
    with pytest.raises(PlanError, match="holds no buffer"):
        interpret(Plan("e", "t", (Step(StepKind.SEND, "send", (3, 0), ("x",), "g", 0, "float32"),)), c)


def test_partial_inputs_reduce_to_the_value_and_single_addends_mislead():
    c = compile_contract(edge(Partial("sum"), Request.TOKEN))
    inputs = make_inputs(c)
    assert np.array_equal(fold([inputs.local[r] for r in (0, 1, 2)], "sum"), inputs.value)
    wrong = sum(np.array_equal(np.argmax(inputs.local[r], -1), np.argmax(inputs.value, -1)) for r in (0, 1, 2))
    assert wrong == 0


def test_rooted_collectives_and_fixed_order_sums():
    c = compile_contract(edge(Partial("sum"), Request.FULL, shape=(4, 8)))
    inputs = make_inputs(c)
    S = lambda *a, **k: Step(StepKind.COLLECTIVE, *a, dtype=DType.FLOAT32, **k)  # noqa: E731
    ex = _run(
        [
            S("gather", (0, 1, 2), ("x",), "g", 0, args={"dim": 0, "root": 2}),
            Step(
                StepKind.PROJECT,
                "sum",
                (2,),
                ("g",),
                "total",
                0,
                DType.FLOAT32,
                args={"dim": 0, "parts": 3, "op": "sum"},
            ),
            S("broadcast", (2, 0, 1), ("total",), "b", 0, args={"root": 2}),
        ],
        c,
        inputs,
    )
    assert "g" not in ex.buffers[0] and ex.buffers[2]["g"].shape == (12, 8)
    assert np.array_equal(ex.buffers[2]["total"], inputs.value)  # rank-order fold: bitwise the reference
    assert all(np.array_equal(ex.buffers[r]["b"], inputs.value) for r in (0, 1, 2))
    assert [k for k, name, _ in ex.held[0]] == [2]  # rank 0 only ever received the broadcast
