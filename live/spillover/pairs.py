"""Paired spillover runs: full logits against source projection, with the simulator beside them.

Machine noise on a shared CPU moves throughput by more than the effect of a few bytes, so
every comparison is a set of *pairs*: one run of ``full`` and one run of each projected
request (``logprob``, ``token``, ``owner_token``) on the same model and concurrency, the
order alternating from pair to pair (full first, then last), each run on fresh processes
and fresh namespaces (:func:`~meshpact.live.spillover.serving.run_once`). A pair favours the
request with the higher throughput. Each row reports medians over its runs, latency
percentiles over all its requests, and a prediction made per run by the caller's
``predict`` (the simulator, calibrated from the run: :mod:`meshpact.spillover_sim`).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from meshpact.core.errors import MeshpactError
from meshpact.core.jsonform import JsonObject

from .serving import REQUESTS, RunResult, SpilloverConfig, run_once

Predict = Callable[[RunResult], Mapping[str, Any]]

__all__ = ["Row", "measure_pairs", "pair_orders", "traffic_cut", "mismatched"]


@dataclass(frozen=True)
class Row:
    model: str
    request: str
    concurrency: int
    throughput_tok_s: float
    latency_s: Mapping[str, float]
    result_bytes: int
    veth_bytes: int
    startups: int
    pairs_favouring: Mapping[str, int]
    simulated: Mapping[str, Any]
    runs: int
    remote_tokens: int
    result_bytes_per_remote_token: float | None
    traffic_cut_vs_full: float | None = None  # 1 - bytes per remote token / full's (projected rows)
    veth_cut_vs_full: float | None = None  # the same, from the kernel's count on the veth
    sim_error: float = 0.0  # simulated / measured throughput - 1
    deployment: str = "requests"
    hidden_bytes: int = 0  # model deployment: hidden states host 1 -> host 2 (median over runs)
    tokens_checked: int = 0  # model deployment: output ids compared with the single-process reference
    outputs_identical: bool | None = None  # model deployment: every run's outputs equal the reference
    first_difference: str | None = None  # the first departure from the reference, where one was found
    throughputs_tok_s: tuple[float, ...] = ()  # every run's throughput, in pair order
    pair_throughputs_tok_s: tuple[tuple[float, float], ...] = ()  # projected rows: (full, this request) per pair
    outputs_as_full: bool | None = None  # model deployment, ids chosen: every run's outputs equal its pair's full run's
    speculative: Mapping[str, float] | None = None  # medians: γ, measured α, tokens per target pass, bytes per round
    compile: str = "eager"  # the decoders' steps: eager or AOTInductor packages
    outputs_digests: tuple[str, ...] = ()  # model deployment: every run's output fingerprint, in pair order

    def to_dict(self) -> JsonObject:
        return asdict(self)


def pair_orders(projected: Sequence[str], pairs: int) -> list[list[str]]:
    """Run order of each pair: full first in even pairs, last in odd ones."""
    return [["full", *projected] if i % 2 == 0 else [*projected, "full"] for i in range(pairs)]


def traffic_cut(projected: RunResult | Row, full: RunResult | Row, counted: str = "result_bytes") -> float | None:
    """How much less traffic per remote token the projected request moves than full logits
    (``counted``: ``result_bytes`` as metered by the executor, ``veth_bytes`` as the kernel
    counted it); None when nothing spilled."""

    def per_token(r: Any) -> float | None:
        return getattr(r, counted) / r.remote_tokens if r.remote_tokens else None

    p, f = per_token(projected), per_token(full)
    return None if p is None or not f else 1.0 - p / f


def measure_pairs(
    models: Sequence[str],
    concurrencies: Sequence[int],
    requests: Sequence[str],
    pairs: int,
    base: SpilloverConfig,
    predict: Predict,
    requests_per_client: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Run every pair for every model and concurrency; one :class:`Row` per (model, request, concurrency)."""
    bad = [r for r in requests if r not in REQUESTS]
    if bad or not requests:
        raise MeshpactError(f"--request {','.join(requests)}: expected one or more of {', '.join(REQUESTS)}")
    if pairs < 1:
        raise MeshpactError(f"--pairs: expected at least 1, got {pairs}")
    projected = [r for r in REQUESTS if r in requests and r != "full"]
    rows: list[Row] = []
    for model in models:
        for c in concurrencies:
            runs: dict[str, list[RunResult]] = {r: [] for r in ["full", *projected]}
            for i, order in enumerate(pair_orders(projected, pairs)):
                for req in order:
                    cfg = replace(base, model=model, request=req, concurrency=c, requests=requests_per_client * c)
                    if progress:
                        progress(f"{model} c={c} pair {i + 1}/{pairs}: {req}")
                    runs[req].append(run_once(cfg))
            rows += _rows(model, c, runs, requests, predict)
    return rows


def _median_or_none(xs: Any) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def _favouring(runs: Mapping[str, list[RunResult]], req: str) -> dict[str, int]:
    full = runs["full"]
    if req != "full":
        wins = sum(p.throughput_tok_s > f.throughput_tok_s for p, f in zip(runs[req], full))
        return {req: wins, "full": len(full) - wins}
    others = [r for r in runs if r != "full"]
    lost = sum(runs[o][i].throughput_tok_s > f.throughput_tok_s for o in others for i, f in enumerate(full))
    return {"full": len(others) * len(full) - lost, "projected": lost}


