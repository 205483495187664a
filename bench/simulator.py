"""Benchmark: the training simulator at cluster scale, all four policies on one fault trace.

Goals (issue 7): 1,024 ranks x 7 days under 2 s and 16,384 ranks x 30 days under 10 s.
Cost grows with events (faults, checkpoints, recovery stages), not with ranks; the last
row raises the fault rate tenfold to show that. Prints a table, then one JSON line.
"""

from __future__ import annotations

import json
import time

from meshpact.core.scenario import builtin_scenario_path, load_scenario
from meshpact.simulator.training import simulate_training

CASES = (
    ("r1024_d7_s", "whatif_1024", {"ranks": 1024, "days": 7}),
    ("r16384_d30_s", "whatif_16384_30d", {"ranks": 16384, "days": 30}),
    ("r16384_d30_10x_faults_s", "whatif_16384_30d", {"ranks": 16384, "days": 30, "overrides": {
        "faults.rank_mtbf_hours": 20000, "faults.rank_loss_mtbf_hours": 6670}}),
)


def main(repeats: int = 3) -> dict[str, float]:
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
    print(f"{'case':<26}{'ranks':>7}{'days':>6}{'faults':>8}{'timeline events':>17}{'seconds (best of %d)' % repeats:>22}")
    for key, ranks, days, faults, events, best in rows:
        print(f"{key:<26}{ranks:>7}{days:>6}{faults:>8}{events:>17}{best:>22.3f}")
    print(json.dumps({"bench": "simulator", "policies": 4, **out}))
    return out


if __name__ == "__main__":
    main()
