"""Group rank 0's verdict on a lost node, without processes: the agent's watch over a control channel on
loopback (a ``TCPStore`` in this process), driven with chosen clock readings.

A live spare node with the job's ``--nproc-per-node`` is given the lost node's group rank and the
ranks are not announced gone; with none registered, or only one that runs another number of
workers (named, with why), the ranks are announced gone as before. ``--spare`` with
``--standalone`` is refused in one line, and a spare node that finds no job at its endpoint says
so in one line. A node waiting in the store's native code (node 0 of a static rendezvous waiting for
the others, a spare node waiting for its job) still stops on SIGTERM, in one line.
"""

from __future__ import annotations

import os

from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousGracefulExitError

from meshpact.live.trials.ports import unclaimed_port
from meshpact.live.launch.command import DEFAULT_REPLACEMENTS, config, main, parser
from meshpact.live.launch.elastic import LaunchOptions, ReplacingAgent
from meshpact.live.launch.nodes import JOB_ENDED_KEY, SPARE_COUNT_KEY, NodeLoss, SpareNode, choose_spare
from meshpact.live.launch.rendezvous import StandbyRendezvous
from meshpact.live.launch.spareagent import NoJobFound, SpareAgent
from meshpact.live.recovery.consensus import gone_ranks
from meshpact.live.recovery.control import ControlChannel
from meshpact.live.store import host_store
from meshpact.live.recovery.jobkey import KEY_ENV, draw

KEY = draw("a test's job key")  # the job key the channels of this file sign with

SILENT_S = 3.0


def _agent_on_channel():
    """Group rank 0's agent of a 2-node x 2-worker job, its channel, and a second client (the other nodes)."""
    server = host_store("127.0.0.1", 0)
    spec = WorkerSpec(
        role="default",
        local_world_size=2,
        rdzv_handler=StandbyRendezvous("127.0.0.1:1", "t", 1.0),
        entrypoint="train.py",
    )
    agent = ReplacingAgent(spec, None, LaunchOptions(node_loss_s=SILENT_S))
    agent._channel = ControlChannel("127.0.0.1", server.port, 0, 4, 5.0, run_id="t", key=KEY)
    wg = agent.get_worker_group()
    wg.group_rank, wg.group_world_size = 0, 2
    return server, agent, wg, ControlChannel("127.0.0.1", server.port, -1, 4, 5.0, run_id="t", key=KEY)


def _register(others: ControlChannel, nproc: int) -> SpareNode:
    node = SpareNode(others.add(SPARE_COUNT_KEY), "10.0.0.3", nproc, 4242)
    others.set(f"spare/node{node.spare_id}", node.to_dict())
    return node


def _lose_node_1(agent, wg, others: ControlChannel, spare: SpareNode | None) -> None:
    """Node 1 beats once, then falls silent past the bound while the spare (if any) keeps beating."""
    others.add("agent/beat1")
    for now in (0.0, 0.5, 1.0, 2.0, 4.5):
        if spare is not None:
            others.add(f"spare/beat{spare.spare_id}")
        agent.nodes.look(agent._channel, wg, now)


def test_a_live_spare_node_with_the_same_workers_per_node_is_given_the_lost_node(capsys):
    server, agent, wg, others = _agent_on_channel()
    spare = _register(others, 2)
    _lose_node_1(agent, wg, others, spare)
    # a store's set is not answered: read on another connection, it is waited for, not raced
    assert others.wait([f"spare/assign{spare.spare_id}"], 5.0)[f"spare/assign{spare.spare_id}"] == {"group_rank": 1}
    assert gone_ranks(others, range(4)) == ()  # the survivors wait for replacements instead of excising
    assert [v.spare for v in agent.nodes.takeovers] == [spare] and agent.nodes.lost_nodes == []
    err = capsys.readouterr().err
    assert (
        "node 1 (ranks [2, 3]) is lost: its agent has not beaten on the control channel for 4.5 s; "
        "spare node 1 at 10.0.0.3 takes its ranks" in err
    )
    agent.nodes.look(agent._channel, wg, 5.0)  # the spare has the bound anew to beat as node 1: not lost again
    assert len(agent.nodes.takeovers) == 1 and agent.nodes.lost_nodes == []
    del server


