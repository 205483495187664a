"""Each kind of violation the checker reports, shown on a mutated plan that really goes wrong.

Every test starts from the lowerer's plan (which passes both the checker and the numeric
interpreter), breaks it the way a careless planner would, and asserts two independent
things: the checker names the violation, and the numeric interpreter shows the damage
(wrong values, missing data, data seen by a non-owner, a collective that cannot run).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from planning_facts import edge

from meshpact.core.checker import ViolationKind, check
from meshpact.core.contract import compile_contract
from meshpact.core.facts import DType, LinkClass, Request
from meshpact.core.interpreter import interpret, judge, leaks, make_inputs, reference
from meshpact.core.lowerer import lower
from meshpact.core.placement import Partial, Replicate, Shard
from meshpact.core.plan import Plan, Step, StepKind, plan_cost


def _find(plan: Plan, op: str) -> int:
    return next(i for i, s in enumerate(plan.steps) if s.op == op)


def _with(plan: Plan, steps) -> Plan:
    return Plan(plan.edge, "mutant", tuple(steps))


def _baseline(contract):
    plan = lower(contract)
    assert check(plan, contract).ok and judge(plan, contract).ok
    return plan


def _rejected(plan, contract, kind: ViolationKind) -> str:
    report = check(plan, contract)
    assert kind in report.kinds, [str(v) for v in report.violations]
    v = next(v for v in report.violations if v.kind is kind)
    assert v.reason and str(v).startswith(kind.value)
    return v.reason


def test_collective_across_domains_cannot_run():
    c = compile_contract(edge(Shard(1), Request.TOKEN))
    plan = _baseline(c)
    i = _find(plan, "broadcast")
    spanning = replace(plan.steps[i], ranks=plan.steps[i].ranks + (1,))
    mutant = _with(plan, plan.steps[:i] + (spanning,) + plan.steps[i + 1 :])
    assert "no native communicator" in _rejected(mutant, c, ViolationKind.CROSS_DOMAIN_COLLECTIVE)
    verdict = judge(mutant, c)
    assert not verdict.ok and "no native communicator spans" in verdict.reason


def test_input_not_present_means_missing_data():
    c = compile_contract(edge(Shard(1), Request.LOGPROB))
    plan = _baseline(c)
    mutant = _with(plan, [s for s in plan.steps if s.kind is not StepKind.SEND])
    assert "does not hold" in _rejected(mutant, c, ViolationKind.MISSING_INPUT)
    assert "holds no buffer" in judge(mutant, c).reason


def test_partial_reduced_twice_gives_wrong_values():
    c = compile_contract(edge(Partial("sum"), Request.REDUCED))
    plan = _baseline(c)
    i = _find(plan, "reduce")
    red = plan.steps[i]
    twice = (replace(red, op="all_reduce", args={"op": "sum"}), replace(red, inputs=(red.output,)))
    mutant = _with(plan, plan.steps[:i] + twice + plan.steps[i + 1 :])
    _rejected(mutant, c, ViolationKind.REDUCED_TWICE)
    inputs = make_inputs(c)
    seen = interpret(mutant, c, inputs).observed
    expected = reference(c, inputs)
    rank = c.edge.consumer.ranks[0]
    np.testing.assert_allclose(seen[rank], 3 * expected[rank], rtol=1e-4, atol=1e-3)  # three ranks: counted 3x


def test_partial_never_reduced_gives_wrong_values():
    c = compile_contract(edge(Partial("sum"), Request.REDUCED))
    plan = _baseline(c)
    i = _find(plan, "reduce")
    send = _find(plan, "send")
    steps = list(plan.steps)
    steps[send] = replace(steps[send], inputs=("x",))
    del steps[i]
    mutant = _with(plan, steps)
    assert "never completed" in _rejected(mutant, c, ViolationKind.NEVER_REDUCED)
    assert "differ" in judge(mutant, c).reason or "outside" in judge(mutant, c).reason


def test_projection_of_a_partial_picks_wrong_tokens():
    c = compile_contract(edge(Partial("sum"), Request.TOKEN))
    plan = _baseline(c)
    i = _find(plan, "argmax")
    steps = list(plan.steps)
    steps[i] = replace(steps[i], inputs=("x",))
    mutant = _with(plan, steps)
    assert "not the projection of the sum" in _rejected(mutant, c, ViolationKind.PROJECTION_OF_PARTIAL)
    assert "not bitwise equal" in judge(mutant, c).reason


def test_consumer_without_its_demand_sees_the_wrong_chunk():
    c = compile_contract(edge(Shard(1), Request.SHARD, shape=(6, 10)))
    plan = _baseline(c)
    i = _find(plan, "scatter")
    steps = list(plan.steps)
    steps[i] = replace(steps[i], args={**dict(steps[i].args), "dim": 0})
    mutant = _with(plan, steps)
    _rejected(mutant, c, ViolationKind.DEMAND_NOT_MET)
    assert "shape" in judge(mutant, c).reason


def test_a_consumer_left_out_ends_without_data():
    c = compile_contract(edge(Shard(1), Request.TOKEN))
    plan = _baseline(c)
    mutant = _with(
        plan,
        [s for s in plan.steps if s.op != "broadcast"][:-1]
        + [replace(plan.steps[-1], ranks=plan.steps[-1].ranks[:1], inputs=(plan.steps[_find(plan, "send")].output,))],
    )
    assert "ends without" in _rejected(mutant, c, ViolationKind.DEMAND_NOT_MET)
    assert "nothing observed" in judge(mutant, c).reason


def test_distributed_logsoftmax_is_not_a_substitute_for_an_exact_consumer():
    tolerant = compile_contract(edge(Shard(1), Request.LOGPROB, shape=(16, 300)))
    exact = compile_contract(edge(Shard(1), Request.LOGPROB, shape=(16, 300), exact=True))
    plan = _baseline(tolerant)
    assert any(s.op == "combine_lse_stats" for s in plan.steps)
    assert "bitwise" in _rejected(plan, exact, ViolationKind.DISALLOWED_SUBSTITUTE)
    assert "not bitwise equal" in judge(plan, exact).reason
    assert judge(plan, tolerant).ok  # within the stated tolerance
    assert not any(s.op == "combine_lse_stats" for s in _baseline(exact).steps)


def test_native_sum_is_not_a_substitute_for_full_bit_for_bit():
    c = compile_contract(edge(Partial("sum"), Request.FULL, shape=(8, 64)))
    plan = _baseline(c)
    assert not any(s.op == "reduce" for s in plan.steps)  # the lowerer sums in the reference order
    gather = _find(plan, "gather")
    total = _find(plan, "sum")
    native = replace(
        plan.steps[gather],
        op="reduce",
        args={"op": "sum", "root": plan.steps[gather].arg("root")},
        output=plan.steps[total].output,
    )
    mutant = _with(plan, plan.steps[:gather] + (native,) + plan.steps[total + 1 :])
    _rejected(mutant, c, ViolationKind.DISALLOWED_SUBSTITUTE)
    assert "not bitwise equal" in judge(mutant, c).reason


def test_non_owner_holding_owner_rows_is_caught_numerically():
    c = compile_contract(edge(Shard(1), Request.OWNER_TOKEN, shape=(6, 10), consumers=(3, 4)))
    plan = _baseline(c)
    tok = plan.steps[_find(plan, "combine_max_arg")].output
    peek = Step(StepKind.SEND, "send", (0, 4), (tok,), "peek", 48, DType.INT64, None, LinkClass.ETHERNET)
    mutant = _with(plan, plan.steps[:-1] + (peek,) + plan.steps[-1:])
    assert "owned by" in _rejected(mutant, c, ViolationKind.NON_OWNER_OBSERVES)
    inputs = make_inputs(c)
    ex = interpret(mutant, c, inputs)
    assert any(rank == 4 for rank, _ in leaks(ex, c, inputs))
    assert not leaks(interpret(plan, c, inputs), c, inputs)
    assert "owned by another rank" in judge(mutant, c).reason


def test_identical_complete_copies_from_two_senders_pass_and_summing_them_is_reduced_twice():
    c = compile_contract(edge(Replicate(), Request.FULL, consumers=(3,)))
    plan = _baseline(c)
    send = plan.steps[_find(plan, "send")]
    second = replace(send, ranks=(1, send.ranks[1]), output="again")
    twice = _with(plan, (send, second, replace(plan.steps[-1], inputs=("again",), output="again")))
    assert check(twice, c).ok and judge(twice, c).ok  # the same bits, whoever sends them
    both = Step(StepKind.PROJECT, "sum", (3,), (send.output, "again"), "both", 0, DType.FLOAT32, "cann@B")
    mutant = _with(plan, (send, second, both, replace(plan.steps[-1], inputs=("both",), output="both")))
    assert "counts it 2 times" in _rejected(mutant, c, ViolationKind.REDUCED_TWICE)
    assert "not bitwise equal" in judge(mutant, c).reason


def test_a_partial_addend_sent_by_two_ranks_has_two_authorities():
    c = compile_contract(edge(Partial("sum"), Request.FULL, consumers=(3,), shape=(4, 6)))
    nbytes = 4 * 6 * 4
    G = Step(
        StepKind.COLLECTIVE,
        "gather",
        (0, 1, 2),
        ("x",),
        "g",
        3 * nbytes,
        DType.FLOAT32,
        "cuda@A",
        LinkClass.FABRIC,
        {"dim": 0, "root": 1},
    )
    mine = Step(StepKind.SEND, "send", (0, 3), ("x",), "a0", nbytes, DType.FLOAT32, None, LinkClass.ETHERNET)
    all_ = Step(StepKind.SEND, "send", (1, 3), ("g",), "all", 3 * nbytes, DType.FLOAT32, None, LinkClass.ETHERNET)
    first = Step(
        StepKind.PROJECT,
        "slice",
        (3,),
        ("all",),
        "rest",
        0,
        DType.FLOAT32,
        "cann@B",
        None,
        {"dim": 0, "start": 4, "stop": 12},
    )
    total = Step(
        StepKind.PROJECT, "sum", (3,), ("a0", "all"), "sum", 0, DType.FLOAT32, "cann@B", None, {"dim": 0, "parts": 2}
    )
    mutant = Plan(
        "e",
        "mutant",
        (G, mine, all_, first, total, Step(StepKind.DELIVER, "deliver", (3,), ("sum",), "sum", 0, DType.FLOAT32)),
    )
    assert "already sends" in _rejected(mutant, c, ViolationKind.DUPLICATE_SENDER)
    assert not judge(mutant, c).ok


def test_delivery_before_completion_observes_one_addend():
    c = compile_contract(edge(Partial("sum"), Request.REDUCED, consumers=(3,)))
    plan = _baseline(c)
    send = plan.steps[_find(plan, "send")]
    early = replace(send, inputs=("x",))
    deliver = plan.steps[-1]
    mutant = _with(plan, (early, deliver) + plan.steps[:-1])
    assert "after the delivery" in _rejected(mutant, c, ViolationKind.DELIVERY_BEFORE_COMPLETION)
    assert not judge(mutant, c).ok


def test_malformed_step_cannot_run():
    c = compile_contract(edge(Shard(1), Request.OWNER_TOKEN, consumers=(3, 4)))
    plan = _baseline(c)
    i = _find(plan, "slice")
    steps = list(plan.steps)
    steps[i] = replace(steps[i], args={"dim": 0, "index": [[0, 99]]})
    mutant = _with(plan, steps)
    _rejected(mutant, c, ViolationKind.MALFORMED_STEP)
    assert "cannot" in judge(mutant, c).reason


def test_every_violation_kind_has_a_demonstration():
    import inspect
    import sys

    source = inspect.getsource(sys.modules[__name__])
    missing = [
        k for k in ViolationKind if f"ViolationKind.{k.name}" not in source.replace("ViolationKind.{k.name}", "")
    ]
    assert not missing


@pytest.mark.parametrize("request_", [Request.TOKEN, Request.LOGPROB, Request.FULL])
def test_an_empty_plan_is_rejected(request_):
    c = compile_contract(edge(Shard(1), request_))
    report = check(Plan("e", "empty", ()), c)
    assert not report.ok and report.kinds == {ViolationKind.DEMAND_NOT_MET}
    assert not judge(Plan("e", "empty", ()), c).ok


# -- declared figures are verified, not trusted ------------------------------------------------


def test_declared_payload_bytes_are_recomputed_from_shapes_and_dtypes():
    c = compile_contract(edge(Shard(1), Request.LOGPROB, shape=(6, 10), dtype=DType.BFLOAT16))
    plan = _baseline(c)
    zeroed = _with(plan, [replace(s, payload_bytes=0) for s in plan.steps])
    report = check(zeroed, c)
    wrong = [v for v in report.violations if v.kind is ViolationKind.PAYLOAD_MISMATCH]
    assert len(wrong) == plan.startups and all(v.step is not None and v.rank is not None for v in wrong)
    assert "declares 0 payload bytes" in wrong[0].reason
    assert plan_cost(zeroed, c.edge.mesh).time_s < plan_cost(plan, c.edge.mesh).time_s  # the lie would win
    doubled = _with(
        plan, [replace(s, payload_bytes=2 * s.payload_bytes) if s.kind is StepKind.SEND else s for s in plan.steps]
    )
    assert ViolationKind.PAYLOAD_MISMATCH in check(doubled, c).kinds


def test_a_cross_host_send_labelled_fabric_is_a_link_mismatch():
    c = compile_contract(edge(Shard(1), Request.TOKEN))
    plan = _baseline(c)
    i = _find(plan, "send")
    assert plan.steps[i].link is LinkClass.ETHERNET
    relabelled = _with(plan, plan.steps[:i] + (replace(plan.steps[i], link=LinkClass.FABRIC),) + plan.steps[i + 1 :])
    reason = _rejected(relabelled, c, ViolationKind.LINK_MISMATCH)
    assert "ethernet" in reason and "fabric" in reason
    v = next(v for v in check(relabelled, c).violations if v.kind is ViolationKind.LINK_MISMATCH)
    assert (v.step, v.rank) == (i, plan.steps[i].ranks[0])
    assert plan_cost(relabelled, c.edge.mesh).time_s < plan_cost(plan, c.edge.mesh).time_s


def test_partials_completed_on_the_consumer_side_break_the_completion_facet():
    from meshpact.core.baselines import layout_only

    c = compile_contract(edge(Partial("sum"), Request.FULL, shape=(6, 10)))
    assert c.completion.inside_domain == "cuda@A"
    plan = layout_only(c)  # every addend hops the bridge and is summed in the consumer's domain
    reason = _rejected(plan, c, ViolationKind.COMPLETED_OUTSIDE_DOMAIN)
    assert "cann@B" in reason and "cuda@A" in reason
    mesh = c.edge.mesh
    crossing = plan_cost(plan, mesh).bytes_by_link["ethernet"]
    assert crossing == 3 * plan_cost(_baseline(c), mesh).bytes_by_link["ethernet"]  # three addends instead of one value
