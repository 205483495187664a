"""``meshpact launch`` on one node: a killed worker is replaced alone and the job ends bit-identical.

The example script (``examples/resilient_train.py``, the README's ``resilient()`` loop) runs
twice side by side: under plain ``torchrun`` without a fault (the reference, and proof that
the script runs under torchrun unchanged) and under ``meshpact launch`` with rank 2 SIGKILLed
after its third step; while it runs, no process of the job listens on every interface
(``/proc/net/tcp{,6}``). Then two nodes as a Slurm script starts them (the static backend on node 0's
address): a worker killed on node 1 is replaced there from node 0's copy.
"""

from __future__ import annotations

import pytest

from _sockets import listeners
from meshpact.live.trials.launchdrill import Job, read_finals

pytestmark = [pytest.mark.live, pytest.mark.slow]

RANKS, STEPS = 4, 10


def test_a_killed_worker_is_replaced_alone_and_the_job_ends_bit_identical_to_one_without_a_fault(tmp_path):
    with Job(Job.torchrun("--standalone", "--nproc-per-node", str(RANKS)), tmp_path / "reference", STEPS) as ref, \
            Job(Job.meshpact("--standalone", "--nproc-per-node", str(RANKS), "--max-restarts", "1"),
                tmp_path / "faulted", STEPS, step_s=0.05) as job:
        others = {r: job.wait_for_step(r, 0, 120) for r in range(RANKS) if r != 2}
        # no process of the job listens on every interface: the rendezvous stores, the control channel,
        # the peer servers and the data path are all on loopback
        listening = listeners(job.proc.pid)
        assert len(listening) >= 3 + 2 * RANKS, listening  # two stores, the channel; each rank's peer server and gloo
        assert not [ln for ln in listening if ln.wildcard], listening
        killed = job.kill_rank(2, after_step=3)
        assert job.wait(180) == 0, job.tail()
        assert ref.wait(180) == 0, ref.tail()
    reference, faulted = read_finals(ref.out, RANKS), read_finals(job.out, RANKS)
    assert sorted(reference) == sorted(faulted) == list(range(RANKS))
    assert {r: f.digest for r, f in faulted.items()} == {r: f.digest for r, f in reference.items()}
    # the three others were never restarted: the same processes from their first step to the end
    assert all(faulted[r].pid == p.pid and faulted[r].incarnation == 0 for r, p in others.items())
    assert faulted[2].incarnation == 1 and faulted[2].pid != killed.pid
    assert f"rank 2 (pid {killed.pid}) exited with -9" in job.log.read_text()


def test_two_nodes_in_a_static_rendezvous_replace_a_worker_alone_from_the_other_nodes_copy(tmp_path):
    # as a Slurm script starts them: one agent per node, the static backend on node 0's MASTER_ADDR:PORT
    # (both nodes on loopback here); rank 3 lives on node 1, its peer copy on node 0
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = ("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
             "--master-port", str(port), "--max-restarts", "1")
    out, key = tmp_path / "faulted", Job.key_env()
    with Job(Job.torchrun("--standalone", "--nproc-per-node", str(RANKS)), tmp_path / "reference", STEPS) as ref, \
            Job(Job.meshpact("--node-rank", "0", *nodes), out, STEPS, step_s=0.05, env=key, name="node0") as node0, \
            Job(Job.meshpact("--node-rank", "1", *nodes), out, STEPS, step_s=0.05, env=key, name="node1") as node1:
        others = {r: node0.wait_for_step(r, 0, 120) for r in range(3)}
        killed = node1.kill_rank(3, after_step=3)
        assert node0.wait(180) == 0, node0.tail()
        assert node1.wait(180) == 0, node1.tail()
        assert ref.wait(180) == 0, ref.tail()
    reference, faulted = read_finals(ref.out, RANKS), read_finals(out, RANKS)
    assert {r: f.digest for r, f in faulted.items()} == {r: f.digest for r, f in reference.items()}
    assert all(faulted[r].pid == p.pid and faulted[r].incarnation == 0 for r, p in others.items())
    assert faulted[3].incarnation == 1 and faulted[3].pid != killed.pid
    assert all(f.storage_bytes_read == 0 for f in faulted.values())
    assert [f.policies for r, f in sorted(faulted.items()) if r != 3] == [("peer_restore",)] * 3
    # waiting seconds for the replacement (over several consensus rounds under load), each process writes the
    # store client's timed-out-wait warning at most once (its agreement's first slice), not once per 0.25 s
    # slice: node 0 runs ranks 0 and 1, node 1 rank 2 and rank 3's replacement
    for node in (node0, node1):
        assert node.log.read_text().count("likely a timeout") <= 2, node.log.read_text()[-3000:]
