"""The simulator beside a live spillover run: the same parameters, calibrated from the machine.

Live mode and the simulator never import each other; this module sits above both (as the
CLI does) and turns one measured :class:`~meshpact.live.spillover.serving.RunResult` into the
serving model's :class:`~meshpact.simulator.serving.ServingParams`:

* the model, the slots of each host, the load and the request, as the run used them;
* the link's β from the ``tc`` rate, per byte of payload: bulk TCP carries an MSS of
  ``MTU − 52`` bytes (IPv4 20, TCP 20, timestamps 12) in a frame of ``MTU + 14`` bytes
  (Ethernet header), and the token bucket counts frames;
* the link's α from the run's timed ping-pong of one small message (half the round trip);
  for the model deployment, from the messages of the run itself (:func:`service_alpha`);
* each host's per-step compute from its timed forward passes: host 2's plus its part of
  the result plan (the source projection, before anything is sent), or for ``full`` plus
  host 1's sampling of the logits (host 2 waits for the chosen ids).

For the model deployment (the decoder split by layers) the same kind of quantities feed
:func:`~meshpact.simulator.batching.simulate_split`: each host's part of a step's
critical path (host 1 from a result's arrival to the next hidden states' send, host 2 from
the step's command to the result's send, less its waits: layers, choice or projection, the
plans' admission and copies), the prefills, the hidden size of the split, and the link's
α and β.

:func:`simulated` runs the batched (lockstep) model, which is what the live hosts do, and
the per-slot model for comparison. :func:`measure` is the paired measurement with this
prediction beside every row.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

from meshpact.core.facts import Request
from meshpact.live.spillover.decoder import scaled_spec
from meshpact.live.spillover.serving import RunResult, SpilloverConfig
from meshpact.live.spillover.pairs import Row, measure_pairs
from meshpact.simulator.batching import simulate_batched, simulate_split
from meshpact.simulator.serving import ServingParams, expected_tokens_per_pass, simulate_params

__all__ = [
    "ETHERNET_MTU",
    "wire_efficiency",
    "service_alpha",
    "sim_params",
    "simulated",
    "measure",
    "SPECULATIVE_COLUMNS",
    "speculative_table_rows",
]

ETHERNET_MTU = 1500
_TCP_IP_HEADERS = 52  # IPv4 20 + TCP 20 + timestamps option 12 (Linux default)
_ETHERNET_HEADER = 14


def wire_efficiency(mtu: int = ETHERNET_MTU) -> float:
    """Payload bytes per byte the token bucket counts, for bulk TCP (MSS over frame length)."""
    return (mtu - _TCP_IP_HEADERS) / (mtu + _ETHERNET_HEADER)


def service_alpha(run: RunResult, beta: float) -> float:
    """The link's α in service: the mean over the run's timed messages of the time in flight
    less the payload's time at ``beta``; the ping-pong's α where the run timed none.

    The ping-pong runs before serving, between two idle hosts, and keeps the median of 21
    round trips; in service each message has to wake a host blocked in its receive, and on
    a loaded machine that host's CPU is often running other work, so a message's time in
    flight has a long tail. The mean, not the median: the throughput is the sum of the steps,
    and every step waits for two messages."""
    if not run.transfers:
        return run.link_alpha_s
    return max(0.0, statistics.fmean(t.one_way_s - t.payload_bytes * beta for t in run.transfers))


def sim_params(run: RunResult) -> ServingParams:
    """The serving model's parameters for ``run`` (see the module docstring)."""
    cfg = run.config
    spec = scaled_spec(cfg.model)
    beta = 8.0 / (cfg.gbit_per_s * 1e9) / wire_efficiency()
    project = run.remote_project_s if cfg.request != "full" else run.consumer_sample_s
    local, remote = run.local_step_s, run.remote_forward_s + project
    gamma = alpha = None
    link_alpha = run.link_alpha_s
    if run.speculative is not None:
        # host 1 drafts (and, for full, verifies the logits); host 2 scores γ + 1 positions
        # (and, verified at the source, verifies); α is the run's measured acceptance
        gamma, alpha = cfg.gamma, run.speculative.alpha
        local = run.local_step_s + (run.consumer_sample_s if cfg.request == "full" else 0.0)
        remote = run.remote_forward_s + (run.remote_project_s if cfg.request != "full" else 0.0)
    elif cfg.deployment == "model":
        # each host's part of a step's critical path (what the other host waits for)
        local, remote = run.local_critical_s, run.remote_critical_s
    link_alpha = service_alpha(run, beta)
    return ServingParams(
        model=spec.source,
        vocab_size=spec.vocab_size,
        local_vendor="cuda",
        remote_vendor="cann",
        local_slots=cfg.local_slots,
        remote_slots=cfg.remote_slots,
        local_per_token_s=local,
        remote_per_token_s=remote,
        local_prefill_s=run.local_prefill_s,
        remote_prefill_s=run.remote_prefill_s,
        link_alpha_s=link_alpha + cfg.delay_ms * 1e-3,
        link_beta_s_per_byte=beta,
        fabric_alpha_s=5e-6,
        fabric_beta_s_per_byte=1e-11,
        request=Request(cfg.request),
        consumer_ranks=1,
        producer_ranks=1,
        concurrency=cfg.concurrency,
        arrival_rate_per_s=None,
        output_tokens=cfg.output_tokens,
        requests=cfg.requests,
        seed=cfg.seed,
        gamma=gamma,
        alpha=alpha,
    )


