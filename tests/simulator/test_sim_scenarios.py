"""Scenario sections: shipped files load and run; bad files name file, field and expectation."""

from __future__ import annotations

import pytest

from meshpact.core.errors import ScenarioError
from meshpact.core.recovery import Policy
from meshpact.core.scenario import builtin_scenario_path, builtin_scenarios, load_scenario, parse_scenario_text
from meshpact.simulator.training import simulate_training

CLUSTER = """cluster:
  domains:
    - {name: a, vendor: cuda, host: h1, ranks: 4}
    - {name: b, vendor: cann, host: h2, ranks: 4}
"""


@pytest.mark.parametrize("name", ["default", "whatif_1024", "whatif_16384_30d", "serving_spillover"])
def test_shipped_scenarios_load(name):
    assert name in builtin_scenarios()
    load_scenario(builtin_scenario_path(name))


def test_default_scenario_keeps_its_cluster_and_runs_all_policies():
    sc = load_scenario(builtin_scenario_path("default"))
    assert sc.mesh().world_size == 32 and len(sc.mesh().domains) == 2
    r = simulate_training(sc, days=1)
    assert [p.value for p in r.policies] == [p.value for p in Policy]


@pytest.mark.parametrize(
    "section, field, expected",
    [
        ("workload: {model: gpt-17}", "workload.model", "unknown model 'gpt-17'"),
        ("workload: {step_seconds: -1}", "workload.step_seconds", "greater than 0"),
        ("workload: {step_seconds: 1, tokens_per_step: 10}", "workload", "not both"),
        ("workload: {mfu: 1.5}", "workload.mfu", "less than or equal to 1"),
        ("faults: {rank_mtbf_hours: 0}", "faults.rank_mtbf_hours", "greater than 0"),
        (
            "faults: {scripted: [{at_s: 5, impact: meteor}]}",
            "faults.scripted.0.impact",
            "'transient', 'hang' or 'rank_loss'",
        ),
        ("faults: {mtbf: 5}", "faults.mtbf", "unknown field"),
        ("checkpointing: {mode: sometimes}", "checkpointing.mode", "'sync' or 'async'"),
        ("checkpointing: {every_steps: 0}", "checkpointing.every_steps", "greater than or equal to 1"),
        ("recovery: {policies: [reboot]}", "recovery.policies.0", "'cold_restart'"),
        ("recovery: {costs: {detection: 3}}", "recovery.costs.detection", "unknown field"),
        (
            "recovery: {stage_seconds: {in_memory: {replay: 1}}}",
            "recovery.stage_seconds",
            "replay follows from lost steps",
        ),
        ("checkpointng: {mode: sync}", "(top level)", "did you mean 'checkpointing'"),
        ("serving: {presets: {}}", "serving.presets", "at least 1 item"),
        (
            "serving: {model: big, presets: {dense: {model: qwen3-14b, local: {vendor: cuda, slots: 1, per_token_s: 0.01}, "
            "remote: {vendor: cann, slots: 1, per_token_s: 0.02}}}}",
            "serving",
            "not a preset",
        ),
        (
            "serving: {request: shard, presets: {dense: {model: qwen3-14b, local: {vendor: cuda, slots: 1, per_token_s: 0.01}, "
            "remote: {vendor: cann, slots: 1, per_token_s: 0.02}}}}",
            "serving.request",
            "expected one of",
        ),
    ],
)
def test_bad_section_names_file_field_and_expectation(section, field, expected):
    with pytest.raises(ScenarioError) as err:
        parse_scenario_text(f"name: x\n{CLUSTER}{section}\n", "bad.yaml")
    text = str(err.value)
    assert "bad.yaml" in text and f"{field}" in text and expected in text, text


def test_async_snapshot_larger_than_host_memory_is_refused(tmp_path):
    path = tmp_path / "small_host.yaml"
    path.write_text(f"name: x\n{CLUSTER}checkpointing: {{mode: async, host_memory_gib_per_rank: 1}}\n")
    with pytest.raises(
        ScenarioError, match=r"checkpointing.host_memory_gib_per_rank: an async snapshot needs 27.5 GiB"
    ):
        simulate_training(load_scenario(path))


def test_parallelism_must_divide_the_ranks():
    sc = parse_scenario_text(f"name: x\n{CLUSTER}workload: {{parallelism: {{tensor: 3}}}}\n", "p.yaml")
    with pytest.raises(
        ScenarioError, match="workload.parallelism: a replica of tensor x pipeline = 3 ranks must divide the 8"
    ):
        simulate_training(sc)


def test_bad_override_names_the_field():
    sc = load_scenario(builtin_scenario_path("default"))
    with pytest.raises(ScenarioError, match=r"checkpointing.every_steps: Input should be greater than or equal to 1"):
        simulate_training(sc, checkpoint_every=0)


def test_scripted_fault_on_a_rank_outside_the_job_is_refused():
    sc = parse_scenario_text(f"name: x\n{CLUSTER}faults: {{scripted: [{{at_s: 1, rank: 8}}]}}\n", "f.yaml")
    with pytest.raises(ScenarioError, match=r"x: faults.scripted.0.rank: rank 8 is not in the job; expected 0..7"):
        simulate_training(sc)
