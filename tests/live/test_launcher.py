"""launch(): a worker function on N real rank processes with torchrun's environment, each rank's
result collected, a failed rank named with its stderr."""

from __future__ import annotations

import pytest

from meshpact.live.launch.launcher import LaunchError, launch

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_each_rank_gets_torchrun_environment_and_its_result_is_collected():
    results = launch("meshpact.live.launch.launcher:echo", 2, {"x": 7}, timeout_s=60)
    assert [r.value["rank"] for r in results] == [0, 1]
    assert all(r.value["world_size"] == 2 and r.value["args"] == {"x": 7} for r in results)
    assert results[0].value["pid"] != results[1].value["pid"]


def test_failed_rank_is_reported_with_its_exit_code():
    with pytest.raises(LaunchError, match="exited with 3"):
        launch("meshpact.live.launch.launcher:echo", 1, {"exit_code": 3}, timeout_s=60)


def test_a_rank_that_crashes_natively_leaves_its_python_stack_in_the_error():
    """A native abort (glibc's answer to a corrupted heap) prints no Python traceback by itself:
    the launcher's fault handler puts the rank's stack in its stderr, which the error quotes."""
    with pytest.raises(LaunchError, match=r"(?s)exited with -6.*Fatal Python error: Aborted.*in echo"):
        launch("meshpact.live.launch.launcher:echo", 1, {"abort": True}, timeout_s=60)


def test_bad_target_is_refused_before_any_process_starts():
    with pytest.raises(LaunchError, match="not 'package.module:function'"):
        launch("no_colon_here", 2)


def test_a_store_address_other_than_loopback_needs_its_port():
    with pytest.raises(LaunchError, match="master_addr 10.1.2.3: the job hosts its store on loopback"):
        launch("meshpact.live.launch.launcher:echo", 2, master_addr="10.1.2.3")
