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


def _trial(knew: list[float], resumed: list[float], injected: float, policy: str = "in_memory"):
    """A trial's result holding one recovery out of generation 0 at step 3, from every rank's events."""
    from meshpact.core.recording import Event, EventKind
    from meshpact.live.recovery.faults import Fault, FaultKind
    from meshpact.live.trials.analysis import TrialResult
    from meshpact.live.trials.outcome import FaultRecord
    from meshpact.live.trials.trialconfig import TrialConfig

    events = []
    for rank, (k, r) in enumerate(zip(knew, resumed)):
        events.append(Event(k + 0.001, EventKind.DECIDED, rank, data={"round": 0}))
        events.append(
            Event(
                r,
                EventKind.RECOVERY_DONE,
                rank,
                data={
                    "generation": 0,
                    "step": 3,
                    "t_detect_wall": k,
                    "t_first_collective_wall": r - 0.002,
                    "t_resumed_wall": r,
                    "policy": policy,
                    "reason": "test",
                    "rebind_s": 0.0,
                    "lost_steps": 0,
                },
            )
        )
    fault = Fault(0, FaultKind.COLLECTIVE, 3, 0)
    return TrialResult(
        TrialConfig(ranks=len(knew), steps=8, faults=1, checkpoint_every=4),
        (fault,),
        [],
        [],
        None,
        {0: FaultRecord(0, 3, "collective", injected)},
        True,
        [],
        0,
        "",
        faulted_events=events,
    )


def test_downtime_as_users_see_it_runs_from_the_fault_to_the_last_rank_running_and_counts_detection():
    result = _trial(knew=[100.010, 100.090, 100.030], resumed=[100.400, 100.450, 100.420], injected=100.000)
    (rec,) = result.recoveries()
    assert rec["knew_spread_s"] == pytest.approx(0.080)  # the first rank knowing -> the last
    assert result.fault_to_running_ms() == [pytest.approx(450.0)]  # not from the first knowing: detection counts
    assert result.fault_to_running_ms("in_memory") == result.fault_to_running_ms()
    assert result.fault_to_running_ms("peer_restore") == []


def test_a_rank_told_by_a_peer_heard_when_its_listener_did_not_when_its_busy_step_raised():
    """At gpt100m on a loaded machine a told rank's data path was cut within 25 ms of the first
    rank knowing while its training thread raised up to half a second later: both are said."""
    from meshpact.core.recording import Event, EventKind
    from meshpact.live.trials.analysis import heard_spread_ms

    def detected(rank: int, t: float, **data) -> Event:
        return Event(t, EventKind.DETECTED, rank, data={"generation": 2, "step": 5, "seconds": 0.001, **data})

    events = [
        detected(0, 10.001),  # its own collective raised: it knew at 10.000
        detected(
            1, 10.501, heartbeat_alarm=True, heartbeat_alarm_to_severed_ms=2.0, heartbeat_severed_to_raised_ms=480.0
        ),  # heard at 10.019, raised at 10.500
        detected(
            2, 10.031, heartbeat_alarm=True, heartbeat_alarm_to_severed_ms=5.0, heartbeat_severed_to_raised_ms=1.0
        ),  # heard at 10.025
        Event(10.2, EventKind.DECIDED, 0, data={"round": 3}),
    ]
    assert heard_spread_ms(events) == [pytest.approx(25.0)]
    # a recovery only one rank saw (the others gone) has no spread
    assert heard_spread_ms([detected(0, 11.0)]) == []
