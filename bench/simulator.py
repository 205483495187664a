"""Benchmark: the training simulator at cluster scale, and sweeps on the local pool and on Dask.

Goals (issues 7 and 15): 1,024 ranks x 7 days under 2 s; 16,384 ranks x 30 days under 10 s;
16,384 ranks x 30 days with node-level faults (8 ranks per node), rack failures, hangs,
stragglers and a warm spare pool under 1 s in process; a 1,000-point sweep on a 2-worker
Dask LocalCluster whose rows equal the local process pool's exactly. Cost grows with events
(faults, checkpoints, recovery stages), not with ranks; one row raises the fault rate
tenfold to show that. Every policy runs on one shared trace. Prints a table, then one JSON
line with the load average it was measured at.

Issue 46: AIReSim's Table 1 cluster (the fleet model) under cold restart, replicated until the
95 % interval of the time to finish and of the effective training ratio is within ±1 % of the
mean, against AIReSim's published figures (Lin, Pattabiraman, Patel, arXiv 2603.07041, 2026;
its repository's docs/SIMULATION_REPORT.md); the same cluster under the other policies, with
their stages calibrated from the shipped live recordings; and one replication's time against
AIReSim's own, run from its source (``--airesim-src PATH``, put on PYTHONPATH of a child
process; simpy is the only module it needs). Without the path the speed comparison is skipped.

Run as a script (``python bench/simulator.py [--airesim-src PATH]``): Dask starts its workers
from this guarded main.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from meshpact.core.recovery import Policy
from meshpact.core.scenario import builtin_scenario_path, load_scenario
from meshpact.simulator.sweep import run_sweep
from meshpact.simulator.training import simulate_training
from _results import emit

ROOT = Path(__file__).resolve().parent.parent
# AIReSim's Table 1 figures: the paper's (as issue 46 quotes them) and its repository's report.
PUBLISHED: dict[str, dict[str, Any]] = {
    "paper": {
        "finish_h": 9850.0,
        "effective_training_ratio": 0.62,
        "s_per_replication": 18.0,
        "source": "Lin, Pattabiraman, Patel, arXiv 2603.07041, 2026",
    },
    "report": {
        "finish_h": 9865.97,
        "effective_training_ratio": 0.6228,
        "source": "karthikp-ubc/airesim docs/SIMULATION_REPORT.md",
    },
}
RECORDINGS = (
    "scenarios/recordings/live-trial-2-ranks.jsonl",
    "tests/simulator/data/live-kill-peer-restore-4-ranks.jsonl",
    "tests/simulator/data/live-kill-excise-4-ranks.jsonl",
)
AIRESIM_RUN = """
import json, sys, time
from airesim.params import Params
from airesim.simulator import Simulator
for seed in map(int, sys.argv[1:]):
    t0 = time.perf_counter()
    s = Simulator(Params(), seed=seed).run()
    print(json.dumps({"seed": seed, "s": time.perf_counter() - t0, "finish_h": s.training_time_hours,
                      "effective_training_ratio": s.effective_training_ratio, "failures": s.total_failures}), flush=True)
