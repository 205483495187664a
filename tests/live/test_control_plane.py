"""``meshpact control-plane``'s verdicts and command lines, without processes: the service's stores on
loopback in this process, the nodes' side played by channel clients, the clock chosen.

With the control plane apart, node 0 is judged as any node: silent past ``--node-loss-s`` its group
rank goes to a live spare node, or its ranks are announced gone; no agent judges (group rank 0's
included), and an agent whose service stops answering says so in one line. The service names its
channel in the rendezvous store for every agent and spare node, listens on its ``--host`` alone, ends
once every node is done, and refuses a bad flag in one line, as ``meshpact launch --control-plane`` does.
"""

from __future__ import annotations

import socket

import pytest
from torch.distributed.elastic.agent.server.api import WorkerSpec

from meshpact.cli import main as cli_main
from meshpact.live.launch.command import main as launch_main
from meshpact.live.launch.controlplane import ControlPlane, ControlPlaneHost, ControlPlaneOptions, ControlPlaneRefused
from meshpact.live.launch.elastic import LaunchOptions, ReplacingAgent
from meshpact.live.launch.nodes import JOB_ENDED_KEY, SPARE_COUNT_KEY, HostNodeLost, NodeEnv, NodeWatch, SpareNode
from meshpact.live.launch.rendezvous import StandbyRendezvous
from meshpact.live.recovery.consensus import gone_ranks
from meshpact.live.recovery.control import ControlChannel
from meshpact.live.recovery.jobkey import KEY_ENV, draw
from meshpact.live.trials.ports import unclaimed_port

KEY = draw("a test's job key")
SILENT_S = 3.0


def _plane(rdzv_id: str = "job") -> ControlPlane:
    options = ControlPlaneOptions(rdzv_id=rdzv_id, port=unclaimed_port(), node_loss_s=SILENT_S, linger_s=0)
    return ControlPlane(options, KEY)


def _publish(nodes: ControlChannel, group_world_size: int = 2, nproc: int = 2) -> None:
    """What each agent publishes as it starts its workers (:class:`NodeEnv`)."""
    for g in range(group_world_size):
        ranks = tuple(range(g * nproc, (g + 1) * nproc))
        nodes.set(
            f"agent/node{g}",
            NodeEnv(
                g,
                group_world_size,
                "default",
                ranks,
                ranks,
                group_world_size * nproc,
                group_world_size * nproc,
                "127.0.0.1",
                29400,
                "job",
                True,
            ).to_dict(),
        )


def _clients(plane: ControlPlane) -> ControlChannel:
    return ControlChannel("127.0.0.1", plane.control_port, -1, 4, 5.0, run_id="job", key=KEY)


def _lose_node_0(plane: ControlPlane, nodes: ControlChannel, spare: SpareNode | None) -> None:
    """Both nodes beat once; then node 0 falls silent past the bound while node 1 (and the spare) beat on."""
    nodes.add("agent/beat0")
    for now in (0.0, 0.5, 1.0, 2.0, 4.5):
        nodes.add("agent/beat1")
        if spare is not None:
            nodes.add(f"spare/beat{spare.spare_id}")
        assert plane.look(now) is False


def test_the_service_hands_node_0_to_a_live_spare_node_and_ends_when_every_node_is_done(capsys):
    with _plane() as plane:
        nodes = _clients(plane)
        _publish(nodes)
        spare = SpareNode(nodes.add(SPARE_COUNT_KEY), "10.0.0.3", 2, 4242)
        nodes.set(f"spare/node{spare.spare_id}", spare.to_dict())
        _lose_node_0(plane, nodes, spare)
        assert nodes.wait([f"spare/assign{spare.spare_id}"], 5.0)[f"spare/assign{spare.spare_id}"] == {"group_rank": 0}
        assert gone_ranks(nodes, range(4)) == ()  # the survivors wait for the replacements of ranks 0 and 1
        err = capsys.readouterr().err
        assert (
            "[meshpact control-plane] node 0 (ranks [0, 1]) is lost: its agent has not beaten on the control "
            "channel for 4.5 s; spare node 1 at 10.0.0.3 takes its ranks"
        ) in err
        nodes.set("agent/done1", True)
        assert plane.look(5.0) is False  # node 0, now the spare node, has not said it is done
        nodes.set("agent/done0", True)
        assert plane.serve(until=None) is True
        assert nodes.wait([JOB_ENDED_KEY], 5.0)[JOB_ENDED_KEY] is True  # spare nodes still standing by leave
        assert "job job ended: every node is done; node(s) [0] ended on spare nodes" in capsys.readouterr().err


def test_without_a_spare_node_the_ranks_of_node_0_are_announced_gone_and_the_job_ends_with_its_survivors():
    with _plane() as plane:
        nodes = _clients(plane)
        _publish(nodes)
        _lose_node_0(plane, nodes, None)
        assert gone_ranks(nodes, range(4)) == (0, 1)
        assert [n.group_rank for n in plane.watch.lost_nodes] == [0]
        nodes.set("agent/done1", True)
        assert plane.look(5.0) is True


def test_the_service_watches_nothing_before_a_node_publishes_and_serves_until_told():
    import time

    with _plane() as plane:
        nodes = _clients(plane)
        assert plane.look(0.0) is False and plane.layout is None  # no node yet: no node can be silent
        assert plane.serve(until=time.monotonic() + 0.3) is False
        _publish(nodes, group_world_size=3, nproc=4)
        assert plane.look(1.0) is False and (plane.layout.group_world_size, plane.layout.nproc_per_node) == (3, 4)


