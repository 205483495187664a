"""Warm starts: ranks forked from a server that imported torch once behave as fresh ones would.

What a stranger to the fork server would check: the children get the launcher's environment
(not the server's), their own session, distinct random draws, their exit codes and signals as
``subprocess`` reports them, and their traceback in the launcher's stderr tail; a replacement
and a rank with other thread settings start as fresh interpreters instead."""

from __future__ import annotations

import os
import signal

import pytest

from meshpact.live.launch.agentjob import AgentJob
from meshpact.live.launch.forkserver import ForkServer
from meshpact.live.launch.launcher import LaunchError, launch

pytestmark = pytest.mark.live

ECHO = "meshpact.live.launch.launcher:echo"


@pytest.fixture(scope="module")
def server():
    with ForkServer() as fs:
        yield fs


def test_forked_ranks_get_the_launchers_environment_their_own_session_and_draws(server, monkeypatch):
    monkeypatch.setenv(
        "MESHPACT_PROBE", "from-the-launcher"
    )  # set after the server started: only the request carries it
    results = launch(
        ECHO, 3, {"report_env": ["MESHPACT_PROBE", "RANK", "OMP_NUM_THREADS"]}, timeout_s=60, forkserver=server
    )
    values = [r.value for r in results]
    assert [v["rank"] for v in values] == [0, 1, 2]
    assert all(v["env"]["MESHPACT_PROBE"] == "from-the-launcher" for v in values)
    assert [v["env"]["RANK"] for v in values] == ["0", "1", "2"]
    assert all(v["ppid"] != os.getpid() for v in values)  # forked by the server, not started here
    assert len({v["ppid"] for v in values}) == 1
    assert all(v["sid"] == v["pid"] for v in values)  # each its own session: killpg reaches it alone
    assert len({v["draw"] for v in values}) == 3  # Python's generator seeded afresh in each
    assert all(v["threads"] == 1 for v in values)


def test_exit_codes_signals_and_tracebacks_come_back_as_from_a_fresh_process(server):
    with pytest.raises(LaunchError, match="exited with 3"):
        launch(ECHO, 1, {"exit_code": 3}, timeout_s=60, forkserver=server)
    with pytest.raises(LaunchError, match="(?s)exited with 1.*RuntimeError: a bug in the worker"):
        launch(ECHO, 1, {"raise": "a bug in the worker"}, timeout_s=60, forkserver=server)
    signalled: list[int] = []

    def signal_both() -> None:  # at the agent's first look with both ranks started
        if not signalled and len(job.pids) == 2:
            os.kill(job.pids[1], signal.SIGKILL)
            os.kill(job.pids[0], signal.SIGTERM)
            signalled.extend(job.pids.values())

    with AgentJob(ECHO, 2, {"sleep_s": 60}, timeout_s=60, forkserver=server, on_tick=signal_both) as job:
        ran = job.run()
    assert [r.returncode for r in ran.results] == [-signal.SIGTERM, -signal.SIGKILL]
    assert ran.gone == {0: -signal.SIGTERM, 1: -signal.SIGKILL} and not ran.timed_out
    assert [r.returncode for r in launch(ECHO, 1, {"timeout_s": 60}, timeout_s=60, forkserver=server)] == [0]


def test_a_replacement_and_other_thread_settings_start_fresh_interpreters(server):
    replaced: list[tuple[int, int]] = []
    with AgentJob(
        ECHO,
        2,
        {"fail_ranks": [1]},
        timeout_s=90,
        forkserver=server,
        max_replacements=1,
        on_replaced=lambda rank, rc, warm: replaced.append((rank, rc)),
    ) as job:
        results = job.run().results
    assert replaced == [(1, 3)]
    first, second = (r.value for r in results)
    assert first["ppid"] != os.getpid() and second["incarnation"] == 1
    assert second["ppid"] == os.getpid()  # the replacement: a real new process of the launcher
    two = launch(ECHO, 1, {}, timeout_s=90, forkserver=server, env=lambda r: {"OMP_NUM_THREADS": "2"})
    assert two[0].value["ppid"] == os.getpid() and two[0].value["threads"] == 2


