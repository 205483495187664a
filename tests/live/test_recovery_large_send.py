"""A peer part way through a large send when a rank's recovery severs its data path finishes or
fails it at once, not at the data-path timeout (30 s here, so a pass cannot come from waiting it
out; 128 MB here). gloo never fails a send it queued on a pair that then fails (``communicator.sever``): the
severing rank shuts down only its reading and drains what the peer still sends."""

from __future__ import annotations

import pytest

from _warm import shared_forkserver
from meshpact.live.launch.launcher import launch

pytestmark = [pytest.mark.live, pytest.mark.slow]

TIMEOUT_S = 30.0
BOUND_S = TIMEOUT_S * 2 / 3  # the send takes well under a second on an idle machine; the timeout is 30 s


def test_a_send_in_flight_to_a_rank_that_starts_a_recovery_ends_long_before_the_data_path_timeout():
    results = sorted(
        (
            r.value
            for r in launch(
                "meshpact.live.trials.probe:large_send_probe",
                2,
                {"data_timeout_s": TIMEOUT_S, "send_mb": 128, "raise_after_s": 0.02},
                timeout_s=150,
                forkserver=shared_forkserver(),
            )
        ),
        key=lambda v: v["rank"],
    )
    assert [v["steps"] for v in results] == [3, 3]  # both ranks finished the job
    for v in results:
        assert [r["policy"] for r in v["recoveries"]] == ["in_memory"], v
        assert v["knew_after_s"][0] < BOUND_S, v
        assert "Timed out" not in v["errors"][0], v
    assert len(results[1]["send_s"]) == 1 and results[1]["send_s"][0] < BOUND_S, results[1]
