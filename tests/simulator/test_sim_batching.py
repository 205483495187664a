"""The lockstep-batched serving model against closed forms."""

from __future__ import annotations

import pytest

from meshpact.core.errors import ScenarioError
from meshpact.core.facts import Request
from meshpact.simulator.batching import simulate_batched
from meshpact.simulator.serving import ServingParams

V = 151936


def params(request: str, **kw: object) -> ServingParams:
    base = dict(
        model="Qwen/Qwen3-30B-A3B",
        vocab_size=V,
        local_vendor="cuda",
        remote_vendor="cann",
        local_slots=1,
        remote_slots=2,
        local_per_token_s=0.03,
        remote_per_token_s=0.02,
        local_prefill_s=0.0,
        remote_prefill_s=0.0,
        link_alpha_s=1e-4,
        link_beta_s_per_byte=8e-9,
        fabric_alpha_s=5e-6,
        fabric_beta_s_per_byte=1e-11,
        request=Request(request),
        consumer_ranks=1,
        producer_ranks=1,
        concurrency=3,
        arrival_rate_per_s=None,
        output_tokens=10,
        requests=3,
    )
    base.update(kw)
    return ServingParams(**base)  # type: ignore[arg-type]  # a dict of every field, values of each type


def test_without_spillover_a_host_decodes_its_batch_in_lockstep():
    r = simulate_batched(params("token", local_slots=2, concurrency=2, requests=4, local_per_token_s=0.01))
    assert r.spilled == 0 and r.latencies == pytest.approx((0.1,) * 4)
    assert r.throughput_tok_s == pytest.approx(2 / 0.01)
    assert r.mean_in_system == pytest.approx(r.arrival_rate_per_s * r.latency_s["mean"])  # Little's law


def test_full_logits_stall_the_remote_batch_for_the_message_and_the_chosen_ids():
    p = params("full")
    r = simulate_batched(p)
    a, b, n = p.link_alpha_s, p.link_beta_s_per_byte, p.output_tokens
    logits = 2 * (2 * V) * b  # two rows of bf16 logits per step
    cycle = p.remote_per_token_s + a + logits + a + 2 * 8 * b
    remote = (n - 1) * cycle + p.remote_per_token_s + a + logits
    assert sorted(r.latencies) == pytest.approx(sorted([n * p.local_per_token_s, remote, remote]))
    assert r.result_bytes == r.remote_tokens * 2 * V and r.spilled == 2
    assert r.startups == 2 * n  # one result message and one feedback message per remote step


def test_source_projection_streams_results_while_the_remote_host_decodes_on():
    p = params("token")
    r = simulate_batched(p)
    remote = p.output_tokens * p.remote_per_token_s + p.link_alpha_s + 2 * 8 * p.link_beta_s_per_byte
    assert sorted(r.latencies)[:2] == pytest.approx([remote, remote])
    assert r.result_bytes == r.remote_tokens * 8 and r.startups == p.output_tokens


def test_open_loop_and_speculative_settings_are_refused():
    with pytest.raises(ScenarioError, match="closed-loop"):
        simulate_batched(params("token", arrival_rate_per_s=5.0))
    with pytest.raises(ScenarioError, match="speculative"):
        simulate_batched(params("token", gamma=4, alpha=0.7, draft_cost_ratio=0.1))
