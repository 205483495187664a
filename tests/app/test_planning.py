"""Planning for the Plans page: edges from facts and the planners' verdicts."""

from __future__ import annotations

import pytest

from meshpact.app.planning import edge_from_facts, judge, steps_rows
from meshpact.core.errors import MeshpactError
from meshpact.core.facts import Request
from meshpact.core.scenario import default_scenario


@pytest.fixture(scope="module")
def mesh():
    return default_scenario().mesh()


def _edge(mesh, **kw):
    facts = dict(producer_domain="cuda@hostA", consumer_domain="cann@hostB", placement="Shard(1)",
                 shape=(8, 1024), dtype="bfloat16", request="token", consumer_ranks=2)
    return edge_from_facts(mesh, **{**facts, **kw})


def test_owner_token_rows_go_to_consumer_ranks_in_turn(mesh):
    e = _edge(mesh, request="owner_token", consumer_ranks=3)
    assert e.consumer.ranks == (16, 17, 18)
    assert e.consumer.owners == (16, 17, 18, 16, 17, 18, 16, 17)
    assert e.consumer.request is Request.OWNER_TOKEN


def test_too_many_consumer_ranks_is_a_readable_error(mesh):
    with pytest.raises(MeshpactError, match=r"consumer ranks: expected 1..16"):
        _edge(mesh, consumer_ranks=17)


def test_the_lowerer_passes_the_checker_and_costs_what_its_steps_say(mesh):
    j = judge(_edge(mesh))
    lowered = next(o for o in j.outcomes if o.planner == "meshpact lowerer")
    assert lowered.ok and not lowered.reasons
    assert lowered.cost.startups == sum(1 for r in steps_rows(lowered.plan) if r["kind"] in ("collective", "send"))
    # source projection: only token ids cross the Ethernet bridge, never the logits
    assert lowered.cost.bytes_by_link["ethernet"] == 8 * 8


def test_facet_summaries_name_the_crossing_and_the_substitutes(mesh):
    from meshpact.app.planning import facet_summaries

    j = judge(_edge(mesh))
    lines = facet_summaries(j.contract)
    assert list(lines) == ["provenance", "substitutability", "completion", "authority", "demand", "locality"]
    assert "ethernet from cuda@hostA to cann@hostB" in lines["locality"]
    assert lines["demand"].startswith("token: 2 observing rank(s)")