def _rows(
    model: str, c: int, runs: Mapping[str, list[RunResult]], wanted: Sequence[str], predict: Predict
) -> list[Row]:
    out = []
    full_row = None
    for req in ["full", *[r for r in runs if r != "full"]]:
        rs = runs[req]
        sims = [predict(r) for r in rs]
        lat = np.concatenate([np.asarray(r.latencies_s) for r in rs])
        remote_tokens = int(statistics.median(r.remote_tokens for r in rs))
        result_bytes = int(statistics.median(r.result_bytes for r in rs))
        measured = statistics.median(r.throughput_tok_s for r in rs)
        sim_thr = statistics.median(s["throughput_tok_s"] for s in sims)
        row = Row(
            model=model,
            request=req,
            concurrency=c,
            throughput_tok_s=measured,
            latency_s={"p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99))},
            result_bytes=result_bytes,
            veth_bytes=int(statistics.median(r.veth_bytes for r in rs)),
            startups=int(statistics.median(r.startups for r in rs)),
            pairs_favouring=_favouring(runs, req),
            simulated={
                "throughput_tok_s": sim_thr,
                "result_bytes": int(statistics.median(s["result_bytes"] for s in sims)),
                "per_slot_throughput_tok_s": _median_or_none(s["per_slot_throughput_tok_s"] for s in sims),
                "link_alpha_s": _median_or_none(s.get("link_alpha_s") for s in sims),
                "ping_pong_alpha_s": statistics.median(r.link_alpha_s for r in rs),
            },
            runs=len(rs),
            remote_tokens=remote_tokens,
            result_bytes_per_remote_token=result_bytes / remote_tokens if remote_tokens else None,
            sim_error=sim_thr / measured - 1.0,
        )
        checks = [r.output_check for r in rs if r.output_check is not None]
        if checks:
            bad = [c.first_difference for c in checks if not c.identical]
            row = replace(
                row,
                tokens_checked=sum(c.tokens for c in checks),
                outputs_identical=not bad,
                first_difference=bad[0] if bad else None,
            )
        if rs[0].speculative is not None:
            keys = ("gamma", "alpha", "tokens_per_pass", "bytes_per_round", "rounds")
            row = replace(
                row, speculative={k: statistics.median(float(getattr(r.speculative, k)) for r in rs) for k in keys}
            )
        # logprob feeds the request's targets instead of the choices: its ids differ by design
        if req not in ("full", "logprob") and all(r.outputs_digest for r in rs + list(runs["full"])):
            row = replace(
                row, outputs_as_full=all(p.outputs_digest == f.outputs_digest for p, f in zip(rs, runs["full"]))
            )
        if req != "full":
            row = replace(
                row,
                pair_throughputs_tok_s=tuple(
                    (f.throughput_tok_s, p.throughput_tok_s) for f, p in zip(runs["full"], rs)
                ),
            )
        row = replace(
            row,
            deployment=rs[0].config.deployment,
            throughputs_tok_s=tuple(r.throughput_tok_s for r in rs),
            compile=rs[0].config.compile,
            outputs_digests=tuple(r.outputs_digest or "" for r in rs),
            hidden_bytes=int(statistics.median(r.hidden_bytes for r in rs)),
        )
        if req == "full":
            full_row = row
        elif full_row is not None:
            row = replace(
                row,
                traffic_cut_vs_full=traffic_cut(row, full_row),
                veth_cut_vs_full=traffic_cut(row, full_row, "veth_bytes"),
            )
        if req in wanted:
            out.append(row)
    return out


COLUMNS = (
    "model",
    "request",
    "conc",
    "compile",
    "tok/s",
    "sim tok/s",
    "sim err",
    "p50 s",
    "p99 s",
    "result B",
    "veth B",
    "sim B",
    "cut",
    "veth cut",
    "startups",
    "pairs",
    "outputs",
)


def table_rows(rows: Sequence[Row]) -> list[list[str]]:
    """The rows as text cells under :data:`COLUMNS` (the CLI and the benchmark print the same table)."""
    out = []
    for r in rows:
        cut, vcut = ("-" if c is None else f"{100 * c:.3f}%" for c in (r.traffic_cut_vs_full, r.veth_cut_vs_full))
        fav = " ".join(f"{k}:{v}" for k, v in r.pairs_favouring.items())
        out.append(
            [
                r.model,
                r.request,
                str(r.concurrency),
                r.compile,
                f"{r.throughput_tok_s:.1f}",
                f"{r.simulated['throughput_tok_s']:.1f}",
                f"{100 * r.sim_error:+.1f}%",
                f"{r.latency_s['p50']:.3f}",
                f"{r.latency_s['p99']:.3f}",
                str(r.result_bytes),
                str(r.veth_bytes),
                str(r.simulated["result_bytes"]),
                cut,
                vcut,
                str(r.startups),
                fav,
                _outputs_cell(r),
            ]
        )
    return out


def _outputs_cell(r: Row) -> str:
    """The output checks: tokens identical to the reference and/or to full's, or the first difference (loud)."""
    cells = []
    if r.outputs_identical is not None:
        cells.append(
            f"{r.tokens_checked} identical"
            if r.outputs_identical
            else f"DIFFERENT FROM REFERENCE: {r.first_difference}"
        )
    if r.outputs_as_full is not None:
        cells.append("= full" if r.outputs_as_full else "DIFFERENT FROM FULL")
    return ", ".join(cells) or "-"


def mismatched(rows: Sequence[Row]) -> list[Row]:
    """Rows with a run whose outputs departed from the single-process reference or from its pair's full run."""
    return [r for r in rows if r.outputs_identical is False or r.outputs_as_full is False]
