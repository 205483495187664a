"""`meshpact plan`, `meshpact edges`, `meshpact transitions`: JSON shapes, tables and user errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from meshpact.cli import main
from meshpact.core.edges import EDGES

FACETS = {"provenance", "substitutability", "completion", "authority", "demand", "locality"}
PLANNERS = {"meshpact", "layout_only", "byte_only"}


def _json(capsys, *argv):
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


def _assert_plan_doc(doc):
    assert set(doc) >= {"edge", "contract", "plans"}
    assert set(doc["contract"]) == FACETS
    assert set(doc["plans"]) == PLANNERS
    for p in doc["plans"].values():
        assert set(p) == {"steps", "startups", "payload_bytes", "time_s", "check"}
        assert set(p["check"]) == {"ok", "violations"}
        assert all(set(v) == {"kind", "step", "rank", "reason"} for v in p["check"]["violations"])
        assert all({"kind", "op", "ranks", "payload_bytes", "dtype"} <= set(s) for s in p["steps"])


def test_plan_json(capsys):
    doc = _json(capsys, "plan", "qwen3-14b-lm-head-logprob", "--json")
    _assert_plan_doc(doc)
    assert doc["edge"] == "qwen3-14b-lm-head-logprob"
    assert doc["contract"]["substitutability"]["equivalence"] == "tolerance"
    m, lo = doc["plans"]["meshpact"], doc["plans"]["layout_only"]
    assert m["check"]["ok"] and m["startups"] < lo["startups"] and m["payload_bytes"] < lo["payload_bytes"]
    assert not doc["plans"]["byte_only"]["check"]["ok"]


def test_edges_json_lists_all_nine_with_result_flag(capsys):
    docs = _json(capsys, "edges", "--json")
    assert [d["edge"] for d in docs] == list(EDGES)
    for d in docs:
        _assert_plan_doc(d)
        assert d["result_edge"] is EDGES[d["edge"]].result_edge
        assert d["plans"]["meshpact"]["check"]["ok"]
        # chosen by α-β time: never slower than the startups-first choice, and cheaper where it changed
        chosen, first = d["plans"]["meshpact"]["time_s"], d["startups_first"]["time_s"]
        assert chosen <= first and (chosen < first) is d["choice_changed_by_time"]
    assert any(d["choice_changed_by_time"] for d in docs)


def test_transitions_json(capsys):
    doc = _json(capsys, "transitions", "--json")
    assert set(doc) == {
        "transitions",
        "structurally_distinct",
        "meshpact_valid",
        "layout_only_complete",
        "byte_only_candidates",
        "byte_only_invalid",
        "byte_only_invalid_rejected",
        "candidate_set",
    }
    assert doc["transitions"] >= 72 and doc["meshpact_valid"] == doc["transitions"]
    # same-host and other-host cases differ only in the bridge's link class
    assert doc["structurally_distinct"] == doc["transitions"] * 2 // 3
    assert "grammar" in doc["candidate_set"]
    assert doc["byte_only_invalid_rejected"] == doc["byte_only_invalid"] > 0


def test_tables_for_people(capsys):
    assert main(["plan", "minimax-m2-lm-head-owner-token"]) == 0
    out = capsys.readouterr().out
    assert "Contract of minimax-m2-lm-head-owner-token" in out and "owner scope" in out
    assert "non_owner_observes" in out and "passes" in out
    assert main(["edges"]) == 0
    assert "Nine real edges" in capsys.readouterr().out
    assert main(["transitions"]) == 0
    assert "meshpact_valid" in capsys.readouterr().out


def test_plan_from_a_facts_file(tmp_path, capsys):
    path = tmp_path / "edge.yaml"
    path.write_text(
        "name: tiny\n"
        "mesh:\n  domains:\n"
        "    - {name: cuda@A, vendor: cuda, host: A, ranks: [0, 1, 2]}\n"
        "    - {name: cann@B, vendor: cann, host: B, ranks: [3]}\n"
        "producer: {name: h, op: down_proj, shape: [8, 16], dtype: float32, domain: cuda@A, placement: Partial(sum)}\n"
        "consumer: {name: next, domain: cann@B, ranks: [3], request: reduced}\n"
    )
    doc = _json(capsys, "plan", "--facts", str(path), "--json")
    _assert_plan_doc(doc)
    assert doc["edge"] == "tiny" and doc["plans"]["meshpact"]["check"]["ok"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["plan", "no-such-edge"], "known edges: qwen3-14b-lm-head-logprob"),
        (["plan"], "name an edge or pass --facts"),
    ],
)
def test_user_errors_are_messages(capsys, argv, message):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_malformed_facts_name_the_field_without_traceback(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: x\nmesh: {domains: [{name: a, vendor: cuda, host: h, ranks: [0]}]}\n"
        "producer: {name: p, op: o, shape: [2, two], dtype: float32, domain: a, placement: Shard(1)}\n"
        "consumer: {name: c, domain: a, ranks: [0], request: full}\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "meshpact.cli", "plan", "--facts", str(path)], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "producer.shape" in out.stderr and "Traceback" not in out.stderr


_GOOD = {
    "domains": "    - {name: cuda@A, vendor: cuda, host: A, ranks: [0, 1]}\n"
    "    - {name: cann@B, vendor: cann, host: B, ranks: [3, 4]}\n",
    "producer": "producer: {name: h, op: o, shape: [4, 8], dtype: bfloat16, domain: cuda@A, placement: Shard(1)}\n",
    "consumer": "consumer: {name: c, domain: cann@B, ranks: [3, 4], request: token}\n",
    "links": "",
}


@pytest.mark.parametrize(
    "part, text, field, expected",
    [
        ("consumer", "consumer: {name: c, domain: cann@B, ranks: [3, 3], request: token}\n", "ranks", "listed twice"),
        (
            "domains",
            "    - {name: cuda@A, vendor: cuda, host: A, ranks: [0, 1], backend: mpi}\n"
            "    - {name: cann@B, vendor: cann, host: B, ranks: [3, 4]}\n",
            "mesh.domains.0.backend",
            "nccl",
        ),
        (
            "domains",
            "    - {name: cuda@A, vendor: cuda, host: A, ranks: [0, 1], backend: hccl}\n"
            "    - {name: cann@B, vendor: cann, host: B, ranks: [3, 4]}\n",
            "mesh.domains.0.backend",
            "native",
        ),
        (
            "consumer",
            "consumer: {name: c, domain: cann@B, ranks: [3, 4], request: token, shard_dim: 7}\n",
            "shard_dim",
            "shard and reduced requests only",
        ),
        (
            "consumer",
            "consumer: {name: c, domain: cann@B, ranks: [3, 4], request: token, owners: [3, 3, 4, 4]}\n",
            "owners",
            "owner_token requests only",
        ),
        (
            "links",
            "  links: {ethernet: {alpha_s: -1.0e-5, beta_s_per_byte: 8.0e-9}}\n",
            "mesh.links.ethernet.alpha_s",
            "non-negative",
        ),
        (
            "links",
            "  links: {ethernet: {alpha_s: .nan, beta_s_per_byte: 8.0e-9}}\n",
            "mesh.links.ethernet.alpha_s",
            "finite",
        ),
        (
            "links",
            "  links: {ethernet: {alpha_s: 5.0e-5, beta_s_per_byte: fast}}\n",
            "mesh.links.ethernet.beta_s_per_byte",
            "number",
        ),
    ],
)
def test_facts_that_do_not_apply_or_do_not_add_up_are_refused(tmp_path, capsys, part, text, field, expected):
    parts = dict(_GOOD, **{part: text})
    path = tmp_path / "edge.yaml"
    path.write_text(
        "name: e\nmesh:\n  domains:\n" + parts["domains"] + parts["links"] + parts["producer"] + parts["consumer"]
    )
    assert main(["plan", "--facts", str(path)]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and field in err and expected in err, err


def test_good_facts_with_yaml_exponents_plan(tmp_path, capsys):
    path = tmp_path / "edge.yaml"
    path.write_text(
        "name: e\nmesh:\n  domains:\n"
        + _GOOD["domains"]
        + "  links: {ethernet: {alpha_s: 5e-5, beta_s_per_byte: 8e-9}}\n"
        + _GOOD["producer"]
        + _GOOD["consumer"]
    )
    doc = _json(capsys, "plan", "--facts", str(path), "--json")
    assert doc["plans"]["meshpact"]["check"]["ok"]


def test_the_cli_exits_1_on_a_plan_its_checker_rejects(tmp_path, capsys, monkeypatch):
    from dataclasses import replace

    import meshpact.core.baselines as baselines
    import meshpact.core.planners as planners

    path = tmp_path / "edge.yaml"
    path.write_text(
        "name: e\nmesh:\n  domains:\n"
        + _GOOD["domains"]
        + "producer: {name: h, op: o, shape: [4, 8], dtype: float32, domain: cuda@A, placement: Partial(sum)}\n"
        + "consumer: {name: c, domain: cann@B, ranks: [3, 4], request: full}\n"
    )
    broken = replace(planners.PLANNERS[0], plan=baselines.layout_only)  # completes partials on the consumer side
    monkeypatch.setattr(planners, "PLANNERS", (broken,) + planners.PLANNERS[1:])
    assert main(["plan", "--facts", str(path)]) == 1
    captured = capsys.readouterr()
    assert "completed_outside_domain" in captured.out and "fails its own check" in captured.err
    assert main(["plan", "--facts", str(path), "--json"]) == 1
    assert not json.loads(capsys.readouterr().out)["plans"]["meshpact"]["check"]["ok"]


_RUN_FACTS = (
    "name: e\nmesh:\n  domains:\n"
    + _GOOD["domains"]
    + "producer: {name: h, op: o, shape: [2, 5], dtype: bfloat16, domain: cuda@A, placement: Shard(1)}\n"
    + "consumer: {name: c, domain: cann@B, ranks: [3, 4], request: token}\n"
)


def test_run_a_plan_on_my_values(tmp_path, capsys):
    facts = tmp_path / "edge.yaml"
    facts.write_text(_RUN_FACTS)
    values = tmp_path / "v.json"
    values.write_text("[[1, 2, 9, 3, 0], [0, NaN, 1, 1, 7]]")  # a NaN wins argmax, as in torch
    doc = _json(capsys, "plan", "--facts", str(facts), "--run", str(values), "--json")
    assert doc["verdict"] == "right"
    assert {r["rank"]: (r["observed"], r["reference"]) for r in doc["ranks"]} == {
        3: ([2, 1], [2, 1]),
        4: ([2, 1], [2, 1]),
    }
    assert main(["plan", "--facts", str(facts), "--run", str(values)]) == 0
    assert "right" in capsys.readouterr().out


def test_run_partial_addends_from_npy(tmp_path, capsys):
    import numpy as np

    facts = tmp_path / "edge.yaml"
    facts.write_text(
        _RUN_FACTS.replace("Shard(1)", "Partial(sum)")
        .replace("request: token", "request: full")
        .replace("bfloat16", "float16")
    )
    rng = np.random.default_rng(0)
    addends = rng.standard_normal((2, 2, 5)).astype(np.float16)
    np.save(tmp_path / "v.npy", addends)
    doc = _json(capsys, "plan", "--facts", str(facts), "--run", str(tmp_path / "v.npy"), "--json")
    assert doc["verdict"] == "right"
    want = (addends[0] + addends[1]).astype(np.float64).tolist()
    assert all(r["reference"] == want and r["observed"] == want for r in doc["ranks"])


def test_run_exits_1_when_a_rank_observes_the_wrong_thing(tmp_path, capsys, monkeypatch):
    from dataclasses import replace

    import meshpact.core.planners as planners
    from meshpact.core.baselines import byte_only_candidates
    from meshpact.core.plan import Plan

    def local_only(contract):  # argmax of the bridge rank's own vocabulary shard
        cand = next(c for c in byte_only_candidates(contract) if c.label.startswith("local_only+send+fan_out"))
        return Plan(cand.plan.edge, "meshpact", cand.plan.steps)

    monkeypatch.setattr(planners, "PLANNERS", (replace(planners.PLANNERS[0], plan=local_only),) + planners.PLANNERS[1:])
    facts = tmp_path / "edge.yaml"
    facts.write_text(_RUN_FACTS)
    values = tmp_path / "v.json"
    values.write_text("[[1, 2, 9, 3, 0], [0, 1, 1, 1, 7]]")
    assert main(["plan", "--facts", str(facts), "--run", str(values), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "wrong" and doc["ranks"][0]["observed"] == [2, 1] != doc["ranks"][0]["reference"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("[[1, 2, 9, 3]]", "expected shape [2, 5]"),
        ("[[1, 2, 9, 3, 0], [0, 1, 1]]", "rectangular array"),
        ("{not json", "not valid JSON"),
    ],
)
def test_unusable_values_are_one_line(tmp_path, capsys, text, message):
    facts = tmp_path / "edge.yaml"
    facts.write_text(_RUN_FACTS)
    values = tmp_path / "v.json"
    values.write_text(text)
    assert main(["plan", "--facts", str(facts), "--run", str(values)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(values) in err and "Traceback" not in err


def test_serving_requests_from_a_facts_file(tmp_path, capsys):
    path = tmp_path / "edge.yaml"
    path.write_text(_RUN_FACTS.replace("request: token", "request: sample, seed: 3, temperature: 0.8"))
    doc = _json(capsys, "plan", "--facts", str(path), "--json")
    assert doc["plans"]["meshpact"]["check"]["ok"]
    assert any(
        s["op"] == "local_sample_max_arg" and s["args"]["seed"] == 3 and s["args"]["temperature"] == 0.8
        for s in doc["plans"]["meshpact"]["steps"]
    )
    path.write_text(_RUN_FACTS.replace("request: token", "request: topk, k: 9"))
    assert main(["plan", "--facts", str(path)]) == 2
    assert "exceeds the vocabulary" in capsys.readouterr().err


def test_a_facts_file_with_several_consumers(tmp_path, capsys):
    path = tmp_path / "group.yaml"
    path.write_text(
        "name: g\nmesh:\n  domains:\n"
        + _GOOD["domains"]
        + "producer: {name: h, op: o, shape: [4, 64], dtype: bfloat16, domain: cuda@A, placement: Shard(1)}\n"
        + "consumers:\n"
        + "  - {name: sampler, domain: cann@B, ranks: [3], request: sample, seed: 1}\n"
        + "  - {name: scorer, domain: cann@B, ranks: [3, 4], request: logprob}\n"
        + "  - {name: logger, domain: cuda@A, ranks: [1], request: topk, k: 5}\n"
    )
    doc = _json(capsys, "plan", "--facts", str(path), "--json")
    assert [c["edge"] for c in doc["consumers"]] == ["g/sampler", "g/scorer", "g/logger"]
    assert doc["joined"]["ok"] and doc["joined"]["startups"] == sum(
        c["plans"]["meshpact"]["startups"] for c in doc["consumers"]
    )
    assert main(["plan", "--facts", str(path)]) == 0
    assert "one schedule for 3 consumers" in capsys.readouterr().out
    path.write_text(path.read_text().replace("k: 5", "k: 500"))
    assert main(["plan", "--facts", str(path)]) == 2
    assert "exceeds the vocabulary" in capsys.readouterr().err
