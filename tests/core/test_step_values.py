"""Steps hold the same typed values whether they are built from typed values or from loose ones
(JSON-like strings, lists, dicts, bools, floats), and refuse invalid ops and participants."""

from __future__ import annotations

import pytest

from meshpact.core.errors import PlanError
from meshpact.core.facts import DType, LinkClass
from meshpact.core.plan import Collective, Plan, Projection, Step, StepKind


def test_loose_values_are_coerced_like_typed_ones() -> None:
    loose = Step(
        "send",
        "send",
        [True, 3.0],  # type: ignore[list-item]  # loose on purpose
        ["a"],
        "b",
        7,
        "bfloat16",
        None,
        "host_bridge",
        {"staging_bytes": 4, "chunks": 2, "ids": [5, {"z": [1, 2]}]},
    )
    typed = Step(
        StepKind.SEND,
        "send",
        (1, 3),
        ("a",),
        "b",
        7,
        DType.BFLOAT16,
        None,
        LinkClass.HOST_BRIDGE,
        (("chunks", 2), ("ids", (5, (("z", (1, 2)),))), ("staging_bytes", 4)),
    )
    assert loose == typed
    assert [type(r) for r in loose.ranks] == [int, int]  # True and 3.0 become 1 and 3, not JSON true/3.0
    assert loose.kind is StepKind.SEND and loose.dtype is DType.BFLOAT16 and loose.link is LinkClass.HOST_BRIDGE
    plan = Plan("e", "p", (loose,))
    assert '"ranks":[1,3]' in plan.to_json()
    assert Plan.from_json(plan.to_json()) == plan


def test_enum_ops_are_accepted_and_args_sorted_by_key() -> None:
    step = Step(StepKind.PROJECT, Projection.TOPK, (2,), ("x",), "y", 0, DType.FLOAT64, args={"z": 1, "k": 4})
    assert [k for k, _ in step.args] == ["k", "z"] and step.arg("k") == 4
    gather = Step(StepKind.COLLECTIVE, Collective.GATHER, (0, 1), ("x",), "y", 8, DType.INT64, args={"root": 1})
    assert gather.startups == 1


@pytest.mark.parametrize(
    "kind, op, ranks, error",
    [
        ("collective", "all_sum", (0, 1), ValueError),
        ("project", "argmin", (0,), ValueError),
        ("project", ["argmax"], (0,), ValueError),
        ("send", "send", (0, 1, 2), PlanError),
        ("deliver", "deliver", (), PlanError),
    ],
)
def test_invalid_steps_are_refused(kind: str, op: object, ranks: tuple[int, ...], error: type) -> None:
    with pytest.raises(error):
        Step(kind, op, ranks, ("x",), "y", 0, DType.FLOAT32)  # type: ignore[arg-type]  # invalid on purpose


def test_bad_plan_json_names_the_step() -> None:
    with pytest.raises(PlanError, match="all_sum"):
        Plan.from_json(
            '{"edge":"e","planner":"p","steps":[{"kind":"collective","op":"all_sum","ranks":[0,1],'
            '"output":"y","payload_bytes":0,"dtype":"float32"}]}'
        )
