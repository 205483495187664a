"""AgentJob: a worker target's ranks under meshpact launch's agent, inside the calling process.

What the trials, the CLI and the dashboard rely on: elastic's worker environment, the agent's
replacement of a failed rank alone (next incarnation, the others untouched), the rank announced
gone on the caller's control channel when no replacement is left (or not, where asked), first
processes forked from the fork server and replacements started fresh, the process registry, the
deadline, and ranks placed on two hosts (network namespaces): each under its host's command prefix,
forked by its host's server, meeting at a store served there.
"""

from __future__ import annotations

import os

import pytest

from meshpact.live.launch.agentjob import AgentJob
from meshpact.live.launch.forkserver import ForkServer
from meshpact.live.launch.launcher import LaunchedProcess, LaunchError, host_store
from meshpact.live.netns import TwoHosts, netns_unavailable
from meshpact.live.recovery.consensus import GONE_KEY, gone_ranks
from meshpact.live.recovery.control import ControlChannel
from meshpact.live.recovery.refusal import REFUSAL_LINE

from _warm import shared_forkserver

pytestmark = [pytest.mark.live, pytest.mark.slow]
ECHO = "meshpact.live.launch.launcher:echo"


def test_ranks_get_elastic_environment_and_fork_from_the_server(tmp_path):
    server = shared_forkserver()
    registry = tmp_path / "processes.jsonl"
    with AgentJob(
        ECHO,
        2,
        {
            "report_env": [
                "GROUP_RANK",
                "TORCHELASTIC_RUN_ID",
                "TORCHELASTIC_ERROR_FILE",
                "MESHPACT_RUN_ID",
                "MESHPACT_INCARNATION",
                "MESHPACT_JOB_KEY",
            ]
        },
        timeout_s=90,
        run_id="phase-a",
        forkserver=server,
        registry=registry,
    ) as job:
        ran = job.run()
    assert [r.rank for r in ran.results] == [0, 1] and all(r.ok for r in ran.results)
    for r in ran.results:
        env = r.value["env"]
        assert env["GROUP_RANK"] == "0" and env["MESHPACT_RUN_ID"] == "phase-a" and env["MESHPACT_INCARNATION"] == "0"
        assert env["TORCHELASTIC_RUN_ID"] == "phase-a"  # elastic's rendezvous id is the job's run id
        assert env["TORCHELASTIC_ERROR_FILE"].endswith("error.json")  # elastic's @record writes there
        assert env["MESHPACT_JOB_KEY"] == job.job_key.secret.hex()  # the agent's key, in the environment alone
        assert r.value["ppid"] == server.pid  # forked from the server, not a fresh interpreter
    listed = LaunchedProcess.read(registry)
    assert sorted((p.rank, p.incarnation, p.run_id) for p in listed) == [(0, 0, "phase-a"), (1, 0, "phase-a")]
    assert {p.pid for p in listed} == {r.value["pid"] for r in ran.results}
    assert ran.replacements == 0 and not ran.gone and not ran.timed_out


def test_a_job_opted_out_of_the_key_by_name_hands_its_ranks_the_opt_out_and_no_key():
    with AgentJob(
        ECHO,
        2,
        {"report_env": ["MESHPACT_JOB_KEY", "MESHPACT_UNAUTHENTICATED"]},
        timeout_s=90,
        run_id="no-key",
        forkserver=shared_forkserver(),
        unauthenticated=True,
    ) as job:
        ran = job.run()
    assert job.job_key is None and all(r.ok for r in ran.results)
    assert [r.value["env"].get("MESHPACT_UNAUTHENTICATED") for r in ran.results] == ["1", "1"]
    assert not any(r.value["env"].get("MESHPACT_JOB_KEY") for r in ran.results)


