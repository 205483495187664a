"""``meshpact control-plane``: the job's stores apart from its training nodes, so node 0 is lost as any node is.

Four network namespaces on one bridge (:class:`~meshpact.live.netns.Hosts`): a control host that trains
nothing runs ``meshpact control-plane`` (the c10d rendezvous store, the store the workers share, the
control channel); two training nodes run ``meshpact launch --control-plane service`` with one worker
each of the example script (one a node keeps the drill's processes, and its time, down); a fourth runs
a spare node. The node hosting group rank 0's worker is SIGKILLed whole (its agent and its worker):
the service finds it silent for ``--node-loss-s`` and hands group rank 0 to the spare node, which
promotes the warm interpreter it kept to rank 0, restored from the copy rank 1 holds in host memory on
the other node; the job ends bit-identical to plain ``torchrun`` without a fault, and the service
ends once every node said it is done.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from meshpact.live.netns import Hosts, bridge_unavailable
from _nodes import PORT, node_job, rdzv_flags
from _references import torchrun_reference
from meshpact.live.trials.launchdrill import Job, read_finals

pytestmark = [
    pytest.mark.live,
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.skipif(bridge_unavailable() is not None, reason=str(bridge_unavailable())),
]

STEPS, LOSS_S = 8, "2.5"
CONTROL, SPARE = 0, 3  # the hosts of the service and of the spare node; hosts 1 and 2 train


def node_flags(hosts: Hosts, host: int, *extra: str) -> list[str]:
    rdzv = rdzv_flags(hosts, host, "apart", endpoint=CONTROL, nproc=1, says_host=False)
    return Job.meshpact(*rdzv, "--node-loss-s", LOSS_S, "--control-plane", "service", *extra, warm_start=True)


def node_of(pid: int) -> str:
    """The node (network namespace) a process runs in: a forked worker's environment, as /proc shows
    it, is its fork server's, so the namespace says where it runs."""
    return os.readlink(f"/proc/{pid}/ns/net")


def test_the_node_of_group_rank_0_lost_whole_is_taken_by_a_spare_node_and_the_job_ends_bit_identical(tmp_path):
    out, key = tmp_path / "faulted", Job.key_env()
    service_log = tmp_path / "control-plane.log"
    with Hosts(4) as hosts, open(service_log, "w") as log:
        service = subprocess.Popen(
            [
                *hosts.prefix(CONTROL),
                sys.executable,
                "-m",
                "meshpact.cli",
                "control-plane",
                "--host",
                hosts.addr[CONTROL],
                "--port",
                str(PORT),
                "--rdzv-id",
                f"apart{hosts.tag}",
                "--node-loss-s",
                LOSS_S,
                "--linger-s",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **key},
        )
        try:
            with (
                node_job(hosts, 1, node_flags(hosts, 1), out, STEPS, key, "node-a") as node_a,
                node_job(hosts, 2, node_flags(hosts, 2), out, STEPS, key, "node-b") as node_b,
                node_job(hosts, SPARE, node_flags(hosts, SPARE, "--spare"), out, STEPS, key, "spare") as spare,
            ):
                first = {r: node_a.wait_for_step(r, 0, 150) for r in (0, 1)}
                spare.wait_for_log(f"spare node 1 at {hosts.addr[SPARE]} registered with the job", 120)
                zero = node_of(first[0].pid)
                lost_node, kept_node = (node_a, node_b) if zero == node_of(node_a.proc.pid) else (node_b, node_a)
                assert zero == node_of(lost_node.proc.pid)  # one worker a node
                assert node_of(first[1].pid) == node_of(kept_node.proc.pid) != zero
                lost = lost_node.wait_for_step(0, 2, 120)
                lost_node.kill_agent_and([lost])
                assert kept_node.wait(120) == 0, kept_node.tail()
                assert spare.wait(60) == 0, spare.tail()
                assert service.wait(30) == 0, service_log.read_text()[-3000:]
        finally:
            if service.poll() is None:
                os.killpg(service.pid, signal.SIGKILL)
                service.wait(10)
    assert not hosts.exists()
    reference, faulted = torchrun_reference(2, STEPS), read_finals(out, 2)
    assert {r: f.digest for r, f in faulted.items()} == {r: f.digest for r, f in reference.items()}
    assert faulted[1].pid == first[1].pid and faulted[1].incarnation == 0  # rank 1's process never stopped
    assert faulted[0].incarnation >= 1 and faulted[0].pid != lost.pid
    # rank 0 restored from the copy rank 1 holds in host memory on the other node: no checkpoint to read
    assert all(f.storage_bytes_read == 0 for f in faulted.values())
    assert faulted[1].recovered_by("peer_restore")
    assert any("rank 0 <- rank 1" in r["reason"] for r in faulted[1].recoveries if r["policy"] == "peer_restore")
    said = service_log.read_text()
    assert (
        "node 0 (ranks [0]) is lost: its agent has not beaten on the control channel" in said
        and f"; spare node 1 at {hosts.addr[SPARE]} takes its ranks" in said
    ), said[-3000:]
    assert "ended: every node is done; node(s) [0] ended on spare nodes" in said, said[-3000:]
    assert f"spare node 1 at {hosts.addr[SPARE]} takes node 0: ranks [0]" in spare.log.read_text()
    assert "is lost" not in kept_node.log.read_text()  # the nodes judge nothing: the service does
