"""Benchmark: how fast the planning core compiles, lowers and checks.

For every structural transition (126) and every real edge (9), times compile + lower +
check (the median of several repetitions each), and times the same pipeline over a
synthetic 1,000-edge graph: the cross-domain edges of an 80-layer model whose attention
runs on CUDA and whose MLP runs on Ascend (attention-FFN disaggregation), in schedule
order: per layer and micro-batch of 2,048 tokens, the row-parallel attention output
(Partial(sum) over TP 4) crosses to the MLP ranks and the MLP's row-parallel output
crosses back, 160 edges per micro-batch, until 1,000 edges (six and a quarter
micro-batches). Goals: median under 200 µs per plan, the graph under 0.5 s. Prints a
table, then one JSON line.
"""

from __future__ import annotations

import statistics
import sys
import time

from meshpact.core.checker import check
from meshpact.core.contract import compile_contract
from meshpact.core.edges import EDGES, two_vendor_mesh
from meshpact.core.facts import Consumer, DType, Edge, ProducerTensor, Request
from meshpact.core.lowerer import lower
from meshpact.core.placement import Partial
from meshpact.core.transitions import enumerate_transitions
from _results import emit

PLAN_GOAL_US, GRAPH_GOAL_S = 200.0, 0.5
LAYERS, HIDDEN, TOKENS, GRAPH_EDGES = 80, 8192, 2048, 1000


def plan_once(edge: Edge) -> bool:
    contract = compile_contract(edge)
    return check(lower(contract), contract).ok


def time_plan_us(edge: Edge, reps: int) -> float:
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        assert plan_once(edge), edge.name
        samples.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(samples)


def synthetic_graph() -> list[Edge]:
    mesh = two_vendor_mesh(4, 4)
    out: list[Edge] = []
    mb = 0
    while len(out) < GRAPH_EDGES:
        for layer in range(LAYERS):
            for src, dst, op in (("cuda@hostA", "cann@hostB", "o_proj"), ("cann@hostB", "cuda@hostA", "down_proj")):
                if len(out) == GRAPH_EDGES:
                    break
                ranks = mesh.domain(dst).ranks
                out.append(
                    Edge(
                        f"mb{mb}.layer{layer}.{op}",
                        mesh,
                        ProducerTensor(
                            f"l{layer}.{op}",
                            f"layers.{layer}.{op}",
                            (TOKENS, HIDDEN),
                            DType.BFLOAT16,
                            src,
                            Partial("sum"),
                        ),
                        Consumer(f"l{layer}.{op}.reader", dst, ranks, Request.REDUCED),
                    )
                )
        mb += 1
    return out


def main() -> int:
    rows = []
    for t in enumerate_transitions():
        rows.append(("transition", t.label, time_plan_us(t.edge, 15)))
    for name, real in EDGES.items():
        rows.append(("edge", name, time_plan_us(real.edge, 15)))
    graph = synthetic_graph()
    for e in graph[:20]:
        plan_once(e)  # warm caches the way a long-running planner would be
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        ok = all(plan_once(e) for e in graph)
        runs.append(time.perf_counter() - t0)
        assert ok
    graph_s = min(runs)
    per = [r[2] for r in rows]
    median_us = statistics.median(per)
    print(f"{'kind':<11} {'case':<58} {'µs':>8}")
    for kind, label, us in rows[:: max(1, len(rows) // 20)] + [r for r in rows if r[0] == "edge"]:
        print(f"{kind:<11} {label[:58]:<58} {us:>8.1f}")
    print(
        f"\nplans timed: {len(rows)} (126 transitions + {len(EDGES)} edges), median {median_us:.1f} µs "
        f"(goal < {PLAN_GOAL_US:.0f}), p90 {statistics.quantiles(per, n=10)[-1]:.1f} µs"
    )
    print(f"{GRAPH_EDGES}-edge graph ({LAYERS} layers): {graph_s:.3f} s (goal < {GRAPH_GOAL_S} s), best of 3")
    emit(
        "planner",
        {
            "bench": "planner",
            "plans": len(rows),
            "median_us_per_plan": round(median_us, 1),
            "p90_us_per_plan": round(statistics.quantiles(per, n=10)[-1], 1),
            "max_us_per_plan": round(max(per), 1),
            "graph_edges": GRAPH_EDGES,
            "graph_1000_edges_s": round(graph_s, 4),
            "plan_goal_met": median_us < PLAN_GOAL_US,
            "graph_goal_met": graph_s < GRAPH_GOAL_S,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
