"""A checkpoint-interval sweep recovers Young's optimal interval sqrt(2·δ·M).

Young (1974), "A first order approximation to the optimum checkpoint interval": with
checkpoint cost δ and mean time between failures M, the expected waste per unit time is
about δ/τ + τ/(2M), smallest at τ = sqrt(2δM). Daly (2006) refines it to
sqrt(2δM)·(1 + sqrt(δ/(2M))/3 + δ/(18M)) − δ for δ < 2M.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshpact.simulator.sweep import run_sweep

DELTA, M_S, RANKS = 60.0, 3600.0, 32  # checkpoint seconds, cluster MTBF seconds


@pytest.mark.slow
def test_sweep_recovers_young_daly_optimal_interval(make_scenario):
    zero = {s: 0.0 for s in ("detection", "consensus", "communicator", "state", "rebinding")}
    sc = make_scenario(
        workload={"model": "qwen3-14b", "step_seconds": 1.0, "days": 150.0},
        faults={"rank_mtbf_hours": RANKS * M_S / 3600.0, "seed": 5},
        checkpointing={"every_steps": 100, "mode": "sync", "seconds": DELTA},
        recovery={"policies": ["checkpoint_restore"], "stage_seconds": {"checkpoint_restore": zero}},
    )
    grid = [250, 350, 450, 550, 650, 750, 900, 1100, 1400]
    frame = run_sweep(sc, {"checkpoint_every": grid}, processes=1)
    tau = frame["checkpointing.every_steps"].to_numpy(dtype=float)
    goodput = frame["goodput"].to_numpy()
    young = math.sqrt(2 * DELTA * M_S)
    daly = young * (1 + math.sqrt(DELTA / (2 * M_S)) / 3 + DELTA / (18 * M_S)) - DELTA
    # fit the first-order model goodput = a - b/τ - c·τ; its optimum is sqrt(b/c)
    a, b, c = np.linalg.lstsq(np.column_stack([np.ones_like(tau), -1 / tau, -tau]), goodput, rcond=None)[0]
    fitted = math.sqrt(b / c)
    print(f"fitted optimum {fitted:.0f} s; Young {young:.0f} s; Daly {daly:.0f} s")
    assert min(daly, young) * 0.9 <= fitted <= max(daly, young) * 1.1
    best = tau[int(np.argmax(goodput))]
    assert 0.75 * young <= best <= 1.3 * young