def simulated(run: RunResult) -> dict[str, Any]:
    """The prediction for ``run``: the batched model's numbers, and the per-slot model's throughput."""
    p = sim_params(run)
    if run.config.deployment == "model":
        split = simulate_split(p, scaled_spec(run.config.model).hidden, run.config.prompt_tokens)
        return {
            "throughput_tok_s": split.throughput_tok_s,
            "result_bytes": split.result_bytes,
            "link_alpha_s": p.link_alpha_s,
            "hidden_bytes": split.feedback_bytes,
            "latency_s": dict(split.latency_s),
            "startups": split.startups,
            "per_slot_throughput_tok_s": None,
        }
    batched = simulate_batched(p)
    per_slot = simulate_params(p)
    return {
        "throughput_tok_s": batched.throughput_tok_s,
        "result_bytes": batched.result_bytes,
        "latency_s": dict(batched.latency_s),
        "startups": batched.startups,
        "per_slot_throughput_tok_s": per_slot.throughput_tok_s,
    }


def measure(
    models: Sequence[str],
    concurrencies: Sequence[int],
    requests: Sequence[str],
    pairs: int,
    base: SpilloverConfig,
    requests_per_client: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """:func:`~meshpact.live.spillover.pairs.measure_pairs` with :func:`simulated` beside every row."""
    return measure_pairs(models, concurrencies, requests, pairs, base, simulated, requests_per_client, progress)


SPECULATIVE_COLUMNS = (
    "model",
    "request",
    "conc",
    "gamma",
    "alpha (measured)",
    "tokens/pass",
    "(1-a^(g+1))/(1-a)",
    "result B/round",
    "tok/s",
)


def speculative_table_rows(rows: Sequence[Row]) -> list[list[str]]:
    """Speculative rows: measured α and tokens per target pass beside the closed form, bytes per round."""
    out = []
    for r in rows:
        if r.speculative is None:
            continue
        sp = r.speculative
        g = int(sp["gamma"])
        out.append(
            [
                r.model,
                r.request,
                str(r.concurrency),
                str(g),
                f"{sp['alpha']:.3f}",
                f"{sp['tokens_per_pass']:.2f}",
                f"{expected_tokens_per_pass(g, sp['alpha']):.2f}",
                f"{sp['bytes_per_round']:,.0f}",
                f"{r.throughput_tok_s:.1f}",
            ]
        )
    return out
