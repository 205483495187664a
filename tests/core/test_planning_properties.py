"""Property tests over random facts: accepted plans are numerically right, and the lowerer's always are.

The numeric interpreter knows nothing of the checker; each property ties the two together.
"""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from planning_facts import random_edges

from meshpact.core.baselines import byte_only_candidates, layout_only
from meshpact.core.checker import check
from meshpact.core.contract import compile_contract
from meshpact.core.interpreter import judge
from meshpact.core.lowerer import lower
from meshpact.core.plan import Plan, StepKind

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(random_edges(), st.integers(0, 2**16))
def test_the_lowerers_plan_passes_the_checker_and_gives_the_demanded_observation(edge, seed):
    contract = compile_contract(edge)
    plan = lower(contract)
    report = check(plan, contract)
    assert report.ok, [str(v) for v in report.violations]
    verdict = judge(plan, contract, seed)
    assert verdict.ok, verdict.reason


@FAST
@given(random_edges())
def test_lowering_is_deterministic_byte_for_byte(edge):
    assert lower(compile_contract(edge)).to_json() == lower(compile_contract(edge)).to_json()


def _mutants(plan: Plan, rng: random.Random, count: int) -> list[Plan]:
    """Plans a careless planner might produce: steps dropped, swapped, duplicated, re-rooted, re-ranked."""
    out = []
    steps = list(plan.steps)
    ranks = sorted({r for s in steps for r in s.ranks})
    for _ in range(count):
        s2 = list(steps)
        how = rng.randrange(6)
        i = rng.randrange(len(s2))
        st_ = s2[i]
        if how == 0:
            del s2[i]
        elif how == 1 and len(s2) > 1:
            j = min(i + 1, len(s2) - 1)
            s2[i], s2[j] = s2[j], s2[i]
        elif how == 2:
            s2.insert(i, st_)
        elif how == 3 and st_.arg("root") is not None:
            s2[i] = replace(st_, args=tuple({**dict(st_.args), "root": rng.choice(st_.ranks)}.items()))
        elif how == 4 and st_.kind is StepKind.SEND:
            s2[i] = replace(st_, ranks=(rng.choice(ranks), st_.ranks[1]))
        elif how == 5 and st_.kind is not StepKind.SEND:
            new = tuple(sorted(set(st_.ranks) ^ {rng.choice(ranks)})) or st_.ranks
            s2[i] = replace(st_, ranks=new)
        if s2:
            out.append(Plan(plan.edge, "mutant", tuple(s2)))
    return out


@FAST
@given(random_edges(), st.integers(0, 2**16))
def test_every_plan_the_checker_accepts_yields_the_demanded_observation(edge, seed):
    contract = compile_contract(edge)
    plans = [layout_only(contract)] + [c.plan for c in byte_only_candidates(contract)]
    plans += _mutants(lower(contract), random.Random(seed), 6)
    for plan in plans:
        if check(plan, contract).ok:
            verdict = judge(plan, contract, seed)
            assert verdict.ok, f"accepted yet wrong: {verdict.reason}\n{plan.to_json()}"


@FAST
@given(random_edges(), st.integers(0, 2**16))
def test_accepted_plans_follow_torch_on_nan_and_minus_inf_rows(edge, seed):
    """Rows holding NaN, only -inf, or some -inf: every accepted plan still gives the reference."""
    contract = compile_contract(edge)
    plans = [lower(contract), layout_only(contract)] + [c.plan for c in byte_only_candidates(contract)]
    for plan in plans:
        if check(plan, contract).ok:
            verdict = judge(plan, contract, seed, specials=True)
            assert verdict.ok, f"accepted yet wrong on NaN/-inf rows: {verdict.reason}\n{plan.to_json()}"