def test_without_a_spare_node_the_lost_nodes_ranks_are_announced_gone(capsys):
    server, agent, wg, others = _agent_on_channel()
    _lose_node_1(agent, wg, others, None)
    assert gone_ranks(others, range(4)) == (2, 3)
    assert [n.group_rank for n in agent.nodes.lost_nodes] == [1] and agent.nodes.takeovers == []
    assert "no spare node is registered; the job is told its ranks are gone" in capsys.readouterr().err
    agent.nodes.end_standby(agent._channel, 0)
    assert (
        others.wait([JOB_ENDED_KEY], 5.0)[JOB_ENDED_KEY] is True
    )  # a spare node that comes late leaves when the job ends
    del server


def test_a_spare_node_with_other_workers_per_node_is_not_used_and_named(capsys):
    server, agent, wg, others = _agent_on_channel()
    spare = _register(others, 4)
    _lose_node_1(agent, wg, others, spare)
    assert others.get(f"spare/assign{spare.spare_id}") is None
    assert gone_ranks(others, range(4)) == (2, 3)
    assert (
        "no registered spare node can take its ranks (spare node 1 at 10.0.0.3 runs 4 worker(s) per node, "
        "the job 2); the job is told its ranks are gone" in capsys.readouterr().err
    )
    del server


def test_the_first_live_spare_node_is_chosen_and_a_silent_one_is_named():
    loss = NodeLoss(1, (2, 3), 3.2)
    silent, live, later = (SpareNode(i, f"10.0.0.{i + 2}", 2, 100 + i) for i in (1, 2, 3))
    verdict = choose_spare(loss, 2, [later, live, silent], live={2, 3}, node_loss_s=SILENT_S)
    assert verdict.spare == live
    assert verdict.passed_over == ("spare node 1 at 10.0.0.3 has not beaten within 3 s",)
    assert choose_spare(loss, 2, [silent], live=set(), node_loss_s=SILENT_S).spare is None


