"""The launcher starts real rank processes with torchrun's environment and stops them."""

from __future__ import annotations

import pytest

from meshpact.live.launcher import Launch, LaunchError, launch

pytestmark = [pytest.mark.live, pytest.mark.slow]


def test_each_rank_gets_torchrun_environment_and_its_result_is_collected():
    results = launch("meshpact.live.launcher:echo", 2, {"x": 7}, timeout_s=60)
    assert [r.value["rank"] for r in results] == [0, 1]
    assert all(r.value["world_size"] == 2 and r.value["args"] == {"x": 7} for r in results)
    assert results[0].value["pid"] != results[1].value["pid"]


def test_failed_rank_is_reported_with_its_exit_code():
    with pytest.raises(LaunchError, match="exited with 3"):
        launch("meshpact.live.launcher:echo", 1, {"exit_code": 3}, timeout_s=60)


def test_a_rank_that_crashes_natively_leaves_its_python_stack_in_the_error():
    """A native abort (glibc's answer to a corrupted heap) prints no Python traceback by itself:
    the launcher's fault handler puts the rank's stack in its stderr, which the error quotes."""
    with pytest.raises(LaunchError, match=r"(?s)exited with -6.*Fatal Python error: Aborted.*in echo"):
        launch("meshpact.live.launcher:echo", 1, {"abort": True}, timeout_s=60)


def test_bad_target_is_refused_before_any_process_starts():
    with pytest.raises(LaunchError, match="not 'package.module:function'"):
        Launch("no_colon_here", 2)


def test_a_killed_rank_can_be_replaced_and_the_deadline_kills_stragglers():
    replaced: list[int] = []

    def on_exit(job: Launch, rank: int, rc: int) -> None:
        replaced.append(rc)
        job.replace(rank)

    with Launch("meshpact.live.launcher:echo", 2, {"timeout_s": 60}, timeout_s=60) as job:
        job.kill(1)  # before it can arrive: the replacement must finish the rendezvous
        results = job.wait(on_exit=on_exit)
    assert replaced == [-9]
    assert all(r.ok for r in results) and results[1].incarnation == 1


def test_a_replacement_that_fails_leaves_its_own_stderr_to_name_why():
    """What a trial quotes when a replacement dies by itself (the rank then gets no process
    again): that process's stderr, not its predecessor's."""
    seen: dict[int, tuple[int, str]] = {}

    def on_exit(job: Launch, rank: int, rc: int) -> None:
        if job.incarnation(rank) == 0:
            assert job.replace(rank)
        else:
            seen[rank] = (rc, job.stderr_tail(rank))

    with Launch("meshpact.live.launcher:echo", 1, {"fail_ranks": [0], "raise_in_replacement": "the replacement broke",
                                                   "timeout_s": 60}, timeout_s=60) as job:
        results = job.wait(on_exit=on_exit)
    rc, tail = seen[0]
    assert rc == 1 and "RuntimeError: the replacement broke" in tail
    assert results[0].incarnation == 1 and not results[0].ok
