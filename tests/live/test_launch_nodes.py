"""``meshpact launch`` on two nodes (network namespaces joined by veth), one agent each.

Node 0 hosts elastic's c10d rendezvous; each node runs two workers of the example script. Node
1's link is cut for 3 s (every connection to it: data, stores, control channel) and the job
recovers in memory; then rank 3, on node 1, is SIGKILLed: node 1's agent replaces it alone (a
warm spare), its state comes from the copy node 0's rank 0 holds in host memory (no checkpoint
exists to read), and the job ends bit-identical to plain ``torchrun`` on one node without a fault.
One job takes both faults: each is checked by what it leaves in the ranks' records. Node 1's
agent and both its workers SIGKILLed together: node 0's agent announces the node lost, the
survivors excise its ranks and end bit-identical to the excising reference
(:mod:`meshpact.live.trials.launchref`).
"""

from __future__ import annotations

import subprocess
import time

import pytest

from meshpact.live.netns import TwoHosts, netns_unavailable
from _nodes import node_job, rdzv_flags
from _references import torchrun_reference
from meshpact.live.trials.launchdrill import Job, excised_at, excising_reference, read_finals

pytestmark = [
    pytest.mark.live,
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(netns_unavailable(shaped=False) is not None, reason=str(netns_unavailable(shaped=False))),
]

STEPS, CUT_S = 10, 3.0
# node 1's agent is silent for the cut and then until TCP retransmits its beat: Linux doubles the
# retransmission timeout from 0.2 s, so a segment lost at the cut is sent again 0.2, 0.6, 1.4, 3.0
# and 6.2 s after it. A cut of 3 s can hold the beats back 6.2 s: past the default 5 s bound
CUT_NODE_LOSS_S = "10"


def node_flags(hosts: TwoHosts, node: int, *extra: str) -> list[str]:
    return Job.meshpact(*rdzv_flags(hosts, node, "drill"), *extra, warm_start=True)


def cut_link(hosts: TwoHosts, node: int, seconds: float) -> None:
    """Node ``node``'s end of the link down for ``seconds``, then up again."""
    link = ["ip", "-n", hosts.ns[node], "link", "set", "dev", hosts.iface[node]]
    subprocess.run([*link, "down"], check=True)
    try:
        time.sleep(seconds)
    finally:
        subprocess.run([*link, "up"], check=True)


def test_node_1s_link_cut_and_then_a_worker_killed_there_are_both_recovered_in_memory(tmp_path):
    out, key = tmp_path / "faulted", Job.key_env()
    restarts = ("--max-restarts", "1", "--node-loss-s", CUT_NODE_LOSS_S)
    with (
        TwoHosts(link=None) as hosts,
        node_job(hosts, 0, node_flags(hosts, 0, *restarts), out, STEPS, key, "node0") as node0,
        node_job(
            hosts, 1, node_flags(hosts, 1, *restarts, "--spare-ranks-per-node", "1"), out, STEPS, key, "node1"
        ) as node1,
    ):
        others = {r: node1.wait_for_step(r, 0, 150) for r in (0, 1, 2)}
        node1.wait_for_step(3, 1, 120)
        cut_link(hosts, 1, CUT_S)
        killed = node1.kill_rank(3, after_step=5)
        assert node1.wait(180) == 0, node1.tail()
        assert node0.wait(60) == 0, node0.tail()
    reference, faulted = torchrun_reference(4, STEPS), read_finals(out, 4)
    assert {r: f.digest for r, f in faulted.items()} == {r: f.digest for r, f in reference.items()}
    assert all(faulted[r].pid == p.pid and faulted[r].incarnation == 0 for r, p in others.items())
    assert faulted[3].incarnation == 1 and faulted[3].pid != killed.pid
    # the cut: recovered in memory by the same processes, no node declared lost; the kill: restored
    # from a peer's host memory (the job keeps no checkpoint: nothing in storage to read)
    survivors = [faulted[r] for r in (0, 1, 2)]
    assert all(f.recovered_by("in_memory", "peer_restore") for f in survivors), [f.recoveries for f in survivors]
    assert all("rank 3 <- rank 0" in f.recoveries[-1]["reason"] for f in survivors)  # node 0's copy
    assert all(f.storage_bytes_read == 0 for f in faulted.values())
    assert "is lost" not in node0.log.read_text()
    log = node1.log.read_text()
    assert f"rank 3 (pid {killed.pid}) exited with -9" in log and "a warm spare" in log
    assert "exited with" not in node0.log.read_text()


