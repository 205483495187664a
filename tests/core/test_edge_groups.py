"""Several consumers of one producer, each with its own request, and a group spanning two domains."""

from __future__ import annotations

import pytest

from planning_facts import two_domain_mesh

from meshpact.core.errors import FactError
from meshpact.core.facts import Consumer, DType, ProducerTensor, Request
from meshpact.core.group import EdgeGroup, plan_group, split_by_domain
from meshpact.core.interpreter import equivalent, interpret, judge, magnitudes, make_inputs, reference
from meshpact.core.placement import Shard


def _group(consumers):
    mesh = two_domain_mesh(3, 2)
    producer = ProducerTensor("logits", "lm_head", (6, 40), DType.BFLOAT16, "cuda@A", Shard(1))
    return EdgeGroup("serve", mesh, producer, tuple(consumers))


def test_each_consumer_gets_its_own_request_and_the_joined_plan_serves_all():
    group = _group(
        [
            Consumer("sampler", "cann@B", (3,), Request.SAMPLE, seed=9),
            Consumer("scorer", "cann@B", (3, 4), Request.LOGPROB),
            Consumer("logger", "cuda@A", (1,), Request.TOPK, k=4),
        ]
    )
    gp = plan_group(group)
    assert gp.ok and len(gp.plans) == 3
    assert gp.plan.startups == sum(p.startups for p in gp.plans)
    assert {c.demand.request for c in gp.contracts} == {Request.SAMPLE, Request.LOGPROB, Request.TOPK}
    # the joined plan runs once on the shared producer data; each consumer observes its own demand
    scorer = next(c for c in gp.contracts if c.demand.request is Request.LOGPROB)
    inputs = make_inputs(scorer, 1)  # the scorer's inputs carry the target ids
    ex = interpret(gp.plan, scorer, inputs)
    for contract in gp.contracts:
        prefix = contract.edge.consumer.name + ":"
        deliver = next(s for s in gp.plan.steps if s.kind.value == "deliver" and s.output.startswith(prefix))
        scale = magnitudes(contract, inputs)
        for rank, want in reference(contract, inputs).items():
            got = ex.buffers[rank][deliver.inputs[0]]
            assert equivalent(got, want, contract, scale[rank]).ok, contract.edge.consumer.name
        assert judge(gp.plans[gp.contracts.index(contract)], contract, 1).ok


def test_a_consumer_group_spanning_both_domains_is_served_per_domain():
    mesh = two_domain_mesh(3, 2)
    consumers = split_by_domain(mesh, "readers", (1, 2, 3, 4), Request.TOKEN)
    assert [(c.domain, c.ranks) for c in consumers] == [("cuda@A", (1, 2)), ("cann@B", (3, 4))]
    gp = plan_group(_group(consumers))
    assert gp.ok and all(judge(p, c).ok for p, c in zip(gp.plans, gp.contracts))
    crossing = [s for s in gp.plan.steps if s.kind.value == "send"]
    assert len(crossing) == 1  # only the other domain's share crosses the bridge
    with pytest.raises(FactError, match="owner-scoped"):
        split_by_domain(mesh, "owners", (1, 3), Request.OWNER_TOKEN, owners=(1, 3, 1, 3, 1, 3))
    with pytest.raises(FactError, match="names must differ"):
        _group([Consumer("a", "cann@B", (3,), Request.TOKEN), Consumer("a", "cann@B", (4,), Request.TOKEN)])
