"""Serving spillover against queueing laws, byte counts and closed forms."""

from __future__ import annotations

import pytest

from meshpact.core.catalog import get_model
from meshpact.core.facts import Request
from meshpact.core.scenario import builtin_scenario_path, load_scenario
from meshpact.simulator.serving import expected_tokens_per_pass, result_plan, serving_params, simulate_serving


@pytest.fixture(scope="module")
def spill():
    return load_scenario(builtin_scenario_path("serving_spillover"))


def test_littles_law_holds_for_open_loop_arrivals(spill):
    r = simulate_serving(
        spill,
        overrides={
            "serving.arrival_rate_per_s": 6.0,
            "serving.requests": 300,
            "serving.output_tokens": 64,
            "serving.seed": 4,
        },
    )
    assert r.spilled > 0  # the load reaches the remote host
    # L = λ·W: the time-average number in the system equals throughput times mean latency
    assert r.mean_in_system == pytest.approx(r.arrival_rate_per_s * r.latency_s["mean"], rel=1e-9)


def test_closed_loop_keeps_concurrency_requests_in_flight(spill):
    r = simulate_serving(spill, concurrency=4, requests=40)
    assert r.mean_in_system == pytest.approx(4.0, rel=1e-9)  # no request ever waits outside the system


@pytest.mark.parametrize("model", ["dense", "moe", "minimax"])
@pytest.mark.parametrize("request_kind, per_token", [("full", None), ("logprob", 4), ("token", 8), ("owner_token", 8)])
def test_bytes_sent_equal_bytes_received_and_the_catalog_sizes(spill, model, request_kind, per_token):
    r = simulate_serving(spill, model=model, concurrency=12, request=request_kind, requests=24, output_tokens=16)
    vocab = get_model(spill.serving.presets[model].model).vocab_size
    size = 2 * vocab if per_token is None else per_token  # bf16 logits are 2·V bytes per token
    assert r.spilled > 0
    assert r.result_bytes == r.bytes_received == r.remote_tokens * size
    assert r.remote_tokens == r.spilled * 16
    if request_kind == "full":
        assert r.feedback_bytes == r.remote_tokens * 8  # the sampled ids travel back


def test_no_spill_below_local_capacity_and_spill_above(spill):
    assert simulate_serving(spill, concurrency=8, requests=16).spilled == 0
    r = simulate_serving(spill, concurrency=16, requests=16)  # 8 local slots: 8 spill at once
    assert r.spilled == 8 and r.remote_tokens == 8 * spill.serving.output_tokens


def test_one_remote_request_takes_compute_plus_link_time_exactly(spill):
    # 9 clients, 8 local slots: exactly one request runs remotely, alone on the link
    p = serving_params(spill)
    n = 32
    r = simulate_serving(spill, concurrency=9, requests=9, request="full", output_tokens=n)
    logits = 2 * p.vocab_size
    per_token = (
        p.remote_per_token_s
        + (p.link_alpha_s + logits * p.link_beta_s_per_byte)
        + (p.link_alpha_s + 8 * p.link_beta_s_per_byte)
    )
    assert max(r.latencies) == pytest.approx(p.remote_prefill_s + n * per_token, rel=1e-9)
    # with a source projection the token streams back; only the last one is waited for
    r = simulate_serving(spill, concurrency=9, requests=9, request="token", output_tokens=n)
    want = p.remote_prefill_s + n * p.remote_per_token_s + p.link_alpha_s + 8 * p.link_beta_s_per_byte
    assert max(r.latencies) == pytest.approx(want, rel=1e-9)


def test_full_logits_saturate_a_slower_link(spill):
    fast = simulate_serving(spill, concurrency=16, request="full", requests=32)
    slow = simulate_serving(spill, concurrency=16, request="full", requests=32, link_gbps=0.25)
    assert slow.latency_s["p99"] > fast.latency_s["p99"] * 2
    same = simulate_serving(spill, concurrency=16, request="token", requests=32, link_gbps=0.25)
    assert same.latency_s["p99"] < fast.latency_s["p99"]


def test_results_cross_as_the_lowerers_plan(spill):
    from dataclasses import replace

    from meshpact.core.plan import StepKind

    p = replace(serving_params(spill), consumer_ranks=4)

    def sends(plan):
        return [s for s in plan.steps if s.kind is StepKind.SEND]

    owner = result_plan(replace(p, request=Request.OWNER_TOKEN), tokens=3, owner=2)
    assert [(s.ranks, s.payload_bytes) for s in sends(owner)] == [((4, 2), 3 * 8)]  # to the owner alone
    assert owner.steps[-1].ranks == (2,) and owner.startups == 1
    token = result_plan(replace(p, request=Request.TOKEN), tokens=3)
    assert [s.payload_bytes for s in sends(token)] == [24] and token.startups == 2  # then a broadcast at home
    full = result_plan(replace(p, request=Request.FULL), tokens=3)
    assert [s.payload_bytes for s in sends(full)] == [3 * 2 * p.vocab_size]
    # a vocab-sharded head still sends only the token: the projection happens at the source
    sharded = result_plan(replace(p, request=Request.TOKEN, producer_ranks=4), tokens=3)
    assert sum(s.payload_bytes for s in sends(sharded)) == 24 and sharded.startups > token.startups


