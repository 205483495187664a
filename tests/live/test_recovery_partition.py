"""A real partition of the data link (network namespaces, veth), control link intact."""

from __future__ import annotations

import os
import subprocess

import pytest

from _recovery import assert_recovered, trial
from meshpact.core.recording import EventKind
from meshpact.live.recovery.faults import NetnsPair, netns_unavailable

pytestmark = [pytest.mark.live, pytest.mark.slow, pytest.mark.netns]

_WHY = netns_unavailable()


def _namespaces() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


@pytest.mark.skipif(_WHY is not None, reason=_WHY or "")
def test_data_link_down_then_up_is_recovered_in_memory_bit_identical():
    before = _namespaces()
    # without the heartbeat: found by the data-path timeout (a rank on each side of the cut)
    result = trial(
        ranks=2,
        steps=8,
        faults=1,
        fault_kind="partition",
        checkpoint_every=4,
        baselines=False,
        data_timeout_s=0.5,
        down_s=1.0,
        heartbeat=False,
    )
    assert_recovered(result, "in_memory")
    (rec,) = result.recoveries()
    assert rec["stages_s"]["detection"] >= 0.5
    # the trial's namespaces (named after this process, see live/netns.py), and their links,
    # are gone; other runs on the machine may come and go meanwhile
    ours = f"mph{os.getpid() % 100000}"
    assert not {n for n in _namespaces() - before if n.startswith(ours)}


@pytest.mark.skipif(_WHY is not None, reason=_WHY or "")
def test_with_a_long_data_path_timeout_the_heartbeat_finds_the_cut_link():
    """A 30 s data path would wait the 3 s cut out (TCP resends once the link is back) and
    never fault: only the heartbeat's quiet-data-path rule can find it, and the standby,
    whose links the cut crosses too, is not used."""
    result = trial(
        ranks=4,
        steps=8,
        faults=1,
        fault_kind="partition",
        checkpoint_every=4,
        baselines=False,
        data_timeout_s=30.0,
        down_s=3.0,
    )
    assert_recovered(result, "in_memory")
    (rec,) = result.recoveries()
    assert rec["stages_s"]["detection"] < 3.0
    events = result.events()
    detected = [e.data for e in events if e.event == EventKind.DETECTED]
    assert any(d.get("heartbeat_quiet") for d in detected), detected
    rebuilt = [e for e in events if e.event == EventKind.REBUILT and e.data.get("generation") == rec["generation"]]
    assert rebuilt and all("quiet" in str(e.data.get("standby")) for e in rebuilt), [e.data for e in rebuilt]


@pytest.mark.skipif(_WHY is not None, reason=_WHY or "")
def test_namespace_pair_is_removed_even_when_the_body_fails():
    pair = NetnsPair()
    with pytest.raises(RuntimeError):
        with pair:
            assert pair.exists()
            raise RuntimeError("boom")
    assert not pair.exists()
