"""Benchmark: the training simulator at cluster scale, and sweeps on the local pool and on Dask.

Goals (issues 7 and 15): 1,024 ranks x 7 days under 2 s; 16,384 ranks x 30 days under 10 s;
16,384 ranks x 30 days with node-level faults (8 ranks per node), rack failures, hangs,
stragglers and a warm spare pool under 1 s in process; a 1,000-point sweep on a 2-worker
Dask LocalCluster whose rows equal the local process pool's exactly. Cost grows with events
(faults, checkpoints, recovery stages), not with ranks; one row raises the fault rate
tenfold to show that. Every policy runs on one shared trace. Prints a table, then one JSON
line with the load average it was measured at.

Run as a script (``python bench/simulator.py``): Dask starts its workers from this guarded main.
"""

from __future__ import annotations

import os
import time

from meshpact.core.recovery import Policy
from meshpact.core.scenario import builtin_scenario_path, load_scenario
from meshpact.simulator.sweep import run_sweep
from meshpact.simulator.training import simulate_training
from _results import emit

CASES = (
    ("r1024_d7_s", "whatif_1024", {"ranks": 1024, "days": 7}),
    ("r16384_d30_s", "whatif_16384_30d", {"ranks": 16384, "days": 30}),
    ("r16384_d30_nodes_spares_s", "whatif_16384_30d_nodes", {"ranks": 16384, "days": 30}),
    ("r16384_d30_10x_faults_s", "whatif_16384_30d", {"ranks": 16384, "days": 30, "overrides": {
        "faults.rank_mtbf_hours": 20000, "faults.rank_loss_mtbf_hours": 6670}}),
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
    return {"sweep_points": points, "sweep_rows": len(dask), "sweep_pool_2proc_s": round(pool_s, 2),
            "sweep_dask_local_2workers_s": round(dask_s, 2), "sweep_dask_equals_pool": same}


def main(repeats: int = 3) -> dict[str, object]:
    out, rows = training_cases(repeats)
    sweep = sweep_case()
    load = os.getloadavg()
    print(f"{'case':<28}{'ranks':>7}{'days':>6}{'faults':>8}{'timeline events':>17}{'seconds (best of %d)' % repeats:>22}")
    for key, ranks, days, faults, events, best in rows:
        print(f"{key:<28}{ranks:>7}{days:>6}{faults:>8}{events:>17}{best:>22.3f}")
    print(f"sweep of {sweep['sweep_points']} points ({sweep['sweep_rows']} rows): local pool of 2 processes "
          f"{sweep['sweep_pool_2proc_s']} s, Dask LocalCluster of 2 workers {sweep['sweep_dask_local_2workers_s']} s, "
          f"rows equal: {sweep['sweep_dask_equals_pool']}")
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    doc = {"bench": "simulator", "policies": len(Policy), **out, **sweep, "loadavg_1m": round(load[0], 2)}
    emit("simulator", doc)
    return doc


if __name__ == "__main__":
    main()
