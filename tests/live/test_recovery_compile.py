"""A torch.compile'd workload recovers bit-identically and keeps running compiled graphs.

Each fault kind that leaves every rank alive is tried: a raised collective, a rank stalled
past the data-path timeout, and a real partition of the data link. Compiled regions are
counted by the profiler in a step before the first fault and in a step after the last
recovery; both must have run compiled graphs.
"""

from __future__ import annotations

import pytest

from _recovery import assert_recovered, trial
from meshpact.live.recovery.faults import _RaiseOnCollective, netns_unavailable
from meshpact.live.trials.rankworker import compiled_regions

pytestmark = [pytest.mark.live, pytest.mark.slow]

_NO_NETNS = netns_unavailable()

# the data-path timeout bounds how long a rank may wait on a peer that is still compiling its
# first step; with the heartbeat on (the default) a stall and a partition need only outlast its
# bound (a rank compiling spends CPU time and moves: neither stalled nor quiet)
KINDS = [
    # the third operation of the step raises: a compiled block has run under the injector by then
    pytest.param("collective", {"data_timeout_s": 20.0, "nth_op": 3}, id="collective"),
    pytest.param("stall", {"data_timeout_s": 5.0, "stall_s": 1.5}, id="stall"),
    pytest.param(
        "partition",
        {"data_timeout_s": 5.0, "down_s": 2.0},
        id="partition",
        marks=[pytest.mark.netns, pytest.mark.skipif(_NO_NETNS is not None, reason=_NO_NETNS or "")],
    ),
]


@pytest.mark.parametrize("kind, timing", KINDS)
def test_compiled_blocks_run_compiled_before_and_after_an_in_memory_recovery(kind, timing):
    # operations are counted by the backends' sequence numbers, which leave dynamo alone
    result = trial(
        ranks=2, steps=6, faults=1, fault_kind=kind, checkpoint_every=3, baselines=False, workload="compiled", **timing
    )
    assert_recovered(result, "in_memory")
    for rank in result.faulted:
        assert rank.compiled_graphs >= 1
        assert rank.compiled_regions["before_first_fault"] > 0, rank.compiled_regions
        assert rank.compiled_regions["after_last_recovery"] > 0, rank.compiled_regions
        assert [r.group for r in rank.retired if r.alive] == []


def test_the_collective_injector_leaves_compilation_on_for_later_steps():
    """dynamo runs a compiled frame eagerly under a Python dispatch mode, and kept doing so
    after it: the injecting rank then trained uncompiled and parted from the reference. Which
    frames run compiled is dynamo's choice, before any backend: the eager backend shows it
    without inductor's build."""
    import torch

    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1)), backend="eager")
    x = torch.randn(4, 8)
    assert compiled_regions(lambda: model(x)) == 1
    with _RaiseOnCollective(1_000, "never raised: no collective here"):
        assert compiled_regions(lambda: model(x)) == 1
    assert compiled_regions(lambda: model(x)) == 1
