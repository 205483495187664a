"""Speculative decoding across the link: full logits of γ+1 positions against verification at the source."""

from __future__ import annotations

import pytest

from _warm import shared_forkserver
import torch

from meshpact.cli import main as cli_main
from meshpact.core.errors import MeshpactError, ScenarioError
from meshpact.core.facts import Request
from meshpact.live.netns import netns_unavailable
from meshpact.live.spillover.decoder import Decoder, scaled_spec
from meshpact.live.spillover.serving import SpilloverConfig, run_once
from meshpact.live.spillover.speculative import acceptance, digest, verify
from meshpact.simulator.batching import simulate_split
from meshpact.simulator.serving import ServingParams, expected_tokens_per_pass
from meshpact.spillover_sim import simulated

needs_netns = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))


def test_verification_accepts_the_drafts_up_to_the_first_the_target_would_not_choose():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [9, 6, 7], [5, 0, 7]])
    chosen = torch.tensor([[5, 6, 7, 8], [5, 6, 1, 2], [4, 6, 7, 8], [5, 6, 7, 8]])
    k, nxt = verify(drafts, chosen)
    assert k == [3, 2, 0, 1]  # a later agreement after a rejection counts for nothing
    assert nxt == [8, 1, 4, 6]  # the target's own token where the drafts stop (the bonus when all agree)


def test_alpha_counts_each_accepted_draft_against_each_rejection():
    alpha, per_pass = acceptance([4, 0, 2, 4], gamma=4)
    assert alpha == pytest.approx(10 / 12) and per_pass == pytest.approx(14 / 4)
    assert acceptance([4, 4], gamma=4)[0] == 1.0 and acceptance([0, 0, 0], gamma=2) == (0.0, 1.0)


def test_a_perturbed_draft_agrees_less_the_larger_its_noise_and_keeps_the_targets_shape():
    torch.set_num_threads(1)
    target = Decoder(scaled_spec("moe"), 1, 40, seed=4)
    agree = {}
    for scale in (0.0, 0.3):
        draft = target.perturbed(scale, seed=1)
        assert draft.head.shape == target.head.shape and draft.layers[0].keys() == target.layers[0].keys()
        target.prefill(0, [1, 2, 3])
        draft.prefill(0, [1, 2, 3])
        tok, same = 3, 0
        for _ in range(12):
            a = int(target.step([0], [tok]).argmax())
            same += a == int(draft.step([0], [tok]).argmax())
            tok = a
        agree[scale] = same
    assert agree[0.0] == 12 and agree[0.3] < 12


def test_scoring_several_positions_matches_stepping_them_one_by_one():
    torch.set_num_threads(1)
    spec = scaled_spec("dense")
    a, b = Decoder(spec, 2, 30, seed=9), Decoder(spec, 2, 30, seed=9)
    for m in (a, b):
        m.prefill(1, [7, 8, 9, 10])
    scored = a.score([1], torch.tensor([[10, 11, 12]]), [3])
    stepped = torch.stack([b.step([1], [t])[0] for t in (10, 11, 12)])
    assert scored.shape == (1, 3, 151936) and int(a.length[1]) == 6
    assert torch.allclose(scored[0], stepped, atol=1e-4)
    a.set_length(1, 4)  # reject the last two: rescoring from position 4 overwrites them
    again = a.score([1], torch.tensor([[11, 5]]), [4])
    assert torch.allclose(again[0, 0], stepped[1], atol=1e-4)


def _params(request: str, gamma: int, alpha: float) -> ServingParams:
    return ServingParams(
        model="qwen3-14b",
        vocab_size=151936,
        local_vendor="cuda",
        remote_vendor="cann",
        local_slots=4,
        remote_slots=12,
        local_per_token_s=0.004,
        remote_per_token_s=0.01,
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
        output_tokens=400,
        requests=6,
        gamma=gamma,
        alpha=alpha,
        seed=2,
    )


