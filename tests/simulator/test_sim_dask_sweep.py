"""Sweeps on Dask distributed give the rows the local pool gives, in the same order."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
import yaml

from meshpact.core.errors import MeshpactError
from meshpact.simulator.sweep import check_scheduler


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:8786", "tcp://sched.example:1", "tcp://[::1]:8786", "local"])
def test_scheduler_addresses_that_are_accepted(address):
    assert check_scheduler(address) == address


@pytest.mark.parametrize(
    "address", ["127.0.0.1:8786", "tcp://host", "tcp://host:0", "tcp://host:70000", "http://h:1", "Local", ""]
)
def test_scheduler_addresses_that_are_refused(address):
    with pytest.raises(MeshpactError, match="--scheduler .*expected local or tcp://HOST:PORT"):
        check_scheduler(address)


@pytest.mark.slow
def test_a_two_worker_local_cluster_matches_the_local_pool(tmp_path):
    # through the CLI, as a person runs it: Dask's worker processes start from a guarded main
    f = tmp_path / "sc.yaml"
    f.write_text(
        yaml.safe_dump(
            {
                "name": "dask",
                "cluster": {"domains": [{"name": "a", "vendor": "cuda", "host": "h", "ranks": 32}]},
                "workload": {"step_seconds": 2.0, "days": 1.0},
                "faults": {
                    "rank_mtbf_hours": 200.0,
                    "rank_loss_mtbf_hours": 2000.0,
                    "node_fraction": 0.5,
                    "spare_ranks": 8,
                },
            }
        )
    )
    grid = ["--param", "seed=1,2,3,4,5", "--param", "checkpoint_every=100,400"]
    runs = {}
    for name, engine in (("dask", ["--scheduler", "local", "--processes", "2"]), ("pool", ["--processes", "1"])):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "meshpact.cli",
                "simulate",
                "sweep",
                "--scenario",
                str(f),
                *grid,
                *engine,
                "--out",
                str(tmp_path / f"{name}.csv"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        assert "10/10" in out.stderr  # the same progress bar
        runs[name] = pd.read_csv(tmp_path / f"{name}.csv")
    assert len(runs["dask"]) == 10 * 5 and runs["dask"]["faults"].sum() > 0
    pd.testing.assert_frame_equal(runs["dask"], runs["pool"], check_exact=True)
    assert (tmp_path / "dask.csv").read_bytes() == (tmp_path / "pool.csv").read_bytes()
