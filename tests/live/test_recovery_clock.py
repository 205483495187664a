"""The recovery clock: from the first rank knowing to the last rank through the first collective."""

from __future__ import annotations

import pytest

from meshpact.live.trials.analysis import recovery_span


def _rec(detect: float, first: float, resumed: float) -> dict:
    return {"t_detect_wall": detect, "t_first_collective_wall": first, "t_resumed_wall": resumed}


def test_the_span_runs_from_the_earliest_detection_to_the_latest_completed_first_collective():
    # rank 2 knew first (it raised); rank 0 was the last through the first collective
    recs = [_rec(100.050, 100.080, 100.095), _rec(100.030, 100.079, 100.090), _rec(100.010, 100.081, 100.091)]
    start, end = recovery_span(recs)
    assert start == 100.010 and end == 100.095
    assert all(start <= r["t_first_collective_wall"] <= r["t_resumed_wall"] <= end for r in recs)


def test_a_detection_skew_between_ranks_is_counted_in_the_recovery():
    recs = [_rec(10.0, 10.5, 10.6), _rec(10.4, 10.5, 10.6)]
    start, end = recovery_span(recs)
    assert end - start == pytest.approx(0.6)  # not 0.2: the slower rank's late knowing is recovery time


def test_no_records_is_refused():
    with pytest.raises(ValueError, match="at least one"):
        recovery_span([])