def test_node_1_lost_with_its_agent_is_excised_by_the_survivors_bit_identical_to_its_excising_reference(tmp_path):
    out, key = tmp_path / "faulted", Job.key_env()
    with (
        TwoHosts(link=None) as hosts,
        node_job(
            hosts,
            0,
            node_flags(hosts, 0, "--node-loss-s", "3"),
            out,
            STEPS,
            key,
            "node0",
            script_args=("--excise-to", "2"),
        ) as node0,
        node_job(
            hosts,
            1,
            node_flags(hosts, 1, "--node-loss-s", "3"),
            out,
            STEPS,
            key,
            "node1",
            script_args=("--excise-to", "2"),
        ) as node1,
    ):
        survivors = {r: node0.wait_for_step(r, 0, 150) for r in (0, 1)}
        lost = [node1.wait_for_step(r, 3, 120) for r in (2, 3)]
        node1.kill_agent_and(lost)
        assert node0.wait(120) == 0, node0.tail()
    finals = read_finals(out, 4)
    assert sorted(finals) == [0, 1]  # ranks 2 and 3 went with their node
    assert all(finals[r].pid == p.pid and finals[r].incarnation == 0 for r, p in survivors.items())
    assert all(f.policies == ("excise",) for f in finals.values()), [f.recoveries for f in finals.values()]
    # bit for bit the job in which ranks 2 and 3 left at that step without a fault (plain torchrun)
    step = excised_at(finals[0])
    assert step is not None and excised_at(finals[1]) == step
    reference = excising_reference(tmp_path / "reference", STEPS, step, 4, 2)
    assert {r: f.digest for r, f in finals.items()} == {r: f.digest for r, f in reference.items()}
    log = node0.log.read_text()
    assert "node 1 (ranks [2, 3]) is lost" in log and "not waiting for the agents of lost node(s) [1]" in log


def test_node_0_lost_with_its_agent_ends_node_1_with_one_line_naming_it(tmp_path):
    """Node 0's agent hosts the job's stores, which no other node takes over: node 1 must not hang nor die
    with its agent's traceback, but stop its workers and say what was lost and what to do."""
    out, key = tmp_path / "faulted", Job.key_env()
    with (
        TwoHosts(link=None) as hosts,
        node_job(hosts, 0, node_flags(hosts, 0, "--node-loss-s", "3"), out, STEPS, key, "node0") as node0,
        node_job(hosts, 1, node_flags(hosts, 1, "--node-loss-s", "3"), out, STEPS, key, "node1") as node1,
    ):
        lost = [node0.wait_for_step(r, 3, 150) for r in (0, 1)]
        node0.kill_agent_and(lost)
        assert node1.wait(90) == 1, node1.tail()
    log = node1.log.read_text()
    # one line, whichever came first: the agent's refusal while its workers still ran (past --node-loss-s),
    # or its note beside elastic's record of workers that had all failed on the channel already
    said = [line for line in log.splitlines() if "the control channel node 0's agent hosts at" in line]
    assert len(said) == 1, node1.tail()
    assert "no other node can take" in said[0], said
    assert "meshpact/launch.py" not in log  # no traceback from the agent itself
    assert not (out / "rank2.json").exists() and not (out / "rank3.json").exists()  # nothing claims to have finished


def test_plain_torchrun_on_two_nodes_restarts_the_job_from_its_checkpoint_bit_identical(tmp_path):
    """What plain torchrun gives (the docs' table): a killed worker ends the attempt on every node, the
    agents restart every worker (--max-restarts 1), each loads the newest checkpoint itself and the job
    ends bit for bit as the run without a fault; every process is a new one."""
    out, key = tmp_path / "faulted", Job.key_env()
    ckpt = ("--checkpoint-dir", str(tmp_path / "checkpoints"), "--checkpoint-every", "3")

    def node(hosts: TwoHosts, n: int) -> Job:
        flags = [*rdzv_flags(hosts, n, "plain"), "--max-restarts", "1"]
        env = {
            "GLOO_SOCKET_IFNAME": hosts.iface[n],
            "MESHPACT_PEER_ADDR": hosts.addr[n],
            "MESHPACT_HOST_ID": f"node{n}",
            **key,
        }
        return node_job(hosts, n, Job.torchrun(*flags), out, STEPS, env, f"node{n}", script_args=ckpt)

    with TwoHosts(link=None) as hosts, node(hosts, 0) as node0, node(hosts, 1) as node1:
        first = {r: (node0 if r < 2 else node1).wait_for_step(r, 0, 150) for r in range(4)}
        node1.kill_rank(3, after_step=5)
        assert node0.wait(240) == 0, node0.tail()
        assert node1.wait(240) == 0, node1.tail()
    reference, faulted = torchrun_reference(4, STEPS), read_finals(out, 4)
    assert {r: f.digest for r, f in faulted.items()} == {r: f.digest for r, f in reference.items()}
    assert all(faulted[r].pid != p.pid for r, p in first.items())  # torchrun restarted every worker
    assert sum(f.storage_bytes_read for f in faulted.values()) > 0  # from the checkpoint, not a peer
    assert all(f.recovered_by() for f in faulted.values()), [f.recoveries for f in faulted.values()]
