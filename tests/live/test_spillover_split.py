"""Model-split spillover: host 1 the first layers, host 2 the rest and the LM head, every step over the link."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from _warm import shared_forkserver
import torch

from meshpact.cli import main as cli_main
from meshpact.core.errors import MeshpactError
from meshpact.core.facts import Request
from meshpact.live.netns import netns_unavailable
from meshpact.live.spillover.decoder import LAYERS, Decoder, scaled_spec, split_parts
from meshpact.live.spillover.serving import RunResult, SpilloverConfig, run_once
from meshpact.live.spillover.split import OutputCheck, compare, reference
from meshpact.simulator.batching import simulate_split
from meshpact.simulator.serving import ServingParams

needs_netns = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))


def test_a_split_is_refused_where_a_host_would_hold_no_layer():
    with pytest.raises(MeshpactError, match="expected 1..1"):
        split_parts(2, 0)
    with pytest.raises(MeshpactError, match="expected 1..3"):
        split_parts(4, 4)
    first, last = split_parts(4, 3)
    assert (first.first, first.last, last.first, last.last) == (0, 3, 3, 4)
    assert first.embeds and not first.has_head and last.has_head and not last.embeds


def test_the_two_parts_compute_the_whole_decoder_up_to_the_bf16_boundary():
    torch.set_num_threads(1)
    spec = scaled_spec("minimax")
    first, last = split_parts(LAYERS, 1)
    whole = Decoder(spec, 2, 24, seed=11)
    a, b = Decoder(spec, 2, 24, seed=11), Decoder(spec, 2, 24, seed=11)
    a.keep_only(first)
    b.keep_only(last)
    assert a.head.numel() == 0 and b.embed.numel() == 0 and not a.layers[1] and not b.layers[0]
    prompts = [[3, 200_000, 17, 9, 4], [150_000, 2]]
    for s, p in enumerate(prompts):
        whole.prefill(s, p)
        b.prefill_part(s, last, a.prefill_part(s, first, torch.tensor(p)))
    tokens = [p[-1] for p in prompts]
    for _ in range(3):
        ref = whole.step([0, 1], tokens)
        hidden = a.step_part([0, 1], first, torch.tensor(tokens))
        assert hidden.dtype == torch.bfloat16 and hidden.shape == (2, spec.hidden)
        got = b.step_part([0, 1], last, hidden)
        assert got.shape == (2, 200_064)
        assert torch.allclose(got, ref, atol=0.1)  # only the boundary's rounding to bf16 differs
        assert (got - ref).abs().max() > 0  # ... and it does round: the parts are not the whole model
        tokens = [int(x) for x in ref.argmax(-1)]


_CFG = dict(model="dense", request="token", concurrency=2, requests=3, output_tokens=4, prompt_tokens=5, seed=3)
_SCHEDULE = [
    {"new": [[0, 0], [1, 1]], "batch": [0, 1]},
    {"new": [], "batch": [0, 1]},
    {"new": [], "batch": [0, 1]},
    {"new": [], "batch": [0, 1]},
    {"new": [[0, 2]], "batch": [0]},
    {"new": [], "batch": [0]},
    {"new": [], "batch": [0]},
    {"new": [], "batch": [0]},
]


@pytest.mark.slow
def test_the_reference_check_names_the_first_token_that_departs():
    out, _ = reference(_CFG, _SCHEDULE)
    assert sorted(out) == [0, 1, 2] and all(len(v) == 4 for v in out.values())
    assert compare(_CFG, _SCHEDULE, out, {}).identical
    bad = {rid: list(v) for rid, v in out.items()}
    bad[1][2] = (bad[1][2] + 1) % 151936
    check = compare(_CFG, _SCHEDULE, bad, {})
    assert not check.identical and check.tokens == 6
    assert check.first_difference == f"request 1 token 2: live {bad[1][2]}, reference {out[1][2]}"
    short = {**out, 2: out[2][:3]}
    assert "request 2: 3 tokens live, 4 in the reference" in str(compare(_CFG, _SCHEDULE, short, {}).first_difference)


@pytest.mark.slow
def test_the_reference_check_compares_log_probs_bit_for_bit():
    cfg = {**_CFG, "request": "logprob"}
    out, lp = reference(cfg, _SCHEDULE)
    assert all(v < 0 for vals in lp.values() for v in vals)
    assert compare(cfg, _SCHEDULE, out, lp).identical
    nudged = {rid: list(v) for rid, v in lp.items()}
    nudged[0][3] = nudged[0][3] * (1 + 1e-6)
    assert "request 0 log-prob 3" in str(compare(cfg, _SCHEDULE, out, nudged).first_difference)


def _params(request: str, concurrency: int, gbit: float = 1.0) -> ServingParams:
    return ServingParams(
        model="qwen3-14b",
        vocab_size=151936,
        local_vendor="cuda",
        remote_vendor="cann",
        local_slots=4,
        remote_slots=12,
        local_per_token_s=0.002,
        remote_per_token_s=0.01,
        local_prefill_s=0.003,
        remote_prefill_s=0.004,
        link_alpha_s=1e-4,
        link_beta_s_per_byte=8 / (gbit * 1e9),
        fabric_alpha_s=5e-6,
        fabric_beta_s_per_byte=1e-11,
        request=Request(request),
        consumer_ranks=1,
        producer_ranks=1,
        concurrency=concurrency,
        arrival_rate_per_s=None,
        output_tokens=10,
        requests=3 * concurrency,
    )


@pytest.mark.parametrize("concurrency", [1, 5])
def test_the_split_simulator_moves_every_step_over_the_link_at_any_concurrency(concurrency):
    full = simulate_split(_params("full", concurrency), hidden_size=96, prompt_tokens=7)
    token = simulate_split(_params("token", concurrency), hidden_size=96, prompt_tokens=7)
    tokens = 3 * concurrency * 10
    assert full.remote_tokens == token.remote_tokens == tokens and full.local_tokens == 0
    assert full.result_bytes == tokens * 2 * 151936 and token.result_bytes == tokens * 8
    # hidden states: every token's row plus each request's prompt (all but its last token)
    assert full.feedback_bytes == (tokens + 3 * concurrency * 6) * 96 * 2
    assert token.throughput_tok_s > full.throughput_tok_s
    # one step of one row: both hosts' parts, three α, the hidden row and one id across the link
    one = simulate_split(_params("token", 1), hidden_size=96, prompt_tokens=1)
    step = 0.002 + 0.01 + 2 * 1e-4 + (96 * 2 + 8) * 8e-9
    assert one.makespan_s == pytest.approx(3 * (0.003 + 0.004 + 10 * step), rel=1e-6)


def test_a_bad_deployment_is_refused_with_what_was_expected(capsys):
    assert cli_main(["live", "spillover", "--deployment", "layers"]) == 2
    assert "--deployment 'layers': expected one of requests, model" in capsys.readouterr().err
    with pytest.raises(MeshpactError, match="expected one of requests, model"):
        SpilloverConfig(deployment="pipeline")


_LIVE: dict[str, Any] = dict(
    deployment="model", model="moe", requests=4, output_tokens=5, prompt_tokens=6, timeout_s=120
)


@pytest.fixture(scope="module")
def split_runs() -> dict[tuple[str, int], RunResult]:
    if netns_unavailable():
        pytest.skip(str(netns_unavailable()))
    return {
        (req, c): run_once(SpilloverConfig(request=req, concurrency=c, **_LIVE), forkserver=shared_forkserver())
        for req, c in (("full", 1), ("logprob", 2), ("owner_token", 2))
    }


@pytest.mark.slow
@pytest.mark.live
@pytest.mark.netns
@needs_netns
@pytest.mark.timeout(1800)  # two packages compiled first: about 40 s on a quiet machine, over 10 min at load 30
def test_compiled_steps_serve_the_eager_runs_tokens_and_replay_through_the_same_packages(split_runs, tmp_path):
    eager = split_runs[("owner_token", 2)]
    aoti = run_once(
        SpilloverConfig(
            request="owner_token", concurrency=2, compile="aoti", work_dir=str(tmp_path), **{**_LIVE, "timeout_s": 300}
        ),
        forkserver=shared_forkserver(),
    )
    assert aoti.config.compile == "aoti" and aoti.compile_s > 0  # compiled in the parent, into a fresh work dir
    assert sorted(p.name.split("-")[1] for p in (Path(aoti.config.work_dir) / "aoti").glob("*.pt2")) == ["l0", "l1"]
    assert aoti.output_check == OutputCheck(20, True, None)
    assert aoti.outputs_digest == eager.outputs_digest  # greedy ids equal to the eager decoder's


@pytest.mark.slow
@pytest.mark.live
@pytest.mark.netns
@needs_netns
@pytest.mark.parametrize("key,row_bytes", [(("full", 1), 2 * 151936), (("logprob", 2), 4), (("owner_token", 2), 8)])
def test_every_step_crosses_both_ways_and_the_outputs_equal_the_single_process_reference(split_runs, key, row_bytes):
    r = split_runs[key]
    tokens = _LIVE["requests"] * _LIVE["output_tokens"]
    hidden = scaled_spec("moe").hidden
    assert len(r.latencies_s) == _LIVE["requests"] and r.remote_tokens == tokens  # concurrency 1 included
    assert r.result_bytes == r.planned["payload_bytes"] == tokens * row_bytes
    assert r.hidden_bytes == (tokens + _LIVE["requests"] * (_LIVE["prompt_tokens"] - 1)) * hidden * 2
    assert r.steps["remote"] == r.steps["local"] == tokens // key[1]
    assert r.veth_bytes >= r.result_bytes and r.veth_tx_bytes >= r.hidden_bytes
    assert r.output_check == OutputCheck(tokens, True, None)
    assert r.local_critical_s > 0 and r.remote_critical_s > 0
    # every message of the run timed end to end: prompts and steps host 1 -> 2, results back
    assert len(r.transfers) == r.steps["remote"] + _LIVE["requests"] + r.steps["remote"]
    assert sum(t.payload_bytes for t in r.transfers) == r.hidden_bytes + r.result_bytes
    assert all(0 < t.one_way_s < 5 for t in r.transfers)
