"""Sweeps on Dask distributed give the rows the local pool gives, in the same order."""

from __future__ import annotations

import pandas as pd
import pytest

from meshpact.core.errors import MeshpactError
from meshpact.simulator.sweep import check_scheduler, run_sweep


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:8786", "tcp://sched.example:1", "tcp://[::1]:8786", "local"])
def test_scheduler_addresses_that_are_accepted(address):
    assert check_scheduler(address) == address


@pytest.mark.parametrize("address", ["127.0.0.1:8786", "tcp://host", "tcp://host:0", "tcp://host:70000", "http://h:1",
                                     "Local", ""])
def test_scheduler_addresses_that_are_refused(address):
    with pytest.raises(MeshpactError, match="--scheduler .*expected local or tcp://HOST:PORT"):
        check_scheduler(address)


@pytest.mark.slow
def test_a_two_worker_local_cluster_matches_the_local_pool(make_scenario):
    sc = make_scenario(workload={"step_seconds": 2.0, "days": 1.0},
                       faults={"rank_mtbf_hours": 200.0, "rank_loss_mtbf_hours": 2000.0, "node_fraction": 0.5,
                               "spare_ranks": 8})
    params = {"seed": [1, 2, 3, 4, 5], "checkpoint_every": [100, 400]}
    seen: list[tuple[int, int]] = []
    dask = run_sweep(sc, params, scheduler="local", processes=2, progress=lambda d, t: seen.append((d, t)))
    local = run_sweep(sc, params, processes=1)
    assert seen[-1] == (10, 10) and len(seen) == 10
    assert dask["faults"].sum() > 0
    pd.testing.assert_frame_equal(dask, local, check_exact=True)
