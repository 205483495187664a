"""Fault plans and trial settings: bad input is refused with what was expected."""

from __future__ import annotations

import pytest

from meshpact.core.errors import MeshpactError
from meshpact.live.recovery.faults import CollectiveFault, FaultKind, plan_faults
from meshpact.live.recovery.runtime import is_comm_fault
from meshpact.live.recovery.trial import TrialConfig


def test_faults_land_on_distinct_steps_with_rotating_ranks():
    faults = plan_faults("collective", steps=40, count=10, world_size=4)
    assert len({f.step for f in faults}) == 10 and all(1 <= f.step < 40 for f in faults)
    assert [f.rank for f in faults[:5]] == [0, 1, 2, 3, 0]
    assert all(f.kind is FaultKind.COLLECTIVE for f in faults)


def test_too_many_faults_for_the_steps_is_refused():
    with pytest.raises(MeshpactError, match="cannot place 12 fault"):
        plan_faults("stall", steps=10, count=12, world_size=2)


@pytest.mark.parametrize("kw, message", [
    ({"ranks": 1}, "--ranks must be at least 2"),
    ({"checkpoint_every": 0}, "--checkpoint-every must be between 1"),
    ({"fault_kind": "stall", "stall_s": 0.5, "data_timeout_s": 1.0}, "must outlast the data-path timeout"),
    ({"fault_kind": "partition", "down_s": 0.5, "data_timeout_s": 1.0}, "must outlast the data-path timeout"),
])
def test_trial_settings_are_checked(kw, message):
    with pytest.raises(MeshpactError, match=message):
        TrialConfig(**kw)


def test_unknown_fault_kind_is_refused():
    with pytest.raises(ValueError):
        TrialConfig(fault_kind="meteor")


def test_data_path_failures_are_told_apart_from_bugs_in_the_step():
    assert is_comm_fault(CollectiveFault("x"))
    assert is_comm_fault(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    assert not is_comm_fault(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_comm_fault(ValueError("timed out"))
