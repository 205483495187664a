"""``meshpact launch --spare``: a spare node takes the ranks of a node the job lost.

Three network namespaces on one bridge (:class:`~meshpact.live.netns.Hosts`): node 0 hosts
elastic's c10d rendezvous, nodes 0 and 1 run two workers each of the example script, and a third
node runs a spare agent that joins no rendezvous round. Node 1's agent and both its workers are
SIGKILLed together: node 0's agent finds the node silent for ``--node-loss-s``, hands its group
rank to the spare node, whose agent promotes the two warm interpreters it kept while standing by
to ranks 2 and 3 (incarnation 1), restored from the copies node 0's ranks hold in host memory;
the job ends bit-identical to plain ``torchrun`` on one node without a fault.
"""

from __future__ import annotations

import re

import pytest

from meshpact.live.netns import Hosts, bridge_unavailable
from _nodes import node_job, rdzv_flags
from _references import torchrun_reference
from meshpact.live.trials.launchdrill import Job, read_finals

pytestmark = [
    pytest.mark.live,
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(bridge_unavailable() is not None, reason=str(bridge_unavailable())),
]

STEPS, SPARE = 10, 2  # SPARE: the spare node's host


def node_flags(hosts: Hosts, host: int, *extra: str) -> list[str]:
    return Job.meshpact(*rdzv_flags(hosts, host, "spare"), "--node-loss-s", "3", *extra, warm_start=True)


def test_node_1_lost_with_its_agent_is_taken_by_the_spare_node_and_the_job_ends_bit_identical(tmp_path):
    out, key = tmp_path / "faulted", Job.key_env()
    with (
        Hosts(3) as hosts,
        node_job(hosts, 0, node_flags(hosts, 0), out, STEPS, key, "node0") as node0,
        node_job(hosts, 1, node_flags(hosts, 1), out, STEPS, key, "node1") as node1,
        node_job(hosts, SPARE, node_flags(hosts, SPARE, "--spare"), out, STEPS, key, "spare") as spare,
    ):
        survivors = {r: node0.wait_for_step(r, 0, 150) for r in (0, 1)}
        node0.wait_for_log(f"spare node 1 at {hosts.addr[SPARE]} registered", 120)
        lost = [node1.wait_for_step(r, 3, 120) for r in (2, 3)]
        node1.kill_agent_and(lost)
        assert node0.wait(180) == 0, node0.tail()
        assert spare.wait(60) == 0, spare.tail()
    assert not hosts.exists()
    reference, faulted = torchrun_reference(4, STEPS), read_finals(out, 4)
    assert {r: f.digest for r, f in faulted.items()} == {r: f.digest for r, f in reference.items()}
    assert all(faulted[r].pid == p.pid and faulted[r].incarnation == 0 for r, p in survivors.items())
    spare_log = spare.log.read_text()
    started = (
        f"spare node 1 at {hosts.addr[SPARE]} started rank(s) [2, 3] as pid(s) "
        f"{[faulted[2].pid, faulted[3].pid]} (2 of them warm interpreter(s))"
    )  # made while it stood by
    assert started in spare_log, spare_log[-3000:]
    assert all(faulted[p.rank].incarnation >= 1 and faulted[p.rank].pid != p.pid for p in lost)
    # ranks 2 and 3 restored from the copies node 0's ranks hold in host memory: no checkpoint to read
    assert all(f.storage_bytes_read == 0 for f in faulted.values())
    kept = [faulted[r] for r in survivors]
    assert all(f.recovered_by("peer_restore") for f in kept), [f.recoveries for f in kept]
    holders = [dict(re.findall(r"rank (\d+) <- rank (\d+)", f.recoveries[0]["reason"])) for f in kept]
    assert all(h.keys() == {"2", "3"} and set(h.values()) <= {"0", "1"} for h in holders), holders  # on node 0
    log = node0.log.read_text()
    assert (
        "node 1 (ranks [2, 3]) is lost: its agent has not beaten on the control channel" in log
        and f"; spare node 1 at {hosts.addr[SPARE]} takes its ranks" in log
    ), log[-3000:]
    assert "the job is told its ranks are gone" not in log
    assert "waiting for the spare node(s) acting as node(s) [1] to finish" in log
