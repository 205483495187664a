"""The peer-copy model calibrated from a run's copy rates, and judged against a run without copies."""

from __future__ import annotations

import pytest

from meshpact.core.errors import RecordingError
from meshpact.simulator.calibrate import peer_copy_calibration

# 4 ranks, 2 MB shipped per rank and commit to one holder; CPU seconds of each part of the copy
SUMMARY = {
    "copies": 1,
    "network_bytes_per_step": 4 * 2_000_000,
    "ship_ms_mean": 64.0,
    "snapshot_ms_per_commit": 3.0,
    "step_ms_with": 160.0,
    "step_ms_without": 150.0,
    "host_copy_ms_per_commit": 2.0,
    "ship_cpu_ms_per_commit": 20.0,
    "receive_cpu_ms_per_commit": 10.0,
    "step_cpu_ms": 50.0,
    "cores_per_rank": 0.5,
}


def test_rates_come_from_the_cpu_seconds_of_each_part_never_from_the_step_latency():
    cal = peer_copy_calibration(SUMMARY, 4)
    assert cal.costs.host_copy_bytes_per_s == pytest.approx(2e6 / 0.002)
    assert cal.costs.peer_bytes_per_s == pytest.approx(2e6 / 0.064)  # the ship lasts 64 ms
    assert cal.costs.peer_cpu_bytes_per_s == pytest.approx(2e6 / 0.020)  # and keeps a core busy for 20
    assert cal.costs.peer_receive_bytes_per_s == pytest.approx(2e6 / 0.010)
    assert cal.costs.cores_per_rank == 0.5
    # the step latencies play no part: changing them leaves every rate alone
    other = peer_copy_calibration({**SUMMARY, "step_ms_with": 400.0, "step_ms_without": 90.0}, 4)
    assert other.costs == cal.costs


def test_judged_against_a_run_without_copies_on_shared_cores():
    """Half a core per rank, the step keeping 50 ms of 120 ms busy: the cores bound is
    (50 + 2 + 20 + 10) / 0.5 = 164 ms, beyond the training thread's 2 + 120."""
    cal = peer_copy_calibration(SUMMARY, 4)
    j = cal.judge(0.120, 0.150)
    assert cal.cost(0.120).cpu_bound
    assert j.predicted_s_per_step == pytest.approx(0.164 - 0.120)
    assert j.measured_s_per_step == pytest.approx(0.030)
    assert j.error == pytest.approx(0.044 / 0.030 - 1.0)
    assert cal.judge(0.1, 0.1).error is None  # nothing measured: no error, not a division by zero


def test_the_training_thread_prediction_adds_the_wait_when_the_step_is_shorter_than_the_ship():
    long_ship = {**SUMMARY, "ship_ms_mean": 200.0, "cores_per_rank": 8.0}
    cal = peer_copy_calibration(long_ship, 4)
    compute = cal.measured.compute_s  # 160 - 3 ms
    assert cal.predicted_thread_s == pytest.approx(0.002 + (0.2 - compute))
    assert cal.to_dict()["s_per_step"]["predicted"] == pytest.approx(cal.predicted_thread_s)


def test_a_summary_from_before_the_parts_were_measured_uses_the_whole_thread_time_and_the_ship_seconds():
    old = {
        k: v
        for k, v in SUMMARY.items()
        if k
        not in (
            "host_copy_ms_per_commit",
            "ship_cpu_ms_per_commit",
            "receive_cpu_ms_per_commit",
            "step_cpu_ms",
            "cores_per_rank",
        )
    }
    cal = peer_copy_calibration(old, 4)
    assert cal.costs.host_copy_bytes_per_s == pytest.approx(2e6 / 0.003)
    assert cal.costs.peer_bytes_per_s == cal.costs.peer_cpu_bytes_per_s == pytest.approx(2e6 / 0.064)
    assert cal.costs.cores_per_rank == 12.0  # the cost model's default


@pytest.mark.parametrize(
    "field",
    ["host_copy_ms_per_commit", "ship_cpu_ms_per_commit", "receive_cpu_ms_per_commit", "step_cpu_ms", "cores_per_rank"],
)
def test_a_malformed_part_is_refused_by_name(field):
    with pytest.raises(RecordingError, match=f"peer_copy_overhead.{field} must be a number"):
        peer_copy_calibration({**SUMMARY, field: "fast"}, 4)
