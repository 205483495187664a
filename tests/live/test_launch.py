"""``meshpact launch`` on one node: a killed worker is replaced alone and the job ends bit-identical.

The README's loop, unchanged (``_readme_loop.py``, checked against the README's code block; run
by ``_readme_job.py``, which only watches it), runs twice side by side: under plain ``torchrun``
without a fault (the reference, and proof that it runs under torchrun unchanged) and under
``meshpact launch --standalone --nproc-per-node 4`` with no other flag (the defaults: peer
copies kept, a replacement per failed worker) with rank 2 SIGKILLed after its third step; while
it runs, no process of the job listens on every interface (``/proc/net/tcp{,6}``). With
``--max-restarts 0`` and no checkpoint the same kill cannot be recovered: the job ends within
the control channel's bound, every other rank saying the same one line, and nothing is
replaced. Then two nodes as a Slurm script starts them (the static backend on node 0's address,
the example script ``examples/resilient_train.py``): a worker killed on node 1 is replaced
there from node 0's copy.
"""

from __future__ import annotations

import pytest

import re
import time
from dataclasses import dataclass
from pathlib import Path

from _sockets import listeners
from meshpact.live.recovery import RecoveryConfig
from meshpact.live.recovery.refusal import REFUSAL_LINE
from _references import torchrun_reference
from meshpact.live.trials.launchdrill import Final, Job, Progress, read_finals
from meshpact.live.trials.ports import unclaimed_port

pytestmark = [pytest.mark.live, pytest.mark.slow]

RANKS, STEPS = 4, 10
README_JOB = Path(__file__).with_name("_readme_job.py")
README_STEPS = 100  # what the README's loop runs


def test_the_fixture_is_the_readmes_loop_as_it_stands():
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = re.search(r"## Your training loop, made resilient.*?```python\n(.*?)```", readme, re.S)
    assert block is not None and block.group(1) == README_JOB.with_name("_readme_loop.py").read_text()
    assert "start_session()" in block.group(1)  # no settings: the defaults are what is tried


@dataclass
class _ReadmeRuns:
    """The README's loop run three ways at once (one start-up for every assertion below)."""

    reference: dict[int, Final]
    faulted: dict[int, Final]
    faulted_others: dict[int, Progress]
    faulted_killed: Progress
    faulted_log: str
    listening: list
    refused_rc: int
    refused_took_s: float
    refused_others: dict[int, Progress]
    refused_killed: Progress
    refused_log: str
    refused_finals: dict[int, Final]


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory) -> _ReadmeRuns:
    """Plain torchrun without a fault; ``meshpact launch --standalone --nproc-per-node 4`` with no other
    flag and rank 2 killed after its third step; the same with ``--max-restarts 0`` (and no checkpoint)."""
    tmp = tmp_path_factory.mktemp("readme")
    one_node = ("--standalone", "--nproc-per-node", str(RANKS))
    with (
        Job(Job.meshpact(*one_node), tmp / "faulted", README_STEPS, step_s=0.02, script=README_JOB) as job,
        Job(
            Job.meshpact(*one_node, "--max-restarts", "0"),
            tmp / "refused",
            README_STEPS,
            step_s=0.02,
            script=README_JOB,
        ) as refused,
    ):
        others = {r: job.wait_for_step(r, 0, 120) for r in range(RANKS) if r != 2}
        refused_others = {r: refused.wait_for_step(r, 0, 120) for r in range(RANKS) if r != 2}
        # no process of the job listens on every interface: the rendezvous stores, the control channel,
        # the peer servers and the data path are all on loopback
        listening = listeners(job.proc.pid)
        killed = job.kill_rank(2, after_step=3)
        refused_killed = refused.kill_rank(2, after_step=3)
        t_kill = time.monotonic()
        refused_rc = refused.wait(120)
        took = time.monotonic() - t_kill
        assert job.wait(180) == 0, job.tail()
    return _ReadmeRuns(
        torchrun_reference(RANKS, README_STEPS, README_JOB),
        read_finals(job.out, RANKS),
        others,
        killed,
        job.log.read_text(),
        listening,
        refused_rc,
        took,
        refused_others,
        refused_killed,
        refused.log.read_text(),
        read_finals(refused.out, RANKS),
    )