def test_a_failed_worker_is_replaced_by_default_and_max_restarts_0_turns_it_off(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text("")
    one_node = ["--standalone", "--nproc-per-node", "2"]
    assert config([*one_node, str(script)])[0].max_restarts == DEFAULT_REPLACEMENTS == 3  # torchrun's is 0
    assert config([*one_node, "--max-restarts", "0", str(script)])[0].max_restarts == 0
    assert config([*one_node, "--max_restarts=1", str(script)])[0].max_restarts == 1
    with pytest.raises(SystemExit):
        parser().parse_args(["--help"])
    assert "Replacement processes per node (default 3)" in " ".join(capsys.readouterr().out.split())


def test_spare_with_standalone_is_refused_in_one_line(capsys):
    assert main(["--spare", "--standalone", "--nproc-per-node", "2", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --spare:") and "--standalone" in err


def test_a_spare_node_that_finds_no_job_under_its_id_says_so_in_one_line():
    server = host_store("127.0.0.1", 0)  # a rendezvous store where no job named its control channel
    standby = StandbyRendezvous(f"127.0.0.1:{server.port}", "other", 0.5)
    spec = WorkerSpec(
        role="default", local_world_size=2, rdzv_handler=standby, entrypoint="train.py", local_addr="127.0.0.1"
    )
    agent = SpareAgent(spec, None, LaunchOptions(spare=True), standby)
    with pytest.raises(NoJobFound) as err:
        agent._rendezvous(agent.get_worker_group())
    assert str(err.value).startswith(
        f"--spare: no job with --rdzv-id other named its control channel at 127.0.0.1:{server.port} within 0.5 s"
    )
    assert "\n" not in str(err.value)


def test_a_standing_spare_node_takes_the_group_rank_it_is_given_or_leaves_when_the_job_ends(capsys):
    server = host_store("127.0.0.1", 0)
    standby = StandbyRendezvous(f"127.0.0.1:{server.port}", "t", 1.0)
    spec = WorkerSpec(role="default", local_world_size=2, rdzv_handler=standby, entrypoint="train.py")
    agent = SpareAgent(spec, None, LaunchOptions(spare=True), standby)
    agent._channel = ControlChannel("127.0.0.1", server.port, -1, 4, 5.0, run_id="t", key=KEY)
    others = ControlChannel("127.0.0.1", server.port, 0, 4, 5.0, run_id="t", key=KEY)
    me = SpareNode(1, "10.0.0.3", 2, 4242)
    others.set("spare/assign1", {"group_rank": 1})
    assert agent._stand_by(me) == 1
    assert others.counter("spare/beat1") == 1  # it beat before it looked
    others.set(JOB_ENDED_KEY, True)
    with pytest.raises(RendezvousGracefulExitError):  # elastic's way out of a rendezvous: exit status 0
        agent._stand_by(SpareNode(2, "10.0.0.4", 2, 4243))
    assert "spare node 2 at 10.0.0.4: the job ended without needing a spare node; leaving" in capsys.readouterr().err


def test_once_a_node_is_lost_the_other_agents_do_not_wait_at_elastics_exit_barrier(capsys, monkeypatch):
    """In a job of three or more nodes an agent other than group rank 0 would wait the barrier's whole
    timeout for the lost agent (or for a spare node, which is in no elastic barrier)."""
    server, agent, wg, others = _agent_on_channel()
    node2 = ReplacingAgent(agent.get_worker_group().spec, None, LaunchOptions(node_loss_s=SILENT_S))
    node2._channel = ControlChannel("127.0.0.1", server.port, 2, 4, 5.0, run_id="t", key=KEY)
    node2.get_worker_group().group_rank = 2
    barriers = []
    monkeypatch.setattr(SimpleElasticAgent, "_exit_barrier", lambda self: barriers.append(self))
    node2._exit_barrier()
    assert barriers == [node2]  # nothing lost yet: elastic's barrier, as torchrun's agents do
    _lose_node_1(agent, wg, others, None)
    node2._exit_barrier()
    assert barriers == [node2] and "a node of the job was lost" in capsys.readouterr().err
    del server


@pytest.mark.parametrize("role", ["static", "spare"])
def test_a_node_waiting_in_the_store_stops_on_sigterm_with_one_line(tmp_path, role):
    # node 0 of a static rendezvous waits for the other nodes, and a spare node for a job to name its
    # control channel, in the store's native code; the agent must still hear a scheduler's SIGTERM
    # there, not hold it until the join timeout (600 s by default)
    import signal
    import subprocess
    import sys
    import time

    served = host_store("127.0.0.1", 0)  # the spare's endpoint: a store where no job has named its channel
    port = unclaimed_port()
    script = tmp_path / "train.py"
    script.write_text("print('never started')\n")
    flags = (
        [
            "--nnodes",
            "2",
            "--node-rank",
            "0",
            "--rdzv-backend",
            "static",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
        ]
        if role == "static"
        else [
            "--spare",
            "--nnodes",
            "1:2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{served.port}",
            "--rdzv-id",
            "nojob",
        ]
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshpact.launch", "--nproc-per-node", "1", *flags, str(script)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, KEY_ENV: KEY.secret.hex()},
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert ("joining the static rendezvous" if role == "static" else "spare node: waiting for job nojob") in line, (
            line
        )
        time.sleep(1.0)  # inside the store's wait
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        err = proc.stderr.read()
    finally:
        proc.kill()
    assert rc != 0
    assert "stopped by SIGTERM" in err and "Traceback" not in err, err