"""


def _airesim(src: Path, seeds: list[int]) -> list[dict]:
    """AIReSim's replications, run from its source in a child process."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", AIRESIM_RUN, *map(str, seeds)],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
        cwd=src,
    )
    if out.returncode != 0:
        raise SystemExit(f"bench/simulator.py: AIReSim from {src} failed: {out.stderr.strip().splitlines()[-1:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def fleet_cases(airesim_src: Path | None) -> dict[str, Any]:
    """Agreement with AIReSim's Table 1, the policies on the same cluster, and the speed ratio."""
    from meshpact.core.fleet import FleetSpec
    from meshpact.simulator.calibrate import calibration_from_recording
    from meshpact.simulator.fleet import Estimate, combine_adjust, fleet_charge, replicate, run_fleet, simulate_fleet

    fleet = FleetSpec()
    cold = fleet_charge(Policy.COLD_RESTART, fleet)
    t0 = time.perf_counter()
    ours = replicate(fleet, cold, confidence=0.95, tolerance=0.01, min_runs=10, max_runs=200, seed=1000)
    agree_s = time.perf_counter() - t0
    errors = {
        k: {
            "finish_h": ours.finish_h.mean / v["finish_h"] - 1,
            "effective_training_ratio": ours.effective_training_ratio.mean / v["effective_training_ratio"] - 1,
        }
        for k, v in PUBLISHED.items()
    }
    within = all(abs(x) < 0.03 for e in errors.values() for x in e.values())
    agreement: dict[str, Any] = {
        "published": PUBLISHED,
        "ours": {
            "finish_h": ours.finish_h.to_dict(),
            "effective_training_ratio": ours.effective_training_ratio.to_dict(),
            "converged": ours.converged,
            "tolerance": ours.tolerance,
            "failures_mean": sum(r.failures for r in ours.runs) / len(ours.runs),
            "wall_s": round(agree_s, 2),
        },
        "error_vs_published": errors,
        "within_3_percent": within,
    }

    cals = [calibration_from_recording(ROOT / p) for p in RECORDINGS]
    adjust = combine_adjust(*((tuple(c.measured), c.adjust) for c in cals))
    scenario = load_scenario(builtin_scenario_path("airesim_table1"))
    comp = simulate_fleet(scenario, policies=list(Policy), adjust=adjust, tolerance=0.01, min_runs=10, seed=2000)
    policies = [
        {
            "policy": p.value,
            "recovery_s": round(r.charge.downtime_s, 2),
            "rollback_every_s": r.charge.rollback_every_s,
            "slowdown": round(r.charge.slowdown, 5),
            "replications": len(r.runs),
            "finish_h": round(r.finish_h.mean, 1),
            "finish_h_half_width": round(r.finish_h.half_width, 1),
            "effective_training_ratio": round(r.effective_training_ratio.mean, 4),
            "effective_training_ratio_half_width": round(r.effective_training_ratio.half_width, 4),
        }
        for p, r in comp.results.items()
    ]

    speed: dict[str, Any]
    best = min(_timed(lambda s=s: run_fleet(fleet, cold, seed=s)) for s in range(3))
    if airesim_src is None:
        print("speed comparison skipped: no --airesim-src PATH (a checkout of github.com/karthikp-ubc/airesim)")
        speed = {"ours_s_per_replication": round(best, 3), "skipped": "no --airesim-src"}
    else:
        one = _airesim(airesim_src, [42])  # alone, for the time
        more = one + _airesim(airesim_src, [43, 44, 45])
        theirs = one[0]["s"]
        speed = {
            "ours_s_per_replication": round(best, 3),
            "airesim_s_per_replication": round(theirs, 2),
            "ratio": round(theirs / best, 1),
        }
        agreement["airesim_here"] = {
            "replications": len(more),
            "finish_h": Estimate.of([r["finish_h"] for r in more], 0.95).to_dict(),
            "effective_training_ratio": Estimate.of([r["effective_training_ratio"] for r in more], 0.95).to_dict(),
            "failures_mean": sum(r["failures"] for r in more) / len(more),
        }
        agreement["error_vs_airesim_here"] = {
            "finish_h": ours.finish_h.mean / agreement["airesim_here"]["finish_h"]["mean"] - 1,
            "effective_training_ratio": ours.effective_training_ratio.mean
            / agreement["airesim_here"]["effective_training_ratio"]["mean"]
            - 1,
        }
    return {"airesim_table1": agreement, "airesim_table1_policies": policies, "airesim_table1_speed": speed}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


CASES = (
    ("r1024_d7_s", "whatif_1024", {"ranks": 1024, "days": 7}),
    ("r16384_d30_s", "whatif_16384_30d", {"ranks": 16384, "days": 30}),
    ("r16384_d30_nodes_spares_s", "whatif_16384_30d_nodes", {"ranks": 16384, "days": 30}),
    (
        "r16384_d30_10x_faults_s",
        "whatif_16384_30d",
        {
            "ranks": 16384,
            "days": 30,
            "overrides": {"faults.rank_mtbf_hours": 20000, "faults.rank_loss_mtbf_hours": 6670},
        },
    ),
)
SWEEP = {"seed": list(range(1, 101)), "checkpoint_every": [100, 200, 300, 400, 500, 700, 1000, 1500, 2000, 3000]}


def training_cases(repeats: int) -> tuple[dict[str, float], list[tuple]]:
    out: dict[str, float] = {}
    rows = []
    for key, name, flags in CASES:
        scenario = load_scenario(builtin_scenario_path(name))
        best, result = float("inf"), None
        for _ in range(repeats):
            t0 = time.perf_counter()
            result = simulate_training(scenario, **flags)
            best = min(best, time.perf_counter() - t0)
        assert result is not None
        events = sum(len(r.timeline) for r in result.policies.values())
        out[key] = round(best, 4)
        rows.append((key, flags["ranks"], flags["days"], len(result.trace), events, best))
    return out, rows


def sweep_case() -> dict[str, float | int | bool]:
    scenario = load_scenario(builtin_scenario_path("default"))
    points = len(SWEEP["seed"]) * len(SWEEP["checkpoint_every"])
    t0 = time.perf_counter()
    pool = run_sweep(scenario, {**SWEEP, "days": [1]}, processes=2)
    pool_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    dask = run_sweep(scenario, {**SWEEP, "days": [1]}, processes=2, scheduler="local")
    dask_s = time.perf_counter() - t0
    same = bool(pool.equals(dask))
    return {
        "sweep_points": points,
        "sweep_rows": len(dask),
        "sweep_pool_2proc_s": round(pool_s, 2),
        "sweep_dask_local_2workers_s": round(dask_s, 2),
        "sweep_dask_equals_pool": same,
    }


def main(repeats: int = 3, airesim_src: Path | None = None) -> dict[str, Any]:
    fleet = fleet_cases(airesim_src)
    out, rows = training_cases(repeats)
    sweep = sweep_case()
    load = os.getloadavg()
    print(
        f"{'case':<28}{'ranks':>7}{'days':>6}{'faults':>8}{'timeline events':>17}{'seconds (best of %d)' % repeats:>22}"
    )
    for key, ranks, days, faults, events, best in rows:
        print(f"{key:<28}{ranks:>7}{days:>6}{faults:>8}{events:>17}{best:>22.3f}")
    print(
        f"sweep of {sweep['sweep_points']} points ({sweep['sweep_rows']} rows): local pool of 2 processes "
        f"{sweep['sweep_pool_2proc_s']} s, Dask LocalCluster of 2 workers {sweep['sweep_dask_local_2workers_s']} s, "
        f"rows equal: {sweep['sweep_dask_equals_pool']}"
    )
    a = fleet["airesim_table1"]
    ours = a["ours"]
    print(
        f"AIReSim Table 1 under cold restart: {ours['finish_h']['mean']:,.0f} h ± {ours['finish_h']['half_width']:,.0f}, "
        f"effective training ratio {ours['effective_training_ratio']['mean']:.4f} ± "
        f"{ours['effective_training_ratio']['half_width']:.4f} over {ours['finish_h']['n']} replications; "
        f"within 3 % of the published figures: {a['within_3_percent']}"
    )
    print(f"{'policy':<20}{'recovery (s)':>14}{'time to finish (h)':>22}{'effective training ratio':>28}")
    for r in fleet["airesim_table1_policies"]:
        print(
            f"{r['policy']:<20}{r['recovery_s']:>14.1f}{r['finish_h']:>14,.0f} ± {r['finish_h_half_width']:<5,.0f}"
            f"{r['effective_training_ratio']:>20.4f} ± {r['effective_training_ratio_half_width']:.4f}"
        )
    sp = fleet["airesim_table1_speed"]
    if "ratio" in sp:
        print(
            f"one replication: {sp['ours_s_per_replication']} s here, {sp['airesim_s_per_replication']} s in AIReSim: "
            f"{sp['ratio']}x"
        )
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    doc = {"bench": "simulator", "policies": len(Policy), **out, **sweep, **fleet, "loadavg_1m": round(load[0], 2)}
    emit("simulator", doc)
    return doc


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the training simulator at scale, and against AIReSim")
    ap.add_argument(
        "--airesim-src",
        type=Path,
        default=None,
        help="a checkout of github.com/karthikp-ubc/airesim, for the speed comparison",
    )
    args = ap.parse_args()
    if args.airesim_src is not None and not (args.airesim_src / "airesim" / "simulator.py").is_file():
        raise SystemExit(
            f"--airesim-src {args.airesim_src}: no airesim/simulator.py there; give a checkout of "
            "github.com/karthikp-ubc/airesim"
        )
    main(airesim_src=args.airesim_src)