def test_the_readmes_loop_under_the_defaults_replaces_a_killed_worker_alone_bit_identical_to_no_fault(readme_runs):
    runs = readme_runs
    assert len(runs.listening) >= 3 + 2 * RANKS, (
        runs.listening
    )  # two stores, the channel; each rank's peer server and gloo
    assert not [ln for ln in runs.listening if ln.wildcard], runs.listening
    reference, faulted = runs.reference, runs.faulted
    assert sorted(reference) == sorted(faulted) == list(range(RANKS))
    assert {r: f.digest for r, f in faulted.items()} == {r: f.digest for r, f in reference.items()}
    # the three others were never restarted: the same processes from their first step to the end
    assert all(faulted[r].pid == p.pid and faulted[r].incarnation == 0 for r, p in runs.faulted_others.items())
    assert faulted[2].incarnation == 1 and faulted[2].pid != runs.faulted_killed.pid
    assert f"rank 2 (pid {runs.faulted_killed.pid}) exited with -9" in runs.faulted_log
    assert all(f.recovered_by("peer_restore") for r, f in faulted.items() if r != 2), faulted


def test_a_recovery_that_cannot_happen_ends_the_job_once_with_one_line_per_rank_and_no_replacement(readme_runs):
    """``--max-restarts 0``, no checkpoint, and the README's loop offers no excision: nothing can recover
    the killed rank, and the agent starts no process for it or for the ranks that refuse."""
    runs, log = readme_runs, readme_runs.refused_log
    assert runs.refused_rc != 0, log[-3000:]
    assert runs.refused_took_s < RecoveryConfig().control_timeout_s, (runs.refused_took_s, log[-3000:])
    said = [ln for ln in log.splitlines() if ln.startswith(REFUSAL_LINE)]
    assert len(said) == RANKS - 1 and len(set(said)) == 1, log[-3000:]  # the same one line on every other rank
    assert "declared lost, no replacement comes" in said[0], said[0]
    assert "Traceback" not in log, log[-3000:]
    assert "replaced by" not in log
    for r, p in runs.refused_others.items():  # each refused, and was left gone, not replaced
        assert re.search(rf"rank {r} \(pid {p.pid}\) exited with 1, refusing a recovery that cannot happen", log), log
    assert f"rank 2 (pid {runs.refused_killed.pid}) exited with -9 and no replacement is left (--max-restarts 0)" in log
    assert runs.refused_finals == {}


def test_two_nodes_in_a_static_rendezvous_replace_a_worker_alone_from_the_other_nodes_copy(tmp_path):
    # as a Slurm script starts them: one agent per node, the static backend on node 0's MASTER_ADDR:PORT
    # (both nodes on loopback here); rank 3 lives on node 1, its peer copy on node 0
    port = unclaimed_port()
    nodes = (
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "static",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--max-restarts",
        "1",
    )
    out, key = tmp_path / "faulted", Job.key_env()
    node0_cmd, node1_cmd = (Job.meshpact("--node-rank", str(n), *nodes, warm_start=True) for n in (0, 1))
    with (
        Job(node0_cmd, out, STEPS, step_s=0.05, env=key, name="node0") as node0,
        Job(node1_cmd, out, STEPS, step_s=0.05, env=key, name="node1") as node1,
    ):
        others = {r: node0.wait_for_step(r, 0, 120) for r in range(3)}
        killed = node1.kill_rank(3, after_step=3)
        assert node0.wait(180) == 0, node0.tail()
        assert node1.wait(180) == 0, node1.tail()
    reference, faulted = torchrun_reference(RANKS, STEPS), read_finals(out, RANKS)
    assert {r: f.digest for r, f in faulted.items()} == {r: f.digest for r, f in reference.items()}
    assert all(faulted[r].pid == p.pid and faulted[r].incarnation == 0 for r, p in others.items())
    assert faulted[3].incarnation == 1 and faulted[3].pid != killed.pid
    assert all(f.storage_bytes_read == 0 for f in faulted.values())
    assert all(f.recovered_by("peer_restore") for r, f in faulted.items() if r != 3), faulted
    # waiting seconds for the replacement (over several consensus rounds under load), each process writes the
    # store client's timed-out-wait warning at most once (its agreement's first slice), not once per 0.25 s
    # slice: node 0 runs ranks 0 and 1, node 1 rank 2 and rank 3's replacement
    for node in (node0, node1):
        assert node.log.read_text().count("likely a timeout") <= 2, node.log.read_text()[-3000:]
