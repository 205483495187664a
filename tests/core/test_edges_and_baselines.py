"""The nine real edges, the baselines, the transition enumeration and edge facts files."""

from __future__ import annotations

import json

import pytest

from planning_facts import edge

from meshpact.core.baselines import byte_only, byte_only_candidates, layout_only
from meshpact.core.catalog import get_model
from meshpact.core.checker import ViolationKind, check
from meshpact.core.contract import compile_contract
from meshpact.core.edges import EDGES, get_edge, miniature
from meshpact.core.errors import FactError
from meshpact.core.factsfile import edge_from_dict, load_edge_facts
from meshpact.core.facts import Request
from meshpact.core.interpreter import judge
from meshpact.core.lowerer import lower
from meshpact.core.plan import plan_cost
from meshpact.core.placement import Partial, Replicate, Shard
from meshpact.core.transitions import enumerate_transitions, evaluate_transitions


def test_nine_edges_with_the_demanded_kinds():
    assert len(EDGES) == 9
    requests = [e.edge.consumer.request for e in EDGES.values()]
    results = [e for e in EDGES.values() if e.result_edge]
    assert {e.edge.consumer.request for e in results} >= {Request.LOGPROB, Request.TOKEN, Request.OWNER_TOKEN}
    assert all(isinstance(e.edge.producer.placement, Shard) and e.edge.producer.placement.dim == 1 for e in results)
    assert Request.REDUCED in requests and Request.SHARD in requests
    assert all(e.edge.cross_domain and e.edge.source.startswith("https://huggingface.co/") for e in EDGES.values())
    down = get_edge("qwen3-14b-mlp-down-reduced")
    assert down.producer.shape[1] == get_model("qwen3-14b").hidden_size and isinstance(down.producer.placement, Partial)
    assert "moe" in " ".join(EDGES) and "kv" in " ".join(EDGES)


@pytest.mark.parametrize("name", list(EDGES))
def test_lowerer_beats_layout_only_on_every_real_edge(name):
    real = EDGES[name]
    c = compile_contract(real.edge)
    plan, lo = lower(c), layout_only(c)
    assert check(plan, c).ok
    mesh = c.edge.mesh
    assert plan_cost(plan, mesh).time_s <= plan_cost(lo, mesh).time_s  # chosen by α-β time; ties where the
    assert plan.startups <= lo.startups  # fastest plan is what the transition table does (shard to shard)
    if real.result_edge:
        assert plan.payload_bytes < lo.payload_bytes / 100
    small = compile_contract(miniature(real.edge))
    assert judge(lower(small), small).ok


def test_result_edges_move_statistics_in_one_collective_not_three():
    c = compile_contract(get_edge("qwen3-14b-lm-head-logprob"))
    plan = lower(c)
    collectives = [s for s in plan.steps if s.kind.value == "collective" and s.domain == "cuda@hostA"]
    assert [s.op for s in collectives] == ["gather"]
    assert plan.payload_bytes < c.provenance.shape[0] * 4 * 60  # per token: 4 shards x 12 B + 4 B + fan-out


def test_owner_scoped_delivery_reaches_owners_only():
    c = compile_contract(get_edge("minimax-m2-lm-head-owner-token"))
    sends = [s for s in lower(c).steps if s.op == "send"]
    owners = set(c.edge.consumer.owners)
    assert {s.ranks[1] for s in sends} == owners and len(sends) == len(owners)
    assert ViolationKind.NON_OWNER_OBSERVES in check(layout_only(c), c).kinds


def test_partials_complete_inside_the_producer_domain():
    for name in ("qwen3-14b-mlp-down-reduced", "qwen3-30b-a3b-moe-combine"):
        c = compile_contract(get_edge(name))
        plan = lower(c)
        first_send = next(i for i, s in enumerate(plan.steps) if s.op == "send")
        assert any(s.op in ("reduce", "reduce_scatter", "all_reduce") for s in plan.steps[:first_send])


def test_replicated_source_has_one_authoritative_sender():
    c = compile_contract(get_edge("mistral-7b-pipeline-hidden-handoff"))
    assert len([s for s in lower(c).steps if s.op == "send"]) == 1
    copies = layout_only(c)  # every holder sends its identical copy: correct, and n times the bridge bytes
    assert check(copies, c).ok
    mesh = c.edge.mesh
    n = len(c.provenance.holdings)
    assert plan_cost(copies, mesh).bytes_by_link["ethernet"] == n * plan_cost(lower(c), mesh).bytes_by_link["ethernet"]


def test_unknown_edge_lists_known_ones():
    with pytest.raises(FactError, match="known edges: qwen3-14b-lm-head-logprob"):
        get_edge("gpt-5-head")


def test_byte_only_keeps_the_cheapest_candidate_and_the_checker_rejects_it_when_wrong():
    c = compile_contract(edge(Shard(1), Request.TOKEN))
    cands = byte_only_candidates(c)
    best = byte_only(c)
    assert best.payload_bytes == min(x.plan.payload_bytes for x in cands)
    assert {x.label for x in cands} >= {"meshpact", "layout_only", "collective_across_domains"}
    for x in cands:
        assert judge(x.plan, c).ok or not check(x.plan, c).ok, x.label
    assert not check(best, c).ok and not judge(best, c).ok


