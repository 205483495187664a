"""A rank blocked on a pair nobody severs learns of a recovery from the control channel, not
from the data-path timeout (30 s here, so a pass cannot come from waiting it out)."""

from __future__ import annotations

import pytest

from _warm import shared_forkserver
from meshpact.live.launch.launcher import launch

pytestmark = [pytest.mark.live, pytest.mark.slow]

TIMEOUT_S = 30.0


def test_ranks_blocked_on_each_other_leave_the_failed_step_long_before_the_data_path_timeout():
    results = sorted(
        (
            r.value
            for r in launch(
                "meshpact.live.trials.probe:stuck_send_probe",
                3,
                {"data_timeout_s": TIMEOUT_S},
                timeout_s=120,
                forkserver=shared_forkserver(),
            )
        ),
        key=lambda v: v["rank"],
    )
    assert [v["steps"] for v in results] == [3, 3, 3]  # every rank finished the job
    for v in results:
        assert len(v["recoveries"]) == 1, v
        assert v["recoveries"][0]["policy"] == "in_memory", v
        # ranks 1 and 2 were severed by their heartbeat: the wait was seconds at most, not the timeout
        assert v["knew_after_s"][0] < TIMEOUT_S / 3, v
        assert "Timed out" not in v["errors"][0], v
