"""Ten raised collectives on four ranks: recovered in memory, bit-identical, old groups silent."""

from __future__ import annotations

import pytest

from _recovery import assert_recovered, trial
from meshpact.commands.live_recover import json_view

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_ten_raised_collectives_recover_in_memory_bit_identical_with_baselines():
    result = trial(ranks=4, steps=16, faults=10, fault_kind="collective", checkpoint_every=4)
    s = assert_recovered(result, "in_memory")
    assert s["policy_counts"]["checkpoint_restore"] == 0
    # the checkpoint-restore drill and the cold restart ran in the same job and also ended
    # bit-identical (they are part of the comparison above)
    down = s["downtime_s"]
    assert down["in_memory"] and down["checkpoint_restore"] and down["cold_restart"]
    assert all(r["reason"].startswith("all 4 ranks alive") for r in result.recoveries())
    view = json_view(s)
    assert list(view) == ["ranks", "steps", "fault_kind", "faults_injected", "faults_recovered", "bit_identical",
                          "policy_counts", "rebind_ms", "downtime_s", "recording"]
    assert set(view["downtime_s"]) == {"in_memory", "checkpoint_restore", "cold_restart"}
    assert set(view["rebind_ms"]) == {"median", "max"}