def test_failed_rank_is_replaced_alone_and_fresh(tmp_path):
    seen: list[tuple[int, int, bool]] = []
    server = shared_forkserver()
    with AgentJob(
        ECHO,
        2,
        {"fail_ranks": [1]},
        timeout_s=120,
        max_replacements=1,
        forkserver=server,
        on_replaced=lambda rank, rc, warm: seen.append((rank, rc, warm)),
    ) as job:
        ran = job.run()
    assert seen == [(1, 3, False)]  # the first process exited 3; a new process, not a spare
    first, second = ran.results
    assert first.ok and first.incarnation == 0 and first.value["ppid"] == server.pid
    assert second.ok and second.incarnation == 1 and second.value["incarnation"] == 1
    assert second.value["ppid"] == os.getpid()  # a replacement is a real start, not forked
    assert ran.replacements == 1


@pytest.mark.parametrize("announce", [True, False])
def test_rank_without_replacement_is_announced_gone_or_not(tmp_path, announce):
    store = host_store("127.0.0.1", 0, 2)
    gone: list[tuple[int, int]] = []
    with AgentJob(
        ECHO,
        2,
        {"fail_ranks": [1]},
        timeout_s=90,
        max_replacements=0,
        run_id="g",
        control=("127.0.0.1", store.port),
        forkserver=shared_forkserver(),
        announce_gone=announce,
        on_gone=lambda rank, rc: gone.append((rank, rc)),
    ) as job:
        ran = job.run()
    assert gone == [(1, 3)] and ran.gone == {1: 3}
    assert ran.results[0].ok and ran.results[1].returncode == 3
    channel = ControlChannel("127.0.0.1", store.port, 0, 2, 5.0, run_id="g", key=job.job_key)
    if announce:  # a store's set is not answered: the agent's write is waited for on this connection
        channel.wait([f"{GONE_KEY}1"], 5.0)
    assert gone_ranks(channel, [0, 1]) == ((1,) if announce else ())


def test_deadline_stops_every_rank_and_says_so():
    with AgentJob(ECHO, 2, {"sleep_s": 60}, timeout_s=6, forkserver=shared_forkserver()) as job:
        ran = job.run()
    assert ran.timed_out
    assert [r.returncode for r in ran.results] == [None, None]
    assert sorted(job.pids) == [0, 1]
    for pid in job.pids.values():  # nothing of the job is left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_replacement_that_fails_leaves_its_own_stderr_to_name_why():
    """What a trial quotes when a replacement dies by itself (the rank then gets no process
    again): that process's stderr, not its predecessor's."""
    gone: list[tuple[int, int]] = []
    with AgentJob(
        ECHO,
        1,
        {"fail_ranks": [0], "raise_in_replacement": "the replacement broke", "timeout_s": 60},
        timeout_s=90,
        max_replacements=1,
        forkserver=shared_forkserver(),
        on_gone=lambda rank, rc: gone.append((rank, rc)),
    ) as job:
        ran = job.run()
    (only,) = ran.results
    assert gone == [(0, 1)] and only.incarnation == 1 and only.returncode == 1
    assert "RuntimeError: the replacement broke" in only.stderr_tail


def test_bad_target_is_one_line_before_any_rank_starts():
    with pytest.raises(LaunchError, match="cannot be loaded"):
        AgentJob("meshpact.no_such_module:worker", 2)


def test_spares_are_refused_where_ranks_run_under_a_prefix():
    with pytest.raises(LaunchError, match="a warm spare starts on the agent's own host"):
        AgentJob(ECHO, 2, spares=1, prefix=lambda r: ["env"])


_NO_NETNS = netns_unavailable(shaped=False)


