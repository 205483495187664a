"""Plans that are numerically exact are accepted, and the cheaper exact choice is the lowerer's."""

from __future__ import annotations

import pytest

from planning_facts import edge

from meshpact.core.checker import ViolationKind, check
from meshpact.core.contract import compile_contract
from meshpact.core.facts import DType, Request
from meshpact.core.interpreter import judge
from meshpact.core.lowerer import complete_raw, lower
from meshpact.core.placement import Partial
from meshpact.core.plan import Plan, Step, StepKind
from meshpact.core.planbuild import PlanBuilder


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16, DType.INT64])
def test_partial_max_tokens_come_from_per_addend_pairs_exactly(dtype):
    c = compile_contract(edge(Partial("max"), Request.TOKEN, shape=(6, 40), n=3, dtype=dtype))
    plan = lower(c)
    assert [s.op for s in plan.steps if s.kind is StepKind.PROJECT][:2] == ["local_max_arg", "combine_max_arg"]
    assert check(plan, c).ok
    for seed in range(10):
        assert judge(plan, c, seed, specials=True).ok
    # the completing plan (reduce max, then argmax) moves the logits: the pairs are far cheaper
    build = PlanBuilder(c, "complete")
    raw = complete_raw(build, (0,))
    completing = build.plan()
    assert raw != c.provenance.tensor and plan.payload_bytes < completing.payload_bytes


def test_pairs_of_only_some_max_addends_are_still_refused():
    c = compile_contract(edge(Partial("max"), Request.TOKEN, shape=(6, 40), n=3))
    plan = lower(c)
    gather = next(i for i, s in enumerate(plan.steps) if s.op == "gather")
    g = plan.steps[gather]
    two = Step(
        g.kind, g.op, g.ranks[:2], g.inputs, g.output, 2 * g.payload_bytes // 3, g.dtype, g.domain, g.link, g.args
    )
    mutant = Plan("e", "mutant", plan.steps[:gather] + (two,) + plan.steps[gather + 1 :])
    assert ViolationKind.PROJECTION_OF_PARTIAL in check(mutant, c).kinds
    assert not judge(mutant, c).ok


def test_a_two_operand_sum_in_swapped_order_is_exact():
    c = compile_contract(edge(Partial("sum"), Request.FULL, shape=(4, 6), n=3, m=1, exact=True))
    nbytes = 4 * 6 * 4
    dom = "cuda@A"

    def gather(ranks, out):
        return Step(
            StepKind.COLLECTIVE,
            "gather",
            ranks,
            ("x",),
            out,
            len(ranks) * nbytes,
            DType.FLOAT32,
            dom,
            None,
            {"dim": 0, "root": 0},
        )

    def project(op, ins, out, **args):
        return Step(StepKind.PROJECT, op, (0,), ins, out, 0, DType.FLOAT32, dom, None, args)

    def fetch(rank, out):  # rank's addend onto rank 0
        return Step(
            StepKind.COLLECTIVE, "broadcast", (rank, 0), ("x",), out, nbytes, DType.FLOAT32, dom, None, {"root": rank}
        )

    steps = (
        gather((0, 1), "g01"),
        project("sum", ("g01",), "s01", dim=0, parts=2),
        fetch(2, "a2"),
        project("sum", ("a2", "s01"), "total"),  # a2 + (a0 + a1): one commutative addition
        Step(StepKind.SEND, "send", (0, 3), ("total",), "arrived", nbytes, DType.FLOAT32, None, "ethernet"),
        Step(StepKind.DELIVER, "deliver", (3,), ("arrived",), "arrived", 0, DType.FLOAT32),
    )
    plan = Plan("e", "swapped", steps)
    assert check(plan, c).ok
    assert all(judge(plan, c, seed).ok for seed in range(10))
    # (a2 + a0) + a1 is another association: not the reference bits, and refused
    bad = (
        gather((0, 2), "g02"),
        project("sum", ("g02",), "s02", dim=0, parts=2),
        fetch(1, "a1"),
        project("sum", ("s02", "a1"), "total"),
    ) + steps[4:]
    assert ViolationKind.DISALLOWED_SUBSTITUTE in check(Plan("e", "reassociated", bad), c).kinds
    assert not all(judge(Plan("e", "reassociated", bad), c, seed).ok for seed in range(10))


def test_argmax_after_a_native_reassociated_sum_is_still_refused():
    c = compile_contract(edge(Partial("sum"), Request.TOKEN, shape=(6, 40), n=3))
    build = PlanBuilder(c, "native")
    reduced = build.collective(
        "reduce",
        c.provenance.ranks,
        "x",
        build.name("reduced"),
        3 * 6 * 40 * 4,
        DType.FLOAT32,
        {"op": "sum", "root": 0},
    )
    token = build.project("argmax", (0,), reduced, build.name("token"), DType.INT64)
    arrived = build.send(0, 3, token, build.name("arrived"), 6 * 8, DType.INT64)
    build.deliver((3,), arrived, DType.INT64)
    build.steps.append(
        Step(StepKind.COLLECTIVE, "broadcast", (3, 4), (arrived,), "b", 48, DType.INT64, "cann@B", None, {"root": 3})
    )
    build.deliver((4,), "b", DType.INT64)
    report = check(build.plan(), c)
    assert ViolationKind.DISALLOWED_SUBSTITUTE in report.kinds
