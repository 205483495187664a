"""Two-host spillover: results cross the veth as the lowered plan, metered, kernel-counted, simulated."""

from __future__ import annotations

from typing import Any

import pytest

from _warm import shared_forkserver
import torch

from meshpact.cli import main as cli_main
from meshpact.live.spillover.decoder import Decoder, scaled_spec
from meshpact.live.netns import netns_unavailable
from meshpact.live.spillover.serving import RunResult, SpilloverConfig, run_once
from meshpact.live.spillover.pairs import pair_orders, traffic_cut
from meshpact.live.spillover.split import OutputCheck
from meshpact.spillover_sim import simulated

needs_netns = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))


def test_scaled_models_keep_each_familys_real_vocabulary_and_shape():
    dense, moe, minimax = scaled_spec("dense"), scaled_spec("moe"), scaled_spec("minimax")
    assert (dense.vocab_size, moe.vocab_size, minimax.vocab_size) == (151936, 151936, 200064)
    assert dense.experts == 0 and dense.intermediate > 0
    assert moe.experts > 0 and moe.experts_per_token > 0 and minimax.experts > 0
    assert dense.hidden == 5120 // 64 and moe.hidden == 2048 // 64 and minimax.hidden == 3072 // 64


def test_a_sequence_decodes_the_same_alone_and_in_a_batch():
    torch.set_num_threads(1)
    model = Decoder(scaled_spec("moe"), slots=3, max_len=12, seed=5)
    model.prefill(0, [5, 6, 7])
    model.prefill(1, [9, 10, 11, 12, 13])
    model.prefill(2, [1, 2])
    batched = model.step([0, 1, 2], [7, 13, 2])
    alone = Decoder(scaled_spec("moe"), slots=1, max_len=12, seed=5)
    alone.prefill(0, [9, 10, 11, 12, 13])
    single = alone.step([0], [13])
    assert batched.shape == (3, 151936)
    assert torch.allclose(batched[1], single[0], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(batched[0], batched[1])


def test_pairs_alternate_which_request_runs_first():
    assert pair_orders(["token"], 3) == [["full", "token"], ["token", "full"], ["full", "token"]]


def test_bad_command_line_values_name_the_flag_and_the_expectation(capsys):
    assert cli_main(["live", "spillover", "--model", "gpt"]) == 2
    assert "--model 'gpt': gpt unknown; expected one or more of dense, moe, minimax" in capsys.readouterr().err
    assert cli_main(["live", "spillover", "--concurrency", "8,zero"]) == 2
    assert "expected positive integers" in capsys.readouterr().err
    assert cli_main(["live", "spillover", "--request", "logits"]) == 2
    assert "expected one or more of full, logprob, token, owner_token" in capsys.readouterr().err
    assert cli_main(["live", "spillover", "--compile", "jit"]) == 2
    assert "--compile 'jit': expected one of eager, aoti" in capsys.readouterr().err


def test_a_concurrency_beyond_both_hosts_slots_is_refused():
    with pytest.raises(Exception, match="exceeds the two hosts"):
        SpilloverConfig(concurrency=20, local_slots=4, remote_slots=12)


_SMALL: dict[str, Any] = dict(
    model="moe", concurrency=6, requests=9, output_tokens=6, local_slots=4, remote_slots=4, timeout_s=90
)


@pytest.fixture(scope="module")
def small_runs() -> dict[str, RunResult]:
    if netns_unavailable():
        pytest.skip(str(netns_unavailable()))
    return {
        req: run_once(SpilloverConfig(request=req, **_SMALL), forkserver=shared_forkserver())
        for req in ("full", "token", "logprob", "owner_token")
    }


@pytest.mark.slow
@pytest.mark.live
@pytest.mark.netns
@needs_netns
@pytest.mark.parametrize(
    "request_kind,row_bytes", [("full", 2 * 151936), ("token", 8), ("logprob", 4), ("owner_token", 8)]
)
def test_results_cross_as_the_plan_predicts_and_the_kernel_sees_them(small_runs, request_kind, row_bytes):
    r = small_runs[request_kind]
    assert len(r.latencies_s) == _SMALL["requests"]  # every request completed
    assert r.spilled >= 1 and r.remote_tokens == r.spilled * _SMALL["output_tokens"]
    assert r.result_bytes == r.planned["payload_bytes"] == r.remote_tokens * row_bytes
    assert r.startups == r.planned["startups"] == r.steps["remote"]  # one bridge message per remote step
    assert r.veth_bytes >= r.result_bytes  # the kernel counts payload plus headers
    if request_kind == "full":
        assert r.veth_bytes < 1.1 * r.result_bytes
    sim = simulated(r)
    assert sim["result_bytes"] > 0 and sim["throughput_tok_s"] > 0


@pytest.mark.slow
@pytest.mark.live
@pytest.mark.netns
@needs_netns
def test_source_projection_cuts_result_traffic_by_more_than_99_9_percent(small_runs):
    full = small_runs["full"]
    for req in ("token", "logprob", "owner_token"):
        assert traffic_cut(small_runs[req], full) > 0.999  # metered by the executor
        # the kernel also counts headers and gloo's rendezvous per message: still far below full logits
        assert traffic_cut(small_runs[req], full, "veth_bytes") > 0.99


def _run(request: str, thr: float, digest: str | None = None, deployment: str = "model") -> RunResult:
    cfg = SpilloverConfig(request=request, deployment=deployment, concurrency=1, requests=1, output_tokens=2)
    return RunResult(
        config=cfg,
        throughput_tok_s=thr,
        latencies_s=(1.0,),
        makespan_s=1.0,
        tokens=2,
        remote_tokens=2,
        spilled=1,
        result_bytes=8 if request != "full" else 607744,
        veth_bytes=100,
        veth_tx_bytes=10,
        command_bytes=10,
        startups=2,
        steps={"local": 2, "remote": 2},
        link_alpha_s=1e-4,
        local_step_s=0.01,
        remote_forward_s=0.01,
        remote_project_s=0.001,
        consumer_sample_s=0.001,
        local_prefill_s=0.0,
        remote_prefill_s=0.0,
        outputs_digest=digest,
        output_check=OutputCheck(2, True, None),
    )


def test_rows_keep_every_pairs_throughputs_and_flag_outputs_that_depart_from_full():
    from meshpact.live.spillover.pairs import _rows, mismatched

    runs = {
        "full": [_run("full", 10.0, "a"), _run("full", 12.0, "b")],
        "token": [_run("token", 11.0, "a"), _run("token", 9.0, "c")],
        "logprob": [_run("logprob", 13.0, "x"), _run("logprob", 14.0, "y")],
    }
    rows = {
        r.request: r
        for r in _rows(
            "dense",
            1,
            runs,
            ["full", "token", "logprob"],
            lambda r: {"throughput_tok_s": 1.0, "result_bytes": 0, "per_slot_throughput_tok_s": None},
        )
    }
    assert rows["full"].throughputs_tok_s == (10.0, 12.0) and rows["token"].throughputs_tok_s == (11.0, 9.0)
    assert rows["token"].pairs_favouring == {"token": 1, "full": 1}
    assert (
        rows["token"].pair_throughputs_tok_s == ((10.0, 11.0), (12.0, 9.0)) and not rows["full"].pair_throughputs_tok_s
    )
    assert rows["token"].outputs_as_full is False  # the second pair's token run chose other ids
    assert rows["logprob"].outputs_as_full is None  # scoring targets: its ids are not chosen
    assert rows["full"].tokens_checked == 4 and rows["full"].outputs_identical
    assert [r.request for r in mismatched(list(rows.values()))] == ["token"]


def test_a_message_is_timed_from_its_send_to_its_receive_on_the_shared_clock():
    from meshpact.live.spillover.serving import Transfer, transfers

    sent = [
        {"group": "bridge:0-1", "seq": 0, "op": "send", "t": 1.0, "seconds": 0.001, "contributed": 160},
        {"group": "bridge:0-1", "seq": 1, "op": "send", "t": 2.0, "seconds": 0.001, "contributed": 320},
        {"group": "bridge:0-1", "seq": 2, "op": "send", "t": 3.0, "seconds": 0.001, "contributed": 8},
    ]
    # the receiver's meter started 10 s earlier; it waited in its first receive before the send
    received = [
        {"group": "bridge:0-1", "seq": 0, "op": "recv", "t": 10.5, "seconds": 0.504, "contributed": 0},
        {"group": "bridge:0-1", "seq": 1, "op": "recv", "t": 12.0, "seconds": 0.010, "contributed": 0},
    ]
    got = transfers(sent, 100.0, received, 90.0)
    assert [t.payload_bytes for t in got] == [160, 320]  # seq 2 never received: not a transfer
    assert [round(t.one_way_s, 6) for t in got] == [0.004, 0.010]
    assert got[0] == Transfer(got[0].one_way_s, 160)


def test_the_simulators_link_alpha_is_the_runs_mean_time_in_flight_less_the_payload():
    from meshpact.live.spillover.serving import Transfer
    from meshpact.spillover_sim import service_alpha

    class Run:  # the two fields service_alpha reads
        link_alpha_s = 1e-4
        transfers = ()

    assert service_alpha(Run(), 8e-9) == 1e-4  # no timed messages: the ping-pong's
    run = Run()
    run.transfers = (Transfer(0.002, 0), Transfer(0.010, 1_000_000), Transfer(0.001, 0))
    assert service_alpha(run, 8e-9) == pytest.approx((0.002 + 0.002 + 0.001) / 3)
