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
    facts = dict(
        producer_domain="cuda@hostA",
        consumer_domain="cann@hostB",
        placement="Shard(1)",
        shape=(8, 1024),
        dtype="bfloat16",
        request="token",
        consumer_ranks=2,
    )
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


def test_producer_tp_degree_lays_the_producer_over_the_first_ranks(mesh):
    e = _edge(mesh, producer_ranks=2)
    assert e.mesh.domain("cuda@hostA").ranks == tuple(sorted(mesh.domain("cuda@hostA").ranks)[:2])
    from meshpact.core.contract import compile_contract

    assert len(compile_contract(e).provenance.holdings) == 2
    with pytest.raises(MeshpactError, match="producer TP degree"):
        _edge(mesh, producer_ranks=99)


def test_serving_requests_take_their_parameters(mesh):
    j = judge(_edge(mesh, request="topk", k=4))
    lowered = next(o for o in j.outcomes if o.planner == "meshpact lowerer")
    assert lowered.ok and any(s.op == "topk" and s.arg("k") == 4 for s in lowered.plan.steps)
    j = judge(_edge(mesh, request="sample", seed=5, temperature=0.5))
    assert next(o for o in j.outcomes if o.planner == "meshpact lowerer").ok


def test_violations_are_grouped_by_kind_with_counts(mesh):
    from meshpact.app.planning import violation_groups

    j = judge(_edge(mesh, placement="Partial(sum)", request="full", dtype="float32"))
    rejected = [o for o in j.outcomes if not o.ok and o.violations]
    assert rejected
    for out in rejected:
        groups = violation_groups(out.violations)
        assert sum(g.count for g in groups) == len(out.violations)
        assert [g.count for g in groups] == sorted((g.count for g in groups), reverse=True)
        assert all(g.examples and g.examples[0].startswith(g.kind) for g in groups)


def test_an_uploaded_values_file_runs_the_lowerers_plan(mesh):
    import json

    import numpy as np

    from meshpact.app.planning import run_uploaded

    e = _edge(mesh, shape=(2, 64), dtype="float32")
    values = np.arange(128, dtype=np.float32).reshape(2, 64)[:, ::-1].copy()  # argmax at column 0
    run = run_uploaded(e, "v.json", json.dumps(values.tolist()).encode())
    assert run.ok and all(r.observed == [0, 0] for r in run.ranks)
    buf = __import__("io").BytesIO()
    np.save(buf, values)
    assert run_uploaded(e, "v.npy", buf.getvalue()).ok
    with pytest.raises(MeshpactError, match="expected shape"):
        run_uploaded(e, "v.json", b"[[1, 2]]")


def test_a_padded_vocabulary_is_planned_with_its_padding_masked(mesh):
    e = _edge(mesh, shape=(8, 1000), pad_vocab=True, producer_ranks=4)
    assert e.producer.shape == (8, 1024) and e.producer.vocab_size == 1000
    lowered = next(o for o in judge(e).outcomes if o.planner == "meshpact lowerer")
    assert lowered.ok and any(s.arg("valid") == 1000 for s in lowered.plan.steps)


def _npy(header: dict | None = None) -> bytes:
    """A .npy file with a valid header: an array of Python objects (pickled), or a bare ``header``
    with no data after it."""
    import io

    import numpy as np

    buf = io.BytesIO()
    if header is not None:
        np.lib.format.write_array_header_1_0(buf, header)
    else:
        np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    return buf.getvalue()


@pytest.mark.parametrize(
    "name,content",
    [
        ("v.npy", b"\x89PNG\r\n\x1a\n\x00\xff"),
        ("v.npy", b""),
        ("v.json", b"\xff\xfe\x00"),
        ("v.json", b""),
        ("v.npy", _npy()),
        ("v.npy", _npy(header={"descr": "<f4", "fortran_order": False, "shape": (100_000, 100_000)})),
    ],
)
def test_any_uploaded_values_file_is_one_line(mesh, name, content):
    from meshpact.app.planning import run_uploaded

    with pytest.raises(MeshpactError) as info:
        run_uploaded(_edge(mesh), name, content)
    text = str(info.value)
    assert "\n" not in text and text.startswith(name) and "allow_pickle" not in text