@pytest.mark.parametrize("gamma, alpha", [(4, 0.8), (2, 0.5), (6, 0.9)])
def test_speculative_tokens_per_target_pass_match_the_closed_form(spill, gamma, alpha):
    # Leviathan et al. 2023: E[tokens per target pass] = (1 - α^(γ+1)) / (1 - α)
    r = simulate_serving(
        spill,
        concurrency=1,
        overrides={
            "serving.requests": 1,
            "serving.output_tokens": 60000,
            "serving.speculative": {"gamma": gamma, "alpha": alpha, "draft_cost_ratio": 0.1},
        },
    )
    want = expected_tokens_per_pass(gamma, alpha)
    assert r.tokens_per_target_pass == pytest.approx(want, rel=0.02)
    assert expected_tokens_per_pass(gamma, 0.0) == 1.0


def test_speculation_cuts_link_startups(spill):
    plain = simulate_serving(spill, concurrency=16, requests=16, request="token")
    spec = simulate_serving(
        spill,
        concurrency=16,
        requests=16,
        request="token",
        overrides={"serving.speculative": {"gamma": 4, "alpha": 0.8, "draft_cost_ratio": 0.05}},
    )
    assert spec.result_bytes == plain.result_bytes  # the same tokens cross
    assert spec.startups < plain.startups / 2  # in fewer messages


def test_the_model_deployment_crosses_the_link_every_step_even_at_concurrency_1(spill):
    from meshpact.simulator.batching import simulate_deployment

    hidden = get_model("qwen3-14b").hidden_size
    full = simulate_deployment(spill, "model", concurrency=1, request="full", requests=4)
    token = simulate_deployment(spill, "model", concurrency=1, request="token", requests=4)
    tokens = 4 * 128
    assert full.remote_tokens == token.remote_tokens == tokens and full.local_tokens == 0
    assert full.result_bytes == tokens * 2 * 151936 and token.result_bytes == tokens * 8
    assert full.feedback_bytes == token.feedback_bytes == tokens * hidden * 2  # hidden states to host 2
    assert token.throughput_tok_s > full.throughput_tok_s
    # the requests deployment at concurrency 1 never spills: nothing crosses
    assert simulate_deployment(spill, "requests", concurrency=1, request="full", requests=4).result_bytes == 0


def test_a_speculative_split_ships_gamma_plus_one_positions_or_a_verdict(spill):
    from meshpact.simulator.batching import simulate_deployment

    full = simulate_deployment(spill, "model", gamma=4, acceptance=0.6, concurrency=2, request="full", requests=4)
    token = simulate_deployment(spill, "model", gamma=4, acceptance=0.6, concurrency=2, request="token", requests=4)
    assert token.result_bytes % 16 == 0 and full.result_bytes % (5 * 151936 * 2) == 0
    assert full.result_bytes // (5 * 151936 * 2) == token.result_bytes // 16  # the same seeded acceptances
    per_round = 4 * 128 / (token.result_bytes // 16)
    assert 1.0 < per_round <= expected_tokens_per_pass(4, 0.6) * 1.15
    assert token.throughput_tok_s > full.throughput_tok_s


def test_simulate_serving_refuses_a_bad_deployment_or_half_a_speculation(capsys):
    from meshpact.cli import main as cli_main

    assert cli_main(["simulate", "serving", "--deployment", "pipeline"]) == 2
    assert "--deployment 'pipeline': expected one of requests, model" in capsys.readouterr().err
    assert cli_main(["simulate", "serving", "--speculative", "3"]) == 2
    assert "expected both" in capsys.readouterr().err
    assert cli_main(["simulate", "serving", "--speculative", "0", "--acceptance", "0.5"]) == 2
    assert "expected GAMMA >= 1" in capsys.readouterr().err
    assert (
        cli_main(["simulate", "serving", "--deployment", "model", "--concurrency", "2", "--requests", "4", "--json"])
        == 0
    )
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["spilled"] == 4 and out["local_tokens"] == 0 and out["remote_tokens"] == 4 * 128


@pytest.mark.slow
def test_the_simulate_page_puts_both_deployments_and_speculation_side_by_side():
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    main = str(Path(__file__).resolve().parents[2] / "app" / "main.py")
    at = AppTest.from_file(main, default_timeout=120).run()
    at.switch_page("views/simulate.py").run()
    compare = next(b for b in at.button if b.label == "Compare deployments")
    compare.click().run()
    assert not at.exception, [e.value for e in at.exception]
    tables = [t.value for t in at.dataframe]
    assert len(tables) == 2
    requests_side, model_side = tables
    assert list(requests_side["concurrency"].unique()) == list(model_side["concurrency"].unique())
    assert set(requests_side["request"]) == set(model_side["request"]) == {"full", "token"}
    # requests: nothing spills at concurrency 1, so nothing crosses; model: every token crosses
    one = requests_side[(requests_side["concurrency"] == 1) & (requests_side["request"] == "full")].iloc[0]
    assert one["result bytes/token"] == 0
    split = model_side[(model_side["concurrency"] == 1) & (model_side["request"] == "full")].iloc[0]
    assert split["result bytes/token"] > 100_000
    # speculation with verification at the source gains in the split deployment
    tok = model_side[(model_side["concurrency"] == 1) & (model_side["request"] == "token")].iloc[0]
    assert tok["tok/s speculative"] > tok["tok/s"]