def test_the_speculative_pipeline_yields_the_closed_forms_tokens_per_pass_and_its_bytes_per_round():
    for alpha in (0.3, 0.8):
        r = simulate_split(_params("token", 5, alpha), hidden_size=64, prompt_tokens=4)
        assert r.remote_tokens == 6 * 400
        assert r.result_bytes % 16 == 0  # a verdict (two int64) per sequence and round
        sequence_rounds = r.result_bytes // 16
        assert r.target_passes <= sequence_rounds <= 3 * r.target_passes
        # a request's last round may yield fewer tokens than it drew: slightly under the closed form
        assert 6 * 400 / sequence_rounds == pytest.approx(expected_tokens_per_pass(5, alpha), rel=0.05)
    full = simulate_split(_params("full", 5, 0.8), hidden_size=64, prompt_tokens=4)
    assert full.result_bytes % (6 * 2 * 151936) == 0  # the logits of γ + 1 positions per sequence and round
    assert full.result_bytes // (6 * 2 * 151936) >= full.target_passes
    assert full.throughput_tok_s < simulate_split(_params("token", 5, 0.8), 64, 4).throughput_tok_s
    with pytest.raises(ScenarioError, match="alpha in"):
        simulate_split(_params("token", 5, 1.5), 64, 4)
    # the target's choice per position to its owner; a verdict and a log-prob per position
    owner = simulate_split(_params("owner_token", 5, 0.8), 64, 4)
    assert owner.result_bytes % (6 * 8) == 0 and owner.result_bytes // (6 * 8) >= owner.target_passes
    logprob = simulate_split(_params("logprob", 5, 0.8), 64, 4)
    assert (
        logprob.result_bytes % (16 + 6 * 4) == 0 and logprob.startups == 2 * logprob.target_passes
    )  # two messages a round


def test_speculation_is_refused_where_it_cannot_run(capsys):
    assert cli_main(["live", "spillover", "--speculative", "4"]) == 2
    assert "--speculative: expected --deployment model" in capsys.readouterr().err
    assert cli_main(["live", "spillover", "--deployment", "model", "--speculative", "4", "--request", "logits"]) == 2
    assert "expected one or more of full, logprob, token, owner_token" in capsys.readouterr().err
    with pytest.raises(MeshpactError, match="expected 1..16"):
        SpilloverConfig(deployment="model", gamma=40, request="token")


@pytest.mark.slow
@pytest.mark.live
@pytest.mark.netns
@needs_netns
def test_full_logits_and_source_verification_decode_the_same_tokens_and_alpha_predicts_the_passes():
    cfg = dict(deployment="model", gamma=3, model="dense", concurrency=2, requests=4, output_tokens=16, timeout_s=120)
    full = run_once(SpilloverConfig(request="full", **cfg), forkserver=shared_forkserver())
    token = run_once(SpilloverConfig(request="token", **cfg), forkserver=shared_forkserver())
    assert full.outputs_digest == token.outputs_digest  # token-identical outputs
    assert full.outputs_digest != digest({0: [0]})
    sf, st = full.speculative, token.speculative
    assert sf is not None and st is not None
    assert sf.rounds == st.rounds and sf.alpha == st.alpha  # the same verdicts, round by round
    assert 0.0 < sf.alpha < 1.0 and sf.tokens_per_pass > 1.0
    assert sf.tokens_per_pass == pytest.approx(expected_tokens_per_pass(3, sf.alpha), rel=0.2)
    assert full.result_bytes == sf.sequence_rounds * 4 * 151936 * 2
    assert token.result_bytes == sf.sequence_rounds * 16
    assert st.bytes_per_round * st.rounds == token.result_bytes
    assert simulated(full)["result_bytes"] > 1000 * simulated(token)["result_bytes"] > 0
    # the lowerer's owner_token plan per position, and the verdict with the emitted tokens' log-probs
    owner = run_once(SpilloverConfig(request="owner_token", **cfg), forkserver=shared_forkserver())
    logprob = run_once(SpilloverConfig(request="logprob", **cfg), forkserver=shared_forkserver())
    assert owner.outputs_digest == logprob.outputs_digest == full.outputs_digest
    assert owner.result_bytes == sf.sequence_rounds * 4 * 8
    assert logprob.result_bytes == sf.sequence_rounds * (16 + 4 * 4)
    # each emitted token's log-prob under the target, against a one-token-at-a-time replay in this process
    from meshpact.live.plans.ops import reference_logprob

    assert len(logprob.emitted_logprobs) == 4 and all(len(v) == 16 for v in logprob.emitted_logprobs)
    spec = scaled_spec("dense")
    target = Decoder(spec, 1, 40, seed=2)  # the target: the run's seed (0) + 2
    from meshpact.live.spillover.serving import prompt_for

    prompt = prompt_for(SpilloverConfig(**cfg).to_dict(), 0, spec.vocab_size)
    target.prefill(0, prompt)
    token_id, replay = prompt[-1], []
    for _ in range(16):
        logits = target.step([0], [token_id]).to(torch.bfloat16)
        token_id = int(logits.argmax(-1))
        replay.append(float(reference_logprob(logits, torch.tensor([token_id]))[0]))
    assert logprob.emitted_logprobs[0] == pytest.approx(replay, abs=0.05)
    assert all(x <= 0 for v in logprob.emitted_logprobs for x in v)
