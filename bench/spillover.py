"""Benchmark: two-host spillover over a 1 Gbit/s veth, full logits against source projection.

For each model family (dense Qwen3-14B, MoE Qwen3-30B-A3B, MiniMax-M2 vocabularies) and
concurrency 1, 8 and 16: paired runs of ``full`` and each projected request on fresh
processes and namespaces, the kernel's and the executor's count of result traffic, and the
simulator calibrated from each run's timed forward passes, the ``tc`` rate and a timed
ping-pong. Checks the issue's acceptance: projection cuts result traffic per remote token
by more than 99.9 %, is faster (at concurrency 8 and 16 for ``--deployment requests``, at
every concurrency for ``--deployment model``, where every step crosses), the simulator is
within 20 %, and, for the model deployment, every run's outputs equal the single-process
reference (with ``--speculative GAMMA``: equal between full and source verification).
Needs root, ``ip`` and ``tc``. Prints a table with the load average, then one JSON line
(every pair's throughputs under ``throughputs_tok_s``). ``--compile eager,aoti`` measures
every row with the decoders' eager steps and again with their AOTInductor packages
(compiled once, before the runs, cached under ``--work-dir``), and says for each row the
throughput ratio and whether the two decoded the same ids.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

from meshpact.core.scenario import SERVING_REQUESTS, Deployment
from meshpact.live.netns import netns_unavailable
from meshpact.live.spillover.serving import COMPILE_MODES, SpilloverConfig
from meshpact.live.spillover.pairs import COLUMNS, Row, mismatched, table_rows
from meshpact.spillover_sim import SPECULATIVE_COLUMNS, measure, speculative_table_rows
from _results import emit


def acceptance(rows: list[Row], min_concurrency: int = 8) -> dict[str, object]:
    """The issue's checks over the measured rows (projection faster from ``min_concurrency`` on)."""
    cuts = [r.traffic_cut_vs_full for r in rows if r.traffic_cut_vs_full is not None]
    veth_cuts = [r.veth_cut_vs_full for r in rows if r.veth_cut_vs_full is not None]
    by_key = {(r.model, r.request, r.concurrency): r for r in rows}
    faster = [
        r.throughput_tok_s > by_key[(r.model, "full", r.concurrency)].throughput_tok_s
        for r in rows
        if r.request != "full" and r.concurrency >= min_concurrency and (r.model, "full", r.concurrency) in by_key
    ]
    errors = [abs(r.sim_error) for r in rows]
    return {
        "min_traffic_cut": min(cuts) if cuts else None,
        "traffic_cut_over_99_9": bool(cuts) and min(cuts) > 0.999,
        "min_veth_cut": min(veth_cuts) if veth_cuts else None,
        "projected_faster": bool(faster) and all(faster),
        "projected_faster_from_concurrency": min_concurrency,
        "projected_faster_count": f"{sum(faster)}/{len(faster)}",
        "max_abs_sim_error": max(errors) if errors else None,
        "sim_within_20pct": bool(errors) and max(errors) <= 0.20,
        "outputs_checked": not mismatched(rows),
    }


def compiled_against_eager(rows: list[Row]) -> dict[str, object]:
    """Each aoti row against its eager row: throughput ratio, and whether every run decoded
    the same ids (model deployment; ``logprob`` compares the chosen ids, which are its targets)."""
    eager = {(r.model, r.request, r.concurrency): r for r in rows if r.compile == "eager"}
    ratios, same, differ = {}, 0, []
    for r in rows:
        e = eager.get((r.model, r.request, r.concurrency))
        if r.compile != "aoti" or e is None:
            continue
        ratios[f"{r.model}/{r.request}/{r.concurrency}"] = round(r.throughput_tok_s / e.throughput_tok_s, 3)
        digests = set(r.outputs_digests) | set(e.outputs_digests)
        if "" not in digests:
            if len(digests) == 1:
                same += 1
            else:
                differ.append(f"{r.model}/{r.request}/{r.concurrency}")
    return {"aoti_vs_eager_throughput": ratios, "aoti_rows_with_eager_ids": same, "aoti_rows_with_other_ids": differ}


def _progress(mode: str, message: str) -> None:
    print(f"[{mode}] {message}", file=sys.stderr, flush=True)


def _print(columns: tuple[str, ...], cells: list[list[str]]) -> None:
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(x.rjust(w) for x, w in zip(row, widths)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="dense,moe,minimax")
    ap.add_argument("--concurrency", default="1,8,16")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--requests-per-client", type=int, default=3)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--link-gbps", type=float, default=1.0)
    ap.add_argument("--deployment", choices=[d.value for d in Deployment], default=Deployment.REQUESTS.value)
    ap.add_argument("--speculative", type=int, default=0, metavar="GAMMA")
    ap.add_argument("--compile", default="eager", help="eager, aoti or both (eager,aoti): the decoders' steps")
    ap.add_argument("--work-dir", default="", help="where aoti packages are cached")
    a = ap.parse_args()
    modes = [m.strip() for m in a.compile.split(",") if m.strip()]
    if not modes or any(m not in COMPILE_MODES for m in modes):
        print(f"--compile {a.compile!r}: expected eager, aoti or eager,aoti", file=sys.stderr)
        return 2
    why = netns_unavailable()
    if why:
        print(f"skipped: {why}")
        print(json.dumps({"bench": "spillover", "skipped": why}))
        return 0
    concs = [int(c) for c in a.concurrency.split(",")]
    requests = [r.value for r in SERVING_REQUESTS]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    rows: list[Row] = []
    for mode in modes:
        base = SpilloverConfig(
            output_tokens=a.output_tokens,
            gbit_per_s=a.link_gbps,
            deployment=a.deployment,
            gamma=a.speculative,
            request="token",
            compile=mode,
            work_dir=a.work_dir,
        )
        rows += measure(
            a.models.split(","),
            concs,
            requests,
            a.pairs,
            base,
            a.requests_per_client,
            progress=functools.partial(_progress, mode),
        )
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()
    _print(COLUMNS, table_rows(rows))
    if a.speculative:
        _print(SPECULATIVE_COLUMNS, speculative_table_rows(rows))
    acc = acceptance([r for r in rows if r.compile == modes[0]], min_concurrency=1 if a.deployment == "model" else 8)
    if len(modes) > 1:
        acc.update(compiled_against_eager(rows))
    load = {
        "before": [round(x, 2) for x in load_before],
        "after": [round(x, 2) for x in load_after],
        "cores": os.cpu_count(),
    }
    print(
        f"acceptance: {acc}  ({a.pairs} pairs per row, {wall:.0f} s, load average (1/5/15 min) "
        f"before {load['before']}, after {load['after']}, {load['cores']} cores)"
    )
    emit(
        f"spillover-{a.deployment}" + (f"-speculative{a.speculative}" if a.speculative else ""),
        {
            "bench": "spillover",
            "deployment": a.deployment,
            "speculative": a.speculative,
            "compile": modes,
            "link_gbps": a.link_gbps,
            "pairs": a.pairs,
            "wall_s": round(wall, 1),
            "load_average": load,
            **acc,
            "rows": [r.to_dict() for r in rows],
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
