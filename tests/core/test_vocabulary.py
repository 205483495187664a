"""The shared vocabulary: placements, facts, plan IR, recordings, scenarios, catalog."""

from __future__ import annotations

import json

import pytest

from meshpact.core.catalog import CATALOG, get_model, load_hf_config
from meshpact.core.errors import FactError, PlanError, RecordingError, ScenarioError
from meshpact.core.facts import Consumer, Domain, DType, Edge, LinkClass, Mesh, ProducerTensor, Request, Vendor
from meshpact.core.placement import Partial, Replicate, Shard, parse_placement, shard_bounds
from meshpact.core.plan import Plan, Step, StepKind, plan_cost
from meshpact.core.recording import RecordingWriter, iter_events, partial_path, read_recording
from meshpact.core.recovery import Policy, RecoveryBreakdown, Stage
from meshpact.core.scenario import default_scenario, load_scenario, parse_scenario_text


def two_domain_mesh() -> Mesh:
    return Mesh(
        domains=(
            Domain("cuda@A", Vendor.CUDA, "A", (0, 1)),
            Domain("cann@B", Vendor.CANN, "B", (2, 3)),
            Domain("cpu@A", Vendor.CPU, "A", (4,)),
        )
    )


@pytest.mark.parametrize("p", [Replicate(), Shard(0), Shard(3), Partial("sum"), Partial("max")])
def test_placement_text_round_trips(p):
    assert parse_placement(repr(p)) == p


@pytest.mark.parametrize("text", ["Shard(-1)", "Shard(x)", "Partial(mean)", "Gather()", "Replicate(1)"])
def test_bad_placement_names_what_is_expected(text):
    with pytest.raises(FactError, match="placement|op must be"):
        parse_placement(text)