@pytest.mark.netns
@pytest.mark.skipif(_NO_NETNS is not None, reason=_NO_NETNS or "")
def test_ranks_on_two_hosts_start_under_their_prefix_and_meet_at_a_store_served_there(tmp_path):
    """Rank r on host r (``ip netns exec``), forked by the server started on its host; the store is
    served on host 0's end of the link, an address this machine's own namespace cannot reach: the
    job runs with the calling thread on host 0. Rank 1's first process fails; its replacement starts
    fresh under the same prefix and reaches the store too."""
    own = os.readlink("/proc/thread-self/ns/net")
    with TwoHosts(link=None) as hosts:
        with ForkServer(prefix=hosts.prefix(0)) as first, ForkServer(prefix=hosts.prefix(1)) as second:
            with hosts.inside(0):
                store = host_store(hosts.addr[0], 0, 2)
                with AgentJob(
                    ECHO,
                    2,
                    {"fail_ranks": [1], "timeout_s": 60, "report_env": ["MASTER_ADDR", "GLOO_SOCKET_IFNAME"]},
                    timeout_s=120,
                    max_replacements=1,
                    prefix=hosts.prefix,
                    master=(hosts.addr[0], int(store.port)),
                    forkserver=lambda r: (first, second)[r],
                    env=lambda r: {"GLOO_SOCKET_IFNAME": hosts.iface[r]},
                ) as job:
                    ran = job.run()
                arrived = store.add("echo/arrived", 0)
            assert os.readlink("/proc/thread-self/ns/net") == own  # the thread is back where it was
            servers = (first.pid, second.pid)
    assert all(r.ok for r in ran.results), [r.stderr_tail for r in ran.results]
    zero, one = (r.value for r in ran.results)
    assert zero["env"]["MASTER_ADDR"] == hosts.addr[0] and zero["env"]["GLOO_SOCKET_IFNAME"] == hosts.iface[0]
    assert one["env"]["GLOO_SOCKET_IFNAME"] == hosts.iface[1]
    assert zero["ppid"] == servers[0]  # forked on host 0 by host 0's server
    assert one["incarnation"] == 1 and one["ppid"] == os.getpid()  # the replacement: a fresh start
    assert arrived == 2 and ran.replacements == 1  # both ranks reached the store across the link


@pytest.mark.netns
@pytest.mark.skipif(_NO_NETNS is not None, reason=_NO_NETNS or "")
def test_one_server_outside_both_hosts_forks_each_rank_into_its_hosts_network_namespace(tmp_path):
    """The server runs in this machine's namespace and each rank's prefix is ``ip netns exec``: it
    forks rank r and moves it into host r's namespace, where rank 1 reaches the store on host 0's end
    of the link (which this machine's own namespace cannot reach)."""
    with TwoHosts(link=None) as hosts, ForkServer() as server:
        with hosts.inside(0):
            store = host_store(hosts.addr[0], 0, 2)
            with AgentJob(
                ECHO,
                2,
                {"timeout_s": 60},
                timeout_s=120,
                prefix=hosts.prefix,
                master=(hosts.addr[0], int(store.port)),
                forkserver=server,
                env=lambda r: {"GLOO_SOCKET_IFNAME": hosts.iface[r]},
            ) as job:
                ran = job.run()
            arrived = store.add("echo/arrived", 0)
        namespaces = [f"net:[{os.stat(f'/var/run/netns/{ns}').st_ino}]" for ns in hosts.ns]
    assert all(r.ok for r in ran.results), [r.stderr_tail for r in ran.results]
    got = [r.value for r in ran.results]
    assert [v["ppid"] for v in got] == [server.pid, server.pid]  # both forked, by the one server
    assert [v["netns"] for v in got] == namespaces and arrived == 2  # each on its own host, across the link


def test_a_rank_refusing_a_recovery_that_cannot_happen_says_one_line_and_gets_no_replacement(tmp_path):
    """A refusal is decided by the whole group: a new process would hold nothing and decide the same, so the
    agent leaves the rank gone however many replacements are left; the other rank is replaced as before."""
    why = "no peer copies are kept (peer copies: 0) and no checkpoint directory is set"
    replaced: list[int] = []
    with AgentJob(
        ECHO,
        3,
        {"refuse_ranks": [1], "refuse_why": why, "fail_ranks": [2]},
        timeout_s=120,
        max_replacements=3,
        forkserver=shared_forkserver(),
        on_replaced=lambda rank, rc, warm: replaced.append(rank),
    ) as job:
        ran = job.run()
    assert replaced == [2] and ran.replacements == 1  # the rank that exited 3 is replaced, the refusing one not
    assert ran.gone == {1: 1}
    refused = ran.results[1]
    assert refused.incarnation == 0
    lines = [ln for ln in refused.stderr_tail.splitlines() if ln.strip()]
    assert lines == [f"{REFUSAL_LINE}{why}"]  # the one line, no traceback
