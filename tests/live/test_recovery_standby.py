"""The standby in a live job: swapped in on a raised collective, discarded and rebuilt (with the
reason in the recording) when a rank was replaced; bit-identical either way."""

from __future__ import annotations

import pytest

from _recovery import assert_recovered, trial
from meshpact.core.recording import EventKind

pytestmark = [pytest.mark.live, pytest.mark.slow]


def _standby_words(result) -> dict[int, dict[int, str]]:
    """generation -> rank -> what the rank's communicator stage says of the standby."""
    out: dict[int, dict[int, str]] = {}
    for e in result.events():
        if e.event == EventKind.REBUILT and "standby" in e.data:
            out.setdefault(int(e.data["generation"]), {})[e.rank or 0] = str(e.data["standby"])
    return out


def test_raised_collectives_swap_the_standby_in_on_every_rank():
    result = trial(ranks=2, steps=6, faults=2, fault_kind="collective", checkpoint_every=3, baselines=False)
    assert_recovered(result, "in_memory")
    words = _standby_words(result)
    assert sorted(words) == [r["generation"] for r in result.recoveries()] == [1, 2]
    # the second standby was built after the first recovery, over the groups it swapped in
    assert all(w == {0: "used", 1: "used"} for w in words.values()), words
    groups = [e.data["new_groups"] for e in result.events() if e.event == EventKind.REBOUND]
    assert sorted({g for gs in groups for g in gs}) == ["meshpact_data_g1", "meshpact_data_g2"]


def test_a_killed_rank_discards_the_standby_and_the_survivors_say_why():
    result = trial(
        ranks=2, steps=6, faults=1, fault_kind="kill", checkpoint_every=3, baselines=False
    )  # shares the reference
    assert_recovered(result, "peer_restore")  # one peer copy per rank by default: no checkpoint read
    assert result.summary()["storage_bytes_read"] == 0
    killed = result.faults[0].rank
    first = min(_standby_words(result).items())  # the kill's recovery (a later one may follow under load)
    generation, words = first
    survivor = 1 - killed
    assert words[survivor] == f"built (rank {killed} has no standby (a replacement process))", words
    # the replacement built the same generation's groups when it joined: nothing it could swap in
    assert killed not in words
    assert generation == min(r["generation"] for r in result.recoveries())