def test_shard_bounds_follow_torch_chunk():
    # torch.chunk(10 elements, 4) -> sizes 3,3,3,1
    assert [shard_bounds(10, 4, i) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert shard_bounds(2, 4, 3) == (2, 2)


def test_link_class_follows_domains_and_hosts():
    mesh = two_domain_mesh()
    assert mesh.link_class(0, 1) is LinkClass.FABRIC
    assert mesh.link_class(0, 4) is LinkClass.HOST_BRIDGE
    assert mesh.link_class(1, 2) is LinkClass.ETHERNET
    assert mesh.domain_of(2).backend.value == "hccl"
    assert mesh.domain("cuda@A").bridge_rank == 0


def test_mesh_rejects_rank_in_two_domains():
    with pytest.raises(FactError, match="rank 1 is in both"):
        Mesh(domains=(Domain("a", Vendor.CUDA, "A", (0, 1)), Domain("b", Vendor.CANN, "B", (1, 2))))


def test_edge_validation_names_the_field():
    mesh = two_domain_mesh()
    logits = ProducerTensor("logits", "lm_head", (4, 32), DType.BFLOAT16, "cuda@A", Shard(1))
    with pytest.raises(FactError, match="owners"):
        Consumer("sampler", "cann@B", (2, 3), Request.OWNER_TOKEN)
    with pytest.raises(FactError, match="not in domain"):
        Edge("e", mesh, logits, Consumer("c", "cann@B", (0,), Request.TOKEN))
    with pytest.raises(FactError, match="Shard\\(2\\)"):
        ProducerTensor("x", "op", (4, 4), "float32", "cuda@A", Shard(2))
    edge = Edge("e", mesh, logits, Consumer("c", "cann@B", (2, 3), Request.TOKEN))
    assert edge.cross_domain and edge.producer.nbytes == 4 * 32 * 2


def _plan() -> Plan:
    return Plan(
        edge="e",
        planner="test",
        steps=(
            Step(
                StepKind.COLLECTIVE,
                "all_gather",
                (0, 1),
                ("x",),
                "xf",
                256,
                DType.BFLOAT16,
                "cuda@A",
                LinkClass.FABRIC,
                {"dim": 1},
            ),
            Step(StepKind.PROJECT, "argmax", (0,), ("xf",), "tok", 0, DType.INT64, "cuda@A"),
            Step(StepKind.SEND, "send", (0, 2), ("tok",), "tok", 32, DType.INT64, None, LinkClass.ETHERNET),
            Step(StepKind.DELIVER, "deliver", (2,), ("tok",), "tok", 0, DType.INT64, "cann@B"),
        ),
    )


def test_plan_json_round_trips_byte_for_byte():
    plan = _plan()
    text = plan.to_json()
    assert Plan.from_json(text).to_json() == text
    assert Plan.from_json(text) == plan


def test_plan_cost_counts_startups_and_bytes_per_link():
    cost = plan_cost(_plan(), two_domain_mesh())
    assert cost.startups == 2
    assert cost.payload_bytes == 256 + 32
    assert cost.bytes_by_link == {"ethernet": 32, "fabric": 256}
    assert cost.time_s > 0


def test_malformed_plan_is_reported():
    with pytest.raises(PlanError, match="missing field 'ranks'"):
        Plan.from_dict({"steps": [{"kind": "send", "op": "send"}]})
    with pytest.raises(PlanError, match="send step needs ranks"):
        Step(StepKind.SEND, "send", (0,), ("a",), "a", 4, "int64")
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{")


def test_recording_is_atomic_and_replayable(tmp_path):
    path = tmp_path / "run.jsonl"
    with RecordingWriter(path, source="test", ranks=2) as rec:
        rec.emit("fault_injected", rank=1, data={"kind": "collective"})
        assert not path.exists() and partial_path(path).exists()
        assert [e.event for e in iter_events(path)] == ["recording_start", "fault_injected"]
        rec.emit("stage_end", rank=0, stage=Stage.CONSENSUS, data={"seconds": 0.01})
    assert path.exists() and not partial_path(path).exists()
    events = read_recording(path)
    assert events[0].data["source"] == "test"
    assert events[-1].stage is Stage.CONSENSUS


def test_bad_recording_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0, "event": "recording_start"}\n{"t": "soon", "event": "x"}\n')
    with pytest.raises(RecordingError, match="bad.jsonl:2"):
        read_recording(path)


def test_recovery_breakdown_orders_stages():
    b = RecoveryBreakdown(Policy.IN_MEMORY, {"rebinding": 0.001, "detection": 0.5})
    assert list(b.durations_s) == [Stage.DETECTION, Stage.REBINDING]
    assert b.total_s == pytest.approx(0.501)
    with pytest.raises(ValueError):
        RecoveryBreakdown("in_memory", {"consensus": -1})


def test_default_scenario_is_32_ranks_in_two_domains():
    mesh = default_scenario().mesh()
    assert mesh.world_size == 32
    assert [d.backend.value for d in mesh.domains] == ["nccl", "hccl"]
    assert mesh.link_class(0, 31) is LinkClass.ETHERNET
    assert mesh.links[LinkClass.ETHERNET].gbit_per_s == pytest.approx(1.0)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("name: x\n", "cluster: required field is missing"),
        ("name: x\ncluster: {domains: [{name: a, vendor: tpu, host: h, ranks: 2}]}\n", "cluster.domains.0.vendor"),
        ("name: x\ncluster: {domains: [{name: a, vendor: cuda, host: h, ranks: 0}]}\n", "positive rank count"),
        ("name: x\ncluster: {domainz: []}\n", "unknown field"),
        ("name: [x\n", "not valid YAML at line"),
        ("- 1\n", "expected a YAML mapping"),
    ],
)
def test_bad_scenario_names_field_and_expectation(text, expected):
    with pytest.raises(ScenarioError) as err:
        parse_scenario_text(text, "bad.yaml")
    assert "bad.yaml" in str(err.value) and expected in str(err.value)


def test_missing_scenario_file(tmp_path):
    with pytest.raises(ScenarioError, match="no such scenario file"):
        load_scenario(tmp_path / "nope.yaml")


def test_catalog_holds_published_values_with_sources():
    qwen = get_model("qwen3-14b")
    assert (qwen.hidden_size, qwen.intermediate_size, qwen.vocab_size) == (5120, 17408, 151936)
    assert qwen.full_logits_bytes_per_token() == 303_872
    assert get_model("minimax-m2").full_logits_bytes_per_token() == 400_128
    assert all(m.source.startswith("https://huggingface.co/") for m in CATALOG.values())
    with pytest.raises(FactError, match="unknown model"):
        get_model("gpt-5")


def test_load_hf_config_from_path(tmp_path):
    cfg = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_hf_config(tmp_path / "config.json", name="tiny")
    assert (m.head_dim, m.num_experts, m.is_moe) == (16, 8, True)
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(FactError, match="hidden_size"):
        load_hf_config(tmp_path / "broken.json")