def test_a_rank_whose_torch_settings_differ_from_the_servers_starts_fresh_and_sees_them(server):
    """inductor reads TORCHINDUCTOR_* when it is imported, which the server did: a child forked
    with another value would run with the server's, so that rank starts as a fresh interpreter
    and its inductor has the value it was given. A variable read when a group is made
    (TORCHELASTIC_*) leaves the rank forked."""
    asked = {"report_env": ["TORCHINDUCTOR_COMPILE_THREADS"], "report_inductor": "compile_threads"}
    other = launch(
        ECHO, 1, asked, timeout_s=90, forkserver=server, env=lambda r: {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    )
    assert other[0].value["ppid"] == os.getpid()
    assert other[0].value["inductor"] == 1
    assert "not forked: TORCHINDUCTOR_COMPILE_THREADS differ(s)" in other[0].stderr_tail  # said, not silent
    same = launch(ECHO, 1, asked, timeout_s=90, forkserver=server, env=lambda r: {"TORCHELASTIC_RUN_ID": "any"})
    assert same[0].value["ppid"] != os.getpid()


def test_a_launcher_that_compiled_something_still_forks_its_ranks(server, monkeypatch, tmp_path):
    """inductor writes its cache directory into the environment at the first compile
    (``cache_dir_utils.cache_dir``; it reads it again at each lookup): a launcher that compiled
    after its server started, as a test worker does, keeps forking its ranks. (Before this was
    known, every later trial of such a worker started its ranks as fresh interpreters.)"""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # what the first compile leaves
    forked = launch(ECHO, 1, {}, timeout_s=90, forkserver=server)
    assert forked[0].value["ppid"] != os.getpid() and "not forked" not in forked[0].stderr_tail


def test_a_forked_script_ends_as_a_fresh_one_its_threads_joined_and_its_exit_handlers_run(server, tmp_path):
    """A warm-started worker (``--warm-start``) runs the user's script in the forked child, which
    ends with ``os._exit``: the script's non-daemon thread, its idle thread pool and its exit
    handler still take effect, and its exit code comes back, as from ``python script.py``."""
    out = tmp_path / "effects"
    script = tmp_path / "script.py"
    script.write_text(
        "import atexit, concurrent.futures, sys, threading, time\n"
        f"out = {str(out)!r}\n"
        "atexit.register(lambda: open(out, 'a').write('atexit\\n'))\n"
        "def late():\n"
        "    time.sleep(0.3)\n"
        "    open(out, 'a').write('thread\\n')\n"
        "threading.Thread(target=late).start()\n"
        "concurrent.futures.ThreadPoolExecutor(2).submit(int, 1).result()\n"
        "print('buffered', end='')\n"
        "sys.exit(4)\n"
    )
    stdout = tmp_path / "stdout"
    child = server.spawn_python(["-u", str(script)], dict(os.environ), str(stdout), str(tmp_path / "stderr"))
    assert child.wait(60) == 4
    assert out.read_text().split() == ["thread", "atexit"] and stdout.read_text() == "buffered"


def test_replacements_are_forked_only_when_the_caller_asks(server):
    """warm_replacements: for callers that measure no replacement's start (the test suite)."""
    with AgentJob(
        ECHO, 2, {"fail_ranks": [1]}, timeout_s=90, forkserver=server, max_replacements=1, warm_replacements=True
    ) as job:
        results = job.run().results
    second = results[1].value
    assert second["incarnation"] == 1 and second["ppid"] != os.getpid()


def test_a_prefixed_rank_is_forked_only_by_a_server_started_under_its_prefix(server):
    """A rank run under a command prefix (``ip netns exec NS`` in a two-host trial; ``env`` here)
    starts fresh beside a plain server, and forked by one started under the same prefix."""
    fresh = launch(ECHO, 1, {}, timeout_s=90, forkserver=server, prefix=lambda r: ["env"])
    assert fresh[0].value["ppid"] == os.getpid()
    with ForkServer(prefix=["env"]) as under:
        mixed = launch(
            ECHO, 2, {}, timeout_s=90, forkserver=lambda r: under if r == 0 else server, prefix=lambda r: ["env"]
        )
    assert mixed[0].value["ppid"] != os.getpid()  # forked by the server under the same prefix
    assert mixed[1].value["ppid"] == os.getpid()  # the plain server does not take a prefixed rank


def test_a_server_that_cannot_start_says_why_at_the_first_rank():
    from meshpact.live.launch.forkserver import ForkServerError

    with ForkServer(preload=("meshpact_no_such_module",), start_timeout_s=60) as broken:
        with pytest.raises(ForkServerError, match="(?s)did not start.*No module named 'meshpact_no_such_module'"):
            broken.spawn(["--target", ECHO], dict(os.environ), os.devnull)


def test_a_server_kept_across_runs_forgets_an_exit_when_its_pid_comes_back(server):
    """One server serves many launches (the tests keep one per process); pids wrap (32768 here),
    so a child that gets the pid of one that exited before must not read as exited."""
    pid = 4_000_000  # beyond any pid this machine hands out: only these messages speak of it
    server._take(f'{{"exit": {pid}, "rc": 3}}'.encode())  # an earlier child with this pid exited
    assert server.returncode(pid) == 3
    server._take(f'{{"id": -1, "pid": {pid}}}'.encode())  # the server forked a new child with the same pid
    assert server.returncode(pid) is None
    server._take(f'{{"exit": {pid}, "rc": 0}}'.encode())  # and that child's own exit is kept
    assert server.returncode(pid) == 0