def test_transitions_cover_the_structural_cases():
    ts = enumerate_transitions()
    assert len(ts) >= 72
    assert len({(repr(t.placement), t.request, t.scope, t.relation) for t in ts}) == len(ts)
    report = evaluate_transitions()
    doc = report.to_dict()
    assert doc["meshpact_valid"] == doc["transitions"] == len(ts)
    assert doc["byte_only_invalid"] > 0 and doc["byte_only_invalid_rejected"] == doc["byte_only_invalid"]
    assert 0 < doc["layout_only_complete"] < doc["transitions"]
    assert not [r for r in report.results if r.accepted_wrong]


FACTS = {
    "name": "mine",
    "mesh": {
        "domains": [
            {"name": "cuda@A", "vendor": "cuda", "host": "A", "ranks": [0, 1]},
            {"name": "cann@B", "vendor": "cann", "host": "B", "ranks": [2, 3], "bridge_rank": 3},
        ]
    },
    "producer": {
        "name": "logits",
        "op": "lm_head",
        "shape": [4, 32],
        "dtype": "bfloat16",
        "domain": "cuda@A",
        "placement": "Shard(1)",
    },
    "consumer": {"name": "s", "domain": "cann@B", "ranks": [2, 3], "request": "token"},
}


def test_facts_file_builds_an_edge(tmp_path):
    path = tmp_path / "e.json"
    path.write_text(json.dumps(FACTS))
    e = load_edge_facts(path)
    assert e.name == "mine" and e.mesh.domain("cann@B").bridge_rank == 3
    assert check(lower(compile_contract(e)), compile_contract(e)).ok


@pytest.mark.parametrize(
    "patch, field",
    [
        (lambda d: d["producer"].update(shape=[4, 0]), "producer.shape"),
        (lambda d: d["producer"].update(placement="Sharded(1)"), "producer.placement"),
        (lambda d: d["consumer"].update(request="tokens"), "consumer.request"),
        (lambda d: d["consumer"].pop("ranks"), "consumer.ranks"),
        (lambda d: d["mesh"]["domains"][0].update(vendor="tpu"), "mesh.domains.0.vendor"),
        (lambda d: d["consumer"].update(colour="red"), "consumer.colour"),
        (lambda d: d["consumer"].update(ranks=[0]), "not in domain"),
        (lambda d: d["consumer"].update(shard_dim=-1), "consumer.shard_dim"),
    ],
)
def test_malformed_facts_name_the_field(patch, field):
    data = json.loads(json.dumps(FACTS))
    patch(data)
    with pytest.raises(FactError, match=field.replace(".", r"\.")) as err:
        edge_from_dict(data, "f.yaml")
    assert str(err.value).startswith("f.yaml")


def test_facts_file_errors(tmp_path):
    with pytest.raises(FactError, match="no such facts file"):
        load_edge_facts(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("mesh: [\n")
    with pytest.raises(FactError, match="not valid YAML"):
        load_edge_facts(bad)


def test_same_domain_baseline_follows_dtensor_table():
    c = compile_contract(edge(Partial("sum"), Request.REDUCED, cross=False))
    assert [s.op for s in layout_only(c).steps] == ["all_reduce", "deliver"]
    c = compile_contract(edge(Shard(0), Request.SHARD, cross=False, consumers=(0, 1, 2), shard_dim=1))
    assert [s.op for s in layout_only(c).steps] == ["all_to_all", "deliver"]
    c = compile_contract(edge(Replicate(), Request.FULL))
    assert [s.op for s in layout_only(c).steps].count("send") == 3


def test_every_planners_declared_bytes_and_links_agree_with_the_checker():
    """The baselines are blind to semantics, not to their own costs: no figure is misdeclared."""
    contracts = [compile_contract(t.edge) for t in enumerate_transitions()]
    contracts += [compile_contract(e.edge) for e in EDGES.values()]
    declared = {ViolationKind.PAYLOAD_MISMATCH, ViolationKind.LINK_MISMATCH}
    for c in contracts:
        for cand in byte_only_candidates(c) + [type(byte_only_candidates(c)[0])("layout_only", layout_only(c))]:
            bad = [str(v) for v in check(cand.plan, c).violations if v.kind in declared]
            assert not bad, (c.edge.name, cand.label, bad[:2])


def test_large_bridge_messages_are_chunked_through_a_bounded_staging_buffer():
    from dataclasses import replace

    from meshpact.core.plan import Plan, StepKind
    from meshpact.core.planbuild import CHUNK_BYTES

    c = compile_contract(get_edge("llama-3.1-8b-kv-prefill-to-decode"))
    plan = lower(c)
    sends = [s for s in plan.steps if s.kind is StepKind.SEND]
    big = [s for s in sends if s.payload_bytes > CHUNK_BYTES]
    assert big and all(
        s.arg("staging_bytes") == CHUNK_BYTES
        and s.arg("chunks") * CHUNK_BYTES >= s.payload_bytes > (s.arg("chunks") - 1) * CHUNK_BYTES
        for s in big
    )
    assert all(s.startups == s.arg("chunks", 1) for s in sends)
    assert check(plan, c).ok
    i = plan.steps.index(big[0])
    short = replace(big[0], args={**dict(big[0].args), "chunks": big[0].arg("chunks") - 1})
    assert (
        ViolationKind.MALFORMED_STEP in check(Plan("e", "m", plan.steps[:i] + (short,) + plan.steps[i + 1 :]), c).kinds
    )
    small = compile_contract(miniature(get_edge("llama-3.1-8b-kv-prefill-to-decode")))
    assert all(s.arg("chunks") is None for s in lower(small).steps)  # under the threshold: one message