def test_every_agent_and_spare_node_reads_the_services_channel_from_the_rendezvous_store_and_nothing_else_listens():
    with _plane("job-7") as plane:
        standby = StandbyRendezvous(f"127.0.0.1:{plane.options.port}", "job-7", 2.0)
        assert standby.job() == ("127.0.0.1", plane.control_port, "job-7") and standby.apart
        for port in (plane.options.port, plane.control_port):  # bound to 127.0.0.1 alone, not every address
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(("127.0.0.2", port), timeout=2).close()
            socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_with_the_control_plane_apart_no_agent_judges_and_a_silent_service_is_said_in_one_line():
    with _plane() as plane:
        nodes = _clients(plane)
        spec = WorkerSpec(
            role="default",
            local_world_size=2,
            entrypoint="train.py",
            rdzv_handler=StandbyRendezvous("127.0.0.1:1", "job", 1.0),
        )
        agent = ReplacingAgent(spec, None, LaunchOptions(node_loss_s=SILENT_S, control_plane=ControlPlaneHost.SERVICE))
        wg = agent.get_worker_group()
        wg.group_rank, wg.group_world_size = 0, 2
        channel = ControlChannel("127.0.0.1", plane.control_port, 0, 4, 5.0, run_id="job", key=KEY)
        nodes.add("agent/beat1")
        for now in (0.0, 2.0, 4.5, 9.0):  # node 1 silent past the bound: group rank 0's agent leaves it be
            agent.nodes.look(channel, wg, now)
        assert nodes.counter("agent/beat0") == 4 and gone_ranks(nodes, range(4)) == ()
        assert agent.nodes.judges_host(0, False)  # group rank 0's agent too: the stores are the service's
    watch = NodeWatch(SILENT_S, apart=True)
    watch.unanswered(0.0, RuntimeError("Connection reset by peer"), ("10.0.0.9", 29400), True)
    with pytest.raises(HostNodeLost) as lost:
        watch.unanswered(3.5, RuntimeError("Connection reset by peer"), ("10.0.0.9", 29400), True)
    assert str(lost.value).startswith(
        "the control plane is lost: meshpact control-plane at 10.0.0.9:29400 has "
        "not answered for 3.5 s (last: Connection reset by peer)"
    )
    assert "\n" not in str(lost.value)


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--rdzv-id", "a b"], "error: --rdzv-id 'a b': expected the job's rendezvous id, 1 to 128 letters"),
        (["--rdzv-id", "j", "--port", "0"], "error: --port '0': expected an integer from 1 to 65535"),
        (["--rdzv-id", "j", "--node-loss-s", "1"], "error: --node-loss-s 1.0: expected more than 1 s"),
        (["--rdzv-id", "j", "--linger-s", "-1"], "error: --linger-s -1.0: expected 0 to 3600 s"),
        (["--rdzv-id", "j", "--host", "192.0.2.1"], "error: --host 192.0.2.1 --port "),
        (["--port", "29400"], "error: --rdzv-id is required"),
    ],
)
def test_a_bad_control_plane_flag_is_refused_in_one_line(flags, expected, capsys, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY.secret.hex())
    assert cli_main(["control-plane", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err


def test_the_service_refuses_to_start_without_the_jobs_key(capsys, monkeypatch):
    for name in (KEY_ENV, "MESHPACT_JOB_KEY_FILE", "MESHPACT_UNAUTHENTICATED"):
        monkeypatch.delenv(name, raising=False)
    assert cli_main(["control-plane", "--rdzv-id", "j", "--port", str(unclaimed_port())]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: the control plane signs with the job's key and none was given") and err.count("\n") == 1
    )


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            ["--control-plane", "lighthouse", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"],
            "error: --control-plane 'lighthouse': expected node or service",
        ),
        (
            ["--control-plane", "service", "--standalone"],
            "error: --control-plane service: --standalone hosts the stores",
        ),
        (
            ["--control-plane", "service", "--nnodes", "2", "--rdzv-backend", "static", "--master-addr", "h"],
            "error: --control-plane service: expected --rdzv-backend c10d and --rdzv-endpoint HOST:PORT",
        ),
        (
            [
                "--control-plane",
                "service",
                "--nnodes",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                "h:1",
                "--rdzv-conf",
                "is_host=1",
            ],
            "error: --control-plane service: --rdzv-conf is_host=1 asks this node to host",
        ),
    ],
)
def test_a_bad_launch_control_plane_flag_is_refused_in_one_line(flags, expected, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY.secret.hex())
    script = tmp_path / "train.py"
    script.write_text("")
    assert launch_main([*flags, "--nproc-per-node", "2", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected) and err.count("\n") == 1, err


def test_the_environment_names_the_control_plane_and_is_named_when_wrong(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MESHPACT_CONTROL_PLANE", "elsewhere")
    script = tmp_path / "train.py"
    script.write_text("")
    assert launch_main(["--standalone", "--nproc-per-node", "2", str(script)]) == 2
    assert capsys.readouterr().err == "error: MESHPACT_CONTROL_PLANE 'elsewhere': expected node or service\n"
    with pytest.raises(ControlPlaneRefused):
        ControlPlaneOptions(rdzv_id="j", port=29400, control_port=29400)
