"""The peer-copy cost model: a host copy on the training thread, a ship hidden only as far as spare cores allow."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshpact.core.recovery_costs import RecoveryCosts, peer_copy_cost, peer_copy_seconds_per_step

# round rates so every expectation below is arithmetic a reader can check
COSTS = RecoveryCosts(
    host_copy_bytes_per_s=1e9,
    peer_bytes_per_s=1e8,
    peer_cpu_bytes_per_s=1e8,
    peer_receive_bytes_per_s=2e8,
    cores_per_rank=4.0,
    step_cores_per_rank=1.0,
)


def test_zero_bytes_cost_nothing_whatever_the_cores():
    for cores in (0.25, 1.0, 64.0):
        costs = RecoveryCosts(cores_per_rank=cores, step_cores_per_rank=8.0)
        c = peer_copy_cost(0, 0.3, costs)
        assert c.per_step_s == 0.0 and c.training_thread_s == 0.0 and c.cycle_s == pytest.approx(0.3)


def test_the_host_copy_is_never_hidden_even_with_cores_to_spare():
    c = peer_copy_cost(10e6, 1.0, COSTS)  # host copy 10 ms, ship 100 ms: well inside a 1 s step
    assert c.host_copy_s == pytest.approx(0.01) and c.ship_s == pytest.approx(0.1)
    assert c.per_step_s == pytest.approx(0.01) and not c.cpu_bound
    assert c.training_thread_s == pytest.approx(0.01)


def test_a_step_shorter_than_the_ship_waits_for_the_copy_in_flight():
    c = peer_copy_cost(10e6, 0.04, COSTS)  # ship 100 ms against a 40 ms step
    assert c.per_step_s == pytest.approx(0.01 + 0.06)
    assert c.training_thread_s == pytest.approx(c.per_step_s)  # all of it on the training thread


def test_more_copies_ship_more_bytes():
    one = peer_copy_cost(10e6, 0.04, COSTS, copies=1)
    three = peer_copy_cost(10e6, 0.04, COSTS, copies=3)
    assert three.ship_s == pytest.approx(3 * one.ship_s) and three.host_copy_s == one.host_copy_s
    assert three.per_step_s == pytest.approx(0.01 + 0.3 - 0.04)


def test_ranks_sharing_cores_pay_for_every_second_of_the_ship():
    """Four ranks on two cores, each step keeping its half core busy: nothing hides, and each
    second of copy work costs two of the step."""
    shared = replace(COSTS, cores_per_rank=0.5, step_cores_per_rank=1.0)
    c = peer_copy_cost(2e6, 0.2, shared)  # host copy 2 ms, ship 20 ms, receive 10 ms
    assert c.cpu_bound
    assert c.per_step_s == pytest.approx((0.002 + 0.02 + 0.01) / 0.5)
    # a step keeping only part of its share busy hides what fits in the idle part
    idle = replace(shared, step_cores_per_rank=0.4)
    assert peer_copy_cost(2e6, 0.2, idle).per_step_s == pytest.approx((0.4 * 0.2 + 0.032) / 0.5 - 0.2)


def test_more_cores_than_ranks_hide_the_ship_and_adding_cores_never_costs_more():
    stretch = [
        peer_copy_seconds_per_step(50e6, 0.3, replace(COSTS, cores_per_rank=cores))
        for cores in (0.25, 0.5, 1.0, 2.0, 16.0)
    ]
    assert stretch == sorted(stretch, reverse=True)
    assert stretch[-1] == pytest.approx(0.05 + (0.5 - 0.3))  # host copy, and only the ship beyond the step


def test_a_huge_state_is_dominated_by_the_ship_and_grows_linearly():
    small = peer_copy_seconds_per_step(1e12, 0.5, COSTS)
    big = peer_copy_seconds_per_step(2e12, 0.5, COSTS)
    assert small == pytest.approx(1e12 / 1e9 + 1e12 / 1e8 - 0.5)
    assert big - small == pytest.approx(1e12 / 1e9 + 1e12 / 1e8)


def test_an_unknown_step_costs_the_whole_copy():
    assert peer_copy_seconds_per_step(10e6, 0.0, COSTS) == pytest.approx(0.01 + 0.1)


@pytest.mark.parametrize(
    "field,value",
    [
        ("host_copy_bytes_per_s", 0.0),
        ("cores_per_rank", 0.0),
        ("step_cores_per_rank", -1.0),
        ("peer_bytes_per_s", float("inf")),
        ("peer_receive_bytes_per_s", 0.0),
        ("peer_cpu_bytes_per_s", -5.0),
    ],
)
def test_impossible_rates_are_refused_by_name(field, value):
    with pytest.raises(ValueError, match=field):
        RecoveryCosts(**{field: value})
