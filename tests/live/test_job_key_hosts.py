"""Whether a job spans hosts decides whether a per-host key may be made for it: a launcher that
says nothing of the ranks per host (srun alone) is not taken for one host unless it meets on loopback."""

from __future__ import annotations

import pytest

from meshpact.live.recovery.jobkey import JobKeyError
from meshpact.live.recovery.session import job_key_of


@pytest.mark.parametrize(
    "env",
    [
        {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500"},  # srun: no LOCAL_WORLD_SIZE, a node's address
        {"MASTER_ADDR": "node07", "MASTER_PORT": "29500"},
        {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": "2"},  # torchrun, two nodes
    ],
)
def test_a_job_that_may_span_hosts_without_a_key_is_refused_in_one_line(env, tmp_path):
    with pytest.raises(JobKeyError, match="spans hosts and has no job key") as err:
        job_key_of({**env, "XDG_RUNTIME_DIR": str(tmp_path)}, "run", 4)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("addr", ["127.0.0.1", "localhost", "::1", "[::1]"])
def test_a_job_meeting_on_loopback_gets_one_key_per_host(addr, tmp_path):
    env = {"MASTER_ADDR": addr, "MASTER_PORT": "29500", "XDG_RUNTIME_DIR": str(tmp_path)}
    first, again = job_key_of(env, "run", 4), job_key_of(env, "run", 4)
    assert first is not None and first == again  # every rank of the job on this host finds the same key
